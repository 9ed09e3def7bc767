//! The decoded acceptance length during training. A thread of its own takes the checkpoints the supervisor asks it
//! to, decodes held-out prompts with each by real speculative decoding (checked against greedy decoding), beside
//! training rather than in its way, scores the same held-out rows teacher-forced (the number training's progress
//! line shows for its batches: the two side by side show overfitting), and keeps the checkpoint with the best
//! decoded acceptance length as
//! `checkpoint.dir/best` (hard links of the checkpoint's files, so pruning old checkpoints never touches it). It
//! loads the full target stack on its first job (a run with evaluation off never does), and keeps its decoding set
//! up from one job to the next ([`DecodeSession`]: caches and CUDA graphs; each checkpoint's weights are copied in),
//! waiting on its own stream only.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use super::publish::{self, Baseline, Measured, Publication};
use crate::config::{Config, DataSource, EvalPrompts, PublishSettings, TargetSource};
use crate::data::TokenRow;
use crate::data::prepare::commit_folder;
use crate::data::prompts::{Prompt, prompt_end, read_prompts};
use crate::data::shards::PreparedSplit;
use crate::device::device_name;
use crate::model::{Depth, Drafter, Target};
use crate::panic::catch_torch;
use crate::train::ObjectiveSettings;
use crate::train::checkpoint::DRAFTER_DIR;
use crate::train::decode_eval::{DecodeSession, DecodeSettings};
use crate::train::eval::evaluate_rows;

/// The folder of the best checkpoint, in `checkpoint.dir`.
pub const BEST_DIR: &str = "best";
/// What the best checkpoint was measured at, in its folder.
pub const EVAL_FILE: &str = "eval.json";

/// What an evaluation decodes and scores.
#[derive(Debug, Clone, Default)]
pub struct EvalSet {
    /// Decoded speculatively and greedily.
    pub prompts: Vec<Prompt>,
    /// Scored teacher-forced: held-out rows (the ones the prompts were cut from, with a held-out split), or none
    /// where the data has no held-out split.
    pub rows: Vec<TokenRow>,
}

/// The prompts `[eval]` names: the first `num_prompts` of the held-out split (each cut where the first assistant
/// reply starts) or of a prompts file; and as many held-out rows, where the data holds some out.
pub fn eval_set(config: &Config, vocab_size: usize) -> Result<EvalSet> {
    let want = config.eval.num_prompts;
    let set = match &config.eval.prompts {
        EvalPrompts::File(path) => {
            let assets = || config.target.source.chat_assets(&Default::default());
            let mut prompts = read_prompts(path, vocab_size, &assets)
                .with_context(|| format!("eval.prompts = {}", path.display()))?;
            prompts.truncate(want);
            // Held-out rows where the data has them; the prompts file decides what is decoded regardless.
            let rows = holdout_split(config).map(|split| split_rows(&split, want)).unwrap_or_default();
            EvalSet { prompts, rows }
        }
        // A stream's evaluation starts on the base data's held-out split, until a wave holds conversations out.
        EvalPrompts::Holdout | EvalPrompts::Stream => {
            let mut set = EvalSet { prompts: vec![], rows: vec![] };
            extend_from_holdout(&mut set, &holdout_split(config)?, want);
            set
        }
    };
    if set.prompts.is_empty() {
        bail!(
            "eval.prompts: no prompt to decode (prepare the data with --holdout 0.05, or set data.holdout = 0.05 for a \
             token-row file; or give a prompts file; or set eval.every_steps = 0)"
        );
    }
    Ok(set)
}

