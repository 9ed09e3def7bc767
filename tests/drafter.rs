//! The drafter and its objective through public interfaces: equality with a naive per-block re-implementation (with
//! sliding windows and causal blocks as vLLM and SGLang run them), the attention rules observed by behaviour,
//! weights and padding, where gradients go, and group-size invariance.
mod reference_models;

use std::collections::BTreeMap;

use dflash::model::config::RopeScaling;
use dflash::model::{Architecture, Drafter, DrafterConfig, Init, LayerAttention, TargetConfig};
use dflash::train::objective::{BlockPlan, ObjectiveSettings, PlanTensors, Row, SlotTargets, lm_head_loss};
use reference_models::*;
use tch::{Device, Kind, Tensor};

const BS: usize = 4;

fn target_cfg() -> TargetConfig {
    small_config(Architecture::Qwen3, false, RopeScaling::None)
}

fn drafter_cfg() -> DrafterConfig {
    let t = target_cfg();
    DrafterConfig::for_target(&t, 2, Some(40), BS, vec![0, 2], t.vocab_size as i64 - 1).unwrap()
}

/// A drafter with larger-than-default random weights so every rule shows in the output.
fn drafter(seed: u64) -> Drafter {
    drafter_with(seed, vec![LayerAttention::default(); 2])
}

/// [`drafter`] with each layer's window and causality as given.
fn drafter_with(seed: u64, layers: Vec<LayerAttention>) -> Drafter {
    let cfg = drafter_cfg().with_layer_attention(layers).unwrap();
    let d = Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(seed)).unwrap();
    tch::no_grad(|| {
        let _ = d.params().master.shallow_clone().f_mul_scalar_(5.0).unwrap();
    });
    d
}

fn weights_by_name(d: &Drafter) -> BTreeMap<String, Tensor> {
    let p = d.params();
    p.layout().named_views(&p.master).into_iter().map(|(n, t)| (n, t.to_kind(Kind::Double))).collect()
}

type Case = DrafterCase;

fn case(seq: usize, seed: i64) -> Case {
    drafter_case(&drafter_cfg(), seq, seed)
}

fn settings() -> ObjectiveSettings {
    ObjectiveSettings::new(64, BS, Some(2.0), drafter_cfg().mask_token_id)
}

/// Final hidden states `[Q, H]` of one row with the given anchors, through the library.
fn run(d: &Drafter, c: &Case, anchors: &[usize], group_blocks: usize) -> Tensor {
    let rows = [Row { input_ids: &c.ids, loss_mask: &c.mask }];
    let mut s = settings();
    s.attention_group_blocks = Some(group_blocks);
    let plan = BlockPlan::new(&rows, &[anchors.to_vec()], c.ids.len(), &s);
    let t = PlanTensors::new(&plan, &s, Kind::Float, Device::Cpu).unwrap();
    let emb = Tensor::embedding(&c.embed, &t.block_ids, -1, false, false);
    tch::no_grad(|| d.forward(&c.features, &emb, &t.positions, &t.attention)).get(0)
}

