//! `dflash eval`: scores a drafter on token rows at every valid anchor (loss, accuracy, teacher-forced acceptance
//! length), or with `--decode` runs real speculative decoding on prompts against the target's greedy decoding.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;

use dflash::config::{Config, Gamma, SlotWeights, TargetSource};
use dflash::data::prompts::read_prompts;
use dflash::data::read_token_rows;
use dflash::device::{DeviceSpec, DtypeSpec, device_name};
use dflash::model::{Depth, Drafter, Target};
use dflash::panic::catch_torch;
use dflash::train::checkpoint::DRAFTER_DIR;
use dflash::train::decode_eval::{DecodeSettings, evaluate_decoding};
use dflash::train::eval::evaluate_rows;
use tch::{Device, Kind};

#[derive(Args)]
pub struct EvalArgs {
    /// The target: a HuggingFace model folder or a preset name (default: target.model).
    #[arg(long, value_name = "DIR|PRESET")]
    target: Option<String>,
    /// The drafter folder (published DFlash format: config.json + model.safetensors), a checkpoint folder
    /// (runs/.../best, runs/.../ckpt-000001000: the drafter it holds), or a run's checkpoint.dir (its newest valid
    /// checkpoint's drafter, as `export --checkpoint` takes it).
    #[arg(long, value_name = "DIR")]
    drafter: PathBuf,
    /// Token rows as JSON lines: {"id"?: int, "input_ids": [...], "loss_mask": [0|1...]}.
    #[arg(long, value_name = "PATH", required_unless_present = "decode", conflicts_with = "decode")]
    data: Option<PathBuf>,
    /// Decode for real: speculative decoding of --prompts with the drafter, checked against the target's own greedy
    /// decoding in the same run (greedy, batch 1).
    #[arg(long, requires = "prompts")]
    decode: bool,
    /// --decode: prompts as JSON lines, {"id"?: int, "input_ids": [...]} or a chat {"messages": [...]} (rendered
    /// with the target's chat template and a generation prompt; trailing assistant messages are dropped).
    #[arg(long, value_name = "PATH")]
    prompts: Option<PathBuf>,
    /// --decode: tokens to generate per prompt at most.
    #[arg(long, default_value_t = 256, value_parser = super::at_least_one, requires = "decode")]
    max_new_tokens: usize,
    /// --decode: the first N prompts of the file only (a quick look at a large set).
    #[arg(long, value_name = "N", value_parser = super::at_least_one, requires = "decode")]
    limit: Option<usize>,
    /// --decode: do not stop at the target's eos_token_id.
    #[arg(long, requires = "decode")]
    ignore_eos: bool,
    /// --decode on a GPU: launch every kernel of the target's and the drafter's passes instead of replaying them
    /// from CUDA graphs (same logits, slower; for comparison).
    #[arg(long, requires = "decode")]
    no_cuda_graphs: bool,
    /// --decode: write each prompt's generated token ids and accepted counts per verify step as JSON lines here.
    #[arg(long, value_name = "PATH", requires = "decode")]
    dump: Option<PathBuf>,
    /// --decode: chat template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON", requires = "decode")]
    template_kwargs: Option<String>,
    /// cpu, cuda:N or auto (default: target.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// f32 or bf16 (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long)]
    dtype: Option<DtypeSpec>,
    /// Weigh the loss's slots by the paper's decay exp(-(k-1)/gamma) (objective.weights = decay, whatever the
    /// configuration says) with this gamma: a number, none, or auto (7 for block size 16, 5 for 10, 4 for 8).
    /// Without it: objective.weights (D-PACE by default) and objective.gamma.
    #[arg(long, conflicts_with = "decode")]
    gamma: Option<Gamma>,
    /// Blocks per row per forward pass (default: objective.num_anchors); the result does not depend on it.
    #[arg(long, value_parser = super::at_least_one, conflicts_with = "decode")]
    num_anchors: Option<usize>,
    /// Rows per target pass.
    #[arg(long, default_value_t = 8, value_parser = super::at_least_one, conflicts_with = "decode")]
    batch: usize,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    json: bool,
}

/// The drafter folder `path` names: a drafter folder as it is, a checkpoint's `drafter/`, or for a run's checkpoint
/// folder its newest valid checkpoint's, as `export --checkpoint` takes it. Anything else is left as given, for
/// loading to say what is missing.
fn drafter_folder(path: PathBuf) -> PathBuf {
    let held = path.join(DRAFTER_DIR);
    if path.join("config.json").exists() || !path.is_dir() {
        return path;
    }
    if held.join("config.json").exists() {
        return held;
    }
    match super::export::newest_checkpoint(&path) {
        Ok((checkpoint, state)) => {
            eprintln!("{}: the drafter of its newest valid checkpoint, step {}", path.display(), state.step);
            checkpoint.join(DRAFTER_DIR)
        }
        Err(_) => path,
    }
}

