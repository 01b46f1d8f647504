//! The directories XLA dumps a compile into when xtrain reads the optimized HLO back (launch
//! counts, memory reports), removed when read.
//!
//! They lie in a root, `$TMPDIR/xtrain-dumps-PID-N`, which this process holds open while any
//! of them lives (and removes with the last), and XLA is given each as `/proc/self/fd/FD/K` (FD
//! the root's descriptor). The reason is Ctrl-C:
//! a compile goes on in another thread while the signal's cleanup removes the temp files, and a
//! dump path spelled from `$TMPDIR` would be created again by the compiler's next file. A root
//! that has been removed can hold nothing new (the kernel refuses to create entries in a removed
//! directory), and [`close`] stops new roots, so once the cleanup has removed it nothing is left
//! behind, whatever the compile thread does next.

use anyhow::{Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The start of a root's name; a Ctrl-C cleanup removes `{ROOT_PREFIX}{pid}-...`.
pub const ROOT_PREFIX: &str = "xtrain-dumps-";

/// A root: its path and the open directory. Removed when its last dump directory is dropped.
struct Root {
    path: PathBuf,
    dir: File,
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The live root, if any, and whether [`close`] has been called.
struct Roots {
    live: Option<Weak<Root>>,
    closed: bool,
}

static ROOTS: Mutex<Roots> = Mutex::new(Roots {
    live: None,
    closed: false,
});

/// No more dump directories in this process: the signal watcher calls this before it removes
/// the temp files, so that no root is created after its look.
pub fn close() {
    ROOTS.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
}

/// The live root, or a new one.
fn root() -> Result<Arc<Root>> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let mut roots = ROOTS.lock().unwrap_or_else(|e| e.into_inner());
    if roots.closed {
        anyhow::bail!("the process is ending: no more compiles");
    }
    if let Some(root) = roots.live.as_ref().and_then(Weak::upgrade) {
        return Ok(root);
    }
    let path = std::env::temp_dir().join(format!(
        "{ROOT_PREFIX}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let dir = std::fs::create_dir_all(&path)
        .and_then(|_| File::open(&path))
        .with_context(|| format!("cannot create {}", path.display()))?;
    let root = Arc::new(Root { path, dir });
    roots.live = Some(Arc::downgrade(&root));
    Ok(root)
}

/// One compile's dump directory, created empty; removed on drop (and its root with the last).
pub struct DumpDir {
    /// The path to give XLA: through the root's descriptor where `/proc` has it.
    path: PathBuf,
    _root: Arc<Root>,
}

impl DumpDir {
    pub fn new() -> Result<DumpDir> {
        use std::os::fd::AsRawFd;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = root()?;
        let name = NEXT.fetch_add(1, Ordering::SeqCst).to_string();
        let by_fd = PathBuf::from(format!("/proc/self/fd/{}", root.dir.as_raw_fd()));
        let path = if by_fd.is_dir() {
            by_fd.join(&name)
        } else {
            root.path.join(&name)
        };
        std::fs::create_dir(&path)
            .with_context(|| format!("cannot create {}", root.path.join(&name).display()))?;
        Ok(DumpDir { path, _root: root })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DumpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::DumpDir;

    /// Each dump directory is new and empty, lies under this process's root, and is gone once
    /// dropped; the root goes with the last.
    #[test]
    fn a_dump_dir_is_fresh_and_removed_on_drop() {
        let a = DumpDir::new().unwrap();
        let b = DumpDir::new().unwrap();
        assert_ne!(a.path(), b.path());
        std::fs::write(a.path().join("x.txt"), "x").unwrap();
        let real = std::fs::canonicalize(a.path()).unwrap();
        assert!(real
            .to_string_lossy()
            .contains(&format!("xtrain-dumps-{}-", std::process::id())));
        let root = real.parent().unwrap().to_path_buf();
        drop(a);
        assert!(!real.exists());
        assert!(b.path().is_dir());
        drop(b);
        assert!(!root.exists(), "{}", root.display());
    }
}