/// The drafter written out from DFLASH.md, one block at a time, in f64, with an explicit softmax.
fn naive_block(w: &BTreeMap<String, Tensor>, cfg: &DrafterConfig, c: &Case, anchor: usize) -> Tensor {
    let dc = &cfg.decoder;
    let (d, eps) = (dc.head_dim as i64, dc.rms_norm_eps);
    let inv = inv_freqs(dc);
    let group = (dc.num_attention_heads / dc.num_key_value_heads) as i64;
    let ctx = rms(&c.features.get(0).to_kind(Kind::Double).matmul(&w["fc.weight"].tr()), &w["hidden_norm.weight"], eps);
    let ctx = ctx.narrow(0, 0, anchor as i64); // strictly before the anchor
    let mut ids = vec![cfg.mask_token_id; BS];
    ids[0] = c.ids[anchor];
    let mut x = c.embed.to_kind(Kind::Double).index_select(0, &Tensor::from_slice(&ids));
    let block_pos: Vec<i64> = (0..BS as i64).map(|k| anchor as i64 + k).collect();
    let ctx_pos: Vec<i64> = (0..anchor as i64).collect();
    for l in 0..dc.num_hidden_layers {
        let p = |s: &str| w[&format!("layers.{l}.{s}")].shallow_clone();
        let xn = rms(&x, &p("input_layernorm.weight"), eps);
        let q = xn.matmul(&p("self_attn.q_proj.weight").tr());
        let k_ctx = ctx.matmul(&p("self_attn.k_proj.weight").tr());
        let v_ctx = ctx.matmul(&p("self_attn.v_proj.weight").tr());
        let k_blk = xn.matmul(&p("self_attn.k_proj.weight").tr());
        let v_blk = xn.matmul(&p("self_attn.v_proj.weight").tr());
        let mut heads = vec![];
        for h in 0..dc.num_attention_heads as i64 {
            let kvh = h / group;
            let qh = rope_at(&rms(&q.narrow(1, h * d, d), &p("self_attn.q_norm.weight"), eps), &inv, &block_pos);
            let kc = rope_at(&rms(&k_ctx.narrow(1, kvh * d, d), &p("self_attn.k_norm.weight"), eps), &inv, &ctx_pos);
            let kb = rope_at(&rms(&k_blk.narrow(1, kvh * d, d), &p("self_attn.k_norm.weight"), eps), &inv, &block_pos);
            let keys = Tensor::cat(&[kc, kb], 0);
            let values = Tensor::cat(&[v_ctx.narrow(1, kvh * d, d), v_blk.narrow(1, kvh * d, d)], 0);
            let scores = qh.matmul(&keys.tr()) / (d as f64).sqrt();
            // The layer's window and causality as the engines apply them: a query at q sees a key at k iff
            // q - k < window, and k <= q (causal) or k - q < window (not).
            let layer = cfg.layer_attention[l];
            for (i, &q) in block_pos.iter().enumerate() {
                for (j, &k) in ctx_pos.iter().chain(&block_pos).enumerate() {
                    let outside = layer.window.is_some_and(|w| q - k >= w || (!layer.causal && k - q >= w));
                    if outside || (layer.causal && k > q) {
                        let _ = scores.get(i as i64).get(j as i64).fill_(f64::NEG_INFINITY);
                    }
                }
            }
            let e = (&scores - scores.amax(&[1i64][..], true)).exp();
            let probs = &e / e.sum_dim_intlist(1, true, Kind::Double);
            heads.push(probs.matmul(&values));
        }
        x = &x + Tensor::cat(&heads, 1).matmul(&p("self_attn.o_proj.weight").tr());
        let hn = rms(&x, &p("post_attention_layernorm.weight"), eps);
        let gate = hn.matmul(&p("mlp.gate_proj.weight").tr());
        let act = &gate * gate.sigmoid() * hn.matmul(&p("mlp.up_proj.weight").tr());
        x = &x + act.matmul(&p("mlp.down_proj.weight").tr());
    }
    rms(&x, &w["norm.weight"], eps)
}

/// The paper's layers, and layers that slide (a window of 5 that cuts the context, one of 3 under the block size
/// both ways) or keep the block causal.
fn layer_kinds() -> Vec<Vec<LayerAttention>> {
    let slide = |w: i64, causal: bool| LayerAttention { window: Some(w), causal };
    vec![
        vec![LayerAttention::default(); 2],
        vec![slide(5, true), LayerAttention::default()],
        vec![slide(3, false); 2],
        vec![LayerAttention { window: None, causal: true }; 2],
    ]
}

#[test]
fn the_drafter_equals_a_naive_per_block_implementation() {
    let c = case(24, 1);
    let anchors = [0, 3, 9, 10, 20];
    for layers in layer_kinds() {
        let d = drafter_with(1, layers.clone());
        let mine = run(&d, &c, &anchors, 2);
        let w = weights_by_name(&d);
        for (j, &a) in anchors.iter().enumerate() {
            let reference = naive_block(&w, d.config(), &c, a);
            let err = rel_err(&mine.narrow(0, (j * BS) as i64, BS as i64), &reference);
            assert!(err < 1e-5, "{layers:?}, block {j} (anchor {a}): relative error {err}");
        }
    }
}

#[test]
fn attention_groups_do_not_change_the_result() {
    let c = case(40, 2);
    let anchors = [1, 5, 6, 14, 22, 23, 30, 37];
    for layers in layer_kinds() {
        let d = drafter_with(2, layers.clone());
        let one = run(&d, &c, &anchors, 64);
        for g in [1, 3, 5] {
            let err = rel_err(&run(&d, &c, &anchors, g), &one.to_kind(Kind::Double));
            assert!(err < 1e-5, "{layers:?}, group size {g}: relative error {err}");
        }
    }
}

