//! DFlash 2 drafters through public interfaces: a fresh one (identity convolutions) drafts as the DFlash drafter with
//! the same backbone does, in training and at inference; trained convolutions never reach across a block; and the
//! objective's selector loss and every gradient are the written-out objective's.
mod reference_models;

use dflash::model::config::RopeScaling;
use dflash::model::variant::dflash2::Dflash2Shape;
use dflash::model::{Architecture, Drafter, DrafterConfig, Init, Variant};
use dflash::train::objective::{
    BlockPlan, ObjectiveSettings, PlanTensors, Row, SelectorTargets, SlotTargets, lm_head_loss,
};
use reference_models::*;
use tch::{Device, Kind, Tensor};

const BS: usize = 4;

fn shape() -> Dflash2Shape {
    Dflash2Shape { conv_kernel_size: 2, conv_group_size: 8, selector_rank: 8, selector_top_k: 4 }
}

fn dflash_cfg() -> DrafterConfig {
    let t = small_config(Architecture::Qwen3, false, RopeScaling::None);
    DrafterConfig::for_target(&t, 2, Some(40), BS, vec![0, 2], t.vocab_size as i64 - 1).unwrap()
}

fn dflash2_cfg() -> DrafterConfig {
    dflash_cfg().with_variant(Variant::DFlash2(shape())).unwrap()
}

/// A DFlash 2 drafter whose backbone is `backbone`'s weights and whose own parts are as initialised.
fn with_backbone(backbone: &Drafter, seed: u64) -> Drafter {
    let d = Drafter::new(dflash2_cfg(), Device::Cpu, Kind::Float, Init::Portable(seed)).unwrap();
    let theirs: std::collections::HashMap<String, Tensor> =
        backbone.params().layout().named_views(&backbone.params().master).into_iter().collect();
    tch::no_grad(|| {
        for (name, mut view) in d.params().layout().named_views(&d.params().master) {
            if let Some(w) = theirs.get(&name) {
                view.copy_(w);
            }
        }
    });
    d
}

/// Scales every weight (so each rule shows in the output) and, with `conv`, gives the convolutions random kernels.
fn perturbed(d: Drafter, conv: bool, seed: i64) -> Drafter {
    tch::no_grad(|| {
        for (name, mut view) in d.params().layout().named_views(&d.params().master) {
            if name.contains("_conv.") {
                if conv {
                    let noise = seeded(seed, || Tensor::randn(view.size(), (Kind::Float, Device::Cpu)));
                    view += noise * 0.5;
                }
            } else {
                view *= 5.0;
            }
        }
    });
    d
}

type Case = DrafterCase;

fn case(seq: usize, seed: i64) -> Case {
    drafter_case(&dflash_cfg(), seq, seed)
}

fn settings() -> ObjectiveSettings {
    ObjectiveSettings::new(64, BS, Some(2.0), dflash_cfg().mask_token_id)
}

fn plan(c: &Case, anchors: &[usize]) -> (BlockPlan, PlanTensors) {
    let rows = [Row { input_ids: &c.ids, loss_mask: &c.mask }];
    let plan = BlockPlan::new(&rows, &[anchors.to_vec()], c.ids.len(), &settings());
    let t = PlanTensors::new(&plan, &settings(), Kind::Float, Device::Cpu).unwrap();
    (plan, t)
}

/// Final hidden states `[Q, H]` of one row with blocks at `anchors`.
fn run(d: &Drafter, c: &Case, anchors: &[usize]) -> Tensor {
    let (_, t) = plan(c, anchors);
    let emb = Tensor::embedding(&c.embed, &t.block_ids, -1, false, false);
    tch::no_grad(|| d.forward(&c.features, &emb, &t.positions, &t.attention)).get(0)
}

