//! The printer of one function: names each value, and writes each node as an op (short
//! forms where StableHLO has them), with its regions nested.

use super::literals::*;
use super::syntax::*;
use super::Decompositions;
use crate::graph::*;
use crate::types::{DType, Shape};
use std::collections::HashMap;
use std::fmt::Write;
use std::rc::Rc;

pub(super) struct Printer {
    counter: usize,
    decomps: Rc<Decompositions>,
}

struct Names(HashMap<Value, String>);

impl Names {
    fn get(&self, v: Value) -> &str {
        &self.0[&v]
    }

    fn list(&self, vs: &[Value]) -> String {
        vs.iter()
            .map(|&v| self.get(v).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn types(f: &Func, vs: &[Value]) -> String {
    vs.iter()
        .map(|&v| f.shape(v).to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// An op's result types as its signature writes them: one bare, several in parentheses.
fn result_types(f: &Func, vs: &[Value]) -> String {
    match vs.len() {
        1 => types(f, vs),
        _ => format!("({})", types(f, vs)),
    }
}

impl Printer {
    pub(super) fn new(decomps: &Rc<Decompositions>) -> Printer {
        Printer {
            counter: 0,
            decomps: decomps.clone(),
        }
    }

    fn fresh(&mut self) -> String {
        let n = self.counter;
        self.counter += 1;
        format!("%{n}")
    }

    pub(super) fn func(&mut self, out: &mut String, f: &Func, visibility: &str, name: &str) {
        let mut names = Names(HashMap::new());
        let mut used = std::collections::HashSet::new();
        let mut params = Vec::new();
        for p in &f.params {
            let mut name = sanitize(&p.name);
            if name.chars().all(|c| c.is_ascii_digit()) || !used.insert(name.clone()) {
                let mut k = 1;
                while !used.insert(format!("{name}_{k}")) {
                    k += 1;
                }
                name = format!("{name}_{k}");
            }
            let mut attrs = Vec::new();
            if let Some(o) = p.attrs.alias_output {
                attrs.push(format!("tf.aliasing_output = {o} : i32"));
            }
            if let Some(s) = &p.attrs.sharding {
                attrs.push(format!("sdy.sharding = #sdy.sharding{}", sharding_attr(s)));
            }
            if let Some(m) = p.attrs.memory {
                attrs.push(format!("mhlo.memory_kind = \"{}\"", m.name()));
            }
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                format!(" {{{}}}", attrs.join(", "))
            };
            params.push(format!("%{name}: {}{attrs}", f.shape(p.value)));
            names.0.insert(p.value, format!("%{name}"));
        }
        let results: Vec<String> = f
            .results
            .iter()
            .map(|r| {
                let mut attrs = vec![format!("xtrain.name = \"{}\"", escape(&r.name))];
                if let Some(s) = &r.sharding {
                    attrs.push(format!("sdy.sharding = #sdy.sharding{}", sharding_attr(s)));
                }
                format!("{} {{{}}}", f.shape(r.value), attrs.join(", "))
            })
            .collect();
        let _ = writeln!(
            out,
            "{}{}{FUNC_RESULTS}{}) {{",
            func_head(visibility, name),
            params.join(", "),
            results.join(", ")
        );
        self.body(out, f, &mut names, "    ");
        let rv: Vec<Value> = f.results.iter().map(|r| r.value).collect();
        let _ = writeln!(out, "    return {} : {}", names.list(&rv), types(f, &rv));
        out.push_str(FUNC_END);
    }

    /// Print a region: a block whose arguments are `f`'s params, ending in `stablehlo.return`.
    fn region(&mut self, out: &mut String, f: &Func, indent: &str) {
        let mut names = Names(HashMap::new());
        let args: Vec<String> = f
            .params
            .iter()
            .map(|p| {
                let n = self.fresh();
                names.0.insert(p.value, n.clone());
                format!("{n}: {}", f.shape(p.value))
            })
            .collect();
        let _ = writeln!(out, "{indent}^bb0({}):", args.join(", "));
        let inner = format!("{indent}  ");
        self.body(out, f, &mut names, &inner);
        let rv: Vec<Value> = f.results.iter().map(|r| r.value).collect();
        let _ = writeln!(
            out,
            "{inner}stablehlo.return {} : {}",
            names.list(&rv),
            types(f, &rv)
        );
    }

    fn body(&mut self, out: &mut String, f: &Func, names: &mut Names, indent: &str) {
        for node in &f.nodes {
            let alias: Option<Vec<Value>> = match node.op {
                Op::StopGradient => Some(vec![node.inputs[0]]),
                Op::UseSaved => Some(vec![node.inputs[1]]),
                Op::CustomVjp(_) => Some(node.inputs[..node.outputs.len()].to_vec()),
                _ => None,
            };
            if let Some(srcs) = alias {
                for (&out, src) in node.outputs.iter().zip(srcs) {
                    let src = names.get(src).to_string();
                    names.0.insert(out, src);
                }
                continue;
            }
            let result = self.fresh();
            if node.outputs.len() == 1 {
                names.0.insert(node.outputs[0], result.clone());
            } else {
                for (k, &o) in node.outputs.iter().enumerate() {
                    names.0.insert(o, format!("{result}#{k}"));
                }
            }
            let lhs = if node.outputs.len() == 1 {
                result.clone()
            } else {
                format!("{result}:{}", node.outputs.len())
            };
            let text = self.op_text(f, node, names, indent);
            let loc = node
                .loc
                .as_ref()
                .map(|l| format!(" loc(\"{}\")", escape(l)))
                .unwrap_or_default();
            let _ = writeln!(out, "{indent}{lhs} = {text}{loc}");
        }
    }

    fn op_text(&mut self, f: &Func, node: &Node, names: &Names, indent: &str) -> String {
        let ins = names.list(&node.inputs);
        let in_types = types(f, &node.inputs);
        let out_t = f.shape(node.outputs[0]);
        let sig = format!("({in_types}) -> {out_t}");
        let generic = |name: &str, props: String| {
            let props = if props.is_empty() {
                String::new()
            } else {
                format!(" <{{{props}}}>")
            };
            format!("\"stablehlo.{name}\"({ins}){props} : {sig}")
        };
        match &node.op {
            Op::Constant(lit) => format!("stablehlo.constant {} : {out_t}", dense_text(lit, out_t)),
            Op::Iota { dim } => format!("stablehlo.iota dim = {dim} : {out_t}"),
            Op::Unary(u) => format!("stablehlo.{} {ins} : {out_t}", u.mlir()),
            Op::Binary(b) => format!("stablehlo.{} {ins} : {out_t}", b.mlir()),
            Op::Compare(dir) => {
                let kind = compare_kind(f.dtype(node.inputs[0]));
                format!("stablehlo.compare {}, {ins}, {kind} : {sig}", dir.mlir())
            }
            Op::Select => generic("select", String::new()),
            Op::Clamp => generic("clamp", String::new()),
            Op::Convert => format!("stablehlo.convert {ins} : {sig}"),
            Op::BitcastConvert => format!("stablehlo.bitcast_convert {ins} : {sig}"),
            Op::BroadcastInDim { dims } => format!("stablehlo.broadcast_in_dim {ins}, dims = {} : {sig}", i64_list(dims)),
            Op::Reshape => format!("stablehlo.reshape {ins} : {sig}"),
            Op::Transpose { perm } => format!("stablehlo.transpose {ins}, dims = {} : {sig}", i64_list(perm)),
            Op::Slice { start, limit, strides } => generic("slice", slice_props(start, limit, strides)),
            Op::DynamicSlice { sizes } => generic("dynamic_slice", format!("slice_sizes = {}", i64_array(sizes))),
            Op::DynamicUpdateSlice => generic("dynamic_update_slice", String::new()),
            Op::Concatenate { dim } => generic("concatenate", format!("dimension = {dim} : i64")),
            Op::Pad { low, high, interior } => generic("pad", pad_props(low, high, interior)),
            Op::Gather { dims, slice_sizes } => generic(
                "gather",
                format!(
                    "dimension_numbers = #stablehlo.gather<{}>, indices_are_sorted = false, slice_sizes = {}",
                    dimension_fields(
                        &[
                            ("offset_dims", &dims.offset_dims),
                            ("collapsed_slice_dims", &dims.collapsed_slice_dims),
                            ("start_index_map", &dims.start_index_map),
                        ],
                        dims.index_vector_dim
                    ),
                    i64_array(slice_sizes)
                ),
            ),
            Op::Scatter { dims, combiner } => {
                let fields = dimension_fields(
                    &[
                        ("update_window_dims", &dims.update_window_dims),
                        ("inserted_window_dims", &dims.inserted_window_dims),
                        ("scatter_dims_to_operand_dims", &dims.scatter_dims_to_operand_dims),
                    ],
                    dims.index_vector_dim,
                );
                let body = self.scatter_combiner(combiner, out_t.dtype, indent);
                format!(
                    "\"stablehlo.scatter\"({ins}) <{{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{fields}>, unique_indices = false}}> ({body}) : {sig}"
                )
            }
            Op::DotGeneral { dims, precision } => dot_general_text(&ins, dims, *precision, &sig),
            Op::Reduce { dims, combiner } => {
                let op = match combiner {
                    Combiner::Add => "add",
                    Combiner::Max => "maximum",
                    _ => "minimum",
                };
                let (x, init) = (names.get(node.inputs[0]), names.get(node.inputs[1]));
                format!("stablehlo.reduce({x} init: {init}) applies stablehlo.{op} across dimensions = {} : {sig}", i64_list(dims))
            }
            Op::While { cond, body } => {
                let outs = types(f, &node.outputs);
                self.while_text(&ins, &in_types, &outs, cond, body, indent)
            }
            Op::OptimizationBarrier => {
                let outs = result_types(f, &node.outputs);
                format!("\"stablehlo.optimization_barrier\"({ins}) : ({in_types}) -> {outs}")
            }
            Op::ShardingConstraint(sh) => format!("sdy.sharding_constraint {ins} {} : {out_t}", sharding_attr(sh)),
            Op::Place(m) => format!(
                "stablehlo.custom_call @annotate_device_placement({ins}) {{has_side_effect = true, mhlo.frontend_attributes = {{_xla_buffer_placement = \"{}\"}}}} : ({in_types}) -> {out_t}",
                m.name()
            ),
            Op::Uninitialized => format!("stablehlo.custom_call @AllocateBuffer() : () -> {out_t}"),
            Op::RngBitGenerator => format!(
                "\"stablehlo.rng_bit_generator\"({ins}) <{{rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>}}> : ({in_types}) -> ({})",
                types(f, &node.outputs)
            ),
            Op::Composite(c) => self.composite_text(f, node, c, (&ins, &in_types)),
            Op::CustomCall(c) => custom_call_text(f, node, c, (&ins, &in_types)),
            Op::ManualComputation(m) => {
                let outs = result_types(f, &node.outputs);
                self.manual_text(&ins, &in_types, &outs, m, indent)
            }
            Op::StopGradient | Op::UseSaved | Op::CustomVjp(_) => {
                unreachable!("aliases print as their source")
            }
        }
    }

    /// A composite call: its name, attributes, decomposition and version, in the pieces the
    /// reader (`read`) finds them by.
    fn composite_text(
        &self,
        f: &Func,
        node: &Node,
        c: &Composite,
        (ins, in_types): (&str, &str),
    ) -> String {
        let symbol = &self.decomps.names[&(&c.decomposition as *const Func as usize)];
        let attrs: Vec<String> = c
            .attributes
            .iter()
            .map(|(k, v)| format!("{k}{ATTR_IS}{}", attr_text(v)))
            .collect();
        let outs = result_types(f, &node.outputs);
        format!(
            "{COMPOSITE_OP}\"{}\" {ins} {COMPOSITE_ATTRS}{}{COMPOSITE_DECOMPOSITION}{symbol}{COMPOSITE_VERSION}{}{COMPOSITE_END}{in_types}) -> {outs}",
            escape(&c.name),
            attrs.join(LIST_SEP),
            c.version
        )
    }

    /// A manual computation: the shardings, the per-device body, then the global types.
    fn manual_text(
        &mut self,
        ins: &str,
        in_types: &str,
        outs: &str,
        m: &ManualComputation,
        indent: &str,
    ) -> String {
        let list = |ss: &[Sharding]| ss.iter().map(sharding_attr).collect::<Vec<_>>().join(", ");
        let axes: Vec<String> = m.manual_axes.iter().map(|a| format!("\"{a}\"")).collect();
        let mut names = Names(HashMap::new());
        let args: Vec<String> = m
            .body
            .params
            .iter()
            .map(|p| {
                let n = self.fresh();
                names.0.insert(p.value, n.clone());
                format!("{n}: {}", m.body.shape(p.value))
            })
            .collect();
        let mut s = format!(
            "sdy.manual_computation({ins}) in_shardings=[{}] out_shardings=[{}] manual_axes={{{}}} ({}) {{\n",
            list(&m.in_shardings),
            list(&m.out_shardings),
            axes.join(", "),
            args.join(", ")
        );
        let inner = format!("{indent}  ");
        self.body(&mut s, &m.body, &mut names, &inner);
        let rv: Vec<Value> = m.body.results.iter().map(|r| r.value).collect();
        let _ = writeln!(
            s,
            "{inner}sdy.return {} : {}",
            names.list(&rv),
            types(&m.body, &rv)
        );
        let _ = write!(s, "{indent}}} : ({in_types}) -> {outs}");
        s
    }

    /// A while loop: its condition and body regions, then the loop's types.
    fn while_text(
        &mut self,
        ins: &str,
        in_types: &str,
        outs: &str,
        cond: &Func,
        body: &Func,
        indent: &str,
    ) -> String {
        let mut s = format!("\"stablehlo.while\"({ins}) ({{\n");
        self.region(&mut s, cond, indent);
        let _ = writeln!(s, "{indent}}}, {{");
        self.region(&mut s, body, indent);
        let _ = write!(s, "{indent}}}) : ({in_types}) -> ({outs})");
        s
    }

    /// The region that combines an old and a new element in a scatter: their sum, or the new one.
    fn scatter_combiner(&mut self, combiner: &Combiner, dtype: DType, indent: &str) -> String {
        let scalar = Shape::scalar(dtype);
        let (a, b) = (self.fresh(), self.fresh());
        let inner = format!("{indent}  ");
        let body = match combiner {
            Combiner::Add => {
                let s = self.fresh();
                format!("{inner}{s} = stablehlo.add {a}, {b} : {scalar}\n{inner}stablehlo.return {s} : {scalar}\n")
            }
            _ => format!("{inner}stablehlo.return {b} : {scalar}\n"),
        };
        format!("{{\n{indent}^bb0({a}: {scalar}, {b}: {scalar}):\n{body}{indent}}}")
    }
}

fn slice_props(start: &[i64], limit: &[i64], strides: &[i64]) -> String {
    format!(
        "limit_indices = {}, start_indices = {}, strides = {}",
        i64_array(limit),
        i64_array(start),
        i64_array(strides)
    )
}

fn pad_props(low: &[i64], high: &[i64], interior: &[i64]) -> String {
    format!(
        "edge_padding_high = {}, edge_padding_low = {}, interior_padding = {}",
        i64_array(high),
        i64_array(low),
        i64_array(interior)
    )
}

/// How a compare of this element type orders its operands.
fn compare_kind(dt: DType) -> &'static str {
    if dt.is_float() {
        "FLOAT"
    } else if dt.is_signed_int() {
        "SIGNED"
    } else {
        "UNSIGNED"
    }
}

/// The non-empty dimension lists of a gather's or scatter's dimension numbers, then the index
/// vector dimension (which is always printed).
fn dimension_fields(lists: &[(&str, &Vec<i64>)], index_vector_dim: i64) -> String {
    let mut fields: Vec<String> = lists
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k} = {}", i64_list(v)))
        .collect();
    fields.push(format!("index_vector_dim = {index_vector_dim}"));
    fields.join(", ")
}

fn dot_general_text(ins: &str, dims: &DotDims, precision: Option<Precision>, sig: &str) -> String {
    let mut s = format!("stablehlo.dot_general {ins}");
    if !dims.lhs_batch.is_empty() {
        let _ = write!(
            s,
            ", batching_dims = {} x {}",
            i64_list(&dims.lhs_batch),
            i64_list(&dims.rhs_batch)
        );
    }
    let _ = write!(
        s,
        ", contracting_dims = {} x {}",
        i64_list(&dims.lhs_contract),
        i64_list(&dims.rhs_contract)
    );
    if let Some(p) = precision {
        let p = match p {
            Precision::Default => "DEFAULT",
            Precision::High => "HIGH",
            Precision::Highest => "HIGHEST",
        };
        let _ = write!(s, ", precision = [{p}, {p}]");
    }
    let _ = write!(s, " : {sig}");
    s
}

/// A custom call with its backend config and layouts.
fn custom_call_text(
    f: &Func,
    node: &Node,
    c: &CustomCall,
    (ins, in_types): (&str, &str),
) -> String {
    let layouts = |ls: &[Vec<i64>]| {
        let each: Vec<String> = ls
            .iter()
            .map(|l| match l.len() {
                0 => "dense<> : tensor<0xindex>".to_string(),
                n => format!("dense<{}> : tensor<{n}xindex>", i64_list(l)),
            })
            .collect();
        format!("[{}]", each.join(", "))
    };
    let outs = result_types(f, &node.outputs);
    format!(
        "stablehlo.custom_call @{}({ins}) {{api_version = 2 : i32, backend_config = \"{}\", operand_layouts = {}, result_layouts = {}}} : ({in_types}) -> {outs}",
        c.target,
        escape(&c.backend_config),
        layouts(&c.operand_layouts),
        layouts(&c.result_layouts)
    )
}
