//! `dflash export`: a checkpoint's drafter as a standalone folder in the published DFlash format, or a built-in
//! target preset (`tiny-tasks`, `tiny`) as a HuggingFace model folder, for other tools to load.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use tch::{Device, Kind};

use dflash::data::builtin::write_tiny_tokenizer;
use dflash::model::{Depth, Drafter, Preset};
use dflash::train::checkpoint::{DRAFTER_DIR, newest_valid, verify_checkpoint};

#[derive(Clone, Copy, ValueEnum)]
pub enum ExportDtype {
    Bf16,
    F32,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint folder (ckpt-N), or a checkpoint.dir whose newest valid checkpoint is taken.
    #[arg(long, value_name = "DIR", required_unless_present = "preset", conflicts_with = "preset")]
    checkpoint: Option<PathBuf>,
    /// A built-in target instead: tiny-tasks or tiny, written as a HuggingFace model folder (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json with the chat template). tiny-tasks' weights are
    /// written as built in, so model.safetensors has the SHA-256 the README states.
    #[arg(long, value_name = "PRESET")]
    preset: Option<Preset>,
    /// Where to write the folder (config.json + model.safetensors, and the tokenizer for a preset).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The drafter's weights' dtype: bf16 as published, or f32 (the master weights as trained).
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: ExportDtype,
}

pub fn run(args: ExportArgs) -> Result<ExitCode> {
    if let Some(preset) = args.preset {
        export_preset(preset, &args.out)?;
        println!("exported the {preset} target to {} (a HuggingFace model folder)", args.out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let Some(checkpoint) = args.checkpoint else {
        bail!("give --checkpoint DIR or --preset NAME");
    };
    let ckpt = if checkpoint.join("MANIFEST").exists() {
        verify_checkpoint(&checkpoint)?;
        checkpoint.clone()
    } else {
        let scan = newest_valid(&checkpoint, &|_| true)?;
        for (_, why) in scan.rejected {
            eprintln!("skipping an invalid checkpoint: {why}");
        }
        scan.newest.map(|(p, _)| p).with_context(|| format!("{}: no valid checkpoint here", checkpoint.display()))?
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

/// The preset as a HuggingFace folder: its weights (built-in bytes as they are, or the random ones drawn), its
/// config and the tiny tokenizer. Only the tiny family has a tokenizer to go with it.
fn export_preset(preset: Preset, out: &std::path::Path) -> Result<()> {
    if !preset.is_tiny() {
        bail!(
            "--preset {preset}: only tiny-tasks and tiny can be exported (the others have random weights and no tokenizer)"
        );
    }
    let spec = preset.spec();
    let target = spec.build_target(Depth::Full, Device::Cpu, Kind::Float)?;
    target.save_hf(out, usize::MAX).with_context(|| format!("--out {}", out.display()))?;
    if let Some(bytes) = spec.weights {
        let path = out.join("model.safetensors");
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    write_tiny_tokenizer(out).with_context(|| format!("--out {}", out.display()))?;
    Ok(())
}
