//! Reading back what the printer wrote: a module's composite calls (name, version, attributes,
//! operand and result types) and its private functions' signatures, and putting another
//! function in one's place. It reads the printer's own forms, found by the pieces `syntax`
//! writes them with, not MLIR at large: a printer change that it could not follow fails the
//! round-trip tests here, not a target's compiler.

use super::function_text;
use super::syntax::*;
use crate::builder::{Error, Result};
use crate::graph::{Attr, Func, Op};
use crate::types::{DType, Shape};

/// A `stablehlo.composite` call of a module's text.
#[derive(Clone, Debug, PartialEq)]
pub struct CompositeCall {
    pub name: String,
    pub version: i32,
    /// In the order printed (by name: the builder's callers sort them).
    pub attributes: Vec<(String, Attr)>,
    /// The symbol of the private function it stands for (`xtrain.attention.impl`).
    pub decomposition: String,
    pub operands: Vec<Shape>,
    pub results: Vec<Shape>,
    /// Where it is, counted from 1.
    pub line: usize,
}

impl CompositeCall {
    pub fn attribute(&self, name: &str) -> Option<&Attr> {
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
    }
}

fn read_err<T>(message: impl Into<String>) -> Result<T> {
    Err(Error {
        op: "read",
        message: message.into(),
    })
}

/// Every composite call of `text`, in the order written (the calls of a decomposition after
/// the function that calls it, as printed). Floats read back at f32, the precision they are
/// printed at.
pub fn composite_calls(text: &str) -> Result<Vec<CompositeCall>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let Some((_, op)) = line.trim_start().split_once(ATTR_IS) else {
            continue;
        };
        let Some(rest) = op.strip_prefix(COMPOSITE_OP) else {
            continue;
        };
        let call = composite_call(rest, n + 1).map_err(|e| Error {
            op: "read",
            message: format!("line {}: {} in {line}", n + 1, e.message),
        })?;
        out.push(call);
    }
    Ok(out)
}

/// A composite call after its op name: `"NAME" %a, %b {composite_attributes = {..}, ..}`.
fn composite_call(text: &str, line: usize) -> Result<CompositeCall> {
    let mut c = Cursor(text);
    let name = c.string()?;
    c.until(COMPOSITE_ATTRS)?;
    let mut attributes = Vec::new();
    while !c.0.starts_with(COMPOSITE_DECOMPOSITION) {
        if !attributes.is_empty() {
            c.eat(LIST_SEP)?;
        }
        let key = c.until(ATTR_IS)?.to_string();
        attributes.push((key, c.attr()?));
    }
    c.eat(COMPOSITE_DECOMPOSITION)?;
    let decomposition = c.until(COMPOSITE_VERSION)?.to_string();
    let version = c.until(COMPOSITE_END)?;
    let version = version
        .parse()
        .or_else(|_| read_err(format!("version {version:?} is not an i32")))?;
    let operands = types(c.until(") -> ")?)?;
    let results = match c.0.strip_prefix('(') {
        Some(list) => types(list.strip_suffix(')').unwrap_or(list))?,
        None => types(c.0)?,
    };
    Ok(CompositeCall {
        name,
        version,
        attributes,
        decomposition,
        operands,
        results,
        line,
    })
}

/// A comma-separated list of tensor types.
fn types(list: &str) -> Result<Vec<Shape>> {
    if list.is_empty() {
        return Ok(Vec::new());
    }
    list.split(LIST_SEP).map(tensor_type).collect()
}

/// `tensor<2x3xbf16>` (also at the start of a longer text: up to its `>`) as a shape.
fn tensor_type(text: &str) -> Result<Shape> {
    let Some(inner) = text
        .strip_prefix("tensor<")
        .and_then(|t| t.split_once('>'))
        .map(|(inner, _)| inner)
    else {
        return read_err(format!("{text:?} is not a tensor type"));
    };
    let mut parts: Vec<&str> = inner.split('x').collect();
    let element = parts.pop().unwrap_or_default();
    let Some(dtype) = DType::parse(element) else {
        return read_err(format!("unknown element type {element} in tensor<{inner}>"));
    };
    let dims = parts
        .iter()
        .map(|d| d.parse::<i64>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .or_else(|_| {
            read_err(format!(
                "tensor<{inner}> has a dimension that is not a number"
            ))
        })?;
    Ok(Shape::new(&dims, dtype))
}

/// The text not yet read.
struct Cursor<'a>(&'a str);

impl<'a> Cursor<'a> {
    fn eat(&mut self, piece: &str) -> Result<()> {
        match self.0.strip_prefix(piece) {
            Some(rest) => {
                self.0 = rest;
                Ok(())
            }
            None => read_err(format!("expected {piece:?} at {:?}", head(self.0))),
        }
    }

