//! `dflash eval`: scores a drafter on token rows at every valid anchor and prints loss, accuracy and simulated
//! acceptance length.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Args;

use dflash::config::{Config, Gamma, TargetSource};
use dflash::data::read_token_rows;
use dflash::device::{DeviceSpec, DtypeSpec, device_name};
use dflash::model::{Depth, Drafter};
use dflash::panic::catch_torch;
use dflash::train::ObjectiveSettings;
use dflash::train::eval::evaluate_rows;

#[derive(Args)]
pub struct EvalArgs {
    /// The target: a HuggingFace model folder or a preset name (default: target.model).
    #[arg(long, value_name = "DIR|PRESET")]
    target: Option<String>,
    /// The drafter folder (published DFlash format: config.json + model.safetensors).
    #[arg(long, value_name = "DIR")]
    drafter: PathBuf,
    /// Token rows as JSON lines: {"id"?: int, "input_ids": [...], "loss_mask": [0|1...]}.
    #[arg(long, value_name = "PATH")]
    data: PathBuf,
    /// cpu, cuda:N or auto (default: target.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// f32 or bf16 (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long)]
    dtype: Option<DtypeSpec>,
    /// Loss-weight decay: a number, none, or auto (7 for block size 16, 5 for 10, 4 for 8). Default:
    /// objective.gamma.
    #[arg(long)]
    gamma: Option<Gamma>,
    /// Blocks per row per forward pass (default: objective.num_anchors); the result does not depend on it.
    #[arg(long)]
    num_anchors: Option<usize>,
    /// Rows per target pass.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    json: bool,
}

pub fn run(config: &Config, args: EvalArgs) -> Result<ExitCode> {
    let source = match &args.target {
        Some(t) => match t.parse() {
            Ok(preset) => TargetSource::Preset(preset),
            Err(_) => TargetSource::Folder(PathBuf::from(t)),
        },
        None => config.target.source.clone(),
    };
    let (device, kind) = super::compute_device(config, args.device, args.dtype)?;
    let report = catch_torch(|| -> Result<_> {
        let drafter = Drafter::load(&args.drafter, device, kind)?;
        let dc = drafter.config().clone();
        let gamma = args.gamma.unwrap_or(config.objective.gamma).resolve(dc.block_size)?;
        let objective = ObjectiveSettings::new(
            args.num_anchors.unwrap_or(config.objective.num_anchors),
            dc.block_size,
            gamma,
            dc.mask_token_id,
        );
        tracing::info!(target = %source, device = %device_name(device), "loading the target");
        let target = source.build_target(&dc.target_layer_ids, Depth::ToLastTap, device, kind)?;
        let tc = target.config();
        if tc.hidden_size != dc.decoder.hidden_size || tc.vocab_size != dc.decoder.vocab_size {
            bail!(
                "the drafter in {} expects a target with hidden size {} and vocabulary {}, but {source} has {} and {}",
                args.drafter.display(),
                dc.decoder.hidden_size,
                dc.decoder.vocab_size,
                tc.hidden_size,
                tc.vocab_size
            );
        }
        let rows = read_token_rows(&args.data, tc.vocab_size)?;
        Ok(evaluate_rows(&target, &drafter, &objective, &rows, args.batch)?)
    })??;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} samples, {} tokens, {} blocks: loss {:.4}, accuracy {:.4}, acceptance length {:.3} (block size {})",
            report.samples,
            report.tokens,
            report.blocks,
            report.loss,
            report.accuracy,
            report.acceptance_length,
            report.block_size
        );
    }
    Ok(ExitCode::SUCCESS)
}
