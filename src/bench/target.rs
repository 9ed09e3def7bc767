//! `dflash bench --what target`: the frozen target's hidden-state capture (or the whole stack) on random tokens.
//!
//! FLOP accounting for target capture, per step of `B x S` tokens through `L` layers (as the PyTorch peer counts):
//! `2 * matmul_weights_per_layer * L * B * S` for the projections and MLP, plus `2 * L * (heads * head_dim) * S *
//! B * S` for causal attention (QK^T and PV, half the square each); with `--full`, the LM head adds
//! `2 * hidden * vocab * B * S`. Norms, RoPE and activations are not counted.
use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tch::Tensor;

use super::{BenchError, StepTimes, check_counts};
use crate::device::{self, kind_name};
use crate::model::{Target, TargetConfig};
use crate::profile::Recorder;

/// What to run and how often.
#[derive(Debug, Clone)]
pub struct TargetBenchOptions {
    pub batch: i64,
    pub seq: i64,
    /// Timed steps; the median is reported.
    pub steps: usize,
    /// Untimed steps first (allocator, kernel selection).
    pub warmup: usize,
    /// Run the whole stack and the LM head instead of stopping at the last tap.
    pub full: bool,
    /// Time the phases of one extra step with device events.
    pub profile: bool,
    /// The device's matrix peak in TFLOP/s, for MFU.
    pub peak_tflops: f64,
}

/// One measured run, printed as a JSON line.
#[derive(Debug, Serialize)]
pub struct TargetBenchReport {
    pub what: &'static str,
    /// The preset name or the model folder.
    pub preset: String,
    pub device: String,
    pub dtype: &'static str,
    pub batch: i64,
    pub seq: i64,
    /// Micro-batches each capture ran as ([`Target::set_micro_batches`]).
    pub micro_batches: usize,
    pub full: bool,
    pub layers_run: usize,
    pub taps: Vec<usize>,
    pub steps: usize,
    pub tokens_per_s: f64,
    pub tflops: f64,
    pub mfu: f64,
    pub peak_tflops: f64,
    pub flops_per_step: f64,
    /// Peak bytes held by the caching allocator during the timed steps (weights included); 0 on the CPU.
    pub peak_mem_bytes: i64,
    pub step_ms_p50: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    /// Median milliseconds until the capture call returned, its work queued but not necessarily done: far below the
    /// step time, the host waited on no device inside the call (what lets the parts of a spread target overlap).
    pub queued_ms_p50: f64,
    /// Milliseconds per phase of one step, from device events (with `profile`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_ms: Option<BTreeMap<&'static str, f64>>,
}

/// FLOPs of one capture (or full) step; see the module docs.
pub fn target_flops(cfg: &TargetConfig, layers_run: usize, batch: i64, seq: i64, full: bool) -> f64 {
    let tokens = (batch * seq) as f64;
    let matmul = 2.0 * (0..layers_run).map(|l| cfg.layer_matmul_params(l)).sum::<usize>() as f64 * tokens;
    // 4 x width per attended key (QK^T and PV): `2 * width * seq * tokens` per causal layer, as the peers count it.
    let keys: f64 = (0..layers_run).map(|l| cfg.attended_keys(l, seq as usize)).sum();
    let attention = 4.0 * (cfg.num_attention_heads * cfg.head_dim) as f64 * keys * batch as f64;
    let head = if full { 2.0 * (cfg.hidden_size * cfg.vocab_size) as f64 * tokens } else { 0.0 };
    matmul + attention + head
}

/// The target's device, or where its layers run when it is spread (`cuda:0 layers 0-12, cuda:1 layers 13-33`).
fn placement(target: &Target) -> String {
    match target.parts() {
        1 => device::device_name(target.device()),
        _ => target.placement(),
    }
}

