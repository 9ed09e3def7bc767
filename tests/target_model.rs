//! The target model through its public interface: hidden-state capture, logits and (for a mixture of experts) the
//! experts each token is routed to, against an independent naive decoder (padded batches included), loading HuggingFace folders (single file and sharded), and every bad-input
//! case producing an error that names the file or key.
mod reference_models;

use dflash::model::config::{GptOssConfig, RopeScaling};
use dflash::model::{Architecture, Depth, Init, ModelError, PartFault, Preset, Target, TargetConfig};
use reference_models::*;
use tch::{Device, Kind, Tensor};

const TAPS: [usize; 2] = [0, 2];

/// Loads `cfg` + `weights` through a folder and checks capture and logits against the naive decoder, on a
/// right-padded batch of rows of different lengths (including a row of one token).
fn check_against_naive(cfg: &TargetConfig, seed: i64) {
    let weights = random_weights(cfg, seed);
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), cfg, &weights, usize::MAX);
    let full = Target::load(dir.path(), &TAPS, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let capture = Target::load(dir.path(), &TAPS, Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(capture.layers_run(), 3, "capture stops at the last tapped layer");
    assert_eq!(full.layers_run(), cfg.num_hidden_layers);

    let rows = token_rows(cfg.vocab_size as i64, &[11, 7, 1, 11], seed as u64);
    let (ids, lengths) = pad_batch(&rows);
    let states = capture.capture(&ids, &lengths).unwrap();
    let logits = full.logits(&ids, &lengths).unwrap();
    let routes = full.expert_choices(&ids, &lengths).unwrap();
    let sparse_layers = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_sparse(l)).count();
    assert_eq!(routes.len(), sparse_layers);
    let h = cfg.hidden_size as i64;
    assert_eq!(states.size(), vec![4, 11, TAPS.len() as i64 * h]);
    for (b, row) in rows.iter().enumerate() {
        let reference = naive_forward(cfg, &weights, row);
        let len = row.len() as i64;
        let mine = states.get(b as i64).narrow(0, 0, len);
        for (j, &tap) in TAPS.iter().enumerate() {
            let err = rel_err(&mine.narrow(1, j as i64 * h, h), &reference.layer_outputs[tap]);
            assert!(err < 1e-5, "row {b} tap {tap}: relative error {err}");
        }
        let err = rel_err(&logits.get(b as i64).narrow(0, 0, len), &reference.logits);
        assert!(err < 1e-5, "row {b} logits: relative error {err}");
        // Routing: the reference's choices are far from ties, and dflash makes exactly the same ones.
        if cfg.moe.is_some() {
            assert!(reference.routing_margin > 1e-4, "row {b}: routing margin {}", reference.routing_margin);
        }
        for (layer, (mine, theirs)) in routes.iter().zip(&reference.experts).enumerate() {
            let s = ids.size()[1];
            let mine: Vec<Vec<i64>> = (0..len).map(|t| Vec::try_from(&mine.get(b as i64 * s + t)).unwrap()).collect();
            assert_eq!(&mine, theirs, "row {b}, sparse layer {layer}: expert choices");
        }
        if len < 11 {
            let pad = states.get(b as i64).narrow(0, len, 11 - len);
            assert_eq!(pad.abs().max().double_value(&[]), 0.0, "padded positions are zeroed");
        }
    }
}

#[test]
fn qwen3_matches_the_naive_decoder_on_padded_batches() {
    check_against_naive(&small_config(Architecture::Qwen3, false, RopeScaling::None), 1);
}

#[test]
fn llama_with_llama3_rope_scaling_matches_the_naive_decoder() {
    check_against_naive(&small_config(Architecture::Llama, false, llama3_scaling()), 2);
}

#[test]
fn tied_lm_head_matches_the_naive_decoder() {
    check_against_naive(&small_config(Architecture::Qwen3, true, RopeScaling::None), 3);
}

#[test]
fn qwen3_moe_matches_the_naive_decoder_with_the_same_expert_choices() {
    check_against_naive(&small_moe_config(), 5);
}

#[test]
fn gpt_oss_matches_the_naive_decoder_with_the_same_expert_choices() {
    check_against_naive(&small_gpt_oss_config(), 11);
}

