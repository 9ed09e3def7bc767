//! Input that would run and produce nothing useful is refused through the command line, naming what is wrong: counts
//! of zero, ShareGPT roles inside OpenAI `messages`, a request without content; and `prepare`'s report accounts for
//! every line it read.
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_dflash");

fn dflash(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env("DFLASH__LOG__LEVEL", "warn").output().unwrap()
}

/// `regenerate --max-tokens 0` and `synthesize --max-tokens 0` would write empty answers: refused at parsing.
#[test]
fn zero_tokens_to_generate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let out = out.to_str().unwrap();
    for args in [
        &["regenerate", "--local", "--model", "tiny-tasks", "--input", "in.jsonl", "--out", out, "--max-tokens", "0"][..],
        &["synthesize", "--model", "tiny-tasks", "--out", out, "--max-tokens", "0"],
    ] {
        let o = dflash(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--max-tokens") && err.contains('0'), "{err}");
    }
    assert!(!std::path::Path::new(out).exists(), "nothing written");
}

/// Every line `prepare` reads is kept, dropped, bad or blank, and the report's counts add up to the lines of the
/// file: bad lines of each kind (a duplicate id, ShareGPT's `human` in OpenAI `messages`, a request without content,
/// malformed JSON), a conversation too short to learn from, and blank lines.
#[test]
fn prepares_report_accounts_for_every_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (chats, data) = (d.join("chats.jsonl"), d.join("data"));
    let good = |id: u32| {
        let answer = "the answer to that is a long one, long enough to learn from in blocks of four tokens";
        serde_json::json!({"id": id, "messages": [{"role": "user", "content": format!("question {id}")},
            {"role": "assistant", "content": answer}]})
        .to_string()
    };
    let lines = [
        good(1),
        good(2),
        good(1),
        r#"{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "a long answer"}]}"#
            .into(),
        r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "a long enough answer"}]}"#.into(),
        "{not json".into(),
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#.into(),
        String::new(),
        "   ".into(),
        good(3),
    ];
    std::fs::write(&chats, lines.join("\n") + "\n").unwrap();
    let o = dflash(&[
        "prepare",
        "--model",
        "tiny-tasks",
        "--input",
        chats.to_str().unwrap(),
        "--out",
        data.to_str().unwrap(),
        "--max-len",
        "256",
        "--block-size",
        "4",
        "--holdout",
        "0",
    ]);
    let printed = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{printed}");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("manifest.json")).unwrap()).unwrap();
    let r = &manifest["report"];
    let count = |v: &serde_json::Value| v.as_u64().unwrap();
    let sum = |v: &serde_json::Value| v.as_object().unwrap().values().map(count).sum::<u64>();
    assert_eq!(count(&r["lines"]) + count(&r["blank"]), lines.len() as u64, "{r}");
    assert_eq!(count(&r["lines"]), count(&r["kept_lines"]) + sum(&r["dropped"]) + sum(&r["bad_lines"]), "{r}");
    assert_eq!((count(&r["kept_lines"]), sum(&r["dropped"]), sum(&r["bad_lines"])), (3, 1, 4), "{r}");
    for expected in ["is ShareGPT's", "a user message has no `content`", "not valid JSON", "chats.jsonl:3"] {
        assert!(printed.contains(expected), "{expected:?} not in: {printed}");
    }
    assert!(printed.contains("8 conversations read (2 blank lines skipped): 3 kept, 1 dropped, 4 bad"), "{printed}");
}
