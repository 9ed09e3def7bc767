//! The data a run starts from: a prepared folder, synthetic rows, a token-row file (checked against the target and
//! prepared once into `data.cache_dir`), or the built-in conversations answered by the target itself
//! (`data.path = "builtin"`), generated, regenerated and prepared once into `data.cache_dir` (each stage resumable
//! and idempotent, so later runs start at once).
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};
use tch::{Device, Kind};

use crate::config::{Config, DataSource, TargetSource};
use crate::data::builtin::sample_conversations;
use crate::data::dataset::{Dataset, SyntheticData};
use crate::data::prepare::{Lines, ModelAssets, PrepareOptions, PrepareOutcome, prepare, prepare_lines};
use crate::data::regenerate::{
    Failure, RegenerateOptions, RegenerateReport, Reply, ShowProgress, regenerate_concurrently,
};
use crate::data::shards::{Manifest, PreparedSplit, hex};
use crate::model::batched::{Answer, BatchGenerator, BatchSettings, Request, default_batch};
use crate::model::sampling::Sampling;
use crate::model::{Depth, Target, TargetConfig};
use sha2::{Digest, Sha256};

/// The target answering as the chat template prompts it (`regenerate --local`, built-in data), many conversations at
/// once ([`BatchGenerator`]).
pub struct LocalResponder {
    pub target: Target,
    pub assets: ModelAssets,
    pub settings: BatchSettings,
}

impl LocalResponder {
    /// Replies stop at the target's EOS ids and the template's end-of-turn tokens, unless `ignore_eos`; `batch`
    /// conversations are answered at once.
    pub fn new(
        target: Target,
        assets: ModelAssets,
        max_tokens: usize,
        sampling: Sampling,
        ignore_eos: bool,
        batch: usize,
    ) -> Self {
        let mut stop = assets.stop_tokens(&target.config().eos_token_ids);
        if ignore_eos {
            stop.clear();
        }
        let settings = BatchSettings { batch, max_new: max_tokens, stop, sampling, cuda_graphs: true };
        LocalResponder { target, assets, settings }
    }