/// Every GPT-OSS piece changes the reference's output, so the match above checks each: the sliding window, the
/// sinks, the SwiGLU clamp and YaRN.
#[test]
fn the_naive_gpt_oss_reference_depends_on_each_piece() {
    let cfg = small_gpt_oss_config();
    let w = random_weights(&cfg, 12);
    let row = &token_rows(cfg.vocab_size as i64, &[11], 12)[0];
    let base = naive_forward(&cfg, &w, row).logits;
    let oss = cfg.gpt_oss.clone().unwrap();
    let variants = [
        (
            "no window",
            TargetConfig {
                gpt_oss: Some(GptOssConfig { sliding_layers: vec![false; 4], ..oss.clone() }),
                ..cfg.clone()
            },
        ),
        ("no clamp", TargetConfig { gpt_oss: Some(GptOssConfig { swiglu_limit: 1e9, ..oss.clone() }), ..cfg.clone() }),
        ("no YaRN", TargetConfig { rope_scaling: RopeScaling::None, ..cfg.clone() }),
    ];
    for (what, other) in variants {
        assert!(rel_err(&naive_forward(&other, &w, row).logits, &base) > 1e-3, "{what} changes nothing");
    }
    let mut no_sinks: Weights = w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect();
    for l in 0..4 {
        no_sinks
            .insert(format!("model.layers.{l}.self_attn.sinks"), Tensor::full([4], -1e9, (Kind::Float, Device::Cpu)));
    }
    assert!(rel_err(&naive_forward(&cfg, &no_sinks, row).logits, &base) > 1e-3, "the sinks change nothing");
}

/// The sparse layers are not vacuous: with each token sent to its experts, changing one expert's weights or the
/// renormalisation changes the output.
#[test]
fn the_naive_moe_reference_depends_on_routing() {
    let cfg = small_moe_config();
    let w = random_weights(&cfg, 6);
    let row = &token_rows(cfg.vocab_size as i64, &[9], 6)[0];
    let run = naive_forward(&cfg, &w, row);
    assert_eq!(run.experts.len(), 3, "layers 0, 2 and 3 are sparse; 1 is dense");
    let chosen: std::collections::BTreeSet<i64> = run.experts.iter().flatten().flatten().copied().collect();
    assert!(chosen.len() >= 4, "tokens spread over the experts: {chosen:?}");
    let plain = TargetConfig {
        moe: cfg.moe.clone().map(|m| dflash::model::config::MoeConfig { norm_topk_prob: false, ..m }),
        ..cfg.clone()
    };
    assert!(rel_err(&naive_forward(&plain, &w, row).logits, &run.logits) > 0.01);
    let mut other: Weights = w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect();
    let used = run.experts[0][0][0];
    other.insert(
        format!("model.layers.0.mlp.experts.{used}.up_proj.weight"),
        w["model.layers.0.mlp.experts.0.up_proj.weight"].zeros_like(),
    );
    assert!(rel_err(&naive_forward(&cfg, &other, row).layer_outputs[0], &run.layer_outputs[0]) > 0.01);
}

#[test]
fn the_naive_check_would_catch_a_wrong_tap_or_missing_qk_norm() {
    // Guard against a vacuous reference: neighbouring layers and the two architectures must differ clearly.
    let cfg = small_config(Architecture::Qwen3, false, RopeScaling::None);
    let w = random_weights(&cfg, 4);
    let row = &token_rows(cfg.vocab_size as i64, &[9], 4)[0];
    let qwen = naive_forward(&cfg, &w, row);
    assert!(rel_err(&qwen.layer_outputs[1], &qwen.layer_outputs[0].to_kind(Kind::Double)) > 0.1);
    let as_llama = TargetConfig { architecture: Architecture::Llama, ..cfg.clone() };
    let llama = naive_forward(&as_llama, &w, row);
    assert!(rel_err(&llama.logits, &qwen.logits) > 0.01);
}

#[test]
fn a_sharded_folder_round_trips_with_identical_outputs() {
    let spec = Preset::Tiny.spec();
    let target = spec.build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let dir = tempfile::tempdir().unwrap();
    target.save_hf(dir.path(), 200_000).unwrap();
    let shards = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("model-"))
        .count();
    assert!(shards > 1, "expected several shards, got {shards}");
    assert!(dir.path().join("model.safetensors.index.json").exists());
    let loaded = Target::load(dir.path(), &spec.taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(loaded.config(), target.config());
    let (ids, lengths) = pad_batch(&token_rows(spec.target.vocab_size as i64, &[20, 13], 9));
    let a = target.capture(&ids, &lengths).unwrap();
    let b = loaded.capture(&ids, &lengths).unwrap();
    assert!(a.equal(&b), "capture differs after the round trip");
    assert!(target.logits(&ids, &lengths).unwrap().equal(&loaded.logits(&ids, &lengths).unwrap()));
}

