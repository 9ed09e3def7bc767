//! The `dflash` binary as users meet it: help texts, subcommands not yet available, configuration errors, and a
//! real benchmark run on the tiny preset.
use std::process::{Command, Output};

use serde_json::json;

fn dflash(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .env_remove("RUST_LOG")
        .env("DFLASH__LOG__LEVEL", "warn")
        .output()
        .expect("run dflash")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_subcommand_explains_itself() {
    let top = dflash(&["--help"]);
    assert!(top.status.success());
    let help = text(&top.stdout);
    for sub in
        ["serve-train", "prepare", "regenerate", "synthesize", "eval", "export", "inspect-run", "bench", "completions"]
    {
        assert!(help.contains(sub), "{sub} missing from --help");
        let out = dflash(&[sub, "--help"]);
        assert!(out.status.success(), "{sub} --help failed");
        assert!(text(&out.stdout).lines().count() > 3, "{sub} --help says too little");
    }
    assert!(help.contains("DFLASH__SECTION__KEY") && help.contains("Exit status"));
    let bench = text(&dflash(&["bench", "--help"]).stdout);
    assert!(bench.contains("FLOPs counted") && bench.contains("--peak-tflops"), "{bench}");
}

/// `--version` says which commit and libtorch the build has and what it finds on this machine; `-V` stays one line.
#[test]
fn the_version_says_commit_libtorch_cuda_and_nvrtc() {
    let long = text(&dflash(&["--version"]).stdout);
    let lines: Vec<&str> = long.lines().collect();
    assert!(lines[0].starts_with("dflash 0."), "{long}");
    // `make test` passes the commit in (to the binary and to this test alike); plain `cargo test` does not.
    match option_env!("DFLASH_COMMIT").filter(|c| !c.is_empty()) {
        Some(commit) => assert_eq!(lines[1], format!("commit {commit}"), "{long}"),
        None => assert!(lines[1].starts_with("commit unknown (built without make"), "{long}"),
    }
    assert!(lines[2].starts_with("libtorch 2.11.0"), "{long}");
    assert!(lines[3].starts_with("CUDA: ") && lines[4].starts_with("NVRTC: "), "{long}");
    assert_eq!(text(&dflash(&["-V"]).stdout).lines().count(), 1);
}

/// `dflash completions SHELL` writes a completion script that knows the subcommands and their flags.
#[test]
fn completions_know_the_subcommands() {
    for (shell, marker) in [("bash", "complete -F"), ("zsh", "#compdef dflash"), ("fish", "complete -c dflash")] {
        let out = dflash(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        for word in ["serve-train", "synthesize", "inspect-run", "max-new-tokens"] {
            assert!(script.contains(word), "{shell} completes {word}");
        }
    }
    assert_eq!(dflash(&["completions", "tcsh"]).status.code(), Some(2), "an unknown shell is a usage error");
}

/// A subcommand a newcomer guesses is answered with the one meant, even where spelling distance misses it.
#[test]
fn a_guessed_subcommand_gets_the_one_meant() {
    for (typed, meant) in [("train", "serve-train"), ("evaluate", "eval"), ("exprot", "export")] {
        let o = dflash(&[typed]);
        assert_eq!(o.status.code(), Some(2), "a bad command line");
        let said = text(&o.stderr);
        assert!(said.contains(&format!("a similar subcommand exists: '{meant}'")), "{typed}: {said}");
    }
}

#[test]
fn configuration_errors_name_the_key() {
    let out = dflash(&["--set", "target.device=gpu", "bench", "--what", "target"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("target.device") && err.contains("gpu"), "{err}");
    let out = dflash(&["--set", "target.devcie=cpu", "bench", "--what", "target"]);
    assert!(text(&out.stderr).contains("devcie"));
    // A count is a whole number: 4.5 rows a batch is refused, not rounded.
    let out = dflash(&["--set", "data.batch_size=4.5", "serve-train"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("data.batch_size") && err.contains("4.5"), "{err}");
    // A malformed override is a bad command line: exit 2, as for any other (README, --help).
    let out = dflash(&["--set", "noequals", "serve-train"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("section.key=value"));
}

#[test]
fn asking_for_a_gpu_that_is_not_there_is_one_clear_error() {
    if tch::Cuda::is_available() {
        return; // this machine has a GPU; the CPU-only message cannot appear
    }
    let out = dflash(&["bench", "--what", "target", "--device", "cuda:0", "--batch", "1", "--seq", "8"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cuda:0") && err.contains("CUDA is not available"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn bench_runs_the_tiny_target_and_prints_json() {
    let out = dflash(&[
        "bench", "--what", "target", "--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps",
        "2", "--warmup", "1", "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in
        ["what", "preset", "device", "batch", "seq", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes", "step_ms_p50"]
    {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["what"], "target");
    assert_eq!(report["layers_run"], 6, "capture stops after tap 5");
    assert!(report["tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// A model folder's taps follow z-lab's rule unless given (the tiny target's 8 layers and 5 draft layers: [1, 2, 3,
/// 4, 5], so capture runs 6 layers); a folder without a config.json says so.
#[test]
fn a_model_folder_taps_by_the_rule_and_an_empty_one_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    tiny_target_folder(&model);
    let args = ["bench", "--what", "target", "--model", model.to_str().unwrap(), "--device", "cpu"];
    let out = dflash(&[&args[..], &["--batch", "1", "--seq", "16", "--steps", "1", "--json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(report["layers_run"], 6, "taps [1, 2, 3, 4, 5]: {report}");
    let out = dflash(&[
        "bench",
        "--what",
        "target",
        "--model",
        dir.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--taps",
        "1,2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("config.json"), "{err}");
}

/// The tiny preset saved as a HuggingFace model folder (weights and config.json).
fn tiny_target_folder(dir: &std::path::Path) {
    preset_target_folder(dflash::model::Preset::Tiny, dir);
}

fn preset_target_folder(preset: dflash::model::Preset, dir: &std::path::Path) {
    use dflash::model::Depth;
    use tch::{Device, Kind};
    preset.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap().save_hf(dir, usize::MAX).unwrap();
}

/// A tiny target folder, a drafter for it, and token rows: `dflash eval` scores them.
#[test]
fn eval_scores_a_drafter_on_token_rows() {
    use dflash::model::{Drafter, DrafterConfig, Init, Preset};
    use tch::{Device, Kind};
    let dir = tempfile::tempdir().unwrap();
    let (target_dir, drafter_dir, data) = (dir.path().join("t"), dir.path().join("d"), dir.path().join("rows.jsonl"));
    tiny_target_folder(&target_dir);
    let cfg = DrafterConfig::for_preset(Preset::Tiny, 16);
    Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(1)).unwrap().save(&drafter_dir, Kind::BFloat16).unwrap();
    let row = |n: usize| {
        let ids: Vec<i64> = (0..n as i64).map(|t| t % 200).collect();
        let mask: Vec<u8> = (0..n).map(|t| u8::from(t >= 3)).collect();
        serde_json::json!({"input_ids": ids, "loss_mask": mask}).to_string()
    };
    std::fs::write(&data, format!("{}\n{}\n", row(40), row(25))).unwrap();
    let args = [
        "eval",
        "--target",
        target_dir.to_str().unwrap(),
        "--drafter",
        drafter_dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--device",
        "cpu",
        "--json",
    ];
    let out = dflash(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["blocks"], 36.0 + 21.0, "every valid anchor: {report}");
    assert_eq!(report["tokens"], 65);
    assert_eq!((&report["weights"], &report["gamma"]), (&json!("dpace"), &json!(null)), "the default: D-PACE");
    let loss = report["loss"].as_f64().unwrap();
    assert!(loss > 1.0 && loss.is_finite(), "{report}");
    let accept = report["acceptance_length"].as_f64().unwrap();
    assert!((1.0..=16.0).contains(&accept));

    // --gamma weighs the slots by the paper's decay, whatever objective.weights says, and the report says so.
    let out = dflash(&[&args[..], &["--gamma", "4"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let decay: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((&decay["weights"], &decay["gamma"]), (&json!("decay"), &json!(4.0)), "{decay}");
    assert_ne!(decay["loss"], report["loss"], "another weighing, another loss");
    assert_eq!(decay["acceptance_length"], report["acceptance_length"], "acceptance does not depend on the weights");
    // A flag that would do nothing is refused: --gamma and the row batch mean nothing to --decode, 0 tokens nothing.
    let decode =
        ["eval", "--decode", "--target", args[2], "--drafter", args[4], "--prompts", "p.jsonl", "--device", "cpu"];
    for (refused, why) in [
        (&decode[..], None),
        (&[&decode[..], &["--gamma", "4"]].concat()[..], Some("--gamma")),
        (&[&decode[..], &["--batch", "2"]].concat()[..], Some("--batch")),
        (&[&decode[..], &["--max-new-tokens", "0"]].concat()[..], Some("at least 1")),
        (&[&args[..], &["--max-new-tokens", "3"]].concat()[..], Some("--decode")),
    ] {
        let out = dflash(refused);
        let err = text(&out.stderr);
        match why {
            // The same flags but the refused one fail later, on the missing prompts file, not at parsing.
            None => assert!(out.status.code() == Some(1) && err.contains("p.jsonl"), "{err}"),
            Some(why) => assert!(out.status.code() == Some(2) && err.contains(why), "{refused:?}: {err}"),
        }
    }

    // A bad row is named by file and line.
    std::fs::write(&data, format!("{}\n{{\"input_ids\": [1, 2], \"loss_mask\": [1]}}\n", row(40))).unwrap();
    let out = dflash(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("rows.jsonl:2") && err.contains("loss_mask"), "{err}");
}

/// `eval --decode` on a tiny target folder (tokenizer included): token and chat prompts, a dump, and a lossless
/// report whose counts add up.
#[test]
fn eval_decode_measures_acceptance_and_checks_losslessness() {
    use dflash::data::builtin::write_tiny_tokenizer;
    use dflash::model::{Drafter, DrafterConfig, Init, Preset};
    use tch::{Device, Kind};
    let dir = tempfile::tempdir().unwrap();
    let (target_dir, drafter_dir) = (dir.path().join("t"), dir.path().join("d"));
    let (prompts, dump) = (dir.path().join("prompts.jsonl"), dir.path().join("dump.jsonl"));
    tiny_target_folder(&target_dir);
    write_tiny_tokenizer(&target_dir).unwrap();
    Drafter::new(DrafterConfig::for_preset(Preset::Tiny, 8), Device::Cpu, Kind::Float, Init::Portable(2))
        .unwrap()
        .save(&drafter_dir, Kind::Float)
        .unwrap();
    std::fs::write(
        &prompts,
        "{\"id\": \"q-5\", \"input_ids\": [257, 117, 10, 40, 41]}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}\n",
    )
    .unwrap();
    let out = dflash(&[
        "eval",
        "--decode",
        "--target",
        target_dir.to_str().unwrap(),
        "--drafter",
        drafter_dir.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--dump",
        dump.to_str().unwrap(),
        "--device",
        "cpu",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(report["token_match_rate"], 1.0);
    assert_eq!(report["generated_tokens"], 40);
    let steps = report["target_steps"].as_f64().unwrap();
    // Each prompt: the prefill's token, then 19 tokens over its verify steps.
    assert!((report["decode_acceptance_length"].as_f64().unwrap() - 38.0 / steps).abs() < 1e-9, "{report}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&dump).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["id"], "q-5", "ids as given");
    assert_eq!(lines[1]["id"], 1, "a line without id is named by its line number");
    assert!(lines.iter().all(|l| l["tokens"].as_array().unwrap().len() == 20 && l["lossless"] == true));
    // --limit decodes the first prompts only.
    let (t, d, p) = (target_dir.to_str().unwrap(), drafter_dir.to_str().unwrap(), prompts.to_str().unwrap());
    let limited =
        dflash(&["eval", "--decode", "--target", t, "--drafter", d, "--prompts", p, "--limit", "1", "--json"]);
    assert!(limited.status.success(), "{}", text(&limited.stderr));
    let report: serde_json::Value = serde_json::from_slice(&limited.stdout).unwrap();
    assert_eq!(report["prompts"], 1, "{report}");
    assert!(text(&limited.stderr).contains("--limit 1: the first 1 of 2 prompts"), "{}", text(&limited.stderr));

    // Token-id prompts need no tokenizer: a folder without one decodes them; a chat prompt names what is missing.
    std::fs::remove_file(target_dir.join("tokenizer.json")).unwrap();
    std::fs::write(&prompts, "{\"id\": 5, \"input_ids\": [257, 117, 10, 40, 41]}\n").unwrap();
    let decode = |prompts: &std::path::Path| {
        let (t, d, p) = (target_dir.to_str().unwrap(), drafter_dir.to_str().unwrap(), prompts.to_str().unwrap());
        dflash(&["eval", "--decode", "--target", t, "--drafter", d, "--prompts", p, "--max-new-tokens", "4", "--json"])
    };
    let out = decode(&prompts);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::write(&prompts, "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}\n").unwrap();
    let out = decode(&prompts);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("prompts.jsonl:1") && text(&out.stderr).contains("tokenizer"),
        "{}",
        text(&out.stderr)
    );

    // Without --prompts, --decode explains itself.
    let out = dflash(&["eval", "--decode", "--drafter", drafter_dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--prompts"), "{}", text(&out.stderr));
}

/// On mixture-of-experts targets (`tiny-moe` and `tiny-gpt-oss`, written out as Qwen3-MoE and GPT-OSS folders and
/// loaded back) speculative decoding gives exactly the target's greedy tokens: verify steps run the sparse layers
/// (and GPT-OSS's sliding windows over the cache) on blocks of tokens, the greedy reference one token at a time.
#[test]
fn eval_decode_is_lossless_on_mixture_of_experts_targets() {
    use dflash::model::{Drafter, DrafterConfig, Init, Preset};
    use tch::{Device, Kind};
    for (preset, class) in [(Preset::TinyMoe, "Qwen3MoeForCausalLM"), (Preset::TinyGptOss, "GptOssForCausalLM")] {
        let dir = tempfile::tempdir().unwrap();
        let (target_dir, drafter_dir, prompts) =
            (dir.path().join("t"), dir.path().join("d"), dir.path().join("p.jsonl"));
        preset_target_folder(preset, &target_dir);
        let config = std::fs::read_to_string(target_dir.join("config.json")).unwrap();
        assert!(config.contains(class), "{config}");
        Drafter::new(DrafterConfig::for_preset(preset, 8), Device::Cpu, Kind::Float, Init::Portable(4))
            .unwrap()
            .save(&drafter_dir, Kind::Float)
            .unwrap();
        std::fs::write(
            &prompts,
            "{\"input_ids\": [257, 117, 10, 40, 41]}\n{\"input_ids\": [257, 99, 98, 97, 10, 32]}\n",
        )
        .unwrap();
        let (t, d, p) = (target_dir.to_str().unwrap(), drafter_dir.to_str().unwrap(), prompts.to_str().unwrap());
        let out = dflash(&[
            "eval",
            "--decode",
            "--target",
            t,
            "--drafter",
            d,
            "--prompts",
            p,
            "--max-new-tokens",
            "24",
            "--ignore-eos",
            "--device",
            "cpu",
            "--json",
        ]);
        assert!(out.status.success(), "{preset}: {}", text(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["lossless"], true, "{preset}: {report}");
        assert_eq!(report["token_match_rate"], 1.0);
        assert_eq!(report["generated_tokens"], 48);
    }
}

/// `export --preset tiny-tasks` writes the built-in target as a HuggingFace folder: the weights byte for byte as built
/// in (the checksum docs/targets.md states), a config and tokenizer that load back into the same model.
#[test]
fn a_preset_exports_as_a_model_folder_that_loads_back_as_the_preset() {
    use dflash::model::presets::TINY_TASKS_SHA256;
    use dflash::model::{Depth, Preset, Target};
    use sha2::{Digest, Sha256};
    use tch::{Device, Kind, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny-tasks");
    let run = dflash(&["export", "--preset", "tiny-tasks", "--out", out.to_str().unwrap()]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    let digest: String = Sha256::digest(&weights).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(digest, TINY_TASKS_SHA256);
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(out.join(file).exists(), "{file} missing");
    }
    let spec = Preset::TinyTasks.spec();
    let loaded = Target::load(&out, &spec.taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let built = spec.build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let ids = Tensor::from_slice(&[257i64, 117, 10, 40, 41]).view([1, 5]);
    let (a, b) = (loaded.logits(&ids, &[5]).unwrap(), built.logits(&ids, &[5]).unwrap());
    assert!(a.equal(&b), "the exported folder is a different model");

    // Presets without a tokenizer, and no source at all, are refused with what to do.
    let refused = dflash(&["export", "--preset", "qwen3-8b", "--out", dir.path().join("q").to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused.stderr).contains("tiny-tasks"), "{}", text(&refused.stderr));
    let neither = dflash(&["export", "--out", dir.path().join("n").to_str().unwrap()]);
    assert_eq!(neither.status.code(), Some(2));
    assert!(text(&neither.stderr).contains("--checkpoint"), "{}", text(&neither.stderr));
}

/// A run whose first layer slides (causal, as the engines assume) and whose second attends fully exports the layers
/// as vLLM and SGLang read them; a new run from that drafter with other layers is refused naming the keys; the
/// speculators layout, which carries one causality for every layer, refuses it and names the other layout.
#[test]
fn sliding_window_layers_train_export_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = |p: &str| dir.path().join(p).to_str().unwrap().to_string();
    let train = |ckpt: &str, layers: &str, init: Option<&str>| {
        let (ckpt, layers) = (format!("checkpoint.dir={ckpt}"), format!("draft_model.layer_types={layers}"));
        let mut args = vec!["serve-train", "--set", "target.model=tiny-tasks", "--set", "target.device=cpu"];
        for set in [
            "drafters.devices=[\"cpu\"]",
            "data.path=synthetic",
            "data.builtin_conversations=8",
            "data.max_len=64",
            "data.batch_size=2",
            "draft_model.num_hidden_layers=2",
            "draft_model.sliding_window=16",
            "optim.max_steps=2",
            "control.listen=off",
            &ckpt,
            &layers,
        ] {
            args.extend(["--set", set]);
        }
        let init = init.map(|i| format!("draft_model.init={i}"));
        if let Some(init) = &init {
            args.extend(["--set", init]);
        }
        dflash(&args)
    };
    let out = train(&path("a"), "[\"sliding_attention\", \"full_attention\"]", None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/final/config.json")).unwrap()).unwrap();
    assert_eq!(config["layer_types"], serde_json::json!(["sliding_attention", "full_attention"]), "{config}");
    assert_eq!(config["sliding_window"], 16);
    assert_eq!(config["use_sliding_window"], true, "transformers drops the window without it");
    assert!(config.get("is_causal").is_none(), "causal where it slides is the engines' default: {config}");

    // The run's folder decodes as its newest checkpoint's drafter, every token the target's own.
    std::fs::write(dir.path().join("prompts.jsonl"), "{\"input_ids\": [257, 117, 10, 40, 41, 42, 43, 44]}\n").unwrap();
    let (run, prompts) = (path("a"), path("prompts.jsonl"));
    let decode = ["eval", "--decode", "--target", "tiny-tasks", "--drafter", &run, "--prompts", &prompts];
    let out = dflash(&[&decode[..], &["--max-new-tokens", "24", "--device", "cpu", "--json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["lossless"], true, "{report}");
    assert!(text(&out.stderr).contains("newest valid checkpoint, step 2"), "{}", text(&out.stderr));

    let out = train(&path("b"), "\"full_attention\"", Some(&path("a/final")));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("attention:") && err.contains("layer_types") && err.contains("sliding_window = 16"), "{err}");

    let target = path("target");
    assert!(dflash(&["export", "--preset", "tiny-tasks", "--out", &target]).status.success());
    let (ckpt, out_dir) = (path("a"), path("speculators"));
    let args = ["export", "--checkpoint", &ckpt, "--format", "speculators", "--verifier", &target, "--out", &out_dir];
    let out = dflash(&args);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--format zlab"), "{}", text(&out.stderr));

    // Every layer sliding and causal is what the speculators layout carries: said in both places vLLM reads, and
    // the verifier given as a relative folder is written as an absolute path (vLLM reads it from elsewhere).
    let out = train(&path("c"), "\"sliding_attention\"", None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["export", "--checkpoint", "c", "--format", "speculators", "--verifier", "target", "--out", "spec"])
        .current_dir(dir.path())
        .env("DFLASH__LOG__LEVEL", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("spec/config.json")).unwrap()).unwrap();
    assert_eq!(config["sliding_window_non_causal"], false);
    assert_eq!(config["transformer_layer_config"]["is_causal"], true);
    assert_eq!(config["transformer_layer_config"]["sliding_window"], 16);
    let verifier = config["speculators_config"]["verifier"]["name_or_path"].as_str().unwrap();
    assert_eq!(std::path::Path::new(verifier), std::fs::canonicalize(dir.path().join("target")).unwrap());
}

/// A run that learns the target's distribution (the target running its whole stack) trains and evaluates its drafter
/// by decoding on the way; `eval` scores a drafter against the target's choices; KL with the data as its target is
/// refused naming both keys.
#[test]
fn learning_the_targets_distribution_trains_and_evaluates() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run").to_str().unwrap().to_string();
    let ckpt = format!("checkpoint.dir={run}");
    let prompts_file = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts_file, "{\"input_ids\": [257, 117, 10, 40, 41, 42, 43, 44]}\n").unwrap();
    let prompts = format!("eval.prompts={}", prompts_file.to_str().unwrap());
    let mut args = vec!["serve-train", "--set", "target.model=tiny-tasks", "--set", "target.device=cpu"];
    for set in [
        "drafters.devices=[\"cpu\"]",
        "data.path=synthetic",
        "data.builtin_conversations=32",
        "data.max_len=64",
        "data.batch_size=2",
        "draft_model.num_hidden_layers=1",
        "optim.max_steps=2",
        "eval.every_steps=2",
        "eval.max_new_tokens=8",
        "control.listen=off",
        "objective.target=argmax",
        "objective.loss=kl",
        &ckpt,
        &prompts,
    ] {
        args.extend(["--set", set]);
    }
    let out = dflash(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.path().join("run/best").is_dir(), "the decoded evaluation kept its best checkpoint");
    // The run's evaluations are kept beside its checkpoints; inspect-run tabulates and plots them.
    let inspected = dflash(&["inspect-run", &run]);
    assert!(inspected.status.success(), "{}", text(&inspected.stderr));
    let table = text(&inspected.stdout);
    assert!(table.lines().any(|l| l.trim_start().starts_with("2 ") && l.ends_with("yes  best")), "{table}");
    let svg = std::fs::read_to_string(dir.path().join("run/evals.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("acceptance length") && svg.contains("<polyline"), "{svg}");
    let none = dflash(&["inspect-run", dir.path().to_str().unwrap()]);
    assert!(text(&none.stderr).contains("evals.jsonl: no history of evaluations"), "{}", text(&none.stderr));

    let data = dir.path().join("rows.jsonl");
    let ids: Vec<i64> = (0..40).map(|t| (t * 3 + 7) % 200).collect();
    let mask: Vec<u8> = (0..40).map(|t| u8::from(t >= 3)).collect();
    std::fs::write(&data, format!("{}\n", serde_json::json!({"input_ids": ids, "loss_mask": mask}))).unwrap();
    let data = data.to_str().unwrap();
    let eval = |sets: &[&str]| {
        let mut args = vec!["eval", "--target", "tiny-tasks", "--drafter", &run, "--data", data, "--json"];
        args.extend(["--device", "cpu"]);
        for set in sets {
            args.extend(["--set", set]);
        }
        let out = dflash(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let on_data = eval(&[]);
    let on_target = eval(&["objective.target=argmax", "objective.loss=kl"]);
    assert_eq!(on_data["blocks"], on_target["blocks"], "the same blocks: {on_data} {on_target}");
    let (ce, kl) = (on_data["loss"].as_f64().unwrap(), on_target["loss"].as_f64().unwrap());
    assert!(kl.is_finite() && kl >= 0.0 && kl != ce, "KL {kl} against the data's CE {ce}");
    assert_ne!(on_data["accuracy"], on_target["accuracy"], "counted against the target's choices: {on_target}");
    // Without --target, eval says which target it scores against.
    let out =
        dflash(&["eval", "--drafter", &run, "--data", data, "--device", "cpu", "--set", "target.model=tiny-tasks"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("target: tiny-tasks (target.model"), "{}", text(&out.stderr));

    let refused = dflash(&["serve-train", "--set", "objective.loss=kl", "--set", "control.listen=off"]);
    assert_eq!(refused.status.code(), Some(1));
    let err = text(&refused.stderr);
    assert!(err.contains("objective.loss") && err.contains("objective.target = \"argmax\""), "{err}");
}

/// A mistyped folder under a local `models/` is named as a missing folder with what is there (not taken for a Hub id);
/// `prepare` keeping no sample leaves no folder behind; a model folder without its tokenizer_config.json says which
/// file it needs.
#[test]
fn model_folders_that_cannot_work_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let export = ["export", "--preset", "tiny-tasks", "--out", "models/TinyTasks"];
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(args)
            .current_dir(dir.path())
            .env("DFLASH__LOG__LEVEL", "warn")
            .output()
            .unwrap()
    };
    assert!(run(&export).status.success());
    let chat = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#;
    std::fs::write(dir.path().join("chats.jsonl"), format!("{chat}\n")).unwrap();
    let prepare =
        |model: &str| run(&["prepare", "--model", model, "--input", "chats.jsonl", "--out", "d", "--max-len", "64"]);
    let out = prepare("models/TinyTask");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("no such folder") && err.contains("TinyTasks") && !err.contains("Hub"), "{err}");
    // Too short to train on: nothing is kept, no folder is left, and a rerun says the same (not "up to date").
    for _ in 0..2 {
        let out = prepare("models/TinyTasks");
        assert_eq!(out.status.code(), Some(1));
        let (said, err) = (text(&out.stdout), text(&out.stderr));
        assert!(said.contains("dropped 1") && err.contains("no sample was kept"), "{said}{err}");
        assert!(!dir.path().join("d").exists());
    }
    std::fs::remove_file(dir.path().join("models/TinyTasks/tokenizer_config.json")).unwrap();
    let out = prepare("models/TinyTasks");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("tokenizer_config.json: not found") && !err.contains("os error"), "{err}");
}

/// `data.max_len` does not cut rows that were prepared already: a run that sets it is told so, and trains.
#[test]
fn max_len_set_for_token_rows_is_said_to_be_unused() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows.jsonl");
    let row = |i: i64| {
        let ids: Vec<i64> = (0..40).map(|t| (t * 5 + i * 11) % 200).collect();
        serde_json::json!({"id": i, "input_ids": ids, "loss_mask": vec![1; 40]}).to_string()
    };
    std::fs::write(&rows, (0..4).map(|i| row(i) + "\n").collect::<String>()).unwrap();
    let (path, ckpt) =
        (format!("data.path={}", rows.display()), format!("checkpoint.dir={}", dir.path().join("c").display()));
    let cache = format!("data.cache_dir={}", dir.path().join("cache").display());
    let mut args = vec!["serve-train"];
    for set in [
        "target.model=tiny-tasks",
        "target.device=cpu",
        "drafters.devices=[\"cpu\"]",
        "data.batch_size=2",
        "data.max_len=32",
        "draft_model.num_hidden_layers=1",
        "optim.max_steps=1",
        "control.listen=off",
        &path,
        &ckpt,
        &cache,
    ] {
        args.extend(["--set", set]);
    }
    let out = dflash(&args);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("data.max_len = 32 is not used with token rows"), "{err}");
}

/// Logs written to a pipe (a file, journald, `docker logs`) carry no colour codes.
#[test]
fn logs_to_a_pipe_are_plain_text() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["bench", "--what", "target", "--preset", "tiny", "--device", "cpu", "--batch", "1", "--seq", "8"])
        .args(["--steps", "1"])
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .env("DFLASH__LOG__LEVEL", "info")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = text(&out.stderr);
    assert!(log.contains("INFO"), "an info line is logged: {log}");
    assert!(!log.contains('\x1b'), "colour codes in a piped log: {log:?}");
}

/// `--resume auto` on a run that is complete loads nothing and trains nothing: it says so, names the drafter (its
/// `final/` exported again) and how to go on; raising `optim.max_steps` then trains on from there.
#[test]
fn resuming_a_complete_run_says_it_is_complete_and_raising_max_steps_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("run");
    let run = |steps: u64| {
        let mut args = vec!["serve-train".to_string(), "--resume".into(), "auto".into()];
        for set in [
            "drafters.devices=[\"cpu\"]".to_string(),
            "draft_model.num_hidden_layers=1".into(),
            format!("optim.max_steps={steps}"),
            "control.listen=off".into(),
            format!("checkpoint.dir={}", ckpt.display()),
            format!("data.ledger={}", ckpt.join("ledger.jsonl").display()),
        ] {
            args.extend(["--set".into(), set]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(&args)
            .env_remove("RUST_LOG")
            .env("DFLASH__LOG__LEVEL", "info")
            .output()
            .expect("run dflash");
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        err
    };
    let ledger = || std::fs::read_to_string(ckpt.join("ledger.jsonl")).unwrap();
    let first = run(4);
    assert!(first.contains("run complete"), "{first}");
    let (trained, exported) = (ledger(), std::fs::metadata(ckpt.join("final/model.safetensors")).unwrap());

    let again = run(4);
    assert!(again.contains("is already complete at step 4: nothing to train"), "{again}");
    assert!(again.contains("raise optim.max_steps"), "{again}");
    assert!(!again.contains("drafter ready") && !again.contains("training"), "nothing started: {again}");
    assert_eq!(ledger(), trained, "nothing trained");
    let final_now = std::fs::metadata(ckpt.join("final/model.safetensors")).unwrap();
    assert_eq!(final_now.len(), exported.len(), "the same drafter exported again");

    let on = run(6);
    assert!(on.contains("resuming") && on.contains("run complete"), "{on}");
    assert!(ledger().len() > trained.len(), "steps 5 and 6 trained");
}

/// A start that fails before anything is written (a data.path that is not prepared data) leaves no checkpoint
/// folder behind: the next try starts as the first did, not refused for a folder that holds only a lock file.
#[test]
fn a_failed_start_leaves_no_checkpoint_folder() {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let ckpt = format!("checkpoint.dir={}", runs.join("first").display());
    let data = format!("data.path={}", dir.path().join("not-prepared").display());
    let out = dflash(&["serve-train", "--set", &ckpt, "--set", &data, "--set", "control.listen=off"]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("not-prepared"), "{err}");
    assert!(!runs.exists(), "runs/ and runs/first were made for the lock and removed with it");
}

/// `export` replaces an earlier export of the same kind (the same command run again) but writes into no other
/// non-empty folder without `--force`, and a run's `final/` given as the checkpoint is said to be an exported
/// drafter already, with the command that exports the run again.
#[test]
fn export_replaces_only_its_own_output_and_knows_an_exported_drafter() {
    let dir = tempfile::tempdir().unwrap();
    let (run, d) = (dir.path().join("run"), dir.path());
    let ckpt = format!("checkpoint.dir={}", run.display());
    let sets = ["drafters.devices=[\"cpu\"]", "draft_model.num_hidden_layers=1", "optim.max_steps=2"];
    let mut args = vec!["serve-train", "--set", "control.listen=off", "--set", &ckpt];
    for s in &sets {
        args.extend(["--set", s]);
    }
    let out = dflash(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let export = |from: &std::path::Path, to: &std::path::Path, extra: &[&str]| {
        let (from, to) = (from.to_str().unwrap(), to.to_str().unwrap());
        dflash(&[&["export", "--checkpoint", from, "--out", to][..], extra].concat())
    };
    let drafter = d.join("drafter");
    for _ in 0..2 {
        let out = export(&run, &drafter, &[]);
        assert!(out.status.success(), "the same export again replaces it: {}", text(&out.stderr));
    }
    let other = d.join("notes");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("todo.txt"), "mine").unwrap();
    let out = export(&run, &other, &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("todo.txt") && err.contains("--force"), "{err}");
    assert!(!other.join("model.safetensors").exists(), "nothing written");
    assert!(export(&run, &other, &["--force"]).status.success());
    assert_eq!(std::fs::read_to_string(other.join("todo.txt")).unwrap(), "mine");

    let out = export(&run.join("final"), &d.join("again"), &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("already an exported drafter"), "{err}");
    assert!(err.contains(&format!("--checkpoint {}", run.display())), "{err}");

    let preset = |to: &std::path::Path| dflash(&["export", "--preset", "tiny-tasks", "--out", to.to_str().unwrap()]);
    let model = d.join("model");
    assert!(preset(&model).status.success() && preset(&model).status.success(), "a preset exported twice");
    let out = preset(&drafter);
    assert!(!out.status.success() && text(&out.stderr).contains("not an earlier export"), "a drafter's folder");
}
