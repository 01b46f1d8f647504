//! The code map's shape, checked (docs/architecture.md): no file of `src/` reaches itself through
//! its imports (no two files import each other, nor any longer circle), and each stage of the
//! library imports only the stages before it (`model` < `program` < `formats` < `data` <
//! `cluster` < `device` < `train` < `compile` < `plan` < `cli`).
//!
//! A file imports another when it names a path into it: a `use` (`crate::`, `super::`, `self::`,
//! `xtrain::`, or a child module of its own), or such a path written inline in code. A name a
//! folder's `mod.rs` re-exports from one of its files counts as that file's; a `mod.rs`
//! declaring and re-exporting its own files does not import them. Comments and strings are not
//! read.

mod common;
use common::collect_rs;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library's stages, in the order each may use the ones before it.
const STAGES: [&str; 10] = [
    "model", "program", "formats", "data", "cluster", "device", "train", "compile", "plan", "cli",
];

#[test]
fn no_two_files_import_each_other() {
    let tree = SourceTree::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let edges = tree.imports();
    let mut pairs = Vec::new();
    for (from, tos) in &edges {
        for to in tos {
            if from < to && edges.get(to).is_some_and(|back| back.contains(from)) {
                pairs.push(format!("{} <-> {}", from.display(), to.display()));
            }
        }
    }
    assert!(
        pairs.is_empty(),
        "files that import each other (move what both need into one of them, or into a third):\n  {}",
        pairs.join("\n  ")
    );
}

/// No circle of imports of any length (`a -> b -> c -> a`): the pairs above are its shortest
/// case. Each circle found is named file by file. `test_support.rs` is left out: it is built
/// only for the unit tests, which may use it from any stage (and it uses the stages above).
#[test]
fn no_import_cycles() {
    let tree = SourceTree::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let test_only = Path::new("test_support.rs");
    let mut edges = tree.imports();
    edges.remove(test_only);
    for tos in edges.values_mut() {
        tos.remove(test_only);
    }
    let cycles = import_cycles(&edges);
    let named: Vec<String> = cycles
        .iter()
        .map(|c| {
            let files: Vec<String> = c.iter().map(|f| f.display().to_string()).collect();
            format!("{} -> {}", files.join(" -> "), files[0])
        })
        .collect();
    assert!(
        named.is_empty(),
        "import cycles (move what the circle shares into a file none of them is imported by):\n  {}",
        named.join("\n  ")
    );
}

/// The cycle finder sees circles of every length, and nothing in a graph without one.
#[test]
fn the_cycle_finder_finds_circles_of_any_length() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(PathBuf::from(a))
                .or_default()
                .insert(PathBuf::from(b));
        }
        g
    };
    let names = |cycles: Vec<Vec<PathBuf>>| -> Vec<Vec<String>> {
        cycles
            .into_iter()
            .map(|c| c.iter().map(|p| p.display().to_string()).collect())
            .collect()
    };
    let three = graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
    assert_eq!(names(import_cycles(&three)), [["a", "b", "c"]]);
    let four = graph(&[("w", "x"), ("x", "y"), ("y", "z"), ("z", "w"), ("p", "q")]);
    assert_eq!(names(import_cycles(&four)), [["w", "x", "y", "z"]]);
    let pair = graph(&[("a", "b"), ("b", "a")]);
    assert_eq!(names(import_cycles(&pair)), [["a", "b"]]);
    let tree = graph(&[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]);
    assert!(import_cycles(&tree).is_empty());
}

/// One circle per strongly connected group of files that import each other round (Tarjan's
/// algorithm finds the groups; a shortest circle through the group's first file is named).
fn import_cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    let mut nodes: Vec<&PathBuf> = edges.keys().chain(edges.values().flatten()).collect();
    nodes.sort();
    nodes.dedup();
    let index_of: BTreeMap<&PathBuf, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let next: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            edges
                .get(*n)
                .map_or(Vec::new(), |t| t.iter().map(|t| index_of[t]).collect())
        })
        .collect();
    let mut out = Vec::new();
    for group in strongly_connected(&next) {
        // A file naming its own items is no circle.
        if group.len() < 2 {
            continue;
        }
        let start = *group.iter().min().unwrap();
        let members: BTreeSet<usize> = group.iter().copied().collect();
        // Breadth first from `start` within the group, back to `start`: a shortest circle.
        let mut from: BTreeMap<usize, usize> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        'search: while let Some(n) = queue.pop_front() {
            for &m in &next[n] {
                if m == start {
                    let mut circle = vec![n];
                    while let Some(&p) = from.get(circle.last().unwrap()) {
                        circle.push(p);
                    }
                    circle.reverse();
                    if circle[0] != start {
                        circle.insert(0, start);
                    }
                    out.push(circle.iter().map(|i| nodes[*i].clone()).collect());
                    break 'search;
                }
                if members.contains(&m) && m != start && !from.contains_key(&m) {
                    from.insert(m, n);
                    queue.push_back(m);
                }
            }
        }
    }
    out
}

