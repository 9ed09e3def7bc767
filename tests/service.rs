//! `serve-train` as operators run it: a real process, its control plane, signals, checkpoints, metrics scraped by a
//! real Prometheus, and live reloads. Tiny shapes, several drafters sharing the CPU.
mod service_process;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use service_process::*;

/// With the paper's recipe, with D-PACE's slot weights (which follow the drafter's own confidence), with Muon
/// (whose momentum buffers are saved where AdamW's first moments are), learning the target's distribution (KL,
/// the target running its whole stack) and packed rows: each resumes exactly, and each trains another drafter from the same start. The paper's run resumes without naming its slot weights, as a run begun before
/// D-PACE became the default does: it keeps the decay it began with.
#[test]
fn stopping_and_resuming_ends_where_an_uninterrupted_run_ends() {
    let paper = stop_and_resume(&["objective.weights=decay"], Resumed::LeavesWeightsToTheDefault);
    let dpace = stop_and_resume(&["objective.dpace_alpha=0.3"], Resumed::AsBegun);
    let muon = stop_and_resume(&["optim.optimizer=muon", "optim.muon_lr=0.01"], Resumed::AsBegun);
    let kl = stop_and_resume(&["objective.target=argmax", "objective.loss=kl"], Resumed::AsBegun);
    let packed = stop_and_resume(&["data.pack=true", "data.pack_len=384"], Resumed::AsBegun);
    assert!(packed != dpace, "data.pack = true trained the same drafter as one conversation per row");
    assert!(paper != dpace, "objective.weights = dpace trained the same drafter as the decay");
    assert!(paper != muon && dpace != muon, "optim.optimizer = muon trained the same drafter as AdamW");
    assert!(kl != dpace, "objective.loss = kl trained the same drafter as the cross-entropy of the data");
}

/// How the resumed run of [`stop_and_resume`] is configured.
#[derive(PartialEq)]
enum Resumed {
    /// With the same settings.
    AsBegun,
    /// Without its `objective.weights`, whose default has changed since the run began.
    LeavesWeightsToTheDefault,
}

/// Runs 14 steps whole and stopped at step 5 or later then resumed; both end with the same drafter and optimizer
/// state, whose drafter bytes it returns.
fn stop_and_resume(more: &[&str], resumed: Resumed) -> Vec<u8> {
    let base = tempfile::tempdir().unwrap();
    let mut sets = vec!["optim.max_steps=14", "optim.schedule=cosine", "optim.warmup_ratio=0.1"];
    sets.extend_from_slice(more);
    let whole = base.path().join("whole");
    let split = base.path().join("split");
    for d in [&whole, &split] {
        std::fs::create_dir_all(d).unwrap();
    }
    let (code, logs) = Service::start(&config(&whole, 2), false, &sets).exit_code();
    assert_eq!(code, 0);
    assert_progress_lines(&logs, &[5, 10], 14);

    let cfg = config(&split, 2);
    let mut first = Service::start(&cfg, false, &sets);
    let s = first.wait("step 5", |s| step(s) >= 5);
    // Where the run stands, in /status and the metrics: the step it ends at, the part done, the time left.
    let p = &s["progress"];
    assert_eq!((p["total_steps"].as_u64(), p["total_steps_estimated"].as_bool()), (Some(14), Some(false)), "{s}");
    assert!((p["fraction"].as_f64().unwrap() - step(&s) as f64 / 14.0).abs() < 1e-9, "{s}");
    assert!(p["eta_seconds"].as_f64().is_some_and(|e| e > 0.0), "{s}");
    let metrics = first.metrics();
    assert_eq!(metric(&metrics, "dflash_run_total_steps"), Some(14.0), "{metrics}");
    assert!(metric(&metrics, "dflash_run_time_left_seconds").is_some_and(|e| e > 0.0), "{metrics}");
    first.signal("-TERM");
    let (code, logs) = first.exit_code();
    assert_eq!(code, STOPPED, "SIGTERM checkpoints and asks to be restarted");
    let stopped_at = checkpoints_written(&logs);
    assert!(stopped_at.len() == 1 && stopped_at[0] < 14, "SIGTERM writes one checkpoint mid-run: {stopped_at:?}");
    if resumed == Resumed::LeavesWeightsToTheDefault {
        sets.retain(|s| !s.starts_with("objective.weights"));
    }
    let (code, logs) = Service::start(&cfg, true, &sets).exit_code();
    assert_eq!(code, 0);
    assert!(logged(&logs, "resuming"));
    for file in ["drafter/model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(whole.join("ckpt/ckpt-000000014").join(file)).unwrap();
        let b = std::fs::read(split.join("ckpt/ckpt-000000014").join(file)).unwrap();
        assert!(a == b, "{file} differs between the uninterrupted and the resumed run");
    }
    if resumed == Resumed::LeavesWeightsToTheDefault {
        let kept =
            |l: &&String| l.contains("objective.weights") && l.contains("decay") && l.contains("as the run began");
        assert!(logs.iter().any(|l| kept(&l)), "the resume says it keeps the run's slot weights: {logs:#?}");
    }
    assert!(split.join("ckpt/final/model.safetensors").exists(), "the end exports the drafter");
    std::fs::read(whole.join("ckpt/ckpt-000000014/drafter/model.safetensors")).unwrap()
}

/// A second signal while the first one's checkpoint is being written (stalled here) exits at once with its own
/// status, without a crash (running C++ destructors under libtorch's threads segfaulted: status 139).
#[test]
fn a_second_signal_exits_at_once_with_its_status() {
    for (first, second, code) in [("-TERM", "-INT", 130), ("-INT", "-TERM", 143)] {
        let dir = tempfile::tempdir().unwrap();
        let mut svc = Service::start(&config(dir.path(), 2), false, &["optim.epochs=4"]);
        svc.wait("step 3", |s| step(s) >= 3);
        svc.fault(0, "checkpoint_stall");
        svc.signal(first);
        svc.poll("the stalled checkpoint", |s| s.tail(50).join("\n"), |t| t.contains("stalled on purpose"));
        svc.signal(second);
        let (status, logs) = svc.exit_code();
        assert_eq!(status, code, "{first} then {second}: {:#?}", &logs[logs.len().saturating_sub(8)..]);
        assert!(logged(&logs, "second signal: exiting now"));
    }
}

/// A second service on the same checkpoint folder (a replacement started while the old one still runs) does not
/// train beside it: it waits up to checkpoint.lock_wait_s, then exits 75 naming the holder; one that waits longer
/// takes the folder over once the holder is gone and resumes its checkpoint. The ledger holds each sample once.
#[test]
fn one_service_per_checkpoint_folder() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let sets = ["optim.epochs=3"];
    let mut first = Service::start(&cfg, false, &sets);
    first.wait("step 2", |s| step(s) >= 2);
    let second = Command::new(BIN)
        .args(["--config", cfg.to_str().unwrap(), "serve-train", "--resume", "auto"])
        .args(["--set", "optim.epochs=3", "--set", "checkpoint.lock_wait_s=1"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(75), "{said}");
    let holder = format!("pid {} on host", first.child.id());
    assert!(
        said.contains("the checkpoint folder is in use by another dflash process") && said.contains(&holder),
        "{said}"
    );

    let mut replacement = Service::start_waiting(&cfg, &["optim.epochs=3", "checkpoint.lock_wait_s=120"]);
    replacement.poll("the replacement to wait", |s| s.tail(20).join("\n"), |t| t.contains(&holder));
    first.stop();
    let (code, logs) = replacement.exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(10)..]);
    assert!(logged(&logs, "resuming"), "it took the folder over and resumed its checkpoint");
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 3);
}

