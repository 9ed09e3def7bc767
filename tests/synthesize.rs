//! `synthesize` through the command line, on the CPU with the built-in tiny-tasks target (f32: every run generates
//! the same tokens): the file `prepare` reads, the same file whether a run was stopped and continued or not (a torn
//! last line included), a rerun with other settings refused, topics and system prompts, several turns, and the
//! errors a user meets first.
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_dflash");

fn synthesize(out: &Path, count: u64, extra: &[&str]) -> Output {
    let count = count.to_string();
    let args = ["synthesize", "--model", "tiny-tasks", "--device", "cpu", "--dtype", "f32", "--max-tokens", "24"];
    let mut command = Command::new(BIN);
    command.args(args).args(["--count", &count, "--out", out.to_str().unwrap(), "--turns", "1-2", "--batch", "8"]);
    command.args(extra).env("DFLASH__LOG__LEVEL", "warn").output().unwrap()
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The same seed and options give the same file, whether written in one run, in two (a smaller --count first), or
/// continued after a torn last line; each line is a conversation `prepare` takes, with its seed and settings.
#[test]
fn a_continued_run_writes_what_one_run_writes() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.jsonl");
    let summary = ok(synthesize(&whole, 24, &[]));
    assert!(summary.starts_with("24 of 24 conversations (24 now, 0 already done)"), "{summary}");
    assert!(summary.contains("spread: ") && summary.contains("distinct first words"), "{summary}");
    assert!(summary.contains("\n  generation: ") && summary.contains(" prefills of "), "{summary}");
    let kept = lines(&whole);
    assert_eq!(kept.len(), 24);
    let ids: Vec<u64> = kept.iter().map(|l| l["id"].as_u64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "in attempt order: {ids:?}");
    assert!(kept.iter().all(|l| l["synthesis"]["settings"]["seed"] == 0 && l["synthesis"]["seed"].is_u64()));
    assert!(kept.iter().any(|l| l["synthesis"]["turns"] == 2), "some conversations of two turns");
    let rejected = lines(&whole.with_file_name("whole.rejected.jsonl"));
    assert!(!rejected.is_empty() && rejected.iter().all(|l| l["reason"].is_string() && l["id"].is_u64()));

    let parts = dir.path().join("parts.jsonl");
    ok(synthesize(&parts, 10, &[]));
    assert_eq!(lines(&parts), kept[..10]);
    // An interrupted write: half a line at the end.
    let mut text = std::fs::read_to_string(&parts).unwrap();
    text.push_str(r#"{"id": 11, "messages": [{"role": "us"#);
    std::fs::write(&parts, text).unwrap();
    let again = ok(synthesize(&parts, 24, &[]));
    assert!(again.starts_with("24 of 24 conversations (14 now, 10 already done)"), "{again}");
    assert_eq!(std::fs::read(&parts).unwrap(), std::fs::read(&whole).unwrap());
    assert_eq!(
        std::fs::read(parts.with_file_name("parts.rejected.jsonl")).unwrap(),
        std::fs::read(whole.with_file_name("whole.rejected.jsonl")).unwrap()
    );
    // Done already: nothing generated.
    let done = ok(synthesize(&parts, 24, &[]));
    assert!(done.starts_with("24 of 24 conversations (0 now, 24 already done) from 0 attempts"), "{done}");

    // Another seed into the same file is refused, naming it.
    let other = synthesize(&parts, 30, &["--seed", "1"]);
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success() && err.contains("parts.jsonl") && err.contains("other settings"), "{err}");

    // The file is data: prepare takes every line.
    let prepared = dir.path().join("prepared");
    let o = Command::new(BIN)
        .args(["prepare", "--model", "tiny-tasks", "--input", whole.to_str().unwrap(), "--out"])
        .args([prepared.to_str().unwrap(), "--max-len", "256", "--block-size", "4"])
        .output()
        .unwrap();
    ok(o);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(prepared.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["report"]["lines"], 24, "{manifest}");
    assert_eq!(manifest["report"]["bad_lines"], serde_json::json!({}), "{manifest}");
}

/// Topics steer the first request through a system prompt the answer does not see; system prompts are part of the
/// conversation, for the share asked.
#[test]
fn topics_and_system_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let topics = dir.path().join("topics.txt");
    std::fs::write(&topics, "counting\nreversing words\n\n").unwrap();
    let systems = dir.path().join("systems.txt");
    std::fs::write(&systems, "You answer in one line.\n").unwrap();
    let out = dir.path().join("steered.jsonl");
    let args = ["--topics", topics.to_str().unwrap(), "--system-prompts", systems.to_str().unwrap()];
    ok(synthesize(&out, 16, &[&args[..], &["--system-share", "1"]].concat()));
    let kept = lines(&out);
    for l in &kept {
        let topic = l["synthesis"]["topic"].as_str().unwrap();
        assert!(["counting", "reversing words"].contains(&topic), "{l}");
        assert_eq!(l["messages"][0]["content"], "You answer in one line.", "{l}");
        assert!(!l["messages"].to_string().contains("request about"), "the steering prompt is not kept: {l}");
    }
    let seen: std::collections::HashSet<&str> =
        kept.iter().map(|l| l["synthesis"]["topic"].as_str().unwrap()).collect();
    assert_eq!(seen.len(), 2);
}

/// What a user meets first: a folder without a chat template, bad options, each named with what to do.
#[test]
fn errors_name_the_input_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("base-model");
    ok(Command::new(BIN)
        .args(["export", "--preset", "tiny-tasks", "--out", folder.to_str().unwrap()])
        .output()
        .unwrap());
    let config = folder.join("tokenizer_config.json");
    let mut tokenizer_config: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    tokenizer_config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config, tokenizer_config.to_string()).unwrap();
    let out = dir.path().join("out.jsonl");
    let cases: [(&[&str], &str); 5] = [
        (&["--model", folder.to_str().unwrap()], "chat template"),
        (&["--model", "tiny-tasks", "--request-temperature", "0"], "--request-temperature 0"),
        (&["--model", "tiny-tasks", "--turns", "3-1"], "--turns"),
        (&["--model", "tiny-tasks", "--answer-top-p", "0"], "--answer-top-p"),
        (&["--model", "tiny-tasks", "--count", "0"], "--count 0"),
    ];
    for (args, expected) in cases {
        let o = Command::new(BIN)
            .args(["synthesize", "--device", "cpu", "--out", out.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(expected), "{args:?}: {err}");
    }
    assert!(!out.exists(), "nothing written on a refused command");
}
