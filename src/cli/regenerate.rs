//! `dflash regenerate`: arguments and printing; the work is in `dflash::data::regenerate`.
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

use dflash::config::{Config, TargetSource};
use dflash::data::prepare::ModelAssets;
use dflash::data::regenerate::{Endpoint, RegenerateOptions, ShowProgress, regenerate_endpoint};
use dflash::device::{DeviceSpec, DtypeSpec};
use dflash::model::Depth;
use dflash::model::batched::default_batch;
use dflash::model::generate::Sampling;
use dflash::service::builtin_data::LocalResponder;

#[derive(Args)]
pub struct RegenerateArgs {
    /// An OpenAI-compatible server's base URL, e.g. http://localhost:8000/v1 (vLLM, SGLang).
    #[arg(long, required_unless_present = "local", conflicts_with = "local")]
    endpoint: Option<String>,
    /// With --endpoint: the served model's name (as the server lists it at /v1/models; vLLM's default is the path
    /// it was started with). With --local: the target's HuggingFace folder, or a built-in preset (`tiny-tasks`,
    /// `tiny`).
    #[arg(long, value_name = "NAME|DIR")]
    model: String,
    /// Generate in this process with --model's weights instead of asking a server: batched on the GPU (or the
    /// CPU), no server to run.
    #[arg(long)]
    local: bool,
    /// Chat JSONL (OpenAI `messages` or ShareGPT `conversations`).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Output JSONL, appended conversation by conversation; a rerun continues where the last run stopped.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Conversations in flight at once (--endpoint).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// --local: conversations the target answers at once (default: 32 on a CPU; on a GPU 256, or fewer where their KV
    /// cache, batch x (1,024 prompt tokens + --max-tokens), would take more than half the free memory; more is faster
    /// until the cache, batch x the longest prompt and reply, fills the device).
    #[arg(long, conflicts_with = "endpoint")]
    batch: Option<usize>,
    /// Retries per request after the first, with exponential backoff (--endpoint).
    #[arg(long, default_value_t = 5)]
    retries: u32,
    /// Seconds before a request is abandoned (and retried).
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Bearer token for the server (default: $OPENAI_API_KEY).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Most tokens per response (a reply cut here is counted in the summary).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// Replies run to --max-tokens, past the end of turn: fixed-length answers, for benchmarks (sent to servers as
    /// vLLM's and SGLang's ignore_eos).
    #[arg(long)]
    ignore_eos: bool,
    /// 0 for greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Seed of sampled replies, mixed with each conversation's id and turn: a reply is the same whatever ran beside
    /// it (sent to servers as `seed`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Variables for the chat template, as a JSON object (sent as chat_template_kwargs to servers).
    #[arg(long, value_name = "JSON")]
    template_kwargs: Option<String>,
    /// --local: cpu, cuda:N or auto (default: target.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// --local: auto, bf16 or f32 (default: target.dtype).
    #[arg(long)]
    dtype: Option<DtypeSpec>,
}

pub fn run(config: &Config, args: RegenerateArgs) -> Result<ExitCode> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature {}: expected a number >= 0", args.temperature);
    }
    let kwargs = super::data::template_kwargs(args.template_kwargs.as_deref())?;
    let opts = RegenerateOptions {
        input: args.input.clone(),
        out: args.out.clone(),
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        seed: args.seed,
        ignore_eos: args.ignore_eos,
        template_kwargs: kwargs.clone(),
        progress: match std::io::stderr().is_terminal() {
            true => ShowProgress::Bar,
            false => ShowProgress::Lines(Duration::from_secs(10)),
        },
    };
    let report = match &args.endpoint {
        Some(url) => {
            let endpoint = Endpoint {
                url: url.clone(),
                model: args.model.clone(),
                api_key: args.api_key.clone(),
                concurrency: args.concurrency,
                retries: args.retries,
                timeout: Duration::from_secs(args.timeout_s),
            };
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(regenerate_endpoint(&opts, &endpoint))?
        }
        None => {
            let (device, kind) = super::compute_device(config, args.device, args.dtype)?;
            let source = TargetSource::from_arg(&args.model);
            if let TargetSource::Preset(p) = &source
                && let Some(warning) = p.random_weights_warning()
            {
                tracing::warn!("--model {warning}");
            }
            let assets = ModelAssets::resolve(&args.model, &kwargs)?;
            // Any layer id works as a tap here; decoding runs the whole stack.
            let target = source.build_target(&[0], Depth::Full, device, kind)?;
            let sampling = Sampling::temperature(args.temperature);
            // A row holds its prompt and reply: sized for prompts of up to 1,024 tokens (longer ones grow the cache).
            let batch = args.batch.unwrap_or_else(|| default_batch(&target, args.max_tokens as usize + 1024)).max(1);
            let responder =
                LocalResponder::new(target, assets, args.max_tokens as usize, sampling, args.ignore_eos, batch);
            dflash::panic::catch_torch(|| responder.regenerate(&opts))??
        }
    };
    println!("{}", report.summary());
    if report.incomplete() {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