/// A data ledger that cannot be written (a full disk: /dev/full answers every write with ENOSPC) is never silent:
/// the service is not ready, /status and the metrics say so at once, and `data.ledger_max_failures` failures in a
/// row (counted at most one a second) end the run with a checkpoint and status 75 rather than a complete run with no audit trail. The checkpoint
/// carries the lines that were not written: resumed with a ledger that works, the ledger is complete.
#[test]
fn a_ledger_that_cannot_be_written_is_loud_and_ends_the_run() {
    if !Path::new("/dev/full").exists() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let mut svc =
        Service::start(&cfg, false, &["optim.epochs=1000", "data.ledger=/dev/full", "data.ledger_max_failures=100000"]);
    let s = svc.wait("a ledger failure", |s| s["ledger"]["failures"].as_u64().unwrap_or(0) >= 1);
    assert!(s["ledger"]["last_error"].as_str().unwrap().contains("No space left on device"), "{s}");
    let (code, body) = svc.request("GET", "/readyz", None);
    assert!(code == 503 && body["problems"][0].as_str().unwrap().contains("data.ledger"), "{code} {body}");
    let text = svc.metrics();
    assert!(metric(&text, "dflash_ledger_write_failures_total").is_some_and(|n| n >= 1.0), "{text}");
    assert_eq!(metric(&text, "dflash_ledger_failing"), Some(1.0));
    svc.stop();

    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let svc = Service::start(&cfg, false, &["optim.epochs=2", "data.ledger=/dev/full", "data.ledger_max_failures=3"]);
    let (code, logs) = svc.exit_code();
    assert_eq!(code, 75, "{:#?}", &logs[logs.len().saturating_sub(8)..]);
    assert!(logged(&logs, "data.ledger failed") && logged(&logs, "times in a row (3 a second or more apart"));
    assert_eq!(checkpoints_written(&logs).len(), 1, "it checkpointed before exiting");
    let (code, logs) = Service::start(&cfg, true, &["optim.epochs=2"]).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(8)..]);
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "every step in the ledger, once");
}

/// The POST endpoints change the run: on a listener other machines reach they answer 401 without a token, and
/// with one set (DFLASH_CONTROL_TOKEN) only a request that carries it is served; the read-only endpoints may be
/// served alone on an address of their own, which takes no POST at all.
#[test]
fn the_control_plane_asks_for_a_token_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let exposed = ["optim.epochs=1000", "control.listen=0.0.0.0:0"];
    let mut svc = Service::start(&cfg, false, &exposed);
    svc.wait("running", |s| s["phase"] == "running");
    let (code, body) = svc.request("POST", "/checkpoint", None);
    assert!(code == 401 && body["error"].as_str().unwrap().contains("DFLASH_CONTROL_TOKEN"), "{code} {body}");
    assert_eq!(svc.request("POST", "/reload", None).0, 401);
    assert_eq!(svc.request("GET", "/status", None).0, 200, "reading needs no token");
    assert!(logged(&svc.tail(200), "is not a loopback address and no token is set"));
    svc.stop();

    let sets = [exposed[0], exposed[1], "control.read_only_listen=127.0.0.1:0"];
    let mut svc = Service::start_with_env(&cfg, true, &sets, &[("DFLASH_CONTROL_TOKEN", "s3cret")]);
    svc.wait("running", |s| s["phase"] == "running");
    let post = |headers: &str| http_with(svc.addr, "POST", "/checkpoint", "", headers).unwrap().0;
    assert_eq!(post(""), 401);
    assert_eq!(post("Authorization: Bearer wrong\r\n"), 401);
    assert_eq!(post("Authorization: Bearer s3cret\r\n"), 202);
    let read_only = svc.address("read_only_address");
    assert_eq!(http(read_only, "GET", "/metrics", "").unwrap().0, 200);
    assert_eq!(http(read_only, "GET", "/readyz", "").unwrap().0, 200);
    let refused = http_with(read_only, "POST", "/checkpoint", "", "Authorization: Bearer s3cret\r\n").unwrap().0;
    assert!(refused == 404 || refused == 405, "no POST on the read-only address: {refused}");
    let status = svc.http("GET", "/status", "").1;
    assert!(!status.contains("s3cret"), "the token is never shown");
    let logs = svc.stop();
    assert!(!logs.iter().any(|l| l.contains("s3cret")), "the token is never logged");
    let state = std::fs::read_dir(dir.path().join("ckpt"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ckpt-"));
    for ckpt in state {
        let text = std::fs::read_to_string(ckpt.path().join("trainer_state.json")).unwrap();
        assert!(!text.contains("s3cret"), "nor written into a checkpoint");
    }
}

/// Every error of the control plane is one JSON shape, `{"error": ...}` saying what was wrong: a path no endpoint
/// has, a method its endpoint does not take (405, not 401 for want of a token), an id that is not a number, a body
/// that is not the one asked for, a drafter that does not exist (naming the ids there are).
#[test]
fn every_control_plane_error_is_one_json_shape_that_says_what_was_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let mut svc = Service::start(&config(dir.path(), 2), false, &["optim.epochs=1000"]);
    svc.wait("running", |s| s["phase"] == "running");
    let error = |method: &str, path: &str, body: &str| {
        let (code, text) = svc.http(method, path, body);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{method} {path}: not JSON: {text:?}"));
        (code, v["error"].as_str().unwrap_or_else(|| panic!("{method} {path}: no error: {v}")).to_string())
    };
    let (code, e) = error("GET", "/nope", "");
    assert!(
        code == 404 && e.contains("no endpoint GET /nope") && e.contains("POST /checkpoint, /reload"),
        "{code} {e}"
    );
    let (code, e) = error("GET", "/reload", "");
    assert!(code == 405 && e.contains("/reload does not take GET"), "{code} {e}");
    let (code, e) = error("DELETE", "/status", "");
    assert!(code == 405 && e.contains("/status does not take DELETE"), "{code} {e}");
    let (code, e) = error("POST", "/drafters/abc/fault", r#"{"kind": "panic"}"#);
    assert!(code == 400 && e.contains("the drafter id must be a number"), "{code} {e}");
    let (code, e) = error("POST", "/drafters/0/fault", "not json");
    assert!((400..500).contains(&code) && e.contains("the body must be"), "{code} {e}");
    let (code, e) = error("POST", "/drafters/7/fault", r#"{"kind": "panic"}"#);
    assert!(code == 404 && e == "no drafter 7: the ids are 0 to 1", "{code} {e}");
    let (code, e) = error("POST", "/targets/x/fault", "");
    assert!(code == 400 && e.contains("the target copy id must be a number"), "{code} {e}");
    svc.stop();
}

/// `optim.max_steps` ends the run at exactly that step, looping over the data as many times as it takes (here 37
/// steps make an epoch, `optim.epochs = 1`), and `checkpoint.every_steps` checkpoints the steps it names, not the
/// first boundary after the steps in flight.
#[test]
fn max_steps_ends_the_run_there_and_checkpoints_are_of_the_steps_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["optim.epochs=1", "optim.max_steps=45", "checkpoint.every_steps=10", "checkpoint.keep=10"];
    let (code, logs) = Service::start(&config(dir.path(), 2), false, &sets).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(8)..]);
    // The periodic ones, then the final one; a periodic one that falls due while the one before is still being
    // written (a slow disk, a loaded machine) is skipped, and says so.
    let written = checkpoints_written(&logs);
    let skipped = logs.iter().filter(|l| l.contains("periodic checkpoint at step")).count();
    assert!(written.iter().all(|s| [10, 20, 30, 40, 45].contains(s)) && written.last() == Some(&45), "{written:?}");
    assert_eq!(written.len() + skipped, 5, "written {written:?}, {skipped} skipped");
    let epochs: std::collections::BTreeSet<u64> = std::fs::read_to_string(dir.path().join("ledger.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["epoch"].as_u64())
        .collect();
    assert_eq!(epochs.into_iter().collect::<Vec<_>>(), vec![0, 1], "into a second epoch to reach step 45");
}

/// The built-in demo, `make run`'s recipe (the tiny-tasks target answering the built-in conversations, two drafters
/// on the CPU summing in process, held-out prompts decoded during training), run twice at once, each from nothing:
/// the same answers byte for byte, the same loss, accuracy and learning rate at every step to the last bit, the same
/// weights and the same end line. It failed when the answers were written in the order they finished, which thread
/// timing decides, and the training order followed the file.
#[test]
fn the_built_in_demo_gives_the_same_result_bit_for_bit_on_every_run() {
    let base = tempfile::tempdir().unwrap();
    let recipe = concat!(env!("CARGO_MANIFEST_DIR"), "/config/make-run.toml");
    let runs: Vec<(PathBuf, std::process::Child)> = ["first", "second"]
        .iter()
        .map(|name| {
            let dir = base.path().join(name);
            let mut cmd = Command::new(BIN);
            cmd.args(["--config", recipe, "serve-train"]);
            for set in [
                format!("data.cache_dir={}", dir.join("data").display()),
                format!("checkpoint.dir={}", dir.join("ckpt").display()),
                "data.builtin_conversations=96".into(),
                "optim.max_steps=24".into(),
                "eval.every_steps=12".into(),
                "eval.max_new_tokens=32".into(),
                "control.listen=off".into(),
                "log.format=json".into(),
                "log.level=info,dflash::steps=debug".into(),
            ] {
                cmd.args(["--set", &set]);
            }
            let child = cmd.env_remove("RUST_LOG").stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
            (dir, child)
        })
        .collect();
    let mut results = Vec::new();
    for (dir, child) in runs {
        let o = child.wait_with_output().unwrap();
        let logs: Vec<Value> =
            String::from_utf8_lossy(&o.stderr).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert!(o.status.success(), "{}: {:#?}", dir.display(), &logs[logs.len().saturating_sub(8)..]);
        let steps: Vec<Value> = logs
            .iter()
            .filter(|l| l["target"] == "dflash::steps")
            .map(|l| {
                let f = &l["fields"];
                json!([f["step"], f["loss"], f["accuracy"], f["acceptance"], f["lr"], f["samples"], f["tokens"]])
            })
            .collect();
        let end = logs
            .iter()
            .filter_map(|l| l["fields"]["message"].as_str())
            .find(|m| m.starts_with("decoded acceptance 1.00 ->"))
            .map(String::from);
        let read = |path: &str| std::fs::read(dir.join(path)).unwrap();
        let answers = read("data/tiny-tasks/regenerated.jsonl");
        let weights = read("ckpt/final/model.safetensors");
        let optimizer = read("ckpt/ckpt-000000024/optimizer.safetensors");
        results.push((steps, end, answers, weights, optimizer));
    }
    let (first, second) = (&results[0], &results[1]);
    assert_eq!(first.0.len(), 24, "a line for each step: {:#?}", first.0);
    assert!(first.0.iter().all(|s| s[1].as_f64().is_some_and(|l| l > 0.0)), "{:#?}", first.0);
    assert!(first.2 == second.2, "the built-in answers differ between the runs");
    assert_eq!(first.0, second.0, "the steps' numbers differ between the runs");
    assert!(first.3 == second.3 && first.4 == second.4, "the weights or the optimizer states differ");
    assert!(first.1.is_some(), "the run ends with the decoded acceptance");
    assert_eq!(first.1, second.1);
}

/// The control port is bound before any long work: a second service on a port in use says so at once, not after
/// answering the built-in conversations (minutes on a CPU).
#[test]
fn a_control_port_in_use_is_found_before_any_long_work() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let started = Instant::now();
    let o = Command::new(BIN)
        .args(["--config", config(dir.path(), 1).to_str().unwrap(), "serve-train"])
        .args(["--set", "data.path=builtin", "--set", "target.model=tiny-tasks"])
        .args(["--set", &format!("data.cache_dir={}", dir.path().join("cache").display())])
        .args(["--set", &format!("control.listen=127.0.0.1:{port}")])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("control.listen = 127.0.0.1:{port}: cannot listen")), "{said}");
    assert!(started.elapsed() < Duration::from_secs(20), "found at once: {:?}", started.elapsed());
    assert!(!dir.path().join("cache").exists(), "before the built-in data is made");
}

