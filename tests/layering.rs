//! The source tree's layering, checked: no two files of `src/` import each other (directly or round a longer
//! circle), and no module imports one that sits above it in the layers below. Rooms with one job stay that way only
//! if something fails the build when a new import goes the wrong way.
//!
//! The test reads the sources, not the compiled crate: every `crate::`, `super::`, `self::` and `dflash::` path
//! (in `use` lines and inline), and the module names a `use` line or a `mod` declaration brings into scope, are
//! resolved to the file that defines the item, following `pub use` re-exports through `mod.rs` files. A re-export
//! of another room's item is an import too (so nothing imports upward or round a circle through one), but a front
//! door's re-export of what sits inside it is not; `mod` declarations are not imports, nor is what a unit test
//! (`#[cfg(test)]`) uses, nor a file's use of the `mod.rs` files it sits in (a folder's front door, which its files
//! implement parts of).
mod source_tree;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use source_tree::{rust_files, src};

/// The top-level modules from the bottom up: a module may import its own layer and the layers under it. Each line
/// says what the layer is for.
const LAYERS: &[&[&str]] = &[
    // What everything shares: the library root, the C++ boundary, devices, panics, joins, profiling.
    &["lib", "ffi", "device", "panic", "bounded_join", "profile"],
    // Tensors on a device: the target families, the drafter, decoding.
    &["model"],
    // Tokens on disk: chat templates, tokenization, prepared shards, the loader.
    &["data"],
    // Hosts finding each other: launch placement, the store's protocol, rendezvous and membership.
    &["cluster"],
    // Optimisation: the objective, AdamW, checkpoints, rounds of gradients across devices and hosts.
    &["train"],
    // The configuration file, which assembles every part's settings.
    &["config"],
    // Logs and metrics.
    &["telemetry"],
    // The long-running service: supervisor, actors, control plane.
    &["service", "proxy"],
    // Speed measurements of the compute core and the service's parts.
    &["bench"],
    // The command line (the binary crate).
    &["cli", "main"],
];

/// One source file: where it is and the module path it defines.
struct SourceFile {
    path: PathBuf,
    module: Vec<String>,
}

/// Lexical tokens, enough to read paths: identifiers, `::` and single punctuation characters.
#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens of Rust source without comments, string and character literals.
fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || (next == Some('#') && raw_string_start(&chars, i + 1))) {
            i = skip_raw_string(&chars, i + 1);
        } else if c == 'b' && next == Some('"') {
            i = skip_string(&chars, i + 1);
        } else if c == '"' {
            i = skip_string(&chars, i);
        } else if c == '\'' {
            i = skip_char_or_lifetime(&chars, i);
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            out.push(Token::Ident(word.trim_start_matches("r#").to_string()));
            continue;
        } else if c == ':' && next == Some(':') {
            out.push(Token::PathSep);
            i += 2;
            continue;
        } else if !c.is_whitespace() {
            out.push(Token::Punct(c));
        }
        i += 1;
    }
    out
}

fn raw_string_start(chars: &[char], mut i: usize) -> bool {
    while chars.get(i) == Some(&'#') {
        i += 1;
    }
    chars.get(i) == Some(&'"')
}

/// Skips `#*"..."#*` starting at the first `#` or `"`; returns the index after it.
fn skip_raw_string(chars: &[char], mut i: usize) -> usize {
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    i += 1;
    while i < chars.len() {
        if chars[i] == '"' && (0..hashes).all(|k| chars.get(i + 1 + k) == Some(&'#')) {
            return i + hashes;
        }
        i += 1;
    }
    i
}

/// Skips `"..."` starting at the quote; returns the index of the closing quote.
fn skip_string(chars: &[char], mut i: usize) -> usize {
    i += 1;
    while i < chars.len() && chars[i] != '"' {
        if chars[i] == '\\' {
            i += 1;
        }
        i += 1;
    }
    i
}

/// Skips a character literal (`'a'`, `'\n'`, `'\u{1F600}'`) or steps over a lifetime's quote.
fn skip_char_or_lifetime(chars: &[char], i: usize) -> usize {
    if chars.get(i + 1) == Some(&'\\') {
        let mut j = i + 2;
        while j < chars.len() && chars[j] != '\'' {
            j += 1;
        }
        return j;
    }
    if chars.get(i + 2) == Some(&'\'') {
        return i + 2;
    }
    i
}

