//! The target's architecture, read from a HuggingFace `config.json` (Qwen3, Qwen3-MoE, GPT-OSS and Llama-3 decoders)
//! or built from a preset, and written back in the same format. Both spellings of the RoPE settings are read: `rope_theta` (+
//! `rope_scaling`) at the top level, as published checkpoints have them, and transformers 5's `rope_parameters`.
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::ModelError;

/// Which decoder family: they differ in per-head q/k norms (the Qwen3 families have them), in the MLP (Qwen3-MoE's
/// and GPT-OSS's sparse layers route each token to a few experts), in attention (GPT-OSS: biases, sinks, sliding
/// windows) and in naming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Architecture {
    Qwen3,
    Qwen3Moe,
    GptOss,
    Llama,
}

impl Architecture {
    const ALL: [Architecture; 4] =
        [Architecture::Qwen3, Architecture::Qwen3Moe, Architecture::GptOss, Architecture::Llama];

    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::GptOss => "gpt_oss",
            Architecture::Llama => "llama",
        }
    }
    /// The Qwen3 families normalise each query and key head (RMSNorm over head_dim) before RoPE.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Qwen3Moe)
    }
}

/// The mixture of experts of Qwen3-MoE and GPT-OSS. Qwen3-MoE's sparse MLP: a router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token (softmax
/// over all experts in f32, top-k, renormalised over the chosen ones when `norm_topk_prob`), and their outputs are
/// summed with those weights. Layer `l` is sparse unless listed in `mlp_only_layers` or `(l + 1)` is not a multiple
/// of `decoder_sparse_step`; other layers keep the dense MLP of `intermediate_size`. GPT-OSS routes as
/// [`GptOssConfig`] says, in every layer, to experts of width `intermediate_size` (held here as
/// `moe_intermediate_size`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `layer` routes its tokens to experts (HF's `Qwen3MoeDecoderLayer` rule).
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer) && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// GPT-OSS's differences from the Qwen3 layout: q/k/v/o biases, one learned attention sink per head (a logit that
/// takes part in the softmax and adds nothing), a sliding window on the layers `layer_types` marks
/// `sliding_attention`, and experts with biases, top-k-then-softmax routing and a clamped SwiGLU,
/// `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max = limit)`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GptOssConfig {
    pub sliding_window: usize,
    /// Per layer: whether it attends only to the last `sliding_window` positions.
    pub sliding_layers: Vec<bool>,
    pub swiglu_alpha: f64,
    pub swiglu_limit: f64,
}

/// How rotary position frequencies are derived from `theta`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum RopeScaling {
    None,
    /// Llama-3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (GPT-OSS; Qwen3 for long contexts): frequencies interpolated by `factor` below the `beta_slow` rotation
    /// boundary, kept above `beta_fast`, ramped between; cos and sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The fields transformers writes for it (`rope_type` included), `None` for plain RoPE.
    pub fn to_json(&self) -> Option<Value> {
        match *self {
            RopeScaling::None => None,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                Some(json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                }))
            }
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                attention_factor,
            } => Some(json!({
                "rope_type": "yarn",
                "factor": factor,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "original_max_position_embeddings": original_max_position_embeddings,
                "truncate": truncate,
                "attention_factor": attention_factor,
            })),
        }
    }
}

/// Everything the decoder needs to know about its shape, validated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    /// The experts of a Qwen3-MoE or GPT-OSS target; `None` for dense decoders.
    pub moe: Option<MoeConfig>,
    /// What GPT-OSS adds; `None` for the other families.
    pub gpt_oss: Option<GptOssConfig>,
}

/// The subset of HuggingFace's `config.json` we read; other keys are ignored, as transformers does.
#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    pad_token_id: Option<Value>,
    use_sliding_window: Option<bool>,
    num_experts: Option<usize>,
    /// transformers 5 writes `num_experts` under this name.
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    experts_per_token: Option<usize>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
}

