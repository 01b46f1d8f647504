//! Checkpoints and adapters on disk: each written as a whole directory or not at all.
//!
//! A checkpoint counts (is *committed*) once `committed.json` is in it. A one-process run writes
//! it inside the directory before the directory's atomic rename, so the rename commits it. In a
//! run of several processes ([`Team`]) every process takes part (the state is gathered from all
//! of them), process 0 writes the directory with `processes.json` in it, every process passes a
//! barrier through the run's store, and only then does process 0 write `committed.json`: a
//! checkpoint of a run whose peer died before the barrier stays uncommitted, and `--resume`
//! refuses it, naming the newest committed one. A checkpoint with neither file (written before
//! markers existed, always by one process) counts by its rename, as it did then.

use crate::device::trainer::Trainer;
use crate::formats::atomic::write_dir_atomic;
use crate::formats::outdir::entries;
use crate::formats::safetensors::SafeTensors;
use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection};
use crate::train::schedule::Schedule;
use anyhow::{bail, Context, Result};
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Write an adapter directory (complete or not at all) of `spec`'s step: PEFT's files and
/// xtrain's record of the base it was trained on (`formats::adapter_base`: its quantization and
/// element type, which merge and export-gguf fold it into).
pub fn save_adapter(
    dir: &Path,
    spec: &crate::program::StepSpec,
    tensors: &BTreeMap<String, HostTensor>,
    base: &crate::formats::peft::BaseModel,
) -> Result<()> {
    write_dir_atomic(dir, |tmp| write_adapter(tmp, spec, tensors, base))
}

/// PEFT's adapter files and xtrain's record of the base, into `dir`.
fn write_adapter(
    dir: &Path,
    spec: &crate::program::StepSpec,
    tensors: &BTreeMap<String, HostTensor>,
    base: &crate::formats::peft::BaseModel,
) -> Result<()> {
    crate::formats::peft::write(dir, &spec.lora, tensors, base)?;
    crate::formats::adapter_base::write_record(
        dir,
        &crate::formats::adapter_base::Trained::of(spec),
    )
}

/// Where training stands, saved with each checkpoint.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub epoch: u64,
    /// Index into the epoch's row order of the next row to use.
    pub position: u64,
    pub seed: u64,
    pub schedule: Schedule,
    /// The settings that define the run, by flag ([`Settings`]); empty in the checkpoints of
    /// earlier versions.
    #[serde(default)]
    pub settings: Settings,
    /// A fingerprint of the training rows (sha256 of their tokens, labels and masks), so that a
    /// resumed run is refused on other data.
    #[serde(default)]
    pub data: Option<String>,
}

/// The settings that define a run, by flag name, as a checkpoint records them (see
/// `train::settings`, which takes and checks them).
pub use crate::cluster::rendezvous::Settings;

/// The command that continues a run from checkpoint `dir`: its every setting, paths included,
/// is recorded there (`settings::of_run`), so no other flag is needed.
pub fn resume_command(dir: &Path) -> String {
    format!("xtrain train --resume {}", crate::formats::shell::path(dir))
}

/// A checkpoint as loaded, or where a run starts: the LoRA weights, the AdamW moments (both by
/// per-layer names; none for a run that starts at step 0) and where training stands.
pub struct Checkpoint {
    pub lora: BTreeMap<String, HostTensor>,
    pub moments: BTreeMap<String, HostTensor>,
    pub state: TrainerState,
    /// A DPO run's reference adapter (`--reference start`): the adapter it started from, kept
    /// in each checkpoint's `reference/` so that a resumed run compares with the same one.
    pub reference: Option<BTreeMap<String, HostTensor>>,
}

/// Where a checkpoint keeps a DPO run's reference adapter.
pub const REFERENCE: &str = "reference";

/// The marker that makes a checkpoint count (see the module docs).
pub const COMMITTED: &str = "committed.json";
/// What a checkpoint of a run of several processes holds until it is committed: how many.
pub const PROCESSES: &str = "processes.json";

