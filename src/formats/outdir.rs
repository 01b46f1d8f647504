//! Output directories: what a command may write into, what killed runs left behind, and who is
//! writing where.
//!
//! Every command that writes a directory (`train`, `merge`, `import-gguf`, `compile`) writes into
//! a new or empty one; one that holds anything else is refused unless the user passes
//! `--overwrite`, and even then the old contents are replaced only once the new output is complete
//! ([`crate::formats::atomic::write_dir_atomic`]). A command that writes one file (`bench
//! --export`) writes a new one, or replaces an existing one only with `--overwrite`
//! ([`check_writable_file`]). No output may replace what the command reads, even with
//! `--overwrite` ([`refuse_inputs_inside`]). Temp names are `.NAME.tmp-PID`
//! (and `.NAME.old-PID` for a directory being replaced): when the process PID is gone, they are
//! leftovers of a killed run, which the next command writing there removes and reports.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

/// `path` as an output location: trailing `.` components dropped (`target/.` is `target`), an
/// existing directory resolved through symlinks, and refused when it names no directory of its
/// own (`/`, `..`, an empty path).
pub fn output_path(path: &Path) -> Result<PathBuf> {
    if path.exists() {
        let real = path
            .canonicalize()
            .with_context(|| format!("cannot resolve {}", path.display()))?;
        if real.parent().is_none() {
            bail!("--out {} is the root directory", path.display());
        }
        return Ok(real);
    }
    let mut p = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => bail!(
                "--out {} must name a directory, not go up with `..`",
                path.display()
            ),
            c => p.push(c),
        }
    }
    if p.file_name().is_none() {
        bail!("--out {} names no directory", path.display());
    }
    Ok(p)
}

/// What `dir` holds, by name, sorted (nothing if it does not exist).
pub fn entries(dir: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

/// A few names of a listing, for a message: `a, b, c and 4 more`.
pub fn some_names(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(4).map(|s| s.as_str()).collect();
    match names.len().saturating_sub(4) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// Check that a command may write the directory `out` (resolved with [`output_path`]): it is new
/// or empty, or `overwrite` is given (the caller then replaces it whole once its output is
/// complete). `inputs` are the directories the command reads: `out` may not be one of them or
/// hold one, even with `overwrite`. Leftovers of killed runs beside `out` are removed first.
pub fn check_writable_dir(out: &Path, overwrite: bool, inputs: &[&Path]) -> Result<PathBuf> {
    let out = output_path(out)?;
    if out.exists() && !out.is_dir() {
        bail!("--out {} exists and is not a directory", out.display());
    }
    refuse_inputs_inside("--out", &out, inputs)?;
    if let (Some(parent), Some(name)) = (out.parent(), out.file_name()) {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        for note in clean_leftovers(parent, Some(&name.to_string_lossy())) {
            crate::esay!("xtrain: {note}");
        }
    }
    refuse_current_dir(&out)?;
    probe_writable("--out", &out)?;
    let held = entries(&out)?;
    if !held.is_empty() && !overwrite {
        bail!(
            "--out {} is not empty (it holds {}); choose a new or empty directory, or pass --overwrite to replace it once the new output is complete",
            out.display(),
            some_names(&held)
        );
    }
    Ok(out)
}

/// Check, before the work that fills it (a plan's or a compile's minutes), that `out` can be
/// written: a probe file is made and removed in `out`, or where `out` does not exist yet in its
/// nearest existing ancestor (where its directories will be made).
fn probe_writable(flag: &str, out: &Path) -> Result<()> {
    let mut at = out;
    while !at.exists() {
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => return Ok(()),
        }
    }
    let probe = at.join(format!(".xtrain-probe-{}", std::process::id()));
    match File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => bail!(
            "{flag} {}: cannot write in {} ({e})",
            out.display(),
            at.display()
        ),
    }
}

/// Refuse to replace `out` when it is the directory the user stands in or one above it (`--out
/// .`, `--out ..`, `--out ~`): it holds their own files, not an output of ours, and
/// `--overwrite` replaces an output directory whole.
pub fn refuse_current_dir(out: &Path) -> Result<()> {
    if let (Ok(cwd), Ok(o)) = (
        std::env::current_dir().and_then(|c| c.canonicalize()),
        out.canonicalize(),
    ) {
        if cwd.starts_with(&o) {
            bail!(
                "--out {} is the current directory or holds it; xtrain replaces an --out whole, \
                 so it writes only a directory of its own: choose one such as ./out",
                out.display()
            );
        }
    }
    Ok(())
}