const SUPPORTED: &str = "Qwen3ForCausalLM (model_type qwen3), Qwen3MoeForCausalLM (qwen3_moe), \
                         GptOssForCausalLM (gpt_oss) or LlamaForCausalLM (llama)";

impl TargetConfig {
    /// The positions the target takes: `max_position_embeddings`, or with YaRN its original positions times its
    /// factor, as vLLM derives a model's length (Qwen3's model card extends 32,768 positions to 131,072 with YaRN's
    /// factor 4 and leaves `max_position_embeddings` at 40,960).
    pub fn positions(&self) -> usize {
        match self.rope_scaling {
            RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
                (original_max_position_embeddings * factor) as usize
            }
            _ => self.max_position_embeddings,
        }
    }

    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        read_config_json(
            dir,
            "a HuggingFace model folder (config.json, *.safetensors, tokenizer files)",
            Self::from_json,
        )
    }

    /// Parses the text of a `config.json`; the error is a reason naming the key. A key that is absent or null means
    /// what the family's transformers config class makes of it ([`FamilyDefaults`]).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let raw: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        // Some keys mean one thing when absent (the class default) and another when null.
        let absent = |key: &str| raw.get(key).is_none();
        let hf: HfConfig = serde_json::from_value(raw.clone()).map_err(|e| format!("not valid JSON: {e}"))?;
        let architecture = architecture_of(&hf)?;
        let family = FamilyDefaults::of(architecture);
        let need = |v: Option<usize>, key: &str| v.ok_or_else(|| format!("missing key `{key}`"));
        let hidden_size = need(hf.hidden_size, "hidden_size")?;
        let num_attention_heads = need(hf.num_attention_heads, "num_attention_heads")?;
        let gpt_oss = architecture == Architecture::GptOss;
        if gpt_oss && hf.attention_bias == Some(false) {
            return Err(
                "`attention_bias` = false is not supported for gpt_oss (published GPT-OSS models have biases)".into()
            );
        }
        if (!gpt_oss && hf.attention_bias == Some(true)) || hf.mlp_bias == Some(true) {
            return Err("`attention_bias`/`mlp_bias` = true is not supported (Qwen3 and Llama-3 have no biases)".into());
        }
        if let Some(act) = hf.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!("`hidden_act` = {act:?} is not supported (only \"silu\")"));
        }
        if hf.use_sliding_window == Some(true) {
            return Err("`use_sliding_window` = true is not supported (published Qwen3 models have it false)".into());
        }
        let max_position_embeddings = hf.max_position_embeddings.unwrap_or(family.max_position_embeddings);
        let (rope_theta, rope_scaling) = rope_settings(&hf, &family, max_position_embeddings)?;
        let num_hidden_layers = need(hf.num_hidden_layers, "num_hidden_layers")?;
        let intermediate_size = need(hf.intermediate_size, "intermediate_size")?;
        let (moe, gpt_oss) = match architecture {
            Architecture::Qwen3Moe => (Some(moe_settings(&hf)), None),
            Architecture::GptOss => {
                let (moe, oss) = gpt_oss_settings(&hf, num_hidden_layers, intermediate_size, absent("sliding_window"))?;
                (Some(moe), Some(oss))
            }
            _ => (None, None),
        };
        let cfg = TargetConfig {
            architecture,
            vocab_size: need(hf.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: match (hf.num_key_value_heads, absent("num_key_value_heads")) {
                (Some(n), _) => n,
                (None, true) => family.num_key_value_heads.unwrap_or(num_attention_heads),
                (None, false) => num_attention_heads,
            },
            head_dim: hf.head_dim.or(family.head_dim).unwrap_or(hidden_size / num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(family.rms_norm_eps),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            bos_token_id: match absent("bos_token_id") {
                true => family.bos_token_id,
                false => token_ids(hf.bos_token_id.as_ref(), "bos_token_id")?.first().copied(),
            },
            eos_token_ids: match absent("eos_token_id") {
                true => family.eos_token_id.into_iter().collect(),
                false => token_ids(hf.eos_token_id.as_ref(), "eos_token_id")?,
            },
            pad_token_id: token_ids(hf.pad_token_id.as_ref(), "pad_token_id")?.first().copied(),
            moe,
            gpt_oss,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the shape is one the decoder can run; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("`{key}` must be positive"));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("`head_dim` ({}) must be even for RoPE", self.head_dim));
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 0.0 {
            return Err(format!("`rope_theta` ({}) must be positive", self.rope_theta));
        }
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps <= 0.0 {
            return Err(format!("`rms_norm_eps` ({}) must be positive", self.rms_norm_eps));
        }
        let has_experts = matches!(self.architecture, Architecture::Qwen3Moe | Architecture::GptOss);
        if has_experts != self.moe.is_some() || (self.architecture == Architecture::GptOss) != self.gpt_oss.is_some() {
            return Err(format!(
                "a {} target has the settings of another family (experts: {}, GPT-OSS attention: {})",
                self.architecture.model_type(),
                self.moe.is_some(),
                self.gpt_oss.is_some()
            ));
        }
        if let Some(oss) = &self.gpt_oss {
            if oss.sliding_layers.len() != self.num_hidden_layers {
                return Err(format!(
                    "`layer_types` has {} entries for {} layers",
                    oss.sliding_layers.len(),
                    self.num_hidden_layers
                ));
            }
            if oss.sliding_window == 0 {
                return Err("`sliding_window` must be positive".into());
            }
            if self.moe.as_ref().is_some_and(|m| m.moe_intermediate_size != self.intermediate_size) {
                return Err("a gpt_oss target's experts are `intermediate_size` wide".into());
            }
        }
        if let Some(m) = &self.moe {
            for (key, v) in [
                ("num_experts", m.num_experts),
                ("moe_intermediate_size", m.moe_intermediate_size),
                ("decoder_sparse_step", m.decoder_sparse_step),
            ] {
                if v == 0 {
                    return Err(format!("`{key}` must be positive"));
                }
            }
            if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
                return Err(format!(
                    "`num_experts_per_tok` ({}) must be between 1 and `num_experts` ({})",
                    m.num_experts_per_tok, m.num_experts
                ));
            }
        }
        Ok(())
    }

    /// The `config.json` HuggingFace writes for this decoder.
    pub fn to_hf_json(&self, torch_dtype: &str) -> Value {
        let mut v = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "torch_dtype": torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [one] => json!(one),
                many => json!(many),
            },
            "pad_token_id": self.pad_token_id,
        });
        if let Some(scaling) = self.rope_scaling.to_json() {
            v["rope_scaling"] = scaling;
        }
        if let (Some(m), Some(oss)) = (&self.moe, &self.gpt_oss) {
            let types: Vec<&str> =
                oss.sliding_layers.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
            for (key, value) in [
                ("num_local_experts", json!(m.num_experts)),
                ("num_experts_per_tok", json!(m.num_experts_per_tok)),
                ("sliding_window", json!(oss.sliding_window)),
                ("layer_types", json!(types)),
                ("swiglu_alpha", json!(oss.swiglu_alpha)),
                ("swiglu_limit", json!(oss.swiglu_limit)),
                ("attention_bias", json!(true)),
            ] {
                v[key] = value;
            }
        } else if let Some(m) = &self.moe {
            for (key, value) in [
                ("num_experts", json!(m.num_experts)),
                ("num_experts_per_tok", json!(m.num_experts_per_tok)),
                ("moe_intermediate_size", json!(m.moe_intermediate_size)),
                ("norm_topk_prob", json!(m.norm_topk_prob)),
                ("decoder_sparse_step", json!(m.decoder_sparse_step)),
                ("mlp_only_layers", json!(m.mlp_only_layers)),
            ] {
                v[key] = value;
            }
        }
        v
    }

    pub fn num_query_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Keys attended to in layer `layer` of a `seq`-token sequence, summed over the queries, as FLOP counts take
    /// them: half the square under a causal mask (as the PyTorch peers count), the exact count in a GPT-OSS
    /// sliding-window layer (at most `sliding_window` keys a query).
    pub fn attended_keys(&self, layer: usize, seq: usize) -> f64 {
        match self.gpt_oss.as_ref().filter(|o| o.sliding_layers[layer]) {
            Some(o) if o.sliding_window < seq => {
                let w = o.sliding_window;
                (w * (w + 1) / 2 + (seq - w) * w) as f64
            }
            _ => (seq * seq) as f64 / 2.0,
        }
    }

    /// One line for logs: the family, depth and width, and the experts of a mixture.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{}, {} layers, hidden {}",
            self.architecture.model_type(),
            self.num_hidden_layers,
            self.hidden_size
        );
        if let Some(m) = &self.moe {
            s += &format!(", {} experts ({} per token)", m.num_experts, m.num_experts_per_tok);
        }
        if let Some(o) = &self.gpt_oss {
            let sliding = o.sliding_layers.iter().filter(|&&s| s).count();
            s += &format!(", {sliding} layers with a {}-token window", o.sliding_window);
        }
        s
    }

    /// Whether decoder layer `layer` has a sparse (mixture-of-experts) MLP.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// The weights one token multiplies in decoder layer `layer` (its active parameters): q, k, v, o, and the dense
    /// MLP's gate, up and down, or in a sparse layer the router and the gate, up and down of each chosen expert.
    pub fn layer_matmul_params(&self, layer: usize) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mlp = match &self.moe {
            Some(m) if m.is_sparse(layer) => {
                h * m.num_experts + m.num_experts_per_tok * 3 * h * m.moe_intermediate_size
            }
            _ => 3 * h * self.intermediate_size,
        };
        h * q + 2 * h * kv + q * h + mlp
    }
}

