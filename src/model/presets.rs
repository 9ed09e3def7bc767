//! Built-in targets: `tiny-tasks`, the default run's target (the `tiny` shape with trained weights built into the
//! binary: it answers the built-in tasks, so a drafter has something to learn); `tiny` and `tiny-moe` (its
//! mixture-of-experts twin) with random weights for tests; and the real shapes of published targets, with random
//! weights, for benchmarks. A preset also fixes what
//! later components share with it: the tapped layer ids (written out, never re-derived) and the MASK token id.
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer};

use super::config::{Architecture, GptOssConfig, MoeConfig, RopeScaling, TargetConfig};
use super::init::Init;
use super::{Depth, ModelError, Target};
use tch::{Device, Kind};

/// The `tiny` preset's vocabulary: byte tokens `0..=255`, then the special tokens below, then unused rows up to
/// [`tiny::MASK`], which no tokenizer token uses.
pub mod tiny {
    pub const VOCAB_SIZE: usize = 320;
    /// `<|endoftext|>`: padding, and the BOS id of the config.
    pub const ENDOFTEXT: i64 = 256;
    pub const IM_START: i64 = 257;
    /// `<|im_end|>`: end of a turn, the EOS id.
    pub const IM_END: i64 = 258;
    pub const THINK: i64 = 259;
    pub const END_THINK: i64 = 260;
    /// The drafter's MASK token: an embedding row no tokenizer token maps to.
    pub const MASK: i64 = 319;
    /// Seed of the portable random weights, so every machine builds the same tiny model.
    pub const SEED: u64 = 20260206;
}

/// The `tiny-tasks` weights: the `tiny` shape trained on the built-in tasks (counting, sums, repeating, reversing,
/// spelling) by `scripts/fixtures/train_tiny_target.py` (the recipe is in its doc string; 330 s on one H200). Its greedy
/// answers to new questions are right 98.7% of the time (309 of 313, `dflash regenerate --local`).
pub const TINY_TASKS_WEIGHTS: &[u8] = include_bytes!("tiny_tasks.safetensors");
/// The SHA-256 of [`TINY_TASKS_WEIGHTS`].
pub const TINY_TASKS_SHA256: &str = "7ff79fdb60bfd51ce893764c49264a2a839d8fd6e54c91e6bdea86ec3e7693fe";

/// A named target shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    TinyTasks,
    Tiny,
    TinyMoe,
    TinyGptOss,
    Qwen3_4b,
    Qwen3_8b,
    /// Qwen3-8B for 131,072 tokens: YaRN's factor 4 over 32,768 original positions, as Qwen3's model card sets it.
    Qwen3_8b128k,
    Llama31_8b,
    /// SmolLM2-135M-Instruct's shapes (the tests' real model, README's worked example), random: its small-target
    /// costs (launches, the 49,152-word LM head, small matrices) without the model's files.
    Smollm2_135m,
    Qwen3_30bA3b,
    GptOss20b,
}

/// What a preset fixes.
#[derive(Debug, Clone)]
pub struct PresetSpec {
    pub target: TargetConfig,
    pub taps: Vec<usize>,
    pub mask_token_id: i64,
    /// How the random weights are drawn: the portable CPU stream for `tiny`, the device's generator otherwise.
    pub init: Init,
    /// Standard deviation of the random matrices: HF's 0.02 for real shapes; 1/sqrt(hidden) for `tiny`, so its
    /// 64-wide LM head gives logits of a realistic spread rather than a near-uniform softmax.
    pub init_std: f64,
    /// Trained weights built into the binary (a safetensors file), instead of random ones.
    pub weights: Option<&'static [u8]>,
}

impl PresetSpec {
    /// The preset's target with its built-in or random weights.
    pub fn build_target(&self, depth: Depth, device: Device, kind: Kind) -> Result<Target, ModelError> {
        self.build_target_spread(depth, &[device], kind)
    }

    /// [`PresetSpec::build_target`] with the layers spread over `devices` ([`Target::load_spread`]).
    pub fn build_target_spread(&self, depth: Depth, devices: &[Device], kind: Kind) -> Result<Target, ModelError> {
        match self.weights {
            Some(bytes) => Target::from_safetensors(
                self.target.clone(),
                bytes,
                "built-in weights",
                &self.taps,
                depth,
                devices,
                kind,
            ),
            None => {
                Target::random_spread(self.target.clone(), &self.taps, depth, devices, kind, self.init, self.init_std)
            }
        }
    }
}

