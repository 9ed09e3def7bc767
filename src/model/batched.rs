//! Batched generation with the target (`regenerate --local`, the built-in data): many sequences decoded at once over
//! one KV cache of `batch` rows, each row at a length of its own. A row whose sequence ends (a stop token, its token
//! limit) is refilled from the queue (continuous batching); new sequences are prefilled together, right-padded,
//! shortest first (on a GPU at bucketed shapes, so that shapes recur); each step feeds every generating row one token
//! and reads each row's keys up to a bucketed length, masked per row, and on a GPU replays from a CUDA graph captured
//! per step shape. The decisions live in [`Schedule`]; this module runs them on tensors.
//!
//! Tokens are chosen as [`super::generate::generate`] chooses them, one sequence at a time ([`pick_tokens`]): greedy
//! output equals it in f32 and sampled output depends on each sequence's seed alone. In bf16 a batch's make-up may
//! round a logit differently, which flips a token only at a near-tie.
use std::sync::mpsc::Receiver;
use std::time::Instant;

use futures::channel::oneshot;
use tch::Tensor;

use super::attention::{CONTEXT_BUCKET, context_bucket};
use super::batch_schedule::{Done, Job, Prefill, Schedule};
use super::sampling::{DrawKind, RowDraws, Sampling, pick_tokens};
use super::{KvCache, ModelError, Target};
use crate::ffi::graph::CudaGraph;

/// Most padded prompt tokens one prefill runs (bounds its activations).
const PREFILL_TOKENS: usize = 16_384;

/// Rows generated at once by default on a GPU (fewer where their KV cache would not fit) and on a CPU, where more
/// rows only pad more.
const DEFAULT_GPU_ROWS: usize = 256;
const DEFAULT_CPU_ROWS: usize = 32;
/// The share of a device's free memory the default batch's KV cache may take: the rest is for the activations, the
/// CUDA graphs' pools and the allocator's slack.
const CACHE_SHARE: f64 = 0.5;

/// Sequences generated at once by default for `target`, each up to `row_positions` positions (its prompt and its
/// reply): 32 on a CPU; on GPUs 256, or fewer where that many rows' KV cache at that length would take more than
/// half of what a device holding the target's layers has free (a large target, long replies); at least 1. The cache
/// grows as the rows do, so this sizes the default only.
pub fn default_batch(target: &Target, row_positions: usize) -> usize {
    let devices = target.layer_devices();
    if !devices.first().is_some_and(|d| d.is_cuda()) {
        return DEFAULT_CPU_ROWS;
    }
    let c = target.config();
    let positions = context_bucket(row_positions.min(c.positions()).max(1) as i64) as u64;
    let position_bytes = 2 * (c.num_key_value_heads * c.head_dim) as u64 * target.kind().elt_size_in_bytes() as u64;
    // A spread target's layers sit in one contiguous run per device.
    let mut distinct = devices.clone();
    distinct.dedup();
    let mut per_device: Vec<(u64, u64)> = Vec::new();
    for device in distinct {
        let layers = devices.iter().filter(|&&d| d == device).count() as u64;
        let Ok(m) = crate::device::memory_stats(device) else { return DEFAULT_GPU_ROWS };
        per_device.push((m.free_to_this_process(), layers * positions * position_bytes));
    }
    rows_that_fit(&per_device, CACHE_SHARE, DEFAULT_GPU_ROWS)
}

/// The rows whose cache fits `share` of every device's free bytes, `(free, bytes a row)` each: at most `most`, at
/// least 1.
fn rows_that_fit(per_device: &[(u64, u64)], share: f64, most: usize) -> usize {
    per_device
        .iter()
        .filter(|(_, row)| *row > 0)
        .map(|&(free, row)| (free as f64 * share / row as f64) as usize)
        .fold(most, usize::min)
        .max(1)
}

/// The shape a prefill of `rows` prompts, the longest `width` tokens, runs at on a GPU: rows rounded up to a
/// multiple of 8 (of 64 past 64), width to a multiple of 64. Nearly every prefill has a shape of its own, and a new
/// shape costs the libraries' per-shape work (choosing kernels, planning) again; in buckets the shapes recur, at the
/// price of padding.
fn prefill_shape(rows: usize, width: usize) -> (usize, usize) {
    let up = |n: usize, to: usize| n.div_ceil(to) * to;
    (if rows <= 64 { up(rows, 8) } else { up(rows, 64) }, up(width, 64))
}

