//! The program's form as flags: the choices of how the step is written that a user may make
//! (one default each, the same for every target), said by `xtrain compile` and `xtrain train`.

use crate::program::{Remat, StepSpec};

impl StepSpec {
    /// The flags of the program's form as the spec has them (the same for every target; see
    /// docs/architecture.md), so that a user sees what the defaults chose.
    pub fn form(&self) -> String {
        let spec = self;
        let bf16 = spec.dtype == hlo::DType::BF16;
        let mut flags = Vec::new();
        if bf16 {
            flags.push(format!("--matmul-result {}", spec.matmul_result.name()));
            flags.push(format!(
                "--attention-scores {}",
                spec.attention_scores.name()
            ));
        }
        let cp = spec.context_size();
        match spec.key_block {
            Some(k) if cp > 1 => {
                let tb = crate::model::context::key_block(spec.seq, cp, k);
                let c = spec.seq / (2 * cp);
                let padded = crate::model::flash::padded(c, tb);
                let pad = match padded > c {
                    true => format!(", each padded to {padded}"),
                    false => String::new(),
                };
                flags.push(format!(
                    "--key-block {k} (blocks of {tb} {}; the sequence is split into chunks of {c}{pad})",
                    if tb == 1 { "token" } else { "tokens" }
                ))
            }
            Some(k) => {
                // Two halves of whole blocks: a length that is not one is padded at its end,
                // said as it is with a context axis.
                let tb = crate::model::flash::key_block(spec.seq, k);
                let padded = crate::model::flash::padded(spec.seq, 2 * tb);
                let pad = match padded > spec.seq {
                    true => {
                        format!("; the sequence is padded to {padded}, two halves of whole blocks")
                    }
                    false => String::new(),
                };
                flags.push(format!("--key-block {k} (blocks of {tb}{pad})"))
            }
            None => {
                flags.push("--key-block off".to_string());
                flags.push(format!(
                    "--attention-block {}",
                    crate::model::attention::query_block(spec.seq, spec.attention_block)
                ));
            }
        }
        flags.push(match spec.mlp_chunk {
            Some(n) if n < spec.seq => {
                let tiles = (spec.seq + n - 1) / n;
                let pad = match tiles * n > spec.seq {
                    true => format!(", the last padded to {n}"),
                    false => String::new(),
                };
                format!("--mlp-chunk {n} ({tiles} tiles{pad})")
            }
            Some(n) => format!("--mlp-chunk {n} (the whole sequence)"),
            None => "--mlp-chunk off".to_string(),
        });
        if spec.remat == Remat::Layer {
            flags.push(format!("--keep-softmax-stats {}", spec.keep_softmax_stats));
        }
        if spec.mesh.is_some() {
            flags.push(format!(
                "--pin-mlp-activations {}",
                spec.pin_mlp_activations
            ));
        }
        flags.join(", ")
    }
}