/// The strongly connected components of a graph (`next[n]`: the nodes `n` points to), by
/// Tarjan's algorithm, written without recursion.
fn strongly_connected(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = next.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on_stack, mut stack, mut groups) = (vec![false; n], Vec::new(), Vec::new());
    let mut counter = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        // (node, how many of its edges are done)
        let mut work = vec![(root, 0)];
        while let Some(&mut (v, ref mut done)) = work.last_mut() {
            if *done == 0 && index[v] == usize::MAX {
                index[v] = counter;
                low[v] = counter;
                counter += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = next[v].get(*done) {
                *done += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut group = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    group.push(w);
                    if w == v {
                        break;
                    }
                }
                group.sort_unstable();
                groups.push(group);
            }
        }
    }
    groups
}

#[test]
fn each_stage_imports_only_the_stages_before_it() {
    let tree = SourceTree::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut wrong = Vec::new();
    for (from, tos) in tree.imports() {
        let Some(here) = stage(&from) else { continue };
        for to in tos {
            if stage(&to).is_some_and(|there| there > here) {
                wrong.push(format!("{} imports {}", from.display(), to.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the stage order {}:\n  {}",
        STAGES.join(" < "),
        wrong.join("\n  ")
    );
}

/// Only `device/` opens plugins (docs/architecture.md): no other file of `src/` loads, finds,
/// installs or opens one, or makes compile options for one (`test_support.rs`, the unit tests'
/// own CPU client, is test-only). `compile` and the command line reach plugins through
/// `device` (`Runtime`, `TargetDevices`, `device::plugins`).
#[test]
fn only_device_opens_plugins() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let opens = [
        "Plugin::load",
        "pjrt::CompileOptions",
        "pjrt::ClientOptions",
        "discover::install",
        "discover::find_all",
        "discover::resolve",
    ];
    let mut wrong = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(&src).unwrap().to_path_buf();
            if path.is_dir() {
                if rel != Path::new("device") {
                    stack.push(path);
                }
                continue;
            }
            if rel == Path::new("test_support.rs") || path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for name in opens.iter().filter(|n| text.contains(*n)) {
                wrong.push(format!("{} names {name}", rel.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "plugins opened outside device/:\n  {}",
        wrong.join("\n  ")
    );
}

/// The reader finds imports of each kind in the tree itself (so that the tests above cannot pass
/// by finding none): a `use` through a folder's re-export, a path written inline in code, and a
/// path from the binary into the library.
#[test]
fn the_import_reader_finds_the_trees_imports() {
    let tree = SourceTree::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let edges = tree.imports();
    for (from, to) in [
        ("train/mod.rs", "device/trainer.rs"),
        ("data/source.rs", "data/read.rs"),
        ("cli/compile.rs", "program/spec/attention.rs"),
        ("cli/mod.rs", "device/platform.rs"),
        ("program/builder.rs", "program/layout.rs"),
    ] {
        assert!(
            edges[Path::new(from)].contains(Path::new(to)),
            "{from} -> {to} not found; {from} imports {:?}",
            edges[Path::new(from)]
        );
    }
}

#[test]
fn the_import_reader_sees_paths_the_way_rust_does() {
    let code = strip(
        r#"let s = "crate::a::b"; // crate::c::d
        let c = '{'; fn f<'a>(x: &'a str) { crate::e::f(x) } /* crate::g */ r"crate::h""#,
    );
    assert!(!code.contains("crate::a") && !code.contains("crate::c"));
    assert!(!code.contains("crate::g") && !code.contains("crate::h"));
    assert!(code.contains("crate::e::f"));
    assert_eq!(code.matches('{').count(), code.matches('}').count());
    let uses = use_statements("pub use crate::a::{self, b::{C, D as E}, f::*};");
    assert!(uses[0].public);
    let paths: Vec<String> = uses[0].paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "crate::a",
            "crate::a::b::C",
            "crate::a::b::D",
            "crate::a::f"
        ]
    );
}

/// Which stage a file (relative to `src/`) belongs to, by its folder.
fn stage(file: &Path) -> Option<usize> {
    let first = file.components().next()?.as_os_str().to_str()?;
    STAGES.iter().position(|s| *s == first)
}

/// The two crates of this package: the library (`src/lib.rs`) and the binary (`src/main.rs`,
/// which holds `src/cli`, and reaches the library as `xtrain::`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Crate {
    Lib,
    Bin,
}

struct SourceFile {
    krate: Crate,
    /// The module path the file is, within its crate (`["device", "runtime"]`).
    module: Vec<String>,
    /// The file's text with comments, strings and character literals blanked out.
    code: String,
}

/// A module, by its crate and its path from the crate's root.
type ModulePath = (Crate, Vec<String>);

/// Where each re-exported name is reached -> where it comes from.
type Reexports = BTreeMap<ModulePath, ModulePath>;

struct SourceTree {
    files: BTreeMap<PathBuf, SourceFile>,
    /// The file of each module that has one.
    modules: BTreeMap<ModulePath, PathBuf>,
}

impl SourceTree {
    fn read(src: &Path) -> SourceTree {
        let mut paths = Vec::new();
        collect_rs(src, &mut paths);
        let mut files = BTreeMap::new();
        let mut modules = BTreeMap::new();
        for path in paths {
            let rel = path.strip_prefix(src).unwrap().to_path_buf();
            let mut module: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_str().unwrap().to_string())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            let krate = if rel == Path::new("main.rs") || rel.starts_with("cli") {
                Crate::Bin
            } else {
                Crate::Lib
            };
            let text = std::fs::read_to_string(&path).unwrap();
            modules.insert((krate, module.clone()), rel.clone());
            files.insert(
                rel,
                SourceFile {
                    krate,
                    module,
                    code: strip(&text),
                },
            );
        }
        SourceTree { files, modules }
    }

    /// Every file's imports: the other files it names paths into.
    fn imports(&self) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
        let reexports = self.reexports();
        let mut edges = BTreeMap::new();
        for (rel, file) in &self.files {
            let mut to = BTreeSet::new();
            for (module, path, public) in self.paths_in(file) {
                // A folder's mod.rs declaring and re-exporting its own files is its shape, not an
                // import.
                if public && self.is_child(file, &module, &path) {
                    continue;
                }
                if let Some((krate, abs)) = self.absolute(&module, &path, file) {
                    if let Some(target) = self.resolve(krate, &abs, &reexports, 0) {
                        if target != *rel {
                            to.insert(target);
                        }
                    }
                }
            }
            edges.insert(rel.clone(), to);
        }
        edges
    }

    /// The paths a file names: (the module it is named in, the path, whether it is a `pub use`).
    fn paths_in(&self, file: &SourceFile) -> Vec<(Vec<String>, Vec<String>, bool)> {
        let mut out = Vec::new();
        let mut code = file.code.clone();
        let modules = inline_modules(&code, &file.module);
        let module_at = |pos: usize| -> Vec<String> {
            modules
                .iter()
                .rev()
                .find(|(range, _)| range.contains(&pos))
                .map(|(_, m)| m.clone())
                .unwrap_or_else(|| file.module.clone())
        };
        for u in use_statements(&code) {
            let module = module_at(u.range.start);
            for p in u.paths {
                out.push((module.clone(), p, u.public));
            }
            code.replace_range(u.range.clone(), &" ".repeat(u.range.len()));
        }
        let children = self.child_modules(file);
        for (pos, path) in inline_paths(&code) {
            let first = path[0].as_str();
            if matches!(first, "crate" | "super" | "self" | "xtrain") || children.contains(first) {
                out.push((module_at(pos), path, false));
            }
        }
        out
    }

    /// The modules declared in files of their own below this file's module.
    fn child_modules(&self, file: &SourceFile) -> BTreeSet<String> {
        self.modules
            .keys()
            .filter(|(k, m)| {
                *k == file.krate && m.len() == file.module.len() + 1 && m.starts_with(&file.module)
            })
            .map(|(_, m)| m.last().unwrap().clone())
            .collect()
    }

    /// Whether `path`, named at the top of `file` (not in an inline module), is into one of the
    /// file's own child modules (`examples::X` or `self::examples::X` in `data/mod.rs`).
    fn is_child(&self, file: &SourceFile, module: &[String], path: &[String]) -> bool {
        let children = self.child_modules(file);
        let first = match path {
            [s, next, ..] if s == "self" => next,
            [first, ..] => first,
            [] => return false,
        };
        module == file.module.as_slice() && children.contains(first)
    }

    /// The path as (crate, segments from that crate's root), named in `module` of `file`.
    fn absolute(
        &self,
        module: &[String],
        path: &[String],
        file: &SourceFile,
    ) -> Option<ModulePath> {
        let krate = file.krate;
        let mut base = module.to_vec();
        let mut rest = path;
        match path[0].as_str() {
            "crate" => return Some((krate, path[1..].to_vec())),
            "xtrain" => return Some((Crate::Lib, path[1..].to_vec())),
            "self" => rest = &path[1..],
            "super" => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
            }
            first => {
                if !self.child_modules(file).contains(first) {
                    return None;
                }
            }
        }
        base.extend(rest.iter().cloned());
        Some((krate, base))
    }

    /// The file a path lands in: the deepest module file it names, or, for a name a module
    /// re-exports, the file the name comes from.
    fn resolve(
        &self,
        krate: Crate,
        path: &[String],
        reexports: &Reexports,
        depth: usize,
    ) -> Option<PathBuf> {
        let mut n = 0;
        while n < path.len() && self.modules.contains_key(&(krate, path[..=n].to_vec())) {
            n += 1;
        }
        if depth < 8 && n < path.len() {
            if let Some((k, target)) = reexports.get(&(krate, path[..=n].to_vec())) {
                let mut full = target.clone();
                full.extend(path[n + 1..].iter().cloned());
                return self.resolve(*k, &full, reexports, depth + 1);
            }
        }
        self.modules.get(&(krate, path[..n].to_vec())).cloned()
    }

    /// The names each module re-exports (`pub use a::b::Name` or `pub use a::b::Name as Alias`),
    /// keyed by the path they are reached at and giving the path they come from.
    fn reexports(&self) -> Reexports {
        let mut out = BTreeMap::new();
        for file in self.files.values() {
            for u in use_statements(&file.code) {
                if !u.public {
                    continue;
                }
                for path in u.paths {
                    if let Some((k, abs)) = self.absolute(&file.module, &path, file) {
                        let mut at = file.module.clone();
                        at.push(path.last().unwrap().clone());
                        out.insert((file.krate, at), (k, abs));
                    }
                }
            }
        }
        out
    }
}

