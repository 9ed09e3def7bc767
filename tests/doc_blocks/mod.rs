//! The fenced blocks of README.md and the docs/ pages, as the tests that run or check them read them.
#![allow(dead_code)]

use std::path::Path;

/// README.md and every page under docs/, as paths relative to the repository.
pub fn doc_pages() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| format!("docs/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    pages.sort();
    pages.insert(0, "README.md".to_string());
    pages
}

/// Every fenced block of `lang` in `page`.
pub fn doc_blocks(page: &str, lang: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(page)).unwrap();
    let fence = format!("```{lang}\n");
    text.split(&fence).skip(1).map(|rest| rest.split("\n```").next().unwrap().to_string()).collect()
}

/// The fenced block of `lang` that contains `marker` in `page`, a Markdown file of the repository (`README.md`,
/// `docs/operations.md`).
pub fn doc_block(page: &str, lang: &str, marker: &str) -> String {
    doc_blocks(page, lang)
        .into_iter()
        .find(|block| block.contains(marker))
        .unwrap_or_else(|| panic!("no ```{lang} block with {marker:?} in {page}"))
}