/// Its identity convolutions make a fresh DFlash 2 drafter the DFlash drafter of its backbone, bit for bit: in
/// training's forward and in a drafting pass at inference.
#[test]
fn a_fresh_dflash2_drafter_drafts_as_its_dflash_backbone() {
    let dflash = perturbed(Drafter::new(dflash_cfg(), Device::Cpu, Kind::Float, Init::Portable(3)).unwrap(), false, 0);
    let dflash2 = with_backbone(&dflash, 4);
    let c = case(20, 5);
    let anchors = [2, 9, 15];
    assert!(run(&dflash, &c, &anchors).equal(&run(&dflash2, &c, &anchors)));
    let draft = |d: &Drafter| {
        let mut cache = d.new_cache(32).unwrap();
        let emb = Tensor::embedding(&c.embed, &Tensor::from_slice(&[c.ids[9], 96, 96, 96]), -1, false, false);
        let w = d.decode_weights().unwrap();
        d.draft(&w, &c.features.narrow(1, 0, 9), &emb.unsqueeze(0), &mut cache).unwrap()
    };
    let (ours, theirs) = (draft(&dflash2), draft(&dflash));
    assert!(ours.equal(&theirs));
    // Trained convolutions change what it drafts.
    let trained = perturbed(with_backbone(&dflash, 4), true, 6);
    assert!((run(&trained, &c, &anchors) - run(&dflash, &c, &anchors)).abs().max().double_value(&[]) > 1e-3);
}

/// A trained convolution mixes each token with the one before it in its own block only: blocks stay blind to each
/// other (a tap across the boundary would carry block 0's last slot into block 1's first).
#[test]
fn trained_convolutions_never_reach_across_a_block() {
    let backbone =
        perturbed(Drafter::new(dflash_cfg(), Device::Cpu, Kind::Float, Init::Portable(7)).unwrap(), false, 0);
    let d = perturbed(with_backbone(&backbone, 8), true, 9);
    let mut c = case(20, 10);
    let anchors = [3, 8, 13];
    let before = run(&d, &c, &anchors);
    c.ids[3] = (c.ids[3] + 1) % 90; // the anchor token of block 0
    let after = run(&d, &c, &anchors);
    let block = |h: &Tensor, j: i64| h.narrow(0, j * BS as i64, BS as i64);
    assert!(!block(&before, 0).equal(&block(&after, 0)), "block 0 reads its anchor");
    assert!(block(&before, 1).equal(&block(&after, 1)));
    assert!(block(&before, 2).equal(&block(&after, 2)));
}

