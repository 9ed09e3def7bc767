//! The subcommands' arguments and output; each calls into the library.
pub mod bench;
pub mod config;
pub mod data;
pub mod eval;
pub mod export;
pub mod inspect_run;
pub mod proxy;
pub mod regenerate;
pub mod synthesize;

use anyhow::{Context, Result};
use tch::{Device, Kind};

use dflash::config::Config;
use dflash::device::{DeviceSpec, DtypeSpec};

/// The device and dtype a command runs on (flags over configuration), with the calling thread bound to it.
pub fn compute_device(config: &Config, device: Option<DeviceSpec>, dtype: Option<DtypeSpec>) -> Result<(Device, Kind)> {
    let device = device.unwrap_or(config.target.device).resolve().context("--device / target.device")?;
    let kind = dtype.unwrap_or(config.target.dtype).resolve(device);
    dflash::device::bind_thread(device)?;
    Ok((device, kind))
}

/// A count that must be at least 1 (a flag of 0 would run and report nothing: tokens to generate, rows to read).
pub fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}: a whole number, at least 1")),
    }
}
