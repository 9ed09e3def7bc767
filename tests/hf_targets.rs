//! Targets against HuggingFace transformers itself: `tests/fixtures/hf-qwen3-moe/` and `tests/fixtures/hf-gpt-oss/`
//! are tiny models that transformers 5.19 made, saved (`save_pretrained`, in its own config.json spelling) and ran
//! with eager attention and its eager loop over experts (`scripts/fixtures/make_hf_target_fixture.py` says how; routing
//! margins at least 2e-3). dflash loads each folder and must route every token to the same experts and reproduce
//! every layer's hidden states and the logits; `hf-gpt-oss/mxfp4/` is the same GPT-OSS with its experts stored as
//! the published folders store them (MXFP4 blocks and scales).
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use dflash::model::{Depth, Target};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn expected(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture(name).join("expected.safetensors")).unwrap().into_iter().collect()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
}

/// Loads `folder` and compares, for both prompts in one right-padded batch (routing groups the tokens of both rows
/// together), the states of `taps` (HF's last `hidden_states` entry is after the final norm: the logits check the
/// last layer), the logits and every sparse layer's expert choices with what transformers computed (`reference`).
fn captures_as_transformers_computes(folder: &Path, reference: &str, taps: &[usize], sparse: &[usize]) {
    let target = Target::load(folder, taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let cfg = target.config().clone();
    let found: Vec<usize> = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_sparse(l)).collect();
    assert_eq!(found, sparse);
    let want = expected(reference);
    let prompts: Vec<Tensor> = (0..2).map(|p| want[&format!("p{p}.input_ids")].shallow_clone()).collect();
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
            assert!(err < 1e-5, "{}: prompt {p}, layer {layer}: relative error {err}", folder.display());
        }
        let err = rel_err(&logits.get(p as i64).narrow(0, 0, len), &want[&format!("p{p}.logits")]);
        assert!(err < 1e-5, "{}: prompt {p} logits: relative error {err}", folder.display());
        for (route, layer) in routes.iter().zip(sparse) {
            let mine = route.narrow(0, p as i64 * s, len);
            let theirs = &want[&format!("p{p}.experts.{layer}")];
            assert!(mine.equal(theirs), "prompt {p}, layer {layer}: experts {mine} vs transformers' {theirs}");
        }
    }
}

/// Decodes prompt 0 with the cache (a prefill of 5, then one token at a time: the path of `eval --decode` and the
/// in-training evaluation, where a sparse layer sees one token and a sliding window moves through the cache) and
/// compares the logits with transformers' whole-sequence run.
fn decodes_as_transformers_runs_the_sequence(folder: &Path, reference: &str, taps: &[usize]) {
    let target = Target::load(folder, taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let want = expected(reference);
    let ids = want["p0.input_ids"].unsqueeze(0);
    let len = ids.size()[1];
    let mut cache = target.new_cache(len).unwrap();
    let first = target.decode(&ids.narrow(1, 0, 5), &mut cache).unwrap();
    let mut logits = vec![first.logits];
    for t in 5..len {
        logits.push(target.decode(&ids.narrow(1, t, 1), &mut cache).unwrap().logits);
    }
    let err = rel_err(&Tensor::cat(&logits, 1).squeeze_dim(0), &want["p0.logits"]);
    assert!(err < 1e-5, "{}: relative error {err}", folder.display());
}

#[test]
fn qwen3_moe_captures_as_transformers_computes_it() {
    let target = Target::load(&fixture("hf-qwen3-moe"), &[0], Depth::Full, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(target.config().moe.as_ref().map(|m| m.num_experts), Some(6), "transformers 5 writes num_local_experts");
    captures_as_transformers_computes(&fixture("hf-qwen3-moe"), "hf-qwen3-moe", &[0, 1, 2], &[0, 2, 3]);
}

#[test]
fn qwen3_moe_decodes_token_by_token_as_transformers_runs_the_sequence() {
    decodes_as_transformers_runs_the_sequence(&fixture("hf-qwen3-moe"), "hf-qwen3-moe", &[1, 3]);
}

/// GPT-OSS: attention biases and sinks, a window of 4 on layers 0 and 2 (the prompts are 13 and 7 tokens), YaRN,
/// top-k-then-softmax routing, clamped SwiGLU experts with biases; from bf16 weights and from MXFP4 experts.
#[test]
fn gpt_oss_captures_as_transformers_computes_it_from_bf16_and_from_mxfp4() {
    let folder = fixture("hf-gpt-oss");
    captures_as_transformers_computes(&folder, "hf-gpt-oss", &[0, 1], &[0, 1, 2]);
    captures_as_transformers_computes(&folder.join("mxfp4"), "hf-gpt-oss", &[0, 1], &[0, 1, 2]);
}

#[test]
fn gpt_oss_decodes_token_by_token_as_transformers_runs_the_sequence() {
    decodes_as_transformers_runs_the_sequence(&fixture("hf-gpt-oss").join("mxfp4"), "hf-gpt-oss", &[0, 2]);
}