/// Adds the rows of `split` that have a prompt before their first answer (each prompt cut there) to `set`, until it
/// holds `want`.
fn extend_from_holdout(set: &mut EvalSet, split: &PreparedSplit, want: usize) {
    for i in 0..split.len() {
        if set.prompts.len() >= want {
            return;
        }
        let s = split.get(i);
        let Some(first) = prompt_end(s.loss_mask) else { continue };
        let row = TokenRow { id: s.id.clone(), input_ids: s.input_ids(), loss_mask: s.loss_mask.to_vec() };
        set.prompts.push(Prompt { id: s.id.clone(), input_ids: row.input_ids[..first].to_vec() });
        set.rows.push(row);
    }
}

/// `eval.prompts = "stream"`: the held-out conversations of the stream's newest waves (`root`: the run's stream
/// folder), newest wave first, up to `want`; `None` while no wave holds any out.
fn recent_traffic(root: &Path, want: usize) -> Result<Option<EvalSet>> {
    let mut set = EvalSet { prompts: vec![], rows: vec![] };
    for wave in crate::data::stream::logged_waves(root)?.iter().rev() {
        let dir = crate::data::stream::wave_dir(root, wave.number);
        let split = PreparedSplit::open(&dir, "holdout", false).with_context(|| format!("{}", dir.display()))?;
        extend_from_holdout(&mut set, &split, want);
        if set.prompts.len() >= want {
            break;
        }
    }
    Ok((!set.prompts.is_empty()).then_some(set))
}

/// The set an evaluation decodes, and whether it is the stream's recent traffic (where `eval.prompts = "stream"` and
/// a wave holds some out); else the set read at start.
fn current_set(spec: &EvalSpec) -> (EvalSet, bool) {
    let Some(root) = &spec.recent_traffic else { return (spec.set.clone(), false) };
    match recent_traffic(root, spec.set.prompts.len().max(1)) {
        Ok(Some(set)) => (set, true),
        Ok(None) => (spec.set.clone(), false),
        Err(e) => {
            tracing::warn!(
                "evaluation: reading the stream's recent traffic: {e:#}; evaluating on data.path's held-out split"
            );
            (spec.set.clone(), false)
        }
    }
}

/// The held-out split of the configured data.
fn holdout_split(config: &Config) -> Result<PreparedSplit> {
    let dir = match &config.data.source {
        DataSource::Prepared(dir) => dir.clone(),
        DataSource::Builtin => super::builtin_data::builtin_dir(config).join("prepared"),
        DataSource::TokenRows(file) => super::builtin_data::token_rows_dir(config, file),
        DataSource::Synthetic(_) => bail!(
            "eval.prompts = \"holdout\": synthetic data has no held-out split; give a prompts file, or set \
             eval.every_steps = 0"
        ),
    };
    PreparedSplit::open(&dir, "holdout", false)
        .with_context(|| format!("eval.prompts = \"holdout\" reads the holdout split of {}", dir.display()))
}

/// The first `count` rows of `split`.
fn split_rows(split: &PreparedSplit, count: usize) -> Vec<TokenRow> {
    (0..split.len().min(count))
        .map(|i| {
            let s = split.get(i);
            TokenRow { id: s.id.clone(), input_ids: s.input_ids(), loss_mask: s.loss_mask.to_vec() }
        })
        .collect()
}

/// What the evaluation thread needs.
pub struct EvalSpec {
    pub source: TargetSource,
    pub taps: Vec<usize>,
    pub device: Device,
    /// More devices its target spreads its later layers over (`target.spread_to`).
    pub spread_to: Vec<Device>,
    pub kind: Kind,
    pub set: EvalSet,
    /// `eval.prompts = "stream"`: the run's stream folder, whose newest held-out conversations each evaluation
    /// decodes instead of `set` once a wave holds some out.
    pub recent_traffic: Option<PathBuf>,
    pub settings: DecodeSettings,
    /// How held-out rows are scored teacher-forced (as training scores its batches).
    pub objective: ObjectiveSettings,
    pub checkpoint_root: PathBuf,
    /// Where an improved drafter is published (`[publish]`).
    pub publish: PublishSettings,
}

