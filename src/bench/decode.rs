//! `dflash bench --what decode`: batch-1 speculative decoding at a preset's shapes (random weights). Times the two
//! passes of a decoding step on their own, then whole generations:
//! - verify: the target's forward over a block (`[last token, bs - 1 drafted]`) after a `seq`-token prefill, its
//!   cache cropped back after each, so every pass sees the same context;
//! - draft: the drafter's pass (one new context token, then the block), reported as drafted tokens per second
//!   (`bs - 1` per pass);
//! - on a GPU, the same passes replayed from CUDA graphs, and the generations with graphs;
//! - speculative and greedy generation of `steps` tokens after a random prompt, through
//!   [`evaluate_decoding`](crate::train::decode_eval::evaluate_decoding). A random drafter is hardly ever accepted,
//!   so this measures the loop's overhead, not a speed-up.
use std::collections::BTreeMap;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::{BenchError, StepTimes};
use crate::data::SampleId;
use crate::data::prompts::Prompt;
use crate::device::{self, device_name, kind_name};
use crate::ffi::graph::CudaGraph;
use crate::model::speculative::{DFlashProposer, Proposer};
use crate::model::{Decoder, Depth, Drafter, Init, LayerAttention, Preset, Variant};
use crate::profile::Recorder;
use crate::train::decode_eval::{DecodeSettings, Divergence, evaluate_decoding};

#[derive(Debug, Clone)]
pub struct DecodeBenchOptions {
    /// Prompt (context) tokens.
    pub seq: i64,
    pub block_size: usize,
    /// Timed passes of each kind, and tokens generated per generation.
    pub steps: usize,
    pub warmup: usize,
    /// Also time the phases of one verify and one draft pass with device events.
    pub profile: bool,
    /// `draft_model.variant`: DFlash 2's drafting pass adds its convolutions and the selector's walk.
    pub variant: Variant,
    /// Each drafter layer's window and causality (`draft_model.layer_types`, ...).
    pub layer_attention: Vec<LayerAttention>,
}

#[derive(Debug, Serialize)]
pub struct DecodeBenchReport {
    pub what: &'static str,
    pub preset: String,
    pub device: String,
    pub dtype: &'static str,
    pub seq: i64,
    pub block_size: usize,
    /// The drafter's published architecture (`DFlashDraftModel` or `DFlash2DraftModel`).
    pub variant: &'static str,
    /// One-token target step (greedy decoding's unit), same context.
    pub step_ms_p50: f64,
    pub verify_ms_p50: f64,
    pub verify_steps_per_s: f64,
    pub draft_ms_p50: f64,
    pub drafted_tokens_per_s: f64,
    /// Whole generations of `steps` tokens (random drafter: acceptance near 1).
    pub speculative_tokens_per_s: f64,
    pub greedy_tokens_per_s: f64,
    pub decode_acceptance_length: f64,
    pub lossless: bool,
    pub token_match_rate: f64,
    /// Where speculative and greedy output first differ (bf16 near-ties), with the greedy step's top-2 logit gap.
    pub divergences: Vec<Divergence>,
    pub peak_mem_bytes: i64,
    /// The same passes and generations with the target's steps replayed from CUDA graphs (a GPU and a dense
    /// target on one device), in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graphed: Option<GraphedReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_phases_ms: Phases,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify_phases_ms: Phases,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_phases_ms: Phases,
}

#[derive(Debug, Serialize)]
pub struct GraphedReport {
    pub step_ms_p50: f64,
    pub verify_ms_p50: f64,
    /// The drafter's pass replayed from its graph.
    pub draft_ms_p50: f64,
    /// Share of the tokens of one drafting pass (the same inputs) that equal the eager pass's (the graph's attention
    /// sums the softmax in another order: in bf16 a near-tie may go the other way).
    pub drafted_match: f64,
    pub speculative_tokens_per_s: f64,
    pub greedy_tokens_per_s: f64,
    pub lossless: bool,
    /// Largest difference between a verify pass's logits replayed and run eagerly, over the same context.
    pub max_logit_diff: f64,
}

