//! Data: conversations and chat templates, tokenization and loss masks, token rows as evaluation and training
//! consume them.
pub mod builtin;
pub mod chat;
pub mod dataset;
pub mod loader;
pub mod packing;
pub mod prepare;
pub mod prompts;
pub mod regenerate;
pub mod sample;
pub mod sample_id;
pub mod settled_lines;
pub mod shards;
pub mod stream;
pub mod synthesize;
pub mod token_rows;
pub mod tokenize;

pub use sample_id::SampleId;
pub use token_rows::{TokenRow, read_token_rows};

use std::path::PathBuf;

/// A problem with an input file, naming the file and line.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}:{line}: {reason}", path.display())]
    Line { path: PathBuf, line: usize, reason: String },
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
}
