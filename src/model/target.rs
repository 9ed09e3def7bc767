//! The frozen target decoder (Qwen3, Qwen3-MoE, GPT-OSS or Llama-3). Its one training-time job is to turn token batches into the
//! concatenated hidden states of the tapped layers, as fast as the GPU allows; it also lends the drafter its
//! embedding and LM head, and can run the whole stack for decoding.
//!
//! "Layer i" is the output of decoder layer i (HuggingFace's `hidden_states[i + 1]`). Capture stops at the last
//! tapped layer. Rows are right-padded: with causal attention a valid position never sees a later one, so padding
//! cannot change valid positions and the fused causal SDPA kernel (flash attention) runs without a mask; padded
//! positions of the output are zeroed.
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tch::{Device, Kind, Tensor};

use super::ModelError;
use super::attention::{
    LayerAttention, context_bucket, flash_applies, flash_runs_on, grouped_bias, masked_attention, repeat_kv,
    sink_attention,
};
use super::config::TargetConfig;
use super::init::{Init, InitStream};
use super::kv_cache::KvCache;
use super::layers::{Rope, norm_rope, rms_norm, swiglu_activation};
use super::moe::SparseMlp;
use super::split::split_layers;
use super::staircase::decode_attention;
use super::weights::{HostTensor, WeightFiles, dequantize_mxfp4, write_sharded};
use crate::device::kind_name;
use crate::profile::span;

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

/// One pre-norm decoder layer; q/k/v and gate/up are stacked so each is one matrix product.
struct DecoderLayer {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    /// `[(heads + 2 * kv_heads) * head_dim, hidden]`
    qkv_proj: Tensor,
    o_proj: Tensor,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// GPT-OSS: `[(heads + 2 * kv_heads) * head_dim]` and `[hidden]`.
    qkv_bias: Option<Tensor>,
    o_bias: Option<Tensor>,
    /// GPT-OSS: one attention-sink logit per head, `[heads]`, and the sliding window of this layer.
    sinks: Option<Tensor>,
    window: Option<i64>,
    mlp: Mlp,
    /// Where this layer's weights live (the first device unless the target is spread), and which of the devices
    /// given (its part of the split: CPU stand-ins for several devices are one `Device` but distinct parts).
    device: Device,
    part: usize,
}

enum Mlp {
    Dense {
        /// `[2 * intermediate, hidden]`
        gate_up_proj: Tensor,
        down_proj: Tensor,
    },
    Sparse(SparseMlp),
}

/// How a layer's attention finds its keys.
enum Keys<'a> {
    /// The input is the whole sequence: causal attention over it.
    Causal,
    /// The input continues a cached sequence: keys are the cache plus the new ones (written to `layer`'s slot) at
    /// `positions` (`[T]`, on the device); `bias` is the causal mask over the bucketed cache after a prefill
    /// ([`grouped_bias`]), `None` for the prefill itself.
    Cached { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, bias: Option<&'a Tensor> },
    /// As `Cached`, with the new positions a device tensor: written by index, attention over the cache's whole
    /// capacity with `bias` ([`grouped_bias`]) masking what is not held (a CUDA graph's step).
    Indexed { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, bias: &'a Tensor },
    /// New sequences (right-padded rows), attended as `Causal`; their keys and values are also written to the cache
    /// rows `rows` from position 0 (batched generation's prefill, [`Target::prefill_rows`]).
    Fill { cache: &'a mut KvCache, layer: usize, rows: &'a Tensor },
    /// One new token per cache row at that row's own position (`positions [B]`), written there; attention over each
    /// row's first `len` positions, `bias` hiding those the row does not hold (batched generation's step,
    /// [`Target::step_rows`]).
    Rows { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, len: i64, bias: &'a Tensor },
    /// The input is whole rows of several conversations each (packed): attention causal within each conversation
    /// and nothing across, as `mask` says ([`Target::capture_packed`]).
    Packed { mask: &'a PackedMask },
}

/// How the tokens of packed rows are kept to their own conversation ([`Keys::Packed`]).
enum PackedMask {
    /// An additive bias `[B, 1, S, S]`: 0 where a token sees a key, -inf elsewhere (any device and dtype; every key
    /// of the row computed, then masked).
    Bias(Tensor),
    /// The rows' conversations (and each row's padding) as the variable-length sequences of libtorch's flash
    /// attention (CUDA, bf16/f16), which computes no key outside a query's own sequence: their cumulative lengths over
    /// the rows laid end to end, `[n + 1]` int32, and the longest.
    Segments { cu_seqlens: Tensor, longest: i64 },
}

impl PackedMask {
    fn to_device(&self, device: Device) -> Result<PackedMask, ModelError> {
        Ok(match self {
            PackedMask::Bias(bias) => PackedMask::Bias(bias.f_to_device(device)?),
            PackedMask::Segments { cu_seqlens, longest } => {
                PackedMask::Segments { cu_seqlens: cu_seqlens.f_to_device(device)?, longest: *longest }
            }
        })
    }
}

/// Where the tokens of a pass go, beside the whole-sequence pass that has no cache.
enum Placement<'a> {
    /// After the cached sequence (from the cache's length).
    Append,
    /// From a device scalar ([`Keys::Indexed`]).
    At(&'a Tensor),
    /// New sequences into these cache rows ([`Keys::Fill`]).
    Fill(&'a Tensor),
    /// One token per cache row at these positions, attention over `len` positions ([`Keys::Rows`]).
    Rows { positions: &'a Tensor, len: i64 },
    /// Packed rows without a cache: each token at `positions [B, S]` (its place in its conversation), attention as
    /// `mask` says ([`Keys::Packed`]).
    Packed { positions: &'a Tensor, mask: &'a PackedMask },
}

/// A source of named HF tensors (`model.layers.3.self_attn.q_proj.weight`, ...), each on the device it is asked for.
type Fetch<'a> = dyn FnMut(&str) -> Result<Tensor, ModelError> + 'a;

impl DecoderLayer {
    /// Layer `l` of `cfg` from the tensors `get` returns, on `device` (part `part` of a spread target).
    fn build(cfg: &TargetConfig, l: usize, device: Device, part: usize, get: &mut Fetch) -> Result<Self, ModelError> {
        let mut get = |suffix: &str| get(&format!("model.layers.{l}.{suffix}"));
        let qkv_proj = Tensor::f_cat(
            &[get("self_attn.q_proj.weight")?, get("self_attn.k_proj.weight")?, get("self_attn.v_proj.weight")?],
            0,
        )?;
        let mlp = Mlp::build(cfg, l, &mut get)?;
        let (q_norm, k_norm) = match cfg.architecture.has_qk_norm() {
            true => (Some(get("self_attn.q_norm.weight")?), Some(get("self_attn.k_norm.weight")?)),
            false => (None, None),
        };
        let (qkv_bias, o_bias, sinks, window) = match &cfg.gpt_oss {
            Some(oss) => (
                Some(Tensor::f_cat(
                    &[get("self_attn.q_proj.bias")?, get("self_attn.k_proj.bias")?, get("self_attn.v_proj.bias")?],
                    0,
                )?),
                Some(get("self_attn.o_proj.bias")?),
                Some(get("self_attn.sinks")?),
                oss.sliding_layers[l].then_some(oss.sliding_window as i64),
            ),
            None => (None, None, None, None),
        };
        Ok(DecoderLayer {
            input_layernorm: get("input_layernorm.weight")?,
            post_attention_layernorm: get("post_attention_layernorm.weight")?,
            qkv_proj,
            o_proj: get("self_attn.o_proj.weight")?,
            q_norm,
            k_norm,
            qkv_bias,
            o_bias,
            sinks,
            window,
            mlp,
            device,
            part,
        })
    }
}

impl Mlp {
    /// Layer `l`'s MLP: dense, Qwen3-MoE's experts or GPT-OSS's; `get` takes names within the layer.
    fn build(cfg: &TargetConfig, l: usize, get: &mut Fetch) -> Result<Self, ModelError> {
        let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_sparse(l)) else {
            return Ok(Mlp::Dense {
                gate_up_proj: Tensor::f_cat(&[get("mlp.gate_proj.weight")?, get("mlp.up_proj.weight")?], 0)?,
                down_proj: get("mlp.down_proj.weight")?,
            });
        };
        if let Some(oss) = &cfg.gpt_oss {
            let mut pair =
                |name: &str, bias: &str| -> Result<(Tensor, Tensor), ModelError> { Ok((get(name)?, get(bias)?)) };
            return Ok(Mlp::Sparse(SparseMlp::gpt_oss(
                pair("mlp.router.weight", "mlp.router.bias")?,
                pair("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias")?,
                pair("mlp.experts.down_proj", "mlp.experts.down_proj_bias")?,
                moe.num_experts_per_tok,
                oss.swiglu_alpha,
                oss.swiglu_limit,
            )));
        }
        let mut gate_up = Vec::with_capacity(moe.num_experts);
        let mut down = Vec::with_capacity(moe.num_experts);
        for e in 0..moe.num_experts {
            let mut expert = |suffix: &str| get(&format!("mlp.experts.{e}.{suffix}"));
            gate_up.push(Tensor::f_cat(&[expert("gate_proj.weight")?, expert("up_proj.weight")?], 0)?);
            down.push(expert("down_proj.weight")?);
        }
        Ok(Mlp::Sparse(SparseMlp::qwen3(
            get("mlp.gate.weight")?,
            Tensor::f_stack(&gate_up, 0)?,
            Tensor::f_stack(&down, 0)?,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
        )))
    }

    /// Adds this MLP's output for the normed rows `h` (`[N, H]`) to the residual rows `x` in place; a sparse MLP
    /// appends its chosen experts to `routes`.
    fn add_to(&self, x: &Tensor, h: &Tensor, routes: Option<&mut Vec<Tensor>>) -> Result<(), ModelError> {
        match self {
            Mlp::Dense { gate_up_proj, down_proj } => {
                let act = swiglu_activation(&h.linear(gate_up_proj, None::<Tensor>));
                let _ = x.shallow_clone().f_addmm_(&act, &down_proj.tr())?;
            }
            Mlp::Sparse(sparse) => {
                if let Some(routes) = routes {
                    routes.push(sparse.route(h)?.0);
                }
                sparse.add_to(x, h)?;
            }
        }
        Ok(())
    }
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

/// The tensor names and shapes of the HuggingFace checkpoint of `cfg` (layers `0..num_layers`), and whether each
/// is a matrix (norm weights are not).
fn hf_tensors(cfg: &TargetConfig, num_layers: usize, with_head: bool) -> Vec<(String, Vec<usize>, bool)> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let (std, norm) = (true, false);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h], std)];
    for l in 0..num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h], norm));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h], norm));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h], std));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], std));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], std));
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q], std));
        if cfg.gpt_oss.is_some() {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![q], std));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv], std));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv], std));
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![h], std));
            out.push((format!("{p}.self_attn.sinks"), vec![cfg.num_attention_heads], std));
        }
        if cfg.architecture.has_qk_norm() {
            out.push((format!("{p}.self_attn.q_norm.weight"), vec![d], norm));
            out.push((format!("{p}.self_attn.k_norm.weight"), vec![d], norm));
        }
        match cfg.moe.as_ref().filter(|m| m.is_sparse(l)) {
            Some(m) if cfg.gpt_oss.is_some() => {
                let (e, w, x) = (m.num_experts, m.moe_intermediate_size, format!("{p}.mlp"));
                out.push((format!("{x}.router.weight"), vec![e, h], std));
                out.push((format!("{x}.router.bias"), vec![e], std));
                out.push((format!("{x}.experts.gate_up_proj"), vec![e, h, 2 * w], std));
                out.push((format!("{x}.experts.gate_up_proj_bias"), vec![e, 2 * w], std));
                out.push((format!("{x}.experts.down_proj"), vec![e, w, h], std));
                out.push((format!("{x}.experts.down_proj_bias"), vec![e, h], std));
            }
            Some(m) => {
                out.push((format!("{p}.mlp.gate.weight"), vec![m.num_experts, h], std));
                for e in 0..m.num_experts {
                    let (x, mi) = (format!("{p}.mlp.experts.{e}"), m.moe_intermediate_size);
                    out.push((format!("{x}.gate_proj.weight"), vec![mi, h], std));
                    out.push((format!("{x}.up_proj.weight"), vec![mi, h], std));
                    out.push((format!("{x}.down_proj.weight"), vec![h, mi], std));
                }
            }
            None => {
                out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], std));
                out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], std));
                out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], std));
            }
        }
    }
    if with_head {
        out.push(("model.norm.weight".to_string(), vec![h], norm));
        if !cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h], std));
        }
    }
    out
}

