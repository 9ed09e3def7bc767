//! Training through public interfaces on the tiny preset: where gradients go, the published file format, bitwise
//! save/load and resume, chunked evaluation, and a drafter that actually learns.
mod reference_models;

use std::collections::BTreeMap;

use dflash::ffi::accel::{AdamwStep, MuonIteration, MuonStep};
use dflash::model::presets::tiny;
use dflash::model::variant::dflash2::Dflash2Shape;
use dflash::model::{Depth, Drafter, DrafterConfig, Init, Preset, Target, Variant};
use dflash::train::objective::ObjectiveSettings;
use dflash::train::{FeatureBatch, Optimizer, OptimizerKind, Teacher, Trainer, UpdateSettings};
use tch::{Device, Kind, Tensor};

const BS: usize = 4;

fn target() -> Target {
    let spec = Preset::Tiny.spec();
    spec.build_target(Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap()
}

fn trainer(target: &Target, num_anchors: usize, seed: u64) -> Trainer {
    trainer_with(target, ObjectiveSettings::new(num_anchors, BS, Some(2.0), tiny::MASK), seed)
}

fn trainer_with(target: &Target, objective: ObjectiveSettings, seed: u64) -> Trainer {
    trainer_of(Variant::DFlash, target, objective, seed)
}

/// DFlash 2 at small sizes: two taps, channel groups of 8, rank 16, 4 candidates.
fn dflash2() -> Variant {
    Variant::DFlash2(Dflash2Shape { conv_kernel_size: 2, conv_group_size: 8, selector_rank: 16, selector_top_k: 4 })
}

fn trainer_of(variant: Variant, target: &Target, objective: ObjectiveSettings, seed: u64) -> Trainer {
    let cfg = DrafterConfig::for_preset(Preset::Tiny, BS).with_variant(variant).unwrap();
    let drafter = Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(seed)).unwrap();
    let optimizer = Optimizer::new(drafter.params(), OptimizerKind::AdamW).unwrap();
    let (embed, lm_head) = (target.embed_tokens().shallow_clone(), target.lm_head().shallow_clone());
    Trainer::new(drafter, optimizer, embed, lm_head, objective, seed)
}

fn update(lr: f64) -> UpdateSettings {
    UpdateSettings {
        adamw: AdamwStep { lr, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 },
        grad_clip: Some(1.0),
        muon: None,
    }
}

/// Counting sequences with a per-row stride (1, 2 or 3): the next tokens follow from the anchor and the context.
/// The first four tokens are a "prompt" (loss mask 0).
fn dataset(n: usize, len: usize) -> Vec<(Vec<i64>, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let stride = (i % 3 + 1) as i64;
            let start = (i as i64 * 37) % 200;
            let ids = (0..len as i64).map(|t| (start + t * stride) % 200).collect();
            let mask = (0..len).map(|t| u8::from(t >= 4)).collect();
            (ids, mask)
        })
        .collect()
}

fn batch(target: &Target, rows: &[(Vec<i64>, Vec<u8>)], first_id: u64, epoch: u64) -> FeatureBatch {
    FeatureBatch::capture(
        target,
        (first_id..first_id + rows.len() as u64).collect(),
        epoch,
        rows.iter().map(|r| r.0.clone()).collect(),
        rows.iter().map(|r| r.1.clone()).collect(),
        (Device::Cpu, Kind::Float),
        false,
    )
    .unwrap()
}

#[test]
fn gradients_reach_every_trained_parameter_and_never_the_target() {
    let t = target();
    let mut tr = trainer(&t, 8, 1);
    let data = dataset(3, 30);
    tr.accumulate(&batch(&t, &data, 0, 0)).unwrap();
    let p = tr.drafter.params();
    for (name, g) in p.layout().named_views(&p.grad) {
        assert!(g.abs().max().double_value(&[]) > 0.0, "no gradient reached {name}");
    }
    for frozen in [t.embed_tokens(), t.lm_head()] {
        assert!(!frozen.requires_grad());
        assert!(!frozen.grad().defined(), "a gradient reached the target");
    }
}