/// The objective's loss and its gradient for every weight (the selector's codebooks and projection, the
/// convolutions and the backbone) equal autograd's through the objective written out: the weighted unary
/// cross-entropy plus alpha times the selector's K-way cross-entropy over the unary top-K (the label last where it
/// is missing) given the data's token before each slot, over the decayed weights' sum.
#[test]
fn the_selector_loss_and_every_gradient_are_the_written_out_objectives() {
    // In f64, so that the two orders of summation agree to far more digits than any mistake would.
    let backbone =
        perturbed(Drafter::new(dflash_cfg(), Device::Cpu, Kind::Float, Init::Portable(11)).unwrap(), false, 0);
    let f32s = perturbed(with_backbone(&backbone, 12), true, 13);
    let mut d = Drafter::zeroed(dflash2_cfg(), Device::Cpu, Kind::Double).unwrap();
    tch::no_grad(|| d.params().master.shallow_clone().copy_(&f32s.params().master));
    let mut c = case(18, 14);
    c.features = c.features.to_kind(Kind::Double);
    c.embed = c.embed.to_kind(Kind::Double);
    let (plan, t) = plan(&c, &[1, 7, 12]);
    let alpha = 0.7;
    let emb = Tensor::embedding(&c.embed, &t.block_ids, -1, false, false);
    let features = c.features.shallow_clone();

    // The library: forward, the chunked head with its selector, backward of the returned gradient.
    let h = d.forward(&features, &emb, &t.positions, &t.attention);
    let flat = h.view([-1, h.size()[2]]);
    let predecessors = t.predecessors(BS).unwrap();
    let slots = SlotTargets {
        selector: Some(SelectorTargets { drafter: &d, predecessors: &predecessors, alpha }),
        ..SlotTargets::labels(&t.labels, &t.weights)
    };
    let out = tch::no_grad(|| lm_head_loss(&flat.detach(), &c.embed, &slots, &plan, 5, true)).unwrap();
    (&h * out.grad.unwrap().view_as(&h)).sum(Kind::Double).backward();
    let ours = d.params().grad.copy();
    d.params_mut().zero_grad();

    // Written out with autograd.
    let h = d.forward(&features, &emb, &t.positions, &t.attention);
    let flat = h.view([-1, h.size()[2]]);
    let logits = flat.matmul(&c.embed.tr());
    let labels = &t.labels;
    let unary_ce = -logits.log_softmax(-1, Kind::Double).gather(1, &labels.unsqueeze(1), false).squeeze_dim(1);
    let top = logits.topk(shape().selector_top_k as i64, -1, true, true).1;
    let contains = top.eq_tensor(&labels.unsqueeze(1)).any_dim(1, false);
    let last = top.select(1, 3).where_self(&contains, labels);
    let candidates = Tensor::cat(&[top.narrow(1, 0, 3), last.unsqueeze(1)], 1);
    let place = candidates.eq_tensor(&labels.unsqueeze(1)).to_kind(Kind::Int64).argmax(1, false);
    let w = d.selector_weights().unwrap();
    let context = w.predecessor_codebook.index_select(0, &predecessors) * flat.matmul(&w.hidden_projection.tr());
    let successors = w.successor_codebook.index_select(0, &candidates.view([-1])).view([candidates.size()[0], 4, -1]);
    let scores =
        logits.gather(1, &candidates, false) + (successors * context.unsqueeze(1)).sum_dim_intlist(-1, false, None);
    let selector_ce = -scores.log_softmax(-1, Kind::Double).gather(1, &place.unsqueeze(1), false).squeeze_dim(1);
    let loss = ((unary_ce + selector_ce * alpha) * t.weights.to_kind(Kind::Double)).sum(Kind::Double);
    loss.backward();
    let written = d.params().grad.copy();

    assert!((out.metrics.weighted_loss - loss.double_value(&[])).abs() < 1e-3 * loss.double_value(&[]).abs());
    for (name, ours) in d.params().layout().named_views(&ours) {
        let theirs = &d.params().layout().named_views(&written).into_iter().find(|(n, _)| *n == name).unwrap().1;
        let scale = theirs.abs().max().double_value(&[]);
        let err = (&ours - theirs).abs().max().double_value(&[]);
        let own = name.contains("candidate_selector") || name.contains("_conv.");
        assert!(scale > 0.0 || !own, "{name} receives no gradient");
        assert!(err <= 1e-6 * scale.max(1e-3), "{name}: off by {err:e} (gradients up to {scale:e})");
    }
}

