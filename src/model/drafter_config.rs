//! The drafter's shape and its DFlash settings, read from and written to the published drafters' `config.json`:
//! a Qwen3 config with `architectures: ["DFlashDraftModel"]` (or `["DFlash2DraftModel"]` with DFlash 2's sizes in
//! `dflash_config`, [`Variant`]), plus `block_size`, `num_target_layers` and `dflash_config {mask_token_id,
//! target_layer_ids}` (read from the top level too, as the reference loader does). Speculators' layout is read too,
//! as z-lab's layout says the same drafter.
//! Each layer's attention (sliding window, causal block) is read as transformers then vLLM resolve it, and written
//! with the keys vLLM and SGLang both need ([`layer_attention_from_json`]).
use std::path::Path;

use serde_json::{Value, json};

use super::attention::LayerAttention;
use super::config::{Architecture, RopeScaling, TargetConfig, read_config_json};
use super::target::validate_taps;
use super::variant::Variant;
use super::{ModelError, Preset};

/// Drafter layers of the published drafters, and of the presets' drafters.
pub const DEFAULT_DRAFTER_LAYERS: usize = 5;

#[derive(Debug, Clone, PartialEq)]
pub struct DrafterConfig {
    /// The Qwen3 decoder shape (`num_hidden_layers` is the drafter's own depth).
    pub decoder: TargetConfig,
    pub block_size: usize,
    pub mask_token_id: i64,
    /// Target layers whose outputs feed `fc`, in order.
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: usize,
    /// Each layer's window and causality (default: full attention, a bidirectional block).
    pub layer_attention: Vec<LayerAttention>,
    /// Which member of the DFlash family: the layers and heads it adds to the shared backbone.
    pub variant: Variant,
}

impl DrafterConfig {
    /// FLOPs of one sample's training step at `seq` tokens and `anchors` blocks: the cost model of DFLASH.md as the
    /// PyTorch peer counts it (dense attention as if every score were computed), with `Q = N*bs` block positions and
    /// `K = S + Q` keys: `fc = S * taps * H * H`, `layer = Q*H*(heads*hd) + K*H*(2*kv_heads*hd) + Q*(heads*hd)*H +
    /// 3*Q*H*I`, `attn = 2 * Q * K * hd * heads`; FLOPs = `2 * (3 * (fc + L*layer) + 3 * L * attn + 2 * Q * H * V)`:
    /// trained products count forward plus two backward products, the frozen LM head forward plus the input gradient.
    pub fn training_flops_per_sample(&self, seq: i64, anchors: usize) -> f64 {
        let q = (anchors * self.block_size) as f64;
        let dense = q * (seq as f64 + q);
        self.training_flops(seq, anchors, |_| dense)
    }

    /// [`DrafterConfig::training_flops_per_sample`] with each layer's attention counting only the (query, key) pairs
    /// it computes: a block's queries see the context before their anchor and their own block, as the layer's window
    /// and causality allow ([`LayerAttention::hides`]). The anchors are drawn uniformly from the sample's positions
    /// (all supervised), so each block's pairs are their mean over every anchor position `0..=seq-2`. This is the
    /// work attention kernels that skip hidden keys do; the dense count is the peer's.
    pub fn training_flops_seen_keys(&self, seq: i64, anchors: usize) -> f64 {
        let positions = (seq - 1).max(1);
        self.training_flops(seq, anchors, |layer| {
            let pairs: i64 = (0..positions).map(|a| block_pairs_seen(a, 0, self.block_size as i64, layer)).sum();
            anchors as f64 * pairs as f64 / positions as f64
        })
    }

    /// The cost model with `pairs(layer)` (query, key) scores per sample in each layer's attention.
    fn training_flops(&self, seq: i64, anchors: usize, pairs: impl Fn(&LayerAttention) -> f64) -> f64 {
        let c = &self.decoder;
        let f = |x: usize| x as f64;
        let (h, i, hd, v) = (f(c.hidden_size), f(c.intermediate_size), f(c.head_dim), f(c.vocab_size));
        let (heads, kv, layers) = (f(c.num_attention_heads), f(c.num_key_value_heads), f(c.num_hidden_layers));
        let q = f(anchors * self.block_size);
        let k = seq as f64 + q;
        let fc = seq as f64 * f(self.target_layer_ids.len()) * h * h;
        let layer = q * h * heads * hd + k * h * 2.0 * kv * hd + q * heads * hd * h + 3.0 * q * h * i;
        let full = LayerAttention::default();
        let attn: f64 = (0..c.num_hidden_layers)
            .map(|l| 2.0 * pairs(self.layer_attention.get(l).unwrap_or(&full)) * hd * heads)
            .sum();
        2.0 * (3.0 * (fc + layers * layer) + 3.0 * attn + 2.0 * q * h * v)
    }

