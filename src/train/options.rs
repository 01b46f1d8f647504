//! What `xtrain train` is asked to do, and the range of every value it takes. [`TrainOptions`]
//! are typed values, the step's among them (a `program::StepOptions`: why the step's settings
//! take three forms is said in `program/spec/`); `train::settings` is the same run by flag
//! name, the form a checkpoint records and a program dir fixes, applied back onto these
//! options.

use crate::data::DataOptions;
use crate::program::StepOptions;
use anyhow::{bail, Result};
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Options of `xtrain train`.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub model: PathBuf,
    /// The data, how it is made into rows and batches, and what is held out for evaluation.
    pub data: DataOptions,
    /// The step: LoRA, AdamW, numerics, remat, accumulation, mesh.
    pub step: StepOptions,
    pub init_adapter: Option<PathBuf>,
    /// Optimizer steps; 0 = as many as `epochs` take.
    pub steps: u64,
    pub epochs: u64,
    pub lr: f64,
    pub warmup: u64,
    pub schedule: String,
    pub min_lr_ratio: f64,
    /// A program dir from `xtrain compile` to run instead of building the step.
    pub program: Option<PathBuf>,
    pub use_cache: bool,
    pub eval_every: u64,
    pub save_every: u64,
    pub resume: Option<PathBuf>,
    pub out: PathBuf,
    /// Replace what `out` holds (a previous run, or anything else) once this run is complete.
    pub overwrite: bool,
    pub seed: u64,
    pub plugin: Option<String>,
    /// Kernels put in place of the program's composites when it is compiled (`--kernel`,
    /// `device::kernels`): the program stays the same, its compiler sees the kernels.
    pub kernels: Vec<String>,
    pub verbose: bool,
    pub log_every: u64,
    pub plot: bool,
    /// One device's peak TFLOP/s, to log the model FLOPs utilization (`train/mfu`).
    pub peak_tflops: Option<f64>,
    /// Stop this invocation after this many steps.
    pub stop_after: Option<u64>,
    /// On a non-finite loss or gradient: stop (false) or skip the step and go on (true).
    pub skip_nonfinite: bool,
    /// The flags given on the command line (`lora-alpha`, `steps`, ...), as opposed to left at
    /// their defaults: a flag left at its default takes the value a checkpoint (`--resume`) or a
    /// program dir (`--program`) records; one given must agree with it.
    pub explicit: BTreeSet<String>,
    /// The `--config` recipe, and the flags of [`TrainOptions::explicit`] whose value is its
    /// (not overridden on the command line).
    pub recipe: Option<(PathBuf, BTreeSet<String>)>,
    /// `--sharding-rules`, as given (the rules themselves are in `step.mesh`).
    pub sharding_rules: Option<PathBuf>,
    /// The flags left out whose value was taken from a checkpoint or a program dir, each with
    /// where from ("checkpoint DIR's run has"), for messages (`train::settings` fills it).
    pub taken_from: std::collections::BTreeMap<String, String>,
    /// `--num-processes`, `--process-id`, `--coordinator`, `--init-timeout` as given (the
    /// launcher's environment fills in the rest: `cluster::launch`).
    pub launch: crate::cluster::launch::LaunchFlags,
}

impl TrainOptions {
    /// Whether `--flag` was given on the command line.
    pub fn given(&self, flag: &str) -> bool {
        self.explicit.contains(flag)
    }

    /// Where the value of `--flag` came from, for messages: "the recipe FILE" or "the command
    /// line".
    pub fn given_by(&self, flag: &str) -> String {
        match &self.recipe {
            Some((file, flags)) if flags.contains(flag) => {
                format!("the recipe {}", file.display())
            }
            _ => "the command line".to_string(),
        }
    }

    /// Where the value of `--flag` in force came from, said before it: "the command line
    /// gives", "the recipe FILE gives", "checkpoint DIR's run has".
    pub fn source_of(&self, flag: &str) -> String {
        match self.taken_from.get(flag) {
            Some(source) => source.clone(),
            None => format!("{} gives", self.given_by(flag)),
        }
    }

    /// An error of the step's spec with the source of the value it refuses named (a recipe's or
    /// a checkpoint's `--attention-block` is not the command line's), where it can say one.
    pub fn name_the_source(&self, e: anyhow::Error) -> anyhow::Error {
        match e.downcast_ref::<crate::program::AttentionBlockUnused>() {
            Some(unused) => unused.from_source(&self.source_of("attention-block")),
            None => e,
        }
    }