/// Reads `dir/config.json` and parses it with `parse`; errors name the file and say what folder was expected.
pub(crate) fn read_config_json<T>(
    dir: &Path,
    expected: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, ModelError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(ModelError::Config { path, reason: format!("not found: point at {expected}") });
    }
    let text = std::fs::read_to_string(&path).map_err(|err| ModelError::Io { path: path.clone(), err })?;
    parse(&text).map_err(|reason| ModelError::Config { path, reason })
}

fn architecture_of(hf: &HfConfig) -> Result<Architecture, String> {
    if let Some(classes) = &hf.architectures {
        return classes
            .iter()
            .find_map(|c| Architecture::ALL.into_iter().find(|a| a.hf_class() == c))
            .ok_or_else(|| format!("unsupported `architectures` {classes:?}: dflash runs {SUPPORTED}"));
    }
    match hf.model_type.as_deref() {
        Some(t) => Architecture::ALL
            .into_iter()
            .find(|a| a.model_type() == t)
            .ok_or_else(|| format!("unsupported `model_type` {t:?}: dflash runs {SUPPORTED}")),
        None => Err(format!("neither `architectures` nor `model_type` is set: dflash runs {SUPPORTED}")),
    }
}

/// Qwen3-MoE's keys, with transformers' `Qwen3MoeConfig` defaults where a key is absent.
fn moe_settings(hf: &HfConfig) -> MoeConfig {
    MoeConfig {
        num_experts: hf.num_experts.or(hf.num_local_experts).unwrap_or(128),
        num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(8),
        moe_intermediate_size: hf.moe_intermediate_size.unwrap_or(768),
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(false),
        decoder_sparse_step: hf.decoder_sparse_step.unwrap_or(1),
        mlp_only_layers: hf.mlp_only_layers.clone().unwrap_or_default(),
    }
}