/// The processes a checkpoint is written by, in a run of several: each takes part, process 0
/// writes, and all meet at barriers (through the run's store).
pub trait Team {
    fn process(&self) -> usize;
    fn processes(&self) -> usize;
    /// Wait until every process reached barrier `name`; an error names who did not.
    fn barrier(&self, name: &str) -> Result<()>;
}

/// A checkpoint: adapter + AdamW moments + trainer state (+ a DPO run's `reference` adapter),
/// in one directory written atomically, and committed (module docs). With a `team` every
/// process calls this (the state is gathered from all of them); process 0 alone writes.
pub fn save_checkpoint(
    dir: &Path,
    trainer: &Trainer,
    state: &TrainerState,
    base: &crate::formats::peft::BaseModel,
    team: Option<&dyn Team>,
    reference: Option<&BTreeMap<String, HostTensor>>,
) -> Result<()> {
    // Every process hands over its shards; process 0 alone gets the state, and writes.
    let Some((lora, moments)) = trainer.state_on_host()? else {
        return commit_across(
            dir,
            state.step,
            team.context("one process holds its state")?,
            || bail!("only process 0 writes a checkpoint"),
        );
    };
    let write = |extra: &dyn Fn(&Path) -> Result<()>| {
        write_dir_atomic(dir, |tmp| {
            write_adapter(tmp, &trainer.spec, &lora, base)?;
            crate::formats::safetensors::write(
                &tmp.join("optimizer.safetensors"),
                &moments,
                &BTreeMap::new(),
            )?;
            crate::formats::atomic::write_bytes_atomic(
                &tmp.join("trainer_state.json"),
                serde_json::to_string_pretty(state)?.as_bytes(),
            )?;
            if let Some(r) = reference {
                write_adapter(&tmp.join(REFERENCE), &trainer.spec, r, base)?;
            }
            extra(tmp)
        })
    };
    let Some(team) = team else {
        // One process: the rename commits it.
        return write(&|tmp| commit(tmp, state.step, 1));
    };
    commit_across(dir, state.step, team, || {
        write(&|tmp| {
            let n = serde_json::json!({ "processes": team.processes() });
            crate::formats::atomic::write_bytes_atomic(
                &tmp.join(PROCESSES),
                n.to_string().as_bytes(),
            )
        })
    })
}

/// The commit of checkpoint `dir` (of `step`) by a team: process 0 writes it (`write`), every
/// process passes the checkpoint's barrier, then process 0 writes the marker.
pub fn commit_across(
    dir: &Path,
    step: u64,
    team: &dyn Team,
    write: impl FnOnce() -> Result<()>,
) -> Result<()> {
    if team.process() == 0 {
        write()?;
    }
    let name = format!("checkpoint-{step}");
    team.barrier(&name).with_context(|| {
        format!(
            "{} is not committed: not every process reached it",
            dir.display()
        )
    })?;
    if team.process() == 0 {
        commit(dir, step, team.processes())?;
    }
    Ok(())
}

/// Write the marker that makes checkpoint `dir` count.
fn commit(dir: &Path, step: u64, processes: usize) -> Result<()> {
    let marker = serde_json::json!({ "step": step, "processes": processes });
    crate::formats::atomic::write_bytes_atomic(&dir.join(COMMITTED), marker.to_string().as_bytes())
}

/// Whether checkpoint `dir` counts: its marker, or no sign of a run of several processes (one
/// written before markers existed).
pub fn is_committed(dir: &Path) -> bool {
    dir.join(COMMITTED).is_file() || !dir.join(PROCESSES).is_file()
}