/// A `use` tree flattened: each leaf's path and the name it binds (`None` for a glob).
fn use_leaves(
    tokens: &[Token],
    mut i: usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let mut path = prefix.to_vec();
    loop {
        match tokens.get(i) {
            Some(Token::Ident(word)) if word == "self" && !path.is_empty() && path.len() == prefix.len() => {
                let name = path.last().cloned();
                i += 1;
                let name = alias(tokens, &mut i).or(name);
                out.push((path, name));
                return i;
            }
            Some(Token::Ident(word)) => {
                path.push(word.clone());
                i += 1;
                if tokens.get(i) == Some(&Token::PathSep) {
                    i += 1;
                    continue;
                }
                let name = alias(tokens, &mut i).or_else(|| path.last().cloned());
                out.push((path, name));
                return i;
            }
            Some(Token::Punct('*')) => {
                out.push((path, None));
                return i + 1;
            }
            Some(Token::Punct('{')) => {
                i += 1;
                while tokens.get(i).is_some_and(|t| *t != Token::Punct('}')) {
                    i = use_leaves(tokens, i, &path, out);
                    if tokens.get(i) == Some(&Token::Punct(',')) {
                        i += 1;
                    }
                }
                return i + 1;
            }
            _ => return i,
        }
    }
}

/// Reads `as name` after a use leaf, if present.
fn alias(tokens: &[Token], i: &mut usize) -> Option<String> {
    if tokens.get(*i) == Some(&Token::Ident("as".into()))
        && let Some(Token::Ident(name)) = tokens.get(*i + 1)
    {
        *i += 2;
        return Some(name.clone());
    }
    None
}

