//! `dflash`: a fault-tolerant trainer for DFlash speculative-decoding drafters.
//!
//! The compute core (`model`, later `train`) knows nothing of actors, so it is tested and benchmarked alone; the
//! binary (`src/main.rs`) is only the command line.
pub mod bench;
pub mod bounded_join;
pub mod cluster;
pub mod config;
pub mod data;
pub mod device;
pub mod ffi;
pub mod model;
pub mod panic;
pub mod profile;
pub mod proxy;
pub mod service;
pub mod telemetry;
pub mod train;

/// The first line of a libtorch error, without tch's prefix or the C++ backtrace libtorch appends.
pub fn torch_message(full: &str) -> String {
    let first = full.lines().next().unwrap_or(full);
    first.trim_start_matches("Internal torch error: ").to_string()
}
