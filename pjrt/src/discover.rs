//! Finding PJRT plugins the way JAX users already install them, and installing the CPU one.
//!
//! A plugin is named by `--plugin cpu|cuda|rocm|tpu|/path/to/plugin.so` or `$XTRAIN_PLUGIN`. Names
//! are looked up in the active Python's site-packages (the layouts of the pip wheels) and in
//! xtrain's own cache dir (`$XTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/xtrain`, else
//! `~/.cache/xtrain`), where `xtrain plugins install cpu` puts the CPU plugin.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A known backend and where its wheel puts the shared object.
pub struct KnownPlugin {
    pub name: &'static str,
    pub wheel: &'static str,
    /// Paths relative to a site-packages directory, most preferred first.
    pub layouts: &'static [&'static str],
}

pub const KNOWN: &[KnownPlugin] = &[
    KnownPlugin {
        name: "cpu",
        wheel: "xla-cpu-pjrt",
        layouts: &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
    },
    KnownPlugin {
        name: "cuda",
        wheel: "jax-cuda13-pjrt (or jax-cuda12-pjrt)",
        layouts: &[
            "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
            "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
        ],
    },
    KnownPlugin {
        name: "rocm",
        wheel: "jax-rocm7-pjrt",
        layouts: &["jax_plugins/xla_rocm7/xla_rocm_plugin.so"],
    },
    KnownPlugin {
        name: "tpu",
        wheel: "libtpu",
        layouts: &["libtpu/libtpu.so"],
    },
];

/// Where xtrain keeps installed plugins and compiled executables.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XTRAIN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("xtrain");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| ".".into());
    home.join(".cache").join("xtrain")
}

/// The Python interpreter used to find site-packages and run pip: `$XTRAIN_PYTHON` or `python3`.
pub fn python() -> String {
    std::env::var("XTRAIN_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The active Python's site-packages directories (empty if there is no Python).
pub fn site_packages() -> Vec<PathBuf> {
    let script = "import site, sys\n\
        paths = list(getattr(site, 'getsitepackages', lambda: [])())\n\
        paths.append(site.getusersitepackages())\n\
        paths += [p for p in sys.path if p.endswith('-packages')]\n\
        print('\\n'.join(paths))";
    let out = match Command::new(python()).args(["-c", script]).output() {
        Ok(o) if o.status.success() => o.stdout,
        _ => return Vec::new(),
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in String::from_utf8_lossy(&out).lines() {
        let p = PathBuf::from(line.trim());
        if !line.trim().is_empty() && !dirs.contains(&p) {
            dirs.push(p);
        }
    }
    dirs
}

/// One place a plugin was found.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    pub name: &'static str,
    pub path: PathBuf,
    /// "site-packages" or "cache".
    pub source: &'static str,
}

fn cached_path(known: &KnownPlugin) -> PathBuf {
    let file = Path::new(known.layouts[0]).file_name().unwrap();
    cache_dir().join("plugins").join(known.name).join(file)
}

/// Every known plugin present on this machine, cache first, then site-packages.
pub fn find_all() -> Vec<Found> {
    let sites = site_packages();
    let mut found = Vec::new();
    for known in KNOWN {
        let cached = cached_path(known);
        if cached.is_file() {
            found.push(Found {
                name: known.name,
                path: cached,
                source: "cache",
            });
        }
        for site in &sites {
            for layout in known.layouts {
                let p = site.join(layout);
                if p.is_file() {
                    found.push(Found {
                        name: known.name,
                        path: p,
                        source: "site-packages",
                    });
                }
            }
        }
    }
    found
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(
        "no '{name}' PJRT plugin found (looked in {looked}). Install the {wheel} wheel into the \
         active Python{hint}, or pass --plugin /path/to/plugin.so"
    )]
    NotFound {
        name: String,
        wheel: &'static str,
        looked: String,
        hint: &'static str,
    },
    #[error("unknown plugin '{0}': use cpu, cuda, rocm, tpu or a path to a .so file")]
    Unknown(String),
    #[error("plugin file {0} does not exist")]
    Missing(PathBuf),
    #[error("installing the CPU plugin failed: {0}")]
    Install(String),
}

/// Resolve a plugin spec (`cpu`, `cuda`, ..., or a path) to a shared object path.
/// `None` means `$XTRAIN_PLUGIN` or else `cpu`.
pub fn resolve(spec: Option<&str>) -> Result<PathBuf, DiscoverError> {
    let env = std::env::var("XTRAIN_PLUGIN").ok();
    let spec = spec.or(env.as_deref()).unwrap_or("cpu");
    if spec.contains('/') || spec.ends_with(".so") {
        let p = PathBuf::from(spec);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(DiscoverError::Missing(p))
        };
    }
    let known = KNOWN
        .iter()
        .find(|k| k.name == spec)
        .ok_or_else(|| DiscoverError::Unknown(spec.to_string()))?;
    if let Some(f) = find_all().into_iter().find(|f| f.name == known.name) {
        return Ok(f.path);
    }
    Err(DiscoverError::NotFound {
        name: spec.to_string(),
        wheel: known.wheel,
        looked: format!(
            "{} and {}'s site-packages",
            cached_path(known).display(),
            python()
        ),
        hint: if spec == "cpu" {
            " (or run `xtrain plugins install cpu`)"
        } else {
            ""
        },
    })
}