#[test]
fn the_writer_matches_the_published_qwen3_8b_drafter() {
    let fixture: serde_json::Value = serde_json::from_str(include_str!("fixtures/qwen3-8b-dflash-b16.json")).unwrap();
    let cfg = DrafterConfig::for_preset(Preset::Qwen3_8b, 16);
    let mine: BTreeMap<String, Vec<i64>> = Drafter::tensor_shapes(&cfg).into_iter().collect();
    let published: BTreeMap<String, Vec<i64>> = serde_json::from_value(fixture["tensors"].clone()).unwrap();
    assert_eq!(mine, published);
    let json = cfg.to_json("bfloat16");
    for (key, value) in fixture["config"].as_object().unwrap() {
        assert!(json.get(key).is_some(), "config.json lacks the published key {key}");
        if matches!(
            key.as_str(),
            "architectures"
                | "model_type"
                | "block_size"
                | "num_target_layers"
                | "dflash_config"
                | "hidden_size"
                | "num_hidden_layers"
                | "intermediate_size"
                | "head_dim"
                | "vocab_size"
        ) {
            assert_eq!(&json[key], value, "{key}");
        }
    }
    // And the published config reads back as the same drafter.
    let read = DrafterConfig::from_json(&fixture["config"].to_string()).unwrap();
    assert_eq!(Drafter::tensor_shapes(&read), Drafter::tensor_shapes(&cfg));
}

#[test]
fn a_saved_drafter_holds_exactly_the_published_tensors() {
    let d =
        Drafter::new(DrafterConfig::for_preset(Preset::Tiny, BS), Device::Cpu, Kind::Float, Init::Portable(3)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    d.save(dir.path(), Kind::BFloat16).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut in_file: Vec<(String, Vec<i64>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::BF16);
            (n, v.shape().iter().map(|&s| s as i64).collect())
        })
        .collect();
    in_file.sort();
    let mut expected = Drafter::tensor_shapes(d.config());
    expected.sort();
    assert_eq!(in_file, expected);
    // A bf16 folder (as published) loads into fp32 master weights holding the bf16 values.
    let back = Drafter::load(dir.path(), Device::Cpu, Kind::Float).unwrap();
    assert_eq!(back.params().master.kind(), Kind::Float);
    let rounded = d.params().master.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    assert!(back.params().master.equal(&rounded));
}

fn snapshot(tr: &Trainer) -> (Tensor, Tensor, Tensor) {
    let (m, v) = tr.optimizer.moments();
    (tr.drafter.params().master.copy(), m.copy(), v.copy())
}

#[test]
fn save_load_is_bitwise_and_resuming_continues_identically() {
    resumes_identically(Variant::DFlash);
}

/// A DFlash 2 drafter (its convolutions, codebooks and projection among the weights and optimizer states) too.
#[test]
fn a_dflash2_drafter_resumes_identically() {
    resumes_identically(dflash2());
}

