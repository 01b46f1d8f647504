//! Ctrl-C (SIGINT) and SIGTERM for the commands without a safe point to stop at (`plan`, whose
//! time is in the compiler, and `import-gguf`): the command ends at once, saying what became of
//! its output and removing the temp files it was writing, with 128 + the signal's number (130,
//! 143). A handler can neither print nor remove files; a thread watching its flag does both.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The flag [`end_at_once`]'s handlers set, once installed.
static HEARD: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Whether a signal has been heard and its watcher is ending the process: the main thread's
/// errors from then on are the interruption's doing (a compile whose dump directory the cleanup
/// removed), and the watcher, not the error, says what happened and sets the exit code.
pub fn ending() -> bool {
    HEARD.get().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// What an interrupted command leaves: `said` (what became of its output), and its temp files:
/// its own (this process's) temp names of `out` beside it, and the system temp dir's entries
/// starting with `temp_prefixes` followed by this process's id.
pub struct OnSignal {
    pub said: String,
    pub out: Option<PathBuf>,
    pub temp_prefixes: &'static [&'static str],
}

/// Install the handlers: the first SIGINT or SIGTERM ends the command as [`OnSignal`] says.
pub fn end_at_once(on: OnSignal) -> Result<()> {
    let flag = Arc::new(AtomicBool::new(false));
    let heard = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone()).context("cannot install signal handlers")?;
        signal_hook::flag::register_usize(sig, heard.clone(), sig as usize)
            .context("cannot install signal handlers")?;
    }
    let _ = HEARD.set(flag.clone());
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(50));
        if !flag.load(Ordering::SeqCst) {
            continue;
        }
        xtrain::device::dumps::close();
        remove_own_temps(&on);
        xtrain::esay!("\nxtrain: interrupted; {}", on.said);
        let _ = std::io::stderr().flush();
        // Other threads may be inside the plugin: no exit handlers run under them.
        signal_hook::low_level::exit(128 + heard.load(Ordering::SeqCst) as i32);
    });
    Ok(())
}

/// Remove this process's temp files until a look finds none (at most 200 looks, 10 ms apart):
/// the plugin's compile thread goes on meanwhile, and a file it writes between a directory's
/// listing and its removal keeps the directory. Its dump directories lie in a root it reaches
/// through a descriptor (`device::dumps`), so once that root is gone it cannot come back.
fn remove_own_temps(on: &OnSignal) {
    for _ in 0..200 {
        if remove_own_temps_once(on) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// One pass of [`remove_own_temps`]: true when it found nothing to remove.
fn remove_own_temps_once(on: &OnSignal) -> bool {
    let mut found = false;
    let pid = std::process::id();
    if let Some(out) = &on.out {
        let dir = out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if let Some(name) = out.file_name().map(|n| n.to_string_lossy().into_owned()) {
            xtrain::formats::outdir::remove_temps_of(dir, &name, pid);
        }
    }
    let tmp = std::env::temp_dir();
    for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if on
            .temp_prefixes
            .iter()
            .any(|p| name.starts_with(&format!("{p}{pid}-")))
        {
            found = true;
            let path = e.path();
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
        }
    }
    !found
}
