//! dflash's drafter against z-lab's model definition. The fixture (`tests/fixtures/zlab-forward/`) is a drafter in
//! z-lab's layout (`dflash export --format zlab`) and what z-lab's `DFlashDraftModel.forward` (PyPI `dflash`
//! 0.1.0) computed from it on the tiny-tasks target's tapped states (HF transformers); `scripts/checks/check_exports.sh`
//! made it and checks a fresh one (`DFLASH_ZLAB_FORWARD` names its folder). dflash loads the same folder and
//! drafts the same block: an anchor after the whole context, seeing all of it and its own block. The second fixture
//! (`zlab-forward-sliding/`, `DFLASH_ZLAB_FORWARD_SLIDING`) is a drafter whose first layer slides over a window of 8
//! of the 24 context positions, causal, as z-lab's model, vLLM and SGLang read its config.json.
use std::path::PathBuf;

use dflash::model::Drafter;
use dflash::train::objective::{BlockPlan, ObjectiveSettings, PlanTensors, Row};
use tch::{Device, Kind, Tensor};

#[test]
fn the_zlab_export_drafts_as_z_labs_model_definition_does() {
    drafts_as_z_lab("DFLASH_ZLAB_FORWARD", "zlab-forward");
}

#[test]
fn a_sliding_window_drafter_drafts_as_z_labs_model_definition_does() {
    let cfg = drafts_as_z_lab("DFLASH_ZLAB_FORWARD_SLIDING", "zlab-forward-sliding");
    let slide = dflash::model::LayerAttention { window: Some(8), causal: true };
    assert_eq!(cfg.layer_attention, vec![slide, Default::default()], "the layers as the fixture has them");
}

/// Compares dflash's forward with z-lab's on the fixture in `env`'s folder (or `tests/fixtures/<fixture>`); returns
/// the drafter's configuration.
fn drafts_as_z_lab(env: &str, fixture: &str) -> dflash::model::DrafterConfig {
    let dir = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture));
    let drafter = Drafter::load(&dir.join("drafter"), Device::Cpu, Kind::Float).unwrap();
    let io: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("forward.safetensors")).unwrap().into_iter().collect();
    let (target_hidden, noise, expected) = (&io["target_hidden"], &io["noise_embedding"], &io["output"]);
    let (context, q) = (target_hidden.size()[1] as usize, noise.size()[1] as usize);
    let cfg = drafter.config();
    assert_eq!(q, cfg.block_size);
    // The block's anchor is the token after the context: its features are never seen, so zeros stand in.
    let width = target_hidden.size()[2];
    let features =
        Tensor::cat(&[target_hidden.shallow_clone(), Tensor::zeros([1, 1, width], (Kind::Float, Device::Cpu))], 1);
    let (ids, mask) = (vec![0i64; context + 1], vec![1u8; context + 1]);
    let rows = [Row { input_ids: &ids, loss_mask: &mask }];
    let s = ObjectiveSettings::new(1, q, Some(2.0), cfg.mask_token_id);
    let plan = BlockPlan::new(&rows, &[vec![context]], context + 1, &s);
    let t = PlanTensors::new(&plan, &s, Kind::Float, Device::Cpu).unwrap();
    let ours = tch::no_grad(|| drafter.forward(&features, noise, &t.positions, &t.attention));
    let err = (&ours - expected).abs().max().double_value(&[]);
    let scale = expected.abs().max().double_value(&[]);
    assert!(err <= 1e-4 * scale.max(1.0), "{fixture}: max |dflash - z-lab| = {err:e} (outputs up to {scale:.3})");
    cfg.clone()
}
