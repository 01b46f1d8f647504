//! `xtrain export-gguf`: a model, with a LoRA adapter merged in or on its own, as a GGUF file
//! for llama.cpp, Ollama and LM Studio.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use xtrain::formats::atomic::Replace;
use xtrain::formats::gguf::export::{self as gguf_export, Base, ExportOptions};
use xtrain::formats::gguf::write::TensorType;

#[derive(Args)]
pub struct ExportGgufArgs {
    /// The base model: a Hugging Face model directory or repo id (org/name).
    #[arg(long)]
    pub model: PathBuf,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// A PEFT adapter directory (a run's `adapter/` or a checkpoint) to merge in, or with
    /// --lora-only to write alone.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The matrices' type: f32, f16, bf16 or q8_0 (vectors stay f32; a row that is not a
    /// whole number of q8_0 blocks is written f16).
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
    /// Write the adapter alone, as llama.cpp's LoRA adapter GGUF (`llama-cli --lora`, Ollama's
    /// ADAPTER), to apply over a GGUF of the same base model.
    #[arg(long)]
    pub lora_only: bool,
    /// The base the adapter was trained against: `nf4` (trained with --quant nf4: merged
    /// against the dequantized NF4 base), `none` (the weights as stored), or `auto` (what the
    /// run's checkpoints record, else `none`).
    #[arg(long, default_value = "auto")]
    pub base_quant: String,
    /// The GGUF file to write: new (see --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out, once the new file is complete.
    #[arg(long)]
    pub overwrite: bool,
}

/// The base the merge uses: as asked, or as the adapter's run recorded; said either way.
fn choose_base(a: &ExportGgufArgs) -> Result<Base> {
    if let Some(adapter) = &a.adapter {
        xtrain::formats::adapter_base::read_record(adapter)?;
    }
    let recorded = a.adapter.as_deref().and_then(gguf_export::recorded_quant);
    let base = match a.base_quant.as_str() {
        "nf4" => Base::Nf4,
        "none" => Base::AsStored,
        "auto" => match &recorded {
            Some((q, _)) if q == "nf4" => Base::Nf4,
            _ => Base::AsStored,
        },
        other => bail!("--base-quant {other}: choose auto, none or nf4"),
    };
    match (&recorded, base) {
        (Some((q, file)), Base::AsStored) if q == "nf4" => xtrain::esay!(
            "xtrain: warning: {} records --quant nf4, but --base-quant none merges against the \
             stored weights, which the adapter was not trained on",
            file.display()
        ),
        (Some((q, file)), Base::Nf4) if q != "nf4" => xtrain::esay!(
            "xtrain: warning: {} records --quant {q}, but --base-quant nf4 merges against the \
             NF4 base",
            file.display()
        ),
        (Some((_, file)), Base::Nf4) if a.adapter.is_some() && !a.lora_only => xtrain::esay!(
            "xtrain: merging against the NF4-dequantized base the adapter was trained on ({} \
             records --quant nf4)",
            file.display()
        ),
        (None, Base::Nf4) if a.adapter.is_some() && !a.lora_only => {
            xtrain::esay!("xtrain: merging against the NF4-dequantized base (--base-quant nf4)")
        }
        (None, Base::AsStored) if a.base_quant == "auto" && !a.lora_only => {
            if let Some(adapter) = &a.adapter {
                xtrain::esay!(
                    "xtrain: {} has no record of the base it was trained on (an adapter from \
                     elsewhere, or from an xtrain before 2026-12-07): merging against the \
                     stored weights; give --base-quant nf4 if it was trained with --quant nf4",
                    adapter.display()
                )
            }
        }
        _ => {}
    }
    Ok(base)
}

const INTERRUPTED: &str = "interrupted";

/// SIGINT/SIGTERM set the returned flag, which the export reads between tensors: it then stops
/// and removes its temp file, so an interrupted export leaves nothing behind. A second signal
/// ends the process at once (exit code 130; the next export to the same file removes the temp).
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())
            .context("cannot install signal handlers")?;
        signal_hook::flag::register(sig, flag.clone()).context("cannot install signal handlers")?;
    }
    Ok(flag)
}

