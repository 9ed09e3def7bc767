//! Several hosts as real processes: three `serve-train` processes on loopback form one run (rank 0 serves the c10d
//! store, assigns every host's batches and keeps the ledger). One host is killed with SIGKILL mid-run and started
//! again: the others keep stepping, it rejoins from a live host, every sample of both epochs is committed exactly
//! once, rank 0's replica check (which covers every host's drafters) never finds them apart, and all three processes
//! end with the run.
mod service_process;

use std::net::TcpListener;

use service_process::*;

const HOSTS: usize = 3;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn three_hosts_train_one_run_and_a_killed_host_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let port = free_port().to_string();
    let sets = |rank: usize| -> Vec<String> {
        vec![
            format!("cluster.hosts={HOSTS}"),
            format!("cluster.rank={rank}"),
            "cluster.master_addr=127.0.0.1".into(),
            format!("cluster.master_port={port}"),
            "cluster.round_timeout_s=8".into(),
            "cluster.rendezvous_timeout_s=120".into(),
            "optim.epochs=2".into(),
            "supervision.check_replicas_every=2".into(),
            "supervision.step_timeout_s=30".into(),
            "checkpoint.every_steps=10".into(),
        ]
    };
    let start = |rank: usize| {
        let sets = sets(rank);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        Service::start(&cfg, false, &sets)
    };
    let mut rank0 = start(0);
    let followers: Vec<Service> = (1..HOSTS).map(start).collect();
    let mut followers = followers.into_iter();
    let rank1 = followers.next().unwrap();
    let rank2 = followers.next().unwrap();

    let before = rank0.wait("the run to pass step 6", |s| s["step"].as_u64().is_some_and(|st| st >= 6));
    let hosts = |s: &serde_json::Value| -> Vec<(u64, u64)> {
        let others = s["other_hosts"].as_array().cloned().unwrap_or_default();
        others.iter().map(|h| (h["rank"].as_u64().unwrap(), h["generation"].as_u64().unwrap())).collect()
    };
    assert_eq!((before["host_role"].as_str(), hosts(&before)), (Some("rank 0"), vec![(1, 1), (2, 1)]));
    let follower = rank1.status();
    assert_eq!((follower["host_role"].as_str(), hosts(&follower)), (Some("follower"), vec![]), "{follower:#}");
    rank2.signal("-9");
    let (code, _) = rank2.exit_code();
    assert_eq!(code, -1, "killed by a signal");
    // The others step on without host 2 (its round closes at the deadline, or at once when it comes back).
    let after_kill = step(&before) + 3;
    rank0.wait("the run to step on without host 2", |s| step(s) >= after_kill);
    let rank2 = start(2);
    let rejoined = rank0.poll(
        "host 2 to rejoin",
        |s| s.tail(400).join("\n"),
        |logs| logs.lines().any(|l| l.contains("host joined the run") && l.contains("\"generation\":2")),
    );
    assert!(rejoined.contains("\"host\":2"), "{rejoined}");
    // Replicas across hosts, host 2's new one among them, agree after it came back.
    let now = rank0.status();
    assert_eq!(hosts(&now), vec![(1, 1), (2, 2)], "host 2 is back as its second generation");
    let joined_at = step(&now);
    let checked = rank0.wait("a replica check after host 2 rejoined", |s| {
        s["replicas_checked_step"].as_u64().is_some_and(|c| c > joined_at + 2) || s["phase"] != "running"
    });
    assert_eq!(checked["replicas_diverged"], 0, "{checked:#}");
    assert!(checked["replicas_checked_step"].as_u64().is_some_and(|c| c > joined_at + 2), "{checked:#}");

    let (code0, logs0) = rank0.exit_code();
    assert_eq!(code0, 0, "{:#?}", &logs0[logs0.len().saturating_sub(30)..]);
    for (rank, host) in [(1, rank1), (2, rank2)] {
        let (code, logs) = host.exit_code();
        assert_eq!(code, 0, "host {rank}: {:#?}", &logs[logs.len().saturating_sub(30)..]);
        assert!(logged(&logs, "rank 0 ended the run"), "host {rank}");
        // Its reads of the store time out five times a second while it waits for its next assignment: decisions,
        // which libtorch must not log as warnings.
        assert!(!logged(&logs, "waitForInput"), "host {rank}");
    }
    assert!(!logged(&logs0, "replicas diverged"));
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "both epochs, every sample once");
    // Rank 0 alone wrote checkpoints; the others left checkpoint.dir alone.
    assert!(!checkpoints_written(&logs0).is_empty());
}