#[test]
fn the_tiny_preset_is_the_same_model_every_time() {
    let build = || {
        let spec = Preset::Tiny.spec();
        spec.build_target(Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap()
    };
    let (a, b) = (build(), build());
    assert!(a.embed_tokens().equal(b.embed_tokens()));
    // A fixed value pins the portable generator: a change of RNG or init would change every tiny run.
    let first: f32 = a.embed_tokens().double_value(&[0, 0]) as f32;
    let again: f32 = b.embed_tokens().double_value(&[0, 0]) as f32;
    assert_eq!(first, again);
    assert!(first != 0.0 && first.abs() < 0.2);
}

/// Packed rows: each conversation's tapped and last states are those it has alone in a row (its positions from 0, its
/// tokens seeing only its own), for Qwen3 and for Llama-3's scaled rope; padding after the conversations is zero.
/// A target with attention sinks refuses them.
#[test]
fn packed_conversations_capture_what_each_captures_alone() {
    for cfg in [
        small_config(Architecture::Qwen3, false, RopeScaling::None),
        small_config(Architecture::Llama, true, llama3_scaling()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_folder(dir.path(), &cfg, &random_weights(&cfg, 7), usize::MAX);
        let t = Target::load(dir.path(), &TAPS, Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let convs = token_rows(cfg.vocab_size as i64, &[9, 1, 14, 6], 3);
        // Row 0: conversations 0, 1 and 2, then padding; row 1: conversation 3 alone, padded to the same length.
        let rows = [[convs[0].clone(), convs[1].clone(), convs[2].clone()].concat(), convs[3].clone()];
        let (ids, _) = pad_batch(&rows);
        let (taps, last) = t.capture_packed(&ids, &[vec![9, 1, 14], vec![6]], true).unwrap();
        let last = last.unwrap();
        let mut at = [(0i64, 0i64), (0, 9), (0, 10), (1, 0)].into_iter();
        for conv in [&convs[0], &convs[1], &convs[2], &convs[3]] {
            let (row, start) = at.next().unwrap();
            let len = conv.len() as i64;
            let (alone_ids, lengths) = pad_batch(std::slice::from_ref(conv));
            let (alone, alone_last) = t.capture_with_last(&alone_ids, &lengths).unwrap();
            let packed = taps.get(row).narrow(0, start, len);
            assert!(
                rel_err(&packed, &alone.get(0).to_kind(Kind::Double)) < 1e-5,
                "{:?}: taps of row {row} at {start}",
                cfg.architecture
            );
            let packed_last = last.get(row).narrow(0, start, len);
            assert!(
                rel_err(&packed_last, &alone_last.get(0).to_kind(Kind::Double)) < 1e-5,
                "last states of row {row} at {start}"
            );
        }
        assert_eq!(taps.get(1).narrow(0, 6, 18).abs().max().double_value(&[]), 0.0, "padding is zero");
    }
    let spec = Preset::TinyGptOss.spec();
    let sinks = spec.build_target(Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap();
    let ids = Tensor::zeros([1, 4], (Kind::Int64, Device::Cpu));
    let err = sinks.capture_packed(&ids, &[vec![2, 2]], false).unwrap_err().to_string();
    assert!(err.contains("sinks"), "{err}");
}

#[test]
fn capture_rejects_bad_batches() {
    let cfg = small_config(Architecture::Qwen3, false, RopeScaling::None);
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), &cfg, &random_weights(&cfg, 5), usize::MAX);
    let t = Target::load(dir.path(), &TAPS, Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap();
    let ids = Tensor::zeros([2, 5], (Kind::Int64, Device::Cpu));
    for (lengths, expected) in [(&[5i64][..], "lengths"), (&[5, 6], "lengths"), (&[0, 5], "lengths")] {
        let err = t.capture(&ids, lengths).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    let err = t.capture(&ids.to_kind(Kind::Float), &[5, 5]).unwrap_err().to_string();
    assert!(err.contains("int64"), "{err}");
    let err = t.logits(&ids, &[5, 5]).unwrap_err();
    assert!(matches!(err, ModelError::NotFull), "{err}");
}

// ---------------------------------------------------------------- bad input: each error names what is wrong

fn good_folder() -> (tempfile::TempDir, TargetConfig) {
    let cfg = small_config(Architecture::Qwen3, false, RopeScaling::None);
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), &cfg, &random_weights(&cfg, 6), 60_000);
    (dir, cfg)
}

fn load_err(dir: &std::path::Path, taps: &[usize]) -> String {
    match Target::load(dir, taps, Depth::Full, Device::Cpu, Kind::Float) {
        Ok(_) => panic!("expected an error loading {}", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn shards(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("model-"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_folder_without_weights_says_so() {
    let (dir, _) = good_folder();
    for shard in shards(dir.path()) {
        std::fs::remove_file(shard).unwrap();
    }
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("no model.safetensors") && err.contains(&dir.path().display().to_string()), "{err}");
}

#[test]
fn a_missing_config_is_named() {
    let (dir, _) = good_folder();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn a_truncated_shard_is_named() {
    let (dir, _) = good_folder();
    let shard = &shards(dir.path())[1];
    let bytes = std::fs::read(shard).unwrap();
    std::fs::write(shard, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains(&shard.display().to_string()) && err.contains("truncated"), "{err}");
}

#[test]
fn a_shard_missing_from_disk_is_named() {
    let (dir, _) = good_folder();
    let shard = &shards(dir.path())[0];
    std::fs::remove_file(shard).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains(&shard.display().to_string()), "{err}");
}

#[test]
fn a_missing_tensor_is_named() {
    let cfg = small_config(Architecture::Qwen3, false, RopeScaling::None);
    let mut w = random_weights(&cfg, 7);
    w.remove("model.layers.1.mlp.up_proj.weight");
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), &cfg, &w, usize::MAX);
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing"), "{err}");
}

#[test]
fn a_shape_that_disagrees_with_config_json_is_named() {
    let (dir, cfg) = good_folder();
    let wrong = TargetConfig { intermediate_size: 96, ..cfg };
    std::fs::write(dir.path().join("config.json"), wrong.to_hf_json("float32").to_string()).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("mlp.gate_proj.weight") && err.contains("intermediate_size=96"), "{err}");
    assert!(err.contains("[80, 48]") && err.contains("[96, 48]"), "{err}");
}

/// A Qwen3-MoE folder whose config disagrees with its expert tensors names the key; one missing an expert names it.
#[test]
fn a_moe_folder_that_disagrees_with_its_config_is_named() {
    let cfg = small_moe_config();
    let mut weights = random_weights(&cfg, 10);
    let dir = tempfile::tempdir().unwrap();
    let wider = TargetConfig {
        moe: cfg.moe.clone().map(|m| dflash::model::config::MoeConfig { moe_intermediate_size: 32, ..m }),
        ..cfg.clone()
    };
    write_folder(dir.path(), &wider, &weights, usize::MAX);
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("mlp.experts.0.gate_proj.weight") && err.contains("moe_intermediate_size=32"), "{err}");
    weights.remove("model.layers.2.mlp.experts.5.down_proj.weight");
    write_folder(dir.path(), &cfg, &weights, usize::MAX);
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("model.layers.2.mlp.experts.5.down_proj.weight") && err.contains("missing"), "{err}");
}

#[test]
fn an_unsupported_architecture_is_named() {
    let (dir, cfg) = good_folder();
    let mut json = cfg.to_hf_json("float32");
    json["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
    let err = load_err(dir.path(), &TAPS);
    assert!(err.contains("config.json") && err.contains("MixtralForCausalLM"), "{err}");
}

#[test]
fn taps_outside_the_model_are_named() {
    let (dir, _) = good_folder();
    let err = load_err(dir.path(), &[1, 4]);
    assert!(err.contains("layer id 4") && err.contains("4 layers"), "{err}");
    let err = load_err(dir.path(), &[2, 1]);
    assert!(err.contains("increasing"), "{err}");
}

#[test]
#[ignore = "needs a GPU"]
fn on_a_gpu_capture_and_logits_match_the_cpu() {
    dflash::device::gpu_for_tests();
    for arch in [Architecture::Qwen3, Architecture::Llama] {
        let cfg = small_config(arch, false, llama3_scaling());
        let dir = tempfile::tempdir().unwrap();
        write_folder(dir.path(), &cfg, &random_weights(&cfg, 8), usize::MAX);
        let load = |device, kind| Target::load(dir.path(), &TAPS, Depth::Full, device, kind).unwrap();
        let cpu = load(Device::Cpu, Kind::Float);
        let (ids, lengths) = pad_batch(&token_rows(cfg.vocab_size as i64, &[64, 40, 3], 8));
        let reference = cpu.capture(&ids, &lengths).unwrap().to_kind(Kind::Double);
        let reference_logits = cpu.logits(&ids, &lengths).unwrap().to_kind(Kind::Double);
        for (kind, tolerance) in [(Kind::Float, 1e-4), (Kind::BFloat16, 5e-2)] {
            let gpu = load(Device::Cuda(0), kind);
            let ids = ids.to_device(Device::Cuda(0));
            let states = gpu.capture(&ids, &lengths).unwrap().to_device(Device::Cpu);
            let logits = gpu.logits(&ids, &lengths).unwrap().to_device(Device::Cpu);
            let err = rel_err(&states, &reference);
            assert!(err < tolerance, "{arch:?} {kind:?} capture: relative error {err}");
            let err = rel_err(&logits, &reference_logits);
            assert!(err < tolerance, "{arch:?} {kind:?} logits: relative error {err}");
        }
    }
}

/// The grouped expert GEMMs (and GPT-OSS's sink attention) on the GPU: in f32 the same experts and states as the
/// CPU; in bf16 (router logits rounded, so a token near a tie may pick another expert, which moves its state a lot)
/// nearly all choices agree and the states agree on average (within 3%: GPT-OSS routes on raw logits, two of six
/// experts, so a bf16 flip moves more).
#[test]
#[ignore = "needs a GPU"]
fn on_a_gpu_moe_capture_matches_the_cpu() {
    dflash::device::gpu_for_tests();
    for cfg in [small_moe_config(), small_gpt_oss_config()] {
        moe_on_the_gpu_matches_the_cpu(&cfg);
    }
}

fn moe_on_the_gpu_matches_the_cpu(cfg: &TargetConfig) {
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), cfg, &random_weights(cfg, 9), usize::MAX);
    let load = |device, kind| Target::load(dir.path(), &TAPS, Depth::Full, device, kind).unwrap();
    let cpu = load(Device::Cpu, Kind::Float);
    let (ids, lengths) = pad_batch(&token_rows(cfg.vocab_size as i64, &[64, 40, 3], 9));
    let reference = cpu.capture(&ids, &lengths).unwrap().to_kind(Kind::Double);
    let reference_routes = cpu.expert_choices(&ids, &lengths).unwrap();
    let mean_rel_err = |a: &Tensor| {
        let diff = (a.to_kind(Kind::Double) - &reference).abs().mean(Kind::Double);
        (diff / reference.abs().mean(Kind::Double)).double_value(&[])
    };
    for (kind, tolerance, min_agreement) in [(Kind::Float, 1e-4, 1.0), (Kind::BFloat16, 3e-2, 0.9)] {
        let gpu = load(Device::Cuda(0), kind);
        let ids = ids.to_device(Device::Cuda(0));
        let states = gpu.capture(&ids, &lengths).unwrap().to_device(Device::Cpu);
        let err = if kind == Kind::Float { rel_err(&states, &reference) } else { mean_rel_err(&states) };
        assert!(err < tolerance, "{:?} {kind:?} capture: relative error {err}", cfg.architecture);
        let routes = gpu.expert_choices(&ids, &lengths).unwrap();
        for (mine, theirs) in routes.iter().zip(&reference_routes) {
            let same = mine.to_device(Device::Cpu).eq_tensor(theirs).to_kind(Kind::Float).mean(Kind::Float);
            let same = same.double_value(&[]);
            assert!(same >= min_agreement, "{:?} {kind:?}: {same} of the expert choices agree", cfg.architecture);
        }
    }
}