/// With a model folder and neither `target_layer_ids` nor `mask_token_id`, the taps follow z-lab's rule (8 target
/// layers, 2 draft layers: [1, 5]) and the MASK token is the first embedding row the tokenizer leaves unused; the
/// log says so, and both are kept resolved in the checkpoint's configuration and the export, so a resume reads the
/// same ones.
#[test]
fn a_model_folders_taps_and_mask_are_resolved_once_and_kept() {
    use dflash::model::{Depth, Preset};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    Preset::Tiny
        .spec()
        .build_target(Depth::Full, tch::Device::Cpu, tch::Kind::Float)
        .unwrap()
        .save_hf(&model, usize::MAX)
        .unwrap();
    dflash::data::builtin::write_tiny_tokenizer(&model).unwrap();
    let target = format!("target.model={}", model.display());
    let sets = [target.as_str(), "draft_model.num_hidden_layers=2", "optim.max_steps=6"];
    let cfg = config(dir.path(), 1);
    let (code, logs) = Service::start(&cfg, false, &sets).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(8)..]);
    assert!(logged(&logs, "draft_model.target_layer_ids = auto: [1, 5]"), "{:#?}", &logs[..logs.len().min(20)]);
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("ckpt/ckpt-000000006/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["config"]["draft_model"]["target_layer_ids"], json!([1, 5]), "resolved in the checkpoint");
    let mask = state["config"]["draft_model"]["mask_token_id"].as_i64().expect("the MASK token, resolved");
    assert!(logged(&logs, &format!("draft_model.mask_token_id = auto: {mask} (the first embedding row no token uses")));
    assert!((256..320).contains(&mask), "past the byte tokens, inside the 320 rows: {mask}");
    let exported: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("ckpt/final/config.json")).unwrap()).unwrap();
    assert_eq!(exported["dflash_config"]["target_layer_ids"], json!([1, 5]));
    assert_eq!(exported["dflash_config"]["mask_token_id"], json!(mask));
    // Resumed for two more steps (a complete run resumed as it was trains nothing and serves nothing).
    let more = [target.as_str(), "draft_model.num_hidden_layers=2", "optim.max_steps=8"];
    let (code, logs) = Service::start(&cfg, true, &more).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(8)..]);
    assert!(logged(&logs, "resuming"), "the resolved ids do not count as a changed setting");
}