/// What transformers' config class of each family (5.17 to 5.23 agree) makes of a key that is absent, where dflash
/// reads it: `tests/fixtures/hf-configs` holds folders those releases wrote and read
/// (`scripts/fixtures/make_hf_config_fixtures.py`).
struct FamilyDefaults {
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: f64,
    /// The positional scaling without `rope_parameters`/`rope_scaling` (or with them null).
    rope: Option<Value>,
    /// `None`: `hidden_size / num_attention_heads`.
    head_dim: Option<usize>,
    /// When the key is absent (`None`: `num_attention_heads`); null always means `num_attention_heads`.
    num_key_value_heads: Option<usize>,
    /// When the keys are absent (null means none).
    bos_token_id: Option<i64>,
    eos_token_id: Option<i64>,
}

impl FamilyDefaults {
    fn of(architecture: Architecture) -> Self {
        let base = FamilyDefaults {
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope: None,
            head_dim: None,
            num_key_value_heads: None,
            bos_token_id: None,
            eos_token_id: None,
        };
        match architecture {
            // LlamaConfig: 2048 positions, head_dim from the width, bos 1 and eos 2.
            Architecture::Llama => {
                FamilyDefaults { max_position_embeddings: 2048, bos_token_id: Some(1), eos_token_id: Some(2), ..base }
            }
            // Qwen3Config: head_dim 128 and 32 key/value heads whatever the width.
            Architecture::Qwen3 => FamilyDefaults { head_dim: Some(128), num_key_value_heads: Some(32), ..base },
            Architecture::Qwen3Moe => FamilyDefaults { num_key_value_heads: Some(4), ..base },
            // GptOssConfig: YaRN (factor 32 over 4,096 positions, not truncated), theta 150,000.
            Architecture::GptOss => FamilyDefaults {
                max_position_embeddings: 131072,
                rms_norm_eps: 1e-5,
                rope_theta: 150000.0,
                rope: Some(json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "original_max_position_embeddings": 4096, "truncate": false})),
                head_dim: Some(64),
                num_key_value_heads: Some(8),
                ..base
            },
        }
    }
}

