//! The subcommands' arguments and output; each calls into the library.
pub mod bench;
pub mod eval;
