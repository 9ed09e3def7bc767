//! Targets against HuggingFace transformers itself: `tests/fixtures/hf-qwen3-moe/` is a tiny Qwen3-MoE that
//! transformers 5.19 made, saved (`save_pretrained`, per-expert tensors, its own config.json spelling) and ran
//! (`scripts/make_hf_target_fixture.py` says how; its routing margins are at least 2e-3). dflash loads the folder and
//! must route every token to the same experts and reproduce every layer's hidden states and the logits.
use std::path::Path;

use dflash::model::{Depth, Target};
use tch::{Device, Kind, Tensor};

fn fixture() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-qwen3-moe"))
}

fn expected() -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture().join("expected.safetensors")).unwrap().into_iter().collect()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
}

#[test]
fn qwen3_moe_captures_as_transformers_computes_it() {
    // HF's last `hidden_states` entry is after the final norm; the logits check the last layer.
    let taps = [0, 1, 2];
    let target = Target::load(fixture(), &taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let cfg = target.config().clone();
    assert_eq!(cfg.moe.as_ref().map(|m| m.num_experts), Some(6), "transformers 5 writes num_local_experts");
    let sparse: Vec<usize> = (0..4).filter(|&l| cfg.is_sparse(l)).collect();
    assert_eq!(sparse, vec![0, 2, 3]);
    let want = expected();
    let prompts: Vec<Tensor> = (0..2).map(|p| want[&format!("p{p}.input_ids")].shallow_clone()).collect();
    // Both prompts in one right-padded batch: routing groups tokens of both rows together.
    let lengths: Vec<i64> = prompts.iter().map(|p| p.size()[0]).collect();
    let s = *lengths.iter().max().unwrap();
    let ids = Tensor::stack(&prompts.iter().map(|p| p.constant_pad_nd([0, s - p.size()[0]])).collect::<Vec<_>>(), 0);
    let states = target.capture(&ids, &lengths).unwrap();
    let logits = target.logits(&ids, &lengths).unwrap();
    let routes = target.expert_choices(&ids, &lengths).unwrap();
    let h = cfg.hidden_size as i64;
    for (p, &len) in lengths.iter().enumerate() {
        let hf_states = &want[&format!("p{p}.hidden_states")];
        for (j, &layer) in taps.iter().enumerate() {
            let mine = states.get(p as i64).narrow(0, 0, len).narrow(1, j as i64 * h, h);
            let err = rel_err(&mine, &hf_states.get(layer as i64 + 1));
            assert!(err < 1e-5, "prompt {p}, layer {layer}: relative error {err}");
        }
        let err = rel_err(&logits.get(p as i64).narrow(0, 0, len), &want[&format!("p{p}.logits")]);
        assert!(err < 1e-5, "prompt {p} logits: relative error {err}");
        for (route, layer) in routes.iter().zip(&sparse) {
            let mine = route.narrow(0, p as i64 * s, len);
            let theirs = &want[&format!("p{p}.experts.{layer}")];
            assert!(mine.equal(theirs), "prompt {p}, layer {layer}: experts {mine} vs transformers' {theirs}");
        }
    }
}

/// The same model decodes one token at a time with its cache as it runs whole sequences (the path `eval --decode`
/// and the in-training evaluation take, where a sparse layer sees one token).
#[test]
fn qwen3_moe_decodes_token_by_token_as_transformers_runs_the_sequence() {
    let target = Target::load(fixture(), &[1, 3], Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let want = expected();
    let ids = want["p0.input_ids"].unsqueeze(0);
    let len = ids.size()[1];
    let mut cache = target.new_cache(len).unwrap();
    let first = target.decode(&ids.narrow(1, 0, 5), &mut cache).unwrap();
    let mut logits = vec![first.logits];
    for t in 5..len {
        logits.push(target.decode(&ids.narrow(1, t, 1), &mut cache).unwrap().logits);
    }
    let err = rel_err(&Tensor::cat(&logits, 1).squeeze_dim(0), &want["p0.logits"]);
    assert!(err < 1e-5, "relative error {err}");
}