/// One evaluation's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluated {
    pub step: u64,
    /// Real speculative decoding of the held-out prompts: tokens kept per target step (what inference sees).
    pub decode_acceptance_length: f64,
    /// The same drafter teacher-forced on held-out rows (the measure training's progress line gives for its
    /// batches); absent where the data holds no rows out.
    #[serde(default)]
    pub holdout_acceptance_length: Option<f64>,
    #[serde(default)]
    pub holdout_rows: usize,
    /// The loss on those rows, weighed as training weighs its batches.
    #[serde(default)]
    pub holdout_loss: Option<f64>,
    pub token_match_rate: f64,
    pub lossless: bool,
    pub prompts: usize,
    pub seconds: f64,
    /// The best acceptance length so far (this one's when it is the new best).
    pub best: f64,
    pub new_best: bool,
    /// The version this evaluation published (`[publish]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published: Option<Publication>,
    /// The published drafter it was weighed against, decoded on the same prompts (`[publish]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
}

impl Evaluated {
    /// What publishing weighs.
    pub fn measured(&self) -> Measured {
        Measured {
            step: self.step,
            decode_acceptance_length: self.decode_acceptance_length,
            prompts: self.prompts,
            lossless: self.lossless,
        }
    }
}

/// The run's best evaluated checkpoint (`root/best`), and what it was measured at.
pub fn best_evaluated(root: &Path) -> Result<(PathBuf, Evaluated)> {
    let best = root.join(BEST_DIR);
    let path = best.join(EVAL_FILE);
    let bytes = std::fs::read(&path).with_context(|| {
        format!("{}: no evaluated checkpoint yet (eval.every_steps > 0 keeps the best one here)", best.display())
    })?;
    let evaluated = serde_json::from_slice(&bytes).with_context(|| format!("{}", path.display()))?;
    Ok((best, evaluated))
}

#[cfg(test)]
impl Evaluated {
    /// A lossless evaluation of 8 prompts at `step` that decoded `acceptance` tokens a target step, the run's best,
    /// for the tests of what reads evaluations.
    pub fn lossless_at(step: u64, acceptance: f64) -> Self {
        Evaluated {
            step,
            decode_acceptance_length: acceptance,
            holdout_acceptance_length: None,
            holdout_rows: 0,
            holdout_loss: None,
            token_match_rate: 1.0,
            lossless: true,
            prompts: 8,
            seconds: 1.0,
            best: acceptance,
            new_best: true,
            published: None,
            baseline: None,
        }
    }
}

/// The handle the supervisor keeps.
pub struct Evaluator {
    jobs: SyncSender<(u64, PathBuf)>,
    busy: Arc<AtomicBool>,
}

impl Evaluator {
    /// Starts the evaluation thread; `on_done` gets each job's outcome (as the checkpointer and the collective
    /// report theirs).
    pub fn start(
        spec: EvalSpec,
        on_done: impl Fn(Result<Evaluated, String>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = sync_channel(1);
        let busy = Arc::new(AtomicBool::new(false));
        let flag = busy.clone();
        std::thread::Builder::new().name("evaluator".into()).spawn(move || run(spec, rx, flag, on_done))?;
        Ok(Evaluator { jobs, busy })
    }

    /// Hands checkpoint `dir` of `step` over; false when the previous evaluation is still running.
    pub fn submit(&self, step: u64, dir: PathBuf) -> bool {
        if self.busy.swap(true, Ordering::SeqCst) {
            return false;
        }
        match self.jobs.try_send((step, dir)) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.busy.store(false, Ordering::SeqCst);
                false
            }
        }
    }
}

