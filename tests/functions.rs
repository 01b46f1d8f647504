//! No function of the library is longer than [`MOST_LINES`] lines (the project's standard: a
//! function that long does more than one thing). Read from the sources as `cargo fmt` writes
//! them: a function runs from its `fn` line to the first line after it that is its own closing
//! brace, at the indentation the `fn` line has. And no root-crate file is longer than the
//! house rule allows (lines before its unit tests: at most two over 600, none over 900).

mod common;
use common::collect_rs;
use std::path::Path;

/// The longest a function may be, its signature and closing brace included.
const MOST_LINES: usize = 120;

/// Functions over the limit while another issue splits them (the file and the function's name).
/// The list only shrinks: an entry that is no longer over the limit fails the test too, so that
/// it is taken off when its function is split.
const BEING_SPLIT: &[(&str, &str)] = &[];

/// The crates' sources: the library and its two workspace crates.
const ROOTS: [&str; 3] = ["src", "hlo/src", "pjrt/src"];

#[test]
fn no_function_is_longer_than_the_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    let mut listed_and_short = Vec::new();
    let mut files = Vec::new();
    for dir in ROOTS {
        collect_rs(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "read {} files only", files.len());
    let mut seen = 0;
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let lengths = function_lengths(&text);
        seen += lengths.len();
        for (name, line, n) in lengths {
            let listed = BEING_SPLIT.contains(&(rel.as_str(), name.as_str()));
            if n > MOST_LINES && !listed {
                over.push(format!("{rel}:{line} {name}: {n} lines"));
            }
        }
    }
    assert!(
        seen > 1000,
        "found {seen} functions only: the reader lost them"
    );
    for (file, name) in BEING_SPLIT {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_default();
        let still = function_lengths(&text)
            .iter()
            .any(|(n, _, len)| n == name && *len > MOST_LINES);
        if !still {
            listed_and_short.push(format!("{file} {name}"));
        }
    }
    assert!(
        over.is_empty(),
        "functions over {MOST_LINES} lines (split each into named steps):\n  {}",
        over.join("\n  ")
    );
    assert!(
        listed_and_short.is_empty(),
        "take these off BEING_SPLIT, they are split (or gone):\n  {}",
        listed_and_short.join("\n  ")
    );
}

/// A root-crate file's lines before its unit tests: at most [`MOST_FILES_OVER`] files over
/// [`FILE_LINES`], and none over [`MOST_FILE_LINES`] (the house rule for `src/`; a file that
/// grows past them is split along a seam, as `model/llama.rs` and `cluster/server.rs` were).
const FILE_LINES: usize = 600;
const MOST_FILE_LINES: usize = 900;
const MOST_FILES_OVER: usize = 2;

#[test]
fn no_root_file_is_longer_than_the_house_rule() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    collect_rs(&root.join("src"), &mut files);
    assert!(files.len() > 100, "read {} files only", files.len());
    let mut long = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let n = lines_before_tests(&text);
        if n > FILE_LINES {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            long.push((n, rel));
        }
    }
    long.sort();
    let said: Vec<String> = long
        .iter()
        .map(|(n, f)| format!("{f}: {n} lines"))
        .collect();
    assert!(
        long.iter().all(|(n, _)| *n <= MOST_FILE_LINES),
        "files over {MOST_FILE_LINES} lines before their tests (split them):\n  {}",
        said.join("\n  ")
    );
    assert!(
        long.len() <= MOST_FILES_OVER,
        "{} files over {FILE_LINES} lines before their tests, at most {MOST_FILES_OVER} may be \
         (split one along a seam):\n  {}",
        long.len(),
        said.join("\n  ")
    );
}

/// The lines of `text` before its unit tests (`#[cfg(test)]` at the left margin), or all.
fn lines_before_tests(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .position(|l| *l == "#[cfg(test)]")
        .unwrap_or(lines.len())
}

#[test]
fn the_reader_measures_functions_as_written() {
    let code = "\
/// fn not_this() {}
pub(crate) fn two() {
}

impl A {
    fn three(
        x: u8,
    ) -> u8 {
        x
    }

    fn declared(&self);
}

async fn inner() {
    let f = || {
    };
}
";
    assert_eq!(lines_before_tests("a\nb\n#[cfg(test)]\nmod tests {}\n"), 2);
    assert_eq!(lines_before_tests("a\nb\n"), 2);
    assert_eq!(
        function_lengths(code),
        vec![
            ("two".to_string(), 2, 2),
            ("three".to_string(), 6, 5),
            ("inner".to_string(), 15, 4),
        ]
    );
}

/// Each function's (name, first line counted from 1, lines).
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some((indent, name)) = fn_line(line) else {
            continue;
        };
        // The signature ends at the body's `{`, or at `;` where there is none.
        let Some(open) = (i..lines.len()).find(|&j| {
            let l = lines[j].trim_end();
            l.ends_with('{') || l.ends_with(';')
        }) else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') || lines[open].trim_end().ends_with('}') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open + 1..lines.len()).find(|&j| lines[j] == close) {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

/// A line that starts a function item: its indentation and the function's name.
fn fn_line(line: &str) -> Option<(&str, String)> {
    let code = line.trim_start();
    let indent = &line[..line.len() - code.len()];
    let mut rest = code;
    if let Some(r) = rest.strip_prefix("pub") {
        rest = match r.strip_prefix('(') {
            Some(r) => r.split_once(") ")?.1,
            None => r.strip_prefix(' ')?,
        };
    }
    for word in ["const ", "async ", "unsafe ", "extern \"C\" "] {
        rest = rest.strip_prefix(word).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some((indent, name))
}
