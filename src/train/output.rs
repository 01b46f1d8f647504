//! A run's output directory (`--out`): claimed for the life of the run with an exclusive lock,
//! cleaned of what killed runs left, and never mixed with another run's files. A directory that
//! holds a previous run is continued only with `--resume` and started afresh only with
//! `--overwrite`, which sets the previous files aside and deletes them once the new run completes.

use crate::formats::outdir::{
    clean_leftovers, entries, process_alive, some_names, temp_name_parts, DirLock,
};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The file naming the process that holds the lock (for the message another run gets).
const HOLDER: &str = ".xtrain-run";
/// Where `--overwrite` sets a previous run's files aside: `.replaced-PID`.
const SET_ASIDE: &str = ".replaced-";

/// Whether `name` is a file or directory a run writes in its output dir.
fn is_run_file(name: &str) -> bool {
    matches!(
        name,
        "metrics.jsonl" | "loss.png" | "adapter" | "tensorboard"
    ) || name.starts_with(SET_ASIDE)
        || ["checkpoint-", "step-"].iter().any(|p| {
            name.strip_prefix(p)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
}

/// Whether `metrics.jsonl` records a step taken (not only an evaluation at step 0).
fn took_a_step(metrics: &Path) -> bool {
    std::fs::read_to_string(metrics).is_ok_and(|t| t.lines().any(|l| l.contains("\"loss\"")))
}

/// The output directory of a run under way.
pub struct RunDir {
    pub path: PathBuf,
    _lock: DirLock,
    /// Where `--overwrite` put the previous run's files until this run completes.
    set_aside: Option<PathBuf>,
    /// Whether the claim created the directory (removed again if the run leaves it empty).
    created: bool,
    /// What earlier `--overwrite` runs set aside before they stopped, deleted when the run that
    /// resumes them completes.
    stale_aside: Vec<PathBuf>,
}

impl Drop for RunDir {
    /// The holder's note goes; a directory this run created and left empty goes too, so that a
    /// run refused before any output leaves none.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path.join(HOLDER));
        if self.created {
            let _ = std::fs::remove_dir(&self.path);
        }
    }
}

impl RunDir {
    /// Claim `out` for a run: create it, lock it (failing at once if another run holds it),
    /// remove what killed runs left, and check what it holds: nothing, the run `resume` continues,
    /// or, with `overwrite`, anything (set aside until this run completes).
    pub fn claim(out: &Path, resume: Option<&Path>, overwrite: bool) -> Result<RunDir> {
        if overwrite {
            crate::formats::outdir::refuse_current_dir(out)?;
        }
        let created = !out.exists();
        std::fs::create_dir_all(out)
            .with_context(|| format!("cannot create output dir {}", out.display()))?;
        if !out.is_dir() {
            bail!(
                "cannot create output dir {}: not a directory",
                out.display()
            );
        }
        let holder = out.join(HOLDER);
        let Some(lock) = DirLock::try_lock(out)? else {
            let who = std::fs::read_to_string(&holder)
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
                .map(|pid| format!(" (pid {pid})"))
                .unwrap_or_default();
            bail!(
                "another xtrain run{who} is writing to {}; wait for it to finish, or choose another --out",
                out.display()
            );
        };
        std::fs::write(&holder, format!("{}\n", std::process::id()))
            .with_context(|| format!("output dir {} is not writable", out.display()))?;
        let mut dir = RunDir {
            path: out.to_path_buf(),
            _lock: lock,
            set_aside: None,
            created,
            stale_aside: Vec::new(),
        };
        let held: Vec<String> = entries(out)?
            .into_iter()
            .filter(|n| n != HOLDER && temp_name_parts(n).is_none())
            .collect();
        let (run, foreign): (Vec<String>, Vec<String>) =
            held.iter().cloned().partition(|n| is_run_file(n));
        if foreign.is_empty() {
            dir.stale_aside = tidy_run_dir(out, &run, resume);
        }
        dir.set_aside = if overwrite {
            if resume.is_some() {
                bail!("--overwrite starts a new run and --resume continues one; give one of them");
            }
            set_aside(out, &held)?
        } else {
            if !foreign.is_empty() {
                bail!(
                    "--out {} holds files that are not a training run's ({}); choose a new or empty directory, or pass --overwrite to replace them once this run completes",
                    out.display(),
                    some_names(&foreign)
                );
            }
            // The logs alone (a run that stopped before its first step) are not a previous run.
            let previous = run
                .iter()
                .any(|n| n != "metrics.jsonl" && n != "tensorboard")
                || took_a_step(&out.join("metrics.jsonl"));
            match resume {
                Some(ckpt) if previous => check_resume_in(out, ckpt)?,
                Some(_) => {}
                None if previous => {
                    let hint = match crate::train::checkpoint::latest_checkpoint(out) {
                        Some(c) => {
                            format!(
                                "continue it with `{}`, ",
                                crate::train::checkpoint::resume_command(&c)
                            )
                        }
                        None => String::new(),
                    };
                    bail!(
                        "--out {} holds a previous run ({}); {hint}pass --overwrite to start afresh (its files are deleted once the new run completes), or choose another --out",
                        out.display(),
                        some_names(&run)
                    );
                }
                None => {}
            }
            None
        };
        Ok(dir)
    }

    /// The run completed: delete the files `--overwrite` set aside (by this run, or by the run
    /// it resumes).
    pub fn complete(&mut self) -> Result<()> {
        for d in std::mem::take(&mut self.stale_aside) {
            std::fs::remove_dir_all(&d)
                .with_context(|| format!("cannot remove the replaced run in {}", d.display()))?;
        }
        if let Some(d) = self.set_aside.take() {
            std::fs::remove_dir_all(&d)
                .with_context(|| format!("cannot remove the replaced run in {}", d.display()))?;
        }
        Ok(())
    }

    /// The run stopped early (`--stop-after`): where the files `--overwrite` set aside wait
    /// for the run that resumes it to complete.
    pub fn stopped(&self) -> Option<String> {
        self.set_aside.as_ref().map(|d| {
            format!(
                "the previous run's files that --overwrite is replacing stay in {} until this run completes (resumed)",
                d.display()
            )
        })
    }

    /// The run failed or was interrupted: if it wrote no checkpoint, the previous run's files
    /// go back where they were; else they stay set aside, and the returned line says where.
    pub fn failed(&mut self) -> Option<String> {
        let d = self.set_aside.take()?;
        let wrote = entries(&self.path)
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n != HOLDER && is_run_file(n) && !n.starts_with(SET_ASIDE))
            .collect::<Vec<_>>();
        if wrote
            .iter()
            .all(|n| n == "metrics.jsonl" || n == "loss.png" || n == "tensorboard")
        {
            let back = (|| -> std::io::Result<()> {
                for n in &wrote {
                    match n.as_str() {
                        "tensorboard" => std::fs::remove_dir_all(self.path.join(n))?,
                        _ => std::fs::remove_file(self.path.join(n))?,
                    }
                }
                for n in entries(&d).map_err(std::io::Error::other)? {
                    std::fs::rename(d.join(&n), self.path.join(&n))?;
                }
                std::fs::remove_dir(&d)
            })();
            if back.is_ok() {
                return Some(format!(
                    "the previous run's files in {} are back in place",
                    self.path.display()
                ));
            }
        }
        Some(format!(
            "the previous run's files that --overwrite was replacing are kept in {}",
            d.display()
        ))
    }
}