/// Refuse an output dir `out` (given as `flag`, such as `--out`) that is one of `inputs` (what the
/// command reads: a model dir, a data file, an adapter) or holds one: writing it (with
/// `--overwrite`, setting its contents aside first) would take away what the command is about to
/// read. Both sides are resolved through symlinks and `..`. Checked before anything is written
/// or moved. `out` need not exist (then it holds nothing).
pub fn refuse_inputs_inside(flag: &str, out: &Path, inputs: &[&Path]) -> Result<()> {
    let Ok(out) = output_path(out) else {
        return Ok(());
    };
    let Ok(out) = out.canonicalize() else {
        return Ok(());
    };
    for input in inputs {
        if let Ok(inp) = input.canonicalize() {
            if inp.starts_with(&out) {
                bail!(
                    "{flag} {} would replace {}, which this command reads; choose another {flag}",
                    out.display(),
                    input.display()
                );
            }
        }
    }
    Ok(())
}

/// Check that a command may write the file `path` (given as `flag`, such as `--export`): it is
/// new, or `overwrite` is given (the caller then replaces it atomically,
/// [`crate::formats::atomic::write_atomic`]). Its directory is made when it is missing (the
/// nearest existing one checked writable first), as a directory output's are: every command
/// makes the missing parents of what it writes. An existing `path` that is one of
/// `inputs` (what the command reads) or lies inside one (a file of the model dir) is refused even
/// with `overwrite`, through symlinks and `..`. Leftovers of killed writes of `path` are removed
/// first. Returns `path` as given (a symlink there is replaced, not what it points to).
pub fn check_writable_file(
    flag: &str,
    path: &Path,
    overwrite: bool,
    inputs: &[&Path],
) -> Result<PathBuf> {
    let name = match path.file_name() {
        Some(n) if !path.as_os_str().to_string_lossy().ends_with('/') => n,
        _ => bail!("{flag} {} names no file", path.display()),
    };
    if path.is_dir() {
        bail!(
            "{flag} {} is a directory; give the name of a file to write",
            path.display()
        );
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if parent.exists() && !parent.is_dir() {
        bail!(
            "{flag} {}: {} is not a directory",
            path.display(),
            parent.display()
        );
    }
    probe_writable(flag, parent)?;
    if let Ok(real) = path.canonicalize() {
        for input in inputs {
            let Ok(inp) = input.canonicalize() else {
                continue;
            };
            if real == inp {
                bail!(
                    "{flag} {} would replace {}, which this command reads; choose another {flag}",
                    path.display(),
                    input.display()
                );
            }
            if real.starts_with(&inp) {
                bail!(
                    "{flag} {} would replace a file of {}, which this command reads; choose another {flag}",
                    path.display(),
                    input.display()
                );
            }
        }
    }
    for note in clean_leftovers(parent, Some(&name.to_string_lossy())) {
        crate::esay!("xtrain: {note}");
    }
    if path.symlink_metadata().is_ok() && !overwrite {
        bail!(
            "{flag} {} exists; choose a new file, or pass --overwrite to replace it once the new one is complete",
            path.display()
        );
    }
    std::fs::create_dir_all(parent).with_context(|| {
        format!(
            "{flag} {}: cannot make {}",
            path.display(),
            parent.display()
        )
    })?;
    Ok(path.to_path_buf())
}

/// Whether process `pid` is alive (or exists under another user).
pub fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The pid in a temp name `.NAME.tmp-PID-N` / `.NAME.old-PID-N` (N counts the process's temp
/// names; older xtrains wrote `.NAME.tmp-PID`), with NAME and the kind.
pub fn temp_name_parts(name: &str) -> Option<(&str, &'static str, u32)> {
    let rest = name.strip_prefix('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    for kind in ["tmp", "old", "staged"] {
        if let Some((base, tail)) = rest.rsplit_once(&format!(".{kind}-")) {
            let (pid, n) = tail.split_once('-').unwrap_or((tail, "0"));
            if !base.is_empty() && digits(pid) && digits(n) {
                return Some((base, kind, pid.parse().ok()?));
            }
        }
    }
    None
}

/// Remove the temp files and directories that killed xtrain processes left in `dir`
/// (`.NAME.tmp-PID-N`, `.NAME.staged-PID-N`, and `.NAME.old-PID-N` once NAME is back in place; only names derived from
/// `only` when given, for a directory xtrain shares with others). A `.NAME.old-PID` whose NAME
/// is missing (killed mid-replace) is moved back to NAME. Returns what it did, one line each.
pub fn clean_leftovers(dir: &Path, only: Option<&str>) -> Vec<String> {
    let mut notes = Vec::new();
    for name in entries(dir).unwrap_or_default() {
        let Some((base, kind, pid)) = temp_name_parts(&name) else {
            continue;
        };
        // A long NAME's temp names hold its first bytes and `~` (atomic::temp_base).
        let mine = |o: &str| crate::formats::atomic::temp_base(o) == base;
        if only.is_some_and(|o| !mine(o)) || process_alive(pid) {
            continue;
        }
        let path = dir.join(&name);
        let target = match (only, base.ends_with('~')) {
            (Some(o), true) => dir.join(o),
            // Whose shortened name it is, is not known: left for the writer of that name.
            (None, true) if kind == "old" => continue,
            _ => dir.join(base),
        };
        if kind == "old" && !target.exists() {
            if std::fs::rename(&path, &target).is_ok() {
                notes.push(format!(
                    "moved {} back to {}: a run (pid {pid}) was killed while replacing it",
                    path.display(),
                    target.display()
                ));
            }
            continue;
        }
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Ok(()) => notes.push(format!(
                "removed {}, left by a killed run (pid {pid})",
                path.display()
            )),
            Err(e) => notes.push(format!(
                "{} was left by a killed run (pid {pid}) and cannot be removed: {e}",
                path.display()
            )),
        }
    }
    notes
}

/// Remove this process's (`pid`'s) temp files and directories of `name` in `dir` (a command
/// interrupted while writing it).
pub fn remove_temps_of(dir: &Path, name: &str, pid: u32) {
    let base = crate::formats::atomic::temp_base(name);
    for entry in entries(dir).unwrap_or_default() {
        if let Some((b, _, p)) = temp_name_parts(&entry) {
            if b == base && p == pid {
                let path = dir.join(&entry);
                let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
            }
        }
    }
}

/// An exclusive lock on a directory (`flock` on the directory itself), held until dropped or
/// the process ends: the kernel releases it when its holder dies, so a killed run never leaves
/// a lock behind.
pub struct DirLock {
    _dir: File,
}

impl DirLock {
    /// Take the lock on `dir` or fail at once if another process holds it.
    pub fn try_lock(dir: &Path) -> Result<Option<DirLock>> {
        use std::os::fd::AsRawFd;
        let f = File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
        // SAFETY: flock on a descriptor this function owns; it is released when `f` is closed.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(Some(DirLock { _dir: f }));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(None);
        }
        Err(e).with_context(|| format!("cannot lock {}", dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name too long to hold in a temp name with its suffix is shortened there (its first
    /// bytes and `~`), and the leftovers of a killed writer of that name are still found.
    #[test]
    fn a_long_names_temp_names_fit_a_file_name() {
        let dir = std::env::temp_dir().join(format!("xtrain-long-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let name = "x".repeat(250);
        let out = dir.join(&name);
        crate::formats::atomic::write_dir_atomic(&out, |d| {
            std::fs::write(d.join("a"), b"1")?;
            Ok(())
        })
        .unwrap();
        assert_eq!(std::fs::read(out.join("a")).unwrap(), b"1");
        crate::formats::atomic::write_bytes_atomic(&dir.join("y".repeat(255)), b"2").unwrap();
        // A killed run's temp dir (pid 1 is never ours, and alive: use one no process has).
        let base = crate::formats::atomic::temp_base(&name).into_owned();
        let left = dir.join(format!(".{base}.tmp-{}-0", i32::MAX));
        std::fs::create_dir_all(&left).unwrap();
        let notes = clean_leftovers(&dir, Some(&name));
        assert!(!left.exists(), "{notes:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temp_names_and_output_paths() {
        assert_eq!(
            temp_name_parts(".model.safetensors.tmp-466"),
            Some(("model.safetensors", "tmp", 466))
        );
        assert_eq!(
            temp_name_parts(".merged.old-12"),
            Some(("merged", "old", 12))
        );
        assert_eq!(
            temp_name_parts(".merged.staged-12-3"),
            Some(("merged", "staged", 12))
        );
        assert_eq!(temp_name_parts(".x.tmp-12-"), None);
        assert_eq!(temp_name_parts(".x.tmp-12-3-4"), None);
        assert_eq!(temp_name_parts("merged.tmp-12"), None);
        assert_eq!(temp_name_parts(".x.tmp-"), None);
        assert_eq!(temp_name_parts(".x.tmp-1a"), None);
        assert_eq!(
            output_path(Path::new("no/such/dir/.")).unwrap(),
            PathBuf::from("no/such/dir")
        );
        assert!(output_path(Path::new("no/such/..")).is_err());
        assert!(output_path(Path::new("/")).is_err());
    }
}
