//! `xtrain import-gguf` and `xtrain merge`'s output: model directories written from other forms.

use anyhow::Result;

pub fn import_gguf(file: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut shown = 0;
    xtrain::formats::gguf::import(file, out, |done, total| {
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 || done == total {
            shown = pct;
            eprintln!("importing {}: {pct}% of {total} tensors", file.display());
        }
    })?;
    println!(
        "wrote {} in {:.1}s",
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