    /// The text before `piece`, with `piece` read too.
    fn until(&mut self, piece: &str) -> Result<&'a str> {
        let Some((before, rest)) = self.0.split_once(piece) else {
            return read_err(format!("expected {piece:?} in {:?}", head(self.0)));
        };
        self.0 = rest;
        Ok(before)
    }

    /// A quoted string as `syntax::escape` writes it.
    fn string(&mut self) -> Result<String> {
        self.eat("\"")?;
        let mut out = String::new();
        let mut chars = self.0.char_indices();
        while let Some((i, ch)) = chars.next() {
            match ch {
                '"' => {
                    self.0 = &self.0[i + 1..];
                    return Ok(out);
                }
                '\\' => match chars.next() {
                    Some((_, e)) => out.push(e),
                    None => break,
                },
                _ => out.push(ch),
            }
        }
        read_err("a string that does not end")
    }

    /// An attribute's value as `syntax::attr_text` writes it.
    fn attr(&mut self) -> Result<Attr> {
        if self.0.starts_with('"') {
            return Ok(Attr::Str(self.string()?));
        }
        let end = self
            .0
            .find(|c: char| !(c.is_ascii_alphanumeric() || "+-.".contains(c)))
            .unwrap_or(self.0.len());
        let number = &self.0[..end];
        self.0 = &self.0[end..];
        if self.0.starts_with(I64_ATTR) {
            self.eat(I64_ATTR)?;
            return match number.parse() {
                Ok(v) => Ok(Attr::Int(v)),
                Err(_) => read_err(format!("{number:?} is not an i64")),
            };
        }
        self.eat(F32_ATTR)?;
        let value = match number.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).ok().map(f32::from_bits),
            None => number.parse::<f32>().ok(),
        };
        match value {
            Some(v) => Ok(Attr::Float(v as f64)),
            None => read_err(format!("{number:?} is not an f32")),
        }
    }
}

fn head(text: &str) -> &str {
    &text[..text.char_indices().nth(40).map_or(text.len(), |(i, _)| i)]
}

/// The byte range of the private function `@name`, from its first line through its last.
fn function_span(text: &str, name: &str) -> Result<(usize, usize)> {
    let first = func_head("private", name);
    let start = if text.starts_with(&first) {
        0
    } else {
        match text.find(&format!("\n{first}")) {
            Some(i) => i + 1,
            None => return read_err(format!("the module has no private function @{name}")),
        }
    };
    match text[start..].find(&format!("\n{FUNC_END}")) {
        Some(e) => Ok((start, start + e + 1 + FUNC_END.len())),
        None => read_err(format!("the function @{name} does not end")),
    }
}

/// The parameter and result types of the private function `@name` of `text`.
pub fn function_signature(text: &str, name: &str) -> Result<(Vec<Shape>, Vec<Shape>)> {
    let (start, _) = function_span(text, name)?;
    let line = text[start..].lines().next().unwrap_or_default();
    let after = &line[func_head("private", name).len()..];
    let close = closing(after)?;
    let params = top_level_items(&after[..close])
        .into_iter()
        .map(|p| match p.split_once(": ") {
            Some((_, ty)) => tensor_type(ty),
            None => read_err(format!("parameter {p:?} of @{name} has no type")),
        })
        .collect::<Result<Vec<_>>>()?;
    let Some(results) = after[close..].strip_prefix(FUNC_RESULTS) else {
        return read_err(format!("@{name}: no results after the parameters"));
    };
    let results = &results[..closing(results)?];
    let results = top_level_items(results)
        .into_iter()
        .map(tensor_type)
        .collect::<Result<Vec<_>>>()?;
    Ok((params, results))
}

/// Where the list that `text` starts inside ends: its `)` at depth 0, outside strings.
fn closing(text: &str) -> Result<usize> {
    match first_at_top(text, |_, ch| ch == ')') {
        Some(i) => Ok(i),
        None => read_err(format!("a list that does not close: {:?}", head(text))),
    }
}

/// `text` cut at each `, ` outside brackets and strings.
fn top_level_items(text: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let cut = first_at_top(rest, |i, ch| ch == ',' && rest[i..].starts_with(LIST_SEP))
            .unwrap_or(rest.len());
        items.push(&rest[..cut]);
        rest = rest.get(cut + LIST_SEP.len()..).unwrap_or("");
    }
    items
}