fn block(h: &Tensor, j: usize) -> Tensor {
    h.narrow(0, (j * BS) as i64, BS as i64)
}

#[test]
fn a_block_never_sees_context_at_or_after_its_anchor() {
    let d = drafter(3);
    let c = case(20, 3);
    let anchors = [3, 8, 13];
    let before = run(&d, &c, &anchors, 1);
    // Perturb the target states at positions 8.. (the anchor of block 1 and everything after it).
    let mut tail = c.features.narrow(1, 8, 12);
    let noise = seeded(4, || Tensor::randn([1, 12, tail.size()[2]], (Kind::Float, Device::Cpu)));
    let _ = tail.f_add_(&noise).unwrap();
    let after = run(&d, &c, &anchors, 1);
    assert!(block(&before, 0).equal(&block(&after, 0)), "block 0 (anchor 3) must not see positions >= 8");
    assert!(block(&before, 1).equal(&block(&after, 1)), "block 1 (anchor 8): strict < anchor");
    assert!(rel_err(&block(&after, 2), &block(&before, 2).to_kind(Kind::Double)) > 1e-4, "block 2 sees 8..12");
    // The position just before an anchor is seen.
    let mut prev = c.features.narrow(1, 7, 1);
    let _ = prev.f_add_(&Tensor::ones_like(&prev)).unwrap();
    let again = run(&d, &c, &anchors, 1);
    assert!(block(&after, 0).equal(&block(&again, 0)));
    assert!(rel_err(&block(&again, 1), &block(&after, 1).to_kind(Kind::Double)) > 1e-4, "block 1 sees 7");
}

#[test]
fn blocks_never_see_each_other_and_see_all_of_themselves() {
    let d = drafter(4);
    let mut c = case(20, 4);
    let anchors = [3, 8, 13];
    let before = run(&d, &c, &anchors, 3);
    c.ids[8] = (c.ids[8] + 1) % 90; // the anchor token of block 1
    let after = run(&d, &c, &anchors, 3);
    assert!(block(&before, 0).equal(&block(&after, 0)));
    assert!(block(&before, 2).equal(&block(&after, 2)));
    // Every slot of block 1 changes, the last included: attention inside a block is bidirectional.
    for k in 0..BS as i64 {
        let (b, a) = (block(&before, 1).get(k), block(&after, 1).get(k));
        assert!(rel_err(&a, &b.to_kind(Kind::Double)) > 1e-4, "slot {k} of block 1 did not see slot 0");
    }
}

#[test]
fn slot_zero_and_padding_blocks_carry_no_loss_and_no_gradient() {
    let d = drafter(5);
    let c = case(16, 5);
    let other = case(16, 6);
    // Row 1 has one anchor, so it gets two padding blocks.
    let rows = [
        Row { input_ids: &c.ids, loss_mask: &c.mask },
        Row { input_ids: &other.ids[..6], loss_mask: &other.mask[..6] },
    ];
    let s = settings();
    let plan = BlockPlan::new(&rows, &[vec![2, 6, 11], vec![1]], 16, &s);
    assert!(plan.weights.iter().step_by(BS).all(|&w| w == 0.0), "slot 0 never weighs");
    let t = PlanTensors::new(&plan, &s, Kind::Float, Device::Cpu).unwrap();
    let features = Tensor::cat(&[&c.features, &other.features], 0);
    let emb = Tensor::embedding(&c.embed, &t.block_ids, -1, false, false).set_requires_grad(true);
    let h = d.forward(&features, &emb, &t.positions, &t.attention);
    let flat = h.view([-1, h.size()[2]]);
    let out =
        lm_head_loss(&flat.detach(), &c.embed, &SlotTargets::labels(&t.labels, &t.weights), &plan, 5, true).unwrap();
    assert!(out.metrics.weighted_loss.is_finite() && out.metrics.weight > 0.0);
    assert_eq!(out.metrics.blocks, 4.0);
    let grad = out.grad.unwrap();
    assert!(bool::try_from(grad.isfinite().all()).unwrap());
    (h * grad.view_as(&flat).view([2, -1, flat.size()[1]])).sum(Kind::Float).backward();
    // No gradient reaches the padding blocks' inputs (row 1, blocks 1 and 2), nor any slot-0-only path.
    let g = emb.grad();
    let padding = g.get(1).narrow(0, BS as i64, 2 * BS as i64);
    assert_eq!(padding.abs().max().double_value(&[]), 0.0);
    assert!(g.get(0).abs().max().double_value(&[]) > 0.0);
}

