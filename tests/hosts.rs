//! Several hosts through their public interfaces: each host is a `Collective` linked to the others by a `HostLink`
//! over one c10d store on loopback (threads stand in for the drafters; a host "killed" stops without a word and
//! drops its link). What must hold: the hosts found the run with rank 0's state, every host applies the same sum
//! bit for bit, a killed host leaves the quorum and the others go on, the restarted host takes a live host's state
//! and contributes again, samples count across hosts, and every host applies rank 0's hyperparameters.
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dflash::cluster::background::Background;
use dflash::cluster::launch::HostPlacement;
use dflash::data::loader::BatchId;
use dflash::ffi::store::Store;
use dflash::train::collective::{Collective, CollectiveError, Contribution, GradientSum, JoinBuffers, RoundReport};
use dflash::train::link::HostLink;
use dflash::train::objective::{Metrics, ObjectiveKnobs};
use dflash::train::optim::{Hyper, LrSchedule, Progress, ScheduleKind};
use dflash::train::step::StepSettings;
use tch::Tensor;

const LAST_STEP: u64 = 12;

fn settings(lr: f64) -> StepSettings {
    let hyper = Hyper {
        schedule: LrSchedule { kind: ScheduleKind::Constant, lr, warmup_steps: 0, total_steps: 1, min_lr_ratio: 0.0 },
        progress: Progress::Steps,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        grad_clip: None,
        muon: None,
    };
    StepSettings { hyper, objective: ObjectiveKnobs { num_anchors: 4, gamma: None } }
}

/// What each host saw: its members' state after each step, its round reports.
#[derive(Default)]
struct Log {
    /// `(rank, member, step)` -> the master weights after applying round `step - 1`.
    states: BTreeMap<(usize, usize, u64), Vec<f32>>,
    /// The state each host's founding member started from, `(rank, generation)`.
    entered: BTreeMap<(usize, u64), (u64, Vec<f32>)>,
    reports: Vec<(usize, RoundReport)>,
    /// With NCCL: `(rank, member, step)` -> the ring the member found.
    rings: BTreeMap<(usize, usize, u64), RingSeen>,
    /// With NCCL: `(rank, member, step)` -> whether the run applied the round's update.
    applied: BTreeMap<(usize, usize, u64), bool>,
}

/// A ring's identity, the member's rank in it and the ring's size.
type RingSeen = (Vec<u8>, usize, usize);

struct Host {
    rank: usize,
    generation: u64,
    collective: Arc<Collective>,
    /// Its beat (the service's feed reader beats on hosts other than rank 0), every second until the host is
    /// dropped ("killed").
    _beats: Background,
}

