//! Starting a new run from a published drafter (`draft_model.init`): z-lab's folders, or one `dflash export` wrote.
//! Its `config.json` must describe the drafter that `[draft_model]` and the target describe (depth, width, block
//! size, tapped layers, MASK token, the target's shape), and its weights must hold every tensor at that shape. It is
//! checked once, before anything starts: a mismatch is one error naming the keys to set, not a drafter failing
//! on every restart. A run that resumes a checkpoint never reads it.
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::model::drafter_config::write_layer_attention;
use crate::model::weights::WeightFiles;
use crate::model::{Drafter, DrafterConfig};

/// Checks the drafter folder `dir` against `configured`, the drafter this run trains.
pub fn check_init(dir: &Path, configured: &DrafterConfig) -> Result<()> {
    let what = || format!("draft_model.init = {}", dir.display());
    let found = DrafterConfig::from_dir(dir).with_context(what)?;
    let wrong = mismatches(configured, &found);
    if !wrong.is_empty() {
        bail!("{}: the drafter there does not fit this run:\n  - {}", what(), wrong.join("\n  - "));
    }
    let files = WeightFiles::open(dir).with_context(what)?;
    for (name, shape) in Drafter::tensor_shapes(configured) {
        let expected: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        match files.shape(&name) {
            None => {
                bail!("{}: its weights have no tensor `{name}`: not a DFlash drafter in the published layout", what())
            }
            Some(s) if s != expected => {
                bail!(
                    "{}: `{name}` has shape {s:?}, its config.json says {expected:?}: the folder is inconsistent",
                    what()
                )
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// What differs between the drafter this run trains and the one found, one line each, naming what to change.
pub fn mismatches(configured: &DrafterConfig, found: &DrafterConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut setting = |what: &str, key: &str, ours: String, theirs: String| {
        if ours != theirs {
            out.push(format!("{what}: this run has {ours}, the drafter {theirs}: set {key} = {theirs}"));
        }
    };
    let (c, f) = (&configured.decoder, &found.decoder);
    setting(
        "layers",
        "draft_model.num_hidden_layers",
        c.num_hidden_layers.to_string(),
        f.num_hidden_layers.to_string(),
    );
    setting(
        "MLP width",
        "draft_model.intermediate_size",
        c.intermediate_size.to_string(),
        f.intermediate_size.to_string(),
    );
    setting("block size", "draft_model.block_size", configured.block_size.to_string(), found.block_size.to_string());
    setting(
        "tapped target layers",
        "draft_model.target_layer_ids",
        format!("{:?}", configured.target_layer_ids),
        format!("{:?}", found.target_layer_ids),
    );
    setting(
        "MASK token",
        "draft_model.mask_token_id",
        configured.mask_token_id.to_string(),
        found.mask_token_id.to_string(),
    );
    if configured.variant != found.variant {
        out.push(format!(
            "variant: this run has {}, the drafter {}: set those draft_model keys as the drafter has them",
            configured.variant.describe(),
            found.variant.describe()
        ));
    }
    if configured.layer_attention != found.layer_attention {
        let shown = |d: &DrafterConfig| {
            let mut v = serde_json::json!({});
            write_layer_attention(&mut v, &d.layer_attention);
            let causal = v.get("is_causal").map_or("\"auto\"".to_string(), |c| c.to_string());
            format!(
                "layer_types = {}, sliding_window = {}, block_causal = {causal}",
                v["layer_types"], v["sliding_window"]
            )
        };
        out.push(format!(
            "attention: this run has {}, the drafter {}: set those draft_model keys as the drafter has them",
            shown(configured),
            shown(found)
        ));
    }
    let mut target = |what: &str, ours: String, theirs: String| {
        if ours != theirs {
            out.push(format!(
                "{what}: the target has {ours}, the drafter was made for {theirs}: a drafter of another target \
                 (target.model)"
            ));
        }
    };
    target("hidden size", c.hidden_size.to_string(), f.hidden_size.to_string());
    target("attention heads", c.num_attention_heads.to_string(), f.num_attention_heads.to_string());
    target("key-value heads", c.num_key_value_heads.to_string(), f.num_key_value_heads.to_string());
    target("head size", c.head_dim.to_string(), f.head_dim.to_string());
    target("vocabulary", c.vocab_size.to_string(), f.vocab_size.to_string());
    target("RoPE theta", c.rope_theta.to_string(), f.rope_theta.to_string());
    target("RoPE scaling", format!("{:?}", c.rope_scaling), format!("{:?}", f.rope_scaling));
    target("RMSNorm epsilon", c.rms_norm_eps.to_string(), f.rms_norm_eps.to_string());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Preset, Variant};

    /// z-lab's published Qwen3-8B drafter fits a run on the qwen3-8b shapes with the default `[draft_model]` and the
    /// preset's taps and MASK token; a block size of 8 is named.
    #[test]
    fn z_labs_qwen3_8b_drafter_fits_a_qwen3_8b_run() {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/qwen3-8b-dflash-b16.json")).unwrap();
        let theirs = DrafterConfig::from_json(&fixture["config"].to_string()).unwrap();
        let spec = Preset::Qwen3_8b.spec();
        let ours = DrafterConfig::for_target(&spec.target, 5, None, 16, spec.taps.clone(), spec.mask_token_id).unwrap();
        assert_eq!(mismatches(&ours, &theirs), Vec::<String>::new());
        let eight = DrafterConfig { block_size: 8, ..ours };
        assert_eq!(
            mismatches(&eight, &theirs),
            vec!["block size: this run has 8, the drafter 16: set draft_model.block_size = 16"]
        );
    }

    #[test]
    fn every_difference_is_named_with_the_key_to_set() {
        let ours = DrafterConfig::for_preset(Preset::Tiny, 4);
        assert!(mismatches(&ours, &ours).is_empty());
        let mut theirs = ours.clone();
        theirs.block_size = 16;
        theirs.mask_token_id = 300;
        theirs.target_layer_ids = vec![1, 2];
        theirs.decoder.num_hidden_layers += 1;
        theirs.decoder.intermediate_size *= 2;
        let lines = mismatches(&ours, &theirs);
        assert_eq!(lines.len(), 5, "{lines:#?}");
        for needed in [
            "set draft_model.block_size = 16",
            "set draft_model.mask_token_id = 300",
            "set draft_model.target_layer_ids = [1, 2]",
            "set draft_model.num_hidden_layers = 3",
            &format!("set draft_model.intermediate_size = {}", theirs.decoder.intermediate_size),
        ] {
            assert!(lines.iter().any(|l| l.contains(needed)), "{needed}: {lines:#?}");
        }
        // A DFlash 2 drafter for a DFlash run: the keys that make one, with its sizes.
        let dflash2 = ours.clone().with_variant(Variant::DFlash2(crate::model::variant::dflash2::Dflash2Shape {
            conv_group_size: 8,
            ..Default::default()
        }));
        let lines = mismatches(&ours, &dflash2.unwrap());
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(lines[0].contains("variant = \"dflash2\", conv_kernel_size = 2, conv_group_size = 8"), "{lines:#?}");
        let mut other_target = ours.clone();
        other_target.decoder.hidden_size *= 2;
        other_target.decoder.rope_theta = 1e6;
        let lines = mismatches(&ours, &other_target);
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(lines.iter().all(|l| l.contains("another target")), "{lines:#?}");
    }
}