/// Reads `rope_theta` and the scaling from either spelling (`rope_parameters` wins where both exist), or the
/// family's default where neither is set.
fn rope_settings(
    hf: &HfConfig,
    family: &FamilyDefaults,
    max_position_embeddings: usize,
) -> Result<(f64, RopeScaling), String> {
    let (params, key) = match (&hf.rope_parameters, &hf.rope_scaling) {
        (Some(p), _) if !p.is_null() => (Some(p), "rope_parameters"),
        (_, Some(s)) if !s.is_null() => (Some(s), "rope_scaling"),
        _ => (family.rope.as_ref(), "the family's default rope_parameters"),
    };
    let theta_in_params = params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
    let theta = theta_in_params.or(hf.rope_theta).unwrap_or(family.rope_theta);
    let Some(params) = params else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default");
    let optional = |name: &str| params.get(name).filter(|v| !v.is_null()).and_then(Value::as_f64);
    let number = |name: &str| {
        optional(name)
            .ok_or_else(|| format!("`{key}.{name}` is missing or not a number (needed by rope_type {kind:?})"))
    };
    if optional("partial_rotary_factor").is_some_and(|f| f != 1.0) {
        return Err(format!("`{key}.partial_rotary_factor` other than 1 is not supported"));
    }
    match kind {
        "default" => Ok((theta, RopeScaling::None)),
        "llama3" => Ok((
            theta,
            RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            },
        )),
        // transformers' `_compute_yarn_parameters`, defaults included.
        "yarn" => {
            let factor = number("factor")?;
            let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let attention_factor = optional("attention_factor").unwrap_or_else(|| {
                match (optional("mscale").filter(|&m| m != 0.0), optional("mscale_all_dim").filter(|&m| m != 0.0)) {
                    (Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                }
            });
            Ok((
                theta,
                RopeScaling::Yarn {
                    factor,
                    beta_fast: optional("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: optional("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0),
                    original_max_position_embeddings: optional("original_max_position_embeddings")
                        .unwrap_or(max_position_embeddings as f64),
                    truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                    attention_factor,
                },
            ))
        }
        other => Err(format!(
            "`{key}.rope_type` = {other:?} is not supported (supported: \"default\", \"llama3\", \"yarn\")"
        )),
    }
}

