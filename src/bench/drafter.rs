//! `dflash bench --what drafter`: whole training steps of a preset's drafter (forward, chunked LM head + loss,
//! backward, clipping, AdamW) on random target features, as the PyTorch peer times them; target capture is not in
//! the step (with `capture`, the preset's target capture of the same batch is timed and reported on its own).
//! `--what pipeline` puts the capture into every step: the preset's target (random weights) captures the batch's
//! features, then the drafter trains on them, on one device with no actors: the yardstick for `serve-train`.
//!
//! FLOPs per sample are [`DrafterConfig::training_flops_per_sample`]'s, the peer's cost model.
use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::{BenchError, StepTimes, check_counts};
use crate::device::{self, device_name, kind_name};
use crate::ffi::accel::{AdamwStep, MuonStep};
use crate::model::drafter_config::default_gamma;
use crate::model::{Depth, Drafter, Init, LayerAttention, ModelError, Preset, Variant};
use crate::profile::Recorder;
use crate::train::objective::ObjectiveSettings;
use crate::train::optim::MuonHyper;
use crate::train::{FeatureBatch, Optimizer, OptimizerKind, Teacher, Trainer, UpdateSettings};

#[derive(Debug, Clone)]
pub struct DrafterBenchOptions {
    pub batch: i64,
    pub seq: i64,
    /// Anchors (blocks) per sequence.
    pub anchors: usize,
    pub block_size: usize,
    pub steps: usize,
    pub warmup: usize,
    pub profile: bool,
    /// Also time the preset target's capture of the same batch (reported separately).
    pub capture: bool,
    /// Capture every step's features with the preset's target before the step (`--what pipeline`).
    pub pipeline: bool,
    pub peak_tflops: f64,
    /// Rows of the LM head and loss computed at once; None: the trainer's default.
    pub lm_head_chunk_rows: Option<i64>,
    /// Blocks per attention group; None: the trainer's default.
    pub attention_group_blocks: Option<usize>,
    /// D-PACE's alpha (`objective.weights = "dpace"`); None: the decay.
    pub dpace_alpha: Option<f64>,
    /// `optim.optimizer`.
    pub optimizer: OptimizerKind,
    /// `optim.muon_*`: Muon's momentum, weight decay, steps and iteration (with `optimizer = muon`).
    pub muon: MuonHyper,
    /// What the slots learn (`objective.target`, `objective.loss`): learning the target's predictions adds its
    /// last states to the features and its LM head to the loss.
    pub teacher: Teacher,
    /// Each layer's window and causality (`draft_model.layer_types`, ...); the preset's drafter keeps full attention
    /// when none restricts it.
    pub layer_attention: Vec<LayerAttention>,
    /// `draft_model.variant` (with DFlash 2's sizes) and DFlash 2's `objective.selector_loss_alpha`.
    pub variant: Variant,
    pub selector_loss_alpha: f64,
    /// Conversations per row (`data.pack`): the batch's `batch` conversations of `seq` tokens packed `pack` to a
    /// row of `pack * seq` tokens; 1: a row each.
    pub pack: i64,
}

#[derive(Debug, Serialize)]
pub struct DrafterBenchReport {
    pub what: &'static str,
    pub preset: String,
    pub device: String,
    pub dtype: &'static str,
    pub batch: i64,
    pub seq: i64,
    /// Conversations per row (1: not packed).
    pub pack: i64,
    /// Anchors per sample the step drew: `--anchors`, or fewer when a row has fewer valid positions.
    pub anchors: usize,
    pub block_size: usize,
    pub lm_head_chunk_rows: i64,
    pub attention_group_blocks: usize,
    pub drafter_params: i64,
    pub steps: usize,
    pub samples_per_s: f64,
    pub tokens_per_s: f64,
    pub tflops: f64,
    /// MFU by the peer's cost model: attention counted dense, every query against every key.
    pub mfu: f64,
    /// MFU counting only the keys each query sees (its context up to the anchor, its block, less what windows and
    /// causality hide): [`DrafterConfig::training_flops_seen_keys`](crate::model::DrafterConfig).
    pub mfu_seen_keys: f64,
    pub peak_tflops: f64,
    pub flops_per_sample: f64,
    pub flops_per_sample_seen_keys: f64,
    /// Peak bytes held by the caching allocator during the timed steps; 0 on the CPU.
    pub peak_mem_bytes: i64,
    pub step_ms_p50: f64,
    pub step_ms_p90: f64,
    /// Every timed step, in the order run.
    pub step_ms: Vec<f64>,
    /// The loss of the last timed step (a sanity check that the steps did real work).
    pub loss: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases_ms: Option<BTreeMap<&'static str, f64>>,
    /// Target capture of the same batch, timed on its own (with `capture`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture_ms_p50: Option<f64>,
}

