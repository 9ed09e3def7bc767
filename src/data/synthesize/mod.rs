//! `dflash synthesize`: conversations written by the target alone, from its model folder. Opened at a user turn
//! (Magpie, Xu et al. 2024: the chat template up to where a user's message starts), an aligned model writes a
//! plausible request; it then answers it as it answers users (greedy by default, as the drafter serves greedy
//! decoding), and for conversations of several turns writes the next request after its answer. The drafter so
//! learns from data in the target's own distribution, at whatever scale the GPU allows, with no corpus to bring.
//!
//! What is kept is decided by [`plan`] (checks on each request, exact and near duplicates judged in attempt order);
//! this module runs it: the target generates on the calling thread, many sequences at once ([`BatchGenerator`]),
//! each drawing its own way (sampled requests beside greedy answers), while a second thread renders, tokenizes and
//! decodes, feeds the plan and writes. Kept conversations are appended to the output (the chat JSONL `prepare`
//! reads, each line with its seed and settings under `synthesis`), rejected attempts with their reason to
//! `<out>.rejected.jsonl`, one flushed line each: a rerun after a kill reads both back and continues, generating no
//! attempt twice; a rerun with other settings is refused. When a run ends both files are put in attempt order and
//! the output holds exactly the first `count` conversations accepted, so the same seed and settings give the same
//! file (on a GPU in bf16, up to a batch's rounding at near-ties, as `regenerate --local`).
pub mod near_duplicates;
pub mod plan;
pub mod turn_checks;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::DataError;
use super::SampleId;
use super::prepare::ModelAssets;
use super::settled_lines::{Meter, Others, SettledLines, ShowProgress, read_settled, rewrite_in_order};
use super::shards::hex;
use crate::model::Target;
use crate::model::batched::{BatchGenerator, BatchSettings, GenerationStats, Request};
use crate::model::sampling::Sampling;
use plan::{Earlier, Outcome, Settings, Synthesis, Want};
use turn_checks::Generated;

/// What to synthesize, and how.
#[derive(Debug, Clone)]
pub struct SynthesizeOptions {
    pub out: PathBuf,
    /// What shapes the conversations and which are kept.
    pub conversations: Settings,
    /// How requests are drawn (sampled: greedy would write one request).
    pub requests: Sampling,
    /// How answers are drawn.
    pub answers: Sampling,
    /// Most tokens of an answer (an answer cut there is kept and counted).
    pub max_tokens: usize,
    pub template_kwargs: Map<String, Value>,
    /// Sequences generated at once.
    pub batch: usize,
    pub progress: ShowProgress,
}

/// The first words of the kept requests: a collapsed run (one opening everywhere) shows here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spread {
    pub requests: u64,
    pub distinct_first_words: u64,
    /// The most common first words with their counts, most common first.
    pub most_common: Vec<(String, u64)>,
}

impl Spread {
    fn of(first_words: &[&str]) -> Spread {
        let mut counts: HashMap<&str, u64> = HashMap::new();
        for w in first_words {
            *counts.entry(w).or_default() += 1;
        }
        let mut most: Vec<(String, u64)> = counts.iter().map(|(w, n)| (w.to_string(), *n)).collect();
        most.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        most.truncate(5);
        Spread { requests: first_words.len() as u64, distinct_first_words: counts.len() as u64, most_common: most }
    }

