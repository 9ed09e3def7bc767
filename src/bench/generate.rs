//! `dflash bench --what generate`: batched generation ([`BatchGenerator`], the engine of `regenerate --local` and the
//! built-in data) on random prompts, every answer run to `max_new` tokens (no stop token, as `--ignore-eos` does), so
//! the work is fixed and comparable with HuggingFace's batched `generate` given `min_new_tokens = max_new_tokens`.
//! Greedy; one untimed warm-up batch first (CUDA graphs are captured there). With `check`, the first prompts are
//! decoded again one at a time ([`greedy`]) and compared: in f32 they must agree; in bf16 a batch's make-up may
//! round a logit differently, and each first difference is reported with the one-at-a-time step's top-2 gap (a
//! near-tie, or a bug).
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::BenchError;
use crate::device::{self, device_name, kind_name};
use crate::model::batched::{BatchGenerator, BatchSettings};
use crate::model::sampling::Sampling;
use crate::model::speculative::greedy;
use crate::model::{Decoder, Target};

#[derive(Debug, Clone)]
pub struct GenerateBenchOptions {
    /// Sequences decoded at once.
    pub batch: usize,
    /// Prompts generated for (several batches' worth keeps rows refilling).
    pub prompts: usize,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// New tokens per prompt.
    pub max_new: usize,
    pub cuda_graphs: bool,
    /// Prompts decoded again one at a time and compared.
    pub check: usize,
}

/// A checked prompt's first difference between batched and one-at-a-time decoding.
#[derive(Debug, Serialize)]
pub struct BatchDivergence {
    pub prompt: usize,
    /// Index among the new tokens.
    pub position: usize,
    /// The one-at-a-time step's top-1 minus top-2 logit there (f32).
    pub top2_gap: f32,
}

/// Batched against one-at-a-time decoding of the first prompts.
#[derive(Debug, Serialize)]
pub struct BatchCheck {
    pub prompts: usize,
    pub identical: usize,
    pub divergences: Vec<BatchDivergence>,
}

#[derive(Debug, Serialize)]
pub struct GenerateBenchReport {
    pub what: &'static str,
    pub target: String,
    pub device: String,
    pub dtype: &'static str,
    pub batch: usize,
    pub prompts: usize,
    pub prompt_len: usize,
    pub max_new: usize,
    pub cuda_graphs: bool,
    pub new_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub peak_mem_bytes: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<BatchCheck>,
}

impl GenerateBenchReport {
    pub fn summary(&self) -> String {
        let check = match &self.check {
            None => String::new(),
            Some(c) => {
                let gaps: Vec<String> = c.divergences.iter().map(|d| format!("{:.3}", d.top2_gap)).collect();
                format!(
                    "; one at a time: {} of {} identical{}",
                    c.identical,
                    c.prompts,
                    if gaps.is_empty() { String::new() } else { format!(", top-2 gaps where not: {}", gaps.join(" ")) }
                )
            }
        };
        format!(
            "generate {} on {} ({}): {} prompts of {} tokens + {} new, batch {}{}: {} tokens in {:.2} s, {:.0} tokens/s{}",
            self.target,
            self.device,
            self.dtype,
            self.prompts,
            self.prompt_len,
            self.max_new,
            self.batch,
            if self.cuda_graphs { ", CUDA graphs" } else { "" },
            self.new_tokens,
            self.seconds,
            self.tokens_per_s,
            check
        )
    }
}

/// Random prompt ids below `vocab`, the same for every run with these settings.
fn random_prompts(count: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count).map(|_| (0..len).map(|_| rng.random_range(0..vocab as i64)).collect()).collect()
}

pub fn bench_generate(
    target: &Target,
    name: &str,
    opts: &GenerateBenchOptions,
) -> Result<GenerateBenchReport, BenchError> {
    if opts.batch == 0 || opts.prompts == 0 || opts.prompt_len == 0 || opts.max_new == 0 {
        return Err(BenchError::Settings("batch, prompts, prompt length and new tokens must be at least 1".into()));
    }
    let positions = target.config().positions();
    if opts.prompt_len + opts.max_new > positions {
        return Err(BenchError::Settings(format!(
            "{} prompt + {} new tokens exceed the target's {positions} positions",
            opts.prompt_len, opts.max_new
        )));
    }
    let dev = target.device();
    let settings = BatchSettings {
        batch: opts.batch,
        max_new: opts.max_new,
        stop: Vec::new(),
        sampling: Sampling::Greedy,
        cuda_graphs: opts.cuda_graphs,
    };
    let mut generator = BatchGenerator::new(target, settings)?;
    let vocab = target.config().vocab_size;
    let warmup = random_prompts(opts.batch.min(opts.prompts), opts.prompt_len, vocab, 1);
    generator.generate_all(&warmup)?;
    device::synchronize(dev)?;
    device::reset_peak_memory(dev)?;
    let prompts = random_prompts(opts.prompts, opts.prompt_len, vocab, 2);
    let start = std::time::Instant::now();
    let answers = generator.generate_all(&prompts)?;
    device::synchronize(dev)?;
    let seconds = start.elapsed().as_secs_f64();
    let new_tokens = answers.iter().map(Vec::len).sum();
    let peak_mem_bytes = device::memory_stats(dev)?.peak_allocated;
    let check = match opts.check {
        0 => None,
        n => Some(check_one_at_a_time(target, &prompts[..n.min(prompts.len())], &answers, opts.max_new)?),
    };
    Ok(GenerateBenchReport {
        what: "generate",
        target: name.to_string(),
        device: device_name(dev),
        dtype: kind_name(target.kind()),
        batch: opts.batch,
        prompts: opts.prompts,
        prompt_len: opts.prompt_len,
        max_new: opts.max_new,
        cuda_graphs: generator.graphed(),
        new_tokens,
        seconds,
        tokens_per_s: new_tokens as f64 / seconds.max(1e-9),
        peak_mem_bytes,
        check,
    })
}

/// Decodes `prompts` one at a time and compares with their batched `answers`.
fn check_one_at_a_time(
    target: &Target,
    prompts: &[Vec<i64>],
    answers: &[Vec<i64>],
    max_new: usize,
) -> Result<BatchCheck, BenchError> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut decoder = Decoder::new(target, (longest + max_new) as i64, &[1])?;
    let mut check = BatchCheck { prompts: prompts.len(), identical: 0, divergences: Vec::new() };
    for (i, (prompt, batched)) in prompts.iter().zip(answers).enumerate() {
        let alone = greedy(&mut decoder, prompt, max_new, &[])?;
        match alone.tokens.iter().zip(batched).position(|(a, b)| a != b) {
            None => check.identical += 1,
            Some(at) => {
                check.divergences.push(BatchDivergence { prompt: i, position: at, top2_gap: alone.choices[at].gap })
            }
        }
    }
    Ok(check)
}