pub fn bench_decode(
    preset: Preset,
    device: Device,
    kind: Kind,
    opts: &DecodeBenchOptions,
) -> Result<DecodeBenchReport, BenchError> {
    super::check_counts(1, opts.seq, opts.steps)?;
    let spec = preset.spec();
    let target = spec.build_target(Depth::Full, device, kind)?;
    let init = match spec.init {
        Init::Portable(_) => Init::Portable(0),
        Init::Device(_) => Init::Device(0),
    };
    let cfg = super::preset_drafter(preset, opts.block_size, &opts.layer_attention, opts.variant)?;
    let drafter = Drafter::new(cfg, device, kind, init)?;
    let vocab = target.config().vocab_size as i64;
    let prompt: Vec<i64> = (0..opts.seq).map(|i| (i * 7919 + 13) % (vocab - 2)).collect();
    let bs = opts.block_size as i64;
    let capacity = opts.seq + bs + opts.steps as i64 + 1;
    device::reset_peak_memory(device)?;

    // Verify passes over a fixed context.
    let mut cache = target.new_cache(capacity)?;
    let prompt_ids = Tensor::f_from_slice(&prompt)?.f_view([1, opts.seq])?.f_to(device)?;
    let context = target.decode_last(&prompt_ids, &mut cache)?.taps;
    let block = prompt_ids.narrow(1, 0, bs);
    let (verify_times, verify_phases_ms) = time_pass(device, opts, || {
        let _ = target.decode(&block, &mut cache)?;
        cache.crop(opts.seq);
        Ok(())
    })?;
    // One-token steps (what greedy decoding runs), same context.
    let token = prompt_ids.narrow(1, 0, 1);
    let (step_times, step_phases_ms) = time_pass(device, opts, || {
        let _ = target.decode(&token, &mut cache)?;
        cache.crop(opts.seq);
        Ok(())
    })?;

    // Draft passes: the prompt's context once, then one new context token per pass.
    let one = context.narrow(1, opts.seq - 1, 1);
    let (first_token, second_token) = (prompt[0], prompt[1]);
    let draft_pass =
        |cuda_graphs: bool, opts: &DecodeBenchOptions| -> Result<(StepTimes, Phases, Vec<i64>), BenchError> {
            let passes = (opts.warmup + opts.steps + 1) as i64;
            let mut proposer = DFlashProposer::new(&drafter, &target, capacity + passes, cuda_graphs)?;
            let _ = proposer.propose(&context.narrow(1, 0, opts.seq - 1), first_token, opts.block_size - 1)?;
            let first = proposer.propose(&one, second_token, opts.block_size - 1)?;
            let (times, phases) = time_pass(device, opts, || {
                let _ = proposer.propose(&one, second_token, opts.block_size - 1)?;
                Ok(())
            })?;
            Ok((times, phases, first))
        };
    let (draft_times, draft_phases_ms, eager_drafted) = draft_pass(false, opts)?;

    let settings = |max_new_tokens: usize, cuda_graphs: bool| DecodeSettings {
        max_new_tokens,
        stop: vec![],
        cuda_graphs,
        progress: false,
    };
    let prompts = [Prompt { id: SampleId::Number(0), input_ids: prompt }];
    let _warm = evaluate_decoding(&target, &drafter, &prompts, &settings(2, false))?;
    let generation = evaluate_decoding(&target, &drafter, &prompts, &settings(opts.steps, false))?;

    // The same, the target's steps replayed from CUDA graphs.
    let mut graphed = None;
    if CudaGraph::available(device) && target.graphable() {
        let mut decoder = Decoder::new(&target, capacity, &[1, bs])?;
        decoder.decode(&prompt_ids)?;
        let replayed = decoder.decode(&block)?.logits;
        let eager = target.decode(&block, &mut cache)?.logits;
        cache.crop(opts.seq);
        let max_logit_diff =
            (replayed.f_to_kind(Kind::Float)? - eager.f_to_kind(Kind::Float)?).f_abs()?.f_max()?.f_double_value(&[])?;
        decoder.crop(opts.seq);
        let plain = DecodeBenchOptions { profile: false, ..opts.clone() };
        let mut pass = |ids: &Tensor| -> Result<StepTimes, BenchError> {
            let (times, _) = time_pass(device, &plain, || {
                let _ = decoder.decode(ids)?;
                decoder.crop(opts.seq);
                Ok(())
            })?;
            Ok(times)
        };
        let (verify, step) = (pass(&block)?, pass(&token)?);
        let (draft, _, drafted) = draft_pass(true, &plain)?;
        let same = drafted.iter().zip(&eager_drafted).filter(|(a, b)| a == b).count();
        let _warm = evaluate_decoding(&target, &drafter, &prompts, &settings(2, true))?;
        let generation = evaluate_decoding(&target, &drafter, &prompts, &settings(opts.steps, true))?;
        graphed = Some(GraphedReport {
            step_ms_p50: step.percentile(50.0),
            verify_ms_p50: verify.percentile(50.0),
            draft_ms_p50: draft.percentile(50.0),
            drafted_match: same as f64 / drafted.len().max(1) as f64,
            speculative_tokens_per_s: generation.speculative_tokens_per_s,
            greedy_tokens_per_s: generation.greedy_tokens_per_s,
            lossless: generation.lossless,
            max_logit_diff,
        });
    }
    drop(cache);
    let verify_ms = verify_times.percentile(50.0);
    let draft_ms = draft_times.percentile(50.0);
    Ok(DecodeBenchReport {
        what: "decode",
        preset: preset.name().to_string(),
        device: device_name(device),
        dtype: kind_name(kind),
        seq: opts.seq,
        block_size: opts.block_size,
        variant: opts.variant.architecture(),
        step_ms_p50: step_times.percentile(50.0),
        verify_ms_p50: verify_ms,
        verify_steps_per_s: 1e3 / verify_ms,
        draft_ms_p50: draft_ms,
        drafted_tokens_per_s: (opts.block_size - 1) as f64 * 1e3 / draft_ms,
        speculative_tokens_per_s: generation.speculative_tokens_per_s,
        greedy_tokens_per_s: generation.greedy_tokens_per_s,
        decode_acceptance_length: generation.decode_acceptance_length,
        lossless: generation.lossless,
        token_match_rate: generation.token_match_rate,
        divergences: generation.divergences,
        peak_mem_bytes: device::memory_stats(device)?.peak_allocated,
        graphed,
        step_phases_ms,
        verify_phases_ms,
        draft_phases_ms,
    })
}

