//! The training loop: compile the step once, upload the frozen weights once, then feed batches,
//! log metrics and write PEFT adapters.

pub mod bench;
pub mod plot;

use crate::device::runtime::Runtime;
use crate::formats::atomic::write_dir_atomic;
use crate::formats::host::{convert, element_type};
use crate::formats::peft::init_lora;
use crate::formats::safetensors::SafeTensors;
use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
use crate::program::{self, Program, Role, StepSpec};
use anyhow::{bail, Context, Result};
use pjrt::{Buffer, CompileOptions, ElementType, Executable, HostTensor};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One batch: input_ids, labels, attention_mask, each s32 [B, T].
#[derive(Clone, Debug)]
pub struct Batch {
    pub input_ids: HostTensor,
    pub labels: HostTensor,
    pub attention_mask: HostTensor,
}

impl Batch {
    pub fn dims(&self) -> (i64, i64) {
        (self.input_ids.dims[0], self.input_ids.dims[1])
    }

    /// Tokens that carry a loss (labels != -100, excluding the first position).
    pub fn target_tokens(&self) -> i64 {
        let labels = self.labels.to_i32().unwrap_or_default();
        let t = self.dims().1 as usize;
        labels
            .iter()
            .enumerate()
            .filter(|(i, &l)| i % t != 0 && l != -100)
            .count() as i64
    }

    /// Read a pre-tokenized batch (`input_ids`, `labels`, optional `attention_mask`) from a
    /// safetensors file; integer types are converted to s32.
    pub fn from_safetensors(path: &Path) -> Result<Batch> {
        let st = SafeTensors::open(path)?;
        let get = |name: &str| -> Result<HostTensor> {
            let t = st.read(name)?;
            if t.dims.len() != 2 {
                bail!(
                    "{}: `{name}` must be [batch, seq], found {:?}",
                    path.display(),
                    t.dims
                );
            }
            convert(&t, ElementType::S32).with_context(|| format!("{}: `{name}`", path.display()))
        };
        let input_ids = get("input_ids")?;
        let labels = if st.tensors.contains_key("labels") {
            get("labels")?
        } else {
            input_ids.clone()
        };
        let attention_mask = if st.tensors.contains_key("attention_mask") {
            get("attention_mask")?
        } else {
            HostTensor::from_i32(&vec![1; input_ids.element_count()], &input_ids.dims)
        };
        for (name, t) in [("labels", &labels), ("attention_mask", &attention_mask)] {
            if t.dims != input_ids.dims {
                bail!(
                    "{}: `{name}` is {:?} but `input_ids` is {:?}",
                    path.display(),
                    t.dims,
                    input_ids.dims
                );
            }
        }
        Ok(Batch {
            input_ids,
            labels,
            attention_mask,
        })
    }

    /// Check token ids against the vocabulary.
    pub fn check_vocab(&self, vocab: i64) -> Result<()> {
        let ids = self.input_ids.to_i32()?;
        if let Some((i, &bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as i64 >= vocab)
        {
            let t = self.dims().1 as usize;
            bail!("token id {bad} at batch row {}, position {} is outside the vocabulary (0..{vocab})", i / t, i % t);
        }
        Ok(())
    }
}

/// A compiled training step with its state on the device.
pub struct Trainer {
    pub rt: Runtime,
    pub program: Program,
    exe: Executable,
    /// Per argument, one buffer per device (its shard).
    frozen: Vec<Vec<Buffer>>,
    /// LoRA params, then m, then v, in program order (the donated part); per device.
    state: Vec<Vec<Buffer>>,
    /// Number of optimizer steps taken.
    pub step: u64,
    pub spec: StepSpec,
    /// Threefry key for LoRA dropout, advanced every step.
    pub dropout_seed: u64,
    /// The evaluation program, compiled on first use, with its results' shardings.
    eval_exe: Option<(Executable, Vec<hlo::Sharding>)>,
    /// Seconds spent compiling the step (or loading it from the cache).
    pub compile_s: f64,
}

/// Loss and exact-match accuracy on held-out rows.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct EvalResult {
    pub loss: f64,
    pub accuracy: f64,
    pub rows: usize,
}

