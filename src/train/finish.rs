//! How an invocation of `xtrain train` ends: the signals that stop it at the next safe point,
//! how it ended ([`Finished`]), and what is said then (how to continue it, what happened to the
//! output dir, the steps skipped).

use crate::train::checkpoint::resume_command;
use crate::train::options::TrainOptions;
use crate::train::output::RunDir;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// The number of the signal that stopped the run (0: none yet), set by the handlers of
/// [`stop_on_signals`].
static SIGNAL: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// The exit code of a run a signal stopped: 128 + the signal's number, the shell's convention
/// (130 for SIGINT, 143 for SIGTERM); SIGINT's where none was heard (the code is then a
/// Ctrl-C's).
pub(super) fn interrupted_code() -> i32 {
    let heard = SIGNAL.get().map_or(0, |s| s.load(Ordering::SeqCst));
    128 + match heard {
        0 => signal_hook::consts::SIGINT,
        n => n as i32,
    }
}

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
/// interrupted (with the command that continues it; an interrupted process exits with 128 + the
/// signal's number: 130 for SIGINT, 143 for SIGTERM),
/// or failed (the error, with what became of the output dir).
pub(super) fn end(opts: &TrainOptions, out: &mut RunDir, finished: Result<Finished>) -> Result<()> {
    match finished {
        Ok(Finished::Complete) => out.complete(),
        Ok(Finished::Stopped(dir)) => {
            crate::esay!(
                "xtrain: stopped after step {} (--stop-after); continue with `{}`",
                dir.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("checkpoint-"))
                    .unwrap_or("?"),
                resume_command(&dir)
            );
            if let Some(note) = out.stopped() {
                crate::esay!("xtrain: {note}");
            }
            Ok(())
        }
        Ok(Finished::Interrupted(saved)) => {
            say_interrupted(opts, out, saved, "before a step was taken");
            std::process::exit(interrupted_code());
        }
        Err(e) => match out.failed() {
            Some(note) => Err(anyhow::anyhow!("{e:#}\n({note})")),
            None => Err(e),
        },
    }
}

/// Say that a signal ended the run, with the checkpoint it saved (None: none, `when` says
/// when it came) and the command that continues it, and settle the output dir.
fn say_interrupted(opts: &TrainOptions, out: &mut RunDir, saved: Option<PathBuf>, when: &str) {
    match saved {
        Some(dir) => crate::esay!(
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
            crate::esay!("\nxtrain: interrupted {when}; nothing new to save{again}");
        }
    }
    if let Some(note) = out.failed() {
        crate::esay!("xtrain: {note}");
    }
}

/// What the first signal does during a phase with no safe point (see [`Signals::abandonable`]);
/// it ends the process.
pub(super) type Abandon = Box<dyn FnOnce() + Send>;

/// Abandon the run during `phase` (`compiling the step`): say so as an interrupted run before
/// its first step, settle the output dir and end the process ([`interrupted_code`]) at once: the
/// phase's thread is inside the plugin, so the process ends without running exit handlers
/// under it (as a second Ctrl-C does).
pub(super) fn abandon(opts: &TrainOptions, out: &Arc<Mutex<RunDir>>, phase: &str) -> Abandon {
    let (opts, out, when) = (
        opts.clone(),
        out.clone(),
        format!("while {phase} (abandoned it)"),
    );
    Box::new(move || {
        say_interrupted(&opts, &mut locked(&out), None, &when);
        let _ = std::io::stderr().flush();
        signal_hook::low_level::exit(interrupted_code());
    })
}