fn run(
    spec: EvalSpec,
    jobs: Receiver<(u64, PathBuf)>,
    busy: Arc<AtomicBool>,
    on_done: impl Fn(Result<Evaluated, String>),
) {
    // Its own stream, of high priority: training launches on the device's default stream and keeps every SM busy,
    // while decoding reads a token every step; on the shared stream each read would wait for the training work
    // queued before it, and on a normal stream its small kernels would queue behind training's blocks.
    // `DFLASH_EVAL_STREAM=normal` takes a normal one instead, for comparing what the evaluation costs training
    // (BENCHMARKS.md: high priority cost training least).
    let priority = match std::env::var("DFLASH_EVAL_STREAM").as_deref() {
        Ok("normal") => crate::device::Priority::Normal,
        _ => crate::device::Priority::High,
    };
    let bound =
        crate::device::bind_thread(spec.device).and_then(|()| crate::device::use_own_stream(spec.device, priority));
    if let Err(e) = bound {
        tracing::error!("evaluator: cannot use {}: {e}", device_name(spec.device));
    }
    clean_staging(&spec.checkpoint_root);
    let mut best = read_best(&spec.checkpoint_root);
    let report = |outcome: Result<Evaluated, String>| {
        busy.store(false, Ordering::SeqCst);
        let failed = outcome.is_err();
        on_done(outcome);
        failed
    };
    // The target and the drafter decoding is set up with, loaded at the first job (again at the next one if that
    // fails): a run with evaluation off never loads them.
    let (target, shape, first) = loop {
        let Ok((step, dir)) = jobs.recv() else { return };
        match caught(catch_torch(|| load(&spec, &dir))) {
            Ok((target, shape)) => break (target, shape, (step, dir)),
            Err(e) => _ = report(Err(e)),
        }
    };
    // Kept from one evaluation to the next: the caches and, with eval.cuda_graphs, the CUDA graphs, captured once;
    // the published drafter decoded on the prompts, once a version.
    let mut session: Option<DecodeSession> = None;
    let mut baseline: Option<PublishedDecode> = None;
    // The prompts the session was set up for (a stream's recent traffic changes from one evaluation to the next).
    let mut session_prompts: Vec<crate::data::SampleId> = Vec::new();
    let mut next = Some(first);
    while let Some((step, dir)) = next.take().or_else(|| jobs.recv().ok()) {
        let (set, recent) = current_set(&spec);
        let prompts: Vec<crate::data::SampleId> = set.prompts.iter().map(|p| p.id.clone()).collect();
        if prompts != session_prompts {
            if recent {
                tracing::info!(
                    prompts = prompts.len(),
                    "evaluation: recent traffic, the newest waves' held-out conversations"
                );
                // The best so far was measured on other prompts: on recent traffic, best is the best on these.
                best = None;
            }
            // The published drafter's decoding too was of other prompts.
            (session, baseline) = (None, None);
            session_prompts = prompts;
        }
        let kept = (&mut best, &mut baseline);
        let outcome = catch_torch(|| evaluate(&spec, &set, (&target, &shape), &mut session, step, &dir, kept));
        if report(caught(outcome)) {
            // Whatever failed may have left decoding half done: the next evaluation sets it up afresh.
            session = None;
        }
    }
}

/// An outcome as the supervisor hears it: an error or a panic as its message.
fn caught<T>(outcome: Result<Result<T>, crate::panic::Panicked>) -> Result<T, String> {
    match outcome {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(p) => Err(p.to_string()),
    }
}

/// The full target and the drafter in `checkpoint`, both kept for the run: decoding is set up with that drafter's
/// shape (every later checkpoint's) and copies each checkpoint's weights into its own.
fn load(spec: &EvalSpec, checkpoint: &Path) -> Result<(Target, Drafter)> {
    let loading = Instant::now();
    let devices: Vec<Device> = std::iter::once(spec.device).chain(spec.spread_to.iter().copied()).collect();
    let target = spec.source.build_target_spread(&spec.taps, Depth::Full, &devices, spec.kind)?;
    let drafter = Drafter::load(&checkpoint.join(DRAFTER_DIR), spec.device, spec.kind)
        .with_context(|| format!("the drafter of {}", checkpoint.display()))?;
    let seconds = format!("{:.1}", loading.elapsed().as_secs_f64());
    tracing::info!(device = %device_name(spec.device), seconds, "evaluator: loaded the full target (once)");
    Ok((target, drafter))
}

