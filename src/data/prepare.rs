//! `dflash prepare`: chat JSONL -> token ids and loss masks in memory-mappable shards. Token-row JSONL (rows
//! `{"id"?, "input_ids", "loss_mask"}` another pipeline tokenized) takes the same way, checked against the target
//! instead of tokenized: `serve-train` trains from such a file through a prepared copy of it.
//!
//! Lines are read in chunks and processed in parallel (render, tokenize, mask, truncate), then written in input
//! order. Everything goes into a hidden temporary folder beside the output, which is renamed into place after the
//! manifest is written and synced: an interrupted run leaves no output, and a rerun starts clean. A run whose inputs,
//! tokenizer, template and settings match an existing output's fingerprint does nothing.
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rayon::prelude::*;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::DataError;
use super::chat::{ChatError, ChatTemplate, Conversation};
use super::sample::{Sample, build_sample_timed};
use super::sample_id::FirstUse;
use super::shards::{
    FORMAT, InputEntry, Manifest, PrepareReport, SplitEntry, SplitWriter, file_sha256, hex, manifest_path,
};
use super::token_rows::parse_row;
use super::tokenize::TextTokenizer;

/// Lines processed together (in parallel) before being written.
const CHUNK_LINES: usize = 4096;
/// Bad lines quoted in the report (all are counted).
const QUOTED_ERRORS: usize = 10;

/// The tokenizer and chat template a dataset is prepared with, and what identifies them.
pub struct ModelAssets {
    pub template: ChatTemplate,
    pub tokenizer: TextTokenizer,
    /// The hash of the tokenizer and template ([`ModelAssets::identity_of`]): part of the fingerprint, and what a run
    /// compares with its target's ([`Manifest::tokenizer`]).
    pub identity: String,
    /// What to call them in reports (`tiny` or the folder).
    pub name: String,
}

impl ModelAssets {
    /// A model folder's `tokenizer.json` and `tokenizer_config.json`.
    pub fn from_dir(dir: &Path, template_kwargs: &Map<String, Value>) -> Result<Self, DataError> {
        let bad = |reason: String| DataError::File { path: dir.to_path_buf(), reason };
        let tokenizer = TextTokenizer::from_dir(dir).map_err(bad)?;
        let template = ChatTemplate::from_dir(dir, template_kwargs).map_err(bad)?;
        let identity = Self::identity_of(&tokenizer, &template).map_err(bad)?;
        Ok(ModelAssets { template, tokenizer, identity, name: dir.display().to_string() })
    }

    /// The hash of what tokenizes and renders: the tokenizer's definition, the template's source and its special
    /// tokens. The same tokenizer and template hash the same wherever they come from (a model folder, however its
    /// files are formatted, or the built-in ones).
    pub fn identity_of(tokenizer: &TextTokenizer, template: &ChatTemplate) -> Result<String, String> {
        let mut h = Sha256::new();
        h.update(tokenizer.definition()?);
        h.update(template.identity());
        Ok(hex(&h.finalize()))
    }
}

impl ModelAssets {
    /// Where a generated turn ends: the target's end-of-sequence ids `eos` and the end-of-turn tokens the vocabulary
    /// has.
    pub fn stop_tokens(&self, eos: &[i64]) -> Vec<i64> {
        let mut stop = eos.to_vec();
        for marker in ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>"] {
            if let Some(id) = self.tokenizer.token_id(marker) {
                stop.push(id as i64);
            }
        }
        stop.sort_unstable();
        stop.dedup();
        stop
    }
}

#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub inputs: Vec<PathBuf>,
    pub out: PathBuf,
    pub max_len: usize,
    /// What becomes of a conversation longer than `max_len`.
    pub long: LongConversations,
    pub block_size: usize,
    /// Fraction of samples kept apart for evaluation (by a hash of seed and id: stable across runs).
    pub holdout: f64,
    pub seed: u64,
    pub template_kwargs: Map<String, Value>,
    /// Stop at the first bad line instead of skipping it.
    pub strict: bool,
    pub progress: bool,
    /// Replace a prepared folder at `out` that holds other data (otherwise refused: a run may be training on it).
    pub force: bool,
}

/// What `prepare` does with a conversation longer than `max_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LongConversations {
    /// Keep its first `max_len` tokens.
    #[default]
    Truncate,
    /// Cut it into pieces of `max_len` tokens (the last one shorter), each a sample of its own: piece `n` after the
    /// first is `"{id}#{n}"`, and every piece goes to the split its conversation's id draws.
    Split,
}

