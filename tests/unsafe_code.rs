//! The rules for `unsafe` in `src/`, checked: C functions of the shim (`csrc/`) are declared only at the C++
//! boundary (`src/ffi/`), and every `unsafe` block, impl and function says why it is sound: a `// SAFETY:` comment
//! on the lines just before it, on its line or first inside its block; an `unsafe fn` a `# Safety` section in its
//! doc comment.
mod source_tree;

use std::fs;

use source_tree::{rust_files, src};

/// Lines above an `unsafe` a SAFETY comment may sit on (a statement split over a few lines).
const LINES_ABOVE: usize = 3;

/// The code of a line: what comes before a `//` comment, without string literals (good enough for this source).
fn code(line: &str) -> String {
    let mut out = String::new();
    let mut in_string = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if in_string => {
                chars.next();
            }
            '"' => in_string = !in_string,
            '/' if !in_string && chars.peek() == Some(&'/') => break,
            _ if !in_string => out.push(c),
            _ => {}
        }
    }
    out
}

fn has_word(code: &str, word: &str) -> bool {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == word)
}

/// Whether the comment block just above line `i` (past at most [`LINES_ABOVE`] lines of the same statement) or the
/// line itself or the next one (the first line inside a block) holds a `SAFETY:` comment.
fn has_safety_comment(lines: &[&str], i: usize) -> bool {
    if lines[i].contains("SAFETY:") || lines.get(i + 1).is_some_and(|l| l.contains("SAFETY:")) {
        return true;
    }
    let mut code_lines = 0;
    let mut in_comment = false;
    for line in lines[..i].iter().rev() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            if line.contains("SAFETY:") {
                return true;
            }
            in_comment = true;
        } else if in_comment || trimmed.is_empty() || code_lines == LINES_ABOVE {
            return false;
        } else {
            code_lines += 1;
        }
    }
    false
}

/// Whether the doc comment above line `i` (an `unsafe fn`) has a `# Safety` section.
fn has_safety_section(lines: &[&str], i: usize) -> bool {
    lines[..i]
        .iter()
        .rev()
        .take_while(|l| l.trim_start().starts_with("///") || l.trim_start().starts_with("#["))
        .any(|l| l.contains("# Safety"))
}

/// Each `unsafe` of `text` that does not say why it is sound, as `line: code`. Declarations of foreign functions
/// and their pointer types (`unsafe extern "C"`) are not unsafe code.
fn unexplained(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = code(line);
        if !has_word(&code, "unsafe") || line.contains("unsafe extern \"C\"") {
            continue;
        }
        let explained = match has_word(&code, "fn") && !code.contains('|') {
            true => has_safety_section(&lines, i),
            false => has_safety_comment(&lines, i),
        };
        if !explained {
            out.push(format!("{}: {}", i + 1, line.trim()));
        }
    }
    out
}

/// Each declaration of a C function block outside `src/ffi/`, as `line: code`.
fn foreign_blocks(text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let line = line.trim_start();
            line.starts_with("unsafe extern \"C\" {") || line.starts_with("extern \"C\" {")
        })
        .map(|(i, line)| format!("{}: {}", i + 1, line.trim()))
        .collect()
}

#[test]
fn every_unsafe_says_why_it_is_sound() {
    let files = rust_files(&src());
    let mut report = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).expect("a readable source file");
        for problem in unexplained(&text) {
            report.push(format!("{}:{problem}", file.display()));
        }
    }
    assert!(
        report.is_empty(),
        "unsafe without a SAFETY comment (or an unsafe fn without # Safety):\n  {}",
        report.join("\n  ")
    );
}

#[test]
fn only_the_cpp_boundary_declares_c_functions() {
    let files = rust_files(&src());
    let boundary = src().join("ffi");
    let mut report = Vec::new();
    for file in files.iter().filter(|f| !f.starts_with(&boundary)) {
        let text = fs::read_to_string(file).expect("a readable source file");
        for block in foreign_blocks(&text) {
            report.push(format!("{}:{block}", file.display()));
        }
    }
    assert!(report.is_empty(), "C functions declared outside src/ffi/:\n  {}", report.join("\n  "));
}

#[test]
fn the_check_tells_an_explained_unsafe_from_a_bare_one() {
    let explained = "// SAFETY: plain C call.\nlet x = unsafe { f() };\nlet y = g(|e| unsafe {\n    // SAFETY: valid.\n    h(e)\n});\n\
        // SAFETY: a comment of two lines,\n// the reason on the second.\nlet z = g(\n    |e| unsafe { h(e) },\n);\n\
        /// Does it.\n///\n/// # Safety\n/// The caller keeps `p` alive.\npub unsafe fn k(p: *const u8) {}\n\
        type F = unsafe extern \"C\" fn();\n";
    assert!(unexplained(explained).is_empty(), "{:?}", unexplained(explained));
    let bare = "let s = \"unsafe in a string\"; // unsafe in a comment\nlet x = unsafe { f() };\nunsafe impl Send for T {}\n\
        pub unsafe fn k() {}\n// SAFETY: about the block before.\nlet a = 1;\n\nlet y = unsafe { f() };\n";
    assert_eq!(unexplained(bare).len(), 4, "{:?}", unexplained(bare));
    assert_eq!(foreign_blocks("unsafe extern \"C\" {\n    fn f();\n}\ntype F = unsafe extern \"C\" fn();\n").len(), 1);
}