/// In a run dir that holds only a run's files: remove what killed runs left, and say where an
/// `--overwrite` run that stopped left an earlier run's files. Returns those set-aside dirs a
/// resumed run is to delete when it completes.
fn tidy_run_dir(out: &Path, run: &[String], resume: Option<&Path>) -> Vec<PathBuf> {
    let mut stale = Vec::new();
    for note in clean_leftovers(out, None) {
        crate::esay!("xtrain: {note}");
    }
    for n in run.iter().filter(|n| n.starts_with(SET_ASIDE)) {
        let pid = n[SET_ASIDE.len()..].parse::<u32>().unwrap_or(0);
        if process_alive(pid) {
            continue;
        }
        // The run that set them aside stopped; the one resuming it finishes its job.
        let then = if resume.is_some() {
            stale.push(out.join(n));
            "they are deleted when this run completes"
        } else {
            "delete it, or move them back"
        };
        crate::esay!(
            "xtrain: {} holds the files of an earlier run that an --overwrite run (pid {pid}) was replacing when it stopped; {then}",
            out.join(n).display()
        );
    }
    stale
}

/// `--resume CKPT` into `out` that holds a run: CKPT must be that run's.
fn check_resume_in(out: &Path, ckpt: &Path) -> Result<()> {
    let inside = match (out.canonicalize(), ckpt.canonicalize()) {
        (Ok(o), Ok(c)) => c.parent() == Some(o.as_path()),
        _ => false,
    };
    if !inside {
        bail!(
            "--out {} holds another run than the one --resume {} continues; resume into that checkpoint's own directory, or into a new --out",
            out.display(),
            ckpt.display()
        );
    }
    Ok(())
}

/// Move `names` (everything `out` held) into `out/.replaced-PID`.
fn set_aside(out: &Path, names: &[String]) -> Result<Option<PathBuf>> {
    if names.is_empty() {
        return Ok(None);
    }
    let d = out.join(format!("{SET_ASIDE}{}", std::process::id()));
    std::fs::create_dir(&d).with_context(|| format!("cannot create {}", d.display()))?;
    for n in names {
        std::fs::rename(out.join(n), d.join(n))
            .with_context(|| format!("cannot set {} aside", out.join(n).display()))?;
    }
    crate::esay!(
        "xtrain: --overwrite: set aside what {} held ({}) in {}; deleted once this run completes",
        out.display(),
        some_names(names),
        d.display()
    );
    Ok(Some(d))
}

#[cfg(test)]
mod tests {
    use super::is_run_file;

    #[test]
    fn run_files_are_known_by_name() {
        for n in [
            "metrics.jsonl",
            "tensorboard",
            "adapter",
            "checkpoint-12",
            "step-3",
            ".replaced-77",
        ] {
            assert!(is_run_file(n), "{n}");
        }
        for n in [
            "checkpoint-",
            "checkpoint-x",
            "notes.txt",
            "model.safetensors",
        ] {
            assert!(!is_run_file(n), "{n}");
        }
    }
}
