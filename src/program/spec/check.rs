//! The checks that make a [`StepSpec`] one a program can be built for, each refusal naming its
//! flag.

use super::attention::{AttentionBlockUnused, KEY_BLOCKS_ABOVE};
use super::memory::Remat;
use super::step::StepSpec;
use crate::model::config::LlamaConfig;
use anyhow::{bail, Result};

pub(in crate::program) fn check_spec(spec: &StepSpec) -> Result<()> {
    spec.lora.validate()?;
    if !spec.offload.is_none() && !spec.remat.scan() {
        bail!(
            "--offload {} needs looped layers (--remat layer or save-proj): layers are copied to \
             and from host memory one at a time inside the layer loop",
            spec.offload.name()
        );
    }
    spec.adam.validate()?;
    if spec.batch < 1 {
        bail!("--batch-size must be at least 1, got {}", spec.batch);
    }
    if spec.seq < 2 {
        bail!(
            "--seq must be at least 2 (a token and the next one it predicts), got {}",
            spec.seq
        );
    }
    if spec.seq > spec.model.max_position_embeddings {
        bail!(
            "--seq {} is longer than the model's max_position_embeddings {} (config.json): it was \
             not trained on positions past that; use --seq {} or less",
            spec.seq,
            spec.model.max_position_embeddings,
            spec.model.max_position_embeddings
        );
    }
    if let Some(w) = spec.model.sliding_window {
        if spec.seq > w {
            bail!(
                "--seq {} is longer than the model's sliding window of {w} tokens (config.json's \
                 `sliding_window`): its layers let a token see only the last {w} tokens, itself \
                 included, which xtrain's attention does not implement; use --seq {w} or less, \
                 where the window changes nothing",
                spec.seq
            );
        }
    }
    if spec.quant.is_nf4() {
        check_nf4_blocks(&spec.model)?;
    }
    check_lora_rank(spec)?;
    if let Some(m) = &spec.mesh {
        crate::program::sharding::check_axes(&m.axes, &m.rules)?;
        let mut tensors = crate::model::tensors::frozen_args(&spec.model, true);
        tensors.extend(
            crate::model::tensors::lora_args(&spec.model, &spec.lora, true)
                .into_iter()
                .map(|t| (t.name, t.shape)),
        );
        tensors.push(("input_ids".into(), vec![spec.batch, spec.seq]));
        // Before the splits: a length the context axis cannot cut is said as such, not as an
        // axis that splits nothing (seq 4100 over context=3).
        check_context_length(spec)?;
        crate::program::sharding::check_splits(&m.axes, &m.rules, &tensors)?;
    }
    if let Some(c) = spec.loss_chunk {
        if spec.remat == Remat::None {
            bail!(
                "--loss-chunk {c} computes the loss in chunks after the looped layers; with \
                 --remat none the layers are unrolled and the loss is computed whole, so the \
                 flag would do nothing: give --remat layer or save-proj, or leave it out"
            );
        }
        if c < 1 || spec.seq % c != 0 {
            bail!(
                "--loss-chunk {c} must be a positive divisor of the sequence length {}",
                spec.seq
            );
        }
    }
    if spec.grad_accum < 1 {
        bail!("--grad-accum must be at least 1, got {}", spec.grad_accum);
    }
    if let Some(p) = &spec.dpo {
        p.validate()?;
        // Each microbatch holds whole pairs (rows 2i and 2i + 1 of the batch).
        if spec.batch % 2 != 0 || spec.examples() % spec.grad_accum != 0 {
            bail!(
                "--grad-accum {} must divide the batch size {} (pairs; {} rows)",
                spec.grad_accum,
                spec.examples(),
                spec.batch
            );
        }
    }
    if spec.batch % spec.grad_accum != 0 {
        bail!(
            "--grad-accum {} must divide the batch size {}",
            spec.grad_accum,
            spec.batch
        );
    }
    if spec.keep_softmax_stats && spec.remat == Remat::None {
        bail!(
            "--keep-softmax-stats is for --remat layer (save-proj keeps the statistics anyway); \
             with --remat none the backward pass recomputes nothing"
        );
    }
    if spec.pin_mlp_activations && spec.mesh.is_none() {
        bail!(
            "--pin-mlp-activations places activations on a device mesh, but this step runs on \
             one device; give --mesh (or a --target of several devices), or leave the flag out"
        );
    }
    check_attention_form(spec)?;
    check_mlp_chunk(spec)?;
    if let Some(r) = spec.attention_block {
        if r < 1 || spec.seq % r != 0 {
            bail!(
                "--attention-block {r} must be a positive divisor of the sequence length {}",
                spec.seq
            );
        }
    }
    Ok(())
}