/// The text with comments, string literals and character literals replaced by spaces (newlines
/// kept), so that what remains is code and its braces balance.
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, s: &[char]| {
        for ch in s {
            out.push(if *ch == '\n' { '\n' } else { ' ' });
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            let end = c[i..]
                .iter()
                .position(|&ch| ch == '\n')
                .map_or(c.len(), |n| i + n);
            blank(&mut out, &c[i..end]);
            i = end;
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let (mut depth, mut j) = (0, i);
            while j < c.len() {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &c[i..j]);
            i = j;
        } else if !prev_ident && (c[i] == 'r' || (c[i] == 'b' && c.get(i + 1) == Some(&'r'))) && {
            let s = if c[i] == 'b' { i + 2 } else { i + 1 };
            let hashes = c[s..].iter().take_while(|&&ch| ch == '#').count();
            c.get(s + hashes) == Some(&'"')
        } {
            let s = if c[i] == 'b' { i + 2 } else { i + 1 };
            let hashes = c[s..].iter().take_while(|&&ch| ch == '#').count();
            let mut j = s + hashes + 1;
            while j < c.len() {
                if c[j] == '"'
                    && c[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&ch| ch == '#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            blank(&mut out, &c[i..j.min(c.len())]);
            i = j.min(c.len());
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(c.len());
            blank(&mut out, &c[i..end]);
            i = end;
        } else if c[i] == '\'' && c.get(i + 1) == Some(&'\\') {
            let mut j = i + 2;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            let end = (j + 1).min(c.len());
            blank(&mut out, &c[i..end]);
            i = end;
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            blank(&mut out, &c[i..i + 3]);
            i += 3;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The inline modules (`mod tests { ... }`) of a file's code: each one's byte range and module
/// path.
fn inline_modules(code: &str, module: &[String]) -> Vec<(std::ops::Range<usize>, Vec<String>)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    // Open inline modules: (brace depth inside them, start, path).
    let mut open: Vec<(usize, usize, Vec<String>)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if open.last().is_some_and(|(d, _, _)| *d == depth + 1) {
                    let (_, start, path) = open.pop().unwrap();
                    out.push((start..i, path));
                }
            }
            b'm' if code[i..].starts_with("mod ") && (i == 0 || !is_ident_byte(bytes[i - 1])) => {
                let rest = &code[i + 4..];
                let name: String = rest
                    .trim_start()
                    .chars()
                    .take_while(|c| is_ident_char(*c))
                    .collect();
                let after = rest.trim_start()[name.len()..].trim_start();
                if after.starts_with('{') {
                    let mut path = open
                        .last()
                        .map_or_else(|| module.to_vec(), |(_, _, p)| p.clone());
                    path.push(name);
                    let brace = i + 4 + (rest.len() - after.len());
                    open.push((depth + 1, i, path));
                    depth += 1;
                    i = brace + 1;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// A `use` statement.
struct UseStatement {
    /// Where it is in the code, `use` to `;`.
    range: std::ops::Range<usize>,
    /// The paths it names (a group's `self` names the group's own path; a glob and an alias
    /// name the path before them).
    paths: Vec<Vec<String>>,
    /// `pub use` (or `pub(...) use`): a re-export.
    public: bool,
}

/// The `use` statements of some code.
fn use_statements(code: &str) -> Vec<UseStatement> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(n) = code[i..].find("use ") {
        let at = i + n;
        i = at + 4;
        if at > 0 && (is_ident_byte(bytes[at - 1]) || bytes[at - 1] == b'$') {
            continue;
        }
        let Some(end) = code[at..].find(';').map(|e| at + e) else {
            break;
        };
        let before = code[..at].trim_end();
        let public = before.ends_with("pub")
            || (before.ends_with(')') && {
                let open = before.rfind('(').unwrap_or(0);
                before[..open].trim_end().ends_with("pub")
            });
        let tokens = tokenize(&code[at + 4..end]);
        let mut paths = Vec::new();
        use_tree(&tokens, &mut 0, &mut Vec::new(), &mut paths);
        out.push(UseStatement {
            range: at..end + 1,
            paths,
            public,
        });
        i = end + 1;
    }
    out
}

fn tokenize(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let c: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < c.len() {
        if is_ident_char(c[i]) {
            let start = i;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else if "{},*".contains(c[i]) {
            out.push(c[i].to_string());
            i += 1;
        } else {
            i += 1;
        }
    }
    out
}

/// One use tree from `tokens[*at..]`, below `prefix`, into `out`.
fn use_tree(
    tokens: &[String],
    at: &mut usize,
    prefix: &mut Vec<String>,
    out: &mut Vec<Vec<String>>,
) {
    let depth = prefix.len();
    loop {
        let token = tokens.get(*at).map(String::as_str);
        let next = tokens.get(*at + 1).map(String::as_str);
        match token {
            Some("{") => {
                *at += 1;
                loop {
                    match tokens.get(*at).map(String::as_str) {
                        Some("}") | None => {
                            *at += 1;
                            break;
                        }
                        Some(",") => *at += 1,
                        _ => use_tree(tokens, at, prefix, out),
                    }
                }
                break;
            }
            Some("*") => {
                *at += 1;
                out.push(prefix.clone());
                break;
            }
            // A group's `self`: the group's own path.
            Some("self") if next != Some("::") => {
                *at += if next == Some("as") { 3 } else { 1 };
                out.push(prefix.clone());
                break;
            }
            Some("::") => *at += 1,
            Some(t) if t != "," && t != "}" => {
                prefix.push(t.to_string());
                *at += 1;
                match next {
                    Some("::") => {}
                    Some("as") => {
                        *at += 2;
                        out.push(prefix.clone());
                        break;
                    }
                    _ => {
                        out.push(prefix.clone());
                        break;
                    }
                }
            }
            _ => break,
        }
    }
    prefix.truncate(depth);
}

/// The paths written in code (`a::b::c`, starting where no `::` comes before): each one's byte
/// position and segments.
fn inline_paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if is_ident_byte(bytes[i]) && (i == 0 || !is_ident_byte(bytes[i - 1])) {
            let preceded = code[..i].trim_end().ends_with("::") || (i > 0 && bytes[i - 1] == b'$');
            let start = i;
            let mut segs = Vec::new();
            let mut j = i;
            loop {
                let s = j;
                while j < bytes.len() && is_ident_byte(bytes[j]) {
                    j += 1;
                }
                segs.push(code[s..j].to_string());
                let rest = &code[j..];
                let trimmed = rest.trim_start();
                if let Some(after) = trimmed.strip_prefix("::") {
                    let after = after.trim_start();
                    if after.as_bytes().first().is_some_and(|b| is_ident_byte(*b)) {
                        j = code.len() - after.len();
                        continue;
                    }
                }
                break;
            }
            if !preceded && segs.len() > 1 {
                out.push((start, segs));
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}