/// The run logged a progress line at exactly these steps (log.every_steps = 5), each with every field an operator
/// reads, with sane values.
fn assert_progress_lines(logs: &[String], steps: &[u64], total: u64) {
    let lines: Vec<String> = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["fields"]["message"].as_str().map(str::to_string))
        .filter(|m| m.starts_with("step "))
        .collect();
    let at: Vec<u64> = lines.iter().map(|m| m[5..].split(' ').next().unwrap().parse().unwrap()).collect();
    assert_eq!(at, steps, "{lines:#?}");
    for (line, at) in lines.iter().zip(at) {
        // The step, the step the run ends at and the part done; then the time left at the recent rate.
        let percent = (100.0 * at as f64 / total as f64).round();
        assert!(line.starts_with(&format!("step {at} of {total} ({percent:.0}%) · ")), "{line}");
        let left = line.split(" · ").nth(1).unwrap();
        assert!(left.ends_with(" left") && left.starts_with(|c: char| c.is_ascii_digit()), "{line}");
        // "step 10 · epoch 0 · loss 5.2 · accuracy 0.1 · acceptance 1.1 · 13.1 samples/s · feature wait 0.0% · ..."
        let fields: Vec<&str> = line.split(" · ").collect();
        let value = |name: &str| -> f64 {
            let field = fields.iter().find(|f| f.contains(name)).unwrap_or_else(|| panic!("{name} missing: {line}"));
            let number = field.split(' ').find(|w| w.starts_with(|c: char| c.is_ascii_digit())).unwrap();
            number.trim_end_matches('%').parse().unwrap()
        };
        assert!(value("loss").is_finite() && value("loss") > 0.0, "{line}");
        assert!((0.0..=1.0).contains(&value("accuracy")), "{line}");
        assert!(value("acceptance") >= 1.0, "{line}");
        assert!(value("samples/s") > 0.0, "{line}");
        assert!((0.0..=100.0).contains(&value("feature wait")), "{line}");
        assert!(value("lr") > 0.0, "{line}");
        assert_eq!(fields.last(), Some(&"drafters 2/2 live"), "{line}");
    }
}

#[test]
fn chaos_failures_of_every_kind_lose_nothing_and_keep_replicas_identical() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "optim.epochs=12",
        "supervision.max_restarts=3",
        "supervision.restart_window_s=600",
        "supervision.backoff_initial_ms=800",
        "supervision.backoff_max_ms=800",
    ];
    let mut svc = Service::start(&config(dir.path(), 3), false, &sets);
    let mut expected = [0u64; 3];
    svc.wait("step 3", |s| step(s) >= 3);

    // A panic: the survivors keep stepping while the drafter is down, and it rejoins.
    svc.fault(1, "panic");
    let down = svc.wait("drafter 1 down", |s| state(s, 1) != "live");
    let up = svc.wait("drafter 1 back", |s| state(s, 1) == "live");
    expected[1] += 1;
    assert!(step(&up) > step(&down), "survivors advanced while drafter 1 was down: {} -> {}", step(&down), step(&up));

    // An error, and a panic of another drafter while the first is restarting.
    svc.fault(2, "error");
    svc.wait("drafter 2 restarting", |s| state(s, 2) != "live");
    svc.fault(0, "panic");
    expected[2] += 1;
    expected[0] += 1;
    svc.wait("drafter 0 down", |s| state(s, 0) != "live");
    svc.wait("all back", |s| (0..3).all(|i| state(s, i) == "live"));

    // A hang, caught by the step timeout; the thread is abandoned and the drafter restarts.
    svc.fault(1, "hang");
    svc.wait("drafter 1 hung", |s| state(s, 1) != "live");
    expected[1] += 1;
    svc.wait("all back", |s| (0..3).all(|i| state(s, i) == "live"));

    // A failure of the replica a checkpoint is taken from, while the checkpoint is in flight.
    let (code, _) = svc.request("POST", "/checkpoint", None);
    assert!(code == 202 || code == 409);
    svc.fault(0, "panic");
    expected[0] += 1;
    svc.wait("drafter 0 down", |s| state(s, 0) != "live");
    let back = svc.wait("all back, a checkpoint written", |s| {
        (0..3).all(|i| state(s, i) == "live") && !s["last_checkpoint"].is_null()
    });
    let rejoined_at = step(&back);

    // A crash loop: past max_restarts the drafter is marked failed and training goes on without it.
    loop {
        svc.fault(2, "panic");
        let s = svc.wait("drafter 2 down", |s| state(s, 2) != "live");
        if state(&s, 2) == "failed" {
            break;
        }
        let s = svc.wait("drafter 2 back or failed", |s| matches!(state(s, 2).as_str(), "live" | "failed"));
        if state(&s, 2) == "failed" {
            break;
        }
        expected[2] += 1;
    }
    let failed_at = step(&svc.status());
    let s = svc.wait("training continues", |s| step(s) >= failed_at + 5 && s["epoch"].as_u64().unwrap() >= 3);
    assert_eq!(state(&s, 2), "failed");
    for (i, n) in expected.iter().enumerate() {
        assert_eq!(drafter(&s, i)["restarts"].as_u64().unwrap(), *n, "restarts of drafter {i}: {s:#}");
    }
    assert_eq!(s["replicas_diverged"], 0, "replicas must stay bitwise identical: {s:#}");
    assert!(s["replicas_checked_step"].as_u64().unwrap() > rejoined_at, "{s:#}");
    assert_eq!(s["batches_set_aside"], 0);
    live_page_shows_the_run(&svc, &dir.path().join("ckpt"));
    let _ = svc.stop();
    let ids = train_ids(prepared());
    assert!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids) >= 2, "at least two whole epochs");
}

/// The live page (`GET /`) and what it draws: the progress lines' points in step order, the failures and restarts
/// among the recent events, the chart library served by the binary; and the run's TensorBoard event file.
fn live_page_shows_the_run(svc: &Service, run_dir: &std::path::Path) {
    let (code, page) = svc.http("GET", "/", "");
    assert!(code == 200 && page.contains("<title>dflash</title>") && page.contains("assets/uplot.js"), "{code} {page}");
    let (code, js) = svc.http("GET", "/assets/uplot.js", "");
    assert!(code == 200 && js.contains("uPlot"), "{code}");
    let (code, history) = svc.request("GET", "/history", None);
    assert_eq!(code, 200, "{history}");
    let points = history["points"].as_array().unwrap();
    let steps: Vec<u64> = points.iter().map(|p| p["step"].as_u64().unwrap()).collect();
    assert!(steps.len() >= 3 && steps.windows(2).all(|w| w[0] < w[1] && (w[1] - w[0]) % 5 == 0), "{steps:?}");
    assert!(points.iter().all(|p| p["loss"].as_f64().is_some_and(f64::is_finite) && p["lr"].as_f64() > Some(0.0)));
    let events: Vec<&str> = history["events"].as_array().unwrap().iter().filter_map(|e| e["text"].as_str()).collect();
    for wanted in ["drafter failed", "restarting", "drafter marked failed"] {
        assert!(events.iter().any(|t| t.starts_with(wanted)), "no {wanted:?} among the events: {events:#?}");
    }
    assert!(!events.iter().any(|t| t.starts_with("step ")), "progress lines are charted, not listed: {events:#?}");
    let files: Vec<_> = std::fs::read_dir(run_dir.join("tensorboard")).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one event file: {files:?}");
    let name = files[0].file_name().to_string_lossy().to_string();
    let bytes = std::fs::read(files[0].path()).unwrap();
    assert!(name.starts_with("events.out.tfevents.") && bytes.windows(10).any(|w| w == b"train/loss"), "{name}");
}