fn resumes_identically(variant: Variant) {
    tch::set_num_threads(1);
    let t = target();
    let data = dataset(4, 28);
    let batches: Vec<FeatureBatch> = (0..6).map(|e| batch(&t, &data, 0, e)).collect();
    let trainer =
        |t: &Target, n, seed| trainer_of(variant, t, ObjectiveSettings::new(n, BS, Some(2.0), tiny::MASK), seed);
    let mut a = trainer(&t, 6, 5);
    for b in &batches[..3] {
        a.train_step(std::slice::from_ref(b), &update(3e-3)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    a.drafter.save(dir.path(), Kind::Float).unwrap();
    a.optimizer.save(&dir.path().join("optimizer.safetensors"), a.drafter.params().layout()).unwrap();

    let mut b = trainer(&t, 6, 5);
    b.drafter = Drafter::load(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let layout = b.drafter.params().layout();
    b.optimizer =
        Optimizer::load(dir.path(), "optimizer.safetensors", layout, Device::Cpu, OptimizerKind::AdamW).unwrap();
    let (sa, sb) = (snapshot(&a), snapshot(&b));
    assert!(sa.0.equal(&sb.0) && sa.1.equal(&sb.1) && sa.2.equal(&sb.2), "save -> load is not bitwise");
    assert_eq!(b.optimizer.steps(), 3);

    for batch in &batches[3..] {
        let (ma, _) = a.train_step(std::slice::from_ref(batch), &update(3e-3)).unwrap();
        let (mb, _) = b.train_step(std::slice::from_ref(batch), &update(3e-3)).unwrap();
        assert_eq!(ma, mb);
    }
    let (sa, sb) = (snapshot(&a), snapshot(&b));
    assert!(sa.0.equal(&sb.0), "resumed parameters diverged from the uninterrupted run");
    assert!(sa.1.equal(&sb.1) && sa.2.equal(&sb.2));
    assert!(!sa.0.equal(&snapshot(&trainer(&t, 6, 5)).0), "training changed nothing");
}

#[test]
fn evaluation_in_chunks_equals_one_pass() {
    let t = target();
    let data = dataset(3, 40);
    let fb = batch(&t, &data, 0, 0);
    let one = trainer(&t, 1000, 2).evaluate(&fb).unwrap();
    let chunked = trainer(&t, 7, 2).evaluate(&fb).unwrap();
    assert_eq!(one.blocks, 3.0 * 35.0, "every valid anchor is evaluated");
    assert_eq!(
        (one.correct, one.predicted, one.accepted, one.blocks),
        (chunked.correct, chunked.predicted, chunked.accepted, chunked.blocks)
    );
    assert!((one.weighted_loss - chunked.weighted_loss).abs() < 1e-6 * one.weighted_loss);
    assert!((one.weight - chunked.weight).abs() < 1e-9);
}

#[test]
fn a_tiny_drafter_overfits_a_tiny_dataset() {
    let t = target();
    overfits(&t, trainer(&t, 12, 7));
}

/// With D-PACE's slot weights (alpha 0.5) the same: the loss it reports (normalised by the supervised slots) falls as
/// far, and the drafter learns to draft.
#[test]
fn a_tiny_drafter_overfits_a_tiny_dataset_with_dpace() {
    let objective = ObjectiveSettings { dpace_alpha: Some(0.5), ..ObjectiveSettings::new(12, BS, None, tiny::MASK) };
    let t = target();
    overfits(&t, trainer_with(&t, objective, 7));
}

/// With Muon for the weight matrices (speculators' defaults but a higher rate for 150 steps) and AdamW for the norms.
#[test]
fn a_tiny_drafter_overfits_a_tiny_dataset_with_muon() {
    let t = target();
    let mut tr = trainer(&t, 12, 7);
    tr.optimizer = Optimizer::new(tr.drafter.params(), OptimizerKind::Muon).unwrap();
    let muon =
        MuonStep { lr: 0.02, momentum: 0.95, weight_decay: 0.1, ns_steps: 5, iteration: MuonIteration::NewtonSchulz };
    overfits_with(&t, tr, &UpdateSettings { muon: Some(muon), ..update(5e-3) });
}

/// Learning the trained tiny-tasks target's own choices (its argmax) and its whole distribution (KL): its choices on
/// the counting rows follow their context, so both losses fall and the drafts agree with the target; accuracy and
/// acceptance count the target's argmax.
#[test]
fn a_tiny_drafter_learns_the_targets_argmax_and_its_distribution() {
    let t = Preset::TinyTasks.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
    for teacher in [Teacher::Argmax, Teacher::Distribution] {
        let objective = ObjectiveSettings { teacher, ..ObjectiveSettings::new(12, BS, Some(2.0), tiny::MASK) };
        overfits(&t, trainer_with(&t, objective, 7));
    }
}

/// A DFlash 2 drafter with the recipe's D-PACE and Muon, orthogonalising by Gram Newton-Schulz
/// (`optim.muon_iteration = "gram"`): both losses fall, and the selector's drafts (what the metrics count for it)
/// agree with the data.
#[test]
fn a_tiny_dflash2_drafter_overfits_a_tiny_dataset_with_dpace_and_muon() {
    let t = target();
    let objective = ObjectiveSettings { dpace_alpha: Some(0.5), ..ObjectiveSettings::new(12, BS, None, tiny::MASK) };
    let mut tr = trainer_of(dflash2(), &t, objective, 7);
    tr.optimizer = Optimizer::new(tr.drafter.params(), OptimizerKind::Muon).unwrap();
    let muon = MuonStep { lr: 0.02, momentum: 0.95, weight_decay: 0.1, ns_steps: 5, iteration: MuonIteration::Gram };
    overfits_with(&t, tr, &UpdateSettings { muon: Some(muon), ..update(5e-3) });
}

fn overfits(t: &Target, tr: Trainer) {
    overfits_with(t, tr, &update(5e-3))
}

fn overfits_with(t: &Target, mut tr: Trainer, settings: &UpdateSettings) {
    let data = dataset(6, 32);
    let with_last = tr.objective.teacher.needs_target_predictions();
    let batch = |rows: &[(Vec<i64>, Vec<u8>)], first_id: u64, epoch: u64| {
        let ids = (first_id..first_id + rows.len() as u64).collect();
        let (input_ids, masks) = rows.iter().cloned().unzip();
        FeatureBatch::capture(t, ids, epoch, input_ids, masks, (Device::Cpu, Kind::Float), with_last).unwrap()
    };
    let eval = batch(&data, 0, 0);
    let before = tr.evaluate(&eval).unwrap();
    for step in 0..150u64 {
        tr.train_step(&[batch(&data, 0, step)], settings).unwrap();
    }
    let after = tr.evaluate(&eval).unwrap();
    assert!(after.loss() < 0.3 * before.loss(), "loss {} -> {}", before.loss(), after.loss());
    assert!(
        after.acceptance_length() > 2.0,
        "acceptance length {} -> {}",
        before.acceptance_length(),
        after.acceptance_length()
    );
}

#[test]
fn a_non_finite_gradient_skips_the_update() {
    let t = target();
    let mut tr = trainer(&t, 4, 9);
    let data = dataset(2, 20);
    let fb = batch(&t, &data, 0, 0);
    let m = tr.accumulate(&fb).unwrap();
    let before = tr.drafter.params().master.copy();
    let _ = tr.drafter.params().grad.narrow(0, 0, 1).fill_(f64::NAN);
    let report = tr.apply(m.weight, &update(1e-2)).unwrap();
    assert!(!report.applied && !report.grad_norm.is_finite());
    assert!(tr.drafter.params().master.equal(&before));
    assert_eq!(tr.optimizer.steps(), 0);
    assert_eq!(tr.drafter.params().grad.abs().max().double_value(&[]), 0.0, "gradient cleared for the next step");
}

#[test]
fn accumulating_micro_batches_equals_one_batch() {
    let t = target();
    let data = dataset(4, 30);
    let whole = batch(&t, &data, 0, 3);
    let (first, second) = (batch(&t, &data[..2], 0, 3), batch(&t, &data[2..], 2, 3));
    let mut a = trainer(&t, 6, 4);
    let mut b = trainer(&t, 6, 4);
    let ma = a.accumulate(&whole).unwrap();
    let mut mb = b.accumulate(&first).unwrap();
    mb.add(&b.accumulate(&second).unwrap());
    assert_eq!((ma.blocks, ma.predicted, ma.correct), (mb.blocks, mb.predicted, mb.correct));
    assert!((ma.weighted_loss - mb.weighted_loss).abs() < 1e-5 * ma.weighted_loss);
    let (ga, gb) = (&a.drafter.params().grad, &b.drafter.params().grad);
    let err = (ga - gb).abs().max().double_value(&[]) / ga.abs().max().double_value(&[]);
    assert!(err < 1e-4, "accumulated gradient differs by {err}");
    a.apply(ma.weight, &update(1e-3)).unwrap();
    b.apply(mb.weight, &update(1e-3)).unwrap();
    let diff = (&a.drafter.params().master - &b.drafter.params().master).abs().max().double_value(&[]);
    // Adam normalises each element, so rounding noise in near-zero gradients shows; 1% of the step is the bound.
    assert!(diff < 1e-5, "updates differ by {diff}");
}

#[test]
fn two_drafters_with_batch_b_equal_one_drafter_with_batch_2b() {
    use dflash::train::collective::{Collective, Contribution, GradientSum};
    use dflash::train::objective::ObjectiveKnobs;
    use dflash::train::optim::{Hyper, LrSchedule, Progress, ScheduleKind};
    use dflash::train::step::StepSettings;
    use std::sync::Arc;
    let t = target();
    let data = dataset(4, 30);
    let hyper = Hyper {
        schedule: LrSchedule {
            kind: ScheduleKind::Constant,
            lr: 2e-3,
            warmup_steps: 0,
            total_steps: 1,
            min_lr_ratio: 0.0,
        },
        progress: Progress::Steps,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: Some(1.0),
        muon: None,
    };
    let mut one = trainer(&t, 6, 12);
    let mut halves = [trainer(&t, 6, 12), trainer(&t, 6, 12)];
    let objective = ObjectiveKnobs { num_anchors: 12, gamma: None };
    let collective =
        Arc::new(Collective::new(0, 0, StepSettings { hyper, objective }, GradientSum::DeviceCopies, |_| {}));
    collective.found(0, 1).unwrap();
    // The second replica joins: it receives the first's state.
    let joiner = collective.clone();
    let buffers = {
        let p = halves[1].drafter.params();
        let [m, v, _] = halves[1].optimizer.state_tensors();
        dflash::train::collective::JoinBuffers {
            master: p.master.shallow_clone(),
            exp_avg: m.shallow_clone(),
            exp_avg_sq: v.shallow_clone(),
        }
    };
    joiner.request_join(1, 1, buffers).unwrap();
    {
        let [m, v, _] = halves[0].optimizer.state_tensors();
        collective.serve_joiners(0, 1, [&halves[0].drafter.params().master, m, v], 0).unwrap();
    }
    collective.wait_joined(1, 1).unwrap();
    for step in 0..3u64 {
        let whole = batch(&t, &data, 0, step);
        let parts = [batch(&t, &data[..2], 0, step), batch(&t, &data[2..], 2, step)];
        let m = one.accumulate(&whole).unwrap();
        one.apply(m.weight, &update(2e-3)).unwrap();
        std::thread::scope(|scope| {
            for (id, (tr, part)) in halves.iter_mut().zip(parts).enumerate() {
                let c = collective.clone();
                scope.spawn(move || {
                    let m = tr.accumulate(&part).unwrap();
                    let own = tr.drafter.params().grad.shallow_clone();
                    let contribution = Contribution {
                        grad: own.shallow_clone(),
                        weight: m.weight,
                        samples: 2,
                        batches: vec![],
                        metrics: m,
                        digest: None,
                    };
                    let r = c.contribute(id, 1, step, contribution, |_| {}).unwrap();
                    let sum = r.grad.as_ref().expect("device copies give the sum");
                    sum.copy_into(&mut own.shallow_clone()).unwrap();
                    tr.apply(r.total_weight, &r.update).unwrap();
                });
            }
        });
    }
    let (a, b) = (&halves[0].drafter.params().master, &halves[1].drafter.params().master);
    assert!(a.equal(b), "the two replicas must stay bitwise identical");
    let diff = (a - &one.drafter.params().master).abs().max().double_value(&[]);
    // Equal up to rounding (the sums differ in order); Adam normalises each element, so the bound is 1% of what
    // three steps can move a weight.
    assert!(diff < 1e-2 * 3.0 * 2e-3, "two drafters with b and one with 2b differ by {diff}");
}

/// Packed rows (`data.pack`) train each conversation as it trains alone: the same anchors (drawn per conversation),
/// the same blocks, the context of its own conversation only, no label from the next one. Each conversation's loss,
/// packed beside others whose tokens are not supervised, equals its loss alone; a packed batch's loss sums and
/// gradient equal the sums of its conversations alone, within f32 rounding; evaluation too. With the paper's decayed
/// weights and with D-PACE's.
#[test]
fn packed_rows_train_each_conversation_as_it_trains_alone() {
    let t = target();
    // Long enough that a group of blocks of the second conversation reads the row's context from its conversation's
    // start (rounded down to 256), not from the row's.
    let lengths = [300usize, 170, 240];
    let data: Vec<(Vec<i64>, Vec<u8>)> = dataset(3, 300)
        .into_iter()
        .zip(lengths)
        .map(|((ids, mask), len)| (ids[..len].to_vec(), mask[..len].to_vec()))
        .collect();
    let alone = |tr: &mut Trainer, i: usize| {
        let m = tr.accumulate(&batch(&t, &data[i..i + 1], i as u64, 3)).unwrap();
        let g = tr.drafter.params().grad.copy();
        tr.drafter.params_mut().zero_grad();
        (m, g)
    };
    // Rows [0, 1] and [2]; `supervised` says whose tokens count.
    let packed = |supervised: &[bool]| {
        let mask = |i: usize| if supervised[i] { data[i].1.clone() } else { vec![0; lengths[i]] };
        FeatureBatch::capture_packed(
            &t,
            vec![0, 1, 2],
            3,
            vec![[data[0].0.clone(), data[1].0.clone()].concat(), data[2].0.clone()],
            vec![[mask(0), mask(1)].concat(), mask(2)],
            Some(vec![vec![lengths[0], lengths[1]], vec![lengths[2]]]),
            (Device::Cpu, Kind::Float),
            false,
        )
        .unwrap()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs().max(1e-3);
    for dpace in [None, Some(0.5)] {
        let objective =
            ObjectiveSettings { dpace_alpha: dpace, ..ObjectiveSettings::new(6, BS, Some(2.0), tiny::MASK) };
        let mut tr = trainer_with(&t, objective, 4);
        let singles: Vec<_> = (0..3).map(|i| alone(&mut tr, i)).collect();
        for (i, (m, _)) in singles.iter().enumerate() {
            let only = tr.accumulate(&packed(&[i == 0, i == 1, i == 2])).unwrap();
            tr.drafter.params_mut().zero_grad();
            assert!(m.blocks > 0.0 && only.blocks == m.blocks, "conversation {i}: {only:?} against {m:?}");
            assert!(close(only.weighted_loss, m.weighted_loss) && only.weight == m.weight, "{i}: {only:?} {m:?}");
            assert_eq!((only.correct, only.accepted), (m.correct, m.accepted), "conversation {i}");
        }
        let all = tr.accumulate(&packed(&[true, true, true])).unwrap();
        let grad = tr.drafter.params().grad.copy();
        tr.drafter.params_mut().zero_grad();
        let sum = |f: fn(&dflash::train::objective::Metrics) -> f64| singles.iter().map(|(m, _)| f(m)).sum::<f64>();
        assert!(close(all.weighted_loss, sum(|m| m.weighted_loss)), "{all:?}");
        assert_eq!((all.weight, all.blocks), (sum(|m| m.weight), sum(|m| m.blocks)));
        let expected = singles.iter().fold(Tensor::zeros_like(&grad), |acc, (_, g)| acc + g);
        let err = (&grad - &expected).abs().max().double_value(&[]) / expected.abs().max().double_value(&[]);
        assert!(err < 1e-4, "dpace {dpace:?}: the packed gradient is off by {err} (relative)");
        let evaluated = tr.evaluate(&packed(&[true, true, true])).unwrap();
        let each: f64 =
            (0..3).map(|i| tr.evaluate(&batch(&t, &data[i..i + 1], i as u64, 3)).unwrap().weighted_loss).sum();
        assert!(close(evaluated.weighted_loss, each), "evaluation: {} against {each}", evaluated.weighted_loss);
    }
}
