//! Program directories (`train_step.mlir` + `manifest.json`), model presets, and the on-disk
//! cache of compiled executables.

use crate::program::{Program, StepSpec, TensorSpec};
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::Path;

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `manifest.json`: everything a runner needs to feed the program, and what it was built for.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub xtrain_version: String,
    /// sha256 of train_step.mlir.
    pub program_sha256: String,
    pub spec: StepSpec,
    pub args: Vec<TensorSpecOwned>,
    pub results: Vec<TensorSpecOwned>,
}

/// [`TensorSpec`] in a form that round-trips through JSON.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct TensorSpecOwned {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
    pub role: crate::program::Role,
    pub bytes: i64,
}

impl From<&TensorSpec> for TensorSpecOwned {
    fn from(t: &TensorSpec) -> Self {
        TensorSpecOwned {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype.mlir().to_string(),
            role: t.role,
            bytes: t.shape.iter().product::<i64>() * t.dtype.size_bytes() as i64,
        }
    }
}

impl TensorSpecOwned {
    fn to_spec(&self) -> Result<TensorSpec> {
        Ok(TensorSpec {
            name: self.name.clone(),
            shape: self.shape.clone(),
            dtype: hlo::DType::parse(&self.dtype)
                .with_context(|| format!("unknown dtype {}", self.dtype))?,
            role: self.role,
        })
    }
}

pub const MANIFEST_FORMAT: &str = "xtrain-program/1";

/// Write a program directory atomically per file.
pub fn write_dir(dir: &Path, program: &Program, spec: &StepSpec) -> Result<Manifest> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        xtrain_version: env!("CARGO_PKG_VERSION").into(),
        program_sha256: sha256_hex(program.text.as_bytes()),
        spec: spec.clone(),
        args: program.args.iter().map(Into::into).collect(),
        results: program.results.iter().map(Into::into).collect(),
    };
    crate::formats::atomic::write_bytes_atomic(
        &dir.join("train_step.mlir"),
        program.text.as_bytes(),
    )?;
    crate::formats::atomic::write_bytes_atomic(
        &dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest)?.as_bytes(),
    )?;
    Ok(manifest)
}

/// Read a program directory, checking the program text against the manifest's hash.
pub fn read_dir(dir: &Path) -> Result<(Program, StepSpec)> {
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).with_context(|| {
        format!(
            "cannot read {} (is {} a program dir from `xtrain compile`?)",
            mpath.display(),
            dir.display()
        )
    })?;
    let m: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("{} is not an xtrain manifest", mpath.display()))?;
    if m.format != MANIFEST_FORMAT {
        bail!(
            "{}: format {} is not {MANIFEST_FORMAT}",
            mpath.display(),
            m.format
        );
    }
    let ppath = dir.join("train_step.mlir");
    let program = std::fs::read_to_string(&ppath)
        .with_context(|| format!("cannot read {}", ppath.display()))?;
    let hash = sha256_hex(program.as_bytes());
    if hash != m.program_sha256 {
        bail!(
            "{} does not match its manifest (sha256 {hash}, manifest says {})",
            ppath.display(),
            m.program_sha256
        );
    }
    let args = m.args.iter().map(|a| a.to_spec()).collect::<Result<_>>()?;
    let results = m
        .results
        .iter()
        .map(|a| a.to_spec())
        .collect::<Result<_>>()?;
    Ok((Program::new(program, args, results, &m.spec), m.spec))
}
