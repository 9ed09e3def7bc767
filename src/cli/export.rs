//! `dflash export`: a checkpoint's drafter as a standalone folder in the published DFlash format.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use tch::{Device, Kind};

use dflash::model::Drafter;
use dflash::train::checkpoint::{DRAFTER_DIR, newest_valid, verify_checkpoint};

#[derive(Clone, Copy, ValueEnum)]
pub enum ExportDtype {
    Bf16,
    F32,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint folder (ckpt-N), or a checkpoint.dir whose newest valid checkpoint is taken.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Where to write the drafter (config.json + model.safetensors).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Weights' dtype: bf16 as published, or f32 (the master weights as trained).
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: ExportDtype,
}

pub fn run(args: ExportArgs) -> Result<ExitCode> {
    let ckpt = if args.checkpoint.join("MANIFEST").exists() {
        verify_checkpoint(&args.checkpoint)?;
        args.checkpoint.clone()
    } else {
        let scan = newest_valid(&args.checkpoint, &|_| true)?;
        for (_, why) in scan.rejected {
            eprintln!("skipping an invalid checkpoint: {why}");
        }
        scan.newest
            .map(|(p, _)| p)
            .with_context(|| format!("{}: no valid checkpoint here", args.checkpoint.display()))?
    };
    let kind = match args.dtype {
        ExportDtype::Bf16 => Kind::BFloat16,
        ExportDtype::F32 => Kind::Float,
    };
    let drafter = Drafter::load(&ckpt.join(DRAFTER_DIR), Device::Cpu, Kind::Float)?;
    drafter.save(&args.out, kind)?;
    println!("exported {} to {}", ckpt.display(), args.out.display());
    Ok(ExitCode::SUCCESS)
}