/// The bytes of each of the first `layers` decoder layers' tensors in `specs`, and of everything else, which lives on
/// the first device (the embedding, and the final norm and LM head where they are held).
fn layer_bytes(
    cfg: &TargetConfig,
    specs: &HashMap<String, (Vec<usize>, bool)>,
    layers: usize,
    kind: Kind,
) -> (Vec<u64>, u64) {
    let bytes = |shape: &[usize]| shape.iter().product::<usize>() as u64 * kind.elt_size_in_bytes() as u64;
    let mut per_layer = vec![0u64; layers];
    let mut first = 0u64;
    for (name, (shape, _)) in specs {
        let layer = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        match layer {
            Some(l) if l < layers => per_layer[l] += bytes(shape),
            _ => first += bytes(shape),
        }
    }
    // Capture loads an untied LM head outside the list (the drafter needs it): it lives on the first device too.
    if !cfg.tie_word_embeddings && !specs.contains_key("lm_head.weight") {
        first += bytes(&[cfg.vocab_size, cfg.hidden_size]);
    }
    (per_layer, first)
}

/// The part (index into `devices`) of each of the first `layers` decoder layers: [`split_layers`] by the GPUs' free
/// memory (the device's, plus what this process's caching allocator holds unused) when every device is a GPU,
/// evenly otherwise. Refused, before anything is loaded, when the weights a GPU would hold exceed what it has free.
fn spread(
    cfg: &TargetConfig,
    specs: &HashMap<String, (Vec<usize>, bool)>,
    layers: usize,
    devices: &[Device],
    kind: Kind,
) -> Result<Vec<usize>, ModelError> {
    let (per_layer, first) = layer_bytes(cfg, specs, layers, kind);
    let free = match devices.iter().all(|d| d.is_cuda()) {
        true => Some(
            devices
                .iter()
                .map(|&d| {
                    // What this process's allocator holds unused (a restarted target's predecessor, freed) is free
                    // to it too.
                    let m = crate::device::memory_stats(d)?;
                    Ok((m.device_free.max(0) + (m.reserved - m.allocated).max(0)) as u64)
                })
                .collect::<Result<Vec<u64>, ModelError>>()?,
        ),
        false => None,
    };
    let parts = split_layers(&per_layer, first, free.as_deref().unwrap_or(&vec![1; devices.len()]));
    if let Some(free) = free {
        check_fit(&per_layer, first, &parts, devices, &free)?;
    }
    Ok(parts)
}

