//! `xtrain import-gguf` and `xtrain merge`: model directories written from other forms, each
//! into a new or empty `--out` (or, with `--overwrite`, replacing it once complete).

use anyhow::Result;
use std::path::Path;
use xtrain::formats::atomic::Replace;
use xtrain::formats::outdir::check_writable_dir;

pub fn import_gguf(file: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let out = check_writable_dir(out, overwrite, &[file])?;
    crate::cli::signals::end_at_once(crate::cli::signals::OnSignal {
        said: format!(
            "{} is written whole or not at all: nothing was written there",
            out.display()
        ),
        out: Some(out.clone()),
        temp_prefixes: &[],
    })?;
    let t0 = std::time::Instant::now();
    let mut shown = 0;
    xtrain::formats::gguf::import::import(file, &out, Replace::when(overwrite), |done, total| {
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 || done == total {
            shown = pct;
            xtrain::esay!("importing {}: {pct}% of {total} tensors", file.display());
        }
    })?;
    let g = xtrain::formats::gguf::read::Gguf::open(file)?;
    let (_, (family, why)) = xtrain::formats::gguf::import::arch_and_family(&g)?;
    xtrain::say!(
        "wrote {} in {:.1}s: a {} model{}",
        out.display(),
        t0.elapsed().as_secs_f64(),
        family.model_type(),
        why.map(|w| format!(" ({w})")).unwrap_or_default(),
    );
    Ok(())
}

pub fn merge(model: &Path, adapter: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let out = check_writable_dir(out, overwrite, &[model, adapter])?;
    // Said once the adapter is read and checked (a refusal comes first).
    let nf4 = || {
        xtrain::formats::adapter_base::warn_if_another_base(adapter, model, "merge");
        trained_on_nf4(adapter, "merge")
    };
    xtrain::formats::merge::merge(model, adapter, &out, Replace::when(overwrite), &nf4)?;
    xtrain::say!("wrote {}", out.display());
    Ok(())
}

/// Whether `adapter` records that it was trained with `--quant nf4` (then `command` folds it
/// into the NF4-dequantized base, and says so); where it records nothing, `command` says that
/// it uses the stored weights. A damaged record is an error naming it.
pub fn trained_on_nf4(adapter: &Path, command: &str) -> Result<bool> {
    xtrain::formats::adapter_base::read_record(adapter)?;
    match xtrain::formats::gguf::export::recorded_quant(adapter) {
        Some((q, record)) if q == "nf4" => {
            xtrain::esay!(
                "xtrain: {command}: folding the adapter into the NF4-dequantized base it was \
                 trained on ({} records --quant nf4)",
                record.display()
            );
            Ok(true)
        }
        Some(_) => Ok(false),
        None => {
            xtrain::esay!(
                "xtrain: {command}: {} has no record of the base it was trained on (an adapter \
                 from elsewhere, or from an xtrain before 2026-12-07): using the stored \
                 weights, which is right unless it was trained with --quant nf4",
                adapter.display()
            );
            Ok(false)
        }
    }
}