impl Preset {
    pub const ALL: [Preset; 11] = [
        Preset::TinyTasks,
        Preset::Tiny,
        Preset::TinyMoe,
        Preset::TinyGptOss,
        Preset::Qwen3_4b,
        Preset::Qwen3_8b,
        Preset::Qwen3_8b128k,
        Preset::Llama31_8b,
        Preset::Smollm2_135m,
        Preset::Qwen3_30bA3b,
        Preset::GptOss20b,
    ];

    /// The presets of the `tiny` vocabulary and its built-in byte-level tokenizer.
    /// Whether its weights were trained (built into the binary); the others are random, for shapes and benchmarks:
    /// what they write is noise.
    pub fn is_trained(self) -> bool {
        self.spec().weights.is_some()
    }

    /// The warning for a preset with random weights used where its outputs matter (training, regeneration).
    pub fn random_weights_warning(self) -> Option<String> {
        (!self.is_trained()).then(|| {
            format!(
                "{} has random weights (a shape for benchmarks): what it writes is noise, and a drafter trained on it \
                 learns nothing useful. Use tiny-tasks (trained, built in) or a model folder",
                self.name()
            )
        })
    }

    pub fn is_tiny(self) -> bool {
        matches!(self, Preset::Tiny | Preset::TinyTasks | Preset::TinyMoe | Preset::TinyGptOss)
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::TinyTasks => "tiny-tasks",
            Preset::Tiny => "tiny",
            Preset::TinyMoe => "tiny-moe",
            Preset::TinyGptOss => "tiny-gpt-oss",
            Preset::Qwen3_4b => "qwen3-4b",
            Preset::Qwen3_8b => "qwen3-8b",
            Preset::Qwen3_8b128k => "qwen3-8b-128k",
            Preset::Llama31_8b => "llama3.1-8b",
            Preset::Smollm2_135m => "smollm2-135m",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
            Preset::GptOss20b => "gpt-oss-20b",
        }
    }

    pub fn spec(self) -> PresetSpec {
        let qwen3 = |hidden, intermediate, tie| TargetConfig {
            architecture: Architecture::Qwen3,
            vocab_size: 151936,
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: 40960,
            tie_word_embeddings: tie,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645],
            pad_token_id: Some(151643),
            moe: None,
            gpt_oss: None,
        };
        let real = |target, taps: &[usize], mask| PresetSpec {
            target,
            taps: taps.to_vec(),
            mask_token_id: mask,
            init: Init::Device(0),
            init_std: 0.02,
            weights: None,
        };
        match self {
            Preset::TinyTasks => PresetSpec { weights: Some(TINY_TASKS_WEIGHTS), ..Preset::Tiny.spec() },
            Preset::Tiny => PresetSpec {
                target: TargetConfig {
                    architecture: Architecture::Qwen3,
                    vocab_size: tiny::VOCAB_SIZE,
                    hidden_size: 64,
                    intermediate_size: 192,
                    num_hidden_layers: 8,
                    num_attention_heads: 4,
                    num_key_value_heads: 2,
                    head_dim: 16,
                    rms_norm_eps: 1e-6,
                    rope_theta: 10000.0,
                    rope_scaling: RopeScaling::None,
                    max_position_embeddings: 4096,
                    tie_word_embeddings: false,
                    bos_token_id: Some(tiny::ENDOFTEXT),
                    eos_token_ids: vec![tiny::IM_END],
                    pad_token_id: Some(tiny::ENDOFTEXT),
                    moe: None,
                    gpt_oss: None,
                },
                taps: vec![1, 3, 5],
                mask_token_id: tiny::MASK,
                init: Init::Portable(tiny::SEED),
                init_std: 0.125,
                weights: None,
            },
            // The tiny shape with 8 experts of width 64, two per token; layer 0 keeps the dense MLP.
            Preset::TinyMoe => {
                let tiny = Preset::Tiny.spec();
                let moe = MoeConfig {
                    num_experts: 8,
                    num_experts_per_tok: 2,
                    moe_intermediate_size: 64,
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: vec![0],
                };
                let target = TargetConfig { architecture: Architecture::Qwen3Moe, moe: Some(moe), ..tiny.target };
                PresetSpec { target, init: Init::Portable(tiny::SEED + 1), ..tiny }
            }
            // The tiny shape as a GPT-OSS: 8 experts of width 192, two per token, an 8-token window on even layers,
            // YaRN over 1024 original positions.
            Preset::TinyGptOss => {
                let tiny = Preset::Tiny.spec();
                let moe = MoeConfig {
                    num_experts: 8,
                    num_experts_per_tok: 2,
                    moe_intermediate_size: tiny.target.intermediate_size,
                    norm_topk_prob: false,
                    decoder_sparse_step: 1,
                    mlp_only_layers: vec![],
                };
                let layers = tiny.target.num_hidden_layers;
                let target = TargetConfig {
                    architecture: Architecture::GptOss,
                    rope_scaling: RopeScaling::Yarn {
                        factor: 4.0,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        original_max_position_embeddings: 1024.0,
                        truncate: false,
                        attention_factor: 0.1 * 4f64.ln() + 1.0,
                    },
                    moe: Some(moe),
                    gpt_oss: Some(GptOssConfig {
                        sliding_window: 8,
                        sliding_layers: (0..layers).map(|l| l % 2 == 0).collect(),
                        swiglu_alpha: 1.702,
                        swiglu_limit: 7.0,
                    }),
                    ..tiny.target
                };
                PresetSpec { target, init: Init::Portable(tiny::SEED + 2), ..tiny }
            }
            Preset::Qwen3_4b => real(qwen3(2560, 9728, true), &[1, 9, 17, 25, 33], 151669),
            Preset::Qwen3_8b => real(qwen3(4096, 12288, false), &[1, 9, 17, 25, 33], 151669),
            // The model card's `rope_scaling`: {"rope_type": "yarn", "factor": 4.0,
            // "original_max_position_embeddings": 32768}, `max_position_embeddings` left at 40,960; transformers'
            // defaults for the rest (`truncate` true, the attention factor 0.1 ln 4 + 1).
            Preset::Qwen3_8b128k => {
                let qwen3_8b = Preset::Qwen3_8b.spec();
                let rope_scaling = RopeScaling::Yarn {
                    factor: 4.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    original_max_position_embeddings: 32768.0,
                    truncate: true,
                    attention_factor: 0.1 * 4f64.ln() + 1.0,
                };
                PresetSpec { target: TargetConfig { rope_scaling, ..qwen3_8b.target }, ..qwen3_8b }
            }
            Preset::Llama31_8b => real(
                TargetConfig {
                    architecture: Architecture::Llama,
                    vocab_size: 128256,
                    hidden_size: 4096,
                    intermediate_size: 14336,
                    num_hidden_layers: 32,
                    num_attention_heads: 32,
                    num_key_value_heads: 8,
                    head_dim: 128,
                    rms_norm_eps: 1e-5,
                    rope_theta: 500000.0,
                    rope_scaling: RopeScaling::Llama3 {
                        factor: 8.0,
                        low_freq_factor: 1.0,
                        high_freq_factor: 4.0,
                        original_max_position_embeddings: 8192.0,
                    },
                    max_position_embeddings: 131072,
                    tie_word_embeddings: false,
                    bos_token_id: Some(128000),
                    eos_token_ids: vec![128001, 128008, 128009],
                    pad_token_id: None,
                    moe: None,
                    gpt_oss: None,
                },
                &[1, 8, 15, 22, 29],
                // <|reserved_special_token_0|>: in the embedding table, never produced by the tokenizer.
                128002,
            ),
            // config.json of SmolLM2-135M-Instruct (transformers 5.17); the taps and MASK of config/smollm2-135m.toml.
            Preset::Smollm2_135m => real(
                TargetConfig {
                    architecture: Architecture::Llama,
                    vocab_size: 49152,
                    hidden_size: 576,
                    intermediate_size: 1536,
                    num_hidden_layers: 30,
                    num_attention_heads: 9,
                    num_key_value_heads: 3,
                    head_dim: 64,
                    rms_norm_eps: 1e-5,
                    rope_theta: 100000.0,
                    rope_scaling: RopeScaling::None,
                    max_position_embeddings: 8192,
                    tie_word_embeddings: true,
                    bos_token_id: Some(1),
                    eos_token_ids: vec![2],
                    pad_token_id: Some(2),
                    moe: None,
                    gpt_oss: None,
                },
                &[1, 8, 15, 22, 29],
                // `<empty_output>`, a code-notebook marker no chat uses.
                16,
            ),
            // Qwen3-30B-A3B's config.json: 48 layers, 128 experts of width 768, 8 per token; taps by z-lab's rule for
            // 5 drafter layers (1 + i * 44 / 4).
            Preset::Qwen3_30bA3b => real(
                TargetConfig {
                    architecture: Architecture::Qwen3Moe,
                    num_hidden_layers: 48,
                    num_key_value_heads: 4,
                    intermediate_size: 6144,
                    moe: Some(MoeConfig {
                        num_experts: 128,
                        num_experts_per_tok: 8,
                        moe_intermediate_size: 768,
                        norm_topk_prob: true,
                        decoder_sparse_step: 1,
                        mlp_only_layers: vec![],
                    }),
                    ..qwen3(2048, 6144, false)
                },
                &[1, 12, 23, 34, 45],
                151669,
            ),
            // gpt-oss-20b's config.json (its experts dequantised from MXFP4 to bf16); taps by z-lab's rule for 24
            // layers; MASK <|reserved_200000|>.
            Preset::GptOss20b => real(
                TargetConfig {
                    architecture: Architecture::GptOss,
                    vocab_size: 201088,
                    hidden_size: 2880,
                    intermediate_size: 2880,
                    num_hidden_layers: 24,
                    num_attention_heads: 64,
                    num_key_value_heads: 8,
                    head_dim: 64,
                    rms_norm_eps: 1e-5,
                    rope_theta: 150000.0,
                    rope_scaling: RopeScaling::Yarn {
                        factor: 32.0,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        original_max_position_embeddings: 4096.0,
                        truncate: false,
                        attention_factor: 0.1 * 32f64.ln() + 1.0,
                    },
                    max_position_embeddings: 131072,
                    tie_word_embeddings: false,
                    bos_token_id: None,
                    eos_token_ids: vec![200002],
                    pad_token_id: Some(199999),
                    moe: Some(MoeConfig {
                        num_experts: 32,
                        num_experts_per_tok: 4,
                        moe_intermediate_size: 2880,
                        norm_topk_prob: false,
                        decoder_sparse_step: 1,
                        mlp_only_layers: vec![],
                    }),
                    gpt_oss: Some(GptOssConfig {
                        sliding_window: 128,
                        sliding_layers: (0..24).map(|l| l % 2 == 0).collect(),
                        swiglu_alpha: 1.702,
                        swiglu_limit: 7.0,
                    }),
                },
                &[1, 6, 11, 16, 21],
                200000,
            ),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
            format!("unknown preset {s:?}: choose one of {}", names.join(", "))
        })
    }
}