/// Times target capture (or the full stack) on random token ids.
pub fn bench_target(target: &Target, label: &str, opts: &TargetBenchOptions) -> Result<TargetBenchReport, BenchError> {
    check_counts(opts.batch, opts.seq, opts.steps)?;
    let cfg = target.config();
    let dev = target.device();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<i64> = (0..opts.batch * opts.seq).map(|_| rng.random_range(0..cfg.vocab_size as i64)).collect();
    let ids = Tensor::f_from_slice(&ids)?.f_view([opts.batch, opts.seq])?.f_to(dev)?;
    let lengths = vec![opts.seq; opts.batch as usize];
    let step = || -> Result<(), BenchError> {
        let out = if opts.full { target.logits(&ids, &lengths)? } else { target.capture(&ids, &lengths)? };
        drop(out);
        Ok(())
    };
    for _ in 0..opts.warmup {
        step()?;
    }
    device::synchronize(dev)?;
    device::reset_peak_memory(dev)?;
    let mut queued_ms = Vec::with_capacity(opts.steps);
    let times = StepTimes::measure(dev, opts.steps, || {
        let start = std::time::Instant::now();
        step()?;
        queued_ms.push(start.elapsed().as_secs_f64() * 1e3);
        Ok::<(), BenchError>(())
    })?;
    queued_ms.sort_by(f64::total_cmp);
    let peak_mem_bytes = device::memory_stats(dev)?.peak_allocated;
    let phases_ms = if opts.profile {
        let recorder = Recorder::start(dev);
        step()?;
        Some(recorder.finish()?)
    } else {
        None
    };
    let step_ms_p50 = times.percentile(50.0);
    let layers_run = target.layers_run();
    let flops_per_step = target_flops(cfg, layers_run, opts.batch, opts.seq, opts.full);
    let tflops = flops_per_step / (step_ms_p50 * 1e-3) / 1e12;
    Ok(TargetBenchReport {
        what: "target",
        preset: label.to_string(),
        device: placement(target),
        dtype: kind_name(target.kind()),
        batch: opts.batch,
        seq: opts.seq,
        micro_batches: target.micro_batches_for(opts.batch),
        full: opts.full,
        layers_run,
        taps: target.taps().to_vec(),
        steps: opts.steps,
        tokens_per_s: (opts.batch * opts.seq) as f64 / (step_ms_p50 * 1e-3),
        tflops,
        mfu: tflops / opts.peak_tflops,
        peak_tflops: opts.peak_tflops,
        flops_per_step,
        peak_mem_bytes,
        step_ms_p50,
        step_ms_min: times.min(),
        queued_ms_p50: queued_ms[queued_ms.len() / 2],
        step_ms_max: times.max(),
        phases_ms,
    })
}

impl TargetBenchReport {
    /// One line for people; `--json` prints the whole report instead.
    pub fn summary(&self) -> String {
        format!(
            "target {} on {} ({}, {} layers{}): {}x{} tokens in {} micro-batch(es), {:.0} tokens/s, {:.1} TFLOP/s, MFU {:.1}% of {:.0}, \
             step p50 {:.2} ms, peak memory {:.2} GB",
            self.preset,
            self.device,
            self.dtype,
            self.layers_run,
            if self.full { " + LM head" } else { "" },
            self.batch,
            self.seq,
            self.micro_batches,
            self.tokens_per_s,
            self.tflops,
            self.mfu * 100.0,
            self.peak_tflops,
            self.step_ms_p50,
            self.peak_mem_bytes as f64 / 1e9,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use tch::Kind;

    #[test]
    fn flops_match_the_published_formula_at_qwen3_8b_shapes() {
        let cfg = Preset::Qwen3_8b.spec().target;
        // Per layer: q 4096x4096, k and v 1024x4096, o 4096x4096, MLP 3 x 4096x12288.
        assert_eq!(cfg.layer_matmul_params(0), 192_937_984);
        let f = target_flops(&cfg, 34, 16, 2048, false);
        let tokens = 16.0 * 2048.0;
        let expected = 2.0 * 192_937_984.0 * 34.0 * tokens + 2.0 * 34.0 * 4096.0 * 2048.0 * tokens;
        assert_eq!(f, expected);
        assert!(target_flops(&cfg, 36, 1, 8, true) > target_flops(&cfg, 36, 1, 8, false));
    }

    /// A mixture-of-experts layer counts what one token multiplies: the router and its 8 chosen experts of 128.
    #[test]
    fn moe_flops_count_the_active_parameters() {
        let cfg = Preset::Qwen3_30bA3b.spec().target;
        let attention = 2048 * 4096 * 2 + 2 * 2048 * 512;
        let active = attention + 2048 * 128 + 8 * 3 * 2048 * 768;
        assert!((0..48).all(|l| cfg.layer_matmul_params(l) == active));
        // With the embedding and the LM head: Qwen's published 3.3B activated parameters.
        let total = 48 * active + 2 * 151936 * 2048;
        assert!((3.3e9..3.4e9).contains(&(total as f64)), "{total}");
        // A dense layer (mlp_only_layers) counts its dense MLP.
        let tiny = Preset::TinyMoe.spec().target;
        assert_eq!(
            tiny.layer_matmul_params(0) - tiny.layer_matmul_params(1),
            3 * 64 * 192 - (64 * 8 + 2 * 3 * 64 * 64)
        );
    }

    #[test]
    fn reports_a_real_measurement_on_the_tiny_target() {
        let spec = Preset::Tiny.spec();
        let target = spec.build_target(crate::model::Depth::Full, tch::Device::Cpu, Kind::Float).unwrap();
        let opts =
            TargetBenchOptions { batch: 2, seq: 16, steps: 3, warmup: 1, full: true, profile: true, peak_tflops: 1.0 };
        let r = bench_target(&target, "tiny", &opts).unwrap();
        assert!(r.tokens_per_s > 0.0 && r.step_ms_p50 > 0.0);
        assert!(r.step_ms_min <= r.step_ms_p50 && r.step_ms_p50 <= r.step_ms_max);
        assert_eq!(r.layers_run, 8);
        let phases = r.phases_ms.unwrap();
        assert!(phases.contains_key("target.attention") && phases.contains_key("target.mlp"), "{phases:?}");
        let bad = TargetBenchOptions { steps: 0, ..opts };
        assert!(bench_target(&target, "tiny", &bad).is_err());
    }
}