/// Where a step's target features come from.
enum Features {
    /// Captured by the target each step (`pipeline`).
    Captured(Box<crate::model::Target>),
    /// The same random features (and last states, where the objective reads them) every step.
    Fixed(Tensor, Option<Tensor>),
}

/// Times training steps of `preset`'s drafter on `device` (bf16 compute on a GPU, f32 on the CPU).
pub fn bench_drafter(
    preset: Preset,
    device: Device,
    kind: Kind,
    opts: &DrafterBenchOptions,
) -> Result<DrafterBenchReport, BenchError> {
    check_counts(opts.batch, opts.seq, opts.steps)?;
    if opts.pack < 1 || opts.batch % opts.pack != 0 {
        return Err(BenchError::Settings(format!(
            "--pack {}: conversations per row must be at least 1 and divide --batch {}",
            opts.pack, opts.batch
        )));
    }
    // The rows the step trains: `batch / pack` of `pack * seq` tokens.
    let (rows_n, row_len) = (opts.batch / opts.pack, opts.seq * opts.pack);
    let conversations = (opts.pack > 1).then(|| vec![vec![opts.seq as usize; opts.pack as usize]; rows_n as usize]);
    let cfg = super::preset_drafter(preset, opts.block_size, &opts.layer_attention, opts.variant)?;
    let spec = preset.spec();
    if opts.seq as usize > cfg.decoder.positions() {
        return Err(BenchError::Settings(format!(
            "seq {} exceeds the preset's {} positions",
            opts.seq,
            cfg.decoder.positions()
        )));
    }
    let gamma = default_gamma(opts.block_size);
    let mut objective = ObjectiveSettings {
        dpace_alpha: opts.dpace_alpha,
        teacher: opts.teacher,
        selector_loss_alpha: opts.selector_loss_alpha,
        ..ObjectiveSettings::new(opts.anchors, opts.block_size, gamma, cfg.mask_token_id)
    };
    if let Some(rows) = opts.lm_head_chunk_rows {
        if rows < 1 {
            return Err(BenchError::Settings(format!("--lm-head-chunk-rows must be at least 1, got {rows}")));
        }
        objective.lm_head_chunk_rows = rows;
    }
    if let Some(blocks) = opts.attention_group_blocks {
        if blocks < 1 {
            return Err(BenchError::Settings("--attention-group-blocks must be at least 1".into()));
        }
        objective.attention_group_blocks = Some(blocks);
    }
    let attention_group_blocks = objective.group_blocks(device);
    let lm_head_chunk_rows = objective.lm_head_chunk_rows;
    let (v, h) = (cfg.decoder.vocab_size as i64, cfg.decoder.hidden_size as i64);
    let width = cfg.context_width() as i64;
    let init = match spec.init {
        Init::Portable(_) => Init::Portable(0),
        Init::Device(_) => Init::Device(0),
    };
    // The target first, as serve-train builds it, so memory is laid out the same way.
    let with_last = opts.teacher.needs_target_predictions();
    let depth = if with_last { Depth::Full } else { Depth::ToLastTap };
    let target = if opts.pipeline { Some(spec.build_target(depth, device, kind)?) } else { None };
    let drafter = Drafter::new(cfg.clone(), device, kind, init)?;
    let drafter_params = drafter.params().layout().num_params();
    // Frozen embedding, LM head and target features: random, as the peer makes them.
    tch::manual_seed(0);
    let random = |shape: &[i64], std: f64| -> Result<Tensor, ModelError> {
        Ok((Tensor::f_randn(shape, (Kind::Float, device))? * std).f_to_kind(kind)?)
    };
    let embed = random(&[v, h], 0.02)?;
    let lm_head = random(&[v, h], 0.02)?;
    let optimizer = Optimizer::new(drafter.params(), opts.optimizer)?;
    let mut trainer = Trainer::new(drafter, optimizer, embed, lm_head, objective, 0);
    let features = match target {
        Some(target) => Features::Captured(Box::new(target)),
        None => Features::Fixed(
            random(&[rows_n, row_len, width], 0.5)?,
            if with_last { Some(random(&[rows_n, row_len, h], 1.0)?) } else { None },
        ),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let rows: Vec<Vec<i64>> = (0..rows_n).map(|_| (0..row_len).map(|_| rng.random_range(0..v - 2)).collect()).collect();
    let masks = vec![vec![1u8; row_len as usize]; rows_n as usize];
    let update = UpdateSettings {
        adamw: AdamwStep { lr: 6e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
        muon: (opts.optimizer == OptimizerKind::Muon).then_some(MuonStep {
            lr: opts.muon.lr,
            momentum: opts.muon.momentum,
            weight_decay: opts.muon.weight_decay,
            ns_steps: opts.muon.ns_steps,
            iteration: opts.muon.iteration,
        }),
        grad_clip: Some(1.0),
    };
    let mut epoch = 0u64;
    let mut loss = 0.0;
    let mut step = || -> Result<(), BenchError> {
        let sample_ids = (0..opts.batch as u64).collect();
        let batch = match &features {
            Features::Captured(target) => {
                let (ids, mask, conv) = (rows.clone(), masks.clone(), conversations.clone());
                FeatureBatch::capture_packed(target, sample_ids, epoch, ids, mask, conv, (device, kind), with_last)?
            }
            Features::Fixed(hidden, last) => FeatureBatch {
                sample_ids,
                epoch,
                input_ids: rows.clone(),
                loss_mask: masks.clone(),
                conversations: conversations.clone(),
                target_hidden: hidden.shallow_clone(),
                target_last: last.as_ref().map(Tensor::shallow_clone),
            },
        };
        epoch += 1; // fresh anchors every step
        let (metrics, _) = trainer.train_step(std::slice::from_ref(&batch), &update)?;
        loss = metrics.loss();
        Ok(())
    };
    for _ in 0..opts.warmup {
        step()?;
    }
    device::synchronize(device)?;
    device::reset_peak_memory(device)?;
    let times = StepTimes::measure(device, opts.steps, &mut step)?;
    let peak_mem_bytes = device::memory_stats(device)?.peak_allocated;
    let phases_ms = if opts.profile {
        let recorder = Recorder::start(device);
        step()?;
        Some(recorder.finish()?)
    } else {
        None
    };
    drop(trainer);
    let capture_ms_p50 = if opts.capture {
        let target = match features {
            Features::Captured(target) => *target,
            Features::Fixed(..) => spec.build_target(Depth::ToLastTap, device, kind)?,
        };
        let flat: Vec<i64> = rows.concat();
        let ids = Tensor::f_from_slice(&flat)?.f_view([rows_n, row_len])?.f_to(device)?;
        let lengths = vec![row_len; rows_n as usize];
        let packed: Option<Vec<Vec<i64>>> =
            conversations.as_ref().map(|rows| rows.iter().map(|r| r.iter().map(|&l| l as i64).collect()).collect());
        let capture = || -> Result<(), BenchError> {
            match &packed {
                Some(rows) => drop(target.capture_packed(&ids, rows, false)?),
                None => drop(target.capture(&ids, &lengths)?),
            }
            Ok(())
        };
        capture()?;
        Some(StepTimes::measure(device, opts.steps, capture)?.percentile(50.0))
    } else {
        None
    };
    let step_ms_p50 = times.percentile(50.0);
    // FLOPs of the blocks the step drew: no more than the row has valid anchors (every position but the last here).
    let anchors = opts.anchors.min(opts.seq.max(1) as usize - 1);
    let flops_per_sample = cfg.training_flops_per_sample(opts.seq, anchors);
    let flops_per_sample_seen_keys = cfg.training_flops_seen_keys(opts.seq, anchors);
    let samples_per_s = opts.batch as f64 / (step_ms_p50 * 1e-3);
    let tflops = flops_per_sample * samples_per_s / 1e12;
    Ok(DrafterBenchReport {
        what: if opts.pipeline { "pipeline" } else { "drafter" },
        preset: preset.name().to_string(),
        device: device_name(device),
        dtype: kind_name(kind),
        batch: opts.batch,
        seq: opts.seq,
        pack: opts.pack,
        anchors,
        block_size: opts.block_size,
        lm_head_chunk_rows,
        attention_group_blocks,
        drafter_params,
        steps: opts.steps,
        samples_per_s,
        tokens_per_s: samples_per_s * opts.seq as f64,
        tflops,
        mfu: tflops / opts.peak_tflops,
        mfu_seen_keys: flops_per_sample_seen_keys * samples_per_s / 1e12 / opts.peak_tflops,
        peak_tflops: opts.peak_tflops,
        flops_per_sample,
        flops_per_sample_seen_keys,
        peak_mem_bytes,
        step_ms_p50,
        step_ms_p90: times.percentile(90.0),
        step_ms: times.in_order().iter().map(|t| (t * 100.0).round() / 100.0).collect(),
        loss,
        phases_ms,
        capture_ms_p50,
    })
}

impl DrafterBenchReport {
    pub fn summary(&self) -> String {
        format!(
            "{} {} on {} ({}, {} params): batch {} x seq {}, {} anchors, bs {}: {:.2} samples/s, {:.1} TFLOP/s, \
             MFU {:.1}% of {:.0} ({:.1}% counting the keys seen), step p50 {:.1} ms p90 {:.1} ms, peak memory {:.2} GB, loss {:.3}{}",
            self.what,
            self.preset,
            self.device,
            self.dtype,
            self.drafter_params,
            self.batch,
            self.seq,
            self.anchors,
            self.block_size,
            self.samples_per_s,
            self.tflops,
            self.mfu * 100.0,
            self.peak_tflops,
            self.mfu_seen_keys * 100.0,
            self.step_ms_p50,
            self.step_ms_p90,
            self.peak_mem_bytes as f64 / 1e9,
            self.loss,
            self.capture_ms_p50.map(|ms| format!(", target capture of the batch {ms:.1} ms")).unwrap_or_default(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DrafterConfig;

    /// A tiny step's options: `batch` rows of `seq` tokens, `anchors` blocks of 4, one step, nothing else asked for
    /// (the defaults' Muon, AdamW, the data's tokens).
    fn tiny_options(batch: i64, seq: i64, anchors: usize) -> DrafterBenchOptions {
        DrafterBenchOptions {
            batch,
            seq,
            anchors,
            block_size: 4,
            steps: 1,
            warmup: 0,
            profile: false,
            capture: false,
            pipeline: false,
            peak_tflops: 1.0,
            lm_head_chunk_rows: None,
            attention_group_blocks: None,
            dpace_alpha: None,
            optimizer: OptimizerKind::AdamW,
            muon: crate::config::Config::builtin().unwrap().optim.muon,
            teacher: Teacher::Data,
            layer_attention: vec![],
            variant: Variant::DFlash,
            selector_loss_alpha: 1.0,
            pack: 1,
        }
    }

    #[test]
    fn flops_match_the_peer_at_qwen3_8b_shapes() {
        // DFLASH.md / the issue: a step at 768 tokens, 256 anchors is 39.4 TFLOP per sample.
        let cfg = DrafterConfig::for_preset(Preset::Qwen3_8b, 16);
        let f = cfg.training_flops_per_sample(768, 256);
        assert!((f / 1e12 - 39.4).abs() < 0.05, "{}", f / 1e12);
    }

    #[test]
    fn runs_real_steps_on_the_tiny_preset() {
        let opts = DrafterBenchOptions { steps: 2, warmup: 1, profile: true, capture: true, ..tiny_options(2, 24, 4) };
        let r = bench_drafter(Preset::Tiny, Device::Cpu, Kind::Float, &opts).unwrap();
        assert!(r.samples_per_s > 0.0 && r.loss.is_finite() && r.loss > 0.0);
        assert!(r.step_ms_p50 <= r.step_ms_p90);
        assert!(r.capture_ms_p50.unwrap() > 0.0);
        let phases = r.phases_ms.unwrap();
        for phase in ["drafter.attention", "drafter.backward", "lm_head.loss", "optimizer"] {
            assert!(phases.contains_key(phase), "{phase} missing from {phases:?}");
        }
    }

    /// More anchors than a row has are not counted: 16 tokens give 15 valid anchors.
    #[test]
    fn flops_count_the_anchors_that_fit() {
        let opts = tiny_options(1, 16, 1000);
        let r = bench_drafter(Preset::Tiny, Device::Cpu, Kind::Float, &opts).unwrap();
        assert_eq!(r.anchors, 15);
        let cfg = DrafterConfig::for_preset(Preset::Tiny, 4);
        let expected = cfg.training_flops_per_sample(16, 15) * r.samples_per_s / 1e12;
        assert!((r.tflops - expected).abs() <= 1e-9 * expected.max(1e-12), "{} vs {expected}", r.tflops);
        let seen = cfg.training_flops_seen_keys(16, 15) * r.samples_per_s / 1e12 / r.peak_tflops;
        assert!((r.mfu_seen_keys - seen).abs() <= 1e-9 * seen && r.mfu_seen_keys < r.mfu);
    }

    #[test]
    fn the_pipeline_captures_inside_every_step() {
        let opts = DrafterBenchOptions { profile: true, pipeline: true, ..tiny_options(2, 24, 4) };
        let r = bench_drafter(Preset::Tiny, Device::Cpu, Kind::Float, &opts).unwrap();
        assert_eq!(r.what, "pipeline");
        assert!(r.loss.is_finite() && r.loss > 0.0);
        let phases = r.phases_ms.unwrap();
        assert!(phases.contains_key("target.capture"), "the capture is not in the step: {phases:?}");
        // Packed: the two conversations share a row, captured and trained as alone; a pack that does not divide
        // the batch is refused.
        let packed =
            bench_drafter(Preset::Tiny, Device::Cpu, Kind::Float, &DrafterBenchOptions { pack: 2, ..opts.clone() });
        let packed = packed.unwrap();
        assert!(packed.pack == 2 && packed.loss.is_finite() && packed.loss > 0.0 && packed.anchors == 4);
        let odd = bench_drafter(Preset::Tiny, Device::Cpu, Kind::Float, &DrafterBenchOptions { pack: 3, ..opts });
        assert!(odd.unwrap_err().to_string().contains("--pack 3"));
    }
}