/// How a batched generation runs.
#[derive(Debug, Clone)]
pub struct BatchSettings {
    /// Sequences decoded at once (cache rows).
    pub batch: usize,
    /// Most tokens a sequence adds (fewer where the model's positions end), unless its request says.
    pub max_new: usize,
    /// Tokens that end a sequence (returned with it).
    pub stop: Vec<i64>,
    /// How tokens are drawn, unless a request says.
    pub sampling: Sampling,
    /// Replay the steps from CUDA graphs where they apply (a dense target on one GPU).
    pub cuda_graphs: bool,
}

/// A sequence to generate, and where its new tokens go.
pub struct Request {
    pub prompt: Vec<i64>,
    /// Draws its sampled tokens ([`pick_tokens`]).
    pub seed: u64,
    /// Its own way of drawing and token limit, in place of the generator's ([`BatchSettings`]).
    pub sampling: Option<Sampling>,
    pub max_new: Option<usize>,
    pub reply: ReplyTo,
}

/// Where a request's new tokens go, or why there are none.
pub type ReplyTo = oneshot::Sender<Result<Vec<i64>, String>>;

/// Where a request's new tokens arrive.
pub type Answer = oneshot::Receiver<Result<Vec<i64>, String>>;

impl Request {
    /// A request for `prompt`'s continuation, and where it arrives.
    pub fn new(prompt: Vec<i64>, seed: u64) -> (Request, Answer) {
        let (reply, answer) = oneshot::channel();
        (Request { prompt, seed, sampling: None, max_new: None, reply }, answer)
    }

    /// This request drawn with `sampling`, up to `max_new` tokens, whatever the generator's settings.
    pub fn drawn(self, sampling: Sampling, max_new: usize) -> Request {
        Request { sampling: Some(sampling), max_new: Some(max_new), ..self }
    }
}

/// A step shape's captured graph (per kind of draw): its inputs, written before each replay, and where it writes the
/// chosen tokens.
struct Captured {
    rows: usize,
    keys: i64,
    draw: DrawKind,
    graph: CudaGraph,
    inputs: StepTensors,
    picked: Tensor,
}

/// One step's inputs on the device.
struct StepTensors {
    ids: Tensor,
    positions: Tensor,
    draws: RowDraws,
}

/// Where a generator's time went (host clocks; a step's time includes waiting for its tokens), for the summaries of
/// the commands that generate: how full its batch ran, what a step and a prefill cost, what the graphs' captures
/// cost, and how long it waited for work with nothing to generate.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct GenerationStats {
    /// The rows the generator holds (`--batch`).
    pub batch: usize,
    pub steps: u64,
    /// Rows generating, summed over the steps.
    pub row_steps: u64,
    /// The steps' time, captures excluded.
    pub step_seconds: f64,
    pub prefills: u64,
    pub prefill_rows: u64,
    /// Prompt tokens the prefills ran, padding included.
    pub prefill_tokens: u64,
    pub prefill_seconds: f64,
    /// The part of `prefill_seconds` the host spent queuing the prefills' work, before waiting for their first
    /// tokens: near all of it, and the host's launches bound prefills; a small part, and the device's work does.
    pub prefill_queue_seconds: f64,
    pub captures: u64,
    pub capture_seconds: f64,
    pub idle_seconds: f64,
}

impl GenerationStats {
    /// One line: `N steps of R rows on average (of BATCH), X ms each; ...`; empty when nothing was generated.
    pub fn summary(&self) -> String {
        if self.steps == 0 && self.prefills == 0 {
            return String::new();
        }
        let per = |seconds: f64, n: u64| 1e3 * seconds / n.max(1) as f64;
        format!(
            "{} steps of {:.0} rows on average (of {}), {:.2} ms each; {} prefills of {:.0} prompts on average, \
             {:.1} ms each ({:.1} of it queuing the work; {:.0} padded tokens on average); {} graph captures, \
             {:.1} s; {:.1} s waiting for work",
            self.steps,
            self.row_steps as f64 / self.steps.max(1) as f64,
            self.batch,
            per(self.step_seconds, self.steps),
            self.prefills,
            self.prefill_rows as f64 / self.prefills.max(1) as f64,
            per(self.prefill_seconds, self.prefills),
            per(self.prefill_queue_seconds, self.prefills),
            self.prefill_tokens as f64 / self.prefills.max(1) as f64,
            self.captures,
            self.capture_seconds,
            self.idle_seconds,
        )
    }
}