/// Refuses a split whose weights on some device (summed over the parts placed on it) exceed its free memory.
fn check_fit(
    per_layer: &[u64],
    first: u64,
    parts: &[usize],
    devices: &[Device],
    free: &[u64],
) -> Result<(), ModelError> {
    let mut load: Vec<(Device, u64, u64)> = vec![];
    let mut add = |device: Device, bytes: u64, free: u64| match load.iter_mut().find(|(d, _, _)| *d == device) {
        Some((_, l, _)) => *l += bytes,
        None => load.push((device, bytes, free)),
    };
    add(devices[0], first, free[0]);
    for (&part, &bytes) in parts.iter().zip(per_layer) {
        add(devices[part], bytes, free[part]);
    }
    match load.into_iter().find(|&(_, needs, free)| needs > free) {
        Some((device, needs, free)) => Err(ModelError::DoesNotFit {
            device: crate::device::device_name(device),
            needs_gib: needs as f64 / GIB,
            free_gib: free as f64 / GIB,
            devices: devices.len(),
        }),
        None => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

impl Target {
    /// Loads a HuggingFace model folder (`config.json` + safetensors) onto `device` as `kind`.
    pub fn load(dir: &Path, taps: &[usize], depth: Depth, device: Device, kind: Kind) -> Result<Self, ModelError> {
        Self::load_spread(dir, taps, depth, &[device], kind)
    }

    /// [`Target::load`] over several devices: the decoder layers split into contiguous runs balanced by bytes
    /// ([`split_layers`]), the embedding, final norm and LM head on the first device, which also receives the tapped
    /// states. Each tensor is read straight to its device.
    pub fn load_spread(
        dir: &Path,
        taps: &[usize],
        depth: Depth,
        devices: &[Device],
        kind: Kind,
    ) -> Result<Self, ModelError> {
        let cfg = TargetConfig::from_dir(dir)?;
        let files = WeightFiles::open(dir)?;
        let mut why = format!(
            "config.json: hidden_size={}, intermediate_size={}, heads={}, kv_heads={}, head_dim={}, vocab_size={}",
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.vocab_size
        );
        if let Some(m) = &cfg.moe {
            why += &format!(", num_experts={}, moe_intermediate_size={}", m.num_experts, m.moe_intermediate_size);
        }
        if cfg.tie_word_embeddings && files.contains("lm_head.weight") {
            tracing::debug!("config.json ties the LM head to the embedding; ignoring lm_head.weight");
        }
        Self::build(cfg, taps, depth, devices, kind, |name, shape, _, device| {
            let blocks = format!("{name}_blocks");
            if files.contains(name) || !files.contains(&blocks) {
                return files.load(name, shape, &why, kind, device);
            }
            // GPT-OSS's experts as published: MXFP4 `[experts, out, in / 32, 16]` codes and `[experts, out, in / 32]`
            // scales of the `[experts, in, out]` weight transformers uses.
            let [experts, inputs, outputs] = shape[..] else {
                return files.load(name, shape, &why, kind, device);
            };
            let groups = inputs.div_ceil(32);
            let codes = files.load(&blocks, &[experts, outputs, groups, 16], &why, Kind::Uint8, device)?;
            let scales =
                files.load(&format!("{name}_scales"), &[experts, outputs, groups], &why, Kind::Uint8, device)?;
            let weight = dequantize_mxfp4(&codes, &scales, kind)?.f_narrow(2, 0, inputs as i64)?;
            Ok(weight.f_transpose(1, 2)?.f_contiguous()?)
        })
    }

    /// A target whose weights are one safetensors file held in memory (`what` names it in errors): the built-in
    /// `tiny-tasks` model.
    pub fn from_safetensors(
        cfg: TargetConfig,
        bytes: &[u8],
        what: &str,
        taps: &[usize],
        depth: Depth,
        devices: &[Device],
        kind: Kind,
    ) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::Safetensors { path: what.into(), reason };
        let file = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        Self::build(cfg, taps, depth, devices, kind, |name, shape, _, device| {
            let view = file.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
            if view.shape() != shape {
                return Err(bad(format!("{name} has shape {:?}, the config wants {shape:?}", view.shape())));
            }
            let stored = super::weights::kind_of(view.dtype()).ok_or_else(|| bad(format!("{name}: dtype")))?;
            let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            Ok(Tensor::f_from_data_size(view.data(), &dims, stored)?.f_to_device(device)?.f_to_kind(kind)?)
        })
    }

    /// A target with random weights: norms 1, matrices N(0, std^2), drawn as `init` says.
    pub fn random(
        cfg: TargetConfig,
        taps: &[usize],
        depth: Depth,
        device: Device,
        kind: Kind,
        init: Init,
        std: f64,
    ) -> Result<Self, ModelError> {
        Self::random_spread(cfg, taps, depth, &[device], kind, init, std)
    }

    /// [`Target::random`] over several devices, split as [`Target::load_spread`] splits; the values are the same as
    /// on the first device alone.
    pub fn random_spread(
        cfg: TargetConfig,
        taps: &[usize],
        depth: Depth,
        devices: &[Device],
        kind: Kind,
        init: Init,
        std: f64,
    ) -> Result<Self, ModelError> {
        let mut stream = InitStream::new(init, devices.first().copied().unwrap_or(Device::Cpu));
        Self::build(cfg, taps, depth, devices, kind, |_, shape, is_matrix, device| {
            let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            Ok(stream.next(&dims, if is_matrix { std } else { 0.0 }, kind)?.f_to_device(device)?)
        })
    }

    /// Assembles the model from a source of named HF tensors: `(name, shape, is_matrix, device) -> tensor` on that
    /// device. The layers are split over `devices` ([`split_layers`]); everything else lives on the first.
    fn build(
        cfg: TargetConfig,
        taps: &[usize],
        depth: Depth,
        devices: &[Device],
        kind: Kind,
        mut tensor: impl FnMut(&str, &[usize], bool, Device) -> Result<Tensor, ModelError>,
    ) -> Result<Self, ModelError> {
        let Some(&device) = devices.first() else {
            return Err(ModelError::NoDevice);
        };
        validate_taps(taps, cfg.num_hidden_layers).map_err(ModelError::Taps)?;
        let num_layers = match depth {
            Depth::ToLastTap => taps.last().expect("validated non-empty") + 1,
            Depth::Full => cfg.num_hidden_layers,
        };
        let specs: HashMap<String, (Vec<usize>, bool)> = hf_tensors(&cfg, num_layers, depth == Depth::Full)
            .into_iter()
            .map(|(name, shape, is_matrix)| (name, (shape, is_matrix)))
            .collect();
        let layer_parts = spread(&cfg, &specs, num_layers, devices, kind)?;
        // The device the next tensors go to: each layer's own, the first for the rest.
        let on = std::cell::Cell::new(device);
        let mut get = |name: &str| -> Result<Tensor, ModelError> {
            let (shape, is_matrix) = specs.get(name).expect("every requested tensor is in the spec list");
            tensor(name, shape, *is_matrix, on.get())
        };
        let embed_tokens = get("model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(num_layers);
        for (l, &part) in layer_parts.iter().enumerate() {
            on.set(devices[part]);
            layers.push(DecoderLayer::build(&cfg, l, devices[part], part, &mut get)?);
        }
        on.set(device);
        let (norm, lm_head) = match depth {
            Depth::Full => (
                Some(get("model.norm.weight")?),
                if cfg.tie_word_embeddings { None } else { Some(get("lm_head.weight")?) },
            ),
            // Capture needs no final norm, but the drafter always needs the LM head.
            Depth::ToLastTap if !cfg.tie_word_embeddings => {
                let (_, shape, is_matrix) = hf_tensors(&cfg, 0, true)
                    .into_iter()
                    .find(|(n, _, _)| n == "lm_head.weight")
                    .expect("untied configs have an lm_head");
                (None, Some(tensor("lm_head.weight", &shape, is_matrix, device)?))
            }
            Depth::ToLastTap => (None, None),
        };
        let rope = Rope::new(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, device);
        Ok(Target {
            cfg,
            taps: taps.to_vec(),
            depth,
            device,
            kind,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            micro_batches: 0,
            fault: None,
        })
    }

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

    /// Runs the decoder on right-padded `input_ids [B, S]` (int64, on the model's device) whose rows hold
    /// `lengths` real tokens, and returns the tapped states concatenated in tap order, `[B, S, taps * hidden]`,
    /// zero at padded positions. No gradients are recorded.
    ///
    /// A spread target runs the batch as micro-batches of rows ([`Target::set_micro_batches`]), all launched before
    /// any is waited for, so while a later part works on one micro-batch an earlier part works on the next. Taps of
    /// layers on other devices collect there and move to the first device once at the end: copying each as it comes
    /// would make the first device wait for the later parts (a cross-device copy orders both devices' streams) and
    /// the micro-batches would take turns.
    pub fn capture(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Tensor, ModelError> {
        Ok(self.capture_states(input_ids, lengths, None, false)?.0)
    }

    /// [`Target::capture`] (and, `with_last`, [`Target::capture_with_last`]'s last states) of packed rows: row `r`
    /// of `input_ids [B, S]` holds conversations of the lengths `conversations[r]`, one after the other, then padding.
    /// Each conversation's positions start at 0 and its tokens attend to its own earlier tokens only, so its states
    /// are those it would have alone in a row. Dense targets (no attention sinks or windows).
    pub fn capture_packed(
        &self,
        input_ids: &Tensor,
        conversations: &[Vec<i64>],
        with_last: bool,
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        let lengths: Vec<i64> = conversations.iter().map(|c| c.iter().sum()).collect();
        if conversations.iter().flatten().any(|&l| l < 1) {
            return Err(ModelError::Batch(format!("packed conversations {conversations:?} must each hold a token")));
        }
        self.capture_states(input_ids, &lengths, Some(conversations), with_last)
    }

    /// [`Target::capture`], and also the last layer's output after the final norm, `[B, S, hidden]` on the first
    /// device (zero at padded positions): what the LM head turns into the target's next-token logits, for an objective
    /// that learns from the target's predictions. Needs [`Depth::Full`].
    pub fn capture_with_last(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(Tensor, Tensor), ModelError> {
        let (taps, last) = self.capture_states(input_ids, lengths, None, true)?;
        Ok((taps, last.ok_or(ModelError::NotFull)?))
    }

    fn capture_states(
        &self,
        input_ids: &Tensor,
        lengths: &[i64],
        packed: Option<&[Vec<i64>]>,
        with_last: bool,
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        let (b, s) = self.check_batch(input_ids, lengths)?;
        // Flash attention over each conversation where it runs (packed rows' only attention that skips the keys of
        // other conversations), else the whole row masked.
        let segments = flash_runs_on(self.device, self.kind) && self.cfg.head_dim <= 256;
        let h = self.cfg.hidden_size as i64;
        // With the last states: the final norm, and where its output goes.
        let last = match (with_last, &self.norm) {
            (false, _) => None,
            (true, Some(norm)) => Some((norm, Tensor::f_empty([b, s, h], (self.kind, self.device))?)),
            (true, None) => return Err(ModelError::NotFull),
        };
        let out = Tensor::f_empty([b, s, self.taps.len() as i64 * h], (self.kind, self.device))?;
        let last_tap = self.taps[self.taps.len() - 1];
        let layers_run = if with_last { self.layers.len() } else { last_tap + 1 };
        // The slot of each tap: in `out`, or a [B, S, hidden] buffer on its layer's device.
        let staged = (self.taps.iter())
            .map(|&layer| match self.layers[layer].device {
                device if device == self.device => Ok(None),
                device => Ok(Some(Tensor::f_empty([b, s, h], (self.kind, device))?)),
            })
            .collect::<Result<Vec<Option<Tensor>>, ModelError>>()?;
        let micro_batches = self.micro_batches_for(b) as i64;
        let rows = (b + micro_batches - 1) / micro_batches;
        tch::no_grad(|| -> Result<(), ModelError> {
            for first in (0..b).step_by(rows as usize) {
                let count = rows.min(b - first);
                let ids = input_ids.f_narrow(0, first, count)?;
                let mut next_tap = 0;
                let packed = match packed {
                    Some(rows) => {
                        let rows = &rows[first as usize..(first + count) as usize];
                        Some(packed_attention(rows, s, segments, self.kind, self.device)?)
                    }
                    None => None,
                };
                let placement = match &packed {
                    Some((positions, mask)) => Placement::Packed { positions, mask },
                    None => Placement::Append,
                };
                let output = self.run_layers_at(&ids, layers_run, None, placement, None, |layer, x| {
                    if self.taps.get(next_tap) == Some(&layer) {
                        let _p = span("target.copy_taps");
                        let slot = match &staged[next_tap] {
                            Some(buffer) => buffer.narrow(0, first, count),
                            None => out.narrow(2, next_tap as i64 * h, h).narrow(0, first, count),
                        };
                        slot.shallow_clone().copy_(x);
                        next_tap += 1;
                    }
                })?;
                if let Some((norm, last)) = &last {
                    let normed = rms_norm(&output.f_to_device(self.device)?, norm, self.cfg.rms_norm_eps);
                    last.f_narrow(0, first, count)?.f_copy_(&normed)?;
                }
            }
            for (t, buffer) in staged.iter().enumerate() {
                if let Some(buffer) = buffer {
                    out.f_narrow(2, t as i64 * h, h)?.f_copy_(buffer)?;
                }
            }
            Ok(())
        })?;
        self.zero_padding(&out, lengths)?;
        let last = last.map(|(_, last)| last);
        if let Some(last) = &last {
            self.zero_padding(last, lengths)?;
        }
        Ok((out, last))
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

    /// Runs the whole stack and the LM head: logits `[B, S, vocab]` (padded positions zeroed). Needs
    /// [`Depth::Full`].
    pub fn logits(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        self.check_batch(input_ids, lengths)?;
        let logits = tch::no_grad(|| -> Result<Tensor, ModelError> {
            let x = self.run_layers(input_ids, self.layers.len(), None, None, |_, _| {})?.f_to_device(self.device)?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).linear(self.lm_head(), None::<Tensor>))
        })?;
        self.zero_padding(&logits, lengths)?;
        Ok(logits)
    }

    /// The experts each sparse layer (in layer order, up to the last tap or all) chooses for every position of
    /// `input_ids [B, S]`: `[B * S, experts per token]` each, most probable first. For checking routing against a
    /// reference implementation; empty for a dense target.
    pub fn expert_choices(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Vec<Tensor>, ModelError> {
        self.check_batch(input_ids, lengths)?;
        let mut routes = vec![];
        let _last = tch::no_grad(|| self.run_layers(input_ids, self.layers.len(), None, Some(&mut routes), |_, _| {}))?;
        Ok(routes)
    }

    /// A cache for [`Target::decode`] holding up to `capacity` positions of one sequence (rounded up to a
    /// multiple of [`CONTEXT_BUCKET`](super::attention::CONTEXT_BUCKET), as attention reads it in buckets).
    pub fn new_cache(&self, capacity: i64) -> Result<KvCache, ModelError> {
        self.new_rows_cache(1, context_bucket(capacity))
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

    /// Continues the cached sequence with `input_ids [1, T]` (the prefill when the cache is empty, one token, or a
    /// block to verify): returns the logits `[1, T, vocab]` and the tapped states `[1, T, taps * hidden]` of the
    /// new positions, and holds their keys and values in `cache`. Needs [`Depth::Full`].
    pub fn decode(&self, input_ids: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        self.decode_appended(input_ids, cache, false)
    }

    /// [`Target::decode`] keeping the logits of the last new position only (`[1, 1, vocab]`): what a prefill needs
    /// of them, where all of a 32K-token prompt's would take 10 GB.
    pub fn decode_last(&self, input_ids: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        self.decode_appended(input_ids, cache, true)
    }

    /// [`Target::decode`]'s checks and step; `last_only`: [`Target::decode_last`].
    fn decode_appended(&self, input_ids: &Tensor, cache: &mut KvCache, last_only: bool) -> Result<Decoded, ModelError> {
        if self.norm.is_none() {
            return Err(ModelError::NotFull);
        }
        let t = input_ids.size()[1];
        self.check_batch(input_ids, &[t])?;
        cache.reserve(t)?;
        if (cache.len() + t) as usize > self.cfg.positions() {
            return Err(ModelError::Batch(format!("decoding past the target's {} positions", self.cfg.positions())));
        }
        self.decode_with(input_ids, cache, None, last_only)
    }

    /// [`Target::decode`] with nothing depending on the host between steps, so that a CUDA graph can capture it:
    /// the new positions start at `start` (an int64 scalar on the target's device, the cache's length before the
    /// step, written by the caller), the keys and values are written by index, and attention reads the cache's whole
    /// capacity with a mask. The cache's length is the caller's to advance (by `T`, once per step run). Dense targets
    /// on one device only ([`Target::graphable`]); the caller checks the step fits the cache and the model.
    pub fn decode_at(&self, input_ids: &Tensor, start: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        if !self.graphable() {
            return Err(ModelError::Batch(
                "a decoding step at a device position needs a dense target on one device (no experts, no sinks)".into(),
            ));
        }
        let t = input_ids.size()[1];
        self.check_batch(input_ids, &[t])?;
        self.decode_with(input_ids, cache, Some(start), false)
    }

    /// A cache for batched generation: `rows` sequences of up to `capacity` positions each, every row its own
    /// length ([`Target::prefill_rows`], [`Target::step_rows`]; the caller keeps the lengths).
    pub fn new_rows_cache(&self, rows: i64, capacity: i64) -> Result<KvCache, ModelError> {
        let c = &self.cfg;
        let (kv_heads, d) = (c.num_key_value_heads as i64, c.head_dim as i64);
        KvCache::on_devices(&self.layer_devices(), rows, kv_heads, d, capacity, self.kind)
    }

    /// Batched generation's prefill: runs the right-padded prompts `input_ids [N, P]` (`lengths` tokens each) as new
    /// sequences, writes their keys and values to the cache rows `rows` (`[N]`, int64, on the target's device) from
    /// position 0, and returns the logits of each prompt's last token, `[N, vocab]`. Needs [`Depth::Full`].
    pub fn prefill_rows(
        &self,
        input_ids: &Tensor,
        lengths: &[i64],
        rows: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        let (n, _) = self.check_batch(input_ids, lengths)?;
        tch::no_grad(|| {
            let count = self.layers.len();
            let x = self.run_layers_at(input_ids, count, Some(cache), Placement::Fill(rows), None, |_, _| {})?;
            let x = x.f_to_device(self.device)?;
            let last = Tensor::f_from_slice(lengths)?.f_to(self.device)?.f_sub_scalar(1)?;
            let x = x.f_index(&[Some(Tensor::f_arange(n, (Kind::Int64, self.device))?), Some(last)])?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?)
        })
    }

    /// Batched generation's step: one token for each row of `cache` (`input_ids [B, 1]`), at the row's own position
    /// (`positions [B]`, int64, on the target's device; past what [`Target::prefill_rows`] and earlier steps wrote
    /// there). Attention reads each row's first `len` positions (more than any row's position), masked per row.
    /// Returns the logits `[B, vocab]`. Nothing depends on the host: on one device a CUDA graph may capture it.
    pub fn step_rows(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        len: i64,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        let b = input_ids.size()[0];
        self.check_batch(input_ids, &vec![1; b as usize])?;
        tch::no_grad(|| {
            let count = self.layers.len();
            let placement = Placement::Rows { positions, len };
            let x = self.run_layers_at(input_ids, count, Some(cache), placement, None, |_, _| {})?;
            let x = x.f_to_device(self.device)?.f_squeeze_dim(1)?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?)
        })
    }

    /// Whether [`Target::decode_at`] applies: a dense target (no experts: their routing sizes its kernels; no
    /// attention sinks) held whole on one device.
    pub fn graphable(&self) -> bool {
        self.norm.is_some()
            && self
                .layers
                .iter()
                .all(|l| l.sinks.is_none() && matches!(l.mlp, Mlp::Dense { .. }) && l.device == self.device)
    }

    /// The decoding step; `last_only`: the LM head on the last new position only.
    fn decode_with(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        at: Option<&Tensor>,
        last_only: bool,
    ) -> Result<Decoded, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        tch::no_grad(|| {
            let mut taps = Vec::with_capacity(self.taps.len());
            let placement = at.map_or(Placement::Append, Placement::At);
            let x = self.run_layers_at(input_ids, self.layers.len(), Some(cache), placement, None, |layer, x| {
                if self.taps.contains(&layer) {
                    // A copy (the next layer updates x in place), on the first device.
                    taps.push(if x.device() == self.device { x.copy() } else { x.to_device(self.device) });
                }
            })?;
            let mut x = x.f_to_device(self.device)?;
            if last_only {
                x = x.f_narrow(1, x.size()[1] - 1, 1)?;
            }
            let logits = rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?;
            Ok(Decoded { logits, taps: Tensor::f_cat(&taps, 2)? })
        })
    }

    /// Query heads per key/value head.
    fn query_group(&self) -> i64 {
        (self.cfg.num_attention_heads / self.cfg.num_key_value_heads) as i64
    }

    fn check_batch(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(i64, i64), ModelError> {
        let size = input_ids.size();
        let bad = |reason: String| Err(ModelError::Batch(reason));
        let [b, s] = size[..] else {
            return bad(format!("input_ids must be [batch, seq], got {size:?}"));
        };
        if input_ids.kind() != Kind::Int64 || input_ids.device() != self.device {
            return bad(format!(
                "input_ids must be int64 on {:?}, got {:?} on {:?}",
                self.device,
                input_ids.kind(),
                input_ids.device()
            ));
        }
        if lengths.len() as i64 != b || lengths.iter().any(|&l| l < 1 || l > s) {
            return bad(format!("lengths {lengths:?} must give 1..={s} tokens for each of {b} rows"));
        }
        if s as usize > self.cfg.positions() {
            return bad(format!("sequence length {s} exceeds the target's {} positions", self.cfg.positions()));
        }
        Ok((b, s))
    }

    /// Embeds and runs layers `0..count`, calling `observe(layer, output)` after each; returns the last output, on
    /// the last layer's device. The next layer updates `output` in place: copy what you keep.
    /// With a cache, the tokens continue the cached sequence (positions from its length on) and every layer's new
    /// keys and values are written to it. With `routes`, each sparse layer appends its chosen experts.
    fn run_layers(
        &self,
        input_ids: &Tensor,
        count: usize,
        cache: Option<&mut KvCache>,
        routes: Option<&mut Vec<Tensor>>,
        observe: impl FnMut(usize, &Tensor),
    ) -> Result<Tensor, ModelError> {
        self.run_layers_at(input_ids, count, cache, Placement::Append, routes, observe)
    }

    /// [`Target::run_layers`] with the tokens placed as `placement` says (with a cache; `Append` without one is the
    /// whole-sequence pass). Only `Append` moves the cache's length on: the other placements leave it to the caller.
    fn run_layers_at(
        &self,
        input_ids: &Tensor,
        count: usize,
        mut cache: Option<&mut KvCache>,
        placement: Placement<'_>,
        mut routes: Option<&mut Vec<Tensor>>,
        mut observe: impl FnMut(usize, &Tensor),
    ) -> Result<Tensor, ModelError> {
        let s = input_ids.size()[1];
        let start = match (&cache, &placement) {
            (Some(c), Placement::Append) => c.len(),
            _ => 0,
        };
        let device = self.device;
        // The new positions (`[S]`, or `[B, 1]` for one token per row at its own position), and the mask of the
        // steps that read cached keys.
        let (positions, mut bias) = match (&cache, &placement) {
            (Some(c), Placement::At(at)) => {
                let positions = Tensor::f_arange(s, (Kind::Int64, device))?.f_add(at)?;
                let keys = Tensor::f_arange(c.capacity(), (Kind::Int64, device))?.unsqueeze(0);
                let hidden = keys.f_gt_tensor(&positions.unsqueeze(1))?;
                let bias = grouped_bias(&hidden, s, self.query_group(), self.kind)?;
                (positions, Some(bias))
            }
            (Some(_), Placement::Rows { positions, len }) => {
                let positions = positions.f_unsqueeze(1)?;
                let hidden = Tensor::f_arange(*len, (Kind::Int64, device))?.unsqueeze(0).f_gt_tensor(&positions)?;
                let rows = hidden.size()[0];
                let bias = Tensor::f_zeros([rows, *len], (self.kind, device))?
                    .f_masked_fill(&hidden, f64::NEG_INFINITY)?
                    .f_view([rows, 1, 1, *len])?
                    .f_expand([rows, 1, self.query_group(), *len], false)?
                    .f_contiguous()?;
                (positions, Some(bias))
            }
            // A verify step (several new tokens after cached ones) needs an explicit causal mask over [cache ; new].
            // After a prefill, attention reads the cache in whole buckets with a causal mask over them, so its shape
            // recurs from step to step (cuDNN plans an attention per shape, which costs far more than the attention
            // itself at batch 1).
            (Some(_), Placement::Append) if start > 0 => {
                let positions = Tensor::f_arange_start(start, start + s, (Kind::Int64, device))?;
                let keys = Tensor::f_arange(context_bucket(start + s), (Kind::Int64, device))?.unsqueeze(0);
                let hidden = keys.f_gt_tensor(&positions.unsqueeze(1))?;
                let bias = grouped_bias(&hidden, s, self.query_group(), self.kind)?;
                (positions, Some(bias))
            }
            (None, Placement::Packed { positions, .. }) => (positions.shallow_clone(), None),
            _ => (Tensor::f_arange_start(start, start + s, (Kind::Int64, device))?, None),
        };
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        // -> [1 or B, S, 1, d]: broadcast over batch and heads in the [B, S, heads, d] layout.
        let unsqueeze = |t: Tensor| if t.dim() == 2 { t.unsqueeze(0).unsqueeze(2) } else { t.unsqueeze(2) };
        let (mut cos, mut sin) = (unsqueeze(cos), unsqueeze(sin));
        // Where rows are written: the rows of new sequences, or the positions of each row's token.
        let mut row_index = match &placement {
            Placement::Fill(rows) => Some(rows.shallow_clone()),
            Placement::Rows { positions, .. } => Some(positions.shallow_clone()),
            _ => None,
        };
        // Packed rows' mask, following the layers from device to device.
        let mut packed_mask = match &placement {
            Placement::Packed { mask, .. } => Some(mask.to_device(device)?),
            _ => None,
        };
        let mut x = {
            let _p = span("target.embed");
            self.embed(input_ids)
        };
        // On a spread target the hidden state and the per-step factors follow the layers from device to device.
        let mut part = None;
        for (i, layer) in self.layers[..count].iter().enumerate() {
            if part != Some(layer.part) {
                part = Some(layer.part);
                if self.fault.as_ref().is_some_and(|f| f.fire(layer.part)) {
                    let device = crate::device::device_name(layer.device);
                    panic!("injected panic (fault injection) in part {} ({device}) of the target", layer.part);
                }
            }
            if x.device() != layer.device {
                let _p = span("target.device_hop");
                let to = |t: &Tensor| t.f_to_device(layer.device);
                (x, cos, sin) = (to(&x)?, to(&cos)?, to(&sin)?);
                bias = bias.as_ref().map(to).transpose()?;
                packed_mask = packed_mask.map(|m| m.to_device(layer.device)).transpose()?;
                row_index = row_index.as_ref().map(to).transpose()?;
            }
            let attend = match (cache.as_deref_mut(), &placement) {
                (None, Placement::Packed { .. }) => Keys::Packed { mask: packed_mask.as_ref().expect("a packed mask") },
                (None, _) => Keys::Causal,
                (Some(c), Placement::Append) => {
                    Keys::Cached { cache: c, layer: i, positions: &positions, bias: bias.as_ref() }
                }
                (Some(c), Placement::At(_)) => {
                    let bias = bias.as_ref().expect("a mask for indexed steps");
                    Keys::Indexed { cache: c, layer: i, positions: &positions, bias }
                }
                (Some(c), Placement::Fill(_)) => {
                    Keys::Fill { cache: c, layer: i, rows: row_index.as_ref().expect("rows to fill") }
                }
                (Some(_), Placement::Packed { .. }) => {
                    return Err(ModelError::Batch("packed rows are a whole-sequence pass, without a cache".into()));
                }
                (Some(c), Placement::Rows { len, .. }) => Keys::Rows {
                    cache: c,
                    layer: i,
                    positions: row_index.as_ref().expect("row positions"),
                    len: *len,
                    bias: bias.as_ref().expect("a mask for row steps"),
                },
            };
            x = self.layer_forward(layer, &x, &cos, &sin, attend, routes.as_deref_mut())?;
            observe(i, &x);
        }
        if let (Some(c), Placement::Append) = (cache, &placement) {
            c.advance(s);
        }
        Ok(x)
    }

    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        keys: Keys<'_>,
        routes: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        let (b, s) = (x.size()[0], x.size()[1]);
        let (heads, kv_heads, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let qkv = {
            let _p = span("target.norms");
            rms_norm(x, &layer.input_layernorm, c.rms_norm_eps)
        };
        let qkv = {
            let _p = span("target.qkv_proj");
            qkv.linear(&layer.qkv_proj, layer.qkv_bias.as_ref())
        };
        let q = qkv.narrow(-1, 0, heads * d).view([b, s, heads, d]);
        let k = qkv.narrow(-1, heads * d, kv_heads * d).view([b, s, kv_heads, d]);
        let v = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d).view([b, s, kv_heads, d]);
        let (q, k) = {
            let _p = span("target.qk_norm_rope");
            let eps = c.rms_norm_eps;
            (
                norm_rope(&q, layer.q_norm.as_ref(), eps, cos, sin).transpose(1, 2),
                norm_rope(&k, layer.k_norm.as_ref(), eps, cos, sin).transpose(1, 2),
            )
        };
        let v = v.transpose(1, 2);
        // A prefill into cache rows attends as the whole-sequence pass does.
        let keys = match keys {
            Keys::Fill { cache, layer: index, rows } => {
                cache.fill_rows(index, rows, &k, &v)?;
                Keys::Causal
            }
            keys => keys,
        };
        let attn = {
            let _p = span("target.attention");
            attention(layer, &q, k, v, keys)?
        };
        // The residual stream is updated in place (no autograd here): the GEMMs add their product to it (beta = 1),
        // where `x + product` would read both and write a third tensor.
        let hidden = c.hidden_size as i64;
        {
            let _p = span("target.o_proj");
            let attn = attn.transpose(1, 2).reshape([b * s, heads * d]);
            let _ = x.view([b * s, hidden]).f_addmm_(&attn, &layer.o_proj.tr())?;
            if let Some(bias) = &layer.o_bias {
                let _ = x.shallow_clone().f_add_(bias)?;
            }
        }
        let h = {
            let _p = span("target.norms");
            rms_norm(x, &layer.post_attention_layernorm, c.rms_norm_eps)
        };
        let _p = span("target.mlp");
        layer.mlp.add_to(&x.view([b * s, hidden]), &h.view([b * s, hidden]), routes)?;
        Ok(x.shallow_clone())
    }

    fn zero_padding(&self, t: &Tensor, lengths: &[i64]) -> Result<(), ModelError> {
        let s = t.size()[1];
        if lengths.iter().all(|&l| l == s) {
            return Ok(());
        }
        let lengths = Tensor::f_from_slice(lengths)?.f_to(self.device)?;
        let pad = Tensor::f_arange(s, (Kind::Int64, self.device))?.unsqueeze(0).f_ge_tensor(&lengths.unsqueeze(1))?;
        let _ = t.shallow_clone().f_masked_fill_(&pad.unsqueeze(-1), 0.0)?;
        Ok(())
    }

    /// Writes this model as a HuggingFace folder (`config.json` + safetensors, sharded past `max_shard_bytes`).
    /// Needs [`Depth::Full`], so the folder holds the whole model.
    pub fn save_hf(&self, dir: &Path, max_shard_bytes: usize) -> Result<(), ModelError> {
        if self.depth != Depth::Full {
            return Err(ModelError::NotFull);
        }
        std::fs::create_dir_all(dir).map_err(|err| ModelError::Io { path: dir.to_path_buf(), err })?;
        let c = &self.cfg;
        let (q, kv) = ((c.num_attention_heads * c.head_dim) as i64, (c.num_key_value_heads * c.head_dim) as i64);
        let rows = |t: &Tensor, start: i64, len: i64| t.narrow(0, start, len);
        let mut tensors: Vec<(String, Tensor)> =
            vec![("model.embed_tokens.weight".into(), self.embed_tokens.shallow_clone())];
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let mut put = |suffix: String, t: Tensor| tensors.push((format!("{p}.{suffix}"), t));
            put("input_layernorm.weight".into(), layer.input_layernorm.shallow_clone());
            put("post_attention_layernorm.weight".into(), layer.post_attention_layernorm.shallow_clone());
            put("self_attn.q_proj.weight".into(), rows(&layer.qkv_proj, 0, q));
            put("self_attn.k_proj.weight".into(), rows(&layer.qkv_proj, q, kv));
            put("self_attn.v_proj.weight".into(), rows(&layer.qkv_proj, q + kv, kv));
            put("self_attn.o_proj.weight".into(), layer.o_proj.shallow_clone());
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                put("self_attn.q_norm.weight".into(), qn.shallow_clone());
                put("self_attn.k_norm.weight".into(), kn.shallow_clone());
            }
            match &layer.mlp {
                Mlp::Dense { gate_up_proj, down_proj } => {
                    let i = gate_up_proj.size()[0] / 2;
                    put("mlp.gate_proj.weight".into(), rows(gate_up_proj, 0, i));
                    put("mlp.up_proj.weight".into(), rows(gate_up_proj, i, i));
                    put("mlp.down_proj.weight".into(), down_proj.shallow_clone());
                }
                Mlp::Sparse(sparse) if sparse.router_bias().is_some() => {
                    let bias = |t: Option<&Tensor>| t.expect("GPT-OSS experts have biases").shallow_clone();
                    put("mlp.router.weight".into(), sparse.router().shallow_clone());
                    put("mlp.router.bias".into(), bias(sparse.router_bias()));
                    put("mlp.experts.gate_up_proj".into(), sparse.gate_up().shallow_clone());
                    put("mlp.experts.gate_up_proj_bias".into(), bias(sparse.gate_up_bias()));
                    put("mlp.experts.down_proj".into(), sparse.down().shallow_clone());
                    put("mlp.experts.down_proj_bias".into(), bias(sparse.down_bias()));
                }
                Mlp::Sparse(sparse) => {
                    put("mlp.gate.weight".into(), sparse.router().shallow_clone());
                    let i = sparse.gate_up().size()[2] / 2;
                    for e in 0..sparse.gate_up().size()[0] {
                        let gate_up = sparse.gate_up().get(e).tr();
                        put(format!("mlp.experts.{e}.gate_proj.weight"), rows(&gate_up, 0, i));
                        put(format!("mlp.experts.{e}.up_proj.weight"), rows(&gate_up, i, i));
                        put(format!("mlp.experts.{e}.down_proj.weight"), sparse.down().get(e).tr());
                    }
                }
            }
            if let (Some(bias), Some(o_bias), Some(sinks)) = (&layer.qkv_bias, &layer.o_bias, &layer.sinks) {
                put("self_attn.q_proj.bias".into(), bias.narrow(0, 0, q));
                put("self_attn.k_proj.bias".into(), bias.narrow(0, q, kv));
                put("self_attn.v_proj.bias".into(), bias.narrow(0, q + kv, kv));
                put("self_attn.o_proj.bias".into(), o_bias.shallow_clone());
                put("self_attn.sinks".into(), sinks.shallow_clone());
            }
        }
        if let Some(norm) = &self.norm {
            tensors.push(("model.norm.weight".into(), norm.shallow_clone()));
        }
        if let Some(head) = &self.lm_head {
            tensors.push(("lm_head.weight".into(), head.shallow_clone()));
        }
        let host = tensors
            .into_iter()
            .map(|(name, t)| Ok((name, HostTensor::from_tensor(&t)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        write_sharded(dir, host, max_shard_bytes)?;
        self.save_hf_config(dir)
    }

    /// The HuggingFace `config.json` of this model, into the existing folder `dir`.
    pub fn save_hf_config(&self, dir: &Path) -> Result<(), ModelError> {
        let config = serde_json::to_string_pretty(&self.cfg.to_hf_json(kind_name(self.kind))).expect("json");
        let path = dir.join("config.json");
        std::fs::write(&path, config).map_err(|err| ModelError::Io { path, err })
    }
}

/// The positions `[B, S]` and the mask of packed rows ([`Target::capture_packed`]): each conversation's positions
/// from 0, each token seeing its own conversation's tokens up to itself; the padding after a row's conversations is
/// one more (ignored) conversation, so that no query sees nothing. With `segments`, the mask is the sequences of
/// flash attention over the rows laid end to end; else a bias over each row.
fn packed_attention(
    rows: &[Vec<i64>],
    s: i64,
    segments: bool,
    kind: Kind,
    device: Device,
) -> Result<(Tensor, PackedMask), ModelError> {
    let (mut positions, mut segment_of, mut cumulative) =
        (Vec::with_capacity(rows.len() * s as usize), vec![], vec![0]);
    for row in rows {
        let start = positions.len();
        for (segment, &len) in row.iter().enumerate() {
            positions.extend(0..len);
            segment_of.extend(std::iter::repeat_n(segment as i64, len as usize));
            cumulative.push(positions.len() as i32);
        }
        let used = (positions.len() - start) as i64;
        positions.extend(0..s - used);
        segment_of.extend(std::iter::repeat_n(row.len() as i64, (s - used) as usize));
        if used < s {
            cumulative.push(positions.len() as i32);
        }
    }
    let b = rows.len() as i64;
    let positions = Tensor::f_from_slice(&positions)?.f_view([b, s])?.f_to(device)?;
    if segments {
        let longest = cumulative.windows(2).map(|w| (w[1] - w[0]) as i64).max().unwrap_or(0);
        let cu_seqlens = Tensor::f_from_slice(&cumulative)?.f_to(device)?;
        return Ok((positions, PackedMask::Segments { cu_seqlens, longest }));
    }
    let segments = Tensor::f_from_slice(&segment_of)?.f_view([b, s])?.f_to(device)?;
    let same = segments.f_unsqueeze(2)?.f_eq_tensor(&segments.f_unsqueeze(1)?)?;
    let index = Tensor::f_arange(s, (Kind::Int64, device))?;
    let causal = index.f_unsqueeze(0)?.f_le_tensor(&index.f_unsqueeze(1)?)?;
    let visible = same.f_logical_and(&causal.f_unsqueeze(0)?)?;
    let bias =
        Tensor::f_zeros([b, s, s], (kind, device))?.f_masked_fill(&visible.f_logical_not()?, f64::NEG_INFINITY)?;
    Ok((positions, PackedMask::Bias(bias.f_unsqueeze(1)?)))
}

/// The target's attention as the decoding kernels take it: causal, no window.
const CAUSAL: LayerAttention = LayerAttention { window: None, causal: true };

/// One layer's attention of the queries `q` (`[B, heads, S, d]`) over the new keys and values `k`, `v` and, as
/// `keys` says, the cached ones (which get the new ones written): `[B, heads, S, d]`.
fn attention(layer: &DecoderLayer, q: &Tensor, k: Tensor, v: Tensor, keys: Keys<'_>) -> Result<Tensor, ModelError> {
    let s = q.size()[2];
    let gqa = k.size()[1] != q.size()[1];
    Ok(match (keys, &layer.sinks) {
        // The whole sequence on a GPU in bf16: flash attention with the window, the sink folded in after.
        (Keys::Causal, Some(sinks)) if flash_applies(q) => crate::ffi::attention::sink_flash_attention(
            &q.transpose(1, 2),
            &k.transpose(1, 2),
            &v.transpose(1, 2),
            sinks,
            layer.window,
        )?
        .transpose(1, 2),
        (keys, Some(sinks)) => {
            let positions = |start: i64| -> Result<Tensor, ModelError> {
                Ok(Tensor::f_arange_start(start, start + s, (Kind::Int64, q.device()))?.f_unsqueeze(0)?)
            };
            let (k, v, positions) = match keys {
                Keys::Causal => (k, v, positions(0)?),
                Keys::Cached { cache, layer: index, .. } => {
                    let start = cache.len();
                    let _written = cache.write(index, &k, &v)?;
                    let (k, v) = cache.prefix(index, context_bucket(start + s))?;
                    (k, v, positions(start)?)
                }
                Keys::Rows { cache, layer: index, positions, len, .. } => {
                    let (k, v) = cache.write_rows(index, positions, &k, &v, len)?;
                    (k, v, positions.f_unsqueeze(1)?)
                }
                Keys::Indexed { .. } | Keys::Fill { .. } => {
                    return Err(ModelError::Batch("attention sinks at a device position".into()));
                }
                Keys::Packed { .. } => {
                    return Err(ModelError::Batch("packed rows need a target without attention sinks".into()));
                }
            };
            sink_attention(q, &k, &v, sinks, layer.window, &positions)?
        }
        // (A prefill into rows was written above and attends as the whole sequence.)
        (Keys::Causal | Keys::Fill { .. }, None) => {
            Tensor::f_scaled_dot_product_attention(q, &k, &v, None::<Tensor>, 0.0, true, None, gqa)?
        }
        (Keys::Packed { mask: PackedMask::Bias(bias) }, None) => {
            // Every query head's keys written out: the masked kernels take no grouped heads.
            let rep = q.size()[1] / k.size()[1];
            let (k, v) = (repeat_kv(&k, rep), repeat_kv(&v, rep));
            Tensor::f_scaled_dot_product_attention(q, &k, &v, Some(bias), 0.0, false, None, false)?
        }
        (Keys::Packed { mask: PackedMask::Segments { cu_seqlens, longest } }, None) => {
            // [B, heads, S, d] -> the rows end to end, [B * S, heads, d], and back.
            let (b, heads, d) = (q.size()[0], q.size()[1], q.size()[3]);
            let flat = |t: &Tensor| -> Result<Tensor, ModelError> {
                Ok(t.f_transpose(1, 2)?.f_reshape([b * s, t.size()[1], d])?)
            };
            let out =
                crate::ffi::attention::varlen_flash_attention(&flat(q)?, &flat(&k)?, &flat(&v)?, cu_seqlens, *longest)?;
            out.f_view([b, s, heads, d])?.f_transpose(1, 2)?
        }
        (Keys::Indexed { cache, layer: index, positions, bias }, None) => {
            let (k, v) = cache.write_at(index, positions, &k, &v)?;
            match decode_attention(q, &k, &v, positions, CAUSAL)? {
                Some(out) => out,
                None => masked_attention(q, &k, &v, bias)?,
            }
        }
        (Keys::Rows { cache, layer: index, positions, len, bias }, None) => {
            let (k, v) = cache.write_rows(index, positions, &k, &v, len)?;
            masked_attention(q, &k, &v, bias)?
        }
        (Keys::Cached { cache, layer: index, positions, bias }, None) => {
            let (held_k, held_v) = cache.write(index, &k, &v)?;
            match bias {
                // After the prefill: the decoding kernels over what is held, else the bucketed cache, masked.
                Some(bias) => match decode_attention(q, &held_k, &held_v, positions, CAUSAL)? {
                    Some(out) => out,
                    None => {
                        let (k, v) = cache.prefix(index, bias.size()[3])?;
                        masked_attention(q, &k, &v, bias)?
                    }
                },
                // The prefill: causal over the prompt.
                None => Tensor::f_scaled_dot_product_attention(q, &k, &v, None::<Tensor>, 0.0, true, None, gqa)?,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-8B over two GPUs: the first also holds the embedding and the (untied) LM head, 2.5 GB in bf16, worth
    /// about six and a half layers of 0.39 GB, so the even split of 15.6 GB gives it 13 of the 34 layers capture runs
    /// and the second 21; with a tied head (one table) 15 and 19.
    #[test]
    fn spreading_counts_the_embedding_and_head_on_the_first_device() {
        let count = |cfg: &TargetConfig| {
            let specs = hf_tensors(cfg, 34, false).into_iter().map(|(n, s, m)| (n, (s, m))).collect();
            let (per_layer, first) = layer_bytes(cfg, &specs, 34, Kind::BFloat16);
            let placed = split_layers(&per_layer, first, &[1, 1]);
            (placed.iter().filter(|&&p| p == 0).count(), placed.iter().filter(|&&p| p == 1).count())
        };
        let untied = crate::model::Preset::Qwen3_8b.spec().target;
        assert_eq!(count(&untied), (13, 21));
        let tied = TargetConfig { tie_word_embeddings: true, ..untied };
        assert_eq!(count(&tied), (15, 19));
    }

    /// Qwen3-8B's 34 layers (15.6 GB with embedding and head) on one GPU with 10 GiB free are refused, naming the
    /// device and what to do; on two with 10 GiB each they fit; the same GPU named twice counts its load once.
    #[test]
    fn a_split_that_does_not_fit_the_free_memory_is_refused() {
        let cfg = crate::model::Preset::Qwen3_8b.spec().target;
        let specs = hf_tensors(&cfg, 34, false).into_iter().map(|(n, s, m)| (n, (s, m))).collect();
        let (per_layer, first) = layer_bytes(&cfg, &specs, 34, Kind::BFloat16);
        let ten = 10u64 << 30;
        let (a, b) = (Device::Cuda(0), Device::Cuda(1));
        let err = check_fit(&per_layer, first, &[0; 34], &[a], &[ten]).unwrap_err().to_string();
        assert!(err.contains("cuda:0") && err.contains("14.5 GiB") && err.contains("spread_to"), "{err}");
        let parts = split_layers(&per_layer, first, &[ten, ten]);
        check_fit(&per_layer, first, &parts, &[a, b], &[ten, ten]).unwrap();
        let err = check_fit(&per_layer, first, &parts, &[a, a], &[ten, ten]).unwrap_err().to_string();
        assert!(err.contains("cuda:0"), "{err}");
    }

    /// Packed rows for flash attention: each conversation a sequence, and each row's padding one more, over the rows
    /// laid end to end; every position at its place in its own conversation.
    #[test]
    fn packed_rows_for_flash_attention_are_their_conversations_and_padding() {
        let (positions, mask) =
            packed_attention(&[vec![9, 1, 14], vec![6]], 24, true, Kind::Float, Device::Cpu).unwrap();
        let PackedMask::Segments { cu_seqlens, longest } = mask else { panic!("segments asked for") };
        assert_eq!(Vec::<i32>::try_from(&cu_seqlens).unwrap(), [0, 9, 10, 24, 30, 48]);
        assert_eq!(longest, 18);
        let row = |r: i64| Vec::<i64>::try_from(&positions.get(r)).unwrap();
        assert_eq!(row(0), [(0..9).collect::<Vec<i64>>(), vec![0], (0..14).collect()].concat());
        assert_eq!(row(1), [(0..6).collect::<Vec<i64>>(), (0..18).collect()].concat());
        // A full row adds no padding sequence.
        let (_, mask) = packed_attention(&[vec![10, 14]], 24, true, Kind::Float, Device::Cpu).unwrap();
        let PackedMask::Segments { cu_seqlens, longest } = mask else { panic!("segments asked for") };
        assert_eq!((Vec::<i32>::try_from(&cu_seqlens).unwrap(), longest), (vec![0, 10, 24], 14));
    }

    /// On a GPU in bf16 packed rows take flash attention over each conversation, and each conversation's taps and last
    /// states are those it has alone in a row (the CPU's f32 test of the masked path is tests/target_model.rs').
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_packed_rows_capture_what_each_captures_alone() {
        let device = crate::device::gpu_for_tests();
        let target = crate::model::Preset::Tiny.spec().build_target(Depth::Full, device, Kind::BFloat16).unwrap();
        let lengths = [[37i64, 5, 80], [64, 0, 0]];
        let s = 122;
        let rows: Vec<Vec<i64>> = lengths.iter().map(|r| r.iter().copied().filter(|&l| l > 0).collect()).collect();
        let vocab = target.config().vocab_size as i64;
        let ids = Tensor::randint(vocab, [2, s], (Kind::Int64, device));
        let (taps, last) = target.capture_packed(&ids, &rows, true).unwrap();
        let last = last.unwrap();
        let rel = |a: &Tensor, b: &Tensor| {
            let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
            (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-12)
        };
        for (r, row) in rows.iter().enumerate() {
            let mut start = 0;
            for &len in row {
                let alone_ids = ids.get(r as i64).narrow(0, start, len).unsqueeze(0);
                let (alone, alone_last) = target.capture_with_last(&alone_ids, &[len]).unwrap();
                let err = rel(&taps.get(r as i64).narrow(0, start, len), &alone.get(0));
                assert!(err < 1e-2, "taps of row {r} at {start}: relative error {err}");
                let err = rel(&last.get(r as i64).narrow(0, start, len), &alone_last.get(0));
                assert!(err < 1e-2, "last states of row {r} at {start}: relative error {err}");
                start += len;
            }
        }
        assert_eq!(taps.get(1).narrow(0, 64, s - 64).abs().max().double_value(&[]), 0.0, "padding is zero");
    }
}
