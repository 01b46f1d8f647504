//! The StableHLO text printer. Deterministic: the same graph always prints the same bytes.
//!
//! Simple ops use StableHLO's short ("pretty") forms, the rest the generic form, which every
//! parser accepts. Parameters print under their own names (`%lora.q.A`); other values are
//! numbered in definition order across the whole function, nested regions included.
//!
//! The text is also read back here (`read`): a module's composite calls and private functions,
//! and a function put in one's place, for a target that brings its own implementation of a
//! composite. Printer and reader share the pieces they find things by (`syntax`).
mod literals;
mod printer;
mod read;
mod syntax;

pub use read::{composite_calls, function_signature, replace_function, CompositeCall};

use crate::graph::*;
use printer::Printer;
use std::collections::HashMap;
use std::fmt::Write;
use std::rc::Rc;
use syntax::sanitize;

/// A module: the entry function `main` (first), helper functions, and an optional device mesh.
#[derive(Clone, Debug)]
pub struct Module {
    pub name: String,
    pub funcs: Vec<Func>,
    pub mesh: Option<Mesh>,
}

impl Module {
    pub fn new(name: &str, main: Func) -> Module {
        Module {
            name: name.to_string(),
            funcs: vec![main],
            mesh: None,
        }
    }

    pub fn with_mesh(mut self, mesh: Mesh) -> Module {
        self.mesh = Some(mesh);
        self
    }

    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let partitions = self.mesh.as_ref().map_or(1, |m| m.device_count());
        let _ = writeln!(
            out,
            "module @{} attributes {{mhlo.num_partitions = {partitions} : i32, mhlo.num_replicas = 1 : i32}} {{",
            sanitize(&self.name)
        );
        if let Some(mesh) = &self.mesh {
            let axes: Vec<String> = mesh
                .axes
                .iter()
                .map(|(n, s)| format!("\"{n}\"={s}"))
                .collect();
            let _ = writeln!(out, "  sdy.mesh @mesh = <[{}]>", axes.join(", "));
        }
        let decomps = Rc::new(self.decompositions());
        for (i, f) in self.funcs.iter().enumerate() {
            // XLA runs the function called `main`; the others are helpers.
            let (vis, name) = if i == 0 {
                ("public", "main".to_string())
            } else {
                ("private", sanitize(&f.name))
            };
            Printer::new(&decomps).func(&mut out, f, vis, &name);
        }
        out.push_str(&decomps.text);
        out.push_str("}\n");
        out
    }

    /// The composites' decompositions as private functions, inner ones first, each distinct
    /// text once: named after the composite (`@xtrain.attention.impl`, then `.impl.1`, ...).
    fn decompositions(&self) -> Decompositions {
        fn walk<'a>(f: &'a Func, found: &mut Vec<(&'a str, &'a Func)>) {
            for n in &f.nodes {
                match &n.op {
                    Op::While { cond, body } => {
                        walk(cond, found);
                        walk(body, found);
                    }
                    Op::ManualComputation(m) => walk(&m.body, found),
                    Op::Composite(c) => {
                        walk(&c.decomposition, found);
                        found.push((&c.name, &c.decomposition));
                    }
                    _ => {}
                }
            }
        }
        let mut found = Vec::new();
        for f in &self.funcs {
            walk(f, &mut found);
        }
        let mut d = Decompositions::default();
        let mut by_text: HashMap<String, String> = HashMap::new();
        let mut per_name: HashMap<String, usize> = HashMap::new();
        for (name, f) in found {
            let mut body = String::new();
            let known = Rc::new(std::mem::take(&mut d));
            Printer::new(&known).func(&mut body, f, "private", "NAME");
            d = Rc::try_unwrap(known).unwrap_or_default();
            let symbol = match by_text.get(&body) {
                Some(s) => s.clone(),
                None => {
                    let k = per_name.entry(name.to_string()).or_default();
                    let symbol = match *k {
                        0 => format!("{}.impl", sanitize(name)),
                        k => format!("{}.impl.{k}", sanitize(name)),
                    };
                    *k += 1;
                    let text = body.replacen("@NAME(", &format!("@{symbol}("), 1);
                    d.text.push_str(&text);
                    by_text.insert(body, symbol.clone());
                    symbol
                }
            };
            d.names.insert(f as *const Func as usize, symbol);
        }
        d
    }
}

/// The printed decompositions and the symbol of each composite's (by the address of its
/// function, which lives as long as the module being printed).
#[derive(Default)]
pub(super) struct Decompositions {
    names: HashMap<usize, String>,
    text: String,
}

/// `f` printed alone as `func.func private @name`, for putting in a program's text in place of
/// another function of the same signature (a kernel for a composite's decomposition). It must
/// hold no composite of its own.
pub fn function_text(f: &Func, name: &str) -> String {
    let mut out = String::new();
    Printer::new(&Rc::new(Decompositions::default())).func(&mut out, f, "private", name);
    out
}
