//! `dflash synthesize`: arguments and printing; the work is in `dflash::data::synthesize`.
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

use dflash::config::{Config, TargetSource};
use dflash::data::prepare::ModelAssets;
use dflash::data::regenerate::ShowProgress;
use dflash::data::synthesize::plan::Settings;
use dflash::data::synthesize::turn_checks::TurnBounds;
use dflash::data::synthesize::{SynthesizeOptions, SynthesizeReport, synthesize};
use dflash::device::{DeviceSpec, DtypeSpec};
use dflash::model::Depth;
use dflash::model::batched::default_batch;
use dflash::model::sampling::Sampling;

#[derive(Args)]
pub struct SynthesizeArgs {
    /// The target's HuggingFace folder (a chat model: its template must open a user turn), or `tiny-tasks`.
    #[arg(long)]
    model: String,
    /// Conversations to write.
    #[arg(long, default_value_t = 10_000)]
    count: u64,
    /// Output chat JSONL (what `prepare` reads), written conversation by conversation; a rerun continues it.
    /// Rejected attempts and why go to <stem>.rejected.jsonl beside it.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Seed of everything drawn: the same seed and options give the same file.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Temperature of the requests the target writes (Magpie's: 1.0).
    #[arg(long, default_value_t = 1.0)]
    request_temperature: f64,
    /// Nucleus of the requests (1: every token).
    #[arg(long, default_value_t = 1.0)]
    request_top_p: f64,
    /// Fewest tokens in a request (shorter ones are rejected).
    #[arg(long, default_value_t = 4)]
    min_request_tokens: usize,
    /// Most tokens in a request: one without its end of turn by then is rejected as a runaway.
    #[arg(long, default_value_t = 256)]
    max_request_tokens: usize,
    /// Temperature of the answers (0: greedy, what a drafter serving greedy decoding learns from).
    #[arg(long, default_value_t = 0.0)]
    answer_temperature: f64,
    /// Nucleus of sampled answers.
    #[arg(long, default_value_t = 1.0)]
    answer_top_p: f64,
    /// Most tokens of an answer (one cut there is kept, and counted in the summary).
    #[arg(long, default_value_t = 2048, value_parser = super::at_least_one)]
    max_tokens: usize,
    /// User turns per conversation: N, or A-B for a number drawn per conversation (each later request is written by
    /// the target after its answer).
    #[arg(long, default_value = "1", value_name = "N|A-B")]
    turns: String,
    /// Topics to spread the requests over, one a line: each conversation draws one, and its first request is
    /// written under a system prompt naming it (the answer does not see it).
    #[arg(long, value_name = "FILE")]
    topics: Option<PathBuf>,
    /// System prompts your users send, one a line: a conversation draws one (--system-share of them), and both its
    /// requests and answers see it.
    #[arg(long, value_name = "FILE")]
    system_prompts: Option<PathBuf>,
    /// The share of conversations with a system prompt from --system-prompts (the others get the template's
    /// default).
    #[arg(long, default_value_t = 0.5, requires = "system_prompts")]
    system_share: f64,
    /// Requests this similar to an earlier one (Jaccard similarity of their word pairs, by MinHash) are rejected as
    /// near duplicates; above 1 only exact duplicates are.
    #[arg(long, default_value_t = 0.8)]
    duplicate_threshold: f64,
    /// Attempts at most before the run gives up short of --count (default: 4 x count + 1,000).
    #[arg(long)]
    max_attempts: Option<u64>,
    /// Variables for the chat template, as a JSON object, e.g. '{"enable_thinking": false}' for Qwen3.
    #[arg(long, value_name = "JSON")]
    template_kwargs: Option<String>,
    /// Sequences generated at once (default: 32 on a CPU; on a GPU 256, or fewer where their KV cache, batch x
    /// (--max-request-tokens + --max-tokens + 256), would take more than half the free memory; more is faster until
    /// the cache fills the device).
    #[arg(long)]
    batch: Option<usize>,
    /// cpu, cuda:N or auto (default: target.device).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// auto, bf16 or f32 (default: target.dtype).
    #[arg(long)]
    dtype: Option<DtypeSpec>,
}

/// `--turns`: N or A-B.
fn turns(text: &str) -> Result<(usize, usize)> {
    let bad = || anyhow::anyhow!("--turns {text:?}: expected a number of user turns (1) or a range (2-4), from 1");
    let (low, high) = match text.split_once('-') {
        Some((a, b)) => (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?),
        None => {
            let n = text.trim().parse().map_err(|_| bad())?;
            (n, n)
        }
    };
    if low == 0 || high < low {
        return Err(bad());
    }
    Ok((low, high))
}