/// See the module documentation.
pub struct BatchGenerator<'a> {
    target: &'a Target,
    settings: BatchSettings,
    cache: Option<KvCache>,
    graphs: Vec<Captured>,
    graphs_apply: bool,
    /// Whether prefills run at bucketed shapes ([`prefill_shape`]), padding rows written to a scratch cache row.
    prefill_buckets: bool,
    stats: GenerationStats,
}

impl<'a> BatchGenerator<'a> {
    pub fn new(target: &'a Target, settings: BatchSettings) -> Result<Self, ModelError> {
        if target.config().positions() == 0 {
            return Err(ModelError::Batch("the target has no positions to generate at".into()));
        }
        let graphs_apply = settings.cuda_graphs && CudaGraph::available(target.device()) && target.graphable();
        let settings = BatchSettings { batch: settings.batch.max(1), ..settings };
        let stats = GenerationStats { batch: settings.batch, ..GenerationStats::default() };
        let prefill_buckets =
            target.device().is_cuda() && std::env::var("DFLASH_PREFILL_BUCKETS").map_or(true, |v| v != "0");
        Ok(BatchGenerator { target, settings, cache: None, graphs: Vec::new(), graphs_apply, prefill_buckets, stats })
    }

    /// Prefills at bucketed shapes or at each prefill's own (the default: on a GPU bucketed, unless
    /// `DFLASH_PREFILL_BUCKETS=0`; on a CPU, where padding costs its compute, not). Before the first prefill.
    pub fn with_prefill_buckets(mut self, on: bool) -> Self {
        self.prefill_buckets = on;
        self
    }

    /// Where the time went so far.
    pub fn stats(&self) -> GenerationStats {
        self.stats
    }

    /// Whether steps replay from CUDA graphs.
    pub fn graphed(&self) -> bool {
        self.graphs_apply
    }

    /// Generates for every request received until the senders are gone, answering each as its sequence ends.
    /// On a failure every request held is answered with it, and it is returned.
    pub fn serve(&mut self, requests: &Receiver<Request>) -> Result<(), ModelError> {
        let s = &self.settings;
        let mut schedule: Schedule<ReplyTo> = Schedule::new(s.batch, s.stop.clone(), PREFILL_TOKENS, CONTEXT_BUCKET);
        let result = self.run(&mut schedule, requests);
        if let Err(e) = &result {
            for reply in schedule.drain() {
                let _ = reply.send(Err(e.to_string()));
            }
        }
        result
    }