/// A DFlash 2 drafter proposes the selector's walk from the last accepted token, not each slot's argmax (its
/// codebooks here large enough that the two differ), and speculative decoding with it stays the target's greedy
/// output.
#[test]
fn the_proposer_drafts_the_selectors_walk_and_decoding_stays_lossless() {
    use dflash::model::speculative::{DFlashProposer, Proposer, greedy, speculative};
    use dflash::model::variant::dflash2::candidate_selector::greedy_path;
    use dflash::model::{Decoder, Depth, Preset};

    let t = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let cfg = DrafterConfig::for_preset(Preset::Tiny, BS).with_variant(Variant::DFlash2(shape())).unwrap();
    let d = Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(3)).unwrap();
    tch::no_grad(|| {
        for (name, mut view) in d.params().layout().named_views(&d.params().master) {
            if name.starts_with("candidate_selector.") {
                view *= 60.0;
            }
        }
    });
    let width = d.config().context_width() as i64;
    let states = seeded(21, || Tensor::randn([1, 10, width], (Kind::Float, Device::Cpu)));
    let (mut walked_apart, last) = (false, 17);
    for n in [10, 6, 3] {
        let context = states.narrow(1, 0, n);
        let mut proposer = DFlashProposer::new(&d, &t, 64, false).unwrap();
        let drafted = proposer.propose(&context, last, BS - 1).unwrap();
        // By hand: the same pass, its logits, the walk.
        let w = d.decode_weights().unwrap();
        let mut cache = d.new_cache(64).unwrap();
        let ids =
            Tensor::from_slice(&[last, d.config().mask_token_id, d.config().mask_token_id, d.config().mask_token_id]);
        let emb = t.embed(&ids.view([1, BS as i64]));
        let hidden = d.draft(&w, &context, &emb, &mut cache).unwrap().narrow(1, 1, BS as i64 - 1).get(0);
        let logits = hidden.matmul(&t.lm_head().tr());
        let sel = d.selector_weights().unwrap();
        let walk = tch::no_grad(|| greedy_path(&logits, &hidden, &ids.narrow(0, 0, 1), 4, &sel.borrowed())).unwrap();
        assert_eq!(drafted, Vec::<i64>::try_from(&walk).unwrap(), "{n} context rows");
        walked_apart |= drafted != Vec::<i64>::try_from(logits.argmax(-1, false)).unwrap();
    }
    assert!(walked_apart, "the selector never changed a draft: the test shows nothing");
    let mut proposer = DFlashProposer::new(&d, &t, 128, false).unwrap();
    for (i, (prompt_len, max_new)) in [(3, 9), (17, 16), (30, 20)].into_iter().enumerate() {
        let p: Vec<i64> = (0..prompt_len as i64).map(|j| (j * 37 + i as i64 * 11 + 3) % 250).collect();
        let reference = greedy(&mut Decoder::new(&t, 128, &[]).unwrap(), &p, max_new, &[]).unwrap();
        let out = speculative(&mut Decoder::new(&t, 128, &[]).unwrap(), &mut proposer, BS, &p, max_new, &[]).unwrap();
        assert_eq!(out.tokens, reference.tokens, "prompt {prompt_len} tokens, {max_new} new");
    }
}

/// The folder of speculators' step and save_pretrained: `DFLASH_DFLASH2_SPECULATORS` (`make check-exports`, on a
/// drafter it just trained), else the committed `tests/fixtures/dflash2-speculators`.
fn speculators_fixture() -> std::path::PathBuf {
    std::env::var_os("DFLASH_DFLASH2_SPECULATORS").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash2-speculators")
    })
}

/// One training step of a trained DFlash 2 drafter (exported by dflash, loaded back by speculators 0.9.0's own
/// `DFlash2DraftModel.from_pretrained`) is speculators' step: at every valid anchor, learning the target's argmax with
/// D-PACE weights and the selector's loss at alpha 0.7, the loss and the gradient of every tensor equal what
/// `DFlash2DraftModel.forward` computed (`tests/fixtures/dflash2-speculators/`, by `scripts/fixtures/make_dflash2_fixtures.py
/// --model`). Both normalise by the supervised slots; speculators adds 1e-5 to their count, dflash 1e-6.
#[test]
fn a_training_step_is_speculators_dflash2_step() {
    speculators_step_within(Kind::Float, 1e-6, 1e-5);
}

/// The same step computed in bf16, as a GPU trains (the CPU runs bf16 too): every tensor of the selector's loss and
/// its gradient meets the backbone's in one dtype (a step once mixed f32 D-PACE weights into a bf16 product and
/// failed), and the result is speculators' to bf16's rounding: the loss within 2%, each gradient within 10% of its
/// largest entry (measured: 0.4-2% for the backbone's, 5-7% for the selector's projection and predecessor codebook,
/// whose rows sum many slots' contributions in bf16).
#[test]
fn a_bf16_training_step_is_speculators_dflash2_step_to_bf16_rounding() {
    speculators_step_within(Kind::BFloat16, 2e-2, 1e-1);
}