impl<'de> Deserialize<'de> for Preset {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Why `value` names no model dflash can open: neither a preset nor an existing folder. A Hugging Face Hub id gets
/// the command that downloads it (dflash reads local folders only); `None` when it is fine.
pub fn no_such_model(value: &str) -> Option<String> {
    let path = Path::new(value);
    if value.parse::<Preset>().is_ok() || path.is_dir() {
        return None;
    }
    let presets: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
    // `models/Qwen3-8B` where `models/` is a local folder is a path with a typo, not a Hub id: say what is there.
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty() && p.is_dir() && !path.exists());
    if let Some(parent) = parent {
        let mut there: Vec<String> = std::fs::read_dir(parent)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        there.sort();
        let listed = match there.len() {
            0 => "no folders".to_string(),
            n if n > 12 => format!("{} and {} more", there[..12].join(", "), n - 12),
            _ => there.join(", "),
        };
        return Some(format!("no such folder ({} holds {listed})", parent.display()));
    }
    let hub_like = {
        let mut parts = value.split('/');
        let (owner, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let word = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        parts.next().is_none() && word(owner) && word(name) && !owner.starts_with('.')
    };
    Some(if hub_like {
        let name = value.rsplit('/').next().unwrap_or(value);
        format!(
            "looks like a Hugging Face Hub id, and dflash reads local folders only: download it first \
             (`hf download {value} --local-dir models/{name}`, or `huggingface-cli download` with the same \
             arguments), then give the folder, e.g. models/{name}"
        )
    } else if path.exists() {
        "a file, not a model folder (the folder holding config.json, tokenizer.json and the weights)".to_string()
    } else {
        format!("no such folder (nor a preset: {})", presets.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::target::validate_taps;

    /// Only tiny-tasks has trained weights; every other preset warns where its outputs would matter.
    #[test]
    fn presets_with_random_weights_say_so() {
        assert_eq!(Preset::TinyTasks.random_weights_warning(), None);
        for p in Preset::ALL.iter().filter(|p| **p != Preset::TinyTasks) {
            let warning = p.random_weights_warning().expect("random weights");
            assert!(warning.starts_with(p.name()) && warning.contains("tiny-tasks"), "{warning}");
        }
    }

    #[test]
    fn presets_are_valid_and_named() {
        for p in Preset::ALL {
            let spec = p.spec();
            spec.target.validate().unwrap();
            validate_taps(&spec.taps, spec.target.num_hidden_layers).unwrap();
            assert!((spec.mask_token_id as usize) < spec.target.vocab_size);
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
        assert!("qwen3-9b".parse::<Preset>().unwrap_err().contains("tiny, tiny-moe, tiny-gpt-oss, qwen3-4b"));
    }

    #[test]
    fn tiny_mask_is_outside_the_token_ids() {
        let t = Preset::Tiny.spec();
        assert_eq!(t.mask_token_id, tiny::MASK);
        assert!(tiny::MASK > tiny::END_THINK && (tiny::MASK as usize) == tiny::VOCAB_SIZE - 1);
    }

    /// The built-in weights are the recorded file, and the model answers a question it never saw as the task says.
    #[test]
    fn tiny_tasks_is_the_recorded_model_and_answers_right() {
        use sha2::{Digest, Sha256};
        let digest: String = Sha256::digest(TINY_TASKS_WEIGHTS).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest, TINY_TASKS_SHA256);
        let target = Preset::TinyTasks.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let assets = crate::data::prepare::ModelAssets::tiny(&Default::default());
        let messages = [serde_json::json!({"role": "user", "content": "Count from 17 to 33."})];
        let prompt = assets.template.render(&messages, None, true).unwrap();
        let ids: Vec<i64> = assets.tokenizer.encode(&prompt).unwrap().ids.iter().map(|&t| t as i64).collect();
        let sampling = crate::model::generate::Sampling::Greedy;
        let out = crate::model::generate::generate(&target, &ids, 120, &[tiny::IM_END], sampling, 0).unwrap();
        let tokens: Vec<u32> = out.iter().filter(|&&t| t < 256).map(|&t| t as u32).collect();
        let text = assets.tokenizer.decode(&tokens).unwrap();
        let want: Vec<String> = (17..=33).map(|n| n.to_string()).collect();
        assert_eq!(text.trim(), want.join(" "), "{out:?}");
        // The random-weight `tiny` does not.
        let random = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let noise = crate::model::generate::generate(&random, &ids, 40, &[tiny::IM_END], sampling, 0).unwrap();
        assert_ne!(noise, out);
    }

    #[test]
    fn a_model_that_is_not_there_is_named_as_such_and_a_hub_id_gets_the_download_command() {
        assert_eq!(no_such_model("tiny-tasks"), None);
        assert_eq!(no_such_model(env!("CARGO_MANIFEST_DIR")), None, "an existing folder");
        let hub = no_such_model("Qwen/Qwen3-8B").unwrap();
        assert!(
            hub.contains("Hub id") && hub.contains("hf download Qwen/Qwen3-8B --local-dir models/Qwen3-8B"),
            "{hub}"
        );
        let missing = no_such_model("/models/Qwen3-8B").unwrap();
        assert!(missing.starts_with("no such folder") && missing.contains("tiny-tasks"), "{missing}");
        assert!(no_such_model("./models/x").unwrap().starts_with("no such folder"), "a relative path is a path");
        // Under a folder that is there, a missing one is a typo: what the folder holds is named.
        let models = tempfile::tempdir().unwrap();
        std::fs::create_dir(models.path().join("Qwen3-8B")).unwrap();
        let typo = no_such_model(models.path().join("Qwen3-8b").to_str().unwrap()).unwrap();
        assert!(typo.starts_with("no such folder") && typo.ends_with("holds Qwen3-8B)"), "{typo}");
        let file = no_such_model(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
        assert!(file.starts_with("a file, not a model folder"), "{file}");
    }
}