    /// A drafter for `target`: same hidden size, heads, RoPE and vocabulary, `num_layers` layers.
    pub fn for_target(
        target: &TargetConfig,
        num_layers: usize,
        intermediate_size: Option<usize>,
        block_size: usize,
        target_layer_ids: Vec<usize>,
        mask_token_id: i64,
    ) -> Result<Self, String> {
        let decoder = TargetConfig {
            architecture: Architecture::Qwen3,
            num_hidden_layers: num_layers,
            intermediate_size: intermediate_size.unwrap_or(target.intermediate_size),
            tie_word_embeddings: false,
            moe: None,
            gpt_oss: None,
            ..target.clone()
        };
        let cfg = DrafterConfig {
            decoder,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers: target.num_hidden_layers,
            layer_attention: vec![LayerAttention::default(); num_layers],
            variant: Variant::DFlash,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The same drafter as another member of the family.
    pub fn with_variant(self, variant: Variant) -> Result<Self, String> {
        let cfg = DrafterConfig { variant, ..self };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The same drafter with each layer's attention as given.
    pub fn with_layer_attention(self, layer_attention: Vec<LayerAttention>) -> Result<Self, String> {
        let cfg = DrafterConfig { layer_attention, ..self };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The drafter the presets' benchmarks and default runs use: 5 layers (2 for the tiny ones, 4 for smollm2-135m).
    pub fn for_preset(preset: Preset, block_size: usize) -> Self {
        let spec = preset.spec();
        let layers = match preset {
            p if p.is_tiny() => 2,
            // README's worked example's drafter (config/smollm2-135m.toml).
            Preset::Smollm2_135m => 4,
            _ => DEFAULT_DRAFTER_LAYERS,
        };
        Self::for_target(&spec.target, layers, None, block_size, spec.taps, spec.mask_token_id)
            .expect("preset drafters are valid")
    }

    pub fn validate(&self) -> Result<(), String> {
        self.decoder.validate()?;
        if self.block_size < 2 {
            return Err(format!("`block_size` ({}) must be at least 2", self.block_size));
        }
        if self.mask_token_id < 0 || self.mask_token_id as usize >= self.decoder.vocab_size {
            return Err(format!(
                "`mask_token_id` ({}) must be a row of the target's embedding (0..{})",
                self.mask_token_id, self.decoder.vocab_size
            ));
        }
        validate_taps(&self.target_layer_ids, self.num_target_layers)
            .map_err(|e| format!("`target_layer_ids`: {e}"))?;
        validate_layer_attention(&self.layer_attention, self.decoder.num_hidden_layers)?;
        self.variant.validate(self.decoder.hidden_size, self.decoder.vocab_size, self.block_size)
    }

    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        read_config_json(dir, "a DFlash drafter folder (config.json, model.safetensors)", Self::from_json)
    }

    /// Reads a drafter's `config.json` in z-lab's layout, or in speculators' (rewritten as z-lab's layout says the
    /// same drafter first).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let v = match v.get("speculators_model_type") {
            Some(_) => speculators_as_zlab_layout(&v)?,
            None => v,
        };
        let arch = v.get("architectures").cloned();
        let registration = match arch.as_ref().and_then(Value::as_array).map(Vec::as_slice) {
            Some([Value::String(a)]) => Variant::of_architecture(a),
            _ => None,
        };
        let Some(registration) = registration else {
            return Err(format!(
                "`architectures` is {}, not {}: this is not a DFlash drafter folder",
                arch.map_or("missing".to_string(), |a| a.to_string()),
                Variant::architectures()
            ));
        };
        // The decoder part is a Qwen3 config; read it with the target's reader (the layers' windows apart).
        let mut qwen3 = v.clone();
        qwen3["architectures"] = json!(["Qwen3ForCausalLM"]);
        qwen3["use_sliding_window"] = json!(false);
        let decoder = TargetConfig::from_json(&qwen3.to_string())?;
        let dflash = v.get("dflash_config").cloned().unwrap_or(json!({}));
        let field = |name: &str| dflash.get(name).or_else(|| v.get(name)).cloned();
        let int = |name: &str| -> Result<Option<i64>, String> {
            match field(name) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_i64().map(Some).ok_or_else(|| format!("`{name}` must be an integer")),
            }
        };
        let mask_token_id = int("mask_token_id")?.ok_or("missing `dflash_config.mask_token_id`")?;
        let block_size = int("block_size")?.unwrap_or(16);
        let target_layer_ids: Vec<usize> = match field("target_layer_ids") {
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|i| i.as_u64().map(|i| i as usize))
                .collect::<Option<_>>()
                .ok_or("`target_layer_ids` must be a list of non-negative integers")?,
            _ => return Err("missing `dflash_config.target_layer_ids`".into()),
        };
        let num_target_layers = match int("num_target_layers")? {
            Some(n) => n as usize,
            None => target_layer_ids.last().map_or(0, |l| l + 1),
        };
        let layer_attention = layer_attention_from_json(&v, decoder.num_hidden_layers)?;
        let variant = registration.build(|key| {
            let n =
                int(key)?.ok_or_else(|| format!("missing `dflash_config.{key}` (a {} drafter)", registration.name))?;
            usize::try_from(n).map_err(|_| format!("`{key}` must be positive"))
        })?;
        variant.refuse_untrained(&field)?;
        let cfg = DrafterConfig {
            decoder,
            block_size: usize::try_from(block_size).map_err(|_| "`block_size` must be positive")?,
            mask_token_id,
            target_layer_ids,
            num_target_layers,
            layer_attention,
            variant,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The published `config.json`.
    pub fn to_json(&self, torch_dtype: &str) -> Value {
        let layers = self.decoder.num_hidden_layers;
        let mut v = self.decoder.to_hf_json(torch_dtype);
        v["architectures"] = json!([self.variant.architecture()]);
        v["model_type"] = json!("qwen3");
        v["dtype"] = json!(torch_dtype);
        v["attention_dropout"] = json!(0.0);
        v["initializer_range"] = json!(0.02);
        write_layer_attention(&mut v, &self.layer_attention);
        v["max_window_layers"] = json!(layers);
        v["use_cache"] = json!(true);
        if self.decoder.rope_scaling == RopeScaling::None {
            v["rope_scaling"] = Value::Null;
        }
        v["block_size"] = json!(self.block_size);
        v["num_target_layers"] = json!(self.num_target_layers);
        v["dflash_config"] = json!({
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
        });
        self.variant.write_dflash_config(&mut v["dflash_config"], self.block_size);
        v
    }

    /// The distinct kinds of layer that restrict DFlash's rule (a window, a causal block), in layer order: one attention
    /// pattern serves every layer of a kind.
    pub fn restricting_kinds(&self) -> Vec<LayerAttention> {
        let mut kinds: Vec<LayerAttention> = Vec::new();
        for layer in self.layer_attention.iter().filter(|l| l.restricts()) {
            if !kinds.contains(layer) {
                kinds.push(*layer);
            }
        }
        kinds
    }

    /// Width of the concatenated target features `fc` reads.
    pub fn context_width(&self) -> usize {
        self.target_layer_ids.len() * self.decoder.hidden_size
    }
}

/// A drafter folder's `config.json` in speculators' format (`speculators_model_type` "dflash" or "dflash2", as
/// [`super::speculators`] writes it), rewritten as
/// z-lab's layout says the same drafter, for [`DrafterConfig::from_json`]: the layers' shape from
/// `transformer_layer_config`, the taps one lower (`aux_hidden_state_layer_ids` count the embedding), the block size,
/// MASK token and DFlash 2's sizes into `dflash_config`, and the blocks' causality as vLLM reads it (`is_causal`, else
/// `not sliding_window_non_causal`). What dflash does not train is refused: a reduced draft vocabulary, drafting from
/// the anchor.
fn speculators_as_zlab_layout(v: &Value) -> Result<Value, String> {
    let model_type = v["speculators_model_type"].as_str().unwrap_or_default();
    let Some(registration) = Variant::named(model_type) else {
        return Err(format!(
            "speculators_model_type {model_type:?} is not a DFlash drafter ({})",
            Variant::names().replace('"', "")
        ));
    };
    let mut out = v.get("transformer_layer_config").filter(|l| l.is_object()).cloned().ok_or_else(|| {
        "a speculators folder without `transformer_layer_config` (the drafter's layers): not one speculators wrote"
            .to_string()
    })?;
    let vocab = out["vocab_size"].as_u64();
    if v["draft_vocab_size"].as_u64().is_some_and(|d| Some(d) != vocab) {
        return Err(format!(
            "draft_vocab_size {} differs from the vocabulary ({}): dflash drafts over the target's whole vocabulary",
            v["draft_vocab_size"], out["vocab_size"]
        ));
    }
    if v["sample_from_anchor"].as_bool() == Some(true) {
        return Err("sample_from_anchor = true (the anchor slot drafts too): dflash drafts after the anchor".into());
    }
    let aux: Vec<u64> = v["aux_hidden_state_layer_ids"]
        .as_array()
        .and_then(|ids| ids.iter().map(Value::as_u64).collect())
        .ok_or("missing `aux_hidden_state_layer_ids` (a list of layer ids)")?;
    if aux.contains(&0) {
        return Err("aux_hidden_state_layer_ids names 0, the embedding: DFlash taps decoder layers".into());
    }
    out["architectures"] = json!([registration.architecture]);
    out["block_size"] = v["block_size"].clone();
    let mut dflash = json!({
        "mask_token_id": v["mask_token_id"],
        "target_layer_ids": aux.iter().map(|i| i - 1).collect::<Vec<_>>(),
        "block_size": v["block_size"],
        "causal": !v["sliding_window_non_causal"].as_bool().unwrap_or(true),
    });
    for key in registration.keys {
        dflash[key] = v[key].clone();
    }
    out["dflash_config"] = dflash;
    Ok(out)
}

const SLIDING: &str = "sliding_attention";
const FULL: &str = "full_attention";

/// Each draft layer's attention from a drafter's `config.json` `v`, as vLLM (`qwen3_dflash.py`,
/// `_resolve_layer_attention`) resolves it from the config transformers makes of the file (`Qwen3Config`: without
/// `use_sliding_window: true` the window is null; without `layer_types`, layers from `max_window_layers` (28) on
/// slide when there is a window). A layer slides where `layer_types` says so, or everywhere with
/// `dflash_config.use_swa` when no layer does; its window is `dflash_config.swa_window_size`, else `sliding_window`;
/// it is causal per `is_causal`, else `dflash_config.causal`, else where `layer_types` says it slides. SGLang reads
/// the same from `layer_types`, `sliding_window` and `is_causal`, which [`write_layer_attention`] writes.
pub fn layer_attention_from_json(v: &Value, layers: usize) -> Result<Vec<LayerAttention>, String> {
    let dflash = v.get("dflash_config").cloned().unwrap_or(json!({}));
    let flag = |x: Option<&Value>, name: &str| -> Result<Option<bool>, String> {
        match x {
            None | Some(Value::Null) => Ok(None),
            Some(b) => b.as_bool().map(Some).ok_or_else(|| format!("`{name}` must be true or false")),
        }
    };
    let positive = |x: Option<&Value>, name: &str| -> Result<Option<i64>, String> {
        match x {
            None | Some(Value::Null) => Ok(None),
            Some(n) => {
                n.as_i64().filter(|n| *n > 0).map(Some).ok_or_else(|| format!("`{name}` must be a positive integer"))
            }
        }
    };
    let use_sliding_window = flag(v.get("use_sliding_window"), "use_sliding_window")?.unwrap_or(false);
    // Qwen3Config's default window is 4096, kept only with use_sliding_window.
    let sliding_window = match v.get("sliding_window") {
        None => Some(4096),
        some => positive(some, "sliding_window")?,
    }
    .filter(|_| use_sliding_window);
    let layer_types: Vec<bool> = match v.get("layer_types") {
        None | Some(Value::Null) => {
            let from = positive(v.get("max_window_layers"), "max_window_layers")?.unwrap_or(28) as usize;
            (0..layers).map(|i| sliding_window.is_some() && i >= from).collect()
        }
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some(SLIDING) => Ok(true),
                Some(FULL) => Ok(false),
                _ => Err(format!("`layer_types` entries must be \"{SLIDING}\" or \"{FULL}\", not {t}")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("`layer_types` must be a list, not {other}")),
    };
    if layer_types.len() != layers {
        return Err(format!("`layer_types` has {} entries for {layers} layers", layer_types.len()));
    }
    let use_swa = flag(dflash.get("use_swa"), "dflash_config.use_swa")?.unwrap_or(false);
    let any_sliding = layer_types.iter().any(|s| *s);
    let window = positive(dflash.get("swa_window_size"), "dflash_config.swa_window_size")?.or(sliding_window);
    let causal = flag(v.get("is_causal"), "is_causal")?.or(flag(dflash.get("causal"), "dflash_config.causal")?);
    layer_types
        .iter()
        .map(|&typed_sliding| {
            let sliding = if use_swa && !any_sliding { true } else { typed_sliding };
            let window = match (sliding, window) {
                (false, _) => None,
                (true, Some(w)) => Some(w),
                (true, None) => {
                    return Err("sliding-window layers need a window: `sliding_window` with `use_sliding_window: \
                                true` (transformers drops it otherwise), or `dflash_config.swa_window_size`"
                        .to_string());
                }
            };
            Ok(LayerAttention { window, causal: causal.unwrap_or(typed_sliding) })
        })
        .collect()
}

/// Writes each layer's attention into a drafter's `config.json` `v` with the keys both engines read: `layer_types`,
/// `sliding_window` and `use_sliding_window` (without which transformers drops the window), and `is_causal` where
/// the layers' causality is not the engines' default (causal exactly where a layer slides).
pub fn write_layer_attention(v: &mut Value, layers: &[LayerAttention]) {
    let types: Vec<&str> = layers.iter().map(|l| if l.window.is_some() { SLIDING } else { FULL }).collect();
    v["layer_types"] = json!(types);
    let window = layers.iter().find_map(|l| l.window);
    v["use_sliding_window"] = json!(window.is_some());
    v["sliding_window"] = json!(window);
    let by_default = layers.iter().all(|l| l.causal == l.window.is_some());
    if let (false, Some(first)) = (by_default, layers.first()) {
        v["is_causal"] = json!(first.causal);
    } else if let Some(map) = v.as_object_mut() {
        map.remove("is_causal");
    }
}

/// What the engines can serve: one layer per entry, one window for every sliding layer, and causality either the
/// engines' default (causal exactly where a layer slides) or the same for every layer (`is_causal`).
fn validate_layer_attention(layers: &[LayerAttention], num_layers: usize) -> Result<(), String> {
    if layers.len() != num_layers {
        return Err(format!("the attention of {} layers given for {num_layers} layers", layers.len()));
    }
    let mut windows: Vec<i64> = layers.iter().filter_map(|l| l.window).collect();
    windows.dedup();
    if windows.len() > 1 || windows.first().is_some_and(|w| *w < 1) {
        return Err(format!("sliding-window layers must share one positive window, not {windows:?}"));
    }
    let by_default = layers.iter().all(|l| l.causal == l.window.is_some());
    let uniform = layers.windows(2).all(|w| w[0].causal == w[1].causal);
    if !by_default && !uniform {
        return Err("layers must be causal exactly where they slide, or all causal, or none: vLLM and SGLang \
                    read no other causality"
            .into());
    }
    Ok(())
}

/// The decay of the loss weights over block slots that DFLASH.md gives per block size (7 for 16, 5 for 10, 4 for
/// 8); `None` for other block sizes, which must set it explicitly.
pub fn default_gamma(block_size: usize) -> Option<f64> {
    match block_size {
        16 => Some(7.0),
        10 => Some(5.0),
        8 => Some(4.0),
        _ => None,
    }
}

/// z-lab's rule for the tapped target layers (`build_target_layer_ids` in their `dflash` package, which SGLang and
/// SpecForge copy): one draft layer taps layer L // 2; more tap as many layers, evenly spaced from layer 1 to layer
/// L - 3, each rounded as Python's `round` does (half to even). 36 layers and 5 draft layers: [1, 9, 17, 25, 33]; 32:
/// [1, 8, 15, 22, 29]. `None` when the target is too shallow for distinct taps.
pub fn auto_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Option<Vec<usize>> {
    if num_draft_layers == 1 {
        return Some(vec![num_target_layers / 2]);
    }
    let (start, end) = (1.0, num_target_layers as f64 - 3.0);
    let span = end - start;
    let ids: Vec<usize> = (0..num_draft_layers)
        .map(|i| (start + i as f64 * span / (num_draft_layers - 1) as f64).round_ties_even())
        .map(|x| x.max(0.0) as usize)
        .collect();
    let increasing = ids.windows(2).all(|w| w[0] < w[1]) && ids.last().is_some_and(|&l| l < num_target_layers);
    (span > 0.0 && increasing).then_some(ids)
}

/// The (query, key) pairs a block anchored at `anchor` computes in `layer`: each of its `block_size` queries (at
/// `anchor + k`) against the context keys from `start` (its conversation's start) to the anchor and the block's own
/// keys, less what the layer's window and causality hide ([`LayerAttention::hides`]).
pub fn block_pairs_seen(anchor: i64, start: i64, block_size: i64, layer: &LayerAttention) -> i64 {
    let reach = layer.window.map_or(i64::MAX, |w| w - 1);
    (0..block_size)
        .map(|k| {
            let query = anchor + k;
            // Context keys p in [start, anchor) with query - p <= reach.
            let first = start.max(query.saturating_sub(reach));
            let context = (anchor - first).max(0);
            // Block keys j with |k - j| <= reach, and j <= k where causal.
            let lo = k - reach.min(k);
            let hi = if layer.causal { k } else { (k + reach.min(block_size)).min(block_size - 1) };
            context + (hi - lo + 1)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::auto_target_layer_ids as auto;

    /// The published drafters' taps, SGLang's and SpecForge's copies of the rule, and Python's half-to-even
    /// rounding (11 layers, 3 draft layers: 4.5 rounds to 4).
    #[test]
    fn auto_taps_follow_z_labs_rule() {
        assert_eq!(auto(36, 5), Some(vec![1, 9, 17, 25, 33]));
        assert_eq!(auto(32, 5), Some(vec![1, 8, 15, 22, 29]));
        assert_eq!(auto(28, 4), Some(vec![1, 9, 17, 25]));
        assert_eq!(auto(11, 3), Some(vec![1, 4, 8]));
        assert_eq!(auto(13, 3), Some(vec![1, 6, 10]), "5.5 rounds to the even 6");
        assert_eq!(auto(8, 1), Some(vec![4]));
        assert_eq!(auto(8, 5), Some(vec![1, 2, 3, 4, 5]));
        assert_eq!(auto(6, 5), None, "too shallow for five distinct taps");
        assert_eq!(auto(4, 2), None);
    }

    use super::*;

    /// A block's pairs are the keys [`LayerAttention::hides`] leaves each of its queries, for every kind of layer,
    /// anchors near the start and far from it, and a conversation starting mid-row.
    #[test]
    fn block_pairs_are_what_the_layer_leaves_visible() {
        use tch::{Device, Kind, Tensor};
        let bs = 8i64;
        for window in [None, Some(1), Some(3), Some(8), Some(20)] {
            for causal in [false, true] {
                let layer = LayerAttention { window, causal };
                for (anchor, start) in [(0, 0), (1, 0), (5, 0), (40, 0), (40, 30), (30, 30)] {
                    // Keys: the context [start, anchor), then the block's own positions.
                    let keys: Vec<i64> = (start..anchor).chain(anchor..anchor + bs).collect();
                    let queries = Tensor::arange_start(anchor, anchor + bs, (Kind::Int64, Device::Cpu)).view([bs, 1]);
                    let key_at = Tensor::from_slice(&keys).view([1, -1]);
                    let visible = match layer.hides(&queries, &key_at).unwrap() {
                        Some(hidden) => hidden.logical_not().sum(Kind::Int64).int64_value(&[]),
                        None => bs * keys.len() as i64,
                    };
                    assert_eq!(
                        block_pairs_seen(anchor, start, bs, &layer),
                        visible,
                        "{layer:?} at {anchor} from {start}"
                    );
                }
            }
        }
    }

    /// Full attention over a bidirectional block: a block at anchor `a` computes `bs * (a + bs)` pairs, `bs * ((S -
    /// 2) / 2 + bs)` on average; windows count fewer, and the dense count more than either.
    #[test]
    fn seen_keys_count_the_mean_block_and_windows_count_less() {
        let cfg = DrafterConfig::for_preset(Preset::Qwen3_8b, 16);
        let (seq, anchors) = (3072i64, 512usize);
        let c = &cfg.decoder;
        let per_pair = 2.0 * 3.0 * 2.0 * (c.head_dim * c.num_attention_heads * c.num_hidden_layers) as f64;
        let mean_pairs = 16.0 * ((seq - 2) as f64 / 2.0 + 16.0);
        let expected_gap = per_pair * anchors as f64 * (16.0 * (seq as f64 + 16.0 * anchors as f64) - mean_pairs);
        let gap = cfg.training_flops_per_sample(seq, anchors) - cfg.training_flops_seen_keys(seq, anchors);
        assert!((gap / expected_gap - 1.0).abs() < 1e-9, "{gap} vs {expected_gap}");
        let windowed = cfg
            .clone()
            .with_layer_attention(vec![LayerAttention { window: Some(256), causal: false }; c.num_hidden_layers])
            .unwrap();
        assert!(windowed.training_flops_seen_keys(seq, anchors) < cfg.training_flops_seen_keys(seq, anchors));
    }

    #[test]
    fn round_trips_and_reads_top_level_fields() {
        // Each RoPE the drafter can inherit from its target: plain, Llama-3's, YaRN (GPT-OSS).
        for preset in [Preset::Llama31_8b, Preset::GptOss20b] {
            let cfg = DrafterConfig::for_preset(preset, 16);
            assert_eq!(DrafterConfig::from_json(&cfg.to_json("bfloat16").to_string()).unwrap(), cfg, "{preset}");
        }
        let cfg = DrafterConfig::for_preset(Preset::Qwen3_8b, 16);
        let json = cfg.to_json("bfloat16");
        assert_eq!(DrafterConfig::from_json(&json.to_string()).unwrap(), cfg);
        // The reference loader also takes the DFlash keys from the top level.
        let mut flat = json.clone();
        flat["mask_token_id"] = json.pointer("/dflash_config/mask_token_id").unwrap().clone();
        flat["target_layer_ids"] = json.pointer("/dflash_config/target_layer_ids").unwrap().clone();
        flat.as_object_mut().unwrap().remove("dflash_config");
        assert_eq!(DrafterConfig::from_json(&flat.to_string()).unwrap(), cfg);
    }

    #[test]
    fn rejects_what_is_not_a_drafter() {
        let cfg = DrafterConfig::for_preset(Preset::Tiny, 4);
        let mut json = cfg.to_json("float32");
        json["architectures"] = json!(["Qwen3ForCausalLM"]);
        assert!(DrafterConfig::from_json(&json.to_string()).unwrap_err().contains("not a DFlash drafter"));
        let mut json = cfg.to_json("float32");
        json["dflash_config"]["mask_token_id"] = json!(99999);
        assert!(DrafterConfig::from_json(&json.to_string()).unwrap_err().contains("mask_token_id"));
        let mut json = cfg.to_json("float32");
        json["dflash_config"]["target_layer_ids"] = json!([5, 1]);
        assert!(DrafterConfig::from_json(&json.to_string()).unwrap_err().contains("target_layer_ids"));
        let mut json = cfg.to_json("float32");
        json["block_size"] = json!(1);
        assert!(DrafterConfig::from_json(&json.to_string()).unwrap_err().contains("block_size"));
    }

    /// Each layer's attention as vLLM 0.34's `_resolve_layer_attention` resolves it from what transformers 5.25's
    /// `Qwen3Config` makes of the file, one published layout per case (the cases its docstring names among them).
    #[test]
    fn layer_attention_is_read_as_transformers_then_vllm_read_it() {
        let full = LayerAttention::default();
        let slide = |w: i64, causal: bool| LayerAttention { window: Some(w), causal };
        let read = |extra: Value| {
            let mut v = DrafterConfig::for_preset(Preset::Tiny, 4).to_json("float32");
            for key in ["layer_types", "use_sliding_window", "sliding_window", "max_window_layers"] {
                v.as_object_mut().unwrap().remove(key);
            }
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            layer_attention_from_json(&v, 2)
        };
        let types = |t: [&str; 2]| json!(t);
        // Nothing said: full attention, a bidirectional block (z-lab's Qwen3 drafters).
        assert_eq!(read(json!({})).unwrap(), vec![full, full]);
        // Mixed layer types (z-lab's gemma-4 drafter): causal only where a layer slides.
        let mixed = json!({"layer_types": types([SLIDING, FULL]), "use_sliding_window": true, "sliding_window": 2048});
        assert_eq!(read(mixed.clone()).unwrap(), vec![slide(2048, true), full]);
        // is_causal wins, then dflash_config.causal.
        let mut explicit = mixed.clone();
        explicit["is_causal"] = json!(false);
        explicit["dflash_config"] = json!({"mask_token_id": 1, "target_layer_ids": [1], "causal": true});
        assert_eq!(read(explicit.clone()).unwrap(), vec![slide(2048, false), full]);
        explicit.as_object_mut().unwrap().remove("is_causal");
        assert_eq!(read(explicit).unwrap(), vec![slide(2048, true), LayerAttention { window: None, causal: true }]);
        // dflash_config.use_swa with no sliding layer type (MiMo's drafter): every layer slides, non-causal, its
        // window from swa_window_size.
        let swa = json!({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "use_swa": true,
            "swa_window_size": 512}});
        assert_eq!(read(swa).unwrap(), vec![slide(512, false), slide(512, false)]);
        // Without use_sliding_window transformers drops the window: a sliding layer then has none, as vLLM says.
        let dropped = json!({"layer_types": types([SLIDING, SLIDING]), "sliding_window": 2048});
        assert!(read(dropped).unwrap_err().contains("use_sliding_window"));
        // No layer_types: layers from max_window_layers on slide when there is a window (Qwen3Config's rule).
        let derived = json!({"use_sliding_window": true, "sliding_window": 64, "max_window_layers": 1});
        assert_eq!(read(derived).unwrap(), vec![full, slide(64, true)]);
        assert!(read(json!({"layer_types": [SLIDING]})).unwrap_err().contains("1 entries for 2 layers"));
        assert!(read(json!({"layer_types": ["local"]})).unwrap_err().contains("layer_types"));
    }

    /// What a run trains is what the export says: every servable combination round-trips through `config.json`;
    /// what the engines cannot read is refused.
    #[test]
    fn layer_attention_round_trips_and_unservable_ones_are_refused() {
        let full = LayerAttention::default();
        let slide = |w: i64, causal: bool| LayerAttention { window: Some(w), causal };
        let tiny = DrafterConfig::for_preset(Preset::Tiny, 4);
        let causal_full = LayerAttention { window: None, causal: true };
        for layers in [
            vec![full, full],
            vec![slide(8, true), full],
            vec![slide(8, true), slide(8, true)],
            vec![slide(8, false), slide(8, false)],
            vec![slide(8, false), full],
            vec![slide(8, true), causal_full],
            vec![causal_full, causal_full],
        ] {
            let cfg = tiny.clone().with_layer_attention(layers.clone()).unwrap();
            let json = cfg.to_json("float32");
            assert_eq!(DrafterConfig::from_json(&json.to_string()).unwrap(), cfg, "{layers:?}: {json}");
        }
        let refused = |layers: Vec<LayerAttention>| tiny.clone().with_layer_attention(layers).unwrap_err();
        assert!(refused(vec![slide(8, true), slide(4, true)]).contains("one positive window"));
        assert!(refused(vec![slide(8, false), causal_full]).contains("causal exactly where they slide"));
        assert!(refused(vec![full]).contains("1 layers given for 2"));
    }

    /// A DFlash 2 drafter's config.json is z-lab's (`DFlash2DraftModel`, its sizes and the block size in
    /// `dflash_config`, as vLLM reads them) and reads back; a folder without a size, with a scale dflash does not
    /// train, or with sizes that do not fit is refused, naming the key.
    #[test]
    fn dflash2_configs_round_trip_and_what_does_not_fit_is_refused() {
        let cfg =
            DrafterConfig::for_preset(Preset::Qwen3_8b, 8).with_variant(Variant::DFlash2(Default::default())).unwrap();
        let json = cfg.to_json("bfloat16");
        assert_eq!(json["architectures"], json!(["DFlash2DraftModel"]));
        assert_eq!(
            json["dflash_config"],
            json!({"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids, "block_size": 8,
                "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16})
        );
        assert_eq!(DrafterConfig::from_json(&json.to_string()).unwrap(), cfg);
        let refused = |edit: &dyn Fn(&mut Value)| {
            let mut j = json.clone();
            edit(&mut j);
            DrafterConfig::from_json(&j.to_string()).unwrap_err()
        };
        let err = refused(&|j| drop(j["dflash_config"].as_object_mut().unwrap().remove("selector_rank")));
        assert!(err.contains("missing `dflash_config.selector_rank`"), "{err}");
        assert!(refused(&|j| j["dflash_config"]["output_multiplier"] = json!(2.0)).contains("output_multiplier"));
        assert!(refused(&|j| j["dflash_config"]["conv_group_size"] = json!(7)).contains("conv_group_size"));
        assert!(refused(&|j| j["dflash_config"]["conv_kernel_size"] = json!(9)).contains("conv_kernel_size"));
        // The neutral scales are accepted.
        let mut neutral = json.clone();
        neutral["dflash_config"]["input_embedding_scale"] = json!(1.0);
        neutral["dflash_config"]["final_logit_softcapping"] = Value::Null;
        assert_eq!(DrafterConfig::from_json(&neutral.to_string()).unwrap(), cfg);
    }

    #[test]
    fn gamma_defaults_follow_the_paper() {
        assert_eq!(default_gamma(16), Some(7.0));
        assert_eq!(default_gamma(10), Some(5.0));
        assert_eq!(default_gamma(8), Some(4.0));
        assert_eq!(default_gamma(12), None);
    }
}