/// The first position of `text`, outside strings and at bracket depth 0, whose character
/// `wanted` takes: the one walk over brackets and strings that [`closing`] and
/// [`top_level_items`] share. A closing bracket at depth 0 is offered before it is passed over.
fn first_at_top(text: &str, wanted: impl Fn(usize, char) -> bool) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, ch) in text.char_indices() {
        match (in_string, ch) {
            (true, _) if escaped => escaped = false,
            (true, '\\') => escaped = true,
            (_, '"') => in_string = !in_string,
            (true, _) => {}
            (false, '(' | '{' | '[' | '<') => depth += 1,
            (false, _) if depth == 0 && wanted(i, ch) => return Some(i),
            (false, ')' | '}' | ']' | '>') => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// `text` with the private function `@name` replaced by `f`, printed under that name. `f`
/// must take and give what `@name` does (a kernel in a composite decomposition's place) and
/// hold no composite of its own.
pub fn replace_function(text: &str, name: &str, f: &Func) -> Result<String> {
    let (start, end) = function_span(text, name)?;
    let (params, results) = function_signature(text, name)?;
    let takes: Vec<Shape> = f.params.iter().map(|p| f.shape(p.value).clone()).collect();
    let gives: Vec<Shape> = f.results.iter().map(|r| f.shape(r.value).clone()).collect();
    if (&takes, &gives) != (&params, &results) {
        return read_err(format!(
            "@{name} takes {} and gives {}, its replacement takes {} and gives {}",
            list(&params),
            list(&results),
            list(&takes),
            list(&gives)
        ));
    }
    if holds_composite(f) {
        return read_err(format!(
            "the replacement of @{name} holds a composite of its own"
        ));
    }
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..start]);
    out.push_str(&function_text(f, name));
    out.push_str(&text[end..]);
    Ok(out)
}

fn list(shapes: &[Shape]) -> String {
    let each: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
    format!("({})", each.join(", "))
}

fn holds_composite(f: &Func) -> bool {
    f.nodes.iter().any(|n| match &n.op {
        Op::Composite(_) => true,
        Op::While { cond, body } => holds_composite(cond) || holds_composite(body),
        Op::ManualComputation(m) => holds_composite(&m.body),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_and_types_are_read_in_the_printers_forms() {
        let line = "    %3:2 = stablehlo.composite \"a.\\\"b\" %1, %2 {composite_attributes = {block = -4 : i64, causal = \"x, y\", nan = 0x7FC00000 : f32, scale = 2.5e-1 : f32}, decomposition = @a.b.impl, version = 1 : i32} : (tensor<2x3xf32>, tensor<i32>) -> (tensor<2x3xbf16>, tensor<2xf32>)\n";
        let calls = composite_calls(line).unwrap();
        let c = &calls[0];
        assert_eq!((c.name.as_str(), c.version, c.line), ("a.\"b", 1, 1));
        assert_eq!(c.decomposition, "a.b.impl");
        assert_eq!(c.attribute("block"), Some(&Attr::Int(-4)));
        assert_eq!(c.attribute("causal"), Some(&Attr::Str("x, y".into())));
        assert_eq!(c.attribute("scale"), Some(&Attr::Float(0.25)));
        assert!(matches!(c.attribute("nan"), Some(Attr::Float(v)) if v.is_nan()));
        assert_eq!(
            c.operands,
            [Shape::new(&[2, 3], DType::F32), Shape::scalar(DType::S32)]
        );
        assert_eq!(
            c.results,
            [
                Shape::new(&[2, 3], DType::BF16),
                Shape::new(&[2], DType::F32)
            ]
        );
        let bad = line.replace(" : i32}", " : i16}");
        let e = composite_calls(&bad).unwrap_err().to_string();
        assert!(
            e.starts_with("read: line 1: expected \" : i32} : (\""),
            "{e}"
        );
    }

    #[test]
    fn signatures_are_read_past_attributes_with_commas() {
        let text = "  func.func private @f(%q: tensor<2x3xf32> {sdy.sharding = #sdy.sharding<@mesh, [{\"x\"}, {}]>}, %ids: tensor<2xi32>) -> (tensor<2x3xbf16> {xtrain.name = \"o, (\\\"\"}, tensor<f32> {xtrain.name = \"l\"}) {\n    return\n  }\n";
        let (p, r) = function_signature(text, "f").unwrap();
        assert_eq!(
            p,
            [
                Shape::new(&[2, 3], DType::F32),
                Shape::new(&[2], DType::S32)
            ]
        );
        assert_eq!(
            r,
            [Shape::new(&[2, 3], DType::BF16), Shape::scalar(DType::F32)]
        );
        let e = function_signature(text, "g").unwrap_err().to_string();
        assert!(e.contains("no private function @g"), "{e}");
    }
}