#[allow(clippy::too_many_arguments)]
fn evaluate<'a>(
    spec: &EvalSpec,
    set: &EvalSet,
    (target, shape): (&'a Target, &'a Drafter),
    session: &mut Option<DecodeSession<'a>>,
    step: u64,
    checkpoint: &Path,
    (best, published): (&mut Option<f64>, &mut Option<PublishedDecode>),
) -> Result<Evaluated> {
    let started = Instant::now();
    // The checkpoint may be pruned while it is decoded: its files are linked first.
    let staged = stage(checkpoint, &spec.checkpoint_root, step)?;
    let result = (|| {
        let drafter = Drafter::load(&staged.join(DRAFTER_DIR), spec.device, spec.kind)?;
        let decoding = match session {
            Some(s) => s,
            None => session.insert(DecodeSession::new(target, shape, &set.prompts, &spec.settings)?),
        };
        let baseline = match &spec.publish.dir {
            Some(dir) => published_baseline(dir, decoding, spec, set, published),
            None => None,
        };
        decoding.load(&drafter)?;
        let decoded = decoding.evaluate(&set.prompts, &spec.settings)?;
        let rows = &set.rows;
        let scored = match rows.is_empty() {
            true => None,
            false => Some(evaluate_rows(target, &drafter, &spec.objective, rows, HOLDOUT_BATCH)?),
        };
        Ok::<_, anyhow::Error>((decoded, scored, baseline))
    })();
    let (report, scored, baseline) = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staged);
            return Err(e);
        }
    };
    if !report.lossless {
        let ids: Vec<&crate::data::SampleId> = report.divergences.iter().map(|d| &d.prompt).collect();
        tracing::warn!(
            step,
            prompts = %serde_json::to_string(&ids).unwrap_or_default(),
            "evaluation: speculative decoding left greedy decoding's output on these prompts: both choose tokens \
             alike, so this is a bug (`dflash eval --decode --dump` shows where; please report it)"
        );
    }
    let acceptance = report.decode_acceptance_length;
    let new_best = best.is_none_or(|b| acceptance > b);
    let mut evaluated = Evaluated {
        step,
        decode_acceptance_length: acceptance,
        holdout_acceptance_length: scored.as_ref().map(|s| s.acceptance_length),
        holdout_rows: set.rows.len(),
        holdout_loss: scored.as_ref().map(|s| s.loss),
        token_match_rate: report.token_match_rate,
        lossless: report.lossless,
        prompts: report.prompts,
        seconds: started.elapsed().as_secs_f64(),
        best: if new_best { acceptance } else { best.unwrap_or(acceptance) },
        new_best,
        published: None,
        baseline: baseline.clone(),
    };
    if let Some(dir) = &spec.publish.dir {
        // A publication that fails costs a warning, not the evaluation: the next one tries again.
        match publish::publish(&spec.publish, &staged, &evaluated.measured(), baseline.as_ref(), None) {
            Ok(Ok(p)) => {
                tracing::info!(
                    version = p.version,
                    step,
                    "published {}: {}",
                    dir.join(format!("v{}", p.version)).display(),
                    p.why
                );
                evaluated.published = Some(p);
            }
            Ok(Err(why)) => tracing::info!("not published: {why}"),
            Err(e) => tracing::warn!(step, "publishing to {} failed: {e:#}", dir.display()),
        }
    }
    record(&spec.checkpoint_root, &evaluated);
    if new_best {
        std::fs::write(staged.join(EVAL_FILE), serde_json::to_vec_pretty(&evaluated)?)?;
        promote(&staged, &spec.checkpoint_root)?;
        *best = Some(acceptance);
    } else {
        std::fs::remove_dir_all(&staged)?;
    }
    Ok(evaluated)
}