    /// Generates for each prompt (seeded by its index): the new tokens of each, in order. For tests and benchmarks.
    pub fn generate_all(&mut self, prompts: &[Vec<i64>]) -> Result<Vec<Vec<i64>>, ModelError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut answers = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let (request, answer) = Request::new(prompt.clone(), i as u64);
            let _ = tx.send(request);
            answers.push(answer);
        }
        drop(tx);
        self.serve(&rx)?;
        answers
            .into_iter()
            .map(|a| match futures::executor::block_on(a) {
                Ok(Ok(tokens)) => Ok(tokens),
                Ok(Err(e)) => Err(ModelError::Batch(e)),
                Err(_) => Err(ModelError::Batch("a request was dropped unanswered".into())),
            })
            .collect()
    }

    fn run(&mut self, schedule: &mut Schedule<ReplyTo>, requests: &Receiver<Request>) -> Result<(), ModelError> {
        let positions = self.target.config().positions();
        let mut open = true;
        loop {
            // Wait for work when there is none; take whatever else is waiting.
            if schedule.idle() {
                let waiting = Instant::now();
                let received = requests.recv();
                self.stats.idle_seconds += waiting.elapsed().as_secs_f64();
                match received {
                    Ok(request) => self.submit(schedule, request, positions),
                    Err(_) => return Ok(()),
                }
            }
            while open {
                match requests.try_recv() {
                    Ok(request) => self.submit(schedule, request, positions),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            // Sequences nobody waits for any more (a caller that has what it needs) stop here.
            schedule.cancel(oneshot::Sender::is_canceled);
            for prefill in schedule.admit() {
                let (rows, width) = self.shape_of(&prefill);
                // The padded prompts, and the position the first step writes.
                self.ensure_capacity(width.max(prefill.width() + 1) as i64)?;
                let started = Instant::now();
                let first = self.prefill(&prefill, (rows, width), started)?;
                self.stats.prefills += 1;
                self.stats.prefill_rows += prefill.rows.len() as u64;
                self.stats.prefill_tokens += (rows * width) as u64;
                self.stats.prefill_seconds += started.elapsed().as_secs_f64();
                answer(schedule.started(&prefill, &first));
            }
            if let Some(input) = schedule.step_input() {
                self.ensure_capacity(input.keys)?;
                let (started, captured_before) = (Instant::now(), self.stats.capture_seconds);
                let tokens = self.step(&input)?;
                self.stats.steps += 1;
                self.stats.row_steps += schedule.active() as u64;
                let captured = self.stats.capture_seconds - captured_before;
                self.stats.step_seconds += started.elapsed().as_secs_f64() - captured;
                answer(schedule.stepped(&tokens));
            } else if !open && schedule.idle() {
                return Ok(());
            }
        }
    }

    fn submit(&self, schedule: &mut Schedule<ReplyTo>, request: Request, positions: usize) {
        // Past the model's positions a sequence ends where it is, as a length limit does.
        let wanted = request.max_new.unwrap_or(self.settings.max_new);
        let limit = wanted.min(positions.saturating_sub(request.prompt.len()));
        let sampling = request.sampling.unwrap_or(self.settings.sampling);
        let job = Job { limit, prompt: request.prompt, seed: request.seed, sampling, tag: request.reply };
        if let Some(done) = schedule.submit(job) {
            answer(vec![done]);
        }
    }

    /// Makes the cache hold `positions` per row. It grows as the sequences do (to twice its size at least, so it
    /// seldom grows), keeping what the rows hold; graphs captured over the old one are dropped.
    fn ensure_capacity(&mut self, positions: i64) -> Result<(), ModelError> {
        let have = self.cache.as_ref().map_or(0, KvCache::capacity);
        if positions <= have {
            return Ok(());
        }
        let most = context_bucket(self.target.config().positions() as i64);
        let capacity = context_bucket(positions).max((2 * have).min(most));
        // With bucketed prefills, one row more: the scratch row their padding rows write to.
        let rows = (self.settings.batch + usize::from(self.prefill_buckets)) as i64;
        let grown = self.target.new_rows_cache(rows, capacity).map_err(|e| {
            ModelError::Batch(format!(
                "a KV cache of {rows} rows x {capacity} positions: {e}; answer fewer conversations at once (--batch)"
            ))
        })?;
        if let Some(old) = &self.cache {
            grown.copy_from(old)?;
        }
        self.cache = Some(grown);
        self.graphs.clear();
        Ok(())
    }

    /// The rows and width `prefill` runs at: its own, or bucketed ([`prefill_shape`]).
    fn shape_of(&self, prefill: &Prefill) -> (usize, usize) {
        let own = (prefill.rows.len(), prefill.width());
        if !self.prefill_buckets {
            return own;
        }
        let (rows, width) = prefill_shape(own.0, own.1);
        (rows, width.min(self.target.config().positions()))
    }

    /// Runs `prefill` (begun at `started`) at `rows` x `width` (its own shape or more: the padding rows, one-token
    /// prompts of greedy draws, write the scratch row): the first token of each of its sequences.
    fn prefill(
        &mut self,
        prefill: &Prefill,
        (rows, width): (usize, usize),
        started: Instant,
    ) -> Result<Vec<i64>, ModelError> {
        let device = self.target.device();
        let n = prefill.rows.len();
        let padding = rows - n;
        let lengths: Vec<i64> =
            prefill.prompts.iter().map(|p| p.len() as i64).chain(std::iter::repeat_n(1, padding)).collect();
        let padded: Vec<i64> = prefill
            .prompts
            .iter()
            .flat_map(|p| p.iter().copied().chain(std::iter::repeat_n(0, width - p.len())))
            .chain(std::iter::repeat_n(0, padding * width))
            .collect();
        let ids = Tensor::f_from_slice(&padded)?.f_view([rows as i64, width as i64])?.f_to(device)?;
        let scratch = self.settings.batch as i64;
        let cache_rows: Vec<i64> =
            prefill.rows.iter().map(|&r| r as i64).chain(std::iter::repeat_n(scratch, padding)).collect();
        let cache_rows = Tensor::f_from_slice(&cache_rows)?.f_to(device)?;
        // Every input copied before the work is queued (a copy from the host waits for the work queued before it),
        // so that the host's queuing time is measured apart from the device's work.
        let samplings: Vec<Sampling> =
            prefill.samplings.iter().copied().chain(std::iter::repeat_n(Sampling::Greedy, padding)).collect();
        let seeds: Vec<u64> = prefill.seeds.iter().copied().chain(std::iter::repeat_n(0, padding)).collect();
        let draws = RowDraws::new(&samplings, &seeds, &vec![0; rows])?.to(device)?;
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::Batch("no cache before a prefill".into()))?;
        let logits = self.target.prefill_rows(&ids, &lengths, &cache_rows, cache)?;
        let picked = pick_tokens(&logits, &draws)?.f_narrow(0, 0, n as i64)?;
        self.stats.prefill_queue_seconds += started.elapsed().as_secs_f64();
        Ok(Vec::try_from(picked.f_to(tch::Device::Cpu)?)?)
    }

    /// Runs one step: the token each row of `input` draws.
    fn step(&mut self, input: &super::batch_schedule::StepInput) -> Result<Vec<i64>, ModelError> {
        let device = self.target.device();
        let host = StepTensors {
            ids: Tensor::f_from_slice(&input.tokens)?.f_view([input.rows as i64, 1])?,
            positions: Tensor::f_from_slice(&input.positions)?,
            draws: RowDraws::new(&input.samplings, &input.seeds, &input.steps)?,
        };
        let target = self.target;
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::Batch("no cache before a step".into()))?;
        let run = |t: &StepTensors, cache: &mut KvCache| -> Result<Tensor, ModelError> {
            let logits = target.step_rows(&t.ids, &t.positions, input.keys, cache)?;
            pick_tokens(&logits, &t.draws)
        };
        let picked = if self.graphs_apply {
            match graphed_step(&mut self.graphs, &mut self.stats, target, cache, input, &host, run) {
                Ok(picked) => picked,
                Err(e) => {
                    tracing::warn!("generating without CUDA graphs from here: {e}");
                    self.graphs_apply = false;
                    self.graphs.clear();
                    run(&host.to(device)?, cache)?
                }
            }
        } else {
            run(&host.to(device)?, cache)?
        };
        Ok(Vec::try_from(picked.f_to(tch::Device::Cpu)?)?)
    }
}