/// The rendezvous host is the run's single point: when rank 0 is killed the others checkpoint their replica (newer
/// than rank 0's newest checkpoint) into folders of their own and exit with 75 (restart with `--resume auto`); rank 0
/// resumes from the newest of them, here on two hosts instead of three, and the ledger still has every sample of
/// both epochs once. The run began with the paper's slot weights, as runs did before D-PACE became the default, and
/// the hosts resume without naming them: rank 0 keeps them from its checkpoint, the other host from rank 0.
#[test]
fn losing_rank_0_leaves_the_others_checkpoints_and_the_run_resumes_from_the_newest_on_fewer_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let start = |rank: usize, hosts: usize, port: &str, resume: bool| {
        let sets = [
            format!("cluster.hosts={hosts}"),
            format!("cluster.rank={rank}"),
            "cluster.master_addr=127.0.0.1".into(),
            format!("cluster.master_port={port}"),
            "cluster.round_timeout_s=8".into(),
            "optim.epochs=3".into(),
            "supervision.step_timeout_s=30".into(),
            "checkpoint.every_steps=12".into(),
        ];
        let mut sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        if !resume {
            sets.push("objective.weights=decay");
        }
        Service::start(&cfg, resume, &sets)
    };
    let port = free_port().to_string();
    let mut rank0 = start(0, 3, &port, false);
    let followers: Vec<Service> = (1..3).map(|r| start(r, 3, &port, false)).collect();
    let lines = |logs: &String| logs.lines().map(String::from).collect::<Vec<_>>();
    let logs = rank0.poll("a checkpoint", |s| s.tail(200).join("\n"), |l| !checkpoints_written(&lines(l)).is_empty());
    // Killed a few steps past its first checkpoint (the next one is 12 steps later).
    let first = checkpoints_written(&lines(&logs)).into_iter().min().unwrap();
    rank0.wait("three steps past it", |s| step(s) >= first + 3);
    rank0.signal("-9");
    let (_, logs0) = rank0.exit_code();
    let rank0_newest = checkpoints_written(&logs0).into_iter().max().unwrap();
    let mut written = Vec::new();
    for (rank, host) in (1..).zip(followers) {
        let (code, logs) = host.exit_code();
        let tail = &logs[logs.len().saturating_sub(20)..];
        assert_eq!(code, 75, "host {rank}: {tail:#?}");
        assert!(logged(&logs, "the rendezvous host is gone"), "host {rank}");
        assert!(logged(&logs, "checkpointed this host's replica of the run"), "host {rank}: {tail:#?}");
        let own = dir.path().join("ckpt").join("survivors").join(format!("host-{rank}"));
        let steps: Vec<u64> = std::fs::read_dir(&own)
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().to_string_lossy().strip_prefix("ckpt-")?.parse().ok())
            .collect();
        assert_eq!(steps.len(), 1, "host {rank}: {steps:?}");
        written.push(steps[0]);
    }
    let newest = written.iter().copied().max().unwrap();
    assert!(
        newest > rank0_newest,
        "the others' replicas ({written:?}) are newer than rank 0's checkpoint {rank0_newest}"
    );

    // Resumed on two hosts (a new store on a new port, as a restarted job gets).
    let port = free_port().to_string();
    let rank0 = start(0, 2, &port, true);
    let rank1 = start(1, 2, &port, true);
    let (code0, logs0) = rank0.exit_code();
    assert_eq!(code0, 0, "{:#?}", &logs0[logs0.len().saturating_sub(30)..]);
    let resumed = logs0.iter().find(|l| l.contains("resuming the checkpoint another host wrote")).expect("resumed");
    assert!(resumed.contains(&format!("\"step\":{newest}")), "{resumed}");
    let (code1, logs1) = rank1.exit_code();
    assert_eq!(code1, 0, "{:#?}", &logs1[logs1.len().saturating_sub(30)..]);
    let kept = |logs: &[String], why: &str| logs.iter().any(|l| l.contains("objective.weights") && l.contains(why));
    assert!(kept(&logs0, "as the run began with it"), "rank 0 keeps the run's slot weights");
    assert!(kept(&logs1, "as rank 0 runs it"), "host 1 takes rank 0's slot weights");
    assert!(!dir.path().join("ckpt").join("survivors").exists(), "the others' folder is moved aside");
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 3, "three epochs, every sample once");
}