/// What the evaluator learnt of the published drafter's version `version` on the evaluation's prompts, kept from one
/// evaluation to the next while both stay (the evaluator forgets it when the prompts change): its decoded acceptance,
/// or `None` when it could not be decoded.
struct PublishedDecode {
    version: u64,
    decoded: Option<Baseline>,
}

/// The published drafter (`dir/current`) decoded on the evaluation's prompts, once a version (`kept` remembers the
/// last). `None` when nothing is published, or when it cannot be read or decoded (another shape, say): that costs
/// one warning a version, and the candidate is then weighed against the number the drafter was published at.
fn published_baseline(
    dir: &Path,
    decoding: &mut DecodeSession,
    spec: &EvalSpec,
    set: &EvalSet,
    kept: &mut Option<PublishedDecode>,
) -> Option<Baseline> {
    let current = match publish::current(dir) {
        Ok(current) => current?,
        Err(e) => {
            tracing::warn!("reading the published drafter: {e:#}");
            return None;
        }
    };
    if let Some(kept) = kept.as_ref().filter(|k| k.version == current.version) {
        return kept.decoded.clone();
    }
    let decoded = (|| {
        let published = Drafter::load(&dir.join(publish::CURRENT), spec.device, spec.kind)?;
        decoding.load(&published)?;
        decoding.evaluate(&set.prompts, &spec.settings)
    })();
    let decoded = match decoded {
        Ok(report) => {
            Some(Baseline { version: current.version, decode_acceptance_length: report.decode_acceptance_length })
        }
        Err(e) => {
            tracing::warn!(
                version = current.version,
                "decoding the published drafter: {e}; weighing candidates against the acceptance it was published \
                 at until another version is published"
            );
            None
        }
    };
    *kept = Some(PublishedDecode { version: current.version, decoded: decoded.clone() });
    decoded
}

/// The run's history of evaluations, one JSON line each, beside its checkpoints (`dflash inspect-run` reads it).
pub const HISTORY_FILE: &str = "evals.jsonl";

/// Appends `e` to the run's history. A history that cannot be written costs a warning, not the evaluation.
fn record(root: &Path, e: &Evaluated) {
    use std::io::Write;
    let path = root.join(HISTORY_FILE);
    let written = serde_json::to_string(e).map_err(std::io::Error::other).and_then(|line| {
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
        file.write_all(format!("{line}\n").as_bytes())
    });
    if let Err(err) = written {
        tracing::warn!(path = %path.display(), "could not add the evaluation to the run's history: {err}");
    }
}

/// The evaluations of the run whose checkpoints are in `root`, in step order: one per step, the last recorded (a
/// resumed run may evaluate a step again). A line that does not parse is named by its number.
pub fn read_history(root: &Path) -> Result<Vec<Evaluated>> {
    let path = root.join(HISTORY_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: no history of evaluations (a run records one when it evaluates: eval.every_steps > 0 and \
             eval.prompts set)",
            path.display()
        )
    })?;
    let mut by_step = std::collections::BTreeMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let e: Evaluated =
            serde_json::from_str(line).with_context(|| format!("{}:{}: not an evaluation", path.display(), i + 1))?;
        by_step.insert(e.step, e);
    }
    Ok(by_step.into_values().collect())
}

/// Held-out rows per target pass when they are scored teacher-forced.
const HOLDOUT_BATCH: usize = 4;

/// The best acceptance length recorded in `root/best`, if any.
fn read_best(root: &Path) -> Option<f64> {
    let text = std::fs::read(root.join(BEST_DIR).join(EVAL_FILE)).ok()?;
    serde_json::from_slice::<Evaluated>(&text).ok().map(|e| e.decode_acceptance_length)
}