/// A mutex's value, also after a thread panicked holding it.
pub(super) fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The steps of this invocation that `--skip-nonfinite-steps` skipped (of `taken`, from step
/// `first`), said; a run whose every step was skipped trained nothing and is an error.
pub(super) fn check_skipped(skipped: u64, taken: u64, first: u64) -> Result<()> {
    if skipped > 0 {
        crate::esay!(
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

/// How a run hears SIGINT and SIGTERM (see [`stop_on_signals`]).
pub(super) struct Signals {
    /// Set by the first signal: the run stops at the next safe point.
    pub interrupted: Arc<AtomicBool>,
    /// What the first signal does instead, while a phase without a safe point runs.
    abandon: Arc<Mutex<Option<Abandon>>>,
    /// Set for a process of a run of several (its name, for the message): the first signal
    /// ends it at once.
    at_once: Arc<Mutex<Option<String>>>,
    /// The run's output dir once known: a second signal names its newest checkpoint.
    out: Arc<Mutex<Option<PathBuf>>>,
}

impl Signals {
    /// Whether a signal asked the run to stop.
    pub fn stop(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    /// Run `phase`, which has no safe point to stop at (compiling the step is one call into the
    /// plugin, minutes on a large program, that nothing interrupts), so that a signal during it
    /// (or before it, not yet acted on) runs `abandon` at once, which ends the process. Nothing
    /// is lost: no step was taken.
    /// Make the first signal end this process at once, in any wait (the rendezvous, a barrier,
    /// a gather) or step, with a message and exit code 130 (SIGINT) or 143 (SIGTERM): a process
    /// of a run of several (`name`) has no safe point of its own, since the others cannot stop
    /// at the same one, and they end as for a lost peer when its session closes.
    pub fn end_at_once(&self, name: String) {
        *locked(&self.at_once) = Some(name);
    }

    /// The run's output dir, whose newest checkpoint a second signal names.
    pub fn set_out(&self, out: &std::path::Path) {
        *locked(&self.out) = Some(out.to_path_buf());
    }

    pub fn abandonable<R>(&self, abandon: Abandon, phase: impl FnOnce() -> R) -> R {
        *locked(&self.abandon) = Some(abandon);
        let r = phase();
        // Waits for an `abandon` under way, which ends the process.
        locked(&self.abandon).take();
        r
    }
}

/// SIGINT/SIGTERM set the returned flag: the run stops at the next safe point (after the current
/// step, with a checkpoint; or before the first step, once the data or the first evaluation is
/// done), or, during a phase without one (compiling the step), abandons it at once
/// ([`Signals::abandonable`]). A second signal ends the process at once. Either way the exit
/// code is 128 + the signal's number ([`interrupted_code`]).
pub(super) fn stop_on_signals() -> Result<Signals> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let heard = SIGNAL.get_or_init(Arc::default).clone();
    let count = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let n = count.clone();
        // SAFETY: the handler only adds to an atomic, which is async-signal-safe.
        unsafe {
            signal_hook::low_level::register(sig, move || _ = n.fetch_add(1, Ordering::SeqCst))
        }
        .context("cannot install signal handlers")?;
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
        signal_hook::flag::register_usize(sig, heard.clone(), sig as usize)
            .context("cannot install signal handlers")?;
    }
    let abandon: Arc<Mutex<Option<Abandon>>> = Arc::default();
    let at_once: Arc<Mutex<Option<String>>> = Arc::default();
    let out: Arc<Mutex<Option<PathBuf>>> = Arc::default();
    let dir = out.clone();
    // A signal handler can neither print nor abandon; this thread says what the first signal
    // does, and abandons a phase without a safe point.
    let (flag, action) = (interrupted.clone(), abandon.clone());
    let (sig, now) = (heard.clone(), at_once.clone());
    std::thread::spawn(move || {
        let mut said = false;
        loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if !flag.load(Ordering::SeqCst) {
                continue;
            }
            if count.load(Ordering::SeqCst) >= 2 {
                quit_at_once(locked(&dir).as_deref(), sig.load(Ordering::SeqCst));
            }
            if let Some(name) = locked(&now).as_ref() {
                end_now(name, sig.load(Ordering::SeqCst));
            }
            // Held while abandoning, so that the phase's end waits for the process to end.
            let mut pending = locked(&action);
            if let Some(abandon) = pending.take() {
                abandon();
            }
            drop(pending);
            if !said {
                crate::esay!(
                    "\nxtrain: stopping at the next safe point (press Ctrl-C again to quit at once)"
                );
                said = true;
            }
        }
    });
    Ok(Signals {
        interrupted,
        abandon,
        at_once,
        out,
    })
}

/// A second signal: end the process at once (other threads may be inside the plugin, so no
/// exit handlers run), naming the run's newest checkpoint to continue from.
fn quit_at_once(out: Option<&std::path::Path>, sig: usize) -> ! {
    let code = match sig as i32 {
        signal_hook::consts::SIGTERM => 143,
        _ => 130,
    };
    let newest = out.and_then(newest_checkpoint);
    match newest {
        Some(dir) => crate::esay!(
            "\nxtrain: quitting at once (a second signal); the newest checkpoint is {} \
             (continue with `{}`)",
            dir.display(),
            resume_command(&dir)
        ),
        None => crate::esay!(
            "\nxtrain: quitting at once (a second signal); the run has no checkpoint yet"
        ),
    }
    let _ = std::io::stderr().flush();
    signal_hook::low_level::exit(code)
}

/// The run directory's `checkpoint-K` with the largest K.
pub(super) fn newest_checkpoint(out: &std::path::Path) -> Option<PathBuf> {
    std::fs::read_dir(out)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let k: u64 = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path().is_dir().then_some((k, e.path()))
        })
        .max_by_key(|(k, _)| *k)
        .map(|(_, p)| p)
}

/// End a process of a run of several on signal `sig`: say so, then end without running exit
/// handlers (other threads may be inside the plugin), with 128 + the signal's number.
fn end_now(name: &str, sig: usize) -> ! {
    let (what, code) = match sig as i32 {
        signal_hook::consts::SIGTERM => ("SIGTERM", 143),
        _ => ("SIGINT", 130),
    };
    crate::esay!(
        "\nxtrain: {name}: {what}: ending now (a process of a run of several has no safe point \
         of its own; the others end as for a lost process)"
    );
    let _ = std::io::stderr().flush();
    signal_hook::low_level::exit(code)
}

#[cfg(test)]
mod tests {
    /// A second signal names the checkpoint with the largest step, by number (10 after 9), and
    /// nothing else in the run dir.
    #[test]
    fn the_newest_checkpoint_is_the_largest_step() {
        let dir = std::env::temp_dir().join(format!("xtrain-newest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["checkpoint-9", "checkpoint-10", "step-12", "checkpoint-x"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("checkpoint-11"), b"not a dir").unwrap();
        assert_eq!(
            super::newest_checkpoint(&dir),
            Some(dir.join("checkpoint-10"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(super::newest_checkpoint(&dir), None);
    }
}
