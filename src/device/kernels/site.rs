//! What a kernel is given: the attention composite's attributes, read and checked by the
//! contract in `model::flash` (names, types, the causal rule, the operands' shapes against
//! them), and the decomposition's operand and result types.

use crate::model::flash::{Attributes, GradOperands, Operands};
use anyhow::{bail, Result};
use hlo::{Builder, CompositeCall, Shape, Value};

/// What a kernel is built from.
#[derive(Clone, Debug)]
pub struct Site {
    pub attributes: Attributes,
    pub params: Vec<Shape>,
    pub results: Vec<Shape>,
}

impl Site {
    /// An attention composite call of the program text, checked against the contract.
    pub fn of(call: &CompositeCall) -> Result<Site> {
        Ok(Site {
            attributes: Attributes::from_site(call)?,
            params: call.operands.clone(),
            results: call.results.clone(),
        })
    }

    /// The queries' shape: [B, KV, 2, Cp, G, D].
    pub(super) fn q(&self) -> &Shape {
        &self.params[0]
    }
}

/// The kernel's parameters, named as the decomposition's, checked against its signature.
fn params(b: &mut Builder, site: &Site, names: &[&str]) -> Result<Vec<Value>> {
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

/// The forward composite's operands as the kernel's parameters.
pub(super) fn forward_params(b: &mut Builder, site: &Site) -> Result<Operands<Value>> {
    Ok(Operands::of(&params(b, site, &Operands::<Value>::NAMES)?))
}

/// The backward composite's operands as the kernel's parameters.
pub(super) fn backward_params(b: &mut Builder, site: &Site) -> Result<GradOperands<Value>> {
    Ok(GradOperands::of(&params(
        b,
        site,
        &GradOperands::<Value>::NAMES,
    )?))
}