/// GPT-OSS's keys (transformers' `GptOssConfig` defaults where absent): its experts as a [`MoeConfig`] (every layer
/// sparse) and the rest. `sliding_window` null (not absent) means no window: every layer attends to all positions.
fn gpt_oss_settings(
    hf: &HfConfig,
    layers: usize,
    width: usize,
    window_absent: bool,
) -> Result<(MoeConfig, GptOssConfig), String> {
    let moe = MoeConfig {
        num_experts: hf.num_local_experts.or(hf.num_experts).unwrap_or(128),
        num_experts_per_tok: hf.num_experts_per_tok.or(hf.experts_per_token).unwrap_or(4),
        moe_intermediate_size: width,
        norm_topk_prob: false,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
    };
    let sliding_layers = match &hf.layer_types {
        None => (0..layers).map(|l| l % 2 == 0).collect(),
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(format!("`layer_types` entry {other:?} is not sliding_attention or full_attention")),
            })
            .collect::<Result<_, _>>()?,
    };
    let (sliding_window, sliding_layers) = match (hf.sliding_window, window_absent) {
        (Some(window), _) => (window, sliding_layers),
        (None, true) => (128, sliding_layers),
        (None, false) => (128, vec![false; layers]),
    };
    let oss = GptOssConfig {
        sliding_window,
        sliding_layers,
        swiglu_alpha: hf.swiglu_alpha.unwrap_or(1.702),
        swiglu_limit: hf.swiglu_limit.unwrap_or(7.0),
    };
    Ok((moe, oss))
}

