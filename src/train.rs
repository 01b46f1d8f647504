//! The training loop: compile the step once, upload the frozen weights once, then feed batches,
//! log metrics and write PEFT adapters.

use crate::config::LlamaConfig;
use crate::lora::{kaiming_uniform, LoraConfig, SplitMix};
use crate::optim::AdamW;
use crate::runtime::{convert, element_type, Runtime};
use crate::safetensors::SafeTensors;
use crate::step::{self, Program, Role, StepSpec};
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

/// Fresh LoRA weights: A Kaiming-uniform as PEFT, B zeros.
pub fn init_lora(cfg: &LlamaConfig, lora: &LoraConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = SplitMix(seed);
    step::lora_tensors(cfg, lora)
        .into_iter()
        .map(|t| {
            let values = if t.which == "A" {
                kaiming_uniform(&mut rng, t.shape[0], t.shape[1])
            } else {
                vec![0.0; (t.shape[0] * t.shape[1]) as usize]
            };
            (t.name, HostTensor::from_f32(&values, &t.shape))
        })
        .collect()
}

/// A compiled training step with its state on the device.
pub struct Trainer {
    pub rt: Runtime,
    pub program: Program,
    exe: Executable,
    frozen: Vec<Buffer>,
    /// LoRA params, then m, then v, in program order (the donated part).
    state: Vec<Buffer>,
    /// Number of optimizer steps taken.
    pub step: u64,
    pub spec: StepSpec,
    /// Threefry key for LoRA dropout, advanced every step.
    pub dropout_seed: u64,
}

impl Trainer {
    /// Compile `program` (through the executable cache), upload the frozen weights (in the
    /// program's layout, see [`crate::weights::load`]) and the initial LoRA state (per-layer
    /// PEFT names).
    pub fn new(
        rt: Runtime,
        spec: StepSpec,
        program: Program,
        weights: Vec<HostTensor>,
        lora: &BTreeMap<String, HostTensor>,
        use_cache: bool,
        verbose: bool,
    ) -> Result<Trainer> {
        let t0 = Instant::now();
        let (exe, cached) =
            crate::program::compile_cached(&rt, &program, &CompileOptions::default(), use_cache)?;
        if verbose {
            let how = if cached {
                "loaded the compiled step from the cache"
            } else {
                "compiled the step"
            };
            eprintln!(
                "xtrain: {how} in {:.2}s ({} bytes of StableHLO)",
                t0.elapsed().as_secs_f64(),
                program.text.len()
            );
        }
        let mut frozen = Vec::new();
        let mut w = weights.into_iter();
        for a in program.args.iter().filter(|a| a.role == Role::Frozen) {
            let t = w.next().context("fewer weights than the program takes")?;
            if t.dims != a.shape {
                bail!(
                    "weight `{}` is {:?}, the program takes {:?}",
                    a.name,
                    t.dims,
                    a.shape
                );
            }
            frozen.push(rt.upload(&convert(&t, element_type(a.dtype))?)?);
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
        };
        trainer.set_state(lora, &BTreeMap::new())?;
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
        for t in step::lora_tensors(&self.spec.model, &self.spec.lora) {
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
        let tensors = crate::runtime::to_program_layout(
            &self.state_specs(),
            &all,
            self.spec.model.num_hidden_layers,
        )?;
        self.state = tensors
            .iter()
            .map(|t| self.rt.upload(&convert(t, ElementType::F32)?))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// One optimizer step at learning rate `lr`. Returns (loss before the update, grad norm).
    pub fn step(&mut self, batch: &Batch, lr: f64) -> Result<(f32, f32)> {
        let t = self.step + 1;
        let step_buf = self.rt.upload(&HostTensor::from_f32(&[t as f32], &[]))?;
        let lr_buf = self.rt.upload(&HostTensor::from_f32(&[lr as f32], &[]))?;
        let ids = self.rt.upload(&batch.input_ids)?;
        let labels = self.rt.upload(&batch.labels)?;
        let mask = self.rt.upload(&batch.attention_mask)?;
        let key = if self.spec.lora.dropout > 0.0 {
            let k = [self.dropout_seed, t << 20];
            Some(self.rt.upload(&HostTensor {
                ty: ElementType::U64,
                dims: vec![2],
                bytes: k.iter().flat_map(|v| v.to_le_bytes()).collect(),
            })?)
        } else {
            None
        };
        let mut args: Vec<&Buffer> = self.frozen.iter().collect();
        args.extend(self.state.iter());
        args.extend([&step_buf, &lr_buf, &ids, &labels, &mask]);
        if let Some(k) = &key {
            args.push(k);
        }
        let mut out = self.exe.execute(&[args])?.remove(0);
        let grad_norm = out
            .pop()
            .context("missing grad_norm")?
            .to_host()?
            .scalar_f32()?;
        let loss = out.pop().context("missing loss")?.to_host()?.scalar_f32()?;
        self.state = out;
        self.step = t;
        Ok((loss, grad_norm))
    }

    /// The current LoRA weights (per-layer PEFT names) and AdamW moments, on the host.
    pub fn state_to_host(
        &self,
    ) -> Result<(BTreeMap<String, HostTensor>, BTreeMap<String, HostTensor>)> {
        let named: Vec<(String, HostTensor)> = self
            .state_specs()
            .into_iter()
            .zip(&self.state)
            .map(|((n, _), b)| Ok((n, b.to_host()?)))
            .collect::<Result<_>>()?;
        let all = crate::runtime::from_program_layout(named);
        let (moments, lora): (BTreeMap<_, _>, BTreeMap<_, _>) =
            all.into_iter().partition(|(n, _)| n.starts_with("exp_avg"));
        Ok((lora, moments))
    }
}

/// Options of `xtrain train` on a pre-tokenized batch.
pub struct TrainOptions {
    pub model: PathBuf,
    pub data: PathBuf,
    pub init_adapter: Option<PathBuf>,
    pub steps: u64,
    pub lr: f64,
    pub adam: AdamW,
    pub lora: LoraConfig,
    /// "f32" or "bf16".
    pub dtype: String,
    pub remat: crate::step::Remat,
    pub microbatches: i64,
    /// A program dir from `xtrain compile` to run instead of building the step.
    pub program: Option<PathBuf>,
    pub use_cache: bool,
    pub save_every: u64,
    pub out: PathBuf,
    pub seed: u64,
    pub plugin: Option<String>,
    pub verbose: bool,
    pub log_every: u64,
}

/// Write `dir` as a complete adapter directory or not at all: files go into a temp dir that is
/// renamed into place.
pub fn save_adapter(
    dir: &Path,
    lora: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
    base: &str,
) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .context("adapter dir has no name")?
        .to_string_lossy();
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    crate::peft::write(&tmp, lora, tensors, base)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("cannot replace {}", dir.display()))?;
    }
    std::fs::rename(&tmp, dir)
        .with_context(|| format!("cannot move the adapter into {}", dir.display()))?;
    Ok(())
}