/// What the input lines are.
#[derive(Clone, Copy)]
pub enum Lines<'a> {
    /// Conversations, rendered with the model's chat template and tokenized.
    Conversations(&'a ModelAssets),
    /// Token rows, checked against a target's vocabulary; a row longer than `max_len` is a bad line (not cut).
    TokenRows { vocab_size: usize },
}

impl Lines<'_> {
    /// The tokenizer and template conversations were rendered with, as the manifest records it.
    fn tokenizer(&self) -> Option<String> {
        match self {
            Lines::Conversations(assets) => Some(assets.identity.clone()),
            Lines::TokenRows { .. } => None,
        }
    }

    /// What identifies the tokenization (part of the fingerprint), and what to call it in the manifest.
    fn identity(&self) -> (String, String) {
        match self {
            Lines::Conversations(assets) => (assets.identity.clone(), assets.name.clone()),
            Lines::TokenRows { vocab_size } => {
                (format!("token-rows:{vocab_size}"), format!("token rows (a vocabulary of {vocab_size})"))
            }
        }
    }
}

/// Whether the run wrote a new output.
pub enum PrepareOutcome {
    UpToDate(Manifest),
    Written(Manifest),
}

enum LineResult {
    /// The samples of one line (several when it was split), whether they are held out, and whether it was cut.
    Kept {
        samples: Vec<Sample>,
        holdout: bool,
        cut: bool,
        dropped: usize,
    },
    Dropped(&'static str),
    Bad(&'static str, String),
    Blank,
}

fn kind_of(e: &ChatError) -> &'static str {
    match e {
        ChatError::Json(_) => "malformed JSON",
        ChatError::Shape(_) => "unexpected shape",
        ChatError::UnknownRole(_) => "unknown role",
        ChatError::Empty => "empty conversation",
        ChatError::NoAssistant => "no assistant turn",
        ChatError::Template(_) => "template or tokenizer failed",
        ChatError::Unlocated(_) => "assistant turn not located",
    }
}

/// A stable draw in [0, 1) from (seed, id).
fn unit_hash(seed: u64, id: u64) -> f64 {
    let mut z = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Nanoseconds spent in the two phases, summed over threads.
#[derive(Default)]
struct PhaseClock {
    render: AtomicU64,
    tokenize: AtomicU64,
}

fn process_line(lines: Lines, opts: &PrepareOptions, line: &str, ordinal: u64, clock: &PhaseClock) -> LineResult {
    if line.trim().is_empty() {
        return LineResult::Blank;
    }
    let mut sample = match lines {
        Lines::Conversations(assets) => match conversation_sample(assets, line, ordinal, clock) {
            Ok(s) => s,
            Err(e) => return LineResult::Bad(kind_of(&e), e.to_string()),
        },
        Lines::TokenRows { vocab_size } => match token_row_sample(vocab_size, opts, line, ordinal) {
            Ok(s) => s,
            Err(e) => return LineResult::Bad("bad token row", e),
        },
    };
    let cut = sample.input_ids.len() > opts.max_len;
    let holdout = opts.holdout > 0.0 && unit_hash(opts.seed, sample.id.key()) < opts.holdout;
    let pieces = match opts.long {
        LongConversations::Truncate => {
            sample.input_ids.truncate(opts.max_len);
            sample.loss_mask.truncate(opts.max_len);
            vec![sample]
        }
        LongConversations::Split => split(sample, opts.max_len),
    };
    let total = pieces.len();
    let samples: Vec<Sample> = pieces.into_iter().filter(|s| s.supervised() >= 2 * opts.block_size).collect();
    if samples.is_empty() {
        return LineResult::Dropped(TOO_FEW_SUPERVISED);
    }
    LineResult::Kept { dropped: total - samples.len(), samples, holdout, cut }
}

/// Why a sample is dropped when it teaches too little.
const TOO_FEW_SUPERVISED: &str = "fewer than 2 x block_size supervised tokens";

/// `sample` as pieces of at most `max_len` tokens, in order ([`LongConversations::Split`]).
fn split(sample: Sample, max_len: usize) -> Vec<Sample> {
    let Sample { id, input_ids, loss_mask } = sample;
    input_ids
        .chunks(max_len.max(1))
        .zip(loss_mask.chunks(max_len.max(1)))
        .enumerate()
        .map(|(n, (ids, mask))| Sample { id: id.piece(n), input_ids: ids.to_vec(), loss_mask: mask.to_vec() })
        .collect()
}

/// A token row; one longer than `max_len` is refused unless rows are split.
fn token_row_sample(vocab_size: usize, opts: &PrepareOptions, line: &str, ordinal: u64) -> Result<Sample, String> {
    let row = parse_row(line, ordinal, vocab_size)?;
    let max_len = opts.max_len;
    if row.input_ids.len() > max_len && opts.long == LongConversations::Truncate {
        return Err(format!(
            "{} tokens, more than the target's {max_len} positions; cut the row to {max_len} tokens",
            row.input_ids.len()
        ));
    }
    Ok(Sample { id: row.id, input_ids: row.input_ids.iter().map(|&t| t as u32).collect(), loss_mask: row.loss_mask })
}

fn conversation_sample(
    assets: &ModelAssets,
    line: &str,
    ordinal: u64,
    clock: &PhaseClock,
) -> Result<Sample, ChatError> {
    let conv = Conversation::from_json_line(line, ordinal)?;
    let (sample, [render, tokenize]) = build_sample_timed(&assets.template, &assets.tokenizer, &conv)?;
    clock.render.fetch_add(render.as_nanos() as u64, Ordering::Relaxed);
    clock.tokenize.fetch_add(tokenize.as_nanos() as u64, Ordering::Relaxed);
    Ok(sample)
}

/// How a prepared folder's manifest differs from a preparation of `model`, `settings` and `inputs`: "from other
/// inputs (...)", "with other settings (...)", "with another model's tokenizer (...)", or "by an earlier dflash".
fn what_differs(existing: &Manifest, model: &str, settings: &Value, inputs: &[InputEntry]) -> String {
    let mut why = Vec::new();
    if existing.model != model {
        why.push(format!("with the tokenizer of {} (this run: {model})", existing.model));
    }
    let theirs: Vec<(&str, &str)> = existing.inputs.iter().map(|i| (i.path.as_str(), i.sha256.as_str())).collect();
    let ours: Vec<(&str, &str)> = inputs.iter().map(|i| (i.path.as_str(), i.sha256.as_str())).collect();
    if theirs != ours {
        let names: Vec<&str> = existing.inputs.iter().map(|i| i.path.as_str()).collect();
        why.push(format!("from other inputs or other contents ({})", names.join(", ")));
    }
    if let (Some(a), Some(b)) = (existing.settings.as_object(), settings.as_object()) {
        let changed: Vec<String> = (a.keys().chain(b.keys()))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .map(|k| format!("{k} {} there, {} now", show(a.get(k)), show(b.get(k))))
            .collect();
        if !changed.is_empty() {
            why.push(format!("with other settings ({})", changed.join("; ")));
        }
    }
    match why.is_empty() {
        true => "by another build of dflash (its fingerprint differs)".into(),
        false => why.join(", and "),
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or("(unset)".into(), Value::to_string)
}

/// Prepares the conversations of `opts.inputs` with `assets` into `opts.out`.
pub fn prepare(assets: &ModelAssets, opts: &PrepareOptions) -> Result<PrepareOutcome, DataError> {
    prepare_lines(Lines::Conversations(assets), opts)
}

/// Prepares `opts.inputs`, lines of the given kind, into `opts.out`.
pub fn prepare_lines(lines: Lines, opts: &PrepareOptions) -> Result<PrepareOutcome, DataError> {
    let (identity, model) = lines.identity();
    let started = Instant::now();
    let mut settings = serde_json::json!({
        "max_len": opts.max_len,
        "block_size": opts.block_size,
        "holdout": opts.holdout,
        "seed": opts.seed,
        "template_kwargs": opts.template_kwargs,
        "strict": opts.strict,
    });
    // Written only when splitting, so folders prepared before the choice existed stay up to date.
    if opts.long == LongConversations::Split {
        settings["long"] = "split".into();
    }
    let mut inputs = Vec::new();
    let mut h = Sha256::new();
    h.update(FORMAT);
    h.update(&identity);
    h.update(settings.to_string());
    for path in &opts.inputs {
        let meta = std::fs::metadata(path).map_err(|err| DataError::Io { path: path.clone(), err })?;
        let sha = file_sha256(path)?;
        h.update(&sha);
        inputs.push(InputEntry { path: path.display().to_string(), bytes: meta.len(), sha256: sha });
    }
    let fingerprint = hex(&h.finalize());
    if let Ok(existing) = Manifest::read(&opts.out)
        && existing.fingerprint == fingerprint
        && super::shards::PreparedSplit::open(&opts.out, "train", false).is_ok()
    {
        return Ok(PrepareOutcome::UpToDate(existing));
    }
    if opts.out.exists() && !manifest_path(&opts.out).exists() {
        return Err(DataError::File {
            path: opts.out.clone(),
            reason: "exists and is not a prepared folder; choose another --out or remove it".into(),
        });
    }
    if let Ok(existing) = Manifest::read(&opts.out)
        && existing.fingerprint != fingerprint
        && !opts.force
    {
        return Err(DataError::File {
            path: opts.out.clone(),
            reason: format!(
                "already holds data prepared {}: replacing it would change the rows under a run training on it \
                 (rows it trained on could become held-out rows). Prepare into another --out, or pass --force to \
                 replace it",
                what_differs(&existing, &model, &settings, &inputs)
            ),
        });
    }
    let parent = opts.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|err| DataError::Io { path: parent.to_path_buf(), err })?;
    let name = opts.out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // This call's own staging folder: two processes (or threads) preparing the same folder at once, as two runs
    // starting on the built-in data do, must not write into or delete each other's. Folders that processes no longer
    // running left are removed.
    remove_abandoned_partials(parent, &name);
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(".{name}.partial-{}-{call}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|err| DataError::Io { path: tmp.clone(), err })?;
    }
    std::fs::create_dir_all(&tmp).map_err(|err| DataError::Io { path: tmp.clone(), err })?;
    let result = write_all(lines, opts, &tmp, started).and_then(|(splits, report)| {
        let tokenizer = lines.tokenizer();
        let manifest =
            Manifest { format: FORMAT.to_string(), fingerprint, model, tokenizer, settings, inputs, splits, report };
        let path = manifest_path(&tmp);
        let text = serde_json::to_string_pretty(&manifest).expect("json");
        std::fs::write(&path, text).map_err(|err| DataError::Io { path: path.clone(), err })?;
        std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|err| DataError::Io { path, err })?;
        Ok(manifest)
    });
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // Another process prepared the same data meanwhile: its folder stands (it may be reading it already). Checked
    // again when the move fails, as it does when the other process moved its folder in between check and move.
    let same_data_stands = || {
        Manifest::read(&opts.out)
            .ok()
            .filter(|existing| existing.fingerprint == manifest.fingerprint)
            .filter(|_| super::shards::PreparedSplit::open(&opts.out, "train", false).is_ok())
    };
    if let Some(existing) = same_data_stands() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(PrepareOutcome::UpToDate(existing));
    }
    match commit_folder(&tmp, &opts.out) {
        Ok(()) => Ok(PrepareOutcome::Written(manifest)),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            same_data_stands().map(PrepareOutcome::UpToDate).ok_or(e)
        }
    }
}

