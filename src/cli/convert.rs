//! `xtrain import-gguf` and `xtrain merge`: model directories written from other forms, each
//! into a new or empty `--out` (or, with `--overwrite`, replacing it once complete).

use anyhow::Result;
use std::path::Path;
use xtrain::formats::atomic::Replace;
use xtrain::formats::outdir::check_writable_dir;

pub fn import_gguf(file: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let out = check_writable_dir(out, overwrite, &[file])?;
    let t0 = std::time::Instant::now();
    let mut shown = 0;
    xtrain::formats::gguf::import::import(file, &out, Replace::when(overwrite), |done, total| {
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 || done == total {
            shown = pct;
            xtrain::esay!("importing {}: {pct}% of {total} tensors", file.display());
        }
    })?;
    xtrain::say!(
        "wrote {} in {:.1}s",
        out.display(),
        t0.elapsed().as_secs_f64()
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
