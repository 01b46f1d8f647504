//! Checkpoints and adapters on disk: each written as a whole directory or not at all.

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

/// Write an adapter directory (complete or not at all).
pub fn save_adapter(
    dir: &Path,
    lora: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
    base: &crate::formats::peft::BaseModel,
) -> Result<()> {
    write_dir_atomic(dir, |tmp| {
        crate::formats::peft::write(tmp, lora, tensors, base)
    })
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

/// The settings that define a run, by flag name (without `--`), as a checkpoint records them
/// (see `train::settings`, which takes and checks them).
pub type Settings = BTreeMap<String, serde_json::Value>;

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
}

/// A checkpoint: adapter + AdamW moments + trainer state, in one directory written atomically.
pub fn save_checkpoint(
    dir: &Path,
    trainer: &Trainer,
    state: &TrainerState,
    base: &crate::formats::peft::BaseModel,
) -> Result<()> {
    let (lora, moments) = trainer.state_to_host()?;
    write_dir_atomic(dir, |tmp| {
        crate::formats::peft::write(tmp, &trainer.spec.lora, &lora, base)?;
        crate::formats::safetensors::write(
            &tmp.join("optimizer.safetensors"),
            &moments,
            &BTreeMap::new(),
        )?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("trainer_state.json"),
            serde_json::to_string_pretty(state)?.as_bytes(),
        )
    })
}

/// The latest complete `checkpoint-N` in run dir `out` (the highest N), if any.
pub fn latest_checkpoint(out: &Path) -> Option<PathBuf> {
    entries(out)
        .ok()?
        .into_iter()
        .filter_map(|n| {
            let k: u64 = n.strip_prefix("checkpoint-")?.parse().ok()?;
            out.join(&n)
                .join("trainer_state.json")
                .is_file()
                .then_some((k, n))
        })
        .max()
        .map(|(_, n)| out.join(n))
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

/// A checkpoint's `trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let state_path = dir.join("trainer_state.json");
    if !state_path.exists() {
        if let Some(why) = a_run_dir(dir) {
            bail!(why);
        }
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
    Ok(Checkpoint {
        lora: weights,
        moments,
        state,
    })
}