/// Resolve `cpu`, installing the CPU plugin into the cache first if it is nowhere to be found.
/// Prints one line to stderr when it installs, so a first run says why it takes a moment.
pub fn resolve_or_install(spec: Option<&str>) -> Result<PathBuf, DiscoverError> {
    match resolve(spec) {
        Err(DiscoverError::NotFound { name, .. }) if name == "cpu" => {
            eprintln!(
                "xtrain: no CPU PJRT plugin found; installing the xla-cpu-pjrt wheel into {} (once)",
                cache_dir().join("plugins").display()
            );
            install_cpu()
        }
        other => other,
    }
}

/// Download the `xla-cpu-pjrt` wheel with the system's pip and unpack its plugin into the cache.
/// Safe to run from several processes at once: each unpacks into its own temp dir and renames.
pub fn install_cpu() -> Result<PathBuf, DiscoverError> {
    let known = &KNOWN[0];
    let target = cached_path(known);
    if target.is_file() {
        return Ok(target);
    }
    let err = |m: String| DiscoverError::Install(m);
    let plugins = cache_dir().join("plugins");
    std::fs::create_dir_all(&plugins)
        .map_err(|e| err(format!("cannot create {}: {e}", plugins.display())))?;
    let tmp = plugins.join(format!(".install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
    let result = (|| {
        let status = Command::new(python())
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--quiet",
            ])
            .arg("-d")
            .arg(&tmp)
            .arg("xla-cpu-pjrt")
            .status()
            .map_err(|e| err(format!("cannot run {} -m pip: {e}", python())))?;
        if !status.success() {
            return Err(err(format!(
                "`{} -m pip download xla-cpu-pjrt` failed ({status})",
                python()
            )));
        }
        let wheel = std::fs::read_dir(&tmp)
            .map_err(|e| err(e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| err("pip downloaded no wheel".into()))?;
        let unpacked = tmp.join("unpacked");
        let status = Command::new(python())
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked)
            .status()
            .map_err(|e| err(e.to_string()))?;
        if !status.success() {
            return Err(err(format!("cannot unpack {}", wheel.display())));
        }
        let so = unpacked.join(known.layouts[0]);
        if !so.is_file() {
            return Err(err(format!("the wheel has no {}", known.layouts[0])));
        }
        let dir = target.parent().unwrap();
        let staged = tmp.join(known.name);
        std::fs::create_dir_all(&staged).map_err(|e| err(e.to_string()))?;
        std::fs::rename(&so, staged.join(target.file_name().unwrap()))
            .map_err(|e| err(e.to_string()))?;
        // Another process may have won the race; its copy is as good as ours.
        if std::fs::rename(&staged, dir).is_err() && !target.is_file() {
            return Err(err(format!(
                "cannot move the plugin into {}",
                dir.display()
            )));
        }
        Ok(target.clone())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}
