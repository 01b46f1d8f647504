//! Generation and evaluation with a model (and optionally a LoRA adapter): greedy or sampled
//! decoding, loss and exact-match accuracy on prompt/answer pairs.

use crate::device::runtime::Runtime;
use crate::formats::host::{convert, element_type};
use crate::formats::weights::FrozenWeights;
use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection, SplitMix};
use crate::program::{self, Role, StepSpec};
use anyhow::Result;
use pjrt::{Buffer, CompileOptions, ElementType, Executable, HostTensor};
use std::collections::BTreeMap;
use std::path::Path;

/// A compiled forward program with the model's weights on the device.
pub struct Forward {
    pub spec: StepSpec,
    pub program: program::Program,
    exe: Executable,
    model_bufs: Vec<Buffer>,
    rt_client: pjrt::Client,
    device: pjrt::Device,
}

/// Which program a [`Forward`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// logits of the next token at given positions
    NextToken,
    /// full logits, per-token loss, loss
    Full,
}

impl Forward {
    /// Build, compile (cached) and load a forward program for `batch` x `seq` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rt: &Runtime,
        cfg: &LlamaConfig,
        model_dir: &Path,
        adapter: Option<(&LoraConfig, &BTreeMap<String, HostTensor>)>,
        kind: Kind,
        batch: i64,
        seq: i64,
        dtype: hlo::DType,
    ) -> Result<Forward> {
        let lora = adapter.map(|(c, _)| c.clone()).unwrap_or(LoraConfig {
            r: 1,
            alpha: 1.0,
            dropout: 0.0,
            targets: vec![Projection::Q],
        });
        let spec = StepSpec::new(cfg.clone(), lora, batch, seq, dtype).with_default_form();
        let program = match kind {
            Kind::NextToken => program::build_next_token(&spec, adapter.is_some())?,
            Kind::Full => program::build_forward(&spec, adapter.is_some())?,
        };
        let (exe, _) =
            crate::device::cache::compile_cached(rt, &program, &CompileOptions::default(), true)?;
        // Weight by weight: read, upload, free.
        let mut weights = crate::formats::weights::CheckpointWeights::open(model_dir, cfg)?;
        let mut model_bufs = crate::device::platform::while_loading(|| -> Result<Vec<Buffer>> {
            let mut bufs = Vec::new();
            let frozen = program.args.iter().filter(|a| a.role == Role::Frozen);
            for (k, a) in frozen.enumerate() {
                let whole = vec![0; a.shape.len()];
                let ty = element_type(a.dtype);
                let t = weights.shard(k, &a.name, &a.shape, &whole, &a.shape, ty)?;
                bufs.push(rt.upload(&t)?);
                weights.done(k);
            }
            Ok(bufs)
        })?;
        if let Some((_, tensors)) = adapter {
            let names: Vec<(String, Vec<i64>)> = program
                .args
                .iter()
                .filter(|a| a.role == Role::Lora)
                .map(|a| (a.name.clone(), a.shape.clone()))
                .collect();
            for t in
                crate::formats::host::to_program_layout(&names, tensors, cfg.num_hidden_layers)?
            {
                model_bufs.push(rt.upload(&convert(&t, ElementType::F32)?)?);
            }
        }
        Ok(Forward {
            spec,
            program,
            exe,
            model_bufs,
            rt_client: rt.client.clone(),
            device: rt.devices[0].clone(),
        })
    }

    fn run(&self, extra: &[HostTensor]) -> Result<Vec<HostTensor>> {
        let bufs: Vec<Buffer> = extra
            .iter()
            .map(|t| self.rt_client.to_device(t, &self.device))
            .collect::<std::result::Result<_, _>>()?;
        let mut args: Vec<&Buffer> = self.model_bufs.iter().collect();
        args.extend(bufs.iter());
        let out = self.exe.execute(&[args])?;
        out[0].iter().map(|b| Ok(b.to_host()?)).collect()
    }

    /// Next-token logits [B, V] (NextToken programs).
    pub fn next_logits(
        &self,
        ids: &HostTensor,
        mask: &HostTensor,
        positions: &[i32],
    ) -> Result<Vec<f32>> {
        let pos = HostTensor::from_i32(positions, &[positions.len() as i64]);
        Ok(self
            .run(&[ids.clone(), mask.clone(), pos])?
            .remove(0)
            .to_f32()?)
    }

    /// (logits [B,T,V], per-token CE [B,T]) of a batch (Full programs).
    pub fn full(
        &self,
        ids: &HostTensor,
        labels: &HostTensor,
        mask: &HostTensor,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let out = self.run(&[ids.clone(), labels.clone(), mask.clone()])?;
        Ok((out[0].to_f32()?, out[1].to_f32()?))
    }
}

/// Why decoding stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The model gave the end-of-sequence token.
    Eos,
    /// `max_new` tokens were generated.
    MaxNewTokens,
    /// The program's context (prompt + generated tokens) is full.
    Context,
}

/// Decode up to `max_new` tokens after `prompt` (greedy when temperature is 0). Stops at `eos`.
pub fn generate(
    f: &Forward,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    seed: u64,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    Ok(generate_until(f, prompt, max_new, temperature, seed, eos)?.0)
}

/// [`generate`], and why it stopped.
pub fn generate_until(
    f: &Forward,
    prompt: &[u32],
    max_new: usize,
    temperature: f64,
    seed: u64,
    eos: Option<u32>,
) -> Result<(Vec<u32>, Stop)> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        anyhow::bail!("--temperature must be a number >= 0, got {temperature}");
    }
    let t = f.spec.seq as usize;
    let v = f.spec.model.vocab_size as usize;
    if prompt.is_empty() || prompt.len() >= t {
        anyhow::bail!(
            "the prompt has {} tokens; it must have 1..{} (the context, --context, holds the prompt and the new tokens)",
            prompt.len(),
            t
        );
    }
    let mut ids: Vec<i32> = prompt.iter().map(|&x| x as i32).collect();
    let mut rng = SplitMix(seed);
    let mut out = Vec::new();
    let mut stop = Stop::MaxNewTokens;
    while out.len() < max_new {
        if ids.len() >= t {
            stop = Stop::Context;
            break;
        }
        let n = ids.len();
        let mut row = ids.clone();
        row.resize(t, 0);
        let mask: Vec<i32> = (0..t).map(|i| (i < n) as i32).collect();
        let logits = f.next_logits(
            &HostTensor::from_i32(&row, &[1, t as i64]),
            &HostTensor::from_i32(&mask, &[1, t as i64]),
            &[n as i32 - 1],
        )?;
        if let Some(bad) = logits[..v].iter().find(|x| !x.is_finite()) {
            anyhow::bail!(
                "the model's next-token logits after {n} tokens are not finite ({bad}): the \
                 weights (the model's or the adapter's) hold non-finite or blown-up values, so \
                 no token can be chosen; nothing was generated from them"
            );
        }
        let next = pick(&logits[..v], temperature, &mut rng);
        if Some(next) == eos {
            stop = Stop::Eos;
            break;
        }
        out.push(next);
        ids.push(next as i32);
    }
    Ok((out, stop))
}

fn pick(logits: &[f32], temperature: f64, rng: &mut SplitMix) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |a, (i, &x)| if x > a.1 { (i, x) } else { a })
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let m = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - m) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        u -= w;
        if u <= 0.0 {
            return i as u32;
        }
    }
    argmax()
}
