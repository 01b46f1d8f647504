//! Where a run starts: a checkpoint (`--resume`; its data and schedule checked against this
//! run's), or step 0 with the adapter of `--init-adapter` (which must be the one the flags
//! describe) or a fresh one. A stage of [`super::run`], apart so that the recipe reads whole.

use crate::data::{Source, TrainingData};
use crate::formats::peft::init_lora;
use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection};
use crate::train::checkpoint::{load_checkpoint, Checkpoint, TrainerState};
use crate::train::options::TrainOptions;
use crate::train::schedule::Schedule;
use crate::train::settings;
use anyhow::{bail, Result};
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::Path;

/// Where training starts: a checkpoint (`--resume`, whose settings [`settings::settle`] already
/// took or checked; here its data and schedule are checked against this run's), or step 0 with
/// the adapter of `--init-adapter` (which must be the one the flags describe) or a fresh one.
pub(super) fn starting_point(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    lora_cfg: &LoraConfig,
    schedule: &Schedule,
    data: &TrainingData,
) -> Result<Checkpoint> {
    let fingerprint = data.source.fingerprint();
    let mut settings = settings::of_run(opts);
    settings.insert("batch-size".into(), data.batch.into());
    settings.insert("seq".into(), data.seq.into());
    if opts.data.is_batch_file() {
        for (flag, have) in [("batch-size", data.batch), ("seq", data.seq)] {
            let want = if flag == "seq" {
                opts.data.seq
            } else {
                opts.data.batch_size
            };
            if opts.given(flag) && want != have {
                bail!(
                    "--{flag} {want}, but {} is one pre-tokenized batch of {}x{} (leave --batch-size and --seq out with .safetensors data)",
                    opts.data.path.display(),
                    data.batch,
                    data.seq
                );
            }
        }
    }
    let starts_from_itself = opts
        .step
        .dpo()
        .is_some_and(|p| p.reference == crate::program::Reference::Start);
    let (lora, moments, mut state, reference) = match &opts.resume {
        Some(dir) => {
            let c = load_checkpoint(dir, cfg, lora_cfg)?;
            if starts_from_itself && c.reference.is_none() {
                bail!(
                    "checkpoint {} holds no reference adapter ({}/), which its run's --reference \
                     start compares with; it was not written by a DPO run that had one",
                    dir.display(),
                    crate::train::checkpoint::REFERENCE
                );
            }
            check_resumed_data(dir, &c.state, schedule, data, &fingerprint)?;
            if c.state.step >= schedule.total {
                crate::esay!(
                    "xtrain: nothing to do: {} is at step {} of {} (the run is complete; its \
                     adapter is written again from it; raise --steps to train further)",
                    dir.display(),
                    c.state.step,
                    schedule.total
                );
            }
            let reference = c.reference.filter(|_| starts_from_itself);
            (c.lora, c.moments, c.state, reference)
        }
        None => {
            let w = match &opts.init_adapter {
                Some(dir) => {
                    // With --program the LoRA settings are the program dir's (a flag given must
                    // agree with them): the refusal names it as their source.
                    let asked_by = match &opts.program {
                        Some(p) => format!("program dir {} was built for", p.display()),
                        None => "the flags ask for".to_string(),
                    };
                    initial_adapter(dir, cfg, lora_cfg, &asked_by)?
                }
                None => init_lora(cfg, lora_cfg, opts.seed),
            };
            let reference = starts_from_itself.then(|| w.clone());
            (
                w,
                BTreeMap::new(),
                TrainerState {
                    step: 0,
                    epoch: 0,
                    position: 0,
                    seed: opts.seed,
                    schedule: schedule.clone(),
                    settings: Default::default(),
                    data: None,
                },
                reference,
            )
        }
    };
    state.schedule = schedule.clone();
    state.settings = settings;
    state.data = Some(fingerprint);
    Ok(Checkpoint {
        lora,
        moments,
        state,
        reference,
    })
}

/// A resumed run must see the data its checkpoint's run saw (same rows, same batch shape) and
/// follow the same schedule (a constant one may be extended), and have steps left to take.
fn check_resumed_data(
    dir: &Path,
    st: &TrainerState,
    schedule: &Schedule,
    data: &TrainingData,
    fingerprint: &str,
) -> Result<()> {
    let recorded = |k: &str| st.settings.get(k).and_then(|v| v.as_i64());
    if let (Some(b), Some(t)) = (recorded("batch-size"), recorded("seq")) {
        if (b, t) != (data.batch, data.seq) {
            bail!(
                "checkpoint {}'s run took batches of {b}x{t}, but the data gives {}x{}",
                dir.display(),
                data.batch,
                data.seq
            );
        }
    }
    if st.data.as_deref().is_some_and(|d| d != fingerprint) {
        bail!(
            "checkpoint {} was trained on other data than {} (its rows differ); resume on the same data, or start a new run from its adapter with --init-adapter {}",
            dir.display(),
            data_name(data),
            crate::formats::shell::path(dir)
        );
    }
    let mut same = st.schedule.clone();
    if same.kind == "constant" {
        same.total = schedule.total;
    }
    if &same != schedule {
        bail!(
            "checkpoint {}'s run has the schedule {} but this run's would be {} (did the data change?)",
            dir.display(),
            schedule_text(&st.schedule),
            schedule_text(schedule)
        );
    }
    if st.step > schedule.total {
        bail!(
            "checkpoint {} is at step {}, past this run's last step {}",
            dir.display(),
            st.step,
            schedule.total
        );
    }
    Ok(())
}

fn data_name(data: &TrainingData) -> &'static str {
    match data.source {
        Source::Fixed(_) => "this batch",
        Source::Rows { .. } => "this data",
    }
}

fn schedule_text(s: &Schedule) -> String {
    format!(
        "{} from lr {} over {} steps (warmup {}, min ratio {})",
        s.kind, s.lr, s.total, s.warmup, s.min_ratio
    )
}

/// The tensors of `--init-adapter`, refused unless its rank, alpha and targets are the run's
/// (`asked_by` says whose: "the flags ask for", "program dir DIR was built for").
fn initial_adapter(
    dir: &Path,
    cfg: &LlamaConfig,
    lora_cfg: &LoraConfig,
    asked_by: &str,
) -> Result<BTreeMap<String, HostTensor>> {
    let c = crate::formats::peft::read_config(dir)?;
    if c.r != lora_cfg.r || c.targets != lora_cfg.targets || (c.alpha - lora_cfg.alpha).abs() > 1e-9
    {
        bail!(
            "--init-adapter {} has r={}, alpha={}, targets {}, but {asked_by} r={}, alpha={}, targets {}",
            dir.display(),
            c.r,
            c.alpha,
            Projection::list(&c.targets),
            lora_cfg.r,
            lora_cfg.alpha,
            Projection::list(&lora_cfg.targets)
        );
    }
    crate::formats::peft::read_tensors(dir, cfg, lora_cfg)
}
