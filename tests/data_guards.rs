//! A run trains only on the data it should, through the command line: a folder prepared with another tokenizer or
//! chat template is refused at start (unless `data.allow_other_tokenizer`), `prepare` does not replace a prepared
//! folder under a run without `--force`, and a run does not resume on data that changed since it began.
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_dflash");

fn dflash(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env("DFLASH__LOG__LEVEL", "warn").output().unwrap()
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn refused(o: Output, expected: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected a refusal: {err}");
    for e in expected {
        assert!(err.contains(e), "{e:?} not in: {err}");
    }
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A short run on the CPU: one drafter, `steps` steps, checkpoints in `ckpt`.
fn train(model: &str, data: &Path, ckpt: &Path, steps: u64, extra: &[&str]) -> Output {
    let sets = [
        format!("target.model={model}"),
        "target.device=cpu".into(),
        "drafters.devices=[\"cpu\"]".into(),
        format!("data.path={}", p(data)),
        "data.batch_size=2".into(),
        "objective.num_anchors=8".into(),
        format!("optim.max_steps={steps}"),
        format!("checkpoint.dir={}", p(ckpt)),
        "checkpoint.every_steps=0".into(),
        "eval.every_steps=0".into(),
        "control.listen=off".into(),
    ];
    let mut args = vec!["serve-train".to_string()];
    for s in sets {
        args.extend(["--set".into(), s]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    dflash(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Data prepared with the built-in tokenizer trains a target folder with the same tokenizer and template (the
/// exported tiny-tasks target); the same folder with its chat template edited is another target, and the data is
/// refused naming both, unless `data.allow_other_tokenizer` says the two share one.
#[test]
fn data_prepared_with_another_tokenizer_or_template_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (chats, data, model) = (d.join("chats.jsonl"), d.join("data"), d.join("model"));
    ok(dflash(&["sample-data", "--count", "40", "--out", p(&chats)]));
    ok(dflash(&["prepare", "--model", "tiny-tasks", "--input", p(&chats), "--out", p(&data), "--max-len", "256"]));
    ok(dflash(&["export", "--preset", "tiny-tasks", "--out", p(&model)]));
    ok(train(p(&model), &data, &d.join("same"), 2, &[]));
    // The same vocabulary, another template: every token id fits, so only the recorded tokenizer can tell.
    let config = model.join("tokenizer_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text.replacen("<|im_start|>", "<|im_start|>{# edited #}", 1);
    assert_ne!(text, edited);
    std::fs::write(&config, edited).unwrap();
    refused(
        train(p(&model), &data, &d.join("other"), 2, &[]),
        &[
            "prepared with the tokenizer and chat template of tiny",
            "data.allow_other_tokenizer = true",
            "dflash prepare --model",
        ],
    );
    assert!(!d.join("other").join("ckpt-000000002").exists());
    ok(train(p(&model), &data, &d.join("allowed"), 2, &["--set", "data.allow_other_tokenizer=true"]));
}

/// `prepare` into a folder already prepared from other settings is refused (a run may be training on it) unless
/// `--force`; a run resumed on such rewritten data is refused naming what it began on.
#[test]
fn prepared_data_does_not_change_under_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (chats, data, ckpt) = (d.join("chats.jsonl"), d.join("data"), d.join("ckpt"));
    ok(dflash(&["sample-data", "--count", "40", "--out", p(&chats)]));
    let prepare = |holdout: &str, extra: &[&str]| {
        let args = ["prepare", "--model", "tiny-tasks", "--input", p(&chats), "--out", p(&data), "--max-len", "256"];
        dflash(&[&args[..], &["--holdout", holdout], extra].concat())
    };
    ok(prepare("0.2", &[]));
    ok(prepare("0.2", &[])); // the same preparation: up to date, nothing written
    ok(train("tiny-tasks", &data, &ckpt, 2, &[]));
    refused(prepare("0.3", &[]), &["already holds data prepared", "holdout 0.2 there, 0.3 now", "--force"]);
    ok(prepare("0.3", &["--force"]));
    refused(
        train("tiny-tasks", &data, &ckpt, 4, &["--resume", "auto"]),
        &["cannot resume", "the data changed under the run", "data.path"],
    );
    // Restored, the run continues.
    ok(prepare("0.2", &["--force"]));
    ok(train("tiny-tasks", &data, &ckpt, 4, &["--resume", "auto"]));
}