/// A target spread over several devices (layers split into runs, the hidden state hopping between them) computes what
/// the unsplit one does: capture, logits and cached decoding, for a dense, a Qwen3-MoE and a GPT-OSS target. Here
/// the two "devices" are both the CPU; `on_a_gpu_a_target_spread_over_gpu_and_cpu_matches` crosses a real boundary.
#[test]
fn a_target_spread_over_two_devices_computes_what_the_unsplit_one_does() {
    for cfg in [small_config(Architecture::Qwen3, false, RopeScaling::None), small_moe_config(), small_gpt_oss_config()]
    {
        spread_matches(&cfg, &[Device::Cpu, Device::Cpu], 0.0);
    }
    spread_matches(&small_config(Architecture::Llama, false, llama3_scaling()), &[Device::Cpu; 3], 0.0);
}

/// Fault injection aimed at one part of a spread target: the pass panics where the hidden state enters that part,
/// naming it; the switch then disarms, one pending fault at a time.
#[test]
fn a_fault_armed_for_one_part_strikes_that_part_once() {
    let cfg = small_moe_config();
    let mut target = Target::random_spread(
        cfg.clone(),
        &TAPS,
        Depth::ToLastTap,
        &[Device::Cpu, Device::Cpu],
        Kind::Float,
        Init::Portable(3),
        0.02,
    )
    .unwrap();
    let fault = std::sync::Arc::new(PartFault::default());
    target.watch_faults(fault.clone());
    let (ids, lengths) = pad_batch(&token_rows(cfg.vocab_size as i64, &[5, 3], 2));
    for part in [1, 0] {
        assert!(fault.arm(part));
        assert!(!fault.arm(0), "one pending fault at a time");
        let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target.capture(&ids, &lengths)));
        let message = hit.err().and_then(|p| p.downcast_ref::<String>().cloned()).expect("the capture panicked");
        assert!(message.contains(&format!("part {part} (cpu)")), "{message}");
        let _states = target.capture(&ids, &lengths).expect("the fault struck once");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn on_a_gpu_a_target_spread_over_gpu_and_cpu_matches() {
    dflash::device::gpu_for_tests();
    for cfg in [small_config(Architecture::Llama, false, llama3_scaling()), small_moe_config(), small_gpt_oss_config()]
    {
        spread_matches(&cfg, &[Device::Cuda(0), Device::Cpu], 1e-4);
    }
}