/// Beats for `link` every second until dropped.
fn beats(link: Arc<HostLink>) -> Background {
    Background::spawn("beats", move |stop| {
        while !stop.load(Ordering::SeqCst) {
            let _ = link.beat();
            for _ in 0..20 {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
    .unwrap()
}

fn host(rank: usize, port: u16, sum: GradientSum, log: &Arc<Mutex<Log>>) -> Host {
    host_with_deadline(rank, port, sum, Duration::from_millis(800), log)
}

/// A host whose rounds close at `deadline` at the latest.
fn host_with_deadline(rank: usize, port: u16, sum: GradientSum, deadline: Duration, log: &Arc<Mutex<Log>>) -> Host {
    let placement = HostPlacement {
        hosts: 3,
        rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        // The test serves the store itself, as torchrun's agent does.
        serves_store: false,
        rendezvous_timeout: Duration::from_secs(20),
        leader_timeout: Duration::from_secs(60),
    };
    let link = Arc::new(HostLink::open(&placement, deadline).unwrap());
    let log = log.clone();
    // Host 1 is configured with another learning rate: every host applies rank 0's, the lowest member's.
    let lr = if rank == 1 { 0.5 } else { 0.1 };
    let collective = Collective::new(0, 0, settings(lr), sum, move |r| {
        log.lock().unwrap().reports.push((rank, r));
    });
    let beats = beats(link.clone());
    Host { rank, generation: 0, collective: Arc::new(collective.with_link(link)), _beats: beats }
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t).unwrap()
}

/// How a test drafter's run ends or falters.
#[derive(Clone, Copy, Default)]
struct Fate {
    /// It stops before contributing to this step, as a killed process does.
    dies_before: Option<u64>,
    /// With NCCL: it stops after this step's round closed, before saying whether it summed (killed inside the
    /// all-reduce).
    dies_inside_sum: Option<u64>,
    /// With NCCL: its all-reduce of this step fails.
    sum_fails: Option<u64>,
}

/// One drafter thread: enters the run (the host's first member) or joins its host's collective (asked before the
/// thread starts, so that the first member serves it before its first round), then trains until `LAST_STEP`, or
/// until its `fate` stops it.
fn member(h: &Host, id: usize, first: bool, fate: Fate, log: &Arc<Mutex<Log>>) -> std::thread::JoinHandle<()> {
    let (rank, collective, log) = (h.rank, h.collective.clone(), log.clone());
    let generation = h.generation;
    // Each host starts from its own weights: the run's must replace them.
    let master = Tensor::from_slice(&[rank as f32 + 1.0, 0.5, -0.25, 2.0]);
    let (m, v) = (Tensor::zeros_like(&master), Tensor::zeros_like(&master));
    let buffers =
        JoinBuffers { master: master.shallow_clone(), exp_avg: m.shallow_clone(), exp_avg_sq: v.shallow_clone() };
    if !first {
        collective.request_join(id, 1, buffers.alias()).unwrap();
    }
    std::thread::spawn(move || {
        let mut step = if first {
            let info = collective.enter(id, 1, &buffers, 0).unwrap();
            log.lock().unwrap().entered.insert((rank, generation), (info.step, values(&master)));
            info.step
        } else {
            collective.wait_joined(id, 1).unwrap().step
        };
        while step < LAST_STEP && fate.dies_before != Some(step) {
            if collective.has_joiners() {
                collective.serve_joiners(id, 1, [&master, &m, &v], step).unwrap();
            }
            // A gradient that depends on the state, the host and the step.
            let grad = &master * 0.5 + (rank as f64 + step as f64 * 0.1);
            let c = Contribution {
                grad: grad.shallow_clone(),
                weight: 1.0,
                samples: 2,
                batches: vec![BatchId { epoch: 0, ordinal: step * 10 + rank as u64 }],
                metrics: Metrics::default(),
                digest: None,
            };
            let result = match collective.contribute(id, 1, step, c, |_| {}) {
                Ok(r) => r,
                Err(CollectiveError::Removed) => return,
                Err(e) => panic!("host {rank} member {id} step {step}: {e}"),
            };
            step = result.step + 1;
            if let Some(ring) = &result.ring {
                let rank_in_ring = ring.rank_of(id).expect("a contributor is in the round's ring");
                let ring = (ring.id.bytes().to_vec(), rank_in_ring, ring.members.len());
                log.lock().unwrap().rings.insert((rank, id, step - 1), ring);
            }
            // With NCCL the drafters all-reduce after the round (a stand-in here, completing unless the fate says
            // otherwise; the state stays as it is), then the run decides whether the update applies.
            let Some(sum) = result.grad.as_ref() else {
                let round = result.step;
                if fate.dies_inside_sum == Some(round) {
                    return;
                }
                let applies = collective.summed(id, round, fate.sum_fails != Some(round)).unwrap();
                let mut log = log.lock().unwrap();
                log.applied.insert((rank, id, round), applies);
                log.states.insert((rank, id, step), values(&master));
                continue;
            };
            let sum = sum.to_copy().unwrap();
            let update = &sum * (result.update.adamw.lr / result.total_weight);
            let (mut w, mut mm, mut vv) = (master.shallow_clone(), m.shallow_clone(), v.shallow_clone());
            let _ = w.f_sub_(&update).unwrap();
            let _ = mm.f_mul_scalar_(0.9).unwrap().f_add_(&sum).unwrap();
            let _ = vv.f_add_(&(&sum * &sum)).unwrap();
            log.lock().unwrap().states.insert((rank, id, step), values(&master));
        }
    })
}

/// Host 2 restarts at once: its new generation's announcement takes the old one out of round 4 without waiting
/// for the deadline.
#[test]
fn hosts_found_from_rank_0_sum_identically_and_a_killed_host_rejoins_from_a_live_one() {
    let back_at = three_hosts_one_killed(None, GradientSum::DeviceCopies).0;
    assert_eq!(back_at, 5, "admitted when round 4 closed");
}

/// A host that dies and stays down is found by its silence within seconds (`exchange::GONE_AFTER`), not at the
/// rounds' deadline (two minutes here): the others go on without it.
#[test]
fn a_dead_host_is_found_by_its_silence_not_at_the_deadline() {
    let server = Store::serve(0, Duration::from_secs(20)).unwrap();
    let log = Arc::new(Mutex::new(Log::default()));
    let deadline = Duration::from_secs(120);
    let mut hosts: Vec<Host> = (0..3)
        .map(|r| host_with_deadline(r, server.port(), GradientSum::DeviceCopies, deadline, &log))
        .map(|h| Host { generation: 1, ..h })
        .collect();
    let threads: Vec<_> = (0..2).map(|r| member(&hosts[r], 0, true, Fate::default(), &log)).collect();
    member(&hosts[2], 0, true, Fate { dies_before: Some(3), ..Fate::default() }, &log).join().unwrap();
    let died = std::time::Instant::now();
    hosts.pop();
    for t in threads {
        t.join().unwrap();
    }
    let waited = died.elapsed();
    assert!(waited < Duration::from_secs(40), "the others finished {waited:?} after the death");
    let log = log.lock().unwrap();
    for step in 1..=LAST_STEP {
        let members = log.states.keys().filter(|(.., s)| *s == step).count();
        assert_eq!(members, if step <= 3 { 3 } else { 2 }, "members that applied step {step}");
    }
}

/// Host 2 stays down until host 0 is past step 7: round 4 closes at its deadline without it, the others go on,
/// and it is admitted later.
#[test]
fn the_others_go_on_past_a_silent_death_and_the_host_rejoins_later() {
    let back_at = three_hosts_one_killed(Some(7), GradientSum::DeviceCopies).0;
    assert!(back_at > 7, "host 2 came back at step {back_at}");
}

/// With NCCL only the rounds' records cross the store: every drafter of every host finds the same communicator
/// identity in each round, with a distinct rank and the round's size; the identity changes exactly when the
/// membership does (host 2 killed, host 2 back) and is kept otherwise.
#[test]
fn with_nccl_every_drafter_of_every_host_sums_in_one_ring_per_membership() {
    let (back_at, log) = three_hosts_one_killed(None, GradientSum::Nccl);
    let log = log.lock().unwrap();
    let mut identities = Vec::new();
    for step in 0..LAST_STEP {
        let at: Vec<_> = log.rings.iter().filter(|((.., s), _)| *s == step).map(|(_, r)| r).collect();
        let size = if step < 4 || step >= back_at { 4 } else { 3 };
        assert_eq!(at.len(), size, "step {step}: {at:?}");
        assert!(at.iter().all(|(id, _, n)| *id == at[0].0 && *n == size), "step {step}: one ring of {size}: {at:?}");
        let mut ranks: Vec<usize> = at.iter().map(|(_, r, _)| *r).collect();
        ranks.sort();
        assert_eq!(ranks, (0..size).collect::<Vec<_>>(), "step {step}: distinct ranks");
        if identities.last() != Some(&at[0].0) {
            identities.push(at[0].0.clone());
        }
    }
    assert_eq!(identities.len(), 3, "a ring for the founders, one without host 2, one with it back");
    // Nothing was summed through the store (no host changed its state), and every round's sum completed.
    assert!(log.states.values().all(|s| *s == [1.0, 0.5, -0.25, 2.0]));
    assert!(log.applied.len() > 30 && log.applied.values().all(|&a| a), "{:?}", log.applied);
}

/// With NCCL a host can die inside the all-reduce, after its round closed: that round's update is skipped on every
/// host (the survivors keep identical state), and so is a round whose all-reduce failed on one host; every other
/// round applies; every drafter of every host learns the same for every round, and the next round after a skip has
/// a new communicator.
#[test]
fn with_nccl_a_round_whose_sum_failed_anywhere_is_skipped_on_every_host() {
    let server = Store::serve(0, Duration::from_secs(20)).unwrap();
    let port = server.port();
    let log = Arc::new(Mutex::new(Log::default()));
    let mut hosts: Vec<Host> = (0..3).map(|r| host(r, port, GradientSum::Nccl, &log)).collect();
    for h in &mut hosts {
        h.generation = 1;
    }
    let mut threads = vec![
        member(&hosts[0], 0, true, Fate::default(), &log),
        member(&hosts[1], 0, true, Fate { sum_fails: Some(8), ..Fate::default() }, &log),
        member(&hosts[1], 1, false, Fate::default(), &log),
    ];
    member(&hosts[2], 0, true, Fate { dies_inside_sum: Some(4), ..Fate::default() }, &log).join().unwrap();
    hosts.pop();
    let mut again = host(2, port, GradientSum::Nccl, &log);
    again.generation = 2;
    threads.push(member(&again, 0, true, Fate::default(), &log));
    for t in threads {
        t.join().unwrap();
    }
    let log = log.lock().unwrap();
    for step in 0..LAST_STEP {
        let at: Vec<_> = log.applied.iter().filter(|((.., s), _)| *s == step).collect();
        assert!(at.len() >= 3, "step {step}: {at:?}");
        let expected = step != 4 && step != 8;
        assert!(at.iter().all(|(_, a)| **a == expected), "step {step}: every drafter applies: {expected}: {at:?}");
    }
    // Host 2 died inside round 4 and came back at 5 or later; round 8 had every host and a new ring after it.
    assert!(!log.applied.contains_key(&(2, 0, 4)));
    let ring = |step: u64| log.rings[&(0, 0, step)].0.clone();
    assert_ne!(ring(9), ring(8), "a new communicator after the skipped round");
    assert_eq!(ring(10), ring(9));
    drop(server);
}

/// Three hosts summing by `sum`; host 2 is killed before step 4 and restarts once host 0 reached `restart_after` (at
/// once: `None`). Returns the step the restarted host came back at, and the log.
fn three_hosts_one_killed(restart_after: Option<u64>, sum: GradientSum) -> (u64, Arc<Mutex<Log>>) {
    let server = Store::serve(0, Duration::from_secs(20)).unwrap();
    let port = server.port();
    let log = Arc::new(Mutex::new(Log::default()));
    let mut hosts: Vec<Host> = (0..3).map(|r| host(r, port, sum, &log)).collect();
    for h in &mut hosts {
        h.generation = 1;
    }
    // Host 1 runs two drafters (a local sum under the run's sum); host 2 dies before step 4.
    let mut threads = vec![
        member(&hosts[0], 0, true, Fate::default(), &log),
        member(&hosts[1], 0, true, Fate::default(), &log),
        member(&hosts[1], 1, false, Fate::default(), &log),
    ];
    let doomed = member(&hosts[2], 0, true, Fate { dies_before: Some(4), ..Fate::default() }, &log);
    doomed.join().unwrap();
    // Killed: its link goes with it. It restarts as a new process would.
    hosts.pop();
    if let Some(after) = restart_after {
        while !log.lock().unwrap().states.contains_key(&(0, 0, after)) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut again = host(2, port, sum, &log);
    again.generation = 2;
    threads.push(member(&again, 0, true, Fate::default(), &log));
    for t in threads {
        t.join().unwrap();
    }
    let shared = log;
    let log = shared.lock().unwrap();

    // Founding: hosts 1 and 2 started from rank 0's weights at step 0.
    let founding = log.entered[&(0, 1)].clone();
    assert_eq!(founding, (0, vec![1.0, 0.5, -0.25, 2.0]));
    assert_eq!(log.entered[&(1, 1)], founding);
    assert_eq!(log.entered[&(2, 1)], founding);
    // The restarted host took a live host's state at a later boundary, the state the others had there.
    let (back_at, back_state) = log.entered[&(2, 2)].clone();
    assert!((5..LAST_STEP).contains(&back_at), "host 2 came back at step {back_at}");
    assert_eq!(back_state, log.states[&(0, 0, back_at)]);

    // Every member of every host holds the same weights after every step, bit for bit.
    for step in 1..=LAST_STEP {
        let at: Vec<_> = log.states.iter().filter(|((.., s), _)| *s == step).collect();
        let reference = at[0].1;
        assert!(at.iter().all(|(_, s)| *s == reference), "step {step}: {at:?}");
        let expected = if step <= 4 || step > back_at { 4 } else { 3 };
        assert_eq!(at.len(), expected, "members that applied step {step}: {at:?}");
    }

    // Samples count across hosts: 4 contributions of 2 with host 2, 3 without; host 1's report of round 4 (the one
    // host 2 missed) knows the run's count.
    let committed = |rank: usize, step: u64| {
        log.reports.iter().find(|(r, rep)| *r == rank && rep.step == step).map(|(_, rep)| rep.samples_committed)
    };
    assert_eq!(committed(1, 0), Some(8));
    assert_eq!(committed(1, 3), Some(32));
    assert_eq!(committed(1, 4), Some(38));
    assert_eq!(committed(0, LAST_STEP - 1), committed(2, LAST_STEP - 1));
    drop(log);
    drop(server);
    (back_at, shared)
}

/// A host whose training data is not rank 0's is refused at start, with both fingerprints named.
#[test]
fn a_host_with_other_data_is_refused() {
    let server = Store::serve(0, Duration::from_secs(20)).unwrap();
    let link = |rank: usize| {
        let placement = HostPlacement {
            hosts: 2,
            rank,
            master_addr: "127.0.0.1".into(),
            master_port: server.port(),
            serves_store: false,
            rendezvous_timeout: Duration::from_secs(20),
            leader_timeout: Duration::from_secs(60),
        };
        HostLink::open(&placement, Duration::from_secs(5)).unwrap()
    };
    link(0).agree_on_data("160 samples, sha256 aa").unwrap();
    link(1).agree_on_data("160 samples, sha256 aa").unwrap();
    let err = link(1).agree_on_data("144 samples, sha256 bb").unwrap_err().to_string();
    assert!(err.contains("144 samples, sha256 bb") && err.contains("160 samples, sha256 aa"), "{err}");
    assert!(err.contains("same prepared data"), "{err}");
}