/// The non-empty lines of a file given to `flag`.
fn lines_of(path: Option<&Path>, flag: &str) -> Result<Vec<String>> {
    let Some(path) = path else { return Ok(Vec::new()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("{flag} {}", path.display()))?;
    let lines: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
    if lines.is_empty() {
        bail!("{flag} {}: no line in it (one a line)", path.display());
    }
    Ok(lines)
}

pub fn run(config: &Config, args: SynthesizeArgs) -> Result<ExitCode> {
    let requests =
        Sampling::new(args.request_temperature, args.request_top_p).map_err(|e| anyhow::anyhow!("--request-{e}"))?;
    if requests == Sampling::Greedy {
        bail!("--request-temperature 0: greedy requests would all be the same; use 0.7 to 1.2 (default 1.0)");
    }
    let answers =
        Sampling::new(args.answer_temperature, args.answer_top_p).map_err(|e| anyhow::anyhow!("--answer-{e}"))?;
    if args.count == 0 {
        bail!("--count 0: nothing to synthesize");
    }
    if !(0.0..=1.0).contains(&args.system_share) {
        bail!("--system-share {}: expected a share in [0, 1]", args.system_share);
    }
    if args.duplicate_threshold.is_nan() || args.duplicate_threshold <= 0.0 {
        bail!(
            "--duplicate-threshold {}: expected a Jaccard similarity in (0, 1] (above 1: exact duplicates only)",
            args.duplicate_threshold
        );
    }
    if args.min_request_tokens > args.max_request_tokens || args.max_request_tokens == 0 {
        bail!(
            "--min-request-tokens {} and --max-request-tokens {}: expected 0 < min <= max",
            args.min_request_tokens,
            args.max_request_tokens
        );
    }
    let kwargs = super::data::template_kwargs(args.template_kwargs.as_deref())?;
    let assets = ModelAssets::resolve(&args.model, &kwargs).with_context(|| {
        format!("--model {}: synthesize needs a chat model's tokenizer and chat template", args.model)
    })?;
    assets.template.user_opening(&[]).map_err(|e| {
        anyhow::anyhow!(
            "--model {}: its chat template cannot be opened at a user turn ({e}); synthesize needs a chat model's \
             template (a base model's folder has none to open)",
            args.model
        )
    })?;
    let conversations = Settings {
        count: args.count,
        seed: args.seed,
        turns: turns(&args.turns)?,
        system_prompts: lines_of(args.system_prompts.as_deref(), "--system-prompts")?,
        system_share: args.system_share,
        topics: lines_of(args.topics.as_deref(), "--topics")?,
        bounds: TurnBounds { min_tokens: args.min_request_tokens, max_tokens: args.max_request_tokens },
        duplicate_threshold: args.duplicate_threshold,
        max_attempts: args.max_attempts,
    };
    let opts = SynthesizeOptions {
        out: args.out.clone(),
        conversations,
        requests,
        answers,
        max_tokens: args.max_tokens,
        template_kwargs: kwargs,
        batch: 1,
        progress: match std::io::stderr().is_terminal() {
            true => ShowProgress::Bar,
            false => ShowProgress::Lines(Duration::from_secs(10)),
        },
    };
    let (device, kind) = super::compute_device(config, args.device, args.dtype)?;
    let source = TargetSource::from_arg(&args.model);
    if let TargetSource::Preset(p) = &source
        && let Some(warning) = p.random_weights_warning()
    {
        tracing::warn!("--model {warning}");
    }
    let target = source.build_target(&[0], Depth::Full, device, kind)?;
    // A row holds the template's markup (a system prompt among it), a request and its answer.
    let row_positions = args.max_request_tokens + args.max_tokens + 256;
    let batch = args.batch.unwrap_or_else(|| default_batch(&target, row_positions)).max(1);
    let opts = SynthesizeOptions { batch, ..opts };
    let report = dflash::panic::catch_torch(|| synthesize(&target, &assets, &opts))??;
    println!("{}", summary(&report));
    Ok(if report.conversations < report.count { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// The summary line and what follows it.
pub fn summary(r: &SynthesizeReport) -> String {
    let rejected: u64 = r.rejected.values().sum();
    let tokens = r.request_tokens + r.answer_tokens;
    let mut s = format!(
        "{} of {} conversations ({} now, {} already done) from {} attempts this run; rejected {rejected}",
        r.conversations,
        r.count,
        r.conversations - r.already_done.min(r.conversations),
        r.already_done,
        r.attempts
    );
    if rejected > 0 {
        let reasons: Vec<String> = r.rejected.iter().map(|(why, n)| format!("{why} {n}")).collect();
        s.push_str(&format!(" ({})", reasons.join(", ")));
    }
    let dropped: u64 = r.follow_ups_dropped.values().sum();
    if dropped > 0 {
        let reasons: Vec<String> = r.follow_ups_dropped.iter().map(|(why, n)| format!("{why} {n}")).collect();
        s.push_str(&format!("; {dropped} later turns not kept ({})", reasons.join(", ")));
    }
    s.push_str(&format!("; {} answers cut at --max-tokens", r.answers_cut));
    if tokens > 0 {
        let seconds = r.seconds.max(1e-9);
        s.push_str(&format!(
            "; {tokens} tokens ({} of requests, {} of answers) in {:.1} s: {:.0} tokens/s, {:.1} conversations/s",
            r.request_tokens,
            r.answer_tokens,
            r.seconds,
            tokens as f64 / seconds,
            (r.conversations - r.already_done.min(r.conversations)) as f64 / seconds
        ));
    }
    let sp = &r.spread;
    if sp.requests > 0 {
        let common: Vec<String> = (sp.most_common.iter())
            .map(|(w, n)| format!("{w} {:.0}%", 100.0 * *n as f64 / sp.requests as f64))
            .collect();
        s.push_str(&format!(
            "\n  spread: {} distinct first words in {} requests; most common: {}",
            sp.distinct_first_words,
            sp.requests,
            common.join(", ")
        ));
        if sp.top_share() >= 0.5 {
            s.push_str(
                "\n  the requests are narrow (half or more open with one word): raise --request-temperature, or give \
                 --topics or --system-prompts to spread them",
            );
        }
    }
    let generation = r.generation.summary();
    if !generation.is_empty() {
        s.push_str(&format!("\n  generation: {generation}"));
    }
    if rejected > 0 {
        s.push_str(&format!("\n  rejected attempts, with their reasons: {}", r.rejected_file.display()));
    }
    if r.conversations < r.count {
        s.push_str(
            "\n  short of --count: the attempts ran out (--max-attempts); most were rejected as above. Run the same \
             command with a higher --max-attempts to continue, or loosen what rejects them",
        );
    }
    s
}
