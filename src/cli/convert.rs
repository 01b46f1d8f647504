//! `xtrain import-gguf` and `xtrain merge`: model directories written from other forms, each
//! into a new or empty `--out` (or, with `--overwrite`, replacing it once complete).

use anyhow::{bail, Result};
use std::path::Path;
use std::sync::atomic::Ordering;
use xtrain::formats::atomic::Replace;
use xtrain::formats::outdir::check_writable_dir;

/// Import a GGUF file as a model directory. Ctrl-C (or SIGTERM) stops it between tensors:
/// the half-written directory is removed and nothing is left at `--out`.
pub fn import_gguf(file: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let out = check_writable_dir(out, overwrite, &[file])?;
    let interrupted = super::export::stop_on_signals()?;
    let t0 = std::time::Instant::now();
    let mut shown = 0;
    let done = xtrain::formats::gguf::import::import(
        file,
        &out,
        Replace::when(overwrite),
        |done, total| {
            if interrupted.load(Ordering::SeqCst) {
                bail!(super::export::INTERRUPTED);
            }
            let pct = done * 100 / total.max(1);
            if pct >= shown + 10 || done == total {
                shown = pct;
                xtrain::esay!("importing {}: {pct}% of {total} tensors", file.display());
            }
            Ok(())
        },
    );
    match done {
        Err(_) if interrupted.load(Ordering::SeqCst) => {
            xtrain::esay!(
                "xtrain: import-gguf interrupted: {} was not written (its temp directory is \
                 removed{})",
                out.display(),
                if overwrite {
                    "; what was there is as it was"
                } else {
                    ""
                }
            );
            std::process::exit(130);
        }
        d => d?,
    }
    let g = xtrain::formats::gguf::read::Gguf::open(file)?;
    let (_, (family, why)) = xtrain::formats::gguf::import::arch_and_family(&g)?;
    xtrain::say!(
        "wrote {} in {:.1}s: a {} model{}",
        out.display(),
        t0.elapsed().as_secs_f64(),
        family.model_type(),
        why.map(|w| format!(" ({w})")).unwrap_or_default(),
    );
    Ok(())
}

pub fn merge(model: &Path, adapter: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let out = check_writable_dir(out, overwrite, &[model, adapter])?;
    xtrain::formats::gguf::export::warn_if_trained_on_nf4(adapter, "merge");
    xtrain::formats::merge::merge(model, adapter, &out, Replace::when(overwrite))?;
    xtrain::say!("wrote {}", out.display());
    Ok(())
}
