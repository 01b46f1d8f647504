//! What a kernel is given: the composite's attributes and its decomposition's signature.

use anyhow::{bail, Result};
use hlo::{Attr, Builder, Shape, Value};
use std::collections::BTreeMap;

/// What a kernel is built from: the composite's attributes and its decomposition's signature.
#[derive(Clone, Debug)]
pub struct Site {
    pub attributes: BTreeMap<String, Attr>,
    pub params: Vec<Shape>,
    pub results: Vec<Shape>,
}

impl Site {
    pub(super) fn int(&self, name: &str) -> Result<i64> {
        match self.attributes.get(name) {
            Some(Attr::Int(v)) => Ok(*v),
            other => bail!("the composite's attribute {name} is {other:?}, not an integer"),
        }
    }

    pub(super) fn float(&self, name: &str) -> Result<f64> {
        match self.attributes.get(name) {
            Some(Attr::Float(v)) => Ok(*v),
            other => bail!("the composite's attribute {name} is {other:?}, not a float"),
        }
    }
}

/// The attention composites' operands, in order: the forward's (-> out, lse) and the
/// backward's (-> dq, dk, dv), as `model::flash` passes them.
pub(super) const FORWARD_OPERANDS: [&str; 6] =
    ["q", "k", "v", "query_docs", "key_docs", "chunk_ids"];
pub(super) const BACKWARD_OPERANDS: [&str; 9] = [
    "q",
    "k",
    "v",
    "query_docs",
    "key_docs",
    "chunk_ids",
    "out",
    "lse",
    "dout",
];

/// The kernel's parameters, named as the decomposition's, checked against its signature.
pub(super) fn params(b: &mut Builder, site: &Site, names: &[&str]) -> Result<Vec<Value>> {
    if site.params.len() != names.len() {
        bail!(
            "the decomposition takes {} operands, the kernel {}",
            site.params.len(),
            names.len()
        );
    }
    Ok(names
        .iter()
        .zip(&site.params)
        .map(|(n, s)| b.param(n, s.clone()))
        .collect())
}