/// Removes `parent/.{name}.partial-<pid>-<call>` folders of processes that no longer run (a prepare that was
/// killed), and `.{name}.partial`, the one staging folder of earlier builds.
fn remove_abandoned_partials(parent: &Path, name: &str) {
    let _ = std::fs::remove_dir_all(parent.join(format!(".{name}.partial")));
    let prefix = format!(".{name}.partial-");
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let pid = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Moves the finished `tmp` folder to `out`, replacing an older output, and syncs the parent folder.
pub(crate) fn commit_folder(tmp: &Path, out: &Path) -> Result<(), DataError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |err| DataError::Io { path, err }
    };
    let mut old = tmp.as_os_str().to_owned();
    old.push(".old");
    let old = std::path::PathBuf::from(old);
    if out.exists() {
        std::fs::rename(out, &old).map_err(io(out))?;
    }
    if let Err(err) = std::fs::rename(tmp, out) {
        // Another process moved its folder in meanwhile: the older output goes back where it was if that is free,
        // and is removed if not, so no moved-aside folder is left behind.
        if old.exists() && std::fs::rename(&old, out).is_err() {
            let _ = std::fs::remove_dir_all(&old);
        }
        return Err(io(out)(err));
    }
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::File::open(parent).and_then(|f| f.sync_all()).map_err(io(parent))?;
    }
    Ok(())
}