/// A token id field may be absent, null, one integer or a list of integers.
fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<i64>, String> {
    let bad = || format!("`{key}` must be an integer or a list of integers");
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Number(n)) => n.as_i64().map(|i| vec![i]).ok_or_else(bad),
        Some(Value::Array(items)) => items.iter().map(|i| i.as_i64().ok_or_else(bad)).collect(),
        Some(_) => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_8B: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
      "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
      "intermediate_size": 12288, "max_position_embeddings": 40960, "model_type": "qwen3",
      "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
      "rope_scaling": null, "rope_theta": 1000000, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "vocab_size": 151936 }"#;

    const LLAMA_31_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
      "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
      "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
      "tie_word_embeddings": false, "vocab_size": 128256 }"#;

    #[test]
    fn reads_published_qwen3_and_llama_configs() {
        let q = TargetConfig::from_json(QWEN3_8B).unwrap();
        assert_eq!(q.architecture, Architecture::Qwen3);
        assert_eq!((q.head_dim, q.num_key_value_heads, q.rope_theta), (128, 8, 1e6));
        assert_eq!(q.eos_token_ids, vec![151645]);
        let l = TargetConfig::from_json(LLAMA_31_8B).unwrap();
        assert_eq!(l.architecture, Architecture::Llama);
        assert_eq!(l.head_dim, 128);
        assert_eq!(l.eos_token_ids, vec![128001, 128008, 128009]);
        assert!(matches!(l.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    /// Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B).
    const QWEN3_30B_A3B: &str = r#"{
      "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
      "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
      "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
      "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
      "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936 }"#;

    #[test]
    fn reads_the_published_qwen3_moe_config_as_the_preset() {
        let cfg = TargetConfig::from_json(QWEN3_30B_A3B).unwrap();
        // The preset also names the tokenizer's pad token (<|endoftext|>), which config.json leaves out.
        let preset = crate::model::Preset::Qwen3_30bA3b.spec().target;
        assert_eq!(TargetConfig { pad_token_id: Some(151643), ..cfg.clone() }, preset);
        assert!((0..48).all(|l| cfg.is_sparse(l)));
        // decoder_sparse_step and mlp_only_layers as HF's decoder layer reads them.
        let text = QWEN3_30B_A3B
            .replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 2"#)
            .replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [3]"#);
        let cfg = TargetConfig::from_json(&text).unwrap();
        let sparse: Vec<usize> = (0..8).filter(|&l| cfg.is_sparse(l)).collect();
        assert_eq!(sparse, vec![1, 5, 7]);
        // Absent keys take transformers' defaults (norm_topk_prob false among them).
        let bare = QWEN3_30B_A3B.replace(r#""norm_topk_prob": true,"#, "").replace(r#""num_experts": 128,"#, "");
        let m = TargetConfig::from_json(&bare).unwrap().moe.unwrap();
        assert_eq!((m.num_experts, m.norm_topk_prob), (128, false));
        let again = TargetConfig::from_json(&cfg.to_hf_json("bfloat16").to_string()).unwrap();
        assert_eq!(cfg, again);
    }

    /// gpt-oss-20b's published config.json (openai/gpt-oss-20b), MXFP4 quantization_config included.
    fn gpt_oss_20b() -> String {
        let types: Vec<&str> =
            (0..24).map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
        format!(
            r#"{{ "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
            "layer_types": {types:?}, "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
            "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
            "quantization_config": {{"modules_to_not_convert": ["model.layers.*.self_attn",
            "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}},
            "rms_norm_eps": 1e-05, "rope_scaling": {{"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}}, "rope_theta": 150000,
            "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false,
            "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088 }}"#
        )
    }

    #[test]
    fn reads_the_published_gpt_oss_config_as_the_preset() {
        let cfg = TargetConfig::from_json(&gpt_oss_20b()).unwrap();
        assert_eq!(cfg, crate::model::Preset::GptOss20b.spec().target);
        assert!(
            cfg.summary().contains("32 experts (4 per token), 12 layers with a 128-token window"),
            "{}",
            cfg.summary()
        );
        let again = TargetConfig::from_json(&cfg.to_hf_json("bfloat16").to_string()).unwrap();
        assert_eq!(cfg, again);
        // A sliding layer attends to at most 128 keys per query.
        assert_eq!(cfg.attended_keys(0, 2048), (128 * 129 / 2 + (2048 - 128) * 128) as f64);
        assert_eq!(cfg.attended_keys(1, 2048), 2048.0 * 2048.0 / 2.0);
        let bad = gpt_oss_20b().replace(r#""attention_bias": true"#, r#""attention_bias": false"#);
        assert!(TargetConfig::from_json(&bad).unwrap_err().contains("attention_bias"));
        let bad = gpt_oss_20b().replacen("full_attention", "chunked_attention", 1);
        assert!(TargetConfig::from_json(&bad).unwrap_err().contains("chunked_attention"));
    }

    #[test]
    fn reads_yarn_as_transformers_resolves_it() {
        // Qwen3's long-context recipe: factor 4 over 32768 positions; the attention factor is 0.1 ln 4 + 1.
        let text = QWEN3_8B.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        );
        let cfg = TargetConfig::from_json(&text).unwrap();
        // `max_position_embeddings` is read as written; the positions are vLLM's derived length.
        assert_eq!((cfg.max_position_embeddings, cfg.positions()), (40960, 131072));
        assert_eq!(TargetConfig::from_json(QWEN3_8B).unwrap().positions(), 40960);
        // The long-context preset is this config.json (with the padding id the generation config adds).
        let preset = crate::model::Preset::Qwen3_8b128k.spec().target;
        assert_eq!(TargetConfig { pad_token_id: preset.pad_token_id, ..cfg.clone() }, preset);
        let RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
            original_max_position_embeddings,
        } = cfg.rope_scaling
        else {
            panic!("yarn")
        };
        assert_eq!(
            (factor, beta_fast, beta_slow, truncate, original_max_position_embeddings),
            (4.0, 32.0, 1.0, true, 32768.0)
        );
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        // mscale and mscale_all_dim (DeepSeek's spelling) give their ratio; attention_factor wins when given.
        let with = |extra: &str| {
            let t = QWEN3_8B.replace(
                r#""rope_scaling": null"#,
                &format!(r#""rope_scaling": {{"rope_type": "yarn", "factor": 4.0{extra}}}"#),
            );
            match TargetConfig::from_json(&t).unwrap().rope_scaling {
                RopeScaling::Yarn { attention_factor, .. } => attention_factor,
                _ => panic!("yarn"),
            }
        };
        assert_eq!(with(r#", "mscale": 1.0, "mscale_all_dim": 1.0"#), 1.0);
        assert_eq!(with(r#", "attention_factor": 0.5"#), 0.5);
    }

    #[test]
    fn reads_rope_parameters_spelling() {
        let text = QWEN3_8B.replace(
            r#""rope_theta": 1000000,"#,
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},"#,
        );
        assert_eq!(TargetConfig::from_json(&text).unwrap().rope_theta, 5e6);
        let longrope =
            QWEN3_8B.replace(r#""rope_scaling": null"#, r#""rope_scaling": {"rope_type": "longrope", "factor": 4.0}"#);
        let err = TargetConfig::from_json(&longrope).unwrap_err();
        assert!(err.contains("rope_scaling.rope_type") && err.contains("longrope"), "{err}");
    }

    #[test]
    fn round_trips_through_hf_json() {
        for text in [QWEN3_8B, LLAMA_31_8B] {
            let cfg = TargetConfig::from_json(text).unwrap();
            let again = TargetConfig::from_json(&cfg.to_hf_json("bfloat16").to_string()).unwrap();
            assert_eq!(cfg, again);
        }
    }

    #[test]
    fn rejects_what_it_cannot_run() {
        let cases = [
            (QWEN3_8B.replace("Qwen3ForCausalLM", "MistralForCausalLM"), "unsupported `architectures`"),
            (QWEN3_8B.replace(r#""hidden_size": 4096,"#, ""), "missing key `hidden_size`"),
            (QWEN3_8B.replace(r#""num_key_value_heads": 8"#, r#""num_key_value_heads": 5"#), "num_key_value_heads"),
            (QWEN3_8B.replace(r#""attention_bias": false"#, r#""attention_bias": true"#), "attention_bias"),
            (QWEN3_8B.replace(r#""hidden_act": "silu""#, r#""hidden_act": "gelu""#), "hidden_act"),
            (QWEN3_8B.replace(r#""eos_token_id": 151645"#, r#""eos_token_id": "x""#), "eos_token_id"),
            ("{not json".to_string(), "not valid JSON"),
            (
                QWEN3_8B.replace(r#""rope_scaling""#, r#""use_sliding_window": true, "rope_scaling""#),
                "use_sliding_window",
            ),
            (
                QWEN3_30B_A3B.replace(r#""num_experts_per_tok": 8"#, r#""num_experts_per_tok": 129"#),
                "num_experts_per_tok",
            ),
            (
                QWEN3_30B_A3B.replace(r#""moe_intermediate_size": 768"#, r#""moe_intermediate_size": 0"#),
                "moe_intermediate_size",
            ),
            (
                QWEN3_30B_A3B.replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 0"#),
                "decoder_sparse_step",
            ),
        ];
        for (text, expected) in cases {
            let err = TargetConfig::from_json(&text).unwrap_err();
            assert!(err.contains(expected), "expected {expected:?} in {err:?}");
        }
    }
}