/// Two hosts whose rounds tolerate a long wait: hang budget 4 s (`step_timeout_s`), rounds closing after 60 s,
/// rank 0 lost after `leader_s` of silence.
fn pair(cfg: &std::path::Path, port: u16, leader_s: u64, epochs: u64) -> (Service, Service) {
    let start = |rank: usize| {
        let sets = [
            "cluster.hosts=2".to_string(),
            format!("cluster.rank={rank}"),
            "cluster.master_addr=127.0.0.1".into(),
            format!("cluster.master_port={port}"),
            "cluster.round_timeout_s=60".into(),
            format!("cluster.leader_timeout_s={leader_s}"),
            format!("optim.epochs={epochs}"),
            "supervision.step_timeout_s=4".into(),
            "checkpoint.every_steps=10".into(),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        Service::start(cfg, false, &sets)
    };
    (start(0), start(1))
}

/// Rank 0 stopped (SIGSTOP) for 8 s, twice the hang budget but under `cluster.leader_timeout_s`: nobody is failed
/// for it (rank 0's drafters were computing or waiting while it did not run; the follower's waited for rank 0), the
/// run goes on and completes on both hosts, and every sample of both epochs is committed once.
#[test]
fn a_frozen_rank_0_costs_time_not_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let (mut rank0, rank1) = pair(&cfg, free_port(), 30, 2);
    let before = step(&rank0.wait("the run to pass step 4", |s| step(s) >= 4));
    rank0.signal("-STOP");
    std::thread::sleep(std::time::Duration::from_secs(8));
    rank0.signal("-CONT");
    rank0.wait("the run to step on", |s| step(s) >= before + 4);
    let (code0, logs0) = rank0.exit_code();
    let (code1, logs1) = rank1.exit_code();
    for (rank, code, logs) in [(0, code0, &logs0), (1, code1, &logs1)] {
        let tail = &logs[logs.len().saturating_sub(30)..];
        assert_eq!(code, 0, "host {rank}: {tail:#?}");
        let failed: Vec<&String> = logs.iter().filter(|l| l.contains("drafter failed")).collect();
        assert!(failed.is_empty(), "host {rank}: {failed:#?}");
    }
    assert!(logged(&logs0, "this process did not run for"), "rank 0 knows it was stopped");
    assert!(!logged(&logs1, "rank 0 is lost"));
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "both epochs, every sample once");
}

