//! `dflash bench`: arguments and printing; the measuring lives in `dflash::bench`.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};

use dflash::bench::{
    DecodeBenchOptions, DrafterBenchOptions, GenerateBenchOptions, LaunchBenchOptions, TargetBenchOptions,
    bench_decode, bench_drafter, bench_generate, bench_launch, bench_target,
};
use dflash::config::{Config, TargetSource};
use dflash::device::{DeviceSpec, DtypeSpec, device_name};
use dflash::model::{Depth, Preset};
use dflash::panic::catch_torch;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchWhat {
    /// Target hidden-state capture (or the full stack with --full)
    Target,
    /// Whole drafter training steps on random target features
    Drafter,
    /// Target capture then a drafter training step, per step, on one device, no actors: serve-train's yardstick
    Pipeline,
    /// Batch-1 speculative decoding: target verify and drafter passes, and whole generations (see --help)
    Decode,
    /// Kernel-launch rate of one process with 1, 2, 4, 8 compute threads (see --threads)
    Launch,
    /// Batched generation (regenerate --local's engine): --prompts random prompts of --seq tokens, each answered
    /// with --max-new tokens (no stop token), --batch at once
    Generate,
}

#[derive(Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum)]
    what: BenchWhat,
    /// A built-in shape with random weights: tiny, tiny-moe, tiny-gpt-oss, qwen3-4b, qwen3-8b, qwen3-8b-128k (YaRN
    /// for 131,072 positions), llama3.1-8b, smollm2-135m (the tests' real model's shapes), qwen3-30b-a3b, gpt-oss-20b
    /// (default: target.model when it is a preset). `--what drafter` benchmarks that preset's drafter (5 layers; 2 for
    /// tiny, 4 for smollm2-135m).
    #[arg(long, conflicts_with = "model")]
    preset: Option<Preset>,
    /// A HuggingFace model folder to load instead of a preset (--what target and generate).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Tapped layer ids, comma separated (default: draft_model.target_layer_ids, else the preset's, or z-lab's rule
    /// for a model folder).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    taps: Option<Vec<usize>>,
    /// cpu, cuda:N or auto (default: target.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// auto, bf16 or f32 (default: target.dtype).
    #[arg(long)]
    dtype: Option<DtypeSpec>,
    /// Sequences per step (default: 16 for target, 4 for drafter, 256 for generate).
    #[arg(long)]
    batch: Option<i64>,
    /// Tokens per sequence (default: 2048 for target, 768 for drafter, 512 prompt tokens for decode, 64 for
    /// generate).
    #[arg(long)]
    seq: Option<i64>,
    /// Drafter: anchors (blocks) per sequence.
    #[arg(long, default_value_t = 256)]
    anchors: usize,
    /// Drafter and pipeline: conversations packed per row (`data.pack`): the --batch conversations of --seq tokens
    /// go N to a row of N x --seq tokens, each trained as alone; 1: a row each.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pack: i64,
    /// Drafter: block size.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Timed steps; the median (and for the drafter the 90th percentile) is reported. Decode: timed passes of
    /// each kind, and tokens per generation.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps before timing.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Target: run every layer, the final norm and the LM head instead of stopping at the last tap.
    #[arg(long)]
    full: bool,
    /// Drafter: also time the preset target's capture of the same batch (reported as capture_ms_p50).
    #[arg(long)]
    capture: bool,
    /// Generate: prompts answered (default: 4 x --batch).
    #[arg(long)]
    prompts: Option<usize>,
    /// Generate: new tokens per prompt.
    #[arg(long, default_value_t = 256)]
    max_new: usize,
    /// Generate: step eagerly, without CUDA graphs.
    #[arg(long)]
    no_cuda_graphs: bool,
    /// Generate: decode the first N prompts again one at a time and compare (bf16 differences are reported with
    /// their top-2 logit gap).
    #[arg(long, default_value_t = 0, value_name = "N")]
    check: usize,
    /// Launch: the thread counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_name = "N,...")]
    threads: Vec<usize>,
    /// Launch: kernel launches per thread.
    #[arg(long, default_value_t = 50_000)]
    launches: usize,
    /// Launch: each thread launches on a stream of its own rather than the device's default stream.
    #[arg(long)]
    own_streams: bool,
    /// Drafter: rows of the LM head and loss computed at once (the trainer's default: 2048). More rows: fewer,
    /// larger matrix products; fewer rows: less memory.
    #[arg(long, value_name = "ROWS")]
    lm_head_chunk_rows: Option<i64>,
    /// Drafter: blocks attended together in one attention call (the trainer's default: 64 on a GPU, 8 on the CPU);
    /// results do not depend on it, only speed.
    #[arg(long, value_name = "BLOCKS")]
    attention_group_blocks: Option<usize>,
    /// Also time the phases of one extra step with device events (reported as phases_ms).
    #[arg(long)]
    profile: bool,
    /// The device's bf16 matrix peak in TFLOP/s, for MFU (797: measured on the H200 used for BENCHMARKS.md).
    #[arg(long, default_value_t = 797.0)]
    peak_tflops: f64,
    /// Print one JSON object per run instead of a summary line.
    #[arg(long)]
    json: bool,
    /// Target: spread the decoder layers over these devices (e.g. cuda:0,cuda:1), split by the GPUs' free memory,
    /// instead of --device; the first holds the embedding and head and receives the tapped states.
    #[arg(long, value_delimiter = ',', value_name = "DEVICES", conflicts_with = "device")]
    spread: Option<Vec<DeviceSpec>>,
    /// Target: run each capture as this many micro-batches of rows (default: 1 on one device, 4 per device with
    /// --spread), as target.micro_batches does in serve-train.
    #[arg(long, value_name = "N")]
    micro_batches: Option<usize>,
}