pub fn run(config: &Config, mut args: EvalArgs) -> Result<ExitCode> {
    args.drafter = drafter_folder(args.drafter);
    let source = args.target.as_deref().map_or_else(|| config.target.source.clone(), TargetSource::from_arg);
    if args.target.is_none() {
        eprintln!("target: {source} (target.model; --target names another)");
    }
    let (device, kind) = super::compute_device(config, args.device, args.dtype)?;
    if args.decode {
        return decode(&args, &source, device, kind);
    }
    let data = args.data.as_ref().expect("clap requires --data without --decode");
    let report = catch_torch(|| -> Result<_> {
        let drafter = Drafter::load(&args.drafter, device, kind)?;
        let dc = drafter.config().clone();
        let gamma = args.gamma.unwrap_or(config.objective.gamma).resolve(dc.block_size)?;
        let num_anchors = args.num_anchors.unwrap_or(config.objective.num_anchors);
        let mut recipe = config.objective.clone();
        if args.gamma.is_some() {
            recipe.weights = SlotWeights::Decay;
        }
        let objective = recipe.settings(num_anchors, dc.block_size, gamma, dc.mask_token_id);
        let depth = if objective.teacher.needs_target_predictions() { Depth::Full } else { Depth::ToLastTap };
        let target = load_target(&source, &args.drafter, &drafter, depth, device, kind)?;
        let rows = read_token_rows(data, target.config().vocab_size)?;
        Ok(evaluate_rows(&target, &drafter, &objective, &rows, args.batch)?)
    })??;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} samples, {} tokens, {} blocks: loss {:.4} ({}), accuracy {:.4}, teacher-forced acceptance length {:.3} \
             (block size {})",
            report.samples,
            report.tokens,
            report.blocks,
            report.loss,
            match (report.dpace_alpha, report.gamma) {
                (Some(alpha), _) => format!("D-PACE weights, alpha {alpha}"),
                (None, Some(gamma)) => format!("decay weights, gamma {gamma}"),
                (None, None) => "every slot weighed alike".into(),
            },
            report.accuracy,
            report.acceptance_length,
            report.block_size
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Loads the target with the drafter's tapped layers and checks that the two fit together.
fn load_target(
    source: &TargetSource,
    drafter_dir: &std::path::Path,
    drafter: &Drafter,
    depth: Depth,
    device: Device,
    kind: Kind,
) -> Result<Target> {
    let dc = drafter.config();
    tracing::info!(target = %source, device = %device_name(device), "loading the target");
    let target = source.build_target(&dc.target_layer_ids, depth, device, kind)?;
    let tc = target.config();
    if tc.hidden_size != dc.decoder.hidden_size || tc.vocab_size != dc.decoder.vocab_size {
        bail!(
            "the drafter in {} was trained for another target: it reads hidden size {} and a vocabulary of {}, \
             where {source} has hidden size {} and a vocabulary of {} (pass the target it was trained with as \
             --target)",
            drafter_dir.display(),
            dc.decoder.hidden_size,
            dc.decoder.vocab_size,
            tc.hidden_size,
            tc.vocab_size
        );
    }
    Ok(target)
}

fn decode(args: &EvalArgs, source: &TargetSource, device: Device, kind: Kind) -> Result<ExitCode> {
    let prompts_path = args.prompts.as_ref().expect("clap requires --prompts with --decode");
    let kwargs = super::data::template_kwargs(args.template_kwargs.as_deref())?;
    let report = catch_torch(|| -> Result<_> {
        let drafter = Drafter::load(&args.drafter, device, kind)?;
        let target = load_target(source, &args.drafter, &drafter, Depth::Full, device, kind)?;
        // Chat prompts need the target's tokenizer and template (read only if a conversation line is there).
        let mut prompts = read_prompts(prompts_path, target.config().vocab_size, &|| source.chat_assets(&kwargs))?;
        if let Some(limit) = args.limit.filter(|&n| n < prompts.len()) {
            eprintln!("--limit {limit}: the first {limit} of {} prompts", prompts.len());
            prompts.truncate(limit);
        }
        let stop = if args.ignore_eos { Vec::new() } else { target.config().eos_token_ids.clone() };
        let settings = DecodeSettings {
            max_new_tokens: args.max_new_tokens,
            stop,
            cuda_graphs: !args.no_cuda_graphs,
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        };
        tracing::info!(prompts = prompts.len(), max_new_tokens = args.max_new_tokens, "decoding");
        Ok(evaluate_decoding(&target, &drafter, &prompts, &settings)?)
    })??;
    if let Some(path) = &args.dump {
        let mut text = String::new();
        for r in &report.results {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        std::fs::write(path, text).with_context(|| format!("--dump {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.summary());
    }
    Ok(ExitCode::SUCCESS)
}
