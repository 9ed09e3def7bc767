//! Config folders as transformers reads them: for each of the four families, a `config.json` as a release's
//! `save_pretrained` writes it, one with only the sizes, and one with the optional keys null (`rope_scaling` among them),
//! each beside what that release loaded from it (`expected.json`, by `scripts/fixtures/make_hf_config_fixtures.py`, from transformers
//! 5.17.0 and 5.23.0). dflash must read every folder as transformers does: an absent or null key means what the
//! family's config class makes of it, not a generic default.
use std::path::Path;

use dflash::model::config::{GptOssConfig, MoeConfig, RopeScaling};
use dflash::model::{Architecture, TargetConfig};
use serde_json::Value;

fn usize_of(v: &Value) -> usize {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}")) as usize
}

fn ids(v: &Value) -> Vec<i64> {
    match v {
        Value::Null => vec![],
        Value::Array(items) => items.iter().map(|i| i.as_i64().unwrap()).collect(),
        other => vec![other.as_i64().unwrap()],
    }
}

/// transformers' rope_parameters as dflash's (YaRN's attention factor as transformers computes it when absent).
fn rope(p: &Value) -> (f64, RopeScaling) {
    let theta = p["rope_theta"].as_f64().unwrap();
    let f = |k: &str| p[k].as_f64().unwrap();
    let scaling = match p["rope_type"].as_str().unwrap() {
        "default" => RopeScaling::None,
        "yarn" => RopeScaling::Yarn {
            factor: f("factor"),
            beta_fast: f("beta_fast"),
            beta_slow: f("beta_slow"),
            original_max_position_embeddings: f("original_max_position_embeddings"),
            truncate: p["truncate"].as_bool().unwrap_or(true),
            attention_factor: 0.1 * f("factor").ln() + 1.0,
        },
        other => panic!("no fixture uses rope_type {other}"),
    };
    (theta, scaling)
}

/// The config transformers loaded, in dflash's terms.
fn expected(e: &Value, architecture: Architecture) -> TargetConfig {
    let n = |k: &str| usize_of(&e[k]);
    let (rope_theta, rope_scaling) = rope(&e["rope_parameters"]);
    let layers = n("num_hidden_layers");
    let moe = matches!(architecture, Architecture::Qwen3Moe | Architecture::GptOss).then(|| MoeConfig {
        num_experts: n("num_experts"),
        num_experts_per_tok: n("num_experts_per_tok"),
        moe_intermediate_size: e["moe_intermediate_size"].as_u64().map_or(n("intermediate_size"), |m| m as usize),
        norm_topk_prob: e["norm_topk_prob"].as_bool().unwrap_or(false),
        decoder_sparse_step: e["decoder_sparse_step"].as_u64().unwrap_or(1) as usize,
        mlp_only_layers: e["mlp_only_layers"].as_array().map_or(vec![], |l| l.iter().map(usize_of).collect()),
    });
    let gpt_oss = (architecture == Architecture::GptOss).then(|| {
        let types = e["layer_types"].as_array().unwrap();
        // A null window: transformers' sliding layers then attend to everything.
        let window = e["sliding_window"].as_u64();
        GptOssConfig {
            sliding_window: window.unwrap_or(128) as usize,
            sliding_layers: types.iter().map(|t| window.is_some() && t == "sliding_attention").collect(),
            swiglu_alpha: 1.702,
            swiglu_limit: e["swiglu_limit"].as_f64().unwrap(),
        }
    });
    TargetConfig {
        architecture,
        vocab_size: n("vocab_size"),
        hidden_size: n("hidden_size"),
        intermediate_size: n("intermediate_size"),
        num_hidden_layers: layers,
        num_attention_heads: n("num_attention_heads"),
        num_key_value_heads: n("num_key_value_heads"),
        head_dim: n("head_dim"),
        rms_norm_eps: e["rms_norm_eps"].as_f64().unwrap(),
        rope_theta,
        rope_scaling,
        max_position_embeddings: n("max_position_embeddings"),
        tie_word_embeddings: e["tie_word_embeddings"].as_bool().unwrap(),
        bos_token_id: ids(&e["bos_token_id"]).first().copied(),
        eos_token_ids: ids(&e["eos_token_id"]),
        pad_token_id: ids(&e["pad_token_id"]).first().copied(),
        moe,
        gpt_oss,
    }
}

#[test]
fn every_family_reads_absent_and_null_keys_as_transformers_does_in_two_releases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-configs");
    let mut checked = Vec::new();
    for release in ["5.17.0", "5.23.0"] {
        for family in ["llama", "qwen3", "qwen3_moe", "gpt_oss"] {
            for variant in ["saved", "sparse", "nulls"] {
                let dir = root.join(release).join(format!("{family}-{variant}"));
                let what = format!("transformers {release}, {family}-{variant}");
                let e: Value =
                    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
                let architecture = match family {
                    "llama" => Architecture::Llama,
                    "qwen3" => Architecture::Qwen3,
                    "qwen3_moe" => Architecture::Qwen3Moe,
                    _ => Architecture::GptOss,
                };
                let want = expected(&e, architecture);
                assert_eq!(want.validate(), Ok(()), "{what}: the fixture must be a model that runs");
                assert_eq!(TargetConfig::from_dir(&dir).expect(&what), want, "{what}");
                checked.push(what);
            }
        }
    }
    assert_eq!(checked.len(), 24);
}

/// The case found on a tiny GPT-OSS target: `"rope_scaling": null` and no `rope_parameters` is GptOssConfig's YaRN,
/// not plain RoPE (every hidden state differs otherwise).
#[test]
fn a_gpt_oss_config_with_rope_scaling_null_takes_the_family_yarn() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-configs/5.17.0/gpt_oss-nulls");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let raw: Value = serde_json::from_str(&text).unwrap();
    assert!(raw["rope_scaling"].is_null() && raw.get("rope_parameters").is_none(), "{raw}");
    let c = TargetConfig::from_json(&text).unwrap();
    assert_eq!(c.rope_theta, 150000.0);
    match c.rope_scaling {
        RopeScaling::Yarn { factor, original_max_position_embeddings, truncate, .. } => {
            assert_eq!((factor, original_max_position_embeddings, truncate), (32.0, 4096.0, false))
        }
        other => panic!("plain RoPE where transformers takes YaRN: {other:?}"),
    }
}