type Phases = Option<BTreeMap<&'static str, f64>>;

/// Warms `pass` up, times `opts.steps` runs, and with `opts.profile` the phases of one more from device events.
fn time_pass(
    device: Device,
    opts: &DecodeBenchOptions,
    mut pass: impl FnMut() -> Result<(), BenchError>,
) -> Result<(StepTimes, Phases), BenchError> {
    for _ in 0..opts.warmup {
        pass()?;
    }
    let times = StepTimes::measure(device, opts.steps, &mut pass)?;
    if !opts.profile {
        return Ok((times, None));
    }
    let recorder = Recorder::start(device);
    pass()?;
    Ok((times, Some(recorder.finish()?)))
}

impl DecodeBenchReport {
    pub fn summary(&self) -> String {
        let graphed = match &self.graphed {
            Some(g) => format!(
                "; from CUDA graphs: one-token step {:.2} ms, verify {:.2} ms, draft {:.2} ms (drafted tokens as eager: \
                 {:.2}), speculative {:.1} tokens/s, greedy {:.1} tokens/s, lossless {}, logits within {:.3} of eager",
                g.step_ms_p50,
                g.verify_ms_p50,
                g.draft_ms_p50,
                g.drafted_match,
                g.speculative_tokens_per_s,
                g.greedy_tokens_per_s,
                g.lossless,
                g.max_logit_diff
            ),
            None => String::new(),
        };
        format!(
            "decode {} on {} ({}), batch 1, context {}, block {}: one-token step {:.2} ms, verify {:.2} ms ({:.1} steps/s), draft {:.2} ms \
             ({:.0} drafted tokens/s); generation: speculative {:.1} tokens/s, greedy {:.1} tokens/s, acceptance \
             {:.2}, lossless {} (match rate {:.3}); peak memory {:.2} GB{graphed}",
            self.preset,
            self.device,
            self.dtype,
            self.seq,
            self.block_size,
            self.step_ms_p50,
            self.verify_ms_p50,
            self.verify_steps_per_s,
            self.draft_ms_p50,
            self.drafted_tokens_per_s,
            self.speculative_tokens_per_s,
            self.greedy_tokens_per_s,
            self.decode_acceptance_length,
            self.lossless,
            self.token_match_rate,
            self.peak_mem_bytes as f64 / 1e9
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_both_passes_and_a_lossless_generation_on_the_tiny_preset() {
        let dflash2 =
            Variant::DFlash2(crate::model::variant::dflash2::Dflash2Shape { selector_rank: 8, ..Default::default() });
        for variant in [Variant::DFlash, dflash2] {
            let opts = DecodeBenchOptions {
                seq: 20,
                block_size: 4,
                steps: 6,
                warmup: 1,
                profile: true,
                variant,
                layer_attention: vec![],
            };
            let r = bench_decode(Preset::Tiny, Device::Cpu, Kind::Float, &opts).unwrap();
            assert_eq!(r.variant, variant.architecture());
            assert!(r.verify_steps_per_s > 0.0 && r.drafted_tokens_per_s > 0.0);
            assert!(r.verify_phases_ms.unwrap().contains_key("target.attention"));
            assert!(r.draft_phases_ms.unwrap().contains_key("drafter.attention"));
            assert!(r.lossless, "f32 decoding is exact ({})", r.variant);
            assert!(r.decode_acceptance_length >= 1.0);
        }
    }
}