    /// Regenerates `opts`: the target generates on the calling thread (its device's), while another thread renders
    /// the prompts, keeps twice the batch of conversations in flight and writes the answers.
    pub fn regenerate(&self, opts: &RegenerateOptions) -> Result<RegenerateReport> {
        let (requests, received) = std::sync::mpsc::channel::<Request>();
        let mut generator = BatchGenerator::new(&self.target, self.settings.clone())?;
        let concurrency = 2 * self.settings.batch;
        // The driver's share: the tokenizer and template, and where replies stop (the target stays here).
        let (assets, stop) = (&self.assets, &self.settings.stop);
        std::thread::scope(|scope| {
            let driver = scope.spawn(move || {
                regenerate_concurrently(opts, concurrency, |conv, messages, seed| {
                    let request = request(assets, &messages, conv.tools.as_ref(), seed);
                    let sent = request.and_then(|(request, answer)| {
                        requests.send(request).map_err(|_| Failure::new("the generator has stopped"))?;
                        Ok(answer)
                    });
                    async move {
                        let tokens = match sent?.await {
                            Ok(answer) => answer.map_err(Failure::new)?,
                            Err(_) => return Err(Failure::new("the generator stopped before answering")),
                        };
                        reply(assets, stop, tokens)
                    }
                })
            });
            let served = generator.serve(&received);
            // Requests sent from here on fail at once, and those not taken are answered as dropped.
            drop(received);
            let mut report = match driver.join() {
                Ok(report) => report?,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            served.context("generating the replies")?;
            report.generation = generator.stats();
            Ok(report)
        })
    }
}

/// The generation request of a reply to `messages`, and where its tokens arrive.
fn request(
    assets: &ModelAssets,
    messages: &[Value],
    tools: Option<&Value>,
    seed: u64,
) -> Result<(Request, Answer), Failure> {
    let prompt = assets.template.render(messages, tools, true).map_err(|e| Failure::new(e.to_string()))?;
    let encoded = assets.tokenizer.encode(&prompt).map_err(Failure::new)?;
    Ok(Request::new(encoded.ids.iter().map(|&t| t as i64).collect(), seed))
}

/// The reply of generated `tokens`: cut at the limit unless it ended at a token of `stop`, or runs there on purpose
/// (no stop tokens: --ignore-eos).
fn reply(assets: &ModelAssets, stop: &[i64], mut tokens: Vec<i64>) -> Result<Reply, Failure> {
    let count = tokens.len() as u64;
    let ended = tokens.last().is_some_and(|t| stop.contains(t));
    if ended {
        tokens.pop();
    }
    let text: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    Ok(Reply {
        content: assets.tokenizer.decode(&text).map_err(Failure::new)?,
        reasoning: None,
        tokens: Some(count),
        truncated: !ended && !stop.is_empty(),
    })
}

/// The training samples the configuration names, checked against the target: every token id in its vocabulary,
/// every sample within its positions (an error names the file and the sample).
pub fn dataset(config: &Config, target: &TargetConfig, device: Device, kind: Kind) -> Result<Arc<dyn Dataset>> {
    let d = &config.data;
    let vocab_size = target.vocab_size;
    let fits = |split: PreparedSplit, dir: &Path| -> Result<PreparedSplit> {
        split
            .check_fits(dir, vocab_size, target.positions())
            .with_context(|| format!("data.path = {}: the data does not fit the target", dir.display()))?;
        Ok(split)
    };
    let data: Arc<dyn Dataset> = match &d.source {
        DataSource::Prepared(dir) => {
            same_tokenizer(config, dir)?;
            Arc::new(fits(
                PreparedSplit::open(dir, "train", false).with_context(|| format!("data.path = {}", dir.display()))?,
                dir,
            )?)
        }
        DataSource::Synthetic(lengths) => Arc::new(SyntheticData::new(
            d.builtin_conversations,
            d.max_len,
            *lengths,
            vocab_size,
            config.objective.seed,
        )),
        DataSource::Builtin => Arc::new(fits(builtin(config, device, kind)?, &builtin_dir(config).join("prepared"))?),
        DataSource::TokenRows(file) => Arc::new(token_rows(config, target, file)?),
    };
    if data.is_empty() {
        bail!("data.path: the training split holds no sample");
    }
    let default_max_len = Config::builtin().map(|c| c.data.max_len).ok();
    if matches!(d.source, DataSource::Prepared(_) | DataSource::TokenRows(_)) && Some(d.max_len) != default_max_len {
        tracing::warn!(
            "data.max_len = {} is not used with token rows: they train as prepared (`dflash prepare --max-len` cut \
             them); prepare them again to change their length",
            d.max_len
        );
    }
    Ok(data)
}

/// Refuses a prepared folder whose tokenizer and chat template are not the target's, unless
/// `data.allow_other_tokenizer`: token ids mean text only under the tokenizer that wrote them, and another one's ids
/// (all within the vocabulary when the two are of a size) would train silently on nonsense. A folder from before the
/// manifest recorded its tokenizer, or a target without one (a preset of random weights), is not checked.
fn same_tokenizer(config: &Config, dir: &Path) -> Result<()> {
    let manifest = Manifest::read(dir).with_context(|| format!("data.path = {}", dir.display()))?;
    let Some(theirs) = &manifest.tokenizer else {
        tracing::warn!(
            data = %dir.display(),
            "prepared by a dflash that did not record its tokenizer: it cannot be checked against the target's \
             (prepare it again, into another folder, to have it checked)"
        );
        return Ok(());
    };
    let Ok(target) = config.target.source.chat_assets(&Map::new()) else {
        return Ok(());
    };
    if target.identity == *theirs {
        return Ok(());
    }
    let what = format!(
        "data.path = {}: prepared with the tokenizer and chat template of {} ({}), not the target's ({}: {})",
        dir.display(),
        manifest.model,
        &theirs[..12.min(theirs.len())],
        target.name,
        &target.identity[..12]
    );
    if config.data.allow_other_tokenizer {
        tracing::warn!("{what}; training on it, as data.allow_other_tokenizer = true asks");
        return Ok(());
    }
    bail!(
        "{what}: its token ids would mean other text to this target. Prepare the conversations again with \
         `dflash prepare --model {}` into another folder, or, if the two share a tokenizer and chat template, set \
         data.allow_other_tokenizer = true",
        target.name
    )
}

/// Where the prepared copy of a token-row file lives: `data.cache_dir/token-rows/<file name>-<hash of its full
/// path>` (rewritten when the file, the target's vocabulary or positions, the block size or `data.holdout` change).
pub fn token_rows_dir(config: &Config, file: &Path) -> PathBuf {
    config.data.cache_dir.join("token-rows").join(path_key(file))
}

/// A folder name for `path`: its last component and a hash of its full path.
fn path_key(path: &Path) -> String {
    let full = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let digest = hex(&Sha256::digest(full.to_string_lossy().as_bytes()));
    let name = path.file_name().map_or("data".into(), |n| n.to_string_lossy().into_owned());
    format!("{name}-{}", &digest[..12])
}

/// The train split of a token-row file: every row checked (an error names the file and line), rows with fewer than
/// 2 x block_size supervised tokens dropped, `data.holdout` of them kept apart by id, prepared once.
fn token_rows(config: &Config, target: &TargetConfig, file: &Path) -> Result<PreparedSplit> {
    let out = token_rows_dir(config, file);
    let opts = PrepareOptions {
        long: Default::default(),
        inputs: vec![file.to_path_buf()],
        out: out.clone(),
        max_len: target.positions(),
        block_size: config.draft_model.block_size,
        holdout: config.data.holdout,
        seed: 0,
        template_kwargs: Map::new(),
        strict: true,
        progress: false,
        // A cache of this process's own making, prepared again whenever what it is made from changes.
        force: true,
    };
    let what = || format!("data.path = {}: token rows", file.display());
    let lines = Lines::TokenRows { vocab_size: target.vocab_size };
    let manifest = match prepare_lines(lines, &opts).with_context(what)? {
        PrepareOutcome::UpToDate(m) => m,
        PrepareOutcome::Written(m) => {
            tracing::info!(copy = %out.display(), "token rows checked and prepared: {}", m.report.summary());
            m
        }
    };
    if manifest.report.kept_train == 0 {
        bail!("{}: no row to train on ({})", what(), manifest.report.summary());
    }
    PreparedSplit::open(&out, "train", false).with_context(what)
}

/// Where the built-in data of this configuration's target lives: `data.cache_dir/<target>/` (the preset's name, or
/// the model folder's name and a hash of its path), so answers one target gave are never reused for another. The
/// conversations themselves are shared, in `data.cache_dir`.
pub fn builtin_dir(config: &Config) -> std::path::PathBuf {
    let key = match &config.target.source {
        TargetSource::Preset(p) => p.name().to_string(),
        TargetSource::Folder(dir) => path_key(dir),
    };
    config.data.cache_dir.join(key)
}

fn builtin(config: &Config, device: Device, kind: Kind) -> Result<PreparedSplit> {
    let model = match &config.target.source {
        TargetSource::Preset(p) if p.is_tiny() => p.name().to_string(),
        TargetSource::Folder(dir) => dir.display().to_string(),
        TargetSource::Preset(p) => bail!(
            "data.path = \"builtin\" needs a tokenizer: target.model = tiny-tasks, tiny, tiny-moe, tiny-gpt-oss or a model folder, not the {p} \
             preset; \
             use data.path = \"synthetic\" to benchmark presets"
        ),
    };
    let d = &config.data;
    let dir = &d.cache_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("data.cache_dir = {}", dir.display()))?;
    let conversations = dir.join("conversations.jsonl");
    let answered = builtin_dir(config);
    std::fs::create_dir_all(&answered).with_context(|| format!("data.cache_dir: {}", answered.display()))?;
    if !conversations.exists() {
        let text: String = sample_conversations(d.builtin_conversations, config.objective.seed)
            .iter()
            .map(|c| format!("{c}\n"))
            .collect();
        let tmp = dir.join(".conversations.jsonl.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &conversations)?;
    }
    // The tokenizer and template, read once: the responder borrows them for the regeneration, then prepare does.
    let mut assets = ModelAssets::resolve(&model, &Map::new())?;
    let regenerated = answered.join("regenerated.jsonl");
    let done_marker = answered.join(".regenerated.done");
    if !done_marker.exists() {
        tracing::info!(
            conversations = d.builtin_conversations,
            "built-in data: the target answers the sample conversations (once)"
        );
        let target = config.target.source.build_target(&[0], Depth::Full, device, kind)?;
        // The sample conversations' prompts are short: a row holds its reply and a few hundred tokens more.
        let batch = default_batch(&target, d.builtin_max_new_tokens + 512);
        let responder = LocalResponder::new(target, assets, d.builtin_max_new_tokens, Sampling::Greedy, false, batch);
        let opts = RegenerateOptions {
            input: conversations.clone(),
            out: regenerated.clone(),
            max_tokens: d.builtin_max_new_tokens as u32,
            temperature: 0.0,
            seed: 0,
            ignore_eos: false,
            template_kwargs: Map::new(),
            progress: ShowProgress::Lines(Duration::from_secs(10)),
        };
        let report = crate::panic::catch_torch(|| responder.regenerate(&opts))??;
        assets = responder.assets;
        if report.failed > 0 {
            bail!("built-in data: {} conversations could not be regenerated", report.failed);
        }
        std::fs::write(&done_marker, "")?;
    }
    let prepared = answered.join("prepared");
    let opts = PrepareOptions {
        long: Default::default(),
        inputs: vec![regenerated],
        out: prepared.clone(),
        max_len: d.max_len,
        block_size: config.draft_model.block_size,
        // 1 in 16 conversations held out: the prompts of `eval.prompts = "holdout"`.
        holdout: 0.0625,
        seed: config.objective.seed,
        template_kwargs: Map::new(),
        strict: false,
        progress: false,
        force: true,
    };
    prepare(&assets, &opts)?;
    Ok(PreparedSplit::open(Path::new(&prepared), "train", false)?)
}
