//! The `speculators` format of a DFlash drafter (vLLM detects it by `speculators_model_type`; `vllm serve <folder>`
//! runs it), as the `speculators` package 0.9.0 writes it: its `DFlashConverter` turns z-lab's layout into this.
//!
//! - `config.json`: `speculators_model_type = "dflash"` (`"dflash2"` for DFlash 2, with its four sizes at the top
//!   level as `DFlash2SpeculatorConfig` has them), the drafter's Qwen3 shape as `transformer_layer_config`
//!   (`rope_theta` and any scaling folded into `rope_parameters`, as transformers 5 writes it), `block_size`,
//!   `mask_token_id`, one greedy proposal of `block_size - 1` tokens, and the verifier (the target) by path or hub id.
//! - The tapped layers as `aux_hidden_state_layer_ids`: z-lab's `target_layer_ids` name decoder layer i's output,
//!   which is `hidden_states[i + 1]` (index 0 is the embedding output); speculators names that `i + 1`. The
//!   verifier's last layer is always fed to the drafter implicitly and is left out of the list, so a drafter that
//!   taps it cannot be written in this format (the converter would drop its columns of `fc`).
//! - Causality: vLLM (0.34, `speculators/algos.py`) reads one causality for every layer from this format,
//!   `dflash_config.causal = not sliding_window_non_causal`, unless `transformer_layer_config.is_causal` says
//!   otherwise; speculators trains full-attention layers bidirectional whatever the flag. The converter's default
//!   (`false`) therefore has vLLM run the paper's bidirectional blocks causally. This writes both keys from the
//!   drafter's layers, which must all be causal (then all sliding) or none; other drafters go out as z-lab's layout.
//! - `model.safetensors`: the drafter's own tensors under the published names (`fc`, `hidden_norm`, `layers.*`,
//!   `norm`, and DFlash 2's `candidate_selector.*`). Version 0.9.0 saves neither the embedding, the LM head nor the verifier's norm: it loads them from
//!   the verifier when the model is built.
use serde_json::{Map, Value, json};

use super::DrafterConfig;
use super::config::RopeScaling;

/// The `speculators` version whose format this writes.
pub const SPECULATORS_VERSION: &str = "0.9.0";

/// The target the drafter serves beside, as the config names it.
pub struct Verifier {
    /// A local folder or a hub id (`Qwen/Qwen3-8B`); speculators loads the embedding and LM head from it.
    pub name_or_path: String,
    /// Its `architectures` (`["Qwen3ForCausalLM"]`).
    pub architectures: Vec<String>,
    pub num_hidden_layers: usize,
}

/// speculators' tap ids for `cfg`'s: each z-lab id plus one; an error when one of them is the verifier's last layer.
pub fn aux_hidden_state_layer_ids(cfg: &DrafterConfig, verifier_layers: usize) -> Result<Vec<usize>, String> {
    let ids: Vec<usize> = cfg.target_layer_ids.iter().map(|i| i + 1).collect();
    if ids.contains(&verifier_layers) {
        return Err(format!(
            "the drafter taps the target's last layer ({}): speculators feeds that layer implicitly and leaves it out \
             of aux_hidden_state_layer_ids, so this drafter cannot be written in its format; export --format zlab",
            verifier_layers - 1
        ));
    }
    Ok(ids)
}

/// The `config.json` of the speculators format for a drafter of `cfg`, its weights in `torch_dtype`.
pub fn config_json(cfg: &DrafterConfig, verifier: &Verifier, torch_dtype: &str) -> Result<Value, String> {
    let aux = aux_hidden_state_layer_ids(cfg, verifier.num_hidden_layers)?;
    let causal = one_causality(cfg)?;
    let mut layer = cfg.to_json(torch_dtype);
    layer["is_causal"] = json!(causal);
    let obj = layer.as_object_mut().expect("the drafter's config is an object");
    for key in ["architectures", "block_size", "dflash_config", "num_target_layers", "torch_dtype"] {
        obj.remove(key);
    }
    let theta = obj.remove("rope_theta").unwrap_or(Value::Null);
    obj.remove("rope_scaling");
    obj.insert("rope_parameters".into(), rope_parameters(&cfg.decoder.rope_scaling, theta));
    let sorted: Map<String, Value> =
        std::mem::take(obj).into_iter().collect::<std::collections::BTreeMap<_, _>>().into_iter().collect();
    let algorithm = cfg.variant.name();
    let mut v = json!({
        "architectures": [cfg.variant.architecture()],
        "aux_hidden_state_layer_ids": aux,
        "block_size": cfg.block_size,
        "draft_vocab_size": cfg.decoder.vocab_size,
        "dtype": torch_dtype,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": false,
        "sliding_window_non_causal": !causal,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "accept_tolerance": 0.0,
                "proposal_type": "greedy",
                "speculative_tokens": cfg.block_size - 1,
                "verifier_accept_k": 1,
            }],
            "verifier": {"architectures": verifier.architectures, "name_or_path": verifier.name_or_path},
        },
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": null,
        "tie_word_embeddings": false,
        "transformer_layer_config": Value::Object(sorted),
    });
    // DFlash 2's sizes sit at the top level (`DFlash2SpeculatorConfig`), where vLLM copies them into its
    // `dflash_config`.
    for (key, size) in cfg.variant.sizes() {
        v[key] = json!(size);
    }
    Ok(v)
}