/// Removes staging folders a crash left behind.
fn clean_staging(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".eval-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// `root/.eval-<step>`: the checkpoint's files, hard-linked (copied where linking fails).
fn stage(checkpoint: &Path, root: &Path, step: u64) -> Result<PathBuf> {
    let staged = root.join(format!(".eval-{step}"));
    let _ = std::fs::remove_dir_all(&staged);
    link_tree(checkpoint, &staged).with_context(|| format!("staging {} for evaluation", checkpoint.display()))?;
    Ok(staged)
}

fn link_tree(src: &Path, dst: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            link_tree(&entry.path(), &to)?;
        } else if std::fs::hard_link(entry.path(), &to).is_err() {
            std::fs::copy(entry.path(), &to)?;
        }
    }
    Ok(())
}

/// Makes `staged` the new `root/best`, as `prepare` commits its output (the old one is removed only once the new
/// one is in place).
fn promote(staged: &Path, root: &Path) -> Result<()> {
    Ok(commit_folder(staged, &root.join(BEST_DIR))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sets: &[&str]) -> Config {
        let layers = crate::config::Layers { set: sets.iter().map(|s| s.to_string()).collect(), ..Default::default() };
        Config::load(&layers).unwrap()
    }

    #[test]
    fn prompts_come_from_a_file_or_a_held_out_split_and_are_refused_clearly_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("prompts.jsonl");
        std::fs::write(&file, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4]}\n{\"input_ids\": [5, 6]}\n").unwrap();
        let c = config(&[&format!("eval.prompts={}", file.display()), "eval.num_prompts=2"]);
        let set = eval_set(&c, 320).unwrap();
        assert_eq!(set.prompts.iter().map(|p| p.input_ids.clone()).collect::<Vec<_>>(), vec![vec![1, 2, 3], vec![4]]);
        let err = format!("{:#}", eval_set(&config(&["data.path=synthetic"]), 320).unwrap_err());
        assert!(err.contains("synthetic") && err.contains("eval.every_steps = 0"), "{err}");
        let missing = dir.path().join("no-data");
        let err = format!("{:#}", eval_set(&config(&[&format!("data.path={}", missing.display())]), 320).unwrap_err());
        assert!(err.contains("holdout") && err.contains("no-data"), "{err}");
        let err = format!("{:#}", eval_set(&config(&["eval.prompts=/no/such.jsonl"]), 320).unwrap_err());
        assert!(err.contains("/no/such.jsonl"), "{err}");
    }

    #[test]
    fn staging_links_a_checkpoint_and_promotion_replaces_best() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = root.path().join("ckpt-000000010");
        std::fs::create_dir_all(ckpt.join("drafter")).unwrap();
        std::fs::write(ckpt.join("MANIFEST"), "m").unwrap();
        std::fs::write(ckpt.join("drafter/model.safetensors"), "w").unwrap();
        let staged = stage(&ckpt, root.path(), 10).unwrap();
        // Pruning the checkpoint leaves the staged files intact.
        std::fs::remove_dir_all(&ckpt).unwrap();
        assert_eq!(std::fs::read_to_string(staged.join("drafter/model.safetensors")).unwrap(), "w");
        std::fs::write(
            staged.join(EVAL_FILE),
            r#"{"step":10,"decode_acceptance_length":2.5,"token_match_rate":1.0,
            "lossless":true,"prompts":3,"seconds":1.0,"best":2.5,"new_best":true}"#,
        )
        .unwrap();
        promote(&staged, root.path()).unwrap();
        assert_eq!(read_best(root.path()), Some(2.5));
        let again = stage(&root.path().join(BEST_DIR), root.path(), 20).unwrap();
        promote(&again, root.path()).unwrap();
        assert!(root.path().join(BEST_DIR).join("MANIFEST").exists());
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from(BEST_DIR)]);
        std::fs::create_dir_all(root.path().join(".eval-99")).unwrap();
        clean_staging(root.path());
        assert!(!root.path().join(".eval-99").exists());
    }
}
