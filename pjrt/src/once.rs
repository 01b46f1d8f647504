//! Making a thing in a cache that threads and processes share, once: a plugin install, a venv, a
//! downloaded model, a compiled executable.
//!
//! Every creator builds into a temp name of its own beside the thing (`.NAME.tmp-PID-N`: unique
//! per process and per thread) and renames it into place when it is complete, so the thing's name
//! only ever holds a finished one, and a creator killed half way leaves only a temp name that the
//! next creator removes. Creators take turns under a lock (`.NAME.lock` beside the thing, `flock`:
//! the kernel releases it when its holder dies, so a killed creator never leaves it held): a
//! second one waits for the first, then finds the thing made and uses it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A name beside `target` that no other creator uses, in this process or another:
/// `.NAME.KIND-PID-N`, N counting up within the process.
pub fn unique_sibling(target: &Path, kind: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.{kind}-{}-{n}", std::process::id()))
}

/// An exclusive or shared `flock` on a lock file, held until dropped or the process ends.
pub struct Lock {
    _file: File,
}

impl Lock {
    /// Take the exclusive lock on the file `path` (made if absent, with its directory), waiting
    /// for whoever holds it; `on_wait` is called first when someone does (to say why the caller
    /// stalls).
    pub fn exclusive(path: &Path, on_wait: impl FnOnce()) -> io::Result<Lock> {
        let file = open(path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                on_wait();
                file.lock().map_err(|e| at(path, e))?;
            }
            Err(TryLockError::Error(e)) => return Err(at(path, e)),
        }
        Ok(Lock { _file: file })
    }

    /// Take a shared lock on the file `path` (made if absent): readers hold it together, and
    /// wait while an [`exclusive`](Lock::exclusive) holder writes.
    pub fn shared(path: &Path) -> io::Result<Lock> {
        let file = open(path)?;
        file.lock_shared().map_err(|e| at(path, e))?;
        Ok(Lock { _file: file })
    }
}

fn open(path: &Path) -> io::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| at(dir, e))?;
    }
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| at(path, e))
}