/// The step of `input`'s shape from its graph (captured at first use, counted in `stats`): its inputs written,
/// replayed.
fn graphed_step(
    graphs: &mut Vec<Captured>,
    stats: &mut GenerationStats,
    target: &Target,
    cache: &mut KvCache,
    input: &super::batch_schedule::StepInput,
    host: &StepTensors,
    run: impl Fn(&StepTensors, &mut KvCache) -> Result<Tensor, ModelError>,
) -> Result<Tensor, ModelError> {
    let draw = host.draws.kind;
    let index = match graphs.iter().position(|g| g.rows == input.rows && g.keys == input.keys && g.draw == draw) {
        Some(i) => i,
        None => {
            let started = Instant::now();
            let inputs = host.to(target.device())?;
            let (graph, picked) = CudaGraph::capture(target.device(), 2, || run(&inputs, cache))
                .map_err(|e| ModelError::Torch(format!("capturing a step of {} rows: {e}", input.rows)))?;
            graphs.push(Captured { rows: input.rows, keys: input.keys, draw, graph, inputs, picked });
            stats.captures += 1;
            stats.capture_seconds += started.elapsed().as_secs_f64();
            graphs.len() - 1
        }
    };
    let g = &graphs[index];
    g.inputs.copy_from(host)?;
    g.graph.replay().map_err(|e| ModelError::Torch(e.to_string()))?;
    Ok(g.picked.shallow_clone())
}

