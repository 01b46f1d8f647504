//! Files that are either completely written or not there at all.

use anyhow::{Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Write `path` through `fill` into a temp file in the same directory, fsync it, rename it over
/// `path` and fsync the directory. A crash at any point leaves the old file (or none), never a
/// half-written one.
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    write_atomic_as(path, Replace::Yes, fill)
}

/// Whether [`write_atomic_as`] may replace a file that is at its path when it is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    Yes,
    /// The path was free when the command started (it was checked, no `--overwrite`): a file
    /// that appeared there meanwhile (another command's) is left as it is, and this write fails.
    No,
}

impl Replace {
    /// [`Replace::Yes`] with `--overwrite`, else [`Replace::No`].
    pub fn when(overwrite: bool) -> Replace {
        if overwrite {
            Replace::Yes
        } else {
            Replace::No
        }
    }
}

/// [`write_atomic`], refusing at the end to replace a file that appeared at `path` meanwhile
/// when `replace` is [`Replace::No`] (a hard link made in one step: it fails where a name is).
pub fn write_atomic_as(
    path: &Path,
    replace: Replace,
    fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let (dir, tmp) = sibling(path, "tmp")?;
    let dir = dir.as_path();
    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::new(File::create(&tmp)?);
        fill(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        match replace {
            Replace::Yes => std::fs::rename(&tmp, path)?,
            Replace::No => {
                std::fs::hard_link(&tmp, path).map_err(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => std::io::Error::other(
                        "a file appeared there while this was written (another command's?); it \
                         is left as it is: pass --overwrite to replace it",
                    ),
                    _ => e,
                })?;
                std::fs::remove_file(&tmp)?;
            }
        }
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// [`write_atomic`] for a whole byte string.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, |f| f.write_all(bytes))
}

/// Write `dir` as a complete directory or not at all: `fill` writes into a temp dir
/// (`.NAME.tmp-PID-N`) that is renamed into place. An older `dir` is replaced only then: moved
/// aside (`.NAME.old-PID-N`), the new one moved in, the old one removed; a process killed between
/// the two renames leaves the old one, which the next writer moves back
/// ([`crate::formats::outdir::clean_leftovers`]).
pub fn write_dir_atomic(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    write_dir_atomic_as(dir, Replace::Yes, fill)
}

/// [`write_dir_atomic`], where `replace` says whether a directory with files that is at `dir`
/// when the new one is complete may be replaced ([`replace_dir_with_as`]).
pub fn write_dir_atomic_as(
    dir: &Path,
    replace: Replace,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let (_, tmp) = sibling(dir, "tmp")?;
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    replace_dir_with_as(dir, &tmp, replace)
}

/// Where a directory `dir` that takes several steps to build (a program dir and its build) is
/// written until [`replace_dir_with`] moves it into place: `.NAME.staged-PID-N` beside it.
pub fn staging_dir(dir: &Path) -> Result<PathBuf> {
    Ok(sibling(dir, "staged")?.1)
}

/// The directory holding `path` and the name `.NAME.KIND-PID-N` beside it (the kinds
/// [`crate::formats::outdir::clean_leftovers`] knows: tmp, old, staged).
fn sibling(path: &Path, kind: &str) -> Result<(PathBuf, PathBuf)> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("{} has no name", path.display()))?
        .to_string_lossy();
    // Unique per call, not only per process: threads of one process may write the same path
    // (the executable cache).
    let at = pjrt::once::unique_sibling(&parent.join(temp_base(&name).as_ref()), kind);
    Ok((parent.to_path_buf(), at))
}

/// The longest file name the usual file systems take (NAME_MAX).
const NAME_MAX: usize = 255;

/// What a temp name adds to NAME at most: `.`, `.staged-`, a pid and a counter.
const TEMP_ROOM: usize = 40;

/// NAME as a temp name holds it: itself, or where `.NAME.KIND-PID-N` would be longer than a file
/// name may be, its first bytes and `~` (so that a 250-character `--out` is written, not refused
/// for its temp name's length).
pub fn temp_base(name: &str) -> std::borrow::Cow<'_, str> {
    if name.len() + TEMP_ROOM <= NAME_MAX {
        return name.into();
    }
    let mut end = NAME_MAX - TEMP_ROOM - 1;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}~", &name[..end]).into()
}

/// Move the complete directory `tmp` (beside `dir`) into place as `dir`, replacing an older
/// `dir` only then: moved aside (`.NAME.old-PID-N`), the new one moved in, the old one removed.
pub fn replace_dir_with(dir: &Path, tmp: &Path) -> Result<()> {
    replace_dir_with_as(dir, tmp, Replace::Yes)
}

/// [`replace_dir_with`]; with [`Replace::No`] (`dir` was new or empty when the command started,
/// no `--overwrite`) `tmp` is renamed onto `dir` directly, which the file system refuses where
/// `dir` now holds files (another command's, written meanwhile): those are left as they are.
pub fn replace_dir_with_as(dir: &Path, tmp: &Path, replace: Replace) -> Result<()> {
    if replace == Replace::No {
        if let Err(e) = std::fs::rename(tmp, dir) {
            let _ = std::fs::remove_dir_all(tmp);
            let held = dir.read_dir().is_ok_and(|mut d| d.next().is_some());
            if held {
                anyhow::bail!(
                    "{} was new or empty when this command started and now holds files \
                     (another command's?); they are left as they are: pass --overwrite to \
                     replace them",
                    dir.display()
                );
            }
            return Err(e).with_context(|| format!("cannot move {} into place", dir.display()));
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = std::fs::File::open(parent) {
                let _ = d.sync_all();
            }
        }
        return Ok(());
    }
    let (parent, old) = sibling(dir, "old")?;
    let replacing = dir.exists();
    if replacing {
        let _ = std::fs::remove_dir_all(&old);
        if let Err(e) = std::fs::rename(dir, &old) {
            let _ = std::fs::remove_dir_all(tmp);
            return Err(e).with_context(|| format!("cannot replace {}", dir.display()));
        }
    }
    if let Err(e) = std::fs::rename(tmp, dir) {
        if replacing {
            let _ = std::fs::rename(&old, dir);
        }
        let _ = std::fs::remove_dir_all(tmp);
        return Err(e).with_context(|| format!("cannot move {} into place", dir.display()));
    }
    if let Ok(d) = std::fs::File::open(parent) {
        let _ = d.sync_all();
    }
    if replacing {
        let removed = if old.is_dir() {
            std::fs::remove_dir_all(&old)
        } else {
            std::fs::remove_file(&old)
        };
        removed.with_context(|| format!("cannot remove the replaced {}", old.display()))?;
    }
    Ok(())
}