fn write_all(
    lines_of: Lines,
    opts: &PrepareOptions,
    dir: &Path,
    started: Instant,
) -> Result<(BTreeMap<String, SplitEntry>, PrepareReport), DataError> {
    let total_lines: u64 = opts.inputs.iter().map(|p| count_lines(p)).sum::<Result<u64, _>>()?;
    let bar = if opts.progress {
        let bar = indicatif::ProgressBar::new(total_lines);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} preparing [{elapsed_precise}] {wide_bar} {pos}/{len} conversations ({per_sec}, eta {eta})",
            )
            .expect("valid template"),
        );
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut train = SplitWriter::new(dir, "train");
    let mut holdout = SplitWriter::new(dir, "holdout");
    let mut report = PrepareReport::default();
    let mut seen_ids = FirstUse::default();
    let clock = PhaseClock::default();
    let mut ordinal = 0u64;
    for path in &opts.inputs {
        let file = std::fs::File::open(path).map_err(|err| DataError::Io { path: path.clone(), err })?;
        let mut lines = std::io::BufReader::with_capacity(1 << 20, file).lines().enumerate();
        loop {
            let mut chunk: Vec<(usize, u64, String)> = Vec::with_capacity(CHUNK_LINES);
            for (n, line) in lines.by_ref().take(CHUNK_LINES) {
                let line = line.map_err(|err| DataError::Io { path: path.clone(), err })?;
                chunk.push((n + 1, ordinal, line));
                ordinal += 1;
            }
            if chunk.is_empty() {
                break;
            }
            let results: Vec<LineResult> =
                chunk.par_iter().map(|(_, ord, line)| process_line(lines_of, opts, line, *ord, &clock)).collect();
            for ((line_no, _, _), result) in chunk.iter().zip(results) {
                bar.inc(1);
                let mut bad = |kind: &'static str, message: String| -> Result<(), DataError> {
                    if opts.strict {
                        return Err(DataError::Line { path: path.clone(), line: *line_no, reason: message });
                    }
                    *report.bad_lines.entry(kind.to_string()).or_insert(0) += 1;
                    if report.examples.len() < QUOTED_ERRORS {
                        report.examples.push(format!("{}:{line_no}: {message}", path.display()));
                    }
                    Ok(())
                };
                match result {
                    LineResult::Blank => {
                        report.blank += 1;
                        continue;
                    }
                    LineResult::Bad(kind, message) => bad(kind, message)?,
                    LineResult::Dropped(reason) => *report.dropped.entry(reason.to_string()).or_insert(0) += 1,
                    LineResult::Kept { samples, holdout: to_holdout, cut, dropped } => {
                        let here = || format!("{}:{line_no}", path.display());
                        if let Some(repeated) = samples.iter().find_map(|s| seen_ids.record(&s.id, here).err()) {
                            bad("duplicate id", repeated)?;
                            report.lines += 1;
                            continue;
                        }
                        report.kept_lines += 1;
                        match (cut, opts.long) {
                            (false, _) => {}
                            (true, LongConversations::Truncate) => report.truncated += 1,
                            (true, LongConversations::Split) => report.split += 1,
                        }
                        if dropped > 0 {
                            *report.dropped.entry(format!("pieces with {TOO_FEW_SUPERVISED}")).or_insert(0) +=
                                dropped as u64;
                        }
                        for sample in &samples {
                            report.tokens += sample.input_ids.len() as u64;
                            report.supervised_tokens += sample.supervised() as u64;
                            if to_holdout {
                                report.kept_holdout += 1;
                                holdout.push(sample)?;
                            } else {
                                report.kept_train += 1;
                                train.push(sample)?;
                            }
                        }
                    }
                }
                report.lines += 1;
            }
        }
    }
    bar.finish_and_clear();
    let mut splits = BTreeMap::new();
    splits.insert("train".to_string(), train.finish()?);
    splits.insert("holdout".to_string(), holdout.finish()?);
    report.seconds = started.elapsed().as_secs_f64();
    report.conversations_per_s = report.lines as f64 / report.seconds.max(1e-9);
    report.tokens_per_s = report.tokens as f64 / report.seconds.max(1e-9);
    report.render_thread_s = clock.render.load(Ordering::Relaxed) as f64 * 1e-9;
    report.tokenize_thread_s = clock.tokenize.load(Ordering::Relaxed) as f64 * 1e-9;
    Ok((splits, report))
}

fn count_lines(path: &Path) -> Result<u64, DataError> {
    let file = std::fs::File::open(path).map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
    let mut n = 0;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    loop {
        let buf = reader.fill_buf().map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
        if buf.is_empty() {
            break;
        }
        n += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        let len = buf.len();
        reader.consume(len);
    }
    Ok(n)
}