/// The attention's form: a key block, a context split and the query blocks of the whole-key
/// form that go together.
fn check_attention_form(spec: &StepSpec) -> Result<()> {
    if let Some(r) = spec.attention_block {
        if spec.context_size() > 1 {
            return Err(AttentionBlockUnused {
                block: r,
                why: "which a sequence split over the context axis does not use (it attends \
                      over key/value blocks: --key-block sets their size)"
                    .into(),
                other: String::new(),
            }
            .into());
        }
        if let Some(k) = spec.key_block {
            return Err(AttentionBlockUnused {
                block: r,
                why: format!(
                    "with key/value blocks of {k} (--key-block {k}, or auto above \
                     {KEY_BLOCKS_ABOVE} tokens) the query blocks are the key blocks"
                ),
                other: ", or --key-block off to keep every key at once".to_string(),
            }
            .into());
        }
    }
    if let Some(k) = spec.key_block {
        if k < 1 {
            bail!("--key-block must be a positive number of tokens, got {k}");
        }
    }
    if spec.context_size() > 1 && spec.key_block.is_none() {
        bail!(
            "a sequence split over the context axis is attended over key/value blocks: give \
             --key-block N or auto, not off"
        );
    }
    Ok(())
}

/// `--mlp-chunk N`: a positive number of positions, at most the sequence, on a sequence that
/// is not split over a context axis.
fn check_mlp_chunk(spec: &StepSpec) -> Result<()> {
    let Some(n) = spec.mlp_chunk else {
        return Ok(());
    };
    if n < 1 {
        bail!("--mlp-chunk must be a positive number of positions, got {n}");
    }
    if n > spec.seq {
        bail!(
            "--mlp-chunk {n} is longer than the sequence ({} tokens): the MLP would run whole; \
             give --mlp-chunk {} or less, or off",
            spec.seq,
            spec.seq
        );
    }
    let cp = spec.context_size();
    if cp > 1 {
        bail!(
            "--mlp-chunk {n} tiles the MLP over the sequence, but the mesh splits the sequence \
             over {cp} devices (its context axis), each holding a part of it already: give \
             --mlp-chunk off (or auto, which is off on such a mesh)"
        );
    }
    Ok(())
}

/// B A of rank r on a projection [out, in] has rank at most min(in, out): a larger r only adds
/// memory and time, and is refused naming the projection.
fn check_lora_rank(spec: &StepSpec) -> Result<()> {
    if let Some((target, most)) = spec
        .lora
        .targets
        .iter()
        .map(|&t| {
            let (i, o) = crate::model::tensors::projection_dims(&spec.model, t);
            (t, i.min(o))
        })
        .min_by_key(|(_, d)| *d)
    {
        if spec.lora.r > most {
            bail!(
            "--lora-r {} is larger than the adapted `{}` projection's smaller dimension ({most}): \
             an update B A of that shape has rank {most} at most, so the rest would only cost \
             memory and time; use --lora-r {most} or less",
            spec.lora.r,
            target.module()
        );
        }
    }
    Ok(())
}

/// NF4 quantizes each projection in blocks of [`crate::model::quant::BLOCK`] values: every
/// projection's size must be a multiple of it (the flag is refused here, before a builder
/// meets a shape it cannot split).
fn check_nf4_blocks(cfg: &LlamaConfig) -> Result<()> {
    let block = crate::model::quant::BLOCK as i64;
    for (kind, shape) in crate::model::tensors::layer_kinds(cfg) {
        let n: i64 = shape.iter().product();
        if crate::model::tensors::is_projection(kind) && n % block != 0 {
            bail!(
                "--quant nf4 quantizes in blocks of {block} values, but this model's `{}` has {} = {n} values, not a multiple of {block}; train it without --quant",
                kind.trim_end_matches(".weight"),
                shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
            );
        }
    }
    Ok(())
}

/// Over a context axis of CP devices the sequence is cut in 2 x CP chunks (two per device, so
/// that the causal work is balanced): the length must be a multiple of 2 CP.
fn check_context_length(spec: &StepSpec) -> Result<()> {
    let cp = spec.context_size();
    if cp > 1 && spec.seq % (2 * cp) != 0 {
        bail!(
            "the mesh splits the sequence over {cp} devices, in 2 x {cp} chunks (two per \
             device, so that the causal work is balanced): --seq {} must be a multiple of {}",
            spec.seq,
            2 * cp
        );
    }
    Ok(())
}