/// Rank 0 silent past `cluster.leader_timeout_s` (4 s): the follower takes it for lost, checkpoints its replica
/// (kept intact: its drafters were not failed for waiting) under `survivors/` and exits 75, as when rank 0 is killed;
/// rank 0, continued, finishes the run alone with every sample once.
#[test]
fn a_rank_0_silent_past_the_leader_timeout_leaves_the_follower_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let (mut rank0, rank1) = pair(&cfg, free_port(), 4, 2);
    rank0.wait("the run to pass step 4", |s| step(s) >= 4);
    rank0.signal("-STOP");
    let (code1, logs1) = rank1.exit_code();
    rank0.signal("-CONT");
    let tail = &logs1[logs1.len().saturating_sub(30)..];
    assert_eq!(code1, 75, "{tail:#?}");
    assert!(logged(&logs1, "rank 0 is lost: no answer for"), "{tail:#?}");
    assert!(logged(&logs1, "checkpointed this host's replica of the run"), "{tail:#?}");
    let failed: Vec<&String> = logs1.iter().filter(|l| l.contains("drafter failed")).collect();
    assert!(failed.is_empty(), "its replica was kept intact: {failed:#?}");
    let own = dir.path().join("ckpt").join("survivors").join("host-1");
    assert_eq!(std::fs::read_dir(&own).map(|d| d.count()).unwrap_or(0), 1, "{own:?}");
    let (code0, logs0) = rank0.exit_code();
    assert_eq!(code0, 0, "{:#?}", &logs0[logs0.len().saturating_sub(30)..]);
    let ids = train_ids(prepared());
    assert_eq!(assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids), 2, "both epochs, every sample once");
}

/// A follower stopped for 13 s, past the silence of its beat that makes rank 0 drop it (10 s): rank 0 trains on
/// without it; when it continues it learns from rank 0's membership that it was dropped, is not ready meanwhile (its
/// /status says why), enters the run anew as its second generation, and the run completes with every sample once.
#[test]
fn a_follower_dropped_while_stopped_is_not_ready_until_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    // The run must outlast the follower's stop: a release build's steps are about three times a debug build's.
    let epochs = if cfg!(debug_assertions) { 4 } else { 12 };
    let (mut rank0, mut rank1) = pair(&cfg, free_port(), 30, epochs);
    rank0.wait("the run to pass step 4", |s| step(s) >= 4);
    rank1.signal("-STOP");
    std::thread::sleep(std::time::Duration::from_secs(13));
    rank1.signal("-CONT");
    let out = rank1.wait("the follower to say it is out of the run", |s| s["ready"] == false);
    let problems = out["problems"].to_string();
    assert!(problems.contains("rank 0 dropped this host"), "{out:#}");
    rank1.wait("the follower to be back in the run", |s| s["ready"] == true);
    let (code0, logs0) = rank0.exit_code();
    let (code1, logs1) = rank1.exit_code();
    assert_eq!(code0, 0, "{:#?}", &logs0[logs0.len().saturating_sub(30)..]);
    assert_eq!(code1, 0, "{:#?}", &logs1[logs1.len().saturating_sub(30)..]);
    let rejoined = logs0.iter().any(|l| l.contains("host joined the run") && l.contains("\"generation\":2"));
    assert!(rejoined, "rank 0 took it back as its second generation");
    let ids = train_ids(prepared());
    assert_eq!(
        assert_exactly_once(&dir.path().join("ledger.jsonl"), &ids),
        epochs as usize,
        "every epoch, every sample once"
    );
}

/// A host waiting for the others serves its control plane meanwhile: /healthz answers, /readyz is 503 and /status
/// says the phase (`rendezvous`) and what it waits for.
#[test]
fn a_host_waiting_for_the_others_answers_its_control_plane() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let port = free_port();
    let sets = [
        "cluster.hosts=2".to_string(),
        "cluster.rank=1".into(),
        "cluster.master_addr=127.0.0.1".into(),
        format!("cluster.master_port={port}"),
        "cluster.rendezvous_timeout_s=60".into(),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let waiting = Service::start(&cfg, false, &sets);
    assert_eq!(waiting.http("GET", "/healthz", "").0, 200);
    let (code, ready) = waiting.request("GET", "/readyz", None);
    assert_eq!((code, &ready["phase"]), (503, &serde_json::json!("rendezvous")), "{ready}");
    let status = waiting.status();
    assert_eq!((&status["phase"], &status["ready"]), (&serde_json::json!("rendezvous"), &serde_json::json!(false)));
    let problems = status["problems"].to_string();
    assert!(problems.contains(&format!("waiting for rank 0's store at 127.0.0.1:{port}")), "{status:#}");
    let (code, refused) = waiting.request("POST", "/checkpoint", None);
    assert_eq!(code, 503, "{refused}");
}

