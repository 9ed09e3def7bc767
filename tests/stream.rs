//! `data.stream` through the whole process: `serve-train` waits for the stream's first wave, trains each wave once
//! as an epoch with replay from the base data, leaves out answers that were sampled, and after a stop and a resume
//! takes only the files it had not taken: every streamed conversation in the ledger exactly once, a SIGKILL mid-wave
//! included; with `eval.prompts = "stream"` its evaluations decode the newest waves' held-out conversations.
mod service_process;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use service_process::*;

/// `count` conversations the tiny target can tokenize (the sample data's), as the proxy records them: no id, the
/// request's settings with `temperature`.
fn recorded(count: usize, seed: u64, temperature: f64, dir: &Path) -> Vec<Value> {
    let file = dir.join(format!("sample-{seed}.jsonl"));
    let out = Command::new(BIN)
        .args(["sample-data", "--count", &count.to_string(), "--seed", &seed.to_string(), "--out"])
        .arg(&file)
        .env("DFLASH__LOG__LEVEL", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            json!({"messages": v["messages"], "recorded": {"settings": {"model": "m", "temperature": temperature}}})
        })
        .collect()
}

/// Drops `lines` into the stream folder as `name`, whole: written beside it, then renamed in.
fn drop_in(traffic: &Path, name: &str, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let staging = traffic.parent().unwrap().join(name);
    std::fs::write(&staging, text).unwrap();
    std::fs::rename(&staging, traffic.join(name)).unwrap();
}

/// The ledger's trained ids by epoch, after its rewinds.
fn trained(ledger: &Path) -> BTreeMap<u64, Vec<String>> {
    let mut by_epoch: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for e in ledger_entries(ledger) {
        let ids = e["ids"].as_array().unwrap().iter().map(|i| i.as_str().map_or(i.to_string(), String::from));
        by_epoch.entry(e["epoch"].as_u64().unwrap()).or_default().extend(ids);
    }
    by_epoch
}

fn streamed(ids: &[String], file: &str) -> Vec<String> {
    let mut of: Vec<String> = ids.iter().filter(|i| i.starts_with(file)).cloned().collect();
    of.sort();
    of
}

/// A run's folder with an empty stream folder (`traffic`) and the run's configuration, and the `--set`s of a stream
/// run: the folder looked at every 0.2 s, a wave from 6 conversations, a constant rate, then `more`.
struct StreamRun {
    dir: tempfile::TempDir,
    traffic: PathBuf,
    cfg: PathBuf,
    sets: Vec<String>,
}

impl StreamRun {
    fn new(more: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let traffic = dir.path().join("traffic");
        std::fs::create_dir_all(&traffic).unwrap();
        let cfg = config(dir.path(), 1);
        let mut sets = vec![
            format!("data.stream={}", traffic.display()),
            "data.stream_min_conversations=6".into(),
            "data.stream_poll_s=0.2".into(),
            "optim.schedule=\"constant\"".into(),
        ];
        sets.extend(more.iter().map(|s| s.to_string()));
        StreamRun { dir, traffic, cfg, sets }
    }

    fn start(&self, resume: bool) -> Service {
        Service::start(&self.cfg, resume, &self.sets.iter().map(String::as_str).collect::<Vec<_>>())
    }
}

#[test]
fn a_run_learns_each_wave_of_the_stream_once_across_a_restart() {
    let run = StreamRun::new(&["data.stream_mix=0.5"]);
    let (dir, traffic) = (&run.dir, &run.traffic);
    let ledger = dir.path().join("ledger.jsonl");
    let wave_ids = |file: &str, count: usize| -> Vec<String> {
        let mut ids: Vec<String> = (0..count).map(|i| format!("{file}#{i}")).collect();
        ids.sort();
        ids
    };

    let mut svc = run.start(false);
    svc.wait("running", |s| s["phase"] == "running");
    std::thread::sleep(std::time::Duration::from_millis(800));
    let s = svc.status();
    assert_eq!(step(&s), 0, "nothing to train before the first wave");
    assert_eq!(s["stream"], json!({"waves": 0, "waiting_for_a_wave": true, "pending_conversations": 0}), "{s}");
    assert_eq!(s["progress"]["open_ended"], true, "{s}");
    assert_eq!(svc.http("GET", "/readyz", "").0, 200, "waiting for traffic is not a fault");
    // Eight greedy answers, then two sampled ones (left out).
    let mut first = recorded(8, 11, 0.0, dir.path());
    first.extend(recorded(2, 12, 0.8, dir.path()));
    drop_in(traffic, "a.jsonl", &first);
    let of_epoch =
        |epoch: u64, file: &str| streamed(&trained(&ledger).remove(&epoch).unwrap_or_default(), file).join(",");
    svc.poll("the first wave trained", |_| of_epoch(0, "a.jsonl"), |s| *s == wave_ids("a.jsonl", 8).join(","));
    let text = svc.metrics();
    let count = |outcome: &str| metric(&text, &format!("dflash_stream_conversations_total{{outcome=\"{outcome}\"}}"));
    assert_eq!(
        (count("taken"), count("sampled"), metric(&text, "dflash_stream_waves")),
        (Some(8.0), Some(2.0), Some(1.0))
    );
    let logs = svc.stop();
    assert!(logged(&logs, "wave 1 made (2 sampled answers"), "{:#?}", &logs[logs.len().saturating_sub(20)..]);

    let mut again = run.start(true);
    drop_in(traffic, "b.jsonl", &recorded(6, 13, 0.0, dir.path()));
    again.poll("the second wave trained", |_| of_epoch(1, "b.jsonl"), |s| *s == wave_ids("b.jsonl", 6).join(","));
    again.stop();

    let base: std::collections::HashSet<String> =
        train_ids(prepared()).into_iter().map(|i| i.trim_matches('"').to_string()).collect();
    let by_epoch = trained(&ledger);
    assert_eq!(by_epoch.keys().copied().collect::<Vec<_>>(), [0, 1], "one epoch a wave: {by_epoch:?}");
    for (epoch, (file, count)) in [(0u64, ("a.jsonl", 8)), (1, ("b.jsonl", 6))] {
        let ids = &by_epoch[&epoch];
        let (new, replay): (Vec<&String>, Vec<&String>) = ids.iter().partition(|i| i.starts_with(file));
        assert_eq!(new.len(), count, "epoch {epoch}: each streamed conversation once: {ids:?}");
        assert_eq!(replay.len(), count, "epoch {epoch}: as much replay as new (stream_mix 0.5)");
        let mut unique = replay.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), replay.len(), "replay without repeats: {replay:?}");
        // Replay comes from before the wave: the base data, and for the second wave the first's conversations.
        let earlier = |i: &String| base.contains(i) || (epoch == 1 && i.starts_with("a.jsonl#"));
        assert!(replay.iter().all(|i| earlier(i)), "epoch {epoch}: {replay:?}");
    }
}

