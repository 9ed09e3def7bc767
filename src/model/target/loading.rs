//! Building a target: weights from a HuggingFace folder, one safetensors file in memory or random draws, placed on
//! one device or spread over several (contiguous runs of layers balanced by their bytes, refused where they do not
//! fit the free memory).
use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::layers::DecoderLayer;
use super::{Depth, Target, validate_taps};
use crate::model::ModelError;
use crate::model::config::TargetConfig;
use crate::model::init::{Init, InitStream};
use crate::model::layers::Rope;
use crate::model::split::split_layers;
use crate::model::weights::{WeightFiles, dequantize_mxfp4};

/// The tensor names and shapes of the HuggingFace checkpoint of `cfg` (layers `0..num_layers`), and whether each
/// is a matrix (norm weights are not).
pub(super) fn hf_tensors(cfg: &TargetConfig, num_layers: usize, with_head: bool) -> Vec<(String, Vec<usize>, bool)> {
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
pub(super) fn layer_bytes(
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
pub(super) fn spread(
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
                .map(|&d| Ok(crate::device::memory_stats(d)?.free_to_this_process()))
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
pub(super) fn check_fit(
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

pub(super) const GIB: f64 = (1u64 << 30) as f64;

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
            let stored = crate::model::weights::kind_of(view.dtype()).ok_or_else(|| bad(format!("{name}: dtype")))?;
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
    pub(super) fn build(
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-8B over two GPUs: the first also holds the embedding and the (untied) LM head, 2.5 GB in bf16, worth
    /// about six and a half layers of 0.39 GB, so the even split of 15.6 GB gives it 13 of the 34 layers capture runs
    /// and the second 21; with a tied head (one table) 15 and 19.
    #[test]
    pub(super) fn spreading_counts_the_embedding_and_head_on_the_first_device() {
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
    pub(super) fn a_split_that_does_not_fit_the_free_memory_is_refused() {
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
}