pub fn run(config: &Config, args: BenchArgs) -> Result<ExitCode> {
    let source = match (args.preset, &args.model) {
        (Some(p), _) => TargetSource::Preset(p),
        (None, Some(dir)) => TargetSource::Folder(dir.clone()),
        (None, None) => config.target.source.clone(),
    };
    let (device, kind) = super::compute_device(config, args.device, args.dtype)?;
    let (json, phases) = match args.what {
        BenchWhat::Target => {
            let taps = resolve_taps(config, &args, &source)?;
            let opts = TargetBenchOptions {
                batch: args.batch.unwrap_or(16),
                seq: args.seq.unwrap_or(2048),
                steps: args.steps,
                warmup: args.warmup,
                full: args.full,
                profile: args.profile,
                peak_tflops: args.peak_tflops,
            };
            let depth = if args.full { Depth::Full } else { Depth::ToLastTap };
            let devices = match &args.spread {
                Some(list) => list.iter().map(|d| d.resolve()).collect::<Result<Vec<_>, _>>().context("--spread")?,
                None => vec![device],
            };
            let report = catch_torch(|| -> Result<_> {
                let names: Vec<String> = devices.iter().map(|&d| device_name(d)).collect();
                tracing::info!(target = %source, devices = ?names, "building the target");
                let mut target = source.build_target_spread(&taps, depth, &devices, kind)?;
                target.set_micro_batches(args.micro_batches.unwrap_or(0));
                Ok(bench_target(&target, &source.to_string(), &opts)?)
            })??;
            print_summary(args.json, &report.summary());
            (serde_json::to_value(&report)?, report.phases_ms)
        }
        BenchWhat::Drafter | BenchWhat::Pipeline => {
            let TargetSource::Preset(preset) = source else {
                bail!("--what drafter and pipeline run a preset's random-weight models: pass --preset (e.g. qwen3-8b)");
            };
            let opts = DrafterBenchOptions {
                batch: args.batch.unwrap_or(4),
                seq: args.seq.unwrap_or(768),
                anchors: args.anchors,
                block_size: args.block_size,
                steps: args.steps,
                warmup: args.warmup,
                profile: args.profile,
                capture: args.capture,
                pipeline: args.what == BenchWhat::Pipeline,
                peak_tflops: args.peak_tflops,
                lm_head_chunk_rows: args.lm_head_chunk_rows,
                attention_group_blocks: args.attention_group_blocks,
                dpace_alpha: config.objective.dpace_alpha(),
                optimizer: config.optim.optimizer,
                muon: config.optim.muon,
                teacher: config.objective.teacher,
                layer_attention: config.draft_model.layer_attention.clone(),
                variant: config.draft_model.variant,
                selector_loss_alpha: config.objective.selector_loss_alpha,
                pack: args.pack,
            };
            let report = catch_torch(|| -> Result<_> {
                tracing::info!(%preset, device = %device_name(device), "building the drafter");
                Ok(bench_drafter(preset, device, kind, &opts)?)
            })??;
            print_summary(args.json, &report.summary());
            (serde_json::to_value(&report)?, report.phases_ms)
        }
        BenchWhat::Decode => {
            let TargetSource::Preset(preset) = source else {
                bail!("--what decode runs a preset's random-weight models: pass --preset (e.g. qwen3-8b)");
            };
            let opts = DecodeBenchOptions {
                seq: args.seq.unwrap_or(512),
                block_size: args.block_size,
                steps: args.steps,
                warmup: args.warmup,
                profile: args.profile,
                variant: config.draft_model.variant,
                layer_attention: config.draft_model.layer_attention.clone(),
            };
            let report = catch_torch(|| -> Result<_> {
                tracing::info!(%preset, device = %device_name(device), "building the target and the drafter");
                Ok(bench_decode(preset, device, kind, &opts)?)
            })??;
            print_summary(args.json, &report.summary());
            (serde_json::to_value(&report)?, None)
        }
        BenchWhat::Generate => {
            let batch = args.batch.unwrap_or(256).max(1) as usize;
            let opts = GenerateBenchOptions {
                batch,
                prompts: args.prompts.unwrap_or(4 * batch),
                prompt_len: args.seq.unwrap_or(64).max(1) as usize,
                max_new: args.max_new,
                cuda_graphs: !args.no_cuda_graphs,
                check: args.check,
            };
            let report = catch_torch(|| -> Result<_> {
                tracing::info!(target = %source, device = %device_name(device), "building the target");
                let target = source.build_target(&[0], Depth::Full, device, kind)?;
                Ok(bench_generate(&target, &source.to_string(), &opts)?)
            })??;
            print_summary(args.json, &report.summary());
            (serde_json::to_value(&report)?, None)
        }
        BenchWhat::Launch => {
            let opts = LaunchBenchOptions {
                threads: args.threads.clone(),
                launches: args.launches,
                own_streams: args.own_streams,
            };
            let report = bench_launch(device, &opts)?;
            print_summary(args.json, &report.summary());
            (serde_json::to_value(&report)?, None)
        }
    };
    if args.json {
        println!("{json}");
    } else if let Some(phases) = phases {
        for (phase, ms) in phases {
            println!("  {phase:<20} {ms:>10.3} ms");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_summary(json: bool, summary: &str) {
    if !json {
        println!("{summary}");
    }
}

fn resolve_taps(config: &Config, args: &BenchArgs, source: &TargetSource) -> Result<Vec<usize>> {
    if let Some(taps) = &args.taps {
        return Ok(taps.clone());
    }
    // The bench's own target (--model, --preset) with the configuration's taps setting (a folder: z-lab's rule).
    let depth = match source {
        TargetSource::Preset(p) => p.spec().target.num_hidden_layers,
        TargetSource::Folder(dir) => dflash::model::TargetConfig::from_dir(dir)?.num_hidden_layers,
    };
    Ok(config.target_layer_ids_of(source, depth)?)
}