/// `eval.prompts = "stream"`: each wave holds `data.holdout` of its conversations out, never trains them, and the
/// evaluations after it decode them (the newest wave's first): the drafter is measured on recent traffic.
/// Fewer conversations than a wave takes: `/status` and the metrics say how many wait and when they make a wave by
/// having waited `data.stream_max_wait_s`.
#[test]
fn a_quiet_stream_says_what_waits_and_when_it_trains() {
    let run = StreamRun::new(&["data.stream_max_wait_s=3600"]);
    let mut svc = run.start(false);
    svc.wait("running", |s| s["phase"] == "running");
    drop_in(&run.traffic, "a.jsonl", &recorded(2, 31, 0.0, run.dir.path()));
    let stream =
        svc.poll("two conversations waiting", |s| s.status()["stream"].clone(), |s| s["pending_conversations"] == 2);
    let due = stream["wave_due_in_s"].as_f64().unwrap_or(-1.0);
    assert!(due > 3500.0 && due <= 3600.0, "a file sealed just now waits the whole bound: {stream}");
    assert_eq!(stream["waves"], 0, "{stream}");
    let text = svc.metrics();
    assert_eq!(metric(&text, "dflash_stream_pending_conversations"), Some(2.0));
    let due = metric(&text, "dflash_stream_wave_due_seconds").unwrap_or(-1.0);
    assert!(due > 3500.0 && due <= 3600.0, "{due}");
    svc.stop();
}

#[test]
fn evaluations_decode_the_newest_held_out_traffic() {
    let run = StreamRun::new(&[
        "data.holdout=0.5",
        "eval.prompts=\"stream\"",
        "eval.every_steps=2",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
    ]);
    let (dir, traffic) = (&run.dir, &run.traffic);
    let mut svc = run.start(false);
    svc.wait("running", |s| s["phase"] == "running");
    drop_in(traffic, "a.jsonl", &recorded(16, 21, 0.0, dir.path()));
    let evals = dir.path().join("ckpt/evals.jsonl");
    svc.poll(
        "an evaluation on the wave's held-out traffic",
        |s| format!("{}\n{}", s.tail(400).join("\n"), std::fs::read_to_string(&evals).unwrap_or_default()),
        |seen| seen.contains("evaluation: recent traffic") && seen.contains("decode_acceptance_length"),
    );
    let logs = svc.stop();
    let root = dir.path().join("ckpt/stream/wave-00001");
    let ids = |split: &str| -> Vec<String> {
        let s = dflash::data::shards::PreparedSplit::open(&root, split, false).unwrap();
        (0..s.len()).map(|i| s.id(i).to_json().as_str().unwrap().to_string()).collect()
    };
    let (train, held) = (ids("train"), ids("holdout"));
    assert!(!held.is_empty() && !train.is_empty(), "{train:?} {held:?}");
    let trained: Vec<String> = trained(&dir.path().join("ledger.jsonl")).into_values().flatten().collect();
    assert!(held.iter().all(|h| !trained.contains(h)), "held-out traffic is never trained: {held:?}");
    assert!(logged(&logs, "evaluation: recent traffic"), "{:#?}", &logs[logs.len().saturating_sub(20)..]);
}

/// The trainer killed (SIGKILL) in the middle of a wave, then resumed: the wave goes on from the last checkpoint and
/// every streamed conversation is in the ledger exactly once (its rewinds applied).
#[test]
fn a_trainer_killed_mid_wave_resumes_it_exactly_once() {
    let run = StreamRun::new(&["checkpoint.every_steps=4"]);
    let (dir, traffic) = (&run.dir, &run.traffic);
    let mut svc = run.start(false);
    svc.wait("running", |s| s["phase"] == "running");
    drop_in(traffic, "a.jsonl", &recorded(40, 31, 0.0, dir.path()));
    svc.wait("the wave half trained", |s| step(s) >= 10);
    svc.signal("-KILL");
    let (code, _) = svc.exit_code();
    assert_eq!(code, -1, "killed");
    let mut again = run.start(true);
    let ledger = dir.path().join("ledger.jsonl");
    let of_wave = |t: &BTreeMap<u64, Vec<String>>| streamed(t.get(&0).map_or(&[][..], |v| v.as_slice()), "a.jsonl");
    again.poll("the wave trained", |_| of_wave(&trained(&ledger)).len(), |n| *n >= 40);
    again.stop();
    let ids = of_wave(&trained(&ledger));
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!((ids.len(), unique.len()), (40, 40), "each streamed conversation once: {ids:?}");
}
