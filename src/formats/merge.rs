//! `xtrain merge`: fold a LoRA adapter into the base weights, W' = W + (alpha/r) B A, and write a
//! complete Hugging Face checkpoint (weights in the base model's dtype, config and tokenizer
//! files copied).

use crate::formats::host::convert;
use crate::formats::safetensors::{SafeTensors, WeightFiles};
use crate::model::config::LlamaConfig;
use anyhow::{Context, Result};
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::Path;

/// W [out, in] + scale * B [out, r] @ A [r, in], in f32.
pub fn merged(
    w: &[f32],
    a: &[f32],
    b: &[f32],
    out: usize,
    inp: usize,
    r: usize,
    scale: f32,
) -> Vec<f32> {
    let mut res = w.to_vec();
    for o in 0..out {
        for k in 0..r {
            let bk = b[o * r + k] * scale;
            if bk == 0.0 {
                continue;
            }
            let row = &a[k * inp..(k + 1) * inp];
            for (x, &av) in res[o * inp..(o + 1) * inp].iter_mut().zip(row) {
                *x += bk * av;
            }
        }
    }
    res
}

/// Merge `adapter` into `model` and write the checkpoint to `out`. `nf4_base`, asked once the
/// adapter is read and checked: whether it was trained with `--quant nf4`, so that it is folded
/// into the base as training saw it: every layer's projection matrix NF4-quantized and
/// dequantized (in f32), then stored in its own type.
pub fn merge(
    model: &Path,
    adapter: &Path,
    out: &Path,
    replace: crate::formats::atomic::Replace,
    nf4_base: &dyn Fn() -> Result<bool>,
) -> Result<()> {
    let cfg = LlamaConfig::load(model)?;
    let (lora, tensors) = crate::formats::peft::load_adapter(adapter, &cfg)?;
    let nf4_base = nf4_base()?;
    let files = WeightFiles::open(model)?;
    crate::formats::weights::check(&files, &cfg)?;
    let scale = lora.scale() as f32;
    let mut merged_tensors: BTreeMap<String, HostTensor> = BTreeMap::new();
    for name in files.names() {
        let mut t = files.read(name)?;
        if nf4_base && name.starts_with("model.layers.") && name.ends_with("_proj.weight") {
            let w = convert(&t, pjrt::ElementType::F32)?.to_f32()?;
            let nf4 = crate::model::quant::quantize(&w)
                .map_err(|e| anyhow::anyhow!("{name}: {e}: the base checkpoint is damaged"))?;
            let back = HostTensor::from_f32(&crate::model::quant::dequantize(&nf4), &t.dims);
            t = convert(&back, t.ty)?;
        }
        merged_tensors.insert(name.clone(), t);
    }
    for l in 0..cfg.num_hidden_layers {
        for &target in &lora.targets {
            let wname = target.weight_name(l);
            let w = merged_tensors
                .get(&wname)
                .with_context(|| format!("no `{wname}`"))?;
            let ty = w.ty;
            let (outd, ind) = (w.dims[0] as usize, w.dims[1] as usize);
            let a = tensors[&target.peft_name(l, "A")].to_f32()?;
            let b = tensors[&target.peft_name(l, "B")].to_f32()?;
            let m = merged(
                &convert(w, pjrt::ElementType::F32)?.to_f32()?,
                &a,
                &b,
                outd,
                ind,
                lora.r as usize,
                scale,
            );
            let t = convert(&HostTensor::from_f32(&m, &[outd as i64, ind as i64]), ty)?;
            merged_tensors.insert(wname, t);
        }
    }
    crate::formats::atomic::write_dir_atomic_as(out, replace, |tmp| {
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        crate::formats::safetensors::write(&tmp.join("model.safetensors"), &merged_tensors, &meta)?;
        for f in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
        ] {
            let src = model.join(f);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(f))
                    .with_context(|| format!("copying {}", src.display()))?;
            }
        }
        Ok(())
    })?;
    let _ = SafeTensors::open(&out.join("model.safetensors"))?;
    Ok(())
}