    /// What the run reads besides a checkpoint it resumes (which lies in its `--out`): the
    /// model, the data, the evaluation data, the initial adapter, the program dir, the sharding
    /// rules and the recipe. `--out` may not hold any of them.
    pub fn inputs(&self) -> Vec<&std::path::Path> {
        [
            Some(self.model.as_path()),
            Some(self.data.path.as_path()),
            self.data.eval_data.as_deref(),
            self.init_adapter.as_deref(),
            self.program.as_deref(),
            self.sharding_rules.as_deref(),
            self.recipe.as_ref().map(|(p, _)| p.as_path()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Refuse values no run can use, before any work: every message names its flag.
    pub fn validate(&self) -> Result<()> {
        self.validate_values()?;
        self.validate_shapes()?;
        self.validate_combinations()
    }

    /// `--steps` and `--epochs` given together. From one place (both typed, or both in the
    /// recipe): refused, since `--steps` sets the length and `--epochs` would do nothing. One
    /// typed over the recipe's other: the typed one sets the length (said in `notes`).
    pub fn settle_length(&mut self, notes: &mut Vec<String>) -> Result<()> {
        if !(self.given("steps") && self.given("epochs") && self.steps > 0) {
            return Ok(());
        }
        let (steps_by, epochs_by) = (self.given_by("steps"), self.given_by("epochs"));
        if steps_by == epochs_by {
            bail!(
                "--steps {} and --epochs {} were both given ({steps_by}): --steps sets the run's length, so --epochs would do nothing; give one of them",
                self.steps,
                self.epochs
            );
        }
        if epochs_by == "the command line" {
            notes.push(format!(
                "--epochs {} (the command line) sets the run's length instead of --steps {} ({steps_by})",
                self.epochs, self.steps
            ));
            self.steps = 0;
            self.explicit.remove("steps");
        } else {
            notes.push(format!(
                "--steps {} (the command line) sets the run's length instead of --epochs {} ({epochs_by})",
                self.steps, self.epochs
            ));
            self.epochs = 1;
            self.explicit.remove("epochs");
        }
        Ok(())
    }

    /// Flags that would do nothing in the company they are given in: refused, naming where
    /// each came from.
    fn validate_combinations(&self) -> Result<()> {
        // A kernel that does not run on the plugin named is refused before what it would ask
        // of the data.
        let platform = crate::device::platform::named_platform(self.plugin.as_deref());
        if platform != "unknown" {
            crate::device::kernels::chosen(&self.kernels, platform)?;
        }
        let one_document = self
            .kernels
            .iter()
            .find(|k| crate::device::kernels::needs_one_document_rows(k));
        let packed = self.data.pack && !self.data.is_batch_file() && self.step.dpo().is_none();
        if let Some(k) = one_document.filter(|_| packed) {
            bail!(
                "--kernel {k} attends with cuDNN's causal mask, which does not keep packed \
                 documents apart: add --no-pack (one example per row), or leave --kernel {k} out"
            );
        }
        if self.eval_every > 0 && self.data.eval_data.is_none() && self.data.eval_fraction == 0.0 {
            bail!(
                "--eval-every {} ({}) evaluates on held-out examples, but there are none: give --eval-data FILE or --eval-fraction F, or leave --eval-every out",
                self.eval_every,
                self.given_by("eval-every")
            );
        }
        if self.data.is_batch_file() {
            // Evaluation examples are tokenized with these (all but --no-pack: they are never
            // packed); a pre-tokenized batch is used as it is.
            let text_flags: &[&str] = if self.data.eval_data.is_some() {
                &["no-pack"]
            } else {
                &[
                    "no-pack",
                    "train-on-prompt",
                    "skip-bad-lines",
                    "strict-length",
                    "text-column",
                    "messages-column",
                ]
            };
            if let Some(flag) = text_flags.iter().find(|f| self.given(f)) {
                bail!(
                    "--{flag} ({}) shapes JSONL or Parquet examples into rows, but --data {} is one \
                     pre-tokenized batch, used as it is; leave --{flag} out",
                    self.given_by(flag),
                    self.data.path.display()
                );
            }
        }
        self.validate_preference()?;
        if self.given("min-lr-ratio") && self.schedule == "constant" {
            let schedule_by = if self.given("schedule") {
                self.given_by("schedule")
            } else {
                "the default".to_string()
            };
            bail!(
                "--min-lr-ratio {} ({}) sets where a linear or cosine schedule ends, but --schedule is constant ({schedule_by}); give --schedule linear or cosine, or leave --min-lr-ratio out",
                self.min_lr_ratio,
                self.given_by("min-lr-ratio")
            );
        }
        Ok(())
    }

    /// The flags `--method dpo` takes or refuses: `--reference start` needs the adapter it
    /// names; the flags that shape supervised examples would do nothing.
    fn validate_preference(&self) -> Result<()> {
        let Some(p) = self.step.dpo() else {
            return Ok(());
        };
        if self.data.is_batch_file() {
            bail!(
                "--method dpo trains on preference pairs (JSONL or Parquet rows {{\"prompt\", \
                 \"chosen\", \"rejected\"}}), but --data {} is one pre-tokenized batch",
                self.data.path.display()
            );
        }
        if p.reference == crate::program::Reference::Start
            && self.init_adapter.is_none()
            && self.resume.is_none()
        {
            let fix = match self.taken_from.get("reference") {
                Some(from) => format!("({from} it)"),
                None => "or --reference base to compare with the model without an adapter".into(),
            };
            bail!(
                "--reference start compares the policy with the adapter the run starts from, but \
                 no --init-adapter was given: give --init-adapter DIR (e.g. an SFT run's \
                 adapter) {fix}"
            );
        }
        for flag in ["train-on-prompt", "text-column", "messages-column"] {
            if self.given(flag) {
                bail!(
                    "--{flag} ({}) shapes supervised examples; --method dpo trains on pairs \
                     {{\"prompt\", \"chosen\", \"rejected\"}} whose loss is on the \
                     completions only: leave --{flag} out",
                    self.given_by(flag)
                );
            }
        }
        Ok(())
    }

    /// The checks of [`TrainOptions::validate`] that do not depend on the batch shape, which a
    /// program dir or a checkpoint may still change.
    pub fn validate_values(&self) -> Result<()> {
        if !["constant", "linear", "cosine"].contains(&self.schedule.as_str()) {
            bail!(
                "--schedule must be constant, linear or cosine, got `{}`",
                self.schedule
            );
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            bail!("--lr must be a number >= 0, got {}", self.lr);
        }
        if (self.lr as f32).is_infinite() {
            bail!(
                "--lr {} is beyond f32's range (the step takes it as f32)",
                self.lr
            );
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            bail!(
                "--min-lr-ratio must be in [0, 1], got {}",
                self.min_lr_ratio
            );
        }
        if self.epochs < 1 {
            bail!("--epochs must be at least 1, got {}", self.epochs);
        }
        if self.stop_after == Some(0) {
            bail!("--stop-after must be at least 1 step");
        }
        if self.overwrite && self.resume.is_some() {
            bail!("--overwrite starts a new run and --resume continues one; give one of them");
        }
        if self.init_adapter.is_some() && self.resume.is_some() {
            bail!("--init-adapter and --resume were both given: a resumed run continues from its checkpoint's adapter");
        }
        self.data.validate()
    }

    /// The step flags that must fit the batch shape (for JSONL data; a `.safetensors` batch's
    /// shape is checked once it is read).
    fn validate_shapes(&self) -> Result<()> {
        // The step's own checks (StepSpec) run once the batch shape is known; these need only
        // the flags, so a bad one is refused before the data is read.
        let seq = (!self.data.is_batch_file()).then_some(self.data.seq);
        let batch = (!self.data.is_batch_file()).then_some(self.data.batch_size);
        let m = self.step.grad_accum;
        if m < 1 {
            bail!("--grad-accum must be at least 1, got {m}");
        }
        if batch.is_some_and(|b| b % m != 0) {
            bail!(
                "--grad-accum {m} must divide the batch size {}",
                batch.map_or("(--batch-size)".to_string(), |b| b.to_string())
            );
        }
        for (flag, v) in [
            ("--loss-chunk", self.step.loss_chunk),
            ("--attention-block", self.step.attention_block),
        ] {
            if let Some(c) = v {
                if c < 1 || seq.is_some_and(|t| t % c != 0) {
                    bail!(
                        "{flag} {c} must be a positive divisor of the sequence length {}",
                        seq.map_or("(--seq)".to_string(), |t| t.to_string())
                    );
                }
            }
        }
        Ok(())
    }
}
