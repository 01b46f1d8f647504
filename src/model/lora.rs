//! LoRA as PEFT defines it: for a target projection W [out, in], trainable A [r, in] and
//! B [out, r]; the projection becomes `x W^T + (alpha / r) * dropout(x) A^T B^T`.

use anyhow::{bail, Result};
use std::fmt;

/// A projection LoRA can adapt.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// PEFT's module name (`q_proj`, ...).
    pub fn module(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// `self_attn` or `mlp`: the HF submodule holding the projection.
    pub fn block(self) -> &'static str {
        match self {
            Projection::Q | Projection::K | Projection::V | Projection::O => "self_attn",
            _ => "mlp",
        }
    }

    /// The name users write in `--lora-targets` (`q`, `gate`, ...).
    pub fn short(self) -> &'static str {
        self.module().trim_end_matches("_proj")
    }

    /// Targets as users write them: `q,k,v,o,gate,up,down`.
    pub fn list(targets: &[Projection]) -> String {
        let names: Vec<&str> = targets.iter().map(|t| t.short()).collect();
        names.join(",")
    }

    /// Parse `q`, `q_proj`, `gate`, ...
    pub fn parse(s: &str) -> Result<Projection> {
        let s = s.trim();
        let base = s.strip_suffix("_proj").unwrap_or(s);
        Ok(match base {
            "q" => Projection::Q,
            "k" => Projection::K,
            "v" => Projection::V,
            "o" => Projection::O,
            "gate" => Projection::Gate,
            "up" => Projection::Up,
            "down" => Projection::Down,
            // As torchtune does: an adapter on the output layer of a model whose output is tied
            // to its embedding (Llama 3.2 1B/3B, SmolLM2) changes the embedding too, or unties
            // them, and runtimes disagree on which (PEFT keeps the tie only with
            // `ensure_weight_tying`); xtrain adapts the seven projections and nothing else.
            "lm_head" | "output" | "embed_tokens" | "token_embd" => bail!(
                "LoRA target `{s}` is not supported: xtrain adapts the attention and MLP \
                 projections (q,k,v,o,gate,up,down), not the output layer or the embedding. On a \
                 model whose output is tied to its embedding (Llama 3.2 1B/3B, SmolLM2) an \
                 adapter there changes both or unties them, and PEFT, llama.cpp and vLLM do not \
                 agree on which; drop `{s}` from the targets"
            ),
            _ => bail!("unknown LoRA target `{s}` (choose among q,k,v,o,gate,up,down)"),
        })
    }

    pub fn parse_list(s: &str) -> Result<Vec<Projection>> {
        let mut v: Vec<Projection> = s
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(Projection::parse)
            .collect::<Result<_>>()?;
        v.sort();
        v.dedup();
        if v.is_empty() {
            bail!("--lora-targets is empty");
        }
        Ok(v)
    }

    /// The HF name of the frozen weight this adapts in layer `layer`.
    pub fn weight_name(self, layer: i64) -> String {
        format!(
            "model.layers.{layer}.{}.{}.weight",
            self.block(),
            self.module()
        )
    }

    /// PEFT's file name for A or B (`which` = "A" or "B").
    pub fn peft_name(self, layer: i64, which: &str) -> String {
        format!(
            "base_model.model.model.layers.{layer}.{}.{}.lora_{which}.weight",
            self.block(),
            self.module()
        )
    }
}

impl fmt::Display for Projection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.module())
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraConfig {
    pub r: i64,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<Projection>,
}

impl LoraConfig {
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    pub fn validate(&self) -> Result<()> {
        if self.r <= 0 {
            bail!("--lora-r must be positive, got {}", self.r);
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--lora-dropout must be in [0, 1), got {}", self.dropout);
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            bail!(
                "--lora-alpha must be a positive number, got {} (the adapter's scale is alpha / r)",
                self.alpha
            );
        }
        Ok(())
    }
}

/// A small deterministic generator (splitmix64) for initialisation and shuffling: the same seed
/// gives the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// PEFT's default init of A: `kaiming_uniform_(a=sqrt(5))`, i.e. U(-1/sqrt(in), 1/sqrt(in)).
/// (The same distribution as PEFT; the stream differs from torch's generator.)
pub fn kaiming_uniform(rng: &mut SplitMix, r: i64, fan_in: i64) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..r * fan_in)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
        .collect()
}