/// The latest committed `checkpoint-N` in run dir `out` (the highest N), if any. A later one
/// that is not committed is skipped, and said.
pub fn latest_checkpoint(out: &Path) -> Option<PathBuf> {
    let mut complete: Vec<(u64, String)> = entries(out)
        .ok()?
        .into_iter()
        .filter_map(|n| {
            let k: u64 = n.strip_prefix("checkpoint-")?.parse().ok()?;
            out.join(&n)
                .join("trainer_state.json")
                .is_file()
                .then_some((k, n))
        })
        .collect();
    complete.sort();
    while let Some((_, n)) = complete.pop() {
        let dir = out.join(&n);
        if is_committed(&dir) {
            return Some(dir);
        }
        crate::esay!("xtrain: {} is not committed (a process of its run ended before every process reached it); skipped", dir.display());
    }
    None
}

/// Why `dir`, given as a checkpoint, is a run's output dir instead (it holds `checkpoint-N`
/// dirs, `metrics.jsonl` or `adapter/`): naming its latest checkpoint and the command that
/// continues from it, or saying it has none. None for anything else.
fn a_run_dir(dir: &Path) -> Option<String> {
    let names = entries(dir).ok()?;
    let of_run = |n: &String| {
        n == "metrics.jsonl"
            || n == "adapter"
            || n.strip_prefix("checkpoint-")
                .is_some_and(|k| k.parse::<u64>().is_ok())
    };
    if !names.iter().any(of_run) {
        return None;
    }
    Some(match latest_checkpoint(dir) {
        Some(c) => format!(
            "{} is a run's output dir, not a checkpoint; its latest checkpoint is {}: continue \
             from it with `{}`",
            dir.display(),
            c.display(),
            resume_command(&c)
        ),
        None => format!(
            "{} is a run's output dir, not a checkpoint, and it holds no checkpoint to continue \
             from (a run saves checkpoint-N dirs with --save-every, and when --stop-after, \
             Ctrl-C or a non-finite step stops it)",
            dir.display()
        ),
    })
}

/// A checkpoint's `trainer_state.json`; one that is not committed is refused, naming the
/// newest committed checkpoint beside it.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let state_path = dir.join("trainer_state.json");
    if !state_path.exists() {
        if let Some(why) = a_run_dir(dir) {
            bail!(why);
        }
    }
    if !is_committed(dir) {
        let newest = dir.parent().and_then(latest_checkpoint);
        bail!(
            "checkpoint {} is not committed: a process of its run (of several processes) ended \
             before every process reached it, so it may not match what the others held. {}",
            dir.display(),
            match newest {
                Some(c) => format!(
                    "The newest committed checkpoint is {}: continue from it with `{}`",
                    c.display(),
                    resume_command(&c)
                ),
                None => "No earlier checkpoint of the run is committed: start it again".into(),
            }
        );
    }
    serde_json::from_str(&std::fs::read_to_string(&state_path).with_context(|| {
        format!(
            "cannot read {} (is {} a checkpoint?)",
            state_path.display(),
            dir.display()
        )
    })?)
    .with_context(|| format!("{} is not a trainer state", state_path.display()))
}

pub fn load_checkpoint(dir: &Path, cfg: &LlamaConfig, lora: &LoraConfig) -> Result<Checkpoint> {
    let state = read_state(dir)?;
    let c = crate::formats::peft::read_config(dir)?;
    if c.r != lora.r || c.targets != lora.targets {
        bail!(
            "checkpoint {} has LoRA r={} on {}; this run uses r={} on {}",
            dir.display(),
            c.r,
            Projection::list(&c.targets),
            lora.r,
            Projection::list(&lora.targets)
        );
    }
    let weights = crate::formats::peft::read_tensors(dir, cfg, lora)?;
    let opt = SafeTensors::open(&dir.join("optimizer.safetensors"))?;
    let mut moments = BTreeMap::new();
    for name in opt.tensors.keys() {
        moments.insert(name.clone(), opt.read(name)?);
    }
    let reference = match dir.join(REFERENCE).is_dir() {
        true => Some(crate::formats::peft::read_tensors(
            &dir.join(REFERENCE),
            cfg,
            lora,
        )?),
        false => None,
    };
    Ok(Checkpoint {
        lora: weights,
        moments,
        state,
        reference,
    })
}