impl Trainer {
    /// Compile `program` (through the executable cache), upload the frozen weights (in the
    /// program's layout, see [`crate::formats::weights::load`]) and the initial LoRA weights and AdamW
    /// moments (per-layer PEFT names; missing moments start at zero).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rt: Runtime,
        spec: StepSpec,
        program: Program,
        weights: Vec<HostTensor>,
        lora: &BTreeMap<String, HostTensor>,
        moments: &BTreeMap<String, HostTensor>,
        use_cache: bool,
        verbose: bool,
    ) -> Result<Trainer> {
        let t0 = Instant::now();
        let (exe, cached) = crate::formats::program_dir::compile_cached(
            &rt,
            &program,
            &CompileOptions::default(),
            use_cache,
        )?;
        let compile_s = t0.elapsed().as_secs_f64();
        if verbose {
            let how = if cached {
                "loaded the compiled step from the cache"
            } else {
                "compiled the step"
            };
            eprintln!(
                "xtrain: {how} in {compile_s:.2}s ({} bytes of StableHLO)",
                program.text.len()
            );
        }
        let mesh = spec.mesh.as_ref().map(|m| m.mesh());
        let shardings = program.arg_shardings(&spec);
        let mut frozen = Vec::new();
        let mut w = weights.into_iter();
        for (a, sh) in program
            .args
            .iter()
            .zip(&shardings)
            .filter(|(a, _)| a.role == Role::Frozen)
        {
            let t = w.next().context("fewer weights than the program takes")?;
            if t.dims != a.shape {
                bail!(
                    "weight `{}` is {:?}, the program takes {:?}",
                    a.name,
                    t.dims,
                    a.shape
                );
            }
            // Converted only when the types differ: a large model's weights are not copied twice.
            let want = element_type(a.dtype);
            let t = if t.ty == want { t } else { convert(&t, want)? };
            frozen.push(rt.upload_sharded(&t, sh, mesh.as_ref())?);
        }
        let mut trainer = Trainer {
            rt,
            program,
            exe,
            frozen,
            state: Vec::new(),
            step: 0,
            spec,
            dropout_seed: 0,
            eval_exe: None,
            compile_s,
        };
        trainer.set_state(lora, moments)?;
        Ok(trainer)
    }

    fn state_specs(&self) -> Vec<(String, Vec<i64>)> {
        self.program
            .args
            .iter()
            .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
            .map(|a| (a.name.clone(), a.shape.clone()))
            .collect()
    }

    /// Replace the LoRA weights and moments (per-layer names; missing moments start at zero).
    pub fn set_state(
        &mut self,
        lora: &BTreeMap<String, HostTensor>,
        moments: &BTreeMap<String, HostTensor>,
    ) -> Result<()> {
        let mut all = lora.clone();
        for t in crate::model::tensors::lora_tensors(&self.spec.model, &self.spec.lora) {
            for prefix in ["exp_avg", "exp_avg_sq"] {
                let name = format!("{prefix}.{}", t.name);
                let v = match moments.get(&name) {
                    Some(v) => v.clone(),
                    None => HostTensor::from_f32(
                        &vec![0.0; t.shape.iter().product::<i64>() as usize],
                        &t.shape,
                    ),
                };
                all.insert(name, v);
            }
        }
        let tensors = crate::formats::host::to_program_layout(
            &self.state_specs(),
            &all,
            self.spec.model.num_hidden_layers,
        )?;
        let shardings = self.state_shardings();
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        self.state = tensors
            .iter()
            .zip(&shardings)
            .map(|(t, sh)| {
                self.rt
                    .upload_sharded(&convert(t, ElementType::F32)?, sh, mesh.as_ref())
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn state_shardings(&self) -> Vec<hlo::Sharding> {
        self.program
            .args
            .iter()
            .zip(self.program.arg_shardings(&self.spec))
            .filter(|(a, _)| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
            .map(|(_, s)| s)
            .collect()
    }

    /// Upload a per-step input (replicated or sharded by its name) to every device.
    fn put(&self, name: &str, t: &HostTensor) -> Result<Vec<Buffer>> {
        match &self.spec.mesh {
            Some(m) => self
                .rt
                .upload_sharded(t, &m.sharding(name, &t.dims), Some(&m.mesh())),
            None => Ok(vec![self.rt.upload(t)?]),
        }
    }

    fn devices(&self) -> usize {
        self.program.partitions as usize
    }

    /// One optimizer step at learning rate `lr`. Returns (loss before the update, grad norm).
    pub fn step(&mut self, batch: &Batch, lr: f64) -> Result<(f32, f32)> {
        let t = self.step + 1;
        let mut inputs = vec![
            self.put("step", &HostTensor::from_f32(&[t as f32], &[]))?,
            self.put("lr", &HostTensor::from_f32(&[lr as f32], &[]))?,
            self.put("input_ids", &batch.input_ids)?,
            self.put("labels", &batch.labels)?,
            self.put("attention_mask", &batch.attention_mask)?,
        ];
        if self.spec.lora.dropout > 0.0 {
            let k = [self.dropout_seed, t << 20];
            inputs.push(self.put(
                "dropout_key",
                &HostTensor {
                    ty: ElementType::U64,
                    dims: vec![2],
                    bytes: k.iter().flat_map(|v| v.to_le_bytes()).collect(),
                },
            )?);
        }
        let args: Vec<Vec<&Buffer>> = (0..self.devices())
            .map(|d| {
                self.frozen
                    .iter()
                    .chain(&self.state)
                    .chain(&inputs)
                    .map(|per_device| &per_device[d])
                    .collect()
            })
            .collect();
        let out = self.exe.execute(&args)?;
        let n_state = self.state.len();
        // Loss and grad norm are replicated: read device 0's.
        let loss = out[0][n_state].to_host()?.scalar_f32()?;
        let grad_norm = out[0][n_state + 1].to_host()?.scalar_f32()?;
        let mut per_arg: Vec<Vec<Buffer>> = (0..n_state).map(|_| Vec::new()).collect();
        for device_out in out {
            for (k, b) in device_out.into_iter().take(n_state).enumerate() {
                per_arg[k].push(b);
            }
        }
        self.state = per_arg;
        self.step = t;
        Ok((loss, grad_norm))
    }

    /// Mean loss over `batches` (summed CE / valid targets) and the fraction of rows whose every
    /// target token is the argmax prediction (what greedy decoding would reproduce exactly).
    pub fn evaluate(&mut self, batches: &[Batch]) -> Result<EvalResult> {
        if batches.is_empty() {
            bail!("no evaluation batches");
        }
        if self.eval_exe.is_none() {
            let mut spec = self.spec.clone();
            spec.batch = batches[0].dims().0;
            spec.microbatches = 1;
            let program = program::build_eval(&spec)?;
            let (exe, _) = crate::formats::program_dir::compile_cached(
                &self.rt,
                &program,
                &CompileOptions::default(),
                true,
            )?;
            self.eval_exe = Some((exe, program.result_shardings(&spec)));
        }
        let (exe, result_shardings) = self.eval_exe.as_ref().unwrap();
        let n_lora = self
            .program
            .args
            .iter()
            .filter(|a| a.role == Role::Lora)
            .count();
        let (mut total, mut count, mut rows, mut exact) = (0.0f64, 0.0f64, 0usize, 0usize);
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        for batch in batches {
            let inputs = [
                self.put("input_ids", &batch.input_ids)?,
                self.put("labels", &batch.labels)?,
                self.put("attention_mask", &batch.attention_mask)?,
            ];
            let args: Vec<Vec<&Buffer>> = (0..self.devices())
                .map(|d| {
                    self.frozen
                        .iter()
                        .chain(&self.state[..n_lora])
                        .chain(&inputs)
                        .map(|per| &per[d])
                        .collect()
                })
                .collect();
            let out = exe.execute(&args)?;
            let gather = |k: usize| -> Result<Vec<f32>> {
                let shards: Vec<HostTensor> = out
                    .iter()
                    .map(|o| o[k].to_host())
                    .collect::<std::result::Result<_, _>>()?;
                let dims = vec![batch.dims().0, batch.dims().1];
                Ok(match &mesh {
                    Some(m) => {
                        crate::program::sharding::unshard(&shards, &dims, &result_shardings[k], m)
                    }
                    None => shards[0].clone(),
                }
                .to_f32()?)
            };
            let ce = gather(0)?;
            let correct = gather(1)?;
            let lab = batch.labels.to_i32()?;
            let t = batch.dims().1 as usize;
            for r in 0..batch.dims().0 as usize {
                let mut all = true;
                let mut any = false;
                for p in 0..t - 1 {
                    if lab[r * t + p + 1] != -100 {
                        any = true;
                        total += ce[r * t + p] as f64;
                        count += 1.0;
                        all &= correct[r * t + p] > 0.5;
                    }
                }
                if any {
                    rows += 1;
                    exact += all as usize;
                }
            }
        }
        Ok(EvalResult {
            loss: total / count.max(1.0),
            accuracy: exact as f64 / rows.max(1) as f64,
            rows,
        })
    }

    /// The current LoRA weights (per-layer PEFT names) and AdamW moments, on the host.
    pub fn state_to_host(
        &self,
    ) -> Result<(BTreeMap<String, HostTensor>, BTreeMap<String, HostTensor>)> {
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        let shardings = self.state_shardings();
        let named: Vec<(String, HostTensor)> = self
            .state_specs()
            .into_iter()
            .zip(&self.state)
            .zip(&shardings)
            .map(|(((n, shape), bufs), sh)| {
                let shards: Vec<HostTensor> = bufs
                    .iter()
                    .map(|b| b.to_host())
                    .collect::<std::result::Result<_, _>>()?;
                let t = match &mesh {
                    Some(m) => crate::program::sharding::unshard(&shards, &shape, sh, m),
                    None => shards.into_iter().next().context("no shard")?,
                };
                Ok((n, t))
            })
            .collect::<Result<_>>()?;
        let all = crate::formats::host::from_program_layout(named);
        let (moments, lora): (BTreeMap<_, _>, BTreeMap<_, _>) =
            all.into_iter().partition(|(n, _)| n.starts_with("exp_avg"));
        Ok((lora, moments))
    }
}

/// Learning-rate schedule: linear warmup, then constant, linear or cosine decay to
/// `min_ratio * lr` at the last step.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    pub lr: f64,
    pub warmup: u64,
    /// "constant", "linear" or "cosine"
    pub kind: String,
    pub min_ratio: f64,
    pub total: u64,
}

impl Schedule {
    /// The learning rate of step `step` (1-based).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup > 0 && step <= self.warmup {
            return self.lr * step as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).clamp(0.0, 1.0);
        let min = self.lr * self.min_ratio;
        match self.kind.as_str() {
            "linear" => self.lr - (self.lr - min) * progress,
            "cosine" => {
                min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            _ => self.lr,
        }
    }
}

/// Options of `xtrain train`.
pub struct TrainOptions {
    pub model: PathBuf,
    /// `.safetensors` (one pre-tokenized batch used for every step) or `.jsonl` (text data).
    pub data: PathBuf,
    pub init_adapter: Option<PathBuf>,
    /// Optimizer steps; 0 = as many as `epochs` take.
    pub steps: u64,
    pub epochs: u64,
    pub lr: f64,
    pub warmup: u64,
    pub schedule: String,
    pub min_lr_ratio: f64,
    pub adam: AdamW,
    pub lora: LoraConfig,
    /// "f32" or "bf16".
    pub dtype: String,
    pub remat: crate::program::Remat,
    pub microbatches: i64,
    /// A program dir from `xtrain compile` to run instead of building the step.
    pub program: Option<PathBuf>,
    pub use_cache: bool,
    /// Rows per step and tokens per row (JSONL data).
    pub batch_size: i64,
    pub seq: i64,
    pub pack: bool,
    pub train_on_prompt: bool,
    pub skip_bad_lines: bool,
    pub strict_length: bool,
    pub eval_fraction: f64,
    pub eval_data: Option<PathBuf>,
    pub eval_every: u64,
    pub save_every: u64,
    pub resume: Option<PathBuf>,
    pub out: PathBuf,
    pub seed: u64,
    pub plugin: Option<String>,
    pub verbose: bool,
    pub log_every: u64,
    pub plot: bool,
    /// Stop this invocation after this many steps.
    pub stop_after: Option<u64>,
    /// Device mesh and sharding rules (None: one device).
    pub mesh: Option<crate::program::MeshPlan>,
    /// QLoRA: NF4 base weights.
    pub nf4: bool,
    /// On a non-finite loss or gradient: stop (false) or skip the step and go on (true).
    pub skip_nonfinite: bool,
    /// Compute the loss this many positions at a time (looped layers).
    pub loss_chunk: Option<i64>,
    pub attention_block: Option<i64>,
    /// `--matmul-result`: auto, f32 or compute (see [`crate::device::runtime::wide_matmul_results`]).
    pub matmul_result: String,
}

/// Write an adapter directory (complete or not at all).
pub fn save_adapter(
    dir: &Path,
    lora: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
    base: &str,
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
}

/// A checkpoint as loaded: LoRA weights, AdamW moments (both per-layer names) and the state.
pub type Checkpoint = (
    BTreeMap<String, HostTensor>,
    BTreeMap<String, HostTensor>,
    TrainerState,
);

/// A checkpoint: adapter + AdamW moments + trainer state, in one directory written atomically.
pub fn save_checkpoint(
    dir: &Path,
    trainer: &Trainer,
    state: &TrainerState,
    base: &str,
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

pub fn load_checkpoint(dir: &Path, cfg: &LlamaConfig, lora: &LoraConfig) -> Result<Checkpoint> {
    let state_path = dir.join("trainer_state.json");
    let state: TrainerState =
        serde_json::from_str(&std::fs::read_to_string(&state_path).with_context(|| {
            format!(
                "cannot read {} (is {} a checkpoint?)",
                state_path.display(),
                dir.display()
            )
        })?)
        .with_context(|| format!("{} is not a trainer state", state_path.display()))?;
    let c = crate::formats::peft::read_config(dir)?;
    if c.r != lora.r || c.targets != lora.targets {
        bail!(
            "checkpoint {} has LoRA r={} on {:?}; this run uses r={} on {:?}",
            dir.display(),
            c.r,
            c.targets,
            lora.r,
            lora.targets
        );
    }
    let weights = crate::formats::peft::read_tensors(dir, cfg, lora)?;
    let opt = SafeTensors::open(&dir.join("optimizer.safetensors"))?;
    let mut moments = BTreeMap::new();
    for name in opt.tensors.keys() {
        moments.insert(name.clone(), opt.read(name)?);
    }
    Ok((weights, moments, state))
}

/// Where the batches come from.
enum Source {
    /// One batch used for every step.
    Fixed(Batch),
    /// Rows visited epoch by epoch in a seeded order (the current epoch's order cached).
    Rows {
        rows: Vec<crate::data::Row>,
        batch: usize,
        order: Option<(u64, Vec<usize>)>,
    },
}

impl Source {
    fn steps_per_epoch(&self) -> u64 {
        match self {
            Source::Fixed(_) => 1,
            Source::Rows { rows, batch, .. } => (rows.len() / batch).max(1) as u64,
        }
    }

    /// The batch at (epoch, position), and the position after it.
    fn next(&mut self, seed: u64, epoch: &mut u64, position: &mut u64) -> Batch {
        match self {
            Source::Fixed(b) => b.clone(),
            Source::Rows { rows, batch, order } => {
                if *position as usize + *batch > rows.len() {
                    *epoch += 1;
                    *position = 0;
                }
                // The shuffle of an epoch is computed once, not at every step.
                if order.as_ref().is_none_or(|(e, _)| e != epoch) {
                    *order = Some((*epoch, crate::data::epoch_order(rows.len(), seed, *epoch)));
                }
                let ord = &order.as_ref().unwrap().1;
                let at = *position as usize;
                let picked: Vec<&crate::data::Row> =
                    ord[at..at + *batch].iter().map(|&i| &rows[i]).collect();
                *position += *batch as u64;
                crate::data::batch(&picked)
            }
        }
    }
}

fn read_rows(
    path: &Path,
    tok: &crate::data::text::TextTokenizer,
    opts: &TrainOptions,
) -> Result<Vec<crate::data::Tokenized>> {
    let report = crate::data::read_jsonl(path, opts.skip_bad_lines)?;
    if !report.skipped.is_empty() {
        eprintln!(
            "xtrain: skipped {} bad lines of {} (first: line {}: {})",
            report.skipped.len(),
            path.display(),
            report.skipped[0].0,
            report.skipped[0].1
        );
    }
    report
        .examples
        .iter()
        .map(|e| crate::data::tokenize(tok, e, opts.train_on_prompt))
        .collect()
}

/// The progress line: step, loss, tokens/s, ETA. Rewritten in place on a terminal.
struct Progress {
    start: Instant,
    tty: bool,
    first_step: u64,
}

impl Progress {
    fn show(&self, step: u64, total: u64, loss: f32, tokens_per_s: f64, lr: f64) {
        use std::io::IsTerminal;
        let done = (step - self.first_step + 1) as f64;
        let eta = self.start.elapsed().as_secs_f64() / done * (total - step) as f64;
        let width = 24;
        let filled = (step as usize * width) / total.max(1) as usize;
        let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
        let line = format!("[{bar}] step {step}/{total} loss {loss:.4} lr {lr:.2e} {tokens_per_s:.0} tok/s eta {eta:.0}s");
        if self.tty && std::io::stderr().is_terminal() {
            eprint!("\r{line}");
            if step == total {
                eprintln!();
            }
        } else {
            eprintln!("{line}");
        }
    }
}

/// `xtrain train`: build (or load) the step, then train on the data, logging metrics,
/// evaluating, checkpointing and exporting the adapter.
pub fn run(opts: &TrainOptions) -> Result<()> {
    // SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current step and exits.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
    }
    let cfg = LlamaConfig::load(&opts.model)?;
    // Fail before any work if the output dir cannot be written.
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create output dir {}", opts.out.display()))?;
    let probe = opts.out.join(".xtrain-write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("output dir {} is not writable", opts.out.display()))?;
    let _ = std::fs::remove_file(&probe);

    let is_batch_file = opts.data.extension().is_some_and(|e| e == "safetensors");
    let (mut source, eval_batches, seq) = if is_batch_file {
        let batch = Batch::from_safetensors(&opts.data)?;
        batch.check_vocab(cfg.vocab_size)?;
        let seq = batch.dims().1;
        (Source::Fixed(batch), Vec::new(), seq)
    } else {
        let tok = crate::data::text::TextTokenizer::load(&opts.model)?;
        if tok.vocab_size() as i64 > cfg.vocab_size {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary is {}",
                tok.vocab_size(),
                cfg.vocab_size
            );
        }
        let examples = read_rows(&opts.data, &tok, opts)?;
        let (train_ex, eval_ex) = match &opts.eval_data {
            Some(p) => (examples, read_rows(p, &tok, opts)?),
            None => crate::data::split_eval(&examples, opts.eval_fraction),
        };
        let seq = opts.seq as usize;
        let (rows, report) =
            crate::data::make_rows(&train_ex, seq, opts.pack, tok.pad_id, opts.strict_length)?;
        if report.truncated > 0 {
            eprintln!(
                "xtrain: truncated {} examples to --seq {seq}",
                report.truncated
            );
        }
        if rows.len() < opts.batch_size as usize {
            bail!(
                "{} gives {} rows of {seq} tokens, fewer than one batch of {}",
                opts.data.display(),
                rows.len(),
                opts.batch_size
            );
        }
        // Eval rows are never packed, so that each row is one example (accuracy is per example).
        let (eval_rows, _) = crate::data::make_rows(&eval_ex, seq, false, tok.pad_id, false)?;
        let b = opts.batch_size as usize;
        let eval_batches: Vec<Batch> = eval_rows
            .chunks(b)
            .map(|c| {
                let mut refs: Vec<&crate::data::Row> = c.iter().collect();
                while refs.len() < b {
                    refs.push(&c[0]); // pad the last batch by repeating; repeated rows are skipped below
                }
                crate::data::batch(&refs)
            })
            .collect();
        let eval_batches = mask_repeats(eval_batches, eval_rows.len(), b);
        (
            Source::Rows {
                rows,
                batch: b,
                order: None,
            },
            eval_batches,
            seq as i64,
        )
    };
    let bs = match &source {
        Source::Fixed(b) => b.dims().0,
        Source::Rows { batch, .. } => *batch as i64,
    };
    let (spec, program) = plan(opts, &cfg, bs, seq)?;
    let lora_cfg = spec.lora.clone();
    let total = if opts.steps > 0 {
        opts.steps
    } else {
        source.steps_per_epoch() * opts.epochs.max(1)
    };
    let schedule = Schedule {
        lr: opts.lr,
        warmup: opts.warmup,
        kind: opts.schedule.clone(),
        min_ratio: opts.min_lr_ratio,
        total,
    };

    let (lora, moments, mut state) = match &opts.resume {
        Some(dir) => {
            let (w, m, st) = load_checkpoint(dir, &cfg, &lora_cfg)?;
            if st.seed != opts.seed {
                bail!(
                    "checkpoint {} was trained with --seed {}; resume with the same seed",
                    dir.display(),
                    st.seed
                );
            }
            (w, m, st)
        }
        None => {
            let w = match &opts.init_adapter {
                Some(dir) => {
                    let c = crate::formats::peft::read_config(dir)?;
                    if c.r != lora_cfg.r
                        || c.targets != lora_cfg.targets
                        || (c.alpha - lora_cfg.alpha).abs() > 1e-9
                    {
                        bail!(
                            "--init-adapter {} has r={}, alpha={}, targets {:?}, but the flags ask for r={}, alpha={}, targets {:?}",
                            dir.display(), c.r, c.alpha, c.targets, lora_cfg.r, lora_cfg.alpha, lora_cfg.targets
                        );
                    }
                    crate::formats::peft::read_tensors(dir, &cfg, &lora_cfg)?
                }
                None => init_lora(&cfg, &lora_cfg, opts.seed),
            };
            (
                w,
                BTreeMap::new(),
                TrainerState {
                    step: 0,
                    epoch: 0,
                    position: 0,
                    seed: opts.seed,
                    schedule: schedule.clone(),
                },
            )
        }
    };
    state.schedule = schedule.clone();

    let frozen = program.frozen_shapes();
    let t_load = Instant::now();
    let weights = crate::formats::weights::load(
        &opts.model,
        &cfg,
        &frozen,
        element_type(spec.weight_dtype),
        |_, _| {},
    )?;
    if opts.verbose {
        eprintln!(
            "xtrain: loaded {} weight tensors in {:.1}s",
            frozen.len(),
            t_load.elapsed().as_secs_f64()
        );
    }
    // A CPU plugin gets as many virtual devices as the mesh needs; an accelerator plugin has
    // what it has, and compiling checks that there are enough.
    let rt = Runtime::open(opts.plugin.as_deref(), Some(program.partitions.max(1)))?;
    let mut trainer = Trainer::new(
        rt,
        spec,
        program,
        weights,
        &lora,
        &moments,
        opts.use_cache,
        opts.verbose,
    )?;
    trainer.dropout_seed = opts.seed;
    trainer.step = state.step;

    // metrics.jsonl: on resume keep the lines up to the checkpoint's step.
    let metrics_path = opts.out.join("metrics.jsonl");
    let mut kept = String::new();
    if opts.resume.is_some() {
        if let Ok(old) = std::fs::read_to_string(&metrics_path) {
            for line in old.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
                if v.get("step")
                    .and_then(|s| s.as_u64())
                    .is_some_and(|s| s <= state.step)
                {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
    }
    std::fs::write(&metrics_path, &kept)
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;
    let mut metrics = std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics_path)?;
    let base = opts.model.to_string_lossy().to_string();
    let mut history: Vec<(u64, f64, Option<f64>)> = Vec::new();

    let log_eval = |trainer: &mut Trainer,
                    metrics: &mut std::fs::File,
                    step: u64|
     -> Result<Option<EvalResult>> {
        if eval_batches.is_empty() {
            return Ok(None);
        }
        let r = trainer.evaluate(&eval_batches)?;
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"step": step, "eval_loss": r.loss, "eval_accuracy": r.accuracy, "eval_rows": r.rows})
        )?;
        eprintln!(
            "eval at step {step}: loss {:.4}, exact-match accuracy {:.1}% of {} rows",
            r.loss,
            100.0 * r.accuracy,
            r.rows
        );
        Ok(Some(r))
    };
    if state.step == 0 {
        if let Some(r) = log_eval(&mut trainer, &mut metrics, 0)? {
            history.push((0, f64::NAN, Some(r.loss)));
        }
    }
    let progress = Progress {
        start: Instant::now(),
        tty: true,
        first_step: state.step + 1,
    };
    let tokens_per_step = bs * seq;
    let stop_at = opts
        .stop_after
        .map_or(total, |n| (state.step + n).min(total));
    let mut recent: Vec<f32> = Vec::new();
    while state.step < stop_at {
        if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            let dir = opts.out.join(format!("checkpoint-{}", state.step));
            save_checkpoint(&dir, &trainer, &state, &base)?;
            eprintln!(
                "\nxtrain: interrupted after step {}; saved {} (continue with --resume {})",
                state.step,
                dir.display(),
                dir.display()
            );
            std::process::exit(130);
        }
        let step = state.step + 1;
        let batch = source.next(opts.seed, &mut state.epoch, &mut state.position);
        let lr = schedule.at(step);
        let t0 = Instant::now();
        let (loss, grad_norm) = trainer.step(&batch, lr)?;
        let dt = t0.elapsed().as_secs_f64();
        state.step = step;
        if !loss.is_finite() || !grad_norm.is_finite() {
            // The step left the state as it was (see the program's finite guard).
            writeln!(
                metrics,
                "{}",
                serde_json::json!({"step": step, "nonfinite": true, "loss": loss.to_string(), "grad_norm": grad_norm.to_string()})
            )?;
            if !opts.skip_nonfinite {
                state.step = step - 1;
                let dir = opts.out.join(format!("checkpoint-{}", state.step));
                save_checkpoint(&dir, &trainer, &state, &base)?;
                bail!("step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped without applying it. The last good state is in {} (--skip-nonfinite-steps skips such steps instead)", dir.display());
            }
            eprintln!("xtrain: step {step}: non-finite loss {loss} / gradient norm {grad_norm}; step skipped");
            continue;
        }
        if recent.len() >= 5 {
            let mean = recent.iter().sum::<f32>() / recent.len() as f32;
            if loss > 2.0 * mean + 1.0 {
                eprintln!("xtrain: loss spike at step {step}: {loss:.4} against a recent mean of {mean:.4}");
                writeln!(
                    metrics,
                    "{}",
                    serde_json::json!({"step": step, "loss_spike": loss, "recent_mean": mean})
                )?;
            }
        }
        recent.push(loss);
        if recent.len() > 20 {
            recent.remove(0);
        }
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "epoch": state.epoch, "tokens": tokens_per_step, "step_time_s": dt})
        )?;
        metrics.flush()?;
        history.push((step, loss as f64, None));
        if opts.log_every > 0 && (step % opts.log_every == 0 || step == total) {
            progress.show(step, total, loss, tokens_per_step as f64 / dt, lr);
        }
        if opts.eval_every > 0 && step % opts.eval_every == 0 && step != total {
            if let Some(r) = log_eval(&mut trainer, &mut metrics, step)? {
                history.push((step, f64::NAN, Some(r.loss)));
            }
        }
        if opts.save_every > 0 && step % opts.save_every == 0 {
            save_checkpoint(
                &opts.out.join(format!("checkpoint-{step}")),
                &trainer,
                &state,
                &base,
            )?;
            let (lora_now, _) = trainer.state_to_host()?;
            save_adapter(
                &opts.out.join(format!("step-{step}")),
                &lora_cfg,
                &lora_now,
                &base,
            )?;
        }
    }
    if let Some(r) = log_eval(&mut trainer, &mut metrics, state.step)? {
        history.push((state.step, f64::NAN, Some(r.loss)));
    }
    let (lora_now, _) = trainer.state_to_host()?;
    save_adapter(&opts.out.join("adapter"), &lora_cfg, &lora_now, &base)?;
    if opts.plot {
        let path = opts.out.join("loss.png");
        crate::train::plot::loss_curve(&path, &history)?;
        eprintln!("xtrain: loss curve in {}", path.display());
    }
    Ok(())
}