/// One training step in `kind` against the fixture: the loss within `loss_tol` and each gradient within `grad_tol`
/// of speculators' (relative to the largest of the tensor's entries).
fn speculators_step_within(kind: Kind, loss_tol: f64, grad_tol: f64) {
    use dflash::model::{Depth, Preset};
    use dflash::train::objective::Teacher;
    use dflash::train::{FeatureBatch, Optimizer, OptimizerKind, Trainer};

    let dir = speculators_fixture();
    let drafter = Drafter::load(&dir.join("drafter"), Device::Cpu, kind).unwrap();
    let io: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("step.safetensors")).unwrap().into_iter().collect();
    let target = Preset::TinyTasks.spec().build_target(Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap();
    let cfg = drafter.config().clone();
    let objective = ObjectiveSettings {
        dpace_alpha: Some(0.5),
        teacher: Teacher::Argmax,
        selector_loss_alpha: 0.7,
        ..ObjectiveSettings::new(1000, cfg.block_size, None, cfg.mask_token_id)
    };
    let optimizer = Optimizer::new(drafter.params(), OptimizerKind::AdamW).unwrap();
    let (embed, lm_head) = (target.embed_tokens().to_kind(kind), target.lm_head().to_kind(kind));
    let mut trainer = Trainer::new(drafter, optimizer, embed, lm_head, objective, 0);
    let row = |key: &str| Vec::<i64>::try_from(io[key].view([-1])).unwrap();
    let loss_mask: Vec<u8> = row("loss_mask").into_iter().map(|m| m as u8).collect();
    // Every valid anchor, as the fixture took them (the step draws no more than there are).
    let anchors = dflash::train::objective::valid_anchors(&loss_mask);
    assert_eq!(anchors.iter().map(|&a| a as i64).collect::<Vec<_>>(), row("anchors"));
    let batch = FeatureBatch {
        sample_ids: vec![0],
        epoch: 0,
        input_ids: vec![row("input_ids")],
        loss_mask: vec![loss_mask],
        conversations: None,
        target_hidden: io["target_hidden"].to_kind(kind),
        target_last: Some(io["target_last"].to_kind(kind)),
    };
    let metrics = trainer.accumulate(&batch).unwrap();
    let theirs = io["loss"].double_value(&[0]);
    let loss = metrics.loss();
    assert!((loss - theirs).abs() < loss_tol * theirs, "{kind:?} loss {loss} against speculators' {theirs}");
    let params = trainer.drafter.params();
    let mut compared = 0;
    for (name, ours) in params.layout().named_views(&params.grad) {
        let theirs = &io[&format!("grad.{name}")];
        let ours = ours.to_kind(Kind::Float) / metrics.weight;
        let scale = theirs.abs().max().double_value(&[]);
        let err = (&ours - theirs).abs().max().double_value(&[]);
        assert!(
            err <= grad_tol * scale.max(1e-6),
            "{kind:?} {name}: off by {err:e} (speculators' gradient up to {scale:e})"
        );
        compared += 1;
    }
    assert_eq!(compared, io.keys().filter(|k| k.starts_with("grad.")).count(), "every tensor speculators trains");
}

/// `draft_model.init` takes a DFlash 2 drafter as speculators' own `save_pretrained` writes it (its layout, bf16):
/// the folder fits the run its config.json describes, and its weights are the drafter's, to bf16's rounding.
#[test]
fn draft_model_init_takes_the_folder_speculators_writes() {
    let dir = speculators_fixture();
    let ours = Drafter::load(&dir.join("drafter"), Device::Cpu, Kind::Float).unwrap();
    let saved = dir.join("saved-by-speculators");
    dflash::service::drafter_init::check_init(&saved, ours.config()).unwrap();
    let theirs = Drafter::with_weights(ours.config().clone(), &saved, Device::Cpu, Kind::Float).unwrap();
    let rounded = ours.params().master.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    assert!(theirs.params().master.equal(&rounded), "the weights speculators wrote are not the drafter's");
    assert!(matches!(theirs.config().variant, Variant::DFlash2(s) if s.selector_top_k == 4));
}