/// The crate-relative path a written path names, from the module it is written in; `None` when it starts elsewhere
/// (std, another crate, a local item). `names` maps names in scope to the module paths they stand for.
fn absolute(
    written: &[String],
    here: &[String],
    names: &BTreeMap<String, Vec<String>>,
    binary: bool,
) -> Option<Vec<String>> {
    let (first, rest) = written.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" if binary => vec!["<bin>".into()],
        "crate" => Vec::new(),
        "dflash" => Vec::new(),
        "self" => here.to_vec(),
        "super" => here[..here.len().checked_sub(1)?].to_vec(),
        other => return names.get(other).map(|m| m.iter().cloned().chain(rest.iter().cloned()).collect()),
    };
    let mut rest = rest;
    while rest.first().is_some_and(|s| s == "super") {
        base.pop();
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// What one file writes: the absolute paths it uses and the ones it re-exports (name -> path).
#[derive(Default)]
struct Written {
    uses: Vec<Vec<String>>,
    reexports: BTreeMap<String, Vec<String>>,
}

fn read_file(file: &SourceFile, modules: &BTreeSet<Vec<String>>) -> Written {
    let source = fs::read_to_string(&file.path).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.path.display()));
    let tokens = tokens(&source);
    let binary = file.module.first().is_some_and(|m| m == "<bin>");
    let mut written = Written::default();
    // Inline modules (`mod tests { ... }`): the module path at each brace depth.
    let mut here = file.module.clone();
    let mut inline: Vec<(usize, usize)> = Vec::new(); // (brace depth at open, module path length before)
    // The brace depth of the unit-test module being read, if any: what tests use is not an import.
    let mut in_tests: Option<usize> = None;
    let mut depth = 0usize;
    let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth = depth.saturating_sub(1);
                if in_tests == Some(depth) {
                    in_tests = None;
                }
                if inline.last().is_some_and(|(d, _)| *d == depth) {
                    let (_, len) = inline.pop().expect("checked");
                    here.truncate(len);
                }
            }
            Token::Ident(word) if word == "mod" => {
                if let Some(Token::Ident(name)) = tokens.get(i + 1) {
                    let child: Vec<String> = here.iter().cloned().chain([name.clone()]).collect();
                    if tokens.get(i + 2) == Some(&Token::Punct('{')) {
                        if in_tests.is_none() && for_tests_only(&tokens[..i]) {
                            in_tests = Some(depth);
                        }
                        inline.push((depth, here.len()));
                        here = child;
                        depth += 1;
                        i += 3;
                        continue;
                    }
                    names.insert(name.clone(), child);
                }
            }
            Token::Ident(word) if word == "use" => {
                let public = i > 0 && is_public(&tokens[..i]);
                let mut leaves = Vec::new();
                let end = use_leaves(&tokens, i + 1, &[], &mut leaves);
                for (path, name) in leaves {
                    let Some(target) = absolute(&path, &here, &names, binary) else { continue };
                    if let Some(name) = &name
                        && modules.contains(&target)
                    {
                        names.insert(name.clone(), target.clone());
                    }
                    if in_tests.is_some() || for_tests_only(&tokens[..i]) {
                        continue;
                    }
                    match (public, name) {
                        (true, Some(name)) => {
                            written.reexports.insert(name, target);
                        }
                        _ => written.uses.push(target),
                    }
                }
                i = end;
                continue;
            }
            Token::Ident(word) if tokens.get(i + 1) == Some(&Token::PathSep) && !follows_path_sep(&tokens, i) => {
                let mut path = vec![word.clone()];
                let mut j = i + 1;
                while tokens.get(j) == Some(&Token::PathSep) {
                    match tokens.get(j + 1) {
                        Some(Token::Ident(next)) => {
                            path.push(next.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                if let (Some(target), None) = (absolute(&path, &here, &names, binary), in_tests) {
                    written.uses.push(target);
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    written
}

/// Whether the item starting after `before` carries `#[cfg(test)]` (the attribute right before it, or before a
/// `pub` that is).
fn for_tests_only(before: &[Token]) -> bool {
    let before = match before {
        [rest @ .., Token::Ident(p)] if p == "pub" => rest,
        _ => before,
    };
    let attribute = [
        Token::Punct('#'),
        Token::Punct('['),
        Token::Ident("cfg".into()),
        Token::Punct('('),
        Token::Ident("test".into()),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    before.ends_with(&attribute)
}

fn follows_path_sep(tokens: &[Token], i: usize) -> bool {
    i > 0 && tokens[i - 1] == Token::PathSep
}

/// Whether the tokens before a `use` make it `pub` or `pub(...)`.
fn is_public(before: &[Token]) -> bool {
    match before {
        [.., Token::Ident(p)] => p == "pub",
        [.., Token::Ident(p), Token::Punct('('), _, Token::Punct(')')] => p == "pub",
        _ => false,
    }
}

/// Every `.rs` file of `src/`, with its module path; the binary's files under `<bin>`.
fn source_files(src: &Path) -> Vec<SourceFile> {
    let module_of = |path: &Path| {
        let relative = path.strip_prefix(src).expect("under src");
        let mut module: Vec<String> = relative.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        let last = module.pop().expect("a file name");
        let stem = last.trim_end_matches(".rs").to_string();
        if stem != "mod" && stem != "lib" && stem != "main" {
            module.push(stem.clone());
        }
        if stem == "main" || module.first().is_some_and(|m| m == "cli") {
            module.insert(0, "<bin>".into());
        }
        module
    };
    rust_files(src).into_iter().map(|path| SourceFile { module: module_of(&path), path }).collect()
}

impl SourceFile {
    /// Whether `other` sits inside this file's module (this is a `mod.rs` or the library root above it).
    fn encloses(&self, other: &SourceFile) -> bool {
        let root = self.module.is_empty() && other.module.first().is_none_or(|m| m != "<bin>");
        root || (other.module.len() > self.module.len() && other.module.starts_with(&self.module))
    }
}

/// The import graph between files (by index into `files`), with one example path per edge.
struct Graph {
    root: PathBuf,
    files: Vec<SourceFile>,
    edges: BTreeMap<usize, BTreeMap<usize, String>>,
}

impl Graph {
    fn of(src: &Path) -> Graph {
        let files = source_files(src);
        let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
        let by_module: BTreeMap<Vec<String>, usize> =
            files.iter().enumerate().map(|(i, f)| (f.module.clone(), i)).collect();
        let written: Vec<Written> = files.iter().map(|f| read_file(f, &modules)).collect();
        let mut edges: BTreeMap<usize, BTreeMap<usize, String>> = BTreeMap::new();
        for (from, w) in written.iter().enumerate() {
            for path in &w.uses {
                let Some(to) = resolve(path, &by_module, &written, 0) else { continue };
                if to != from && !files[to].encloses(&files[from]) {
                    edges.entry(from).or_default().entry(to).or_insert_with(|| path.join("::"));
                }
            }
            // A re-export of another room's item depends on that room as a use does: a module cannot import upward
            // (or round a circle) through one. A front door re-exporting what sits inside it is its own room.
            for path in w.reexports.values() {
                let Some(to) = resolve(path, &by_module, &written, 0) else { continue };
                if to != from && !files[to].encloses(&files[from]) && !files[from].encloses(&files[to]) {
                    edges.entry(from).or_default().entry(to).or_insert_with(|| format!("pub use {}", path.join("::")));
                }
            }
        }
        Graph { root: src.to_path_buf(), files, edges }
    }

    /// A file's path under the tree's root.
    fn name(&self, i: usize) -> String {
        self.files[i].path.strip_prefix(&self.root).unwrap_or(&self.files[i].path).display().to_string()
    }

    /// The top-level module a file belongs to.
    fn top(&self, i: usize) -> &str {
        let module = &self.files[i].module;
        match module.first().map(String::as_str) {
            None => "lib",
            Some("<bin>") => module.get(1).map_or("main", String::as_str),
            Some(top) => top,
        }
    }

    /// Each circle: a strongly connected set of two or more files.
    fn circles(&self) -> Vec<Vec<usize>> {
        strongly_connected(self.files.len(), &self.edges).into_iter().filter(|c| c.len() > 1).collect()
    }

    /// Each import from a lower layer to a higher one: "file -> file (path)".
    fn upward(&self) -> Vec<String> {
        let layer = |top: &str| LAYERS.iter().position(|l| l.contains(&top));
        let mut out = Vec::new();
        for (&from, tos) in &self.edges {
            for (&to, path) in tos {
                let (a, b) = (self.top(from), self.top(to));
                match (layer(a), layer(b)) {
                    (Some(la), Some(lb)) if lb > la => {
                        out.push(format!("{} -> {} ({path})", self.name(from), self.name(to)))
                    }
                    (None, _) => out.push(format!("{}: module `{a}` is in no layer", self.name(from))),
                    _ => {}
                }
            }
        }
        out
    }
}

/// The file that defines what `path` names: the deepest module file on it, following a `pub use` there.
fn resolve(
    path: &[String],
    by_module: &BTreeMap<Vec<String>, usize>,
    written: &[Written],
    hops: usize,
) -> Option<usize> {
    let mut at = None;
    let mut len = 0;
    for n in 0..=path.len() {
        if let Some(&i) = by_module.get(&path[..n]) {
            at = Some(i);
            len = n;
        }
    }
    let at = at?;
    if let (Some(item), true) = (path.get(len), hops < 8)
        && let Some(target) = written[at].reexports.get(item)
    {
        let target: Vec<String> = target.iter().cloned().chain(path[len + 1..].iter().cloned()).collect();
        return resolve(&target, by_module, written, hops + 1).or(Some(at));
    }
    Some(at)
}

/// Tarjan's strongly connected components.
fn strongly_connected(n: usize, edges: &BTreeMap<usize, BTreeMap<usize, String>>) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a BTreeMap<usize, BTreeMap<usize, String>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        let tos: Vec<usize> = s.edges.get(&v).map(|t| t.keys().copied().collect()).unwrap_or_default();
        for w in tos {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            component.reverse();
            s.out.push(component);
        }
    }
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_two_source_files_import_each_other() {
    let graph = Graph::of(&src());
    let circles = graph.circles();
    let mut report = String::new();
    for circle in &circles {
        report
            .push_str(&format!("\n  circle: {}", circle.iter().map(|&f| graph.name(f)).collect::<Vec<_>>().join(", ")));
        for &from in circle {
            for (to, path) in graph.edges.get(&from).into_iter().flatten() {
                if circle.contains(to) {
                    report.push_str(&format!("\n    {} uses {path} ({})", graph.name(from), graph.name(*to)));
                }
            }
        }
    }
    assert!(circles.is_empty(), "files of src/ that import each other, directly or round a circle:{report}");
}

#[test]
fn no_module_imports_a_layer_above_it() {
    let upward = Graph::of(&src()).upward();
    assert!(upward.is_empty(), "imports from a lower layer to a higher one (see LAYERS):\n  {}", upward.join("\n  "));
}

/// A tree of source files written for a test of the reader itself.
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary folder");
    for (path, text) in files {
        let path = dir.path().join(path);
        fs::create_dir_all(path.parent().expect("a parent")).expect("a folder");
        fs::write(path, text).expect("a file");
    }
    dir
}

fn circle_names(dir: &Path) -> Vec<Vec<String>> {
    let graph = Graph::of(dir);
    let mut circles: Vec<Vec<String>> =
        graph.circles().into_iter().map(|c| c.into_iter().map(|f| graph.name(f)).collect()).collect();
    for c in &mut circles {
        c.sort();
    }
    circles
}

#[test]
fn the_reader_finds_a_circle_through_uses_reexports_and_inline_paths() {
    let dir = tree(&[
        ("lib.rs", "pub mod model;\npub mod data;\n"),
        ("model/mod.rs", "mod a;\nmod b;\npub use a::Alpha;\n"),
        // `crate::model::Alpha` goes through model/mod.rs's re-export to a.rs.
        ("model/a.rs", "use super::b::beta;\npub struct Alpha;\n"),
        ("model/b.rs", "pub fn beta() -> crate::model::Alpha { crate::model::Alpha }\n"),
        // Strings and comments name paths that are not imports.
        ("data/mod.rs", "// crate::model::a\nconst S: &str = \"crate::model::b\";\n"),
    ]);
    let circles = circle_names(dir.path());
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert!(circles[0][0].ends_with("model/a.rs") && circles[0][1].ends_with("model/b.rs"), "{circles:?}");
}

#[test]
fn the_reader_lets_unit_tests_and_children_use_what_they_need() {
    let dir = tree(&[
        ("lib.rs", "pub mod model;\n"),
        // A parent using its child and the child using the parent's items is one room.
        ("model/mod.rs", "mod a;\npub struct Shared;\nfn f() { a::g() }\n"),
        ("model/a.rs", "use super::Shared;\npub fn g() {}\nfn h(_: Shared) {}\n"),
        ("model/b.rs", "pub fn b() {}\n#[cfg(test)]\nmod tests {\n    use crate::model::c::c;\n}\n"),
        ("model/c.rs", "use super::b::b;\npub fn c() { b() }\n"),
    ]);
    assert!(circle_names(dir.path()).is_empty());
}

/// A re-export is an import of what it re-exports: a file re-exporting its importer's items closes a circle, and a
/// lower layer re-exporting a higher one's item imports upward; a front door re-exporting its own files does neither.
#[test]
fn the_reader_counts_a_reexport_as_an_import() {
    let dir = tree(&[
        (
            "lib.rs",
            "pub mod ffi;
pub mod device;
pub mod model;
pub mod service;
",
        ),
        (
            "ffi/mod.rs",
            "pub mod accel;
",
        ),
        (
            "ffi/accel.rs",
            "use crate::device::DeviceError;
pub fn bind() -> Result<(), DeviceError> { Ok(()) }
",
        ),
        (
            "device.rs",
            "pub use crate::ffi::accel::bind;
pub struct DeviceError;
",
        ),
        (
            "model/mod.rs",
            "mod a;
pub use a::A;
pub use crate::service::Actor;
",
        ),
        (
            "model/a.rs",
            "pub struct A;
",
        ),
        (
            "service/mod.rs",
            "pub struct Actor;
",
        ),
    ]);
    let circles = circle_names(dir.path());
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert!(circles[0][0].ends_with("device.rs") && circles[0][1].ends_with("ffi/accel.rs"), "{circles:?}");
    let upward = Graph::of(dir.path()).upward();
    assert_eq!(upward.len(), 1, "{upward:?}");
    assert!(upward[0].contains("model/mod.rs -> ") && upward[0].contains("pub use service::Actor"), "{upward:?}");
}

#[test]
fn the_reader_reports_an_import_from_a_lower_layer() {
    let dir = tree(&[
        ("lib.rs", "pub mod model;\npub mod service;\n"),
        ("model/mod.rs", "use crate::service::Actor;\n"),
        ("service/mod.rs", "use crate::model;\npub struct Actor;\nfn f() { model::g() }\n"),
    ]);
    let upward = Graph::of(dir.path()).upward();
    assert_eq!(upward.len(), 1, "{upward:?}");
    assert!(upward[0].contains("model/mod.rs -> ") && upward[0].contains("service::Actor"), "{upward:?}");
}