/// Eval batches padded by repeating rows: turn the repeats' labels off so they do not count.
fn mask_repeats(mut batches: Vec<Batch>, real_rows: usize, b: usize) -> Vec<Batch> {
    if let Some(last) = batches.last_mut() {
        let real_in_last = real_rows - (real_rows.saturating_sub(1) / b) * b;
        let t = last.dims().1 as usize;
        let mut labels = last.labels.to_i32().unwrap_or_default();
        for l in labels.iter_mut().skip(real_in_last * t) {
            *l = -100;
        }
        last.labels = HostTensor::from_i32(&labels, &last.labels.dims);
    }
    batches
}

/// Build the step spec for a model and batch shape from the options, or take it from a program
/// dir (checking that the program was built for this model and batch).
pub fn plan(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
) -> Result<(StepSpec, Program)> {
    if let Some(dir) = &opts.program {
        let (program, spec) = crate::formats::program_dir::read_dir(dir)?;
        if &spec.model != cfg {
            bail!(
                "program dir {} was built for another model (its config differs from {})",
                dir.display(),
                opts.model.display()
            );
        }
        if (spec.batch, spec.seq) != (batch, seq) {
            bail!(
                "program dir {} takes batches of {}x{} but the data gives {batch}x{seq}",
                dir.display(),
                spec.batch,
                spec.seq
            );
        }
        return Ok((spec, program));
    }
    let dtype = match opts.dtype.as_str() {
        "f32" => hlo::DType::F32,
        "bf16" => hlo::DType::BF16,
        other => bail!("--dtype must be f32 or bf16, got `{other}`"),
    };
    let spec = StepSpec {
        model: cfg.clone(),
        lora: opts.lora.clone(),
        adam: opts.adam.clone(),
        batch,
        seq,
        weight_dtype: dtype,
        compute_dtype: dtype,
        remat: opts.remat,
        microbatches: opts.microbatches,
        mesh: opts.mesh.clone(),
        nf4: opts.nf4,
        loss_chunk: opts.loss_chunk,
        attention_block: opts.attention_block,
        wide_matmul_results: crate::device::runtime::wide_matmul_results(
            &opts.matmul_result,
            opts.plugin.as_deref(),
        )?,
    };
    let program = program::build_train_step(&spec)?;
    Ok((spec, program))
}