/// Build the step spec for a model dir and batch shape from the options, or take it from a
/// program dir (checking that the program was built for this model and batch).
pub fn plan(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
) -> Result<(StepSpec, Program)> {
    if let Some(dir) = &opts.program {
        let (program, spec) = crate::program::read_dir(dir)?;
        if &spec.model != cfg {
            bail!(
                "program dir {} was built for another model (its config differs from {})",
                dir.display(),
                opts.model.display()
            );
        }
        if (spec.batch, spec.seq) != (batch, seq) {
            bail!(
                "program dir {} takes batches of {}x{} but the data is {batch}x{seq}",
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
    };
    let program = step::build_train_step(&spec)?;
    Ok((spec, program))
}

/// Run `xtrain train` on one pre-tokenized batch used for every step.
pub fn train_on_batch(opts: &TrainOptions) -> Result<()> {
    let cfg = LlamaConfig::load(&opts.model)?;
    let batch = Batch::from_safetensors(&opts.data)?;
    batch.check_vocab(cfg.vocab_size)?;
    let (bs, seq) = batch.dims();
    let (spec, program) = plan(opts, &cfg, bs, seq)?;
    let lora_cfg = spec.lora.clone();
    let lora = match &opts.init_adapter {
        Some(dir) => {
            let c = crate::peft::read_config(dir)?;
            if c.r != lora_cfg.r
                || c.targets != lora_cfg.targets
                || (c.alpha - lora_cfg.alpha).abs() > 1e-9
            {
                bail!(
                    "--init-adapter {} has r={}, alpha={}, targets {:?}, but the flags ask for r={}, alpha={}, targets {:?}",
                    dir.display(), c.r, c.alpha, c.targets, lora_cfg.r, lora_cfg.alpha, lora_cfg.targets
                );
            }
            crate::peft::read_tensors(dir, &cfg, &lora_cfg)?
        }
        None => init_lora(&cfg, &lora_cfg, opts.seed),
    };
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create output dir {}", opts.out.display()))?;
    let frozen: Vec<(String, Vec<i64>)> = program
        .args
        .iter()
        .filter(|a| a.role == Role::Frozen)
        .map(|a| (a.name.clone(), a.shape.clone()))
        .collect();
    let weights = crate::weights::load(
        &opts.model,
        &cfg,
        &frozen,
        element_type(spec.weight_dtype),
        |_, _| {},
    )?;
    let rt = Runtime::open(opts.plugin.as_deref(), Some(1))?;
    let mut trainer = Trainer::new(
        rt,
        spec,
        program,
        weights,
        &lora,
        opts.use_cache,
        opts.verbose,
    )?;
    trainer.dropout_seed = opts.seed;
    let metrics_path = opts.out.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path)
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;
    let tokens_per_step = bs * seq;
    let start = Instant::now();
    let base = opts.model.to_string_lossy().to_string();
    for s in 1..=opts.steps {
        let t0 = Instant::now();
        let (loss, grad_norm) = trainer.step(&batch, opts.lr)?;
        let dt = t0.elapsed().as_secs_f64();
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"step": s, "loss": loss, "grad_norm": grad_norm, "lr": opts.lr, "tokens": tokens_per_step, "step_time_s": dt})
        )?;
        metrics.flush()?;
        if opts.log_every > 0 && (s % opts.log_every == 0 || s == opts.steps) {
            let elapsed = start.elapsed().as_secs_f64();
            let eta = elapsed / s as f64 * (opts.steps - s) as f64;
            eprintln!(
                "step {s}/{} loss {loss:.4} grad_norm {grad_norm:.3} {:.0} tok/s eta {eta:.0}s",
                opts.steps,
                tokens_per_step as f64 / dt
            );
        }
        if opts.save_every > 0 && s % opts.save_every == 0 {
            let (lora_now, _) = trainer.state_to_host()?;
            save_adapter(
                &opts.out.join(format!("step-{s}")),
                &lora_cfg,
                &lora_now,
                &base,
            )?;
        }
    }
    let (lora_now, _) = trainer.state_to_host()?;
    save_adapter(&opts.out.join("adapter"), &lora_cfg, &lora_now, &base)?;
    Ok(())
}