/// What the LM-head tests share: 18 tokens, blocks at 1, 7 and 12, their plan (tensors on the CPU) and the
/// drafter's hidden states `[rows, H]`.
struct HeadCase {
    c: Case,
    anchors: Vec<usize>,
    plan: BlockPlan,
    t: PlanTensors,
    h: Tensor,
}

fn head_case() -> HeadCase {
    let d = drafter(6);
    let c = case(18, 7);
    let anchors = vec![1, 7, 12];
    let rows = [Row { input_ids: &c.ids, loss_mask: &c.mask }];
    let s = settings();
    let plan = BlockPlan::new(&rows, std::slice::from_ref(&anchors), 18, &s);
    let t = PlanTensors::new(&plan, &s, Kind::Float, Device::Cpu).unwrap();
    let h = run(&d, &c, &anchors, 2);
    HeadCase { c, anchors, plan, t, h }
}

#[test]
fn the_head_loss_equals_cross_entropy_written_out() {
    let HeadCase { c, anchors, plan, t, h } = head_case();
    let out = lm_head_loss(&h, &c.embed, &SlotTargets::labels(&t.labels, &t.weights), &plan, 3, false).unwrap();
    // Written out: logits, log-softmax, weighted sum; acceptance per block from the argmax.
    let logits = h.to_kind(Kind::Double).matmul(&c.embed.to_kind(Kind::Double).tr());
    let lsm = logits.log_softmax(-1, Kind::Double);
    let argmax = Vec::<i64>::try_from(logits.argmax(-1, false)).unwrap();
    let (mut wl, mut ws, mut accepted) = (0.0, 0.0, 0.0);
    for (j, &a) in anchors.iter().enumerate() {
        let mut run_on = true;
        let mut len = 1.0;
        for k in 0..BS {
            let i = j * BS + k;
            let w = plan.weights[i] as f64;
            if w > 0.0 {
                wl -= w * lsm.double_value(&[i as i64, c.ids[a + k]]);
                ws += w;
            }
            if k > 0 && run_on {
                if w > 0.0 && argmax[i] == c.ids[a + k] {
                    len += 1.0;
                } else {
                    run_on = false;
                }
            }
        }
        accepted += len;
    }
    assert!((out.metrics.weighted_loss - wl).abs() < 1e-4 * wl.abs(), "{} vs {wl}", out.metrics.weighted_loss);
    assert!((out.metrics.weight - ws).abs() < 1e-6);
    assert_eq!(out.metrics.accepted, accepted);
    assert_eq!(out.metrics.blocks, 3.0);
}