/// `e`, saying which path it was about.
fn at(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// The lock file of `target`: `.NAME.lock` beside it.
pub fn lock_path(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.lock"))
}

/// Make `target` (a file or a directory) unless `done` says it is there: under `target`'s lock,
/// `make` writes the whole thing at the path it is given (which does not exist yet), and that is
/// renamed to `target`. A `target` that is there but not `done` (left by an older layout) is
/// replaced. `what` names the thing in the line said when another creator is making it and this
/// one waits. A `make` that fails or panics leaves nothing behind; one killed leaves a temp name
/// that the next creator removes.
pub fn create_once<E: From<io::Error>>(
    target: &Path,
    what: &str,
    done: impl Fn(&Path) -> bool,
    make: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    if done(target) {
        return Ok(());
    }
    let _lock = Lock::exclusive(&lock_path(target), || {
        eprintln!(
            "xtrain: waiting for another process or thread making {what} ({})",
            target.display()
        )
    })?;
    if done(target) {
        return Ok(());
    }
    remove_leftovers(target);
    let tmp = Removed(unique_sibling(target, "tmp"));
    make(&tmp.0)?;
    if !done(&tmp.0) {
        return Err(io::Error::other(format!(
            "{what} was made but is not complete (its maker left out what {} needs)",
            target.display()
        ))
        .into());
    }
    if target.symlink_metadata().is_ok() {
        let old = Removed(unique_sibling(target, "old"));
        std::fs::rename(target, &old.0).map_err(|e| at(target, e))?;
    }
    std::fs::rename(&tmp.0, target).map_err(|e| at(target, e))?;
    if let Some(dir) = target.parent() {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The temp and set-aside names of `target` that creators which died left (only called under
/// the lock, when no live creator has one).
fn remove_leftovers(target: &Path) {
    let (Some(dir), Some(name)) = (target.parent(), target.file_name()) else {
        return;
    };
    let name = name.to_string_lossy();
    // Also what a maker writes beside its temp name (`..NAME.tmp-PID-N.tmp-PID-M`, a file
    // written atomically at the temp name).
    let prefixes = [format!("{name}.tmp-"), format!("{name}.old-")];
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let bare = n.trim_start_matches('.');
        if n.starts_with('.') && prefixes.iter().any(|p| bare.starts_with(p.as_str())) {
            remove(&e.path());
        }
    }
}

/// Remove a file, link or directory tree, if there.
fn remove(path: &Path) {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(path);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(path);
        }
        Err(_) => {}
    }
}

/// A path removed (whatever it holds by then) when dropped, also on a panic.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    fn fresh(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pjrt-once-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Eight threads at once: one makes it (slowly, in several writes), the others wait and
    /// find it made; nothing but the thing and its lock file is left.
    #[test]
    fn racing_threads_make_a_directory_once() {
        let dir = fresh("threads");
        let target = dir.join("thing");
        let made = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (target, made) = (target.clone(), made.clone());
                std::thread::spawn(move || {
                    create_once(
                        &target,
                        "a test thing",
                        |t| t.join("b").is_file(),
                        |tmp| -> io::Result<()> {
                            made.fetch_add(1, Ordering::SeqCst);
                            std::fs::create_dir(tmp)?;
                            std::fs::write(tmp.join("a"), "a")?;
                            std::thread::sleep(std::time::Duration::from_millis(200));
                            std::fs::write(tmp.join("b"), "b")
                        },
                    )
                    .unwrap();
                    assert_eq!(std::fs::read_to_string(target.join("b")).unwrap(), "b");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(made.load(Ordering::SeqCst), 1);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".thing.lock", "thing"]);
    }

    /// A maker that fails or panics leaves nothing; a dead creator's temp name is removed by
    /// the next one; a thing left incomplete by an older layout is replaced.
    #[test]
    fn failures_and_leftovers_leave_nothing_that_looks_made() {
        let dir = fresh("failures");
        let target = dir.join("thing");
        let done = |t: &Path| t.join("ok").is_file();
        let err = create_once(&target, "x", done, |tmp| {
            std::fs::create_dir(tmp)?;
            Err(io::Error::other("no network"))
        });
        assert_eq!(err.unwrap_err().to_string(), "no network");
        let panicked = std::panic::catch_unwind(|| {
            let _ = create_once(&target, "x", done, |tmp| -> io::Result<()> {
                std::fs::create_dir(tmp)?;
                panic!("pip failed")
            });
        });
        assert!(panicked.is_err());
        // What a creator killed half way (another pid) leaves, and an old layout's directory.
        std::fs::create_dir_all(dir.join(".thing.tmp-999999999-0/half")).unwrap();
        std::fs::write(dir.join("..thing.tmp-999999999-0.tmp-999999999-1"), "").unwrap();
        std::fs::create_dir_all(target.join("old-layout")).unwrap();
        create_once(&target, "x", done, |tmp| {
            std::fs::create_dir(tmp)?;
            std::fs::write(tmp.join("ok"), "")
        })
        .unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".thing.lock", "thing"]);
        assert!(!target.join("old-layout").exists());
        // A maker that leaves out what `done` looks for is an error, not a silent success.
        let other = dir.join("other");
        let err = create_once(&other, "the other thing", done, |tmp| {
            std::fs::create_dir(tmp)
        });
        assert!(
            err.unwrap_err().to_string().contains("is not complete"),
            "an incomplete make must fail"
        );
        assert!(!other.exists(), "an incomplete make is not put in place");
    }

    #[test]
    fn sibling_names_differ_per_call() {
        let t = Path::new("/c/venvs/tb");
        let (a, b) = (unique_sibling(t, "tmp"), unique_sibling(t, "tmp"));
        assert_ne!(a, b);
        let prefix = format!(".tb.tmp-{}-", std::process::id());
        for p in [a, b] {
            assert_eq!(p.parent(), Some(Path::new("/c/venvs")));
            assert!(p
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix));
        }
    }
}