#[test]
fn a_run_killed_mid_checkpoint_resumes_from_the_previous_valid_one() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let sets = ["checkpoint.every_steps=4", "optim.epochs=4"];
    let mut svc = Service::start(&cfg, false, &sets);
    svc.wait("two checkpoints", |s| s["last_checkpoint"]["step"].as_u64().unwrap_or(0) >= 8);
    svc.fault(0, "checkpoint_stall");
    let _ = svc.request("POST", "/checkpoint", None);
    let ckpt = dir.path().join("ckpt");
    let started = Instant::now();
    let torn = loop {
        let tmp =
            std::fs::read_dir(&ckpt).unwrap().flatten().find(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        if let Some(t) = tmp.filter(|t| t.path().join("optimizer.safetensors").exists()) {
            break t.path();
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the stalled checkpoint never started");
        std::thread::sleep(Duration::from_millis(20));
    };
    svc.signal("-KILL");
    let _ = svc.exit_code();
    assert!(torn.exists(), "the kill left a half-written checkpoint");
    // Also damage the newest complete checkpoint: its manifest must reject it.
    let mut valid: Vec<PathBuf> = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("ckpt-"))
        .collect();
    valid.sort();
    let newest = valid.pop().unwrap();
    let previous = valid.pop().unwrap();
    let weights = newest.join("drafter/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xFF;
    std::fs::write(&weights, bytes).unwrap();

    let (code, logs) = Service::start(&cfg, true, &sets).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(20)..]);
    assert!(!torn.exists(), "the killed write's temporary folder is removed at start-up");
    assert!(logged(&logs, "checkpoint rejected"), "the damaged checkpoint is rejected");
    let resumed: Vec<u64> = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "resuming")
        .filter_map(|v| v["fields"]["step"].as_u64())
        .collect();
    let previous_step: u64 = previous.file_name().unwrap().to_string_lossy()[5..].parse().unwrap();
    assert_eq!(resumed, vec![previous_step], "resumed from the previous valid checkpoint");
    assert!(dir.path().join("ckpt/final/model.safetensors").exists());
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A real Prometheus server (Debian's package) on loopback, scraping `target` every second.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: dflash\n    \
                 static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the prometheus server (Debian package `prometheus`; `make test` installs it)");
        Prometheus { child, addr, _dir: dir }
    }

    /// An instant query's result vector (empty when Prometheus is not up yet).
    fn query(&self, expr: &str) -> Vec<Value> {
        let path = format!("/api/v1/query?query={}", percent_encode(expr));
        let Ok((_, body)) = http(self.addr, "GET", &path, "") else { return vec![] };
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        assert_ne!(v["status"], "error", "{expr}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    fn wait_for(&self, expr: &str) {
        let started = Instant::now();
        while self.query(expr).is_empty() {
            assert!(started.elapsed() < Duration::from_secs(90), "Prometheus never saw {expr}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every PromQL expression of the Grafana dashboard, with whether its panel needs another exporter than serve-train
/// (the DCGM exporter, or `dflash proxy`, whose panels tests/proxy.rs checks).
fn dashboard_queries() -> Vec<(String, String, bool)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("grafana/dashboards/dflash.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap_or("").to_string();
        let dcgm = panel["description"].as_str().is_some_and(|d| d.contains("DCGM exporter"));
        let proxy = title.contains("[proxy]");
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap().to_string();
            assert_eq!(expr.contains("DCGM_"), dcgm, "{title}: DCGM panels, and only they, are tagged");
            assert_eq!(expr.contains("dflash_proxy_"), proxy, "{title}: proxy panels, and only they, are tagged");
            out.push((title.clone(), expr, dcgm || proxy));
        }
    }
    assert!(out.len() > 30, "{} queries", out.len());
    out
}

#[test]
fn a_real_prometheus_scrapes_every_dashboard_query_and_promtool_accepts_the_names() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let publish = format!("publish.dir={}", dir.path().join("published").display());
    let sets = [
        "optim.epochs=1000",
        "eval.every_steps=6",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "supervision.backoff_initial_ms=300",
        &publish,
    ];
    let mut svc = Service::start(&cfg, false, &sets);
    let prometheus = Prometheus::start(svc.addr);
    svc.wait("step 2", |s| step(s) >= 2);

    // A checkpoint, a fault, a reload and an evaluation, so that every panel has something to show.
    let (code, _) = svc.request("POST", "/checkpoint", None);
    assert!(code == 202 || code == 409);
    svc.fault(1, "panic");
    svc.wait("drafter 1 down", |s| state(s, 1) != "live");
    svc.wait("drafter 1 back", |s| state(s, 1) == "live");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("lr = 2e-3", "lr = 1e-3");
    std::fs::write(&cfg, text).unwrap();
    let (code, body) = svc.request("POST", "/reload", None);
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["config_version"], 2, "{body}");
    assert_eq!(body["changes"][0]["key"], "optim.lr", "{body}");
    let s = svc.wait("an evaluation", |s| !s["last_evaluation"].is_null() && !s["last_checkpoint"].is_null());
    let eval = &s["last_evaluation"];
    assert!(eval["decode_acceptance_length"].as_f64().unwrap() >= 1.0, "{eval}");

    prometheus.wait_for(
        "dflash_config_version == 2 and on() dflash_evals_total{result=\"success\"} >= 1 \
         and on() sum(dflash_drafter_restarts_total) >= 1 and on() dflash_checkpoint_last_step > 0",
    );
    std::thread::sleep(Duration::from_secs(3));
    let mut empty = Vec::new();
    for (title, expr, elsewhere) in dashboard_queries() {
        if elsewhere {
            continue;
        }
        let expr = expr.replace("$__rate_interval", "15s");
        if prometheus.query(&expr).is_empty() {
            empty.push(format!("{title}: {expr}"));
        }
    }
    assert!(empty.is_empty(), "dashboard queries without data: {empty:#?}");

    let exposition = svc.metrics();
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`)");
    promtool.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {said}");
    for name in ["dflash_learning_rate{drafter=\"1\"}", "dflash_step", "dflash_config_last_reload_successful"] {
        assert!(metric(&exposition, name).is_some(), "{name} missing");
    }

    // The best evaluated checkpoint is kept beside the last K.
    let best: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("ckpt/best/eval.json")).unwrap()).unwrap();
    assert!(best["decode_acceptance_length"].as_f64().unwrap() >= eval["best"].as_f64().unwrap() - 1e-12);
    assert!(dir.path().join("ckpt/best/drafter/model.safetensors").exists());

    // The first lossless evaluation published v1 (publish.dir): /status names it, the metrics count it, and POST
    // /publish publishes the best checkpoint as the next version at once.
    let published = &svc.status()["published"];
    assert!(published["version"].as_u64().is_some_and(|v| v >= 1), "{published}");
    assert!(dir.path().join("published/current/model.safetensors").exists());
    let (code, body) = svc.request("POST", "/publish", None);
    assert_eq!(code, 201, "{body}");
    // (An evaluation may publish meanwhile: versions only grow.)
    let forced = body["version"].as_u64().unwrap();
    assert!(forced > published["version"].as_u64().unwrap(), "{body}");
    assert!(svc.status()["published"]["version"].as_u64().is_some_and(|v| v >= forced));
    assert!(metric(&svc.metrics(), "dflash_publications_total").is_some_and(|n| n >= 2.0));
    // The next evaluation weighs its checkpoint against the published drafter decoded on the same prompts.
    let s = svc.wait("an evaluation beside the published drafter", |s| {
        s["last_evaluation"]["baseline"]["version"].as_u64().is_some_and(|v| v >= forced)
    });
    let baseline = &s["last_evaluation"]["baseline"]["decode_acceptance_length"];
    assert!(baseline.as_f64().is_some_and(|a| a >= 1.0), "{s}");
    svc.stop();
}

#[test]
fn sighup_changes_the_learning_rate_at_one_step_on_every_drafter_and_refuses_what_cannot_change() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let sets = ["optim.epochs=1000", "supervision.backoff_initial_ms=1500", "supervision.backoff_max_ms=1500"];
    let original = std::fs::read_to_string(&cfg).unwrap().replace("lr = 2e-3", "lr = 2e-3\nschedule = \"constant\"");
    std::fs::write(&cfg, &original).unwrap();
    let lr_of = |text: &str, id: usize| metric(text, &format!("dflash_learning_rate{{drafter=\"{id}\"}}"));
    let mut svc = Service::start(&cfg, false, &sets);
    svc.wait_metrics("the first updates", |t| (0..2).all(|i| lr_of(t, i) == Some(2e-3)));
    assert_eq!(svc.status()["pid"].as_u64(), Some(svc.child.id() as u64), "the pid to signal, in /status");

    // A burst of signals with a new learning rate: one reload, applied at one step on both drafters.
    std::fs::write(&cfg, original.replace("lr = 2e-3", "lr = 1e-3")).unwrap();
    for _ in 0..3 {
        svc.signal("-HUP");
    }
    svc.wait("version 2", |s| s["config_version"] == 2);
    let from = svc.reload_step(2);
    // Round `from + 1` completes only after every member applied round `from` (where the new rate starts) and
    // recorded its rate: the committed step then exceeds `from + 1`.
    let s = svc.wait("the step after the reloaded one committed", |s| step(s) > from + 1);
    let text = svc.metrics();
    assert_eq!((lr_of(&text, 0), lr_of(&text, 1)), (Some(1e-3), Some(1e-3)), "step {} from {from}", step(&s));
    assert_eq!(metric(&text, "dflash_config_reloads_total{result=\"success\"}"), Some(1.0), "a burst is one reload");
    assert_eq!(metric(&text, "dflash_config_last_reload_successful"), Some(1.0));
    assert_eq!(metric(&text, "dflash_config_version"), Some(2.0));
    assert!(logged(&svc.tail(200), "optim.lr 0.002 -> 0.001"), "the log shows old -> new");

    // An invalid file: refused, the run goes on with the old values, the gauge drops to 0.
    std::fs::write(&cfg, "[optim\nlr = 5e-4\n").unwrap();
    svc.signal("-HUP");
    // One scrape is not a snapshot (the exporter reads counters, then gauges): wait for both series.
    let failures = |t: &str| metric(t, "dflash_config_reloads_total{result=\"failure\"}");
    let text = svc.wait_metrics("a refused reload", |t| {
        metric(t, "dflash_config_last_reload_successful") == Some(0.0) && failures(t).is_some_and(|n| n >= 1.0)
    });
    assert_eq!(failures(&text), Some(1.0), "one refused reload counted once");
    let at = step(&svc.status());
    let s = svc.wait("training goes on", |s| step(s) >= at + 3);
    assert_eq!(s["config_version"], 2);
    assert_eq!(lr_of(&svc.metrics(), 0), Some(1e-3));

    // A change to a key that cannot change while running: refused whole (the new learning rate too).
    std::fs::write(&cfg, original.replace("batch_size = 2", "batch_size = 3").replace("lr = 2e-3", "lr = 5e-4"))
        .unwrap();
    let (code, body) = svc.request("POST", "/reload", None);
    assert_eq!(code, 422, "{body}");
    let error = body["error"].as_str().unwrap();
    // The batch size defines the run: a resume would refuse it too, so the advice is a new run.
    assert!(error.contains("data.batch_size") && error.contains("another checkpoint.dir"), "{error}");
    assert!(!error.contains("--resume auto"), "{error}");
    let at = step(&svc.status());
    svc.wait("training goes on", |s| step(s) >= at + 3);
    let text = svc.metrics();
    assert_eq!((lr_of(&text, 0), lr_of(&text, 1)), (Some(1e-3), Some(1e-3)));
    assert_eq!(metric(&text, "dflash_config_last_reload_successful"), Some(0.0));

    // A reload while a drafter restarts applies to the restarted drafter too; a new log level applies at once.
    svc.fault(1, "panic");
    svc.wait("drafter 1 restarting", |s| state(s, 1) == "restarting");
    let debug = original.replace("lr = 2e-3", "lr = 4e-4").replace("[log]\n", "[log]\nlevel = \"debug\"\n");
    std::fs::write(&cfg, debug).unwrap();
    assert!(!logged(&svc.tail(100_000), "\"level\":\"DEBUG\""), "debug lines before the reload");
    let (code, body) = svc.request("POST", "/reload", None);
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["config_version"], 3);
    svc.wait("drafter 1 back", |s| state(s, 1) == "live");
    let text = svc.wait_metrics("drafter 1 trained with the new rate", |t| lr_of(t, 1) == Some(4e-4));
    assert_eq!(lr_of(&text, 0), Some(4e-4));
    assert_eq!(metric(&text, "dflash_config_last_reload_successful"), Some(1.0));
    let (code, _) = svc.request("POST", "/checkpoint", None);
    assert!(code == 202 || code == 409);
    svc.wait("a checkpoint", |s| !s["last_checkpoint"].is_null());
    assert!(logged(&svc.tail(100_000), "\"level\":\"DEBUG\""), "log.level = debug took effect");
    svc.stop();
}

/// With a model folder the taps and the MASK token default to `auto` and resolve at start; a reload that changes only
/// the learning rate compares them as resolved, and applies (it was refused, naming the taps, issue 51).
#[test]
fn a_reload_with_the_taps_left_to_auto_applies() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let export = Command::new(BIN).args(["export", "--preset", "tiny-tasks", "--out"]).arg(&model).output().unwrap();
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    let cfg = config(dir.path(), 1);
    let original =
        std::fs::read_to_string(&cfg).unwrap().replace("model = \"tiny\"", &format!("model = {:?}", model.display()));
    std::fs::write(&cfg, &original).unwrap();
    let mut svc = Service::start(&cfg, false, &["optim.epochs=1000"]);
    svc.wait("step 2", |s| step(s) >= 2);
    std::fs::write(&cfg, original.replace("lr = 2e-3", "lr = 1e-3")).unwrap();
    let (code, body) = svc.request("POST", "/reload", None);
    assert_eq!(code, 200, "{body}");
    let keys: Vec<&str> = body["changes"].as_array().unwrap().iter().filter_map(|c| c["key"].as_str()).collect();
    assert_eq!(keys, ["optim.lr"], "{body}");
    svc.stop();
}

#[test]
fn two_target_copies_each_feed_their_drafter_and_every_sample_is_trained_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let mut svc = Service::start(&cfg, false, &["target.capture_devices=[\"cpu\", \"cpu\"]", "optim.epochs=2"]);
    let s = svc.wait("training", |s| step(s) >= 2);
    let targets = s["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2, "{s:#}");
    for (i, t) in targets.iter().enumerate() {
        assert_eq!(t["drafters"], json!([i]), "{s:#}");
        assert_eq!(t["ready"], true);
    }
    let (code, logs) = svc.exit_code();
    assert_eq!(code, 0);
    let ready = logs.iter().filter(|l| l.contains("\"message\":\"target ready\"")).count();
    assert_eq!(ready, 2, "one target ready line per copy");
    let ids = train_ids(prepared());
    assert!(ids.iter().any(|id| id.starts_with("\"sg-")) && ids.iter().any(|id| !id.starts_with('"')), "{ids:?}");
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "two whole epochs, by the ids given");
}

/// Mixture-of-experts targets (`tiny-moe`: Qwen3-MoE, sparse layers tapped and one dense layer; `tiny-gpt-oss`:
/// sinks, sliding windows, YaRN, clamped experts) train drafters through the service as a dense one does: the run
/// completes, every sample is trained once, the drafter is exported.
#[test]
fn mixture_of_experts_targets_train_drafters_and_every_sample_once() {
    for (preset, summary) in [
        ("tiny-moe", "qwen3_moe, 8 layers, hidden 64, 8 experts (2 per token)"),
        ("tiny-gpt-oss", "gpt_oss, 8 layers, hidden 64, 8 experts (2 per token), 4 layers with a 8-token window"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), 2);
        let svc = Service::start(&cfg, false, &[&format!("target.model={preset}")]);
        let (code, logs) = svc.exit_code();
        assert_eq!(code, 0, "{preset}: {logs:#?}");
        assert!(logged(&logs, "run complete"), "{preset}: {logs:#?}");
        assert!(logged(&logs, summary), "{preset}: {logs:#?}");
        assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &train_ids(prepared())), 1);
        assert!(dir.path().join("ckpt/final/model.safetensors").is_file());
    }
}

/// A target spread over two devices (here both the CPU: `target.spread_to`, captures in two micro-batches) feeds the
/// drafters as a whole one does, and an injected panic in either part restarts it whole with every sample still
/// trained exactly once; with two target copies the setting is refused at start, naming both keys.
#[test]
fn a_target_spread_over_devices_trains_and_spreading_several_copies_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let sets = ["target.model=tiny-moe", "target.spread_to=[\"cpu\"]", "optim.epochs=3", "target.micro_batches=2"];
    let mut svc = Service::start(&cfg, false, &sets);
    svc.wait("training", |s| step(s) >= 2);
    // The spread copy is one supervised unit: a panic in either part restarts it whole, its in-flight requests are
    // sent again, the drafters wait, nothing is lost. The later part first, then the first, once it is back and has
    // trained past the batches it was resent (a batch that fails the target twice in a row is set aside as poison).
    for (part, restarts) in [(1, 1), (0, 2)] {
        let (code, answer) = svc.request("POST", "/targets/0/fault", Some(json!({ "part": part })));
        assert_eq!(code, 200, "{answer}");
        let s = svc.wait("the target's restart", |s| {
            s["targets"][0]["restarts"] == restarts && s["targets"][0]["ready"] == true
        });
        let back = step(&s);
        svc.wait("training after the restart", |s| step(s) >= back + 8);
    }
    for (path, body, wanted) in [
        ("/targets/3/fault", None, 404),
        ("/targets/0/fault", Some(json!({"part": 2})), 404),
        ("/targets/0/fault", Some(json!({"parts": 1})), 400),
    ] {
        let (code, answer) = svc.request("POST", path, body);
        assert_eq!(code, wanted, "{path}: {answer}");
    }
    let (code, logs) = svc.exit_code();
    assert_eq!(code, 0, "{logs:#?}");
    assert!(logged(&logs, "cpu layers 0-2, cpu layers 3-5"), "{logs:#?}");
    for part in [1, 0] {
        let message = format!("injected panic (fault injection) in part {part} (cpu) of the target");
        assert!(logged(&logs, &message), "{logs:#?}");
    }
    let loaded = logs.iter().filter(|l| l.contains("\"message\":\"target loaded\"")).count();
    assert_eq!(loaded, 3, "the copy came back after each failure");
    assert!(logged(&logs, "target restarted; resending"), "{logs:#?}");
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &train_ids(prepared())), 3);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["serve-train", "--config", cfg.to_str().unwrap()])
        .args(["--set", "target.spread_to=[\"cpu\"]", "--set", "target.capture_devices=[\"cpu\", \"cpu\"]"])
        .args(["--set", &format!("checkpoint.dir={}", dir.path().join("other").display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(err.contains("target.spread_to") && err.contains("capture_devices"), "{err}");
}

#[test]
fn the_grafana_dashboard_and_the_prometheus_example_are_well_formed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("grafana/dashboards/dflash.json")).unwrap()).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    let rows: Vec<&str> = panels.iter().filter(|p| p["type"] == "row").map(|p| p["title"].as_str().unwrap()).collect();
    for wanted in ["Health", "Throughput", "Learning", "Fault tolerance", "Checkpoints", "Configuration"] {
        assert!(rows.iter().any(|r| r.starts_with(wanted)), "no {wanted} row in {rows:?}");
    }
    let mut ids: Vec<i64> = panels.iter().map(|p| p["id"].as_i64().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let g = &p["gridPos"];
        assert!(g["x"].as_i64().unwrap() + g["w"].as_i64().unwrap() <= 24, "{} overflows the grid", p["title"]);
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{} uses the dashboard's datasource", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            assert!(!expr.contains("[1m]") && !expr.contains("[5m]"), "{expr}: rates use $__rate_interval");
        }
    }
    let out = Command::new("promtool")
        .args(["check", "config"])
        .arg(root.join("grafana/prometheus.yml"))
        .output()
        .expect("promtool (Debian package `prometheus`)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr));
}

/// `POST /checkpoint` answers with the step the checkpoint will be of (the first step not handed out yet), and
/// that is the checkpoint written; a second request while it is in flight is refused (409).
#[test]
fn a_requested_checkpoint_is_of_the_step_the_answer_names() {
    let dir = tempfile::tempdir().unwrap();
    let mut svc = Service::start(&config(dir.path(), 2), false, &["optim.epochs=1000"]);
    svc.wait("training", |s| step(s) >= 3);
    for _ in 0..3 {
        let (code, body) = svc.request("POST", "/checkpoint", None);
        assert_eq!(code, 202, "{body}");
        let promised = body["step"].as_u64().unwrap();
        let s = svc.wait("the checkpoint", |s| s["last_checkpoint"]["step"].as_u64().is_some_and(|c| c >= promised));
        assert_eq!(s["last_checkpoint"]["step"], promised, "{s:#}");
        let path = std::path::PathBuf::from(s["last_checkpoint"]["path"].as_str().unwrap());
        assert!(path.ends_with(format!("ckpt-{promised:09}")), "{}", path.display());
    }
    let (first, _) = svc.request("POST", "/checkpoint", None);
    let (second, body) = svc.request("POST", "/checkpoint", None);
    assert_eq!((first, second), (202, 409), "{body}");
    svc.stop();
}

/// The shared data's train split written as token rows (`inspect --json`: ids as given, strings and integers).
fn token_row_file(dir: &Path) -> PathBuf {
    let o = Command::new(BIN).args(["inspect", prepared().to_str().unwrap(), "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = dir.join("rows.jsonl");
    std::fs::write(&rows, &o.stdout).unwrap();
    rows
}

/// `data.path` naming a token-row file: its rows are checked and prepared once, `data.holdout` of them kept apart
/// by id, and the rest trained exactly once per epoch across a stop and a resume, with the ids as given.
/// Packed rows (`data.pack`): two epochs train every sample exactly once each across a stop and a resume, in fewer
/// steps than one conversation per row takes; rows too short for the longest sample are refused at start, naming
/// the key and the sample.
#[test]
fn packed_rows_train_every_sample_once_in_fewer_steps() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2);
    let sets = ["data.pack=true", "data.pack_len=384", "optim.epochs=2"];
    let mut first = Service::start(&cfg, false, &sets);
    let s = first.wait("step 3", |s| step(s) >= 3);
    // Samples count conversations, not rows (the learning rate's schedule and the time left follow them).
    let committed = s["samples_committed"].as_u64().unwrap();
    assert!(committed > 2 * 2 * step(&s), "{committed} samples in {} steps of 2 packed rows on 2 drafters", step(&s));
    let _ = first.stop();
    let (code, logs) = Service::start(&cfg, true, &sets).exit_code();
    assert_eq!(code, 0, "{logs:#?}");
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "two whole epochs");
    let ledger = std::fs::read_to_string(dir.path().join("ledger.jsonl")).unwrap();
    let steps = ledger.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()?["step"].as_u64()).max().unwrap();
    // Unpacked, an epoch of batches of 2 conversations on 2 drafters takes ids / 4 steps; packed, at most half.
    let unpacked = 2 * (ids.len() as u64).div_ceil(4);
    assert!(2 * (steps + 1) <= unpacked, "{} packed steps, {unpacked} unpacked, for {} samples", steps + 1, ids.len());
    let o = std::process::Command::new(service_process::BIN)
        .args(["--config", cfg.to_str().unwrap(), "serve-train"])
        .args(["--set", "data.pack=true", "--set", "data.pack_len=16", "--set", "control.listen=off", "--set"])
        .arg(format!("checkpoint.dir={}", dir.path().join("refused").display()))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("data.pack_len = 16") && err.contains("set data.pack_len to at least"), "{err}");
}

#[test]
fn a_token_row_file_trains_exactly_once_across_a_resume_and_keeps_its_holdout_apart() {
    let dir = tempfile::tempdir().unwrap();
    let rows = token_row_file(dir.path());
    let cache = dir.path().join("cache");
    let sets = [
        format!("data.path={}", rows.display()),
        format!("data.cache_dir={}", cache.display()),
        "data.holdout=0.25".into(),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).chain(["optim.epochs=2"]).collect();
    let cfg = config(dir.path(), 2);
    let mut first = Service::start(&cfg, false, &sets);
    first.wait("step 3", |s| step(s) >= 3);
    let logs = first.stop();
    assert!(logged(&logs, "token rows checked and prepared"), "{logs:#?}");
    let (code, logs) = Service::start(&cfg, true, &sets).exit_code();
    assert_eq!(code, 0);
    assert!(logged(&logs, "resuming") && !logged(&logs, "token rows checked and prepared"), "prepared once");

    let copies: Vec<PathBuf> =
        std::fs::read_dir(cache.join("token-rows")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let trained = train_ids(&copies[0]);
    let split = dflash::data::shards::PreparedSplit::open(&copies[0], "holdout", false).unwrap();
    let held: Vec<String> = (0..split.len()).map(|i| split.id(i).to_json().to_string()).collect();
    let given: Vec<String> = std::fs::read_to_string(&rows)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].to_string())
        .collect();
    assert!(held.len() * 8 > given.len() && held.len() * 2 < given.len(), "{} of {}", held.len(), given.len());
    assert!(held.iter().all(|id| !trained.contains(id)), "the holdout split is never trained");
    let mut both: Vec<String> = trained.iter().chain(&held).cloned().collect();
    both.sort();
    let mut given_sorted = given.clone();
    given_sorted.sort();
    assert_eq!(both, given_sorted, "every row is in one split (none is too short to keep)");
    assert!(trained.iter().any(|id| id.starts_with('"')), "string ids as given");
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &trained), 2, "two whole epochs");
}

/// A bad row stops serve-train before any training, naming the file and line.
#[test]
fn a_bad_token_row_is_refused_at_start_with_its_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let rows = token_row_file(dir.path());
    let mut lines: Vec<String> = std::fs::read_to_string(&rows).unwrap().lines().map(String::from).collect();
    lines[2] = json!({"id": "broken", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}).to_string();
    std::fs::write(&rows, lines.join("\n") + "\n").unwrap();
    let cfg = config(dir.path(), 1);
    let o = Command::new(BIN)
        .args(["--config", cfg.to_str().unwrap(), "serve-train"])
        .args(["--set", &format!("data.path={}", rows.display())])
        .args(["--set", &format!("data.cache_dir={}", dir.path().join("cache").display())])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rows.jsonl:3") && stderr.contains("loss_mask has 2"), "{stderr}");
    assert!(
        !dir.path().join("ledger.jsonl").exists()
            || std::fs::read_to_string(dir.path().join("ledger.jsonl")).unwrap().is_empty()
    );
}

/// The tensors of a drafter folder's `model.safetensors`: name -> (dtype, bytes).
fn drafter_tensors(dir: &Path) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(name, t)| (name, (format!("{:?}", t.dtype()), t.data().to_vec()))).collect()
}

/// `draft_model.init`: a new run starts from a published drafter (with lr 0 it exports exactly those weights); a
/// drafter that does not fit is refused at start naming the key to set; a resumed run never reads it.
#[test]
fn a_run_starts_from_a_published_drafter_and_resuming_ignores_it() {
    use dflash::model::{Drafter, DrafterConfig, Init, Preset};
    let dir = tempfile::tempdir().unwrap();
    let spec = Preset::Tiny.spec();
    // The drafter `config()` describes (1 layer, block size 4, the tiny target's taps and MASK), as published: bf16.
    let published = dir.path().join("published");
    let cfg = DrafterConfig::for_target(&spec.target, 1, None, 4, spec.taps.clone(), spec.mask_token_id).unwrap();
    let start = Drafter::new(cfg, tch::Device::Cpu, tch::Kind::Float, Init::Portable(77)).unwrap();
    start.save(&published, tch::Kind::BFloat16).unwrap();
    let init = format!("draft_model.init={}", published.display());

    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let cfg = config(&run, 2);
    let sets = [init.as_str(), "optim.lr=0", "optim.max_steps=3"];
    let (code, logs) = Service::start(&cfg, false, &sets).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(10)..]);
    assert!(logged(&logs, "starts from the published drafter"));
    assert_eq!(drafter_tensors(&run.join("ckpt/final")), drafter_tensors(&published), "lr 0: the start, exported");

    // Resuming: the checkpoint is the start, whatever init says (here: a folder that is not there).
    let gone = format!("draft_model.init={}", dir.path().join("deleted").display());
    let (code, logs) = Service::start(&cfg, true, &[gone.as_str(), "optim.lr=0", "optim.max_steps=5"]).exit_code();
    assert_eq!(code, 0, "{:#?}", &logs[logs.len().saturating_sub(10)..]);
    assert!(logged(&logs, "resuming") && logged(&logs, "draft_model.init is not read"));

    // A drafter that does not fit the run: refused before anything starts, naming what to set.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let o = Command::new(BIN)
        .args(["--config", config(&other, 1).to_str().unwrap(), "serve-train"])
        .args(["--set", &init, "--set", "draft_model.block_size=8", "--set", "draft_model.num_hidden_layers=2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    for needed in ["draft_model.init", "set draft_model.block_size = 4", "set draft_model.num_hidden_layers = 1"] {
        assert!(stderr.contains(needed), "{needed}: {stderr}");
    }
}
