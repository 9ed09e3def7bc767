//! The frozen target decoder (Qwen3, Qwen3-MoE, GPT-OSS or Llama-3). Its one training-time job is to turn token batches into the
//! concatenated hidden states of the tapped layers, as fast as the GPU allows; it also lends the drafter its
//! embedding and LM head, and can run the whole stack for decoding.
//!
//! "Layer i" is the output of decoder layer i (HuggingFace's `hidden_states[i + 1]`). Capture stops at the last
//! tapped layer. Rows are right-padded: with causal attention a valid position never sees a later one, so padding
//! cannot change valid positions and the fused causal SDPA kernel (flash attention) runs without a mask; padded
//! positions of the output are zeroed.
//!
//! The model and what it is asked are here; the rest by job, each file readable top to bottom: `loading.rs` (weights
//! from a folder, a file or random, placed on one device or spread over several), `layers.rs` (one decoder layer and
//! its attention), `pipeline.rs` (the pass through the stack, across devices and micro-batches), `capture.rs`
//! (hidden states for training, logits, expert choices), `decode.rs` (the decode session over a KV cache,
//! graphable) and `save_hf.rs` (the HuggingFace folder).
mod capture;
mod decode;
mod layers;
mod loading;
mod pipeline;
mod save_hf;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tch::{Device, Kind, Tensor};

use self::layers::DecoderLayer;
use super::config::TargetConfig;
use super::layers::Rope;

/// Micro-batches per part of a spread target's capture by default ([`Target::auto_micro_batches`]).
pub const MICRO_BATCHES_PER_PART: usize = 4;

/// How much of the stack to hold and run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Layers up to the last tapped one: what hidden-state capture needs.
    ToLastTap,
    /// Every layer and the final norm: what decoding needs.
    Full,
}

/// What one decoding step computes for its new positions.
pub struct Decoded {
    /// `[1, T, vocab]`
    pub logits: Tensor,
    /// The tapped layers' outputs concatenated in tap order, `[1, T, taps * hidden]`: the drafter's context.
    pub taps: Tensor,
}

/// The frozen target model.
pub struct Target {
    cfg: TargetConfig,
    taps: Vec<usize>,
    depth: Depth,
    device: Device,
    kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Option<Tensor>,
    /// `None` when tied to the embedding.
    lm_head: Option<Tensor>,
    rope: Rope,
    /// Micro-batches a capture is cut into (0: [`Target::auto_micro_batches`]).
    micro_batches: usize,
    fault: Option<Arc<PartFault>>,
}

/// Fault injection for a target's parts: armed with a part, the next pass panics where the hidden state enters that
/// part's first layer (the micro-batches before it already in flight), as a failing device would.
#[derive(Debug, Default)]
pub struct PartFault(AtomicUsize);

impl PartFault {
    /// Arms the switch for `part`; false (and unchanged) when a fault is pending already.
    pub fn arm(&self, part: usize) -> bool {
        self.0.compare_exchange(0, part + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Disarms the switch if it is armed for `part`, saying whether it was.
    fn fire(&self, part: usize) -> bool {
        self.0.compare_exchange(part + 1, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

/// Checks tapped layer ids against the decoder: non-empty, strictly increasing, each below the layer count.
pub fn validate_taps(taps: &[usize], num_layers: usize) -> Result<(), String> {
    if taps.is_empty() {
        return Err("no tapped layer ids given".into());
    }
    if taps.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("tapped layer ids {taps:?} must be strictly increasing"));
    }
    if let Some(bad) = taps.iter().find(|&&t| t >= num_layers) {
        return Err(format!(
            "tapped layer id {bad} does not exist: the target has {num_layers} layers (ids 0..={})",
            num_layers - 1
        ));
    }
    Ok(())
}

impl Target {
    pub fn config(&self) -> &TargetConfig {
        &self.cfg
    }
    pub fn taps(&self) -> &[usize] {
        &self.taps
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn kind(&self) -> Kind {
        self.kind
    }
    /// Decoder layers this instance runs (up to the last tap, or all).
    pub fn layers_run(&self) -> usize {
        self.layers.len()
    }
    /// The frozen token embedding `[vocab, hidden]`.
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }
    /// The frozen LM head `[vocab, hidden]` (the embedding itself when tied).
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Embeds token ids `[..]` -> `[.., hidden]`.
    pub fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
    }

    /// Sets how many micro-batches a capture of a spread target is cut into (at most one per row; 0 restores
    /// [`Target::auto_micro_batches`]). More keeps the parts busier (a pipeline of P parts and M micro-batches idles
    /// (P - 1) / (M + P - 1) of the time) at the cost of smaller matrix products.
    pub fn set_micro_batches(&mut self, micro_batches: usize) {
        self.micro_batches = micro_batches;
    }

    /// The micro-batches a capture uses by default: one on a single device, [`MICRO_BATCHES_PER_PART`] per part of
    /// a spread target.
    pub fn auto_micro_batches(&self) -> usize {
        match self.parts() {
            1 => 1,
            parts => MICRO_BATCHES_PER_PART * parts,
        }
    }

    /// The micro-batches a capture of `rows` rows runs as.
    pub fn micro_batches_for(&self, rows: i64) -> usize {
        let chosen = if self.micro_batches == 0 { self.auto_micro_batches() } else { self.micro_batches };
        chosen.clamp(1, rows.max(1) as usize)
    }

    /// How many parts hold layers (1 unless the target is spread).
    pub fn parts(&self) -> usize {
        let mut parts: Vec<usize> = self.layers.iter().map(|l| l.part).collect();
        parts.dedup();
        parts.len().max(1)
    }

    /// Fault injection: the passes of this target panic where `fault` says ([`PartFault`]).
    pub fn watch_faults(&mut self, fault: Arc<PartFault>) {
        self.fault = Some(fault);
    }

    /// Where the layers run, for logs: `cuda:0 layers 0-16, cuda:1 layers 17-33`.
    pub fn placement(&self) -> String {
        let mut runs: Vec<(usize, Device, usize, usize)> = vec![];
        for (l, layer) in self.layers.iter().enumerate() {
            match runs.last_mut() {
                Some((part, _, _, end)) if *part == layer.part => *end = l,
                _ => runs.push((layer.part, layer.device, l, l)),
            }
        }
        let run =
            |(_, d, a, b): &(usize, Device, usize, usize)| format!("{} layers {a}-{b}", crate::device::device_name(*d));
        runs.iter().map(run).collect::<Vec<_>>().join(", ")
    }

    /// The device of each decoder layer held (the first device for all unless the target is spread).
    pub fn layer_devices(&self) -> Vec<Device> {
        self.layers.iter().map(|l| l.device).collect()
    }
}