impl StepTensors {
    fn to(&self, device: tch::Device) -> Result<StepTensors, ModelError> {
        Ok(StepTensors {
            ids: self.ids.f_to(device)?,
            positions: self.positions.f_to(device)?,
            draws: self.draws.to(device)?,
        })
    }

    fn copy_from(&self, host: &StepTensors) -> Result<(), ModelError> {
        self.ids.shallow_clone().f_copy_(&host.ids)?;
        self.positions.shallow_clone().f_copy_(&host.positions)?;
        self.draws.copy_from(&host.draws)
    }
}

/// Sends each finished sequence's tokens (a requester that stopped waiting has nothing to receive).
fn answer(done: Vec<Done<ReplyTo>>) {
    for d in done {
        let _ = d.tag.send(Ok(d.tokens));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::generate::generate;
    use crate::model::presets::tiny;
    use crate::model::{Depth, Preset};
    use tch::Device;
    use tch::Kind;

    /// Prefills run at rows rounded up to 8 (64 past 64) and widths to 64: few shapes, little padding.
    #[test]
    fn prefill_shapes_come_in_buckets() {
        assert_eq!(prefill_shape(1, 1), (8, 64));
        assert_eq!(prefill_shape(35, 290), (40, 320));
        assert_eq!(prefill_shape(64, 64), (64, 64));
        assert_eq!(prefill_shape(65, 65), (128, 128));
        assert_eq!(prefill_shape(256, 512), (256, 512));
    }

    /// The default batch is the most rows whose cache fits half of every device's free memory, within 1..=most.
    #[test]
    fn the_default_batch_fits_the_cache_in_half_the_free_memory() {
        const GIB: u64 = 1 << 30;
        // The tests' real model on an H100: 30 layers x 2 x 3 heads x 64 x 2 bytes x 1,024 positions, 23.6 MB a row.
        let small = 30 * 2 * 3 * 64 * 2 * 1024;
        assert_eq!(rows_that_fit(&[(78 * GIB, small)], 0.5, 256), 256, "a small target: the most");
        // Qwen3-8B's cache at 4,096 positions (36 x 2 x 8 x 128 x 2 bytes each, 604 MB a row), 62 GiB free.
        let large = 36 * 2 * 8 * 128 * 2 * 4096;
        assert_eq!(rows_that_fit(&[(62 * GIB, large)], 0.5, 256), 55);
        // Spread over two devices: the fuller one decides.
        assert_eq!(rows_that_fit(&[(62 * GIB, large / 2), (20 * GIB, large / 2)], 0.5, 256), 35);
        assert_eq!(rows_that_fit(&[(GIB, large)], 0.5, 256), 1, "never none");
        assert_eq!(rows_that_fit(&[], 0.5, 256), 256);
    }

    fn settings(batch: usize, max_new: usize, stop: Vec<i64>, sampling: Sampling) -> BatchSettings {
        BatchSettings { batch, max_new, stop, sampling, cuda_graphs: true }
    }

    /// Prompts of many lengths, some of the built-in task model's chat prompts among them.
    fn prompts() -> Vec<Vec<i64>> {
        let assets = crate::data::prepare::ModelAssets::tiny(&Default::default());
        let chat = |text: &str| -> Vec<i64> {
            let messages = [serde_json::json!({"role": "user", "content": text})];
            let prompt = assets.template.render(&messages, None, true).unwrap();
            assets.tokenizer.encode(&prompt).unwrap().ids.iter().map(|&t| t as i64).collect()
        };
        let mut prompts = vec![chat("Count from 17 to 33."), chat("Count from 3 to 9."), chat("Reverse: abc")];
        prompts.extend((1..8).map(|n| (0..3 * n).map(|i| 20 + (i * 7 + n) % 200).collect::<Vec<i64>>()));
        prompts.push(chat("Count from 90 to 95."));
        prompts
    }

    /// Batched output equals one-at-a-time generation (f32) for every sequence, greedy and sampled, whatever the
    /// batch: rows ending at a stop token or their limit are refilled while others run, on the dense targets, with
    /// experts, and with attention sinks and sliding windows.
    #[test]
    fn batched_generation_equals_one_sequence_at_a_time() {
        let prompts = prompts();
        let stop = vec![tiny::IM_END];
        for preset in [Preset::TinyTasks, Preset::Tiny, Preset::TinyMoe, Preset::TinyGptOss] {
            let target = preset.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
            let nucleus = Sampling::new(0.9, 0.8).unwrap();
            for sampling in [Sampling::Greedy, Sampling::temperature(0.9), nucleus] {
                let alone: Vec<Vec<i64>> = (prompts.iter().enumerate())
                    .map(|(i, p)| generate(&target, p, 24, &stop, sampling, i as u64).unwrap())
                    .collect();
                if preset == Preset::TinyTasks && sampling == Sampling::Greedy {
                    assert!(alone.iter().any(|a| a.len() < 24), "some end at their stop token");
                }
                let batches: &[usize] = if preset == Preset::TinyTasks { &[1, 3, 8] } else { &[3] };
                // Prefills at their own shapes, and at batch 3 at bucketed ones too (a GPU's: padding rows into the
                // scratch row).
                let runs = batches.iter().flat_map(|&b| [(b, false)].into_iter().chain((b == 3).then_some((b, true))));
                for (batch, buckets) in runs {
                    let g = BatchGenerator::new(&target, settings(batch, 24, stop.clone(), sampling)).unwrap();
                    let mut g = g.with_prefill_buckets(buckets);
                    let together = g.generate_all(&prompts).unwrap();
                    assert_eq!(together, alone, "{preset:?}, {sampling:?}, batch {batch}, buckets {buckets}");
                    // Each sequence's first token comes from a prefill, every other from a step of its row.
                    let stats = g.stats();
                    let tokens: u64 = together.iter().map(|t| t.len() as u64).sum();
                    assert_eq!(
                        (stats.prefill_rows, stats.row_steps + stats.prefill_rows),
                        (prompts.len() as u64, tokens)
                    );
                    assert!(stats.row_steps <= stats.steps * batch as u64 && stats.captures == 0);
                    assert!(stats.summary().starts_with(&format!("{} steps of ", stats.steps)));
                }
            }
        }
    }

    /// Requests drawing each their own way in one batch (greedy answers beside sampled questions, some cut to a
    /// nucleus) and with their own limits get what each gets alone (f32).
    #[test]
    fn requests_with_their_own_draws_and_limits_get_what_they_get_alone() {
        let prompts = prompts();
        let target = Preset::TinyTasks.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let ways = [Sampling::Greedy, Sampling::temperature(1.0), Sampling::new(1.0, 0.7).unwrap()];
        let way = |i: usize| (ways[i % 3], 6 + 5 * (i % 4));
        let stop = vec![tiny::IM_END];
        let alone: Vec<Vec<i64>> = (prompts.iter().enumerate())
            .map(|(i, p)| generate(&target, p, way(i).1, &stop, way(i).0, i as u64).unwrap())
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let answers: Vec<Answer> = (prompts.iter().enumerate())
            .map(|(i, p)| {
                let (request, answer) = Request::new(p.clone(), i as u64);
                tx.send(request.drawn(way(i).0, way(i).1)).unwrap();
                answer
            })
            .collect();
        drop(tx);
        let mut g = BatchGenerator::new(&target, settings(4, 40, stop, Sampling::Greedy)).unwrap();
        g.serve(&rx).unwrap();
        let together: Vec<Vec<i64>> =
            answers.into_iter().map(|a| futures::executor::block_on(a).unwrap().unwrap()).collect();
        assert_eq!(together, alone);
        assert!((0..prompts.len()).all(|i| together[i].len() <= way(i).1));
    }

    /// A sequence's follow-up that arrives while others run, longer than the cache held: the cache grows, keeping
    /// what the running rows hold; at the model's positions a sequence ends where it is; an empty prompt gets nothing.
    #[test]
    fn later_longer_requests_grow_the_cache_and_positions_end_sequences() {
        let target = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let limit = target.config().positions();
        let short: Vec<i64> = vec![30, 31, 32];
        let long: Vec<i64> = (0..300).map(|i| 10 + i % 90).collect();
        let edge: Vec<i64> = (0..limit as i64 - 3).map(|i| 10 + i % 50).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let ask = |tx: &std::sync::mpsc::Sender<Request>, prompt: &Vec<i64>, seed: u64| {
            let (request, answer) = Request::new(prompt.clone(), seed);
            tx.send(request).unwrap();
            answer
        };
        let first = ask(&tx, &short, 0);
        let empty = ask(&tx, &vec![], 1);
        let mut g = BatchGenerator::new(&target, settings(4, 40, vec![], Sampling::Greedy)).unwrap();
        let (short, long, edge) = (&short, &long, &edge);
        let follow_up = std::thread::scope(|scope| {
            let asker = scope.spawn(move || {
                let answer = futures::executor::block_on(first).unwrap().unwrap();
                let mut second = short.clone();
                second.extend(&answer);
                second.extend(long);
                let at_edge = ask(&tx, edge, 3);
                let follow = ask(&tx, &second, 2);
                drop(tx);
                let get =
                    |a: oneshot::Receiver<Result<Vec<i64>, String>>| futures::executor::block_on(a).unwrap().unwrap();
                (answer, second, get(follow), get(at_edge))
            });
            g.serve(&rx).unwrap();
            asker.join().unwrap()
        });
        let (answer, second, follow, at_edge) = follow_up;
        assert_eq!(futures::executor::block_on(empty).unwrap().unwrap(), Vec::<i64>::new());
        assert_eq!(answer, generate(&target, short, 40, &[], Sampling::Greedy, 0).unwrap());
        assert_eq!(follow, generate(&target, &second, 40, &[], Sampling::Greedy, 2).unwrap());
        assert_eq!(at_edge.len(), 3, "the model's positions end it");
        assert_eq!(at_edge, generate(&target, edge, 40, &[], Sampling::Greedy, 3).unwrap());
    }

    /// On a GPU: steps replayed from CUDA graphs generate what eager steps generate, and prefills at bucketed
    /// shapes (a GPU's default) what prefills at their own shapes do (f32).
    #[test]
    #[ignore = "needs a GPU"]
    fn replayed_steps_generate_what_eager_steps_generate() {
        let device = crate::ffi::graph::graph_gpu_for_tests();
        let target = Preset::TinyTasks.spec().build_target(Depth::Full, device, Kind::Float).unwrap();
        let prompts = prompts();
        let run_at = |graphs: bool, mixed: bool, buckets: bool| {
            let s = BatchSettings { cuda_graphs: graphs, ..settings(4, 30, vec![tiny::IM_END], Sampling::Greedy) };
            let mut g = BatchGenerator::new(&target, s).unwrap().with_prefill_buckets(buckets);
            assert_eq!(g.graphed(), graphs);
            if !mixed {
                return g.generate_all(&prompts).unwrap();
            }
            // Greedy, sampled and nucleus rows in one batch: a graph per kind of draw.
            let ways = [Sampling::Greedy, Sampling::temperature(1.0), Sampling::new(1.0, 0.7).unwrap()];
            let (tx, rx) = std::sync::mpsc::channel();
            let answers: Vec<Answer> = (prompts.iter().enumerate())
                .map(|(i, p)| {
                    let (request, answer) = Request::new(p.clone(), i as u64);
                    tx.send(request.drawn(ways[i % 3], 30)).unwrap();
                    answer
                })
                .collect();
            drop(tx);
            g.serve(&rx).unwrap();
            answers.into_iter().map(|a| futures::executor::block_on(a).unwrap().unwrap()).collect::<Vec<_>>()
        };
        let run = |graphs: bool, mixed: bool| run_at(graphs, mixed, true);
        assert_eq!(run(true, false), run(false, false));
        assert_eq!(run(true, true), run(false, true));
        assert_eq!(run_at(true, true, false), run(true, true), "prefills at their own shapes");
    }
}