/// A follower pointed at a port where something else listens (it accepts and never answers) gives up within its
/// rendezvous deadline, naming the address, in a few lines (libtorch's C++ stack is not among them).
#[test]
fn a_follower_pointed_at_something_that_is_not_a_store_gives_up_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().take(64).collect();
        std::thread::sleep(std::time::Duration::from_secs(3600));
        drop(held);
    });
    let started = std::time::Instant::now();
    let mut child = follower(&cfg, port, 3)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = started + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the follower still waits after 60 s with a 3 s rendezvous deadline");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(took < std::time::Duration::from_secs(20), "gave up after {took:?}");
    assert!(stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("c10d store"), "{stderr}");
    assert!(!stderr.contains("Exception raised from"), "libtorch's C++ stack in the error: {stderr}");
}

/// A follower whose rendezvous host is not there (nothing listens) gives up at its deadline with one line naming
/// the address: libtorch's log of each failed attempt, with its C++ stack, is kept out unless TORCH_CPP_LOG_LEVEL asks.
#[test]
fn a_missing_rendezvous_host_is_one_line_not_a_cpp_stack() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let port = free_port();
    let out = follower(&cfg, port, 2).env_remove("TORCH_CPP_LOG_LEVEL").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
    assert!(!stderr.contains("Exception raised from") && !stderr.contains("frame #"), "{stderr}");
}

/// A follower whose drafter is not rank 0's (2 layers against 1) is refused when it joins, naming the key and both
/// values, instead of restarting on a reshape error; one whose learning rate differs joins, saying rank 0's applies.
#[test]
fn a_follower_with_another_drafter_is_refused_at_join() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 1);
    let port = free_port();
    let rank0_sets = [
        "cluster.hosts=2".to_string(),
        "cluster.rank=0".into(),
        "cluster.master_addr=127.0.0.1".into(),
        format!("cluster.master_port={port}"),
        "cluster.rendezvous_timeout_s=60".into(),
    ];
    let rank0 = Service::start(&cfg, false, &rank0_sets.iter().map(String::as_str).collect::<Vec<_>>());
    let joining = |set: &str| {
        let mut c = follower(&cfg, port, 60);
        c.args(["--set", set]);
        c
    };
    let started = std::time::Instant::now();
    let out = joining("draft_model.num_hidden_layers=2").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "refused after {:?}", started.elapsed());
    assert!(stderr.contains("draft_model.num_hidden_layers = 2 here, 1 on rank 0"), "{stderr}");
    assert!(!stderr.contains("restart"), "refused, not restarted: {stderr}");
    // A different lr joins (rank 0's applies, said once); stopped once it has said so.
    let mut joins = joining("optim.lr=5e-3").stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut said = String::new();
    let reader = std::io::BufReader::new(joins.stderr.take().unwrap());
    for line in std::io::BufRead::lines(reader) {
        let line = line.unwrap();
        said.push_str(&line);
        said.push('\n');
        if line.contains("optim.lr") || said.lines().count() > 400 {
            break;
        }
    }
    joins.kill().unwrap();
    let _ = joins.wait();
    drop(rank0);
    assert!(said.contains("optim.lr = 0.005 here: rank 0's 0.002 applies to the whole run"), "{said}");
}

/// `serve-train` as host 1 of 2 whose rank 0 serves its store at `127.0.0.1:port`, waiting `rendezvous_s` for it.
fn follower(cfg: &std::path::Path, port: u16, rendezvous_s: u64) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_dflash"));
    c.arg("serve-train").arg("--config").arg(cfg).env_remove("RUST_LOG");
    for set in [
        "cluster.hosts=2".to_string(),
        "cluster.rank=1".into(),
        "cluster.master_addr=127.0.0.1".into(),
        format!("cluster.master_port={port}"),
        format!("cluster.rendezvous_timeout_s={rendezvous_s}"),
        "control.listen=off".into(),
    ] {
        c.args(["--set", &set]);
    }
    c
}