    /// The share of requests that open with the most common word.
    pub fn top_share(&self) -> f64 {
        self.most_common.first().map_or(0.0, |(_, n)| *n as f64 / self.requests.max(1) as f64)
    }
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct SynthesizeReport {
    pub count: u64,
    /// Conversations in the output now.
    pub conversations: u64,
    /// Of those, written by earlier runs.
    pub already_done: u64,
    pub attempts: u64,
    pub rejected: BTreeMap<&'static str, u64>,
    pub follow_ups_dropped: BTreeMap<&'static str, u64>,
    pub answers_cut: u64,
    pub request_tokens: u64,
    pub answer_tokens: u64,
    pub seconds: f64,
    pub spread: Spread,
    pub rejected_file: PathBuf,
    /// Where the generator's time went.
    pub generation: GenerationStats,
}

/// Where the rejected attempts of an output go: `<stem>.rejected.jsonl` beside it.
pub fn rejected_path(out: &Path) -> PathBuf {
    let stem = out.file_stem().map_or("out".into(), |s| s.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.rejected.jsonl"))
}

impl SynthesizeOptions {
    /// The settings every output line carries: a rerun must use the same ones to continue a file.
    fn described(&self, assets: &ModelAssets) -> Value {
        let c = &self.conversations;
        let sampling = |s: Sampling| match s {
            Sampling::Greedy => json!({"temperature": 0.0}),
            Sampling::Sample { temperature, top_p } => json!({"temperature": temperature, "top_p": top_p}),
        };
        let digest = |items: &[String]| -> Value {
            if items.is_empty() { Value::Null } else { json!(hex(&Sha256::digest(items.join("\n").as_bytes()))[..16]) }
        };
        json!({
            "seed": c.seed,
            "requests": sampling(self.requests),
            "answers": sampling(self.answers),
            "max_tokens": self.max_tokens,
            "request_tokens": [c.bounds.min_tokens, c.bounds.max_tokens],
            "turns": [c.turns.0, c.turns.1],
            "system_prompts": digest(&c.system_prompts),
            "system_share": if c.system_prompts.is_empty() { 0.0 } else { c.system_share },
            "topics": digest(&c.topics),
            "duplicate_threshold": c.duplicate_threshold,
            "template_kwargs": self.template_kwargs,
            "tokenizer": assets.identity[..16],
        })
    }
}

/// The attempts earlier runs settled in `out` and its rejected file, checked to be of the same settings.
fn earlier_attempts(out: &Path, rejected: &Path, described: &Value) -> Result<Vec<Earlier>, DataError> {
    let mut earlier = Vec::new();
    let mut other: Option<Value> = None;
    read_settled(out, |line| {
        let Ok(v) = serde_json::from_str::<Value>(line) else { return false };
        let (Some(attempt), Some(messages)) = (v["id"].as_u64(), v["messages"].as_array()) else { return false };
        if other.is_none() && v["synthesis"]["settings"] != *described {
            other = Some(v["synthesis"]["settings"].clone());
        }
        let request = messages.iter().find(|m| m["role"] == "user").and_then(|m| m["content"].as_str());
        earlier.push(Earlier::Accepted { attempt, request: request.unwrap_or_default().to_string() });
        true
    })?;
    if let Some(theirs) = other {
        return Err(DataError::File {
            path: out.to_path_buf(),
            reason: format!(
                "written with other settings ({theirs}) than this run's ({described}): a rerun continues a file only \
                 with the same model, seed and options (--count may change); choose another --out to start anew"
            ),
        });
    }
    read_settled(rejected, |line| {
        let Ok(v) = serde_json::from_str::<Value>(line) else { return false };
        let Some(attempt) = v["id"].as_u64() else { return false };
        let request = v["request"].as_str().unwrap_or_default().to_string();
        earlier.push(Earlier::Rejected { attempt, request, indexed: v["indexed"] == true });
        true
    })?;
    Ok(earlier)
}

/// The target's tokens for one generation, read: its text (without the end of turn), whether it ended at a stop token,
/// and whether a special token came before.
fn read_generation(
    assets: &ModelAssets,
    stop: &[i64],
    special: &HashSet<u32>,
    mut tokens: Vec<i64>,
) -> Result<Generated, String> {
    let count = tokens.len();
    let ended = tokens.last().is_some_and(|t| stop.contains(t));
    if ended {
        tokens.pop();
    }
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    Ok(Generated {
        text: assets.tokenizer.decode(&ids)?,
        tokens: count,
        ended,
        special: ids.iter().any(|t| special.contains(t)),
    })
}

/// The prompt tokens of `want` after `messages`.
fn prompt(assets: &ModelAssets, want: &Want, messages: &[Value]) -> Result<Vec<i64>, String> {
    let text = match want {
        Want::UserTurn => assets.template.user_opening(messages),
        Want::Answer => assets.template.render(messages, None, true),
    }
    .map_err(|e| e.to_string())?;
    Ok(assets.tokenizer.encode(&text)?.ids.iter().map(|&t| t as i64).collect())
}

/// Synthesizes `opts.count` conversations with `target` (see the module documentation).
pub fn synthesize(
    target: &Target,
    assets: &ModelAssets,
    opts: &SynthesizeOptions,
) -> Result<SynthesizeReport, DataError> {
    let fail = |reason: String| DataError::File { path: opts.out.clone(), reason };
    let described = opts.described(assets);
    let rejected_file = rejected_path(&opts.out);
    let earlier = earlier_attempts(&opts.out, &rejected_file, &described)?;
    let earlier_rejected: Vec<u64> = (earlier.iter())
        .filter_map(|e| match e {
            Earlier::Rejected { attempt, .. } => Some(*attempt),
            Earlier::Accepted { .. } => None,
        })
        .collect();
    let count = opts.conversations.count;
    let mut plan = Synthesis::new(opts.conversations.clone(), 2 * opts.batch.max(1), described, earlier);
    let already_done = plan.accepted().min(count);
    let stop = assets.stop_tokens(&target.config().eos_token_ids);
    let special = assets.tokenizer.special_ids();
    let batch = BatchSettings {
        batch: opts.batch.max(1),
        max_new: opts.max_tokens,
        stop: stop.clone(),
        sampling: opts.answers,
        cuda_graphs: true,
    };
    let mut generator = BatchGenerator::new(target, batch).map_err(|e| fail(e.to_string()))?;
    let (requests, received) = std::sync::mpsc::channel::<Request>();
    let mut report =
        SynthesizeReport { count, already_done, rejected_file: rejected_file.clone(), ..Default::default() };
    let mut meter = Meter::new(opts.progress, "synthesizing", count);
    meter.earlier(already_done);
    let (stop, special) = (&stop, &special);
    let (plan_, report_, meter_) = (&mut plan, &mut report, &mut meter);
    let rejected_at = &rejected_file;
    let driven: Result<(), DataError> = std::thread::scope(|scope| {
        // The driver owns the sender: once it returns, the generator finishes what is queued and returns too.
        let driver = scope.spawn(move || -> Result<(), DataError> {
            let (plan, report, meter) = (plan_, report_, meter_);
            let mut out = SettledLines::open(&opts.out)?;
            let mut rejects = SettledLines::open(rejected_at)?;
            let mut pending = FuturesUnordered::new();
            let mut asks = plan.launch();
            loop {
                for ask in asks.drain(..) {
                    let tokens = prompt(assets, &ask.want, &ask.messages).map_err(&fail)?;
                    let (sampling, limit) = match ask.want {
                        Want::UserTurn => (opts.requests, opts.conversations.bounds.max_tokens),
                        Want::Answer => (opts.answers, opts.max_tokens),
                    };
                    let (request, answer) = Request::new(tokens, ask.seed);
                    requests.send(request.drawn(sampling, limit)).map_err(|_| fail("the generator stopped".into()))?;
                    pending.push(async move { (ask.attempt, ask.want, answer.await) });
                }
                if plan.finished() {
                    return Ok(());
                }
                let Some((attempt, want, answer)) = futures::executor::block_on(pending.next()) else {
                    return Err(fail(
                        "the synthesis stalled with attempts unfinished (a bug: please report it)".into(),
                    ));
                };
                let tokens = match answer {
                    Ok(Ok(tokens)) => tokens,
                    Ok(Err(e)) => return Err(fail(format!("generating: {e}"))),
                    Err(_) => return Err(fail("the generator stopped before answering".into())),
                };
                let generated = read_generation(assets, stop, special, tokens).map_err(&fail)?;
                match want {
                    Want::UserTurn => report.request_tokens += generated.tokens as u64,
                    Want::Answer => report.answer_tokens += generated.tokens as u64,
                }
                meter.add(0, generated.tokens as u64);
                let (more, outcomes) = plan.generated(attempt, generated);
                asks = more;
                for outcome in outcomes {
                    match outcome {
                        Outcome::Accepted { line, .. } => {
                            out.write(&line)?;
                            meter.add(1, 0);
                        }
                        Outcome::Rejected { line, .. } => rejects.write(&line)?,
                    }
                }
                asks.extend(plan.launch());
            }
        });
        let served = generator.serve(&received);
        drop(received);
        let driven = match driver.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        served.map_err(|e| fail(format!("generating: {e}")))?;
        driven
    });
    meter.finish();
    report.generation = generator.stats();
    driven?;
    let kept: Vec<SampleId> = plan.kept().into_iter().map(SampleId::Number).collect();
    rewrite_in_order(&opts.out, &kept, Others::Drop)?;
    let rejected_kept: Vec<SampleId> =
        plan.rejected_kept(&earlier_rejected).into_iter().map(SampleId::Number).collect();
    rewrite_in_order(&rejected_file, &rejected_kept, Others::Drop)?;
    report.conversations = kept.len() as u64;
    let tally = plan.tally();
    report.attempts = tally.attempts;
    report.rejected = tally.rejected;
    report.follow_ups_dropped = tally.follow_ups_dropped;
    report.answers_cut = tally.answers_cut;
    report.spread = Spread::of(&plan.kept_first_words());
    report.seconds = meter.started.elapsed().as_secs_f64();
    Ok(report)
}