fn spread_matches(cfg: &TargetConfig, devices: &[Device], tolerance: f64) {
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), cfg, &random_weights(cfg, 14), usize::MAX);
    let whole = Target::load(dir.path(), &TAPS, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let mut spread = Target::load_spread(dir.path(), &TAPS, Depth::Full, devices, Kind::Float).unwrap();
    let placed = spread.layer_devices();
    assert_eq!(placed.first(), devices.first());
    assert_eq!(placed.last(), devices.last());
    assert_eq!(spread.parts(), devices.len(), "{:?}: every device holds layers", cfg.architecture);
    let (ids, lengths) = pad_batch(&token_rows(cfg.vocab_size as i64, &[11, 7, 1], 14));
    let first = devices[0];
    let check_within = |a: &Tensor, b: &Tensor, what: &str, tolerance: f64| {
        let err = rel_err(&a.to_device(Device::Cpu), &b.to_kind(Kind::Double));
        assert!(err <= tolerance, "{:?} {what}: relative error {err}", cfg.architecture);
    };
    let check = |a: &Tensor, b: &Tensor, what: &str| check_within(a, b, what, tolerance);
    let ids_there = ids.to_device(first);
    let whole_states = whole.capture(&ids, &lengths).unwrap();
    // One micro-batch, uneven ones (2 + 1 rows), one per row, and the default. Matrix products over fewer rows may
    // round differently (f32: ~2e-7).
    for micro_batches in [1, 2, 3, 0] {
        spread.set_micro_batches(micro_batches);
        let states = spread.capture(&ids_there, &lengths).unwrap();
        let within = if micro_batches == 1 { tolerance } else { tolerance.max(1e-6) };
        check_within(&states, &whole_states, &format!("capture in {micro_batches} micro-batches"), within);
    }
    check(&spread.logits(&ids_there, &lengths).unwrap(), &whole.logits(&ids, &lengths).unwrap(), "logits");
    let row = ids.narrow(0, 0, 1);
    let (mut a, mut b) = (spread.new_cache(16).unwrap(), whole.new_cache(16).unwrap());
    for (start, len) in [(0, 6), (6, 1), (7, 4)] {
        let mine = spread.decode(&row.narrow(1, start, len).to_device(first), &mut a).unwrap();
        let theirs = whole.decode(&row.narrow(1, start, len), &mut b).unwrap();
        check(&mine.logits, &theirs.logits, "decoded logits");
        check(&mine.taps, &theirs.taps, "decoded taps");
    }
}
