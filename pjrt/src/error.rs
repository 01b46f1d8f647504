//! What can go wrong: an [`Error`] names the plugin call that failed and carries the plugin's
//! own words and code.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot load PJRT plugin {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error(
        "PJRT plugin {path} speaks PJRT C API {plugin_major}.{plugin_minor}, but xtrain needs {needed} \
         (xtrain was written against {header_major}.{header_minor}); install a newer plugin"
    )]
    Version {
        path: PathBuf,
        plugin_major: i32,
        plugin_minor: i32,
        needed: String,
        header_major: i32,
        header_minor: i32,
    },
    #[error("{call} failed ({code}): {message}")]
    Plugin {
        call: &'static str,
        code: &'static str,
        message: String,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn error_code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    NAMES.get(code as usize).copied().unwrap_or("UNKNOWN")
}
