//! `--resume`'s paths: the model, data, output and program dir a checkpoint's run recorded,
//! taken (or checked) before the model is read.

use super::run::PATH_FLAGS;
use super::settle::note;
use crate::train::options::TrainOptions;
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// `--resume CHECKPOINT`: take the paths its run recorded ([`PATH_FLAGS`]) for the flags left
/// out, so that `xtrain train --resume CHECKPOINT` alone continues the run. A recorded path
/// that no longer exists is refused, naming it, unless the flag gives where it is now. A model
/// or data given on the command line must be the recorded one where that still exists; the
/// evaluation data, the output dir and the program dir may be others (said). The output dir left
/// out is the checkpoint's own run dir ([`own_run_dir`]).
pub fn take_recorded_paths(o: &mut TrainOptions, notes: &mut Vec<String>) -> Result<()> {
    let Some(ckpt) = o.resume.clone() else {
        return Ok(());
    };
    let state = crate::train::checkpoint::read_state(&ckpt)?;
    let c = ckpt.display();
    let mut taken = Vec::new();
    for flag in PATH_FLAGS {
        let given: Option<PathBuf> = match *flag {
            "model" => Some(o.model.clone()),
            "data" => Some(o.data.path.clone()),
            "eval-data" => o.data.eval_data.clone(),
            "out" => Some(o.out.clone()),
            _ => o.program.clone(),
        }
        .filter(|p| !p.as_os_str().is_empty());
        let recorded = state
            .settings
            .get(*flag)
            .and_then(|v| v.as_str())
            .map(PathBuf::from);
        if *flag == "out" && given.is_none() {
            if let Some(own) = own_run_dir(&ckpt) {
                take_own_run_dir(o, own, recorded, &mut taken, notes, &c.to_string());
                continue;
            }
        }
        let Some(recorded) = recorded else {
            if given.is_none() && ["model", "data", "out"].contains(flag) {
                bail!(
                    "--{flag} is needed: checkpoint {c} does not record its run's --{flag} (it was written by an earlier xtrain); give --{flag}"
                );
            }
            continue;
        };
        let none = recorded.as_os_str().is_empty();
        let exists = !none && recorded.exists();
        match given {
            None if none => {}
            None if exists => {
                taken.push(format!("--{flag} {}", recorded.display()));
                set_path(o, flag, recorded);
            }
            None => {
                let own_dir = if *flag == "out" {
                    ckpt.parent()
                        .map(|d| format!(" (the checkpoint is in {})", d.display()))
                        .unwrap_or_default()
                } else {
                    String::new()
                };
                bail!(
                    "checkpoint {c}'s run has --{flag} {}, which does not exist now (moved or deleted?); give --{flag} with where it is{own_dir}",
                    recorded.display()
                );
            }
            Some(g) => {
                let same = exists
                    && matches!((g.canonicalize(), recorded.canonicalize()), (Ok(a), Ok(b)) if a == b);
                if same {
                    continue;
                }
                let by = o.given_by(flag);
                if ["model", "data"].contains(flag) && exists {
                    bail!(
                        "checkpoint {c}'s run has --{flag} {}, but {by} gives --{flag} {} (leave the flag out to take the recorded value)",
                        recorded.display(),
                        g.display()
                    );
                }
                let was = if none {
                    "none".to_string()
                } else if exists {
                    recorded.display().to_string()
                } else {
                    format!("{}, which does not exist now", recorded.display())
                };
                notes.push(format!(
                    "--{flag} {} ({by}) instead of the recorded --{flag} {was} (checkpoint {c})",
                    g.display()
                ));
            }
        }
    }
    note(&taken, &format!("checkpoint {c}"), notes);
    Ok(())
}

/// The run dir a checkpoint belongs to: the directory it is in. That, not the `--out` its run
/// recorded, is the run's identity: a run dir copied (or moved) elsewhere is continued where it
/// is now, and the original is left alone.
fn own_run_dir(ckpt: &Path) -> Option<PathBuf> {
    let parent = ckpt.parent()?;
    let dir = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    dir.is_dir().then(|| dir.to_path_buf())
}

/// `--out` left out on `--resume`: the checkpoint's own run dir, said as taken from the
/// checkpoint where it is the recorded one, and as what it is where it is not.
fn take_own_run_dir(
    o: &mut TrainOptions,
    own: PathBuf,
    recorded: Option<PathBuf>,
    taken: &mut Vec<String>,
    notes: &mut Vec<String>,
    ckpt: &str,
) {
    let same =
        |r: &Path| matches!((r.canonicalize(), own.canonicalize()), (Ok(a), Ok(b)) if a == b);
    match recorded {
        Some(r) if same(&r) => taken.push(format!("--out {}", r.display())),
        Some(r) if !r.as_os_str().is_empty() => notes.push(format!(
            "--out {} (the run dir checkpoint {ckpt} is in) instead of the recorded --out {} (the run was copied or moved)",
            own.display(),
            r.display()
        )),
        _ => notes.push(format!(
            "--out {} (the run dir checkpoint {ckpt} is in)",
            own.display()
        )),
    }
    o.out = own;
}

fn set_path(o: &mut TrainOptions, flag: &str, p: PathBuf) {
    match flag {
        "model" => o.model = p,
        "data" => o.data.path = p,
        "eval-data" => o.data.eval_data = Some(p),
        "out" => o.out = p,
        _ => o.program = Some(p),
    }
}