/// The one causality of every layer that this format can carry (see the module doc).
fn one_causality(cfg: &DrafterConfig) -> Result<bool, String> {
    let layers = &cfg.layer_attention;
    let causal = layers.first().is_some_and(|l| l.causal);
    if layers.iter().any(|l| l.causal != causal) || (causal && layers.iter().any(|l| l.window.is_none())) {
        let each: Vec<String> = layers.iter().enumerate().map(|(i, l)| format!("layer {i}: {l}")).collect();
        return Err(format!(
            "the speculators format carries one causality for every layer (vLLM reads it so) and bidirectional \
             full-attention layers (speculators trains them so), and this drafter has {}: export --format zlab",
            each.join("; ")
        ));
    }
    Ok(causal)
}

/// transformers 5's `rope_parameters`: the scaling's fields with its `rope_type`, and `rope_theta`.
fn rope_parameters(scaling: &RopeScaling, theta: Value) -> Value {
    let mut v = scaling.to_json().unwrap_or_else(|| json!({"rope_type": "default"}));
    v["rope_theta"] = theta;
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LayerAttention, Preset, Variant};

    fn tiny_tasks_drafter() -> DrafterConfig {
        let spec = Preset::TinyTasks.spec();
        DrafterConfig::for_target(&spec.target, 5, None, 16, spec.taps.clone(), spec.mask_token_id).unwrap()
    }

    /// The config equals what speculators 0.9.0's own converter wrote for the same drafter (the fixture), but for
    /// `auto_map` (the converter also copies speculators' config class as config.py for `trust_remote_code`; vLLM
    /// and speculators' `from_pretrained` do not need it) and `transformers_version` (the converter's transformers).
    #[test]
    fn the_config_is_what_speculators_own_converter_writes() {
        let fixture: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/speculators-0.9.0-tiny-tasks.json")).unwrap();
        let mut expected = fixture["config"].clone();
        for key in ["auto_map", "transformers_version"] {
            expected.as_object_mut().unwrap().remove(key);
        }
        // Where ours differs on purpose: the converter's `sliding_window_non_causal = false` has vLLM run these
        // bidirectional blocks causally (the module doc); ours says they are not.
        expected["sliding_window_non_causal"] = json!(true);
        expected["transformer_layer_config"]["is_causal"] = json!(false);
        let verifier = Verifier {
            name_or_path: "VERIFIER".into(),
            architectures: vec!["Qwen3ForCausalLM".into()],
            num_hidden_layers: 8,
        };
        let ours = config_json(&tiny_tasks_drafter(), &verifier, "bfloat16").unwrap();
        assert_eq!(ours, expected, "ours:\n{ours:#}\nthe converter's:\n{expected:#}");
    }

    /// A DFlash 2 drafter goes out as speculators' `DFlash2SpeculatorConfig` has it: its model type, architecture and
    /// algorithm, its four sizes at the top level (where vLLM's `update_dflash2` reads them into `dflash_config`),
    /// nothing of z-lab's `dflash_config` in the layer config.
    #[test]
    fn a_dflash2_drafter_is_speculators_dflash2_type() {
        let verifier =
            Verifier { name_or_path: "V".into(), architectures: vec!["Qwen3ForCausalLM".into()], num_hidden_layers: 8 };
        let shape = crate::model::variant::dflash2::Dflash2Shape { conv_group_size: 8, ..Default::default() };
        let cfg = tiny_tasks_drafter().with_variant(Variant::DFlash2(shape)).unwrap();
        let v = config_json(&cfg, &verifier, "bfloat16").unwrap();
        assert_eq!(v["speculators_model_type"], json!("dflash2"));
        assert_eq!(v["speculators_config"]["algorithm"], json!("dflash2"));
        assert_eq!(v["architectures"], json!(["DFlash2DraftModel"]));
        for (key, size) in
            [("conv_kernel_size", 2), ("conv_group_size", 8), ("selector_rank", 256), ("selector_top_k", 16)]
        {
            assert_eq!(v[key], json!(size), "{key}");
        }
        let layer = v["transformer_layer_config"].as_object().unwrap();
        assert!(!layer.contains_key("dflash_config") && !layer.contains_key("architectures"));
        let dflash = config_json(&tiny_tasks_drafter(), &verifier, "bfloat16").unwrap();
        assert!(dflash.get("selector_rank").is_none() && dflash["speculators_model_type"] == json!("dflash"));
    }

    /// What this format says reads back as the drafter it was written from (but for the verifier's depth, which the
    /// format does not carry: the last tap's layer then bounds it), DFlash and DFlash 2, bidirectional and causal
    /// sliding blocks; what dflash cannot train is refused, naming the key.
    #[test]
    fn the_format_reads_back_as_the_drafter_it_was_written_from() {
        let verifier =
            Verifier { name_or_path: "V".into(), architectures: vec!["Qwen3ForCausalLM".into()], num_hidden_layers: 8 };
        let slide = LayerAttention { window: Some(64), causal: true };
        let shape = crate::model::variant::dflash2::Dflash2Shape {
            conv_group_size: 8,
            selector_top_k: 4,
            ..Default::default()
        };
        for cfg in [
            tiny_tasks_drafter(),
            tiny_tasks_drafter().with_variant(Variant::DFlash2(shape)).unwrap(),
            tiny_tasks_drafter().with_layer_attention(vec![slide; 5]).unwrap(),
        ] {
            let text = config_json(&cfg, &verifier, "bfloat16").unwrap().to_string();
            let read = DrafterConfig::from_json(&text).unwrap();
            assert_eq!(read, DrafterConfig { num_target_layers: 6, ..cfg.clone() }, "{text}");
        }
        let mut v = config_json(&tiny_tasks_drafter(), &verifier, "bfloat16").unwrap();
        v["draft_vocab_size"] = json!(32);
        assert!(DrafterConfig::from_json(&v.to_string()).unwrap_err().contains("draft_vocab_size"));
        v["speculators_model_type"] = json!("eagle3");
        assert!(DrafterConfig::from_json(&v.to_string()).unwrap_err().contains("eagle3"));
    }

    /// vLLM's reading of the format (`update_dflash`, then `_dflash_layer_causal`: `is_causal`, else
    /// `dflash_config.causal = not sliding_window_non_causal`) gives each layer the causality it was trained with;
    /// a drafter with mixed causality is refused, naming the other layout.
    #[test]
    fn vllm_reads_each_layers_causality_as_trained() {
        let verifier =
            Verifier { name_or_path: "V".into(), architectures: vec!["Qwen3ForCausalLM".into()], num_hidden_layers: 8 };
        let vllm_causal = |v: &Value| {
            v["transformer_layer_config"]["is_causal"]
                .as_bool()
                .unwrap_or(!v["sliding_window_non_causal"].as_bool().unwrap_or(true))
        };
        let slide = |causal: bool| LayerAttention { window: Some(64), causal };
        for layers in [vec![LayerAttention::default(); 5], vec![slide(true); 5], vec![slide(false); 5]] {
            let cfg = tiny_tasks_drafter().with_layer_attention(layers.clone()).unwrap();
            let v = config_json(&cfg, &verifier, "bfloat16").unwrap();
            assert!(layers.iter().all(|l| l.causal == vllm_causal(&v)), "{layers:?}: {v:#}");
            assert_eq!(
                v["transformer_layer_config"]["layer_types"][0] == "sliding_attention",
                layers[0].window.is_some()
            );
        }
        let mixed = vec![slide(true), slide(true), LayerAttention::default(), slide(true), slide(true)];
        let e = config_json(&tiny_tasks_drafter().with_layer_attention(mixed).unwrap(), &verifier, "bfloat16");
        assert!(e.unwrap_err().contains("--format zlab"));
    }

    #[test]
    fn taps_shift_by_one_and_the_last_layer_cannot_be_tapped() {
        let cfg = tiny_tasks_drafter();
        assert_eq!(aux_hidden_state_layer_ids(&cfg, 8).unwrap(), vec![2, 4, 6]);
        let e = aux_hidden_state_layer_ids(&cfg, 6).unwrap_err();
        assert!(e.contains("last layer (5)") && e.contains("--format zlab"), "{e}");
    }
}
