//! `dflash prepare`, `dflash inspect` and `dflash sample-data`: arguments and printing; the work is in
//! `dflash::data`.
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Map, Value};

use dflash::data::SampleId;
use dflash::data::builtin::sample_conversations;
use dflash::data::prepare::{LongConversations, ModelAssets, PrepareOptions, PrepareOutcome, prepare};
use dflash::data::prompts::prompt_end;
use dflash::data::shards::{Manifest, PreparedSplit};

/// Parses `--template-kwargs` (a JSON object).
pub fn template_kwargs(raw: Option<&str>) -> Result<Map<String, Value>> {
    match raw {
        None => Ok(Map::new()),
        Some(text) => match serde_json::from_str(text) {
            Ok(Value::Object(map)) => Ok(map),
            _ => bail!("--template-kwargs {text:?}: expected a JSON object, e.g. '{{\"enable_thinking\": false}}'"),
        },
    }
}

/// `prepare --long`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Long {
    Truncate,
    Split,
}

#[derive(Args)]
pub struct PrepareArgs {
    /// The target's HuggingFace folder (its tokenizer.json and tokenizer_config.json chat template), or `tiny`.
    #[arg(long, value_name = "DIR|tiny")]
    model: String,
    /// Chat JSONL: one conversation a line, `{"id"?, "messages": [...]}` (OpenAI) or `{"id"?, "conversations":
    /// [{"from", "value"}]}` (ShareGPT). Repeatable; ids default to the line's 0-based number across the inputs.
    #[arg(long = "input", value_name = "FILE", required = true)]
    inputs: Vec<PathBuf>,
    /// The output folder (written atomically: it appears only when finished).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The most tokens a sample has: longer conversations are truncated or split (--long). A sample is trained whole,
    /// so this is the context the drafter learns to use.
    #[arg(long, value_name = "L")]
    max_len: usize,
    /// What becomes of a conversation longer than --max-len: `truncate` keeps its first L tokens; `split` cuts it
    /// into pieces of L tokens (the last shorter), each a sample (`"{id}#{n}"` after the first) in its conversation's
    /// split. Token rows longer than L are refused unless split.
    #[arg(long, value_enum, default_value = "truncate")]
    long: Long,
    /// The drafter's block size: samples with fewer than 2 x block_size supervised tokens are dropped.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Fraction of samples kept apart as the `holdout` split (chosen by a hash of seed and id).
    #[arg(long, default_value_t = 0.0, value_name = "FRAC")]
    holdout: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Variables for the chat template, as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON")]
    template_kwargs: Option<String>,
    /// Stop at the first bad line instead of skipping and counting it.
    #[arg(long)]
    strict: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Replace a folder prepared before from other inputs or settings (refused otherwise: a run training on it
    /// would find its rows changed under it). Prepare into a new folder to keep a run's data as it began.
    #[arg(long)]
    force: bool,
}

pub fn run_prepare(args: PrepareArgs) -> Result<ExitCode> {
    if !(0.0..1.0).contains(&args.holdout) {
        bail!("--holdout {}: expected a fraction in [0, 1)", args.holdout);
    }
    if args.max_len < 2 * args.block_size {
        bail!("--max-len {} cannot hold 2 x --block-size {} supervised tokens", args.max_len, args.block_size);
    }
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("--threads")?;
    }
    let kwargs = template_kwargs(args.template_kwargs.as_deref())?;
    let assets = ModelAssets::resolve(&args.model, &kwargs)?;
    let opts = PrepareOptions {
        inputs: args.inputs,
        out: args.out.clone(),
        max_len: args.max_len,
        long: match args.long {
            Long::Truncate => LongConversations::Truncate,
            Long::Split => LongConversations::Split,
        },
        block_size: args.block_size,
        holdout: args.holdout,
        seed: args.seed,
        template_kwargs: kwargs,
        strict: args.strict,
        progress: std::io::stderr().is_terminal(),
        force: args.force,
    };
    let (manifest, fresh) = match prepare(&assets, &opts)? {
        PrepareOutcome::UpToDate(m) => (m, false),
        PrepareOutcome::Written(m) => (m, true),
    };
    if manifest.report.kept_train + manifest.report.kept_holdout == 0 {
        // Nothing to train on: no folder is left behind that a rerun would take as done.
        if args.json {
            println!("{}", serde_json::json!({"written": false, "out": args.out, "report": manifest.report}));
        } else {
            println!("{}", manifest.report.summary());
        }
        let written = args.out.join("manifest.json");
        std::fs::remove_file(&written).with_context(|| format!("removing {}", written.display()))?;
        let _ = std::fs::remove_dir(&args.out); // only if nothing else is there
        bail!("no sample was kept, so nothing was written to {}; see the report above", args.out.display());
    }
    if args.json {
        println!("{}", serde_json::json!({"written": fresh, "out": args.out, "report": manifest.report}));
    } else if fresh {
        println!("{}\nwrote {}", manifest.report.summary(), args.out.display());
    } else {
        println!("{} is up to date with these inputs and settings; nothing to do", args.out.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct InspectArgs {
    /// A folder written by `dflash prepare`.
    dir: PathBuf,
    /// Which split.
    #[arg(long, default_value = "train")]
    split: String,
    /// Show the sample with this id (as the data gave it: `--id 17` or `--id QWJhYvA_0`).
    #[arg(long)]
    id: Option<String>,
    /// Show at most this many samples, from the start of the split (default: 3 as text; with --json every one).
    #[arg(long)]
    limit: Option<usize>,
    /// Print `{"id", "input_ids", "loss_mask"}` lines (the input `dflash eval --data` reads) instead of text.
    #[arg(long)]
    json: bool,
    /// With --json: each sample's prompt only, `{"id", "input_ids"}` cut before its first reply (its first
    /// supervised token), as the in-training evaluation cuts held-out rows: what `eval --decode --prompts` decodes
    /// from, so that the target answers anew rather than continuing past its own answer. Samples without a prompt
    /// before a reply are left out.
    #[arg(long, requires = "json")]
    prompts: bool,
    /// Decode with this model's tokenizer (default: the one the folder was prepared with).
    #[arg(long, value_name = "DIR|tiny")]
    model: Option<String>,
    /// Check every file's checksum first.
    #[arg(long)]
    verify: bool,
}

/// How many samples `inspect` shows: `--limit`, else a few to read or, as JSON (an evaluation set), the whole split.
fn shown(limit: Option<usize>, json: bool) -> usize {
    limit.unwrap_or(if json { usize::MAX } else { 3 })
}

pub fn run_inspect(args: InspectArgs) -> Result<ExitCode> {
    let split = PreparedSplit::open(&args.dir, &args.split, args.verify)?;
    let positions: Vec<usize> = match args.id {
        Some(id) => {
            let position = split.position_of(&SampleId::parse(&id));
            vec![position.with_context(|| format!("no sample with id {id} in the {} split", args.split))?]
        }
        None => (0..split.len().min(shown(args.limit, args.json))).collect(),
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        for &i in &positions {
            let s = split.get(i);
            let line = match (args.prompts, prompt_end(s.loss_mask)) {
                (false, _) => serde_json::json!({"id": s.id, "input_ids": s.input_ids(), "loss_mask": s.loss_mask}),
                (true, Some(cut)) => serde_json::json!({"id": s.id, "input_ids": &s.input_ids()[..cut]}),
                (true, None) => continue,
            };
            writeln!(out, "{line}")?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let manifest = Manifest::read(&args.dir)?;
    let model = args.model.unwrap_or(manifest.model);
    let assets = ModelAssets::resolve(&model, &Map::new())
        .with_context(|| format!("loading the tokenizer of {model} to decode (pass --model, or use --json)"))?;
    let color = std::io::stdout().is_terminal();
    for &i in &positions {
        let s = split.get(i);
        let ids: Vec<u32> = s.input_ids().iter().map(|&t| t as u32).collect();
        let supervised = s.loss_mask.iter().filter(|&&m| m == 1).count();
        writeln!(out, "── id {} · {} tokens · {} supervised", s.id, s.len(), supervised)?;
        let mut start = 0;
        while start < ids.len() {
            let on = s.loss_mask[start];
            let end = (start..ids.len()).find(|&j| s.loss_mask[j] != on).unwrap_or(ids.len());
            let text = assets.tokenizer.decode(&ids[start..end]).map_err(anyhow::Error::msg)?;
            match (on == 1, color) {
                (true, true) => write!(out, "\x1b[1;32m{text}\x1b[0m")?,
                (true, false) => write!(out, "⟦{text}⟧")?,
                (false, _) => write!(out, "{text}")?,
            }
            start = end;
        }
        writeln!(out)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct SampleDataArgs {
    /// Where to write the conversations (JSONL, OpenAI `messages` form).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    #[arg(long, default_value_t = 2000)]
    count: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run_sample_data(args: SampleDataArgs) -> Result<ExitCode> {
    let mut text = String::new();
    for conv in sample_conversations(args.count, args.seed) {
        text.push_str(&conv.to_string());
        text.push('\n');
    }
    std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {} conversations to {}", args.count, args.out.display());
    Ok(ExitCode::SUCCESS)
}
