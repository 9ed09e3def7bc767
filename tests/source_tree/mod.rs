//! The library's sources as the tests that check the source tree's rules read them (`tests/layering.rs`,
//! `tests/unsafe_code.rs`).
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

/// `src/` of this checkout.
pub fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted by path.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in fs::read_dir(&folder).unwrap_or_else(|e| panic!("cannot read {}: {e}", folder.display())) {
            let path = entry.unwrap_or_else(|e| panic!("cannot read {}: {e}", folder.display())).path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}