#[test]
fn the_head_gradient_is_the_loss_gradient_even_where_the_drafter_is_sure() {
    let HeadCase { c, plan, t, h, .. } = head_case();
    let labels = Vec::<i64>::try_from(&t.labels).unwrap();
    let weights = Vec::<f32>::try_from(&t.weights).unwrap();
    // Every third weighted row all but certain of its label (p within 1e-6 of 1): its gradient is tiny, and a
    // softmax stored in bf16 minus the one-hot would cancel to nothing there.
    let h = h.detach();
    let sure: Vec<i64> = (0..labels.len() as i64).filter(|&i| weights[i as usize] > 0.0 && i % 3 == 0).collect();
    for &i in &sure {
        h.get(i).copy_(&(c.embed.get(labels[i as usize]) * 6.0));
    }
    // On the CPU, and on a GPU where there is one (its bf16 kernels are the ones training uses).
    let mut cases = vec![(Device::Cpu, Kind::Float, 1e-5), (Device::Cpu, Kind::BFloat16, 3e-2)];
    if tch::Cuda::is_available() {
        cases.extend([(Device::Cuda(0), Kind::Float, 1e-5), (Device::Cuda(0), Kind::BFloat16, 3e-2)]);
    }
    for (device, kind, tolerance) in cases {
        let (x, head) = (h.to_kind(kind), c.embed.to_kind(kind));
        let (labels, weights) = (t.labels.to_device(device), t.weights.to_device(device));
        let out = lm_head_loss(
            &x.to_device(device),
            &head.to_device(device),
            &SlotTargets::labels(&labels, &weights),
            &plan,
            5,
            true,
        )
        .unwrap();
        let grad = out.grad.unwrap().to_device(Device::Cpu).to_kind(Kind::Double);
        // The reference: autograd of sum(w * CE) in f64, from the same (rounded) inputs.
        let xr = x.to_kind(Kind::Double).set_requires_grad(true);
        let lsm = xr.matmul(&head.to_kind(Kind::Double).tr()).log_softmax(-1, Kind::Double);
        let ce = -lsm.gather(1, &t.labels.unsqueeze(1), false).squeeze_dim(1);
        let loss = (ce * t.weights.to_kind(Kind::Double)).sum(Kind::Double);
        let reference_loss = loss.double_value(&[]);
        loss.backward();
        let reference = xr.grad();
        let err = rel_err(&grad, &reference);
        eprintln!("{device:?} {kind:?}: head gradient relative error {err}");
        assert!(err < tolerance, "{device:?} {kind:?}: head gradient relative error {err}");
        for &i in &sure {
            let (g, r) = (grad.get(i), reference.get(i));
            assert!(r.abs().max().double_value(&[]) > 0.0);
            let err = rel_err(&g, &r);
            assert!(err < 20.0 * tolerance, "{device:?} {kind:?}: row {i} (p near 1): relative error {err}");
        }
        let want = (reference_loss - out.metrics.weighted_loss).abs();
        assert!(want < 10.0 * tolerance * out.metrics.weighted_loss.abs(), "{device:?} {kind:?}: loss off by {want}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn on_a_gpu_the_drafter_and_its_loss_match_the_cpu() {
    dflash::device::gpu_for_tests();
    // Default-scale weights: the x5 weights of the other tests make softmaxes so sharp that bf16 rounding flips them.
    let cpu = Drafter::new(drafter_cfg(), Device::Cpu, Kind::Float, Init::Portable(8)).unwrap();
    let c = case(64, 8);
    let anchors: Vec<usize> = vec![0, 5, 9, 17, 30, 31, 44, 50, 58];
    let rows = [Row { input_ids: &c.ids, loss_mask: &c.mask }];
    let s = ObjectiveSettings { attention_group_blocks: Some(4), ..settings() };
    let plan = BlockPlan::new(&rows, std::slice::from_ref(&anchors), 64, &s);
    let reference = run(&cpu, &c, &anchors, 4).to_kind(Kind::Double);
    let t_cpu = PlanTensors::new(&plan, &s, Kind::Float, Device::Cpu).unwrap();
    let ref_loss = lm_head_loss(
        &reference.to_kind(Kind::Float),
        &c.embed,
        &SlotTargets::labels(&t_cpu.labels, &t_cpu.weights),
        &plan,
        8,
        false,
    )
    .unwrap()
    .metrics;
    let dir = tempfile::tempdir().unwrap();
    cpu.save(dir.path(), Kind::Float).unwrap();
    for (kind, tolerance) in [(Kind::Float, 1e-4), (Kind::BFloat16, 5e-2)] {
        let dev = Device::Cuda(0);
        let gpu = Drafter::load(dir.path(), dev, kind).unwrap();
        let t = PlanTensors::new(&plan, &s, kind, dev).unwrap();
        let embed = c.embed.to_device(dev).to_kind(kind);
        let emb = Tensor::embedding(&embed, &t.block_ids, -1, false, false);
        let features = c.features.to_device(dev).to_kind(kind);
        let h = tch::no_grad(|| gpu.forward(&features, &emb, &t.positions, &t.attention)).get(0);
        let err = rel_err(&h.to_device(Device::Cpu), &reference);
        eprintln!("{kind:?}: forward relative error {err}");
        assert!(err < tolerance, "{kind:?} forward: relative error {err}");
        let m = lm_head_loss(&h, &embed, &SlotTargets::labels(&t.labels, &t.weights), &plan, 8, false).unwrap().metrics;
        let err = (m.weighted_loss - ref_loss.weighted_loss).abs() / ref_loss.weighted_loss;
        assert!(err < tolerance, "{kind:?} loss: relative error {err}");
    }
}
