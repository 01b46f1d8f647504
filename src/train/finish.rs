//! How an invocation of `xtrain train` ends: the signals that stop it at the next safe point,
//! how it ended ([`Finished`]), and what is said then (how to continue it, what happened to the
//! output dir, the steps skipped).

use crate::train::checkpoint::resume_command;
use crate::train::options::TrainOptions;
use crate::train::output::RunDir;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// How a run's invocation ended, short of an error.
pub(super) enum Finished {
    /// The last step was taken; the adapter is saved.
    Complete,
    /// `--stop-after` ended it early, with this checkpoint.
    Stopped(PathBuf),
    /// A signal ended it, with this checkpoint (None: before any step was taken).
    Interrupted(Option<PathBuf>),
}

/// Say how the run ended and settle its output dir: complete, stopped by `--stop-after` or
/// interrupted (with the command that continues it; an interrupted process exits with code 130),
/// or failed (the error, with what became of the output dir).
pub(super) fn end(opts: &TrainOptions, out: &mut RunDir, finished: Result<Finished>) -> Result<()> {
    match finished {
        Ok(Finished::Complete) => out.complete(),
        Ok(Finished::Stopped(dir)) => {
            eprintln!(
                "xtrain: stopped after step {} (--stop-after); continue with `{}`",
                dir.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("checkpoint-"))
                    .unwrap_or("?"),
                resume_command(&dir)
            );
            if let Some(note) = out.stopped() {
                eprintln!("xtrain: {note}");
            }
            Ok(())
        }
        Ok(Finished::Interrupted(saved)) => {
            match saved {
                Some(dir) => eprintln!(
                    "\nxtrain: interrupted; saved {} (continue with `{}`)",
                    dir.display(),
                    resume_command(&dir)
                ),
                None => {
                    let again = opts
                        .resume
                        .as_ref()
                        .map(|c| format!(" (continue with `{}`)", resume_command(c)))
                        .unwrap_or_default();
                    eprintln!(
                        "\nxtrain: interrupted before a step was taken; nothing new to save{again}"
                    );
                }
            }
            if let Some(note) = out.failed() {
                eprintln!("xtrain: {note}");
            }
            std::process::exit(130);
        }
        Err(e) => match out.failed() {
            Some(note) => Err(anyhow::anyhow!("{e:#}\n({note})")),
            None => Err(e),
        },
    }
}

/// The steps of this invocation that `--skip-nonfinite-steps` skipped (of `taken`, from step
/// `first`), said; a run whose every step was skipped trained nothing and is an error.
pub(super) fn check_skipped(skipped: u64, taken: u64, first: u64) -> Result<()> {
    if skipped > 0 {
        eprintln!(
        "xtrain: skipped {} of {taken} steps (--skip-nonfinite-steps: their loss, gradient or update was not finite or blew the weights up; metrics.jsonl marks them `nonfinite`)",
        skipped
    );
        if skipped == taken {
            bail!(
            "every step {} was skipped ({taken} of {taken}): nothing was trained, so no adapter is written; lower --lr (or look at the data) and start again",
            if first > 0 {
                format!("since step {first}")
            } else {
                "of the run".to_string()
            }
        );
        }
    }
    Ok(())
}

/// SIGINT/SIGTERM set the returned flag: the run stops at the next safe point (after the current
/// step, with a checkpoint; or before the first step, once the data, the compile or the first
/// evaluation is done). A second signal ends the process at once (exit code 130).
pub(super) fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(sig, 130, interrupted.clone())
            .context("cannot install signal handlers")?;
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
    }
    // A signal handler cannot print; this thread says what the first signal does.
    let flag = interrupted.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if flag.load(Ordering::SeqCst) {
            eprintln!(
                "\nxtrain: stopping at the next safe point (press Ctrl-C again to quit at once)"
            );
            break;
        }
    });
    Ok(interrupted)
}
