//! A `--sharding-rules` file, read and parsed into the rules that place tensors on a mesh
//! (`program::sharding::Rules::parse`; `program` reads no file).

use crate::program::sharding::Rules;
use anyhow::{Context, Result};
use std::path::Path;

/// The default rules overridden by the rules file `path`.
pub fn read_rules(path: &Path) -> Result<Rules> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Rules::parse(&text, path)
}
