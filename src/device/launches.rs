//! How many operations a compiled step launches, read from the compiler's optimized HLO text:
//! each instruction of the entry computation that runs as a kernel or a library call (a fusion,
//! a dot, a custom call, a copy, a collective; not a parameter, constant, tuple or bitcast,
//! which only name buffers), with a while loop's body counted once per trip (its
//! `known_trip_count`) and its condition once more than that, and a call's or conditional's
//! computation (its largest branch) in place. A fused computation is one launch, whatever it
//! holds. `xtrain plan`'s time model prices each launch with the device's overhead per
//! operation; nothing here times anything.

use std::collections::HashMap;

/// What a module launches per run: the count, and whether some loop had no known trip count
/// (counted as one trip).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Launches {
    pub count: f64,
    pub unknown_trips: bool,
}

/// Instructions that only name or rearrange buffers: no launch.
const FREE: &[&str] = &[
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "after-all",
    "add-dependency",
    "partition-id",
    "replica-id",
    "domain",
];

/// The launches of the optimized module `text` (its `ENTRY` computation); None where the text
/// has no entry computation.
pub fn launches(text: &str) -> Option<Launches> {
    let computations = computations(text);
    let entry = text
        .lines()
        .find(|l| l.starts_with("ENTRY "))
        .and_then(computation_name)?;
    let mut memo = HashMap::new();
    let mut unknown = false;
    let count = count_of(&entry, &computations, &mut memo, &mut unknown, 0);
    Some(Launches {
        count,
        unknown_trips: unknown,
    })
}

/// Each computation's instruction lines, by name.
fn computations(text: &str) -> HashMap<String, Vec<&str>> {
    let mut out: HashMap<String, Vec<&str>> = HashMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if current.is_none() {
            if t.ends_with('{') {
                current = computation_name(t);
                if let Some(c) = &current {
                    out.entry(c.clone()).or_default();
                }
            }
            continue;
        }
        if t == "}" {
            current = None;
            continue;
        }
        if let Some(c) = &current {
            out.entry(c.clone()).or_default().push(t);
        }
    }
    out
}

/// `%name` of a computation's header line (`%body.3 (p: f32[]) -> f32[] {`, `ENTRY %main ...`).
fn computation_name(header: &str) -> Option<String> {
    let h = header.strip_prefix("ENTRY ").unwrap_or(header);
    let name = h.split_whitespace().next()?;
    name.starts_with('%')
        .then(|| name.trim_start_matches('%').to_string())
}

/// The launches of computation `name` per run.
fn count_of(
    name: &str,
    all: &HashMap<String, Vec<&str>>,
    memo: &mut HashMap<String, f64>,
    unknown: &mut bool,
    depth: usize,
) -> f64 {
    if let Some(&c) = memo.get(name) {
        return c;
    }
    let Some(lines) = all.get(name) else {
        return 0.0;
    };
    // A cycle cannot occur in HLO; the depth only guards against a malformed text.
    if depth > 64 {
        return 0.0;
    }
    let mut total = 0.0;
    for line in lines {
        let Some(op) = opcode(line) else { continue };
        total += match op {
            "while" => {
                let trips = trip_count(line);
                *unknown |= trips.is_none();
                let n = trips.unwrap_or(1) as f64;
                let body =
                    attr(line, "body=").map_or(0.0, |b| count_of(b, all, memo, unknown, depth + 1));
                let cond = attr(line, "condition=")
                    .map_or(0.0, |c| count_of(c, all, memo, unknown, depth + 1));
                n * body + (n + 1.0) * cond
            }
            "call" => {
                attr(line, "to_apply=").map_or(1.0, |c| count_of(c, all, memo, unknown, depth + 1))
            }
            "conditional" => branches(line)
                .iter()
                .map(|b| count_of(b, all, memo, unknown, depth + 1))
                .fold(0.0, f64::max),
            op if FREE.contains(&op) => 0.0,
            _ => 1.0,
        };
    }
    memo.insert(name.to_string(), total);
    total
}

/// The opcode of an instruction line (`%x = f32[2]{0} fusion(%a), kind=kLoop, calls=%f`):
/// the word right before the first `(` that follows a space after the `=`.
fn opcode(line: &str) -> Option<&str> {
    let rest = line.split_once(" = ")?.1;
    let bytes = rest.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'(' || i == 0 {
            continue;
        }
        let start = rest[..i].rfind(' ').map_or(0, |s| s + 1);
        let word = &rest[start..i];
        if !word.is_empty()
            && word
                .bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            && word.as_bytes()[0].is_ascii_lowercase()
        {
            return Some(word);
        }
    }
    None
}

/// The computation an attribute names (`body=%body.3,` -> `body.3`).
fn attr<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(key)? + key.len();
    let rest = line[at..].trim_start_matches('%');
    let end = rest.find([',', ' ', '}', ')']).unwrap_or(rest.len());
    Some(&rest[..end])
}

/// A conditional's branch computations (`branch_computations={%a, %b}`, or
/// `true_computation=%t, false_computation=%f`).
fn branches(line: &str) -> Vec<&str> {
    if let Some(at) = line.find("branch_computations={") {
        let rest = &line[at + "branch_computations={".len()..];
        let end = rest.find('}').unwrap_or(rest.len());
        return rest[..end]
            .split(',')
            .map(|b| b.trim().trim_start_matches('%'))
            .collect();
    }
    ["true_computation=", "false_computation="]
        .iter()
        .filter_map(|k| attr(line, k))
        .collect()
}

/// A while loop's `known_trip_count` (`"known_trip_count":{"n":"32"}`).
fn trip_count(line: &str) -> Option<i64> {
    let at = line.find("known_trip_count")?;
    let rest = &line[at..];
    let n = rest.find("\"n\":\"")? + 5;
    let digits: String = rest[n..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop of 32 trips whose body launches a fusion and a dot, and whose condition one
    /// compare, inside an entry that launches a copy and a custom call around it: 2 + 32 x 2 +
    /// 33 x 1; parameters, constants, tuples and bitcasts launch nothing; a fused computation
    /// counts once.
    #[test]
    fn a_loop_counts_its_body_per_trip() {
        let text = r#"HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} add(%p, %p)
  ROOT %m = f32[4]{0} multiply(%a, %a)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(32)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %d = f32[4]{0} dot(%f, %f), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %d)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %c = f32[4]{0} copy(%a)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %c)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
  %g = f32[4]{0} get-tuple-element(%w), index=1
  %b = f32[4]{0} bitcast(%g)
  ROOT %cc = f32[4]{0} custom-call(%b), custom_call_target="x"
}
"#;
        let l = launches(text).unwrap();
        assert_eq!(l.count, 2.0 + 32.0 * 2.0 + 33.0);
        assert!(!l.unknown_trips);
        let no_trips = text.replace(r#", backend_config={"known_trip_count":{"n":"32"}}"#, "");
        let l = launches(&no_trips).unwrap();
        assert_eq!(l.count, 2.0 + 2.0 + 2.0);
        assert!(l.unknown_trips);
    }

    #[test]
    fn opcodes_are_read_past_tuple_types_and_layouts() {
        assert_eq!(
            opcode("%w = (s32[], f32[4]{0}) while(%t), condition=%c, body=%b"),
            Some("while")
        );
        assert_eq!(
            opcode("%f = bf16[8,128]{1,0:T(8,128)(2,1)} fusion(%x), kind=kLoop"),
            Some("fusion")
        );
        assert_eq!(opcode("ROOT %r = f32[] add(%a, %b)"), Some("add"));
    }
}
