//! docs/development.md's "Adding a drafter variant", checked: every file it names exists, and no file outside the
//! ones it names carries a variant's own code. The backbone asks `Variant` for parts; a file that names DFlash 2's
//! types or its folder elsewhere (outside unit tests and comments) is one more place a new variant would have to
//! find, and the list would no longer be true.
mod source_tree;

use std::fs;
use std::path::Path;

use source_tree::{rust_files, src};

/// What marks DFlash 2's own code: its enum arm, its sizes' type, its folder.
const VARIANT_CODE: [&str; 3] = ["Variant::DFlash2", "Dflash2Shape", "dflash2::"];

/// The section's text.
fn section() -> String {
    let doc = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/development.md")).unwrap();
    let start = doc.find("## Adding a drafter variant").expect("docs/development.md has \"Adding a drafter variant\"");
    let rest = &doc[start + 3..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
}

/// The paths the section names (backticked, with a `/`), relative to the repository.
fn named_paths(section: &str) -> Vec<String> {
    section.split('`').skip(1).step_by(2).filter(|s| s.contains('/') && !s.contains(' ')).map(String::from).collect()
}

/// A file's code without its unit tests and comments.
fn code(text: &str) -> String {
    let text = text.find("#[cfg(test)]\nmod tests").map_or(text, |i| &text[..i]);
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

#[test]
fn the_list_of_files_a_new_variant_touches_is_short_and_true() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let named = named_paths(&section());
    for path in &named {
        assert!(root.join(path).exists(), "\"Adding a drafter variant\" names {path}, which does not exist");
    }
    let sources: Vec<&String> = named.iter().filter(|p| p.starts_with("src/")).collect();
    assert!(sources.len() <= 6, "a short list: {sources:?}");
    let mut outside = Vec::new();
    for file in rust_files(&src()) {
        let relative = file.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let text = code(&fs::read_to_string(&file).unwrap());
        if VARIANT_CODE.iter().any(|mark| text.contains(mark))
            && !sources.iter().any(|p| relative.starts_with(p.as_str()))
        {
            outside.push(relative);
        }
    }
    assert!(
        outside.is_empty(),
        "a variant's own code outside the files \"Adding a drafter variant\" names: {outside:?}"
    );
}

/// The check sees what it looks for: DFlash 2's registration and parts are found where they are.
#[test]
fn the_check_finds_a_variants_code() {
    let text = code(&fs::read_to_string(src().join("model/variant/mod.rs")).unwrap());
    assert!(text.contains("Variant::DFlash2"));
    let drafter = code(&fs::read_to_string(src().join("model/drafter.rs")).unwrap());
    assert!(drafter.contains("dflash2::"), "the drafter runs DFlash 2's parts");
    assert!(named_paths("1. `src/model/variant/dflash2/` and `tests/dflash2.rs`; `Variant`").len() == 2);
}