pub fn export_gguf(mut a: ExportGgufArgs) -> Result<()> {
    let ty = TensorType::parse(&a.ty)?;
    if a.lora_only && a.adapter.is_none() {
        bail!("--lora-only writes an adapter: give it with --adapter DIR");
    }
    a.model = crate::cli::model::model_dir(&a.model, a.revision.as_deref(), "export-gguf")?;
    if let Some(adapter) = &a.adapter {
        if !adapter.join("adapter_config.json").is_file() {
            bail!(
                "--adapter {}: no adapter_config.json there (give a run's adapter/ or a checkpoint-N/ directory)",
                adapter.display()
            );
        }
    }
    let mut inputs = vec![a.model.as_path()];
    inputs.extend(a.adapter.as_deref());
    let out = xtrain::formats::outdir::check_writable_file("--out", &a.out, a.overwrite, &inputs)?;
    if let Some(adapter) = &a.adapter {
        // Read and checked first, so that a refusal comes before what is said of its base.
        let cfg = xtrain::model::config::LlamaConfig::load(&a.model)?;
        xtrain::formats::peft::load_adapter(adapter, &cfg)?;
        xtrain::formats::adapter_base::warn_if_another_base(adapter, &a.model, "export-gguf");
    }
    let base = choose_base(&a)?;
    if a.lora_only && base == Base::Nf4 {
        xtrain::esay!(
            "xtrain: the adapter was trained against the NF4 base; llama.cpp applies it over \
             the base GGUF it is given, which differs from that base by NF4's rounding"
        );
    }
    let opts = ExportOptions {
        model: &a.model,
        adapter: a.adapter.as_deref(),
        ty,
        base,
        lora_only: a.lora_only,
        replace: if a.overwrite {
            Replace::Yes
        } else {
            Replace::No
        },
    };
    let interrupted = stop_on_signals()?;
    let t0 = Instant::now();
    let mut shown = 0;
    let mut progress = |done: usize, total: usize, name: &str| -> Result<()> {
        if interrupted.load(Ordering::SeqCst) {
            bail!(INTERRUPTED);
        }
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 || done == total {
            shown = pct;
            let elapsed = t0.elapsed().as_secs_f64();
            let eta = elapsed / done as f64 * (total - done) as f64;
            xtrain::esay!(
                "exporting: {pct}% ({done}/{total} tensors, {name}), {elapsed:.0}s, about {eta:.0}s left"
            );
        }
        Ok(())
    };
    let written = if opts.lora_only {
        gguf_export::export_lora(&opts, &out, &mut progress)
    } else {
        gguf_export::export_merged(&opts, &out, &mut progress, &mut |n| {
            xtrain::esay!("xtrain: {n}")
        })
    };
    let written = match written {
        Err(_) if interrupted.load(Ordering::SeqCst) => {
            xtrain::esay!(
                "xtrain: export-gguf interrupted: {} was not written (its temp file is removed)",
                out.display()
            );
            std::process::exit(130);
        }
        w => w?,
    };
    let what = match (opts.lora_only, opts.adapter.is_some()) {
        (true, _) => "LoRA adapter",
        (false, true) => "merged model",
        (false, false) => "model",
    };
    xtrain::say!(
        "wrote {} ({what}, {}, {}, {}) in {:.1}s",
        out.display(),
        ty.name(),
        xtrain::words::count(written.tensors, "tensor"),
        xtrain::words::gib(written.bytes as i64),
        t0.elapsed().as_secs_f64()
    );
    if !written.in_f16.is_empty() {
        let n = written.in_f16.len();
        let block = ty.layout().block;
        xtrain::say!(
            "{} in f16, not {}: {} rows are not a whole number of {}'s {block}-value \
             blocks ({})",
            if n == 1 {
                "1 matrix is".to_string()
            } else {
                format!("{n} matrices are")
            },
            ty.name(),
            if n == 1 { "its" } else { "their" },
            ty.name(),
            xtrain::formats::outdir::some_names(&written.in_f16)
        );
    }
    Ok(())
}
