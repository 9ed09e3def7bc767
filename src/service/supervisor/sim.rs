//! A deterministic simulation of the supervisor, in the spirit of FoundationDB's and TigerBeetle's simulators: the
//! real [`Core`] behind the real [`Driver`] (the process's own executor of its actions), and the real collective
//! bookkeeping ([`Rounds`]), in a model world of drafter threads, target copies, a checkpoint writer and a disk
//! (the world is the driver's [`Effects`], in memory), with a seeded random schedule of thousands of events: failures of any
//! subset of drafters at once, failures during a rejoin, of the donor, of a founder, hangs of drafters and of target
//! copies (found by the watchdog), slow steps flagged as hangs, a lost device taking every thread on it, target
//! failures (at times with a drafter's in the same instant) and batches that crash the target, failed and corrupted
//! checkpoints,
//! unreadable checkpoint folders, SIGTERM at any point followed by `--resume auto` (sometimes with another number of
//! drafters), reloads, the whole process stopped for a while (SIGSTOP, a swapping host). Messages from one sender
//! arrive in order; messages from different senders interleave at random, as they do between ractor's message queue
//! and its supervision events.
//!
//! Checked after every event, or at the end of a run:
//! - the run commits a step within a bounded simulated time, or ends with a documented exit code (never a silent
//!   stall);
//! - every sample is committed at most once per epoch (rewinds undo what they undo), and a completed run committed
//!   each epoch whole, set-aside batches aside;
//! - every round's contributors hold the same state, at the round's step; founders load the state the collective
//!   was rewound to; joiners receive the state of the open round;
//! - the learning rate of every round is the schedule's value at that round (steps under `optim.max_steps`,
//!   committed samples otherwise), whatever the number of drafters, across rewinds and resumes;
//! - a checkpoint's trainer state is the one of its snapshot's step boundary;
//! - retention keeps the newest `keep` checkpoints not known invalid, and never deletes one because of invalid ones.
//!
//! `cargo test sim_` runs a CI-sized set of seeds; `DFLASH_SIM_SEEDS=20000 cargo test --release sim_many` runs more
//! (`DFLASH_SIM_FIRST` moves the first seed);
//! a failing seed prints its parameters, the end of its trace and the command that replays it in full
//! (`DFLASH_SIM_SEED=<seed> cargo test --lib sim_replay -- --nocapture`).
use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::core::{Core, HostRole, Setup, step_settings};
use super::driver::{Driver, Effects};
use super::protocol::{
    Action, Activity, DrafterSeen, Event, Feed, LedgerEntry, Notice, Order, Request, ScanFilter, Start, Watched,
    WriteJob,
};
use super::schedule::Item;
use crate::config::Config;
use crate::data::SampleId;
use crate::data::loader::BatchId;
use crate::service::evaluator::Evaluated;
use crate::service::exit::{
    EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NO_PROGRESS, EXIT_OK, EXIT_RESTART, EXIT_TERMINATED, StopSignal,
};
use crate::service::failure::{Failure, FailureKind};
use crate::train::checkpoint::{Scan, TrainerState, Written, to_delete};
use crate::train::collective::{Contributed, RoundReport};
use crate::train::link::{DrafterPart, HostMember, HostRecord};
use crate::train::objective::{Metrics, ObjectiveKnobs};
use crate::train::optim::Hyper;
use crate::train::optim::{LrSchedule, ScheduleKind};
use crate::train::rounds::{Claim, JoinPoll, Rounds};

const STEP_TIMEOUT_S: f64 = 5.0;
const SHUTDOWN_TIMEOUT_S: f64 = 30.0;
/// No committed step for this long while the process runs is a stall.
const STALL: Duration = Duration::from_secs(150);
/// Simulated time a seed runs at most.
const HORIZON: Duration = Duration::from_secs(3 * 3600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A seed's shape of run and how often things fail.
#[derive(Debug, Clone)]
struct Params {
    drafters: usize,
    targets: usize,
    samples: usize,
    batch_size: usize,
    accumulation: usize,
    epochs: u64,
    max_steps: u64,
    prefetch: usize,
    keep: usize,
    every_steps: u64,
    every_seconds: f64,
    min_live: usize,
    max_restarts: usize,
    backoff_initial_ms: u64,
    backoff_max_ms: u64,
    check_every: u64,
    hang_factor: f64,
    hang_floor_s: f64,
    /// Mean simulated seconds between two faults.
    fault_every_s: f64,
    /// Restarts of the whole process (`--resume auto`) the operator allows.
    process_restarts: u32,
    ledger_max_failures: u32,
    /// Hosts of the run: this world is rank 0; the others are modelled as the link shows them to it.
    hosts: usize,
    /// The odds that a checkpoint write takes far longer than the rest (a slow or stuck disk).
    slow_writes: f64,
}

impl Params {
    fn draw(rng: &mut ChaCha8Rng) -> Self {
        let drafters = rng.random_range(1..=4);
        let initial = rng.random_range(20..=300);
        Params {
            drafters,
            targets: if drafters > 1 && rng.random_bool(0.3) { 2 } else { 1 },
            samples: rng.random_range(100..=800),
            batch_size: rng.random_range(1..=3),
            accumulation: rng.random_range(1..=2),
            epochs: rng.random_range(1..=5),
            max_steps: if rng.random_bool(0.3) { rng.random_range(50..=600) } else { 0 },
            prefetch: rng.random_range(1..=3),
            keep: rng.random_range(2..=3),
            every_steps: [0, 3, 7, 15][rng.random_range(0..4)],
            every_seconds: if rng.random_bool(0.3) { 2.0 } else { 0.0 },
            min_live: if drafters > 1 && rng.random_bool(0.3) { 2 } else { 1 },
            max_restarts: rng.random_range(2..=6),
            backoff_initial_ms: initial,
            backoff_max_ms: initial * rng.random_range(1..=8),
            check_every: [0, 1, 5][rng.random_range(0..3)],
            hang_factor: [5.0, 20.0][rng.random_range(0..2)],
            hang_floor_s: [1.0, 30.0][rng.random_range(0..2)],
            fault_every_s: [1.0, 3.0, 10.0, 30.0][rng.random_range(0..4)],
            process_restarts: rng.random_range(0..=3),
            ledger_max_failures: rng.random_range(1..=6),
            hosts: if rng.random_bool(0.35) { rng.random_range(2..=3) } else { 1 },
            slow_writes: 0.03,
        }
    }

    fn config(&self) -> Config {
        let mut c = Config::builtin().expect("the built-in configuration");
        c.drafters.devices = vec![c.drafters.devices[0]; self.drafters];
        c.data.batch_size = self.batch_size;
        c.optim.accumulation = self.accumulation;
        c.optim.epochs = self.epochs;
        c.optim.max_steps = self.max_steps;
        c.optim.schedule = ScheduleKind::Cosine;
        c.optim.warmup_ratio = 0.1;
        c.optim.lr = 1e-3;
        c.optim.min_lr_ratio = 0.1;
        c.supervision.prefetch_steps = self.prefetch;
        c.supervision.min_live_drafters = self.min_live;
        c.supervision.max_restarts = self.max_restarts;
        c.supervision.restart_window_s = 60.0;
        c.supervision.backoff_initial_ms = self.backoff_initial_ms;
        c.supervision.backoff_max_ms = self.backoff_max_ms;
        c.supervision.step_timeout_s = STEP_TIMEOUT_S;
        c.supervision.hang_factor = self.hang_factor;
        c.supervision.hang_floor_s = self.hang_floor_s;
        c.supervision.shutdown_timeout_s = SHUTDOWN_TIMEOUT_S;
        c.supervision.gpu_hang_limit = 3;
        c.supervision.check_replicas_every = self.check_every;
        c.checkpoint.keep = self.keep;
        c.checkpoint.every_steps = self.every_steps;
        c.checkpoint.every_seconds = self.every_seconds;
        c.eval.every_steps = 0;
        c.log.every_steps = 10;
        c.data.ledger = Some(PathBuf::from("ledger.jsonl"));
        c.data.ledger_max_failures = self.ledger_max_failures;
        c
    }

    /// The learning rate every round must use: the schedule written out from the configuration, independently of
    /// the code under test and of the number of drafters.
    fn expected_lr(&self, step: u64, samples_before: u64) -> f64 {
        let (total, at) = match self.max_steps {
            0 => (self.samples as u64 * self.epochs, samples_before),
            m => (m, step),
        };
        let schedule = LrSchedule {
            kind: ScheduleKind::Cosine,
            lr: 1e-3,
            warmup_steps: (0.1 * total as f64).round() as u64,
            total_steps: total.max(1),
            min_lr_ratio: 0.1,
        };
        schedule.lr_at(at)
    }
}

/// A drafter replica's state, as a chain of the rounds it applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Replica {
    step: u64,
    hash: u64,
    optimizer_steps: u64,
}

fn mix(a: u64, b: u64) -> u64 {
    (a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    Building,
    Joining,
    Collecting,
    Computing {
        hung: bool,
    },
    InRound,
    /// Copying its state into joiners it claimed.
    Serving,
    Gone,
}

enum Msg {
    Features(BatchId, u64),
    Empty,
    Order(Order),
}

impl Stage {
    /// What the real thread reports in this stage.
    fn activity(self) -> Activity {
        match self {
            Stage::Building | Stage::Joining | Stage::Gone => Activity::Starting,
            Stage::Collecting => Activity::WaitingForWork,
            Stage::Computing { .. } => Activity::Computing,
            Stage::InRound => Activity::WaitingForPeers,
            Stage::Serving => Activity::Serving,
        }
    }
}

/// A model of one drafter thread.
struct Thread {
    start: Start,
    stage: Stage,
    replica: Replica,
    inbox: VecDeque<Msg>,
    items: Vec<BatchId>,
    samples: u64,
    taken: usize,
    joined: Rc<Cell<Option<Replica>>>,
    /// A snapshot asked for at this step boundary.
    snapshot_at: Option<u64>,
    /// When it entered its stage (for the watchdog).
    since: Duration,
    /// Its messages arrive in order: not before this.
    clock: Duration,
}

impl Thread {
    fn enter(&mut self, stage: Stage, now: Duration) {
        self.stage = stage;
        self.since = now;
    }
}

struct Contribution {
    replica: Replica,
    batches: Vec<BatchId>,
    samples: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum TargetStage {
    Building,
    Ready,
    Gone,
}

/// A request in a target thread's queue: its seq, the drafter thread `(id, generation)` it is for, and the batch
/// with its samples (none: an empty slot).
type Queued = (u64, usize, u64, Option<(BatchId, u64)>);

/// A model of one target thread.
struct TargetThread {
    generation: u64,
    stage: TargetStage,
    queue: VecDeque<Queued>,
    busy: bool,
    clock: Duration,
}

/// The writer's queue: writes and retirements, in order.
enum DiskJob {
    Write(Box<WriteJob>, Replica),
    Retire(u64, u64),
}

struct OnDisk {
    state: TrainerState,
    replica: Replica,
    intact: bool,
}

#[derive(Debug)]
enum Occ {
    Deliver(Box<Event>),
    /// A drafter thread's snapshot, with the message that tells the core of it.
    Snapshot {
        id: usize,
        generation: u64,
        replica: Replica,
    },
    Built {
        id: usize,
        generation: u64,
    },
    Wake {
        id: usize,
        generation: u64,
    },
    Computed {
        id: usize,
        generation: u64,
    },
    Served {
        claim: Claim,
        optimizer_steps: u64,
    },
    TargetBuilt {
        target: usize,
        generation: u64,
    },
    TargetDone {
        target: usize,
        generation: u64,
    },
    Scan(ScanFilter),
    WriteDone,
    Tick,
    Fault,
    /// The process stops (SIGSTOP) for this long.
    Freeze(Duration),
    Restart,
    /// Another host enters the run again (as a new generation).
    HostBack(usize),
    /// The ledger's disk has room again.
    LedgerFreed,
}

/// Faults armed for the next time their occasion comes.
#[derive(Default)]
struct Armed {
    hang: HashSet<usize>,
    slow: HashSet<usize>,
    target_hang: bool,
    start_crash: bool,
    start_hang: bool,
    kill_donor_on_serve: bool,
    kill_founder: bool,
    fail_write: bool,
    fail_scan: bool,
}

/// Another host of the run, as rank 0 sees it through the link: its drafters (as many as rank 0's) train what rank 0
/// feeds them and contribute to the rounds; a lost host leaves the membership, and may enter it again as a new
/// generation from a later round.
struct Remote {
    rank: usize,
    generation: u64,
    alive: bool,
    /// Its first round.
    from: u64,
    /// What rank 0 fed it, by step.
    fed: BTreeMap<u64, Vec<Fed>>,
}

/// One drafter's item of another host: `(drafter, its batch and the batch's samples)`.
type Fed = (usize, Option<(BatchId, u64)>);

struct World {
    seed: u64,
    p: Params,
    rng: ChaCha8Rng,
    now: Duration,
    seq: u64,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    pending: HashMap<u64, (u32, Occ)>,
    process: u32,
    alive: bool,
    hyper: Hyper,
    rounds: Rounds<Contribution, Rc<Cell<Option<Replica>>>>,
    samples_committed: u64,
    /// Samples committed before round `step` of the collective's incarnation `i` in process `p`: `(p, i, step)`.
    boundary_samples: HashMap<(u32, u64, u64), u64>,
    /// The state every contributor of round `(p, i, step)` held.
    round_state: HashMap<(u32, u64, u64), Replica>,
    /// The samples every host trained in round `(p, i, step)`: what the core must commit with it.
    round_samples: HashMap<(u32, u64, u64), u64>,
    /// The step whose batches the core's ledger lines commit now, and their samples (a rewind's repair of the
    /// ledger's recent lines is not a commit).
    committing: (u64, u64),
    threads: BTreeMap<(usize, u64), Thread>,
    routes: HashMap<usize, u64>,
    targets: Vec<TargetThread>,
    collective_clock: Duration,
    disk: BTreeMap<u64, OnDisk>,
    writes: VecDeque<DiskJob>,
    writing: bool,
    /// The ledger file as written: what each line says, rewinds applied.
    ledger: Vec<(u64, u64, Vec<usize>)>,
    /// The ledger's disk is full; the lines this process's writer holds, not yet written; lines it wrote; the
    /// order of its reports.
    ledger_full: bool,
    ledger_pending: VecDeque<LedgerEntry>,
    ledger_lines: u64,
    ledger_clock: Duration,
    batches: HashMap<BatchId, Vec<usize>>,
    poison: HashSet<BatchId>,
    armed: Armed,
    last_progress: Duration,
    restarts_left: u32,
    exits: Vec<(i32, String)>,
    completed: bool,
    /// The signal that asked this process to stop, if any.
    shutdown_requested: Option<StopSignal>,
    write_failed: bool,
    target_failures: Vec<Duration>,
    /// The largest `min_live_drafters` and the smallest `max_restarts` of this process so far.
    strictest: (usize, usize),
    trace: VecDeque<String>,
    full_trace: bool,
    events: u64,
    /// Hung target copies the watchdog found.
    hung_targets_found: u64,
    /// Batches other hosts trained in rounds, and hosts lost.
    remote_batches: u64,
    hosts_lost: u64,
    /// What the world saw go wrong while the driver carried out an action (the first of it).
    violation: Option<String>,
    /// The run's other hosts (several hosts: this world is rank 0), and the last generation any of them had.
    remote: Vec<Remote>,
    host_generations: u64,
    /// A stop of the process to schedule at start `(after, for)`, and the committed step it came at.
    planned_freeze: Option<(Duration, Duration)>,
    froze_at_step: Option<u64>,
}

type Check = Result<(), String>;

fn violation(what: impl Into<String>) -> Check {
    Err(what.into())
}

impl World {
    fn new(seed: u64, full_trace: bool) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let p = Params::draw(&mut rng);
        Self::with(seed, p, rng, full_trace)
    }

    fn with(seed: u64, p: Params, rng: ChaCha8Rng, full_trace: bool) -> Self {
        let config = p.config();
        let remote = (1..p.hosts)
            .map(|rank| Remote { rank, generation: 0, alive: false, from: 0, fed: BTreeMap::new() })
            .collect();
        World {
            seed,
            hyper: step_settings(&config, p.samples as u64, None).hyper,
            restarts_left: p.process_restarts,
            p,
            rng,
            now: Duration::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            pending: HashMap::new(),
            process: 0,
            alive: false,
            rounds: Rounds::new(0),
            samples_committed: 0,
            boundary_samples: HashMap::new(),
            round_state: HashMap::new(),
            round_samples: HashMap::new(),
            committing: (u64::MAX, 0),
            threads: BTreeMap::new(),
            routes: HashMap::new(),
            targets: vec![],
            collective_clock: Duration::ZERO,
            disk: BTreeMap::new(),
            writes: VecDeque::new(),
            writing: false,
            ledger: vec![],
            ledger_full: false,
            ledger_pending: VecDeque::new(),
            ledger_lines: 0,
            ledger_clock: Duration::ZERO,
            batches: HashMap::new(),
            poison: HashSet::new(),
            armed: Armed::default(),
            last_progress: Duration::ZERO,
            exits: vec![],
            completed: false,
            shutdown_requested: None,
            write_failed: false,
            target_failures: vec![],
            strictest: (0, usize::MAX),
            trace: VecDeque::new(),
            full_trace,
            events: 0,
            hung_targets_found: 0,
            remote_batches: 0,
            hosts_lost: 0,
            violation: None,
            remote,
            host_generations: 0,
            planned_freeze: None,
            froze_at_step: None,
        }
    }

    fn note(&mut self, line: String) {
        let line = format!("{:>10.3}s p{} {line}", self.now.as_secs_f64(), self.process);
        if self.full_trace {
            println!("{line}");
        }
        self.trace.push_back(line);
        if self.trace.len() > 80 {
            self.trace.pop_front();
        }
    }

    fn at(&mut self, when: Duration, occ: Occ) {
        self.seq += 1;
        self.queue.push(Reverse((when.max(self.now), self.seq)));
        self.pending.insert(self.seq, (self.process, occ));
    }

    fn after(&mut self, delay: Duration, occ: Occ) {
        self.at(self.now + delay, occ);
    }

    fn jitter(&mut self, lo: u64, hi: u64) -> Duration {
        ms(self.rng.random_range(lo..=hi))
    }

    /// A message to the core from a sender whose messages stay in order.
    fn send_from(&mut self, clock: Duration, event: Event) -> Duration {
        self.occur_from(clock, Occ::Deliver(Box::new(event)))
    }

    /// What a sender whose messages stay in order (its clock) makes happen; the sender's new clock.
    fn occur_from(&mut self, clock: Duration, occ: Occ) -> Duration {
        let when = (self.now + self.jitter(0, 4)).max(clock);
        self.at(when, occ);
        when
    }

    fn thread_says(&mut self, id: usize, generation: u64, event: Event) {
        self.thread_sends(id, generation, Occ::Deliver(Box::new(event)));
    }

    fn thread_sends(&mut self, id: usize, generation: u64, occ: Occ) {
        let clock = self.threads.get(&(id, generation)).map_or(self.now, |t| t.clock);
        let when = self.occur_from(clock, occ);
        if let Some(t) = self.threads.get_mut(&(id, generation)) {
            t.clock = when;
        }
    }

    /// A supervision event (ractor delivers those ahead of messages): a short delay, no order with messages.
    fn supervision(&mut self, event: Event) {
        let delay = self.jitter(0, 2);
        self.after(delay, Occ::Deliver(Box::new(event)));
    }

    // ------------------------------------------------------------------ the process

    /// A new process, with a new core behind a new driver.
    fn start_process(&mut self, driver: &mut Driver<Replica>) -> Check {
        self.process += 1;
        self.alive = true;
        let (resume, rejected) = self.scan_disk(&|_| true);
        let mut config = self.p.config();
        if self.process > 1 && self.rng.random_bool(0.4) {
            // Resumed on another machine: another number of drafters.
            self.p.drafters = self.rng.random_range(1..=4);
            self.p.min_live = self.p.min_live.min(self.p.drafters);
            self.p.targets = self.p.targets.min(self.p.drafters);
            config = self.p.config();
        }
        let step = resume.as_ref().map_or(0, |(_, s): &(PathBuf, TrainerState)| s.step);
        let samples = resume.as_ref().map_or(0, |(_, s)| s.samples_committed);
        self.note(format!(
            "process starts: {} drafters, resume from step {step}, rejected {rejected:?}",
            self.p.drafters
        ));
        self.strictest = (config.supervision.min_live_drafters, config.supervision.max_restarts);
        *driver = Driver::new(Core::new(setup(&self.p, config.clone(), resume, rejected)));
        self.hyper = step_settings(&config, self.p.samples as u64, None).hyper;
        self.rounds = Rounds::new(step);
        self.samples_committed = samples;
        self.threads.clear();
        self.routes.clear();
        self.targets = (0..self.p.targets)
            .map(|_| TargetThread {
                generation: 0,
                stage: TargetStage::Gone,
                queue: VecDeque::new(),
                busy: false,
                clock: Duration::ZERO,
            })
            .collect();
        self.writes.clear();
        self.writing = false;
        // The lines the last process's writer still held died with it.
        self.ledger_pending.clear();
        self.ledger_lines = 0;
        self.ledger_clock = self.now;
        self.armed = Armed::default();
        self.last_progress = self.now;
        self.after(ms(200), Occ::Tick);
        // The other hosts meet the new rank 0 at the rendezvous, each as a new generation.
        for r in &mut self.remote {
            self.host_generations += 1;
            *r = Remote {
                rank: r.rank,
                generation: self.host_generations,
                alive: true,
                from: step,
                fed: BTreeMap::new(),
            };
        }
        if !self.remote.is_empty() {
            let delay = self.jitter(1, 20);
            self.tell_hosts(delay);
        }
        driver.start(self);
        self.checked()
    }

    // ------------------------------------------------------------------ the other hosts

    /// The link's membership reaches the core (the shell tells it when the members change).
    fn tell_hosts(&mut self, after: Duration) {
        let me = HostMember { rank: 0, generation: u64::from(self.process), from: 0 };
        let others = self.remote.iter().filter(|r| r.alive).map(|r| HostMember {
            rank: r.rank,
            generation: r.generation,
            from: r.from,
        });
        let members = std::iter::once(me).chain(others).collect();
        self.after(after, Occ::Deliver(Box::new(Event::Hosts(members))));
    }

    /// Another host is lost (killed, cut off, stopped past the round's deadline): the link drops it from the
    /// membership; at times it comes back later, as a new generation.
    fn lose_host(&mut self) {
        let alive: Vec<usize> = self.remote.iter().filter(|r| r.alive).map(|r| r.rank).collect();
        let Some(&rank) = choose(&mut self.rng, &alive) else { return };
        let r = &mut self.remote[rank - 1];
        r.alive = false;
        r.fed.clear();
        self.hosts_lost += 1;
        self.note(format!("fault: host {rank} is lost"));
        let found_in = self.jitter(20, 3000);
        self.tell_hosts(found_in);
        if self.rng.random_bool(0.7) {
            let back_in = found_in + self.jitter(500, 30_000);
            self.after(back_in, Occ::HostBack(rank));
        }
    }

    /// Host `rank` enters the run again, from the round after the open one.
    fn host_back(&mut self, rank: usize) {
        if self.remote[rank - 1].alive {
            return;
        }
        self.host_generations += 1;
        let r = &mut self.remote[rank - 1];
        *r = Remote {
            rank,
            generation: self.host_generations,
            alive: true,
            from: self.rounds.round() + 1,
            fed: BTreeMap::new(),
        };
        self.note(format!("host {rank} enters the run again as generation {}", self.host_generations));
        let delay = self.jitter(1, 20);
        self.tell_hosts(delay);
    }

    /// The checksums a replica reports of its state, on steps where replicas are compared.
    fn digest(&self, r: Replica) -> Option<[i64; 3]> {
        let due = self.p.check_every > 0 && r.step.is_multiple_of(self.p.check_every);
        due.then_some([r.hash as i64, r.step as i64, r.optimizer_steps as i64])
    }

    /// A capture item as the model carries it, its batch's samples recorded (the ledger check names them).
    fn captured(&mut self, item: Item) -> Option<(BatchId, u64)> {
        match item {
            Item::Capture { batch, positions } => {
                let n = positions.len() as u64;
                self.batches.insert(batch, positions);
                Some((batch, n))
            }
            Item::Empty => None,
        }
    }

    /// The other hosts' parts of round `step` (what rank 0 fed each live host for it), as the link brings them
    /// with the round; each part's checksum is of the state every replica holds at the round's start.
    fn remote_parts(&mut self, step: u64, start: Replica) -> Vec<HostRecord> {
        let digest = self.digest(start);
        let settings =
            (self.hyper.update(step, self.samples_committed), ObjectiveKnobs { num_anchors: 4, gamma: None });
        let mut parts = vec![];
        for r in self.remote.iter_mut().filter(|r| r.alive) {
            let Some(items) = r.fed.remove(&step) else { continue };
            r.fed.retain(|s, _| *s > step);
            let contributions: Vec<DrafterPart> = items
                .into_iter()
                .map(|(drafter, item)| DrafterPart {
                    drafter,
                    generation: r.generation,
                    batches: item.map(|(b, _)| vec![b]).unwrap_or_default(),
                    samples: item.map_or(0, |(_, n)| n),
                    metrics: Metrics::default(),
                    digest,
                })
                .collect();
            let weight = contributions.iter().map(|c| c.samples as f64).sum();
            self.remote_batches += contributions.iter().map(|c| c.batches.len() as u64).sum::<u64>();
            parts.push(HostRecord { rank: r.rank, generation: r.generation, settings, weight, contributions });
        }
        parts
    }

    /// The newest intact checkpoint `allowed` lets through, and the steps of the damaged ones passed on the way.
    fn scan_disk(&self, allowed: &dyn Fn(u64) -> bool) -> (Option<(PathBuf, TrainerState)>, Vec<u64>) {
        let mut rejected = vec![];
        for (step, c) in self.disk.iter().rev() {
            if !allowed(*step) {
                continue;
            }
            if c.intact {
                return (Some((path_of(*step), c.state.clone())), rejected);
            }
            rejected.push(*step);
        }
        (None, rejected)
    }

    // ------------------------------------------------------------------ the driver

    /// A message reaches the process: the driver hands it (after any time the process did not run) to the core and
    /// carries out what it answers.
    fn feed(&mut self, driver: &mut Driver<Replica>, event: Event) -> Check {
        driver.arrived(self, matches!(event, Event::Watch(_)));
        self.checked()?;
        driver.handle(self, event);
        self.checked()
    }

    /// What went wrong while the driver carried out actions, if anything.
    fn checked(&mut self) -> Check {
        self.violation.take().map_or(Ok(()), Err)
    }

    /// Records a violation found inside an effect (the first one stands).
    fn found(&mut self, check: Check) {
        if let Err(e) = check {
            self.violation.get_or_insert(e);
        }
    }

    fn exited(&mut self, core: &Core, code: i32) -> Check {
        let status = core.status();
        self.note(format!("exit {code}: {}", status.phase));
        self.alive = false;
        for t in self.threads.values_mut() {
            t.enter(Stage::Gone, self.now);
        }
        let failed = status.drafters.iter().filter(|d| d.state.name() == "failed").count();
        let why = match code {
            EXIT_OK => {
                if !self.pending_export_done() {
                    return violation("exit 0 without completing the run");
                }
                self.completed = true;
                "complete"
            }
            EXIT_TERMINATED | EXIT_INTERRUPTED => {
                if self.shutdown_requested.map(StopSignal::exit_code) != Some(code) {
                    return violation(format!("exit {code} without that signal ({:?})", self.shutdown_requested));
                }
                if self.pending_export_done() {
                    return violation(format!("exit {code} after completing the run"));
                }
                "stopped"
            }
            EXIT_NO_PROGRESS => {
                // The restart window, counted back from when the ending began (at most shutdown_timeout_s ago).
                let window = Duration::from_secs_f64(60.0 + SHUTDOWN_TIMEOUT_S);
                let recent = self.target_failures.iter().filter(|t| self.now.saturating_sub(**t) <= window).count();
                // Reloads move both limits: the strictest each was in this process counts.
                let (min_live, max_restarts) = self.strictest;
                if failed + min_live <= self.p.drafters && recent <= max_restarts {
                    return violation(format!(
                        "exit 3 with {failed} of {} drafters failed (min_live {min_live}) and {recent} recent target \
                         failures (max_restarts {max_restarts})",
                        self.p.drafters
                    ));
                }
                "no progress"
            }
            EXIT_ERROR => {
                if !self.write_failed {
                    return violation("exit 1 without a failed checkpoint write");
                }
                "error"
            }
            EXIT_RESTART => "restart me",
            other => return violation(format!("undocumented exit status {other}")),
        };
        self.exits.push((code, why.to_string()));
        self.last_progress = self.now;
        self.shutdown_requested = None;
        self.write_failed = false;
        if !self.completed && self.restarts_left > 0 {
            self.restarts_left -= 1;
            self.after(Duration::from_secs(1), Occ::Restart);
        }
        Ok(())
    }

    /// Whether the export of a completed run was asked for in this process (the exit follows its answer).
    fn pending_export_done(&self) -> bool {
        self.trace.iter().rev().take_while(|l| !l.contains("process starts")).any(|l| l.contains("<- Export"))
    }

    // ------------------------------------------------------------------ drafter threads

    fn wake(&mut self, id: usize, generation: u64) {
        let delay = self.jitter(0, 2);
        self.after(delay, Occ::Wake { id, generation });
    }

    /// The thread dies; its actor fails, and the supervisor hears of it.
    fn kill(&mut self, id: usize, generation: u64, kind: FailureKind, message: &str) {
        let Some(t) = self.threads.get_mut(&(id, generation)) else { return };
        if t.stage == Stage::Gone {
            return;
        }
        let running = if matches!(t.stage, Stage::Computing { .. }) { t.items.clone() } else { vec![] };
        t.enter(Stage::Gone, self.now);
        let injected = kind == FailureKind::Injected;
        let failure = Failure { kind, message: message.to_string() };
        self.note(format!("fault: drafter {id}.{generation} dies ({kind:?})"));
        self.supervision(Event::DrafterFailed { id, generation, failure, running, injected });
    }

    /// Target copy `target` fails now (unless it is gone already), as `kind`.
    fn fail_target(&mut self, target: usize, kind: FailureKind, message: &str) {
        let t = &mut self.targets[target];
        if t.stage == TargetStage::Gone {
            return;
        }
        t.stage = TargetStage::Gone;
        let generation = t.generation;
        self.target_failures.push(self.now);
        self.note(format!("fault: target {target}.{generation} fails ({kind:?})"));
        let failure = Failure { kind, message: message.to_string() };
        self.supervision(Event::TargetFailed { target, generation, failure });
    }

    fn built(&mut self, id: usize, generation: u64) -> Check {
        let Some(t) = self.threads.get(&(id, generation)) else { return Ok(()) };
        if t.stage != Stage::Building {
            return Ok(());
        }
        let start = t.start.clone();
        let slot = t.joined.clone();
        if start == Start::Join && self.rounds.request_join(id, generation, slot).is_err() {
            // Given up on while it was starting: it stops quietly.
            self.returned(id, generation);
            return Ok(());
        }
        self.thread_says(id, generation, Event::DrafterReady { id, generation });
        match start {
            Start::Join => {
                self.threads.get_mut(&(id, generation)).expect("present").enter(Stage::Joining, self.now);
                self.wake(id, generation);
            }
            Start::Found(path) => {
                let replica = match &path {
                    None => Replica { step: 0, hash: 0, optimizer_steps: 0 },
                    Some(p) => {
                        let step = step_of(p);
                        match self.disk.get(&step) {
                            Some(c) if c.intact => c.replica,
                            _ => {
                                // Deleted or damaged since it was chosen: loading fails.
                                self.kill(id, generation, FailureKind::CheckpointLoad, "cannot load the checkpoint");
                                return Ok(());
                            }
                        }
                    }
                };
                let round = match self.rounds.found(id, generation) {
                    Ok(round) => round,
                    Err(crate::train::rounds::RoundsError::Removed) => {
                        self.returned(id, generation);
                        return Ok(());
                    }
                    Err(e) => return violation(format!("drafter {id}.{generation} could not found: {e}")),
                };
                if round != replica.step {
                    return violation(format!(
                        "founder {id}.{generation} holds the state of step {} but the collective's round is {round}",
                        replica.step
                    ));
                }
                let t = self.threads.get_mut(&(id, generation)).expect("present");
                t.replica = replica;
                t.enter(Stage::Collecting, self.now);
                self.thread_says(id, generation, Event::DrafterJoined { id, generation, step: round });
                self.wake(id, generation);
            }
        }
        Ok(())
    }

    /// The thread takes what its inbox holds, as the real one does between and before its steps.
    fn run_thread(&mut self, id: usize, generation: u64) -> Check {
        let Some(t) = self.threads.get_mut(&(id, generation)) else { return Ok(()) };
        match t.stage {
            Stage::Joining => match self.rounds.poll_join(id, generation) {
                JoinPoll::Joined(info) => {
                    let Some(replica) = t.joined.get() else {
                        return violation(format!("joiner {id}.{generation} admitted without a state"));
                    };
                    if replica.step != info.step || replica.optimizer_steps != info.optimizer_steps {
                        return violation(format!(
                            "joiner {id} got the state of step {} to join round {}",
                            replica.step, info.step
                        ));
                    }
                    t.replica = replica;
                    t.enter(Stage::Collecting, self.now);
                    self.thread_says(id, generation, Event::DrafterJoined { id, generation, step: info.step });
                    self.wake(id, generation);
                }
                JoinPoll::Waiting => {}
                JoinPoll::Removed => self.returned(id, generation),
            },
            Stage::Collecting => {
                if t.snapshot_at.is_some_and(|at| at <= t.replica.step) {
                    t.snapshot_at = None;
                    let replica = t.replica;
                    self.thread_sends(id, generation, Occ::Snapshot { id, generation, replica });
                    return self.run_thread(id, generation);
                }
                while t.taken < self.p.accumulation {
                    let Some(msg) = t.inbox.pop_front() else { return Ok(()) };
                    match msg {
                        Msg::Features(batch, samples) => {
                            t.items.push(batch);
                            t.samples += samples;
                            t.taken += 1;
                        }
                        Msg::Empty => t.taken += 1,
                        Msg::Order(Order::ServeJoiners) => {
                            self.serve(id, generation);
                            return self.run_thread(id, generation);
                        }
                        Msg::Order(Order::Checkpoint { at }) => {
                            if at < t.replica.step {
                                return violation(format!(
                                    "drafter {id} asked for a snapshot at {at}, already past it"
                                ));
                            }
                            t.snapshot_at = Some(at);
                            return self.run_thread(id, generation);
                        }
                        Msg::Order(Order::Stop) => {
                            self.returned(id, generation);
                            return Ok(());
                        }
                    }
                }
                let hung = self.armed.hang.remove(&id);
                let slow = self.armed.slow.remove(&id);
                let t = self.threads.get_mut(&(id, generation)).expect("present");
                t.enter(Stage::Computing { hung }, self.now);
                if !hung {
                    let compute =
                        if slow { Duration::from_secs_f64(STEP_TIMEOUT_S + 2.0) } else { self.jitter(20, 250) };
                    self.after(compute, Occ::Computed { id, generation });
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn returned(&mut self, id: usize, generation: u64) {
        if let Some(t) = self.threads.get_mut(&(id, generation)) {
            t.enter(Stage::Gone, self.now);
        }
        self.supervision(Event::DrafterExited { id, generation });
    }

    /// The member claims the waiting joiners and copies its state into them; it admits them once the copy is done
    /// (a few milliseconds later, during which anything may happen: it is blocked meanwhile).
    fn serve(&mut self, id: usize, generation: u64) {
        let Some(t) = self.threads.get(&(id, generation)) else { return };
        let replica = t.replica;
        let Ok(claim) = self.rounds.claim_joiners(id, generation) else { return };
        if claim.joiners.is_empty() {
            return;
        }
        for &(m, g) in &claim.joiners {
            if let Some(slot) = self.rounds.payload(m, g) {
                slot.set(Some(replica));
            }
        }
        self.threads.get_mut(&(id, generation)).expect("present").enter(Stage::Serving, self.now);
        let delay = self.jitter(1, 8);
        self.after(delay, Occ::Served { claim, optimizer_steps: replica.optimizer_steps });
    }

    fn served(&mut self, claim: Claim, optimizer_steps: u64) {
        let (id, generation) = claim.server;
        if self.threads.get(&(id, generation)).is_none_or(|t| t.stage != Stage::Serving) {
            return;
        }
        for joiner in self.rounds.admit(&claim, optimizer_steps) {
            let g = claim.joiners.iter().find(|(m, _)| *m == joiner).map(|(_, g)| *g).expect("claimed");
            self.wake(joiner, g);
        }
        self.threads.get_mut(&(id, generation)).expect("present").enter(Stage::Collecting, self.now);
        self.wake(id, generation);
    }

    fn computed(&mut self, id: usize, generation: u64) -> Check {
        let Some(t) = self.threads.get_mut(&(id, generation)) else { return Ok(()) };
        if t.stage != (Stage::Computing { hung: false }) {
            return Ok(());
        }
        let contribution =
            Contribution { replica: t.replica, batches: std::mem::take(&mut t.items), samples: t.samples };
        let step = t.replica.step;
        t.samples = 0;
        t.taken = 0;
        t.enter(Stage::InRound, self.now);
        match self.rounds.contribute(id, generation, step, contribution) {
            Ok(()) => self.complete_rounds(),
            Err(crate::train::rounds::RoundsError::Removed) => {
                self.returned(id, generation);
                Ok(())
            }
            Err(e) => violation(format!("drafter {id}.{generation} contributed to step {step}: {e}")),
        }
    }

    /// Closes every complete round: checks the contributors agree, reports it, and every contributor still
    /// running applies it.
    fn complete_rounds(&mut self) -> Check {
        while let Some(done) = self.rounds.complete() {
            let first = done.contributions[0].2.replica;
            for (m, _, c) in &done.contributions {
                if c.replica != first || c.replica.step != done.step {
                    return violation(format!(
                        "round {}: member {m} holds {:?}, member {} holds {first:?}",
                        done.step, c.replica, done.contributions[0].0
                    ));
                }
            }
            let key = (self.process, done.incarnation, done.step);
            if let Some(previous) = self.round_state.insert(key, first)
                && previous != first
            {
                return violation(format!("round {} of incarnation {} ran twice", done.step, done.incarnation));
            }
            let lr = self.hyper.lr_at(done.step, self.samples_committed);
            let expected = self.p.expected_lr(done.step, self.samples_committed);
            if (lr - expected).abs() > 1e-12 * expected.max(1e-12) {
                return violation(format!("round {}: learning rate {lr}, the schedule says {expected}", done.step));
            }
            let remote = self.remote_parts(done.step, first);
            let local: u64 = done.contributions.iter().map(|(.., c)| c.samples).sum();
            let samples = local + remote.iter().map(HostRecord::samples).sum::<u64>();
            self.round_samples.insert(key, samples);
            self.samples_committed += samples;
            self.boundary_samples.insert((self.process, done.incarnation, done.step + 1), self.samples_committed);
            // Every host applies the same sum: what all of them trained.
            let mut hash = mix(first.hash, done.step);
            let local_batches = done.contributions.iter().flat_map(|(.., c)| &c.batches);
            let remote_batches = remote.iter().flat_map(|h| &h.contributions).flat_map(|c| &c.batches);
            for b in local_batches.chain(remote_batches) {
                hash = mix(hash, b.epoch << 32 | b.ordinal);
            }
            let report = RoundReport {
                step: done.step,
                incarnation: done.incarnation,
                contributions: done
                    .contributions
                    .iter()
                    .map(|(m, g, c)| Contributed {
                        member: *m,
                        generation: *g,
                        batches: c.batches.clone(),
                        metrics: Metrics::default(),
                        samples: c.samples,
                    })
                    .collect(),
                total_weight: samples as f64,
                lr,
                samples_committed: self.samples_committed,
                remote,
            };
            self.collective_clock = self.send_from(self.collective_clock, Event::Round(report));
            let next = Replica { step: done.step + 1, hash, optimizer_steps: first.optimizer_steps + 1 };
            for (m, g, _) in done.contributions {
                let Some(t) = self.threads.get_mut(&(m, g)) else { continue };
                if t.stage != Stage::InRound {
                    continue;
                }
                t.replica = next;
                t.enter(Stage::Collecting, self.now);
                let digest = self.digest(next);
                let event = Event::StepDone {
                    id: m,
                    generation: g,
                    step: next.step,
                    digest,
                    applied: true,
                    feature_wait_s: 0.0,
                };
                self.thread_says(m, g, event);
                if self.rounds.has_joiners() {
                    self.serve(m, g);
                }
                self.wake(m, g);
            }
        }
        Ok(())
    }

    /// What the shell reports with its ticks: the stage of every thread the core runs, and since when.
    fn watched(&self, core: &Core) -> Vec<Watched> {
        let running = core.running_threads();
        let threads = self.threads.iter().filter(|(key, t)| t.stage != Stage::Gone && running.contains(key));
        threads
            .map(|(&(id, generation), t)| Watched {
                seen: DrafterSeen {
                    id,
                    generation,
                    activity: t.stage.activity(),
                    for_: self.now.saturating_sub(t.since),
                },
                running: if matches!(t.stage, Stage::Computing { .. }) { t.items.clone() } else { vec![] },
                injected: false,
            })
            .collect()
    }

    // ------------------------------------------------------------------ target threads

    fn target_work(&mut self, target: usize) {
        let t = &mut self.targets[target];
        if t.stage == TargetStage::Ready && !t.busy && !t.queue.is_empty() {
            t.busy = true;
            let generation = t.generation;
            if std::mem::take(&mut self.armed.target_hang) {
                self.note(format!("fault: target {target}.{generation} hangs on its request"));
                return;
            }
            let delay = self.jitter(1, 10);
            self.after(delay, Occ::TargetDone { target, generation });
        }
    }

    fn target_done(&mut self, target: usize, generation: u64) {
        let t = &mut self.targets[target];
        if t.generation != generation || t.stage != TargetStage::Ready {
            return;
        }
        t.busy = false;
        let Some((seq, drafter, dgen, item)) = t.queue.pop_front() else { return };
        if let Some((batch, _)) = item
            && self.poison.contains(&batch)
        {
            t.stage = TargetStage::Gone;
            self.target_failures.push(self.now);
            self.note(format!("fault: target {target} crashes on batch {batch:?}"));
            let failure = Failure { kind: FailureKind::Torch, message: "index out of range in self".into() };
            self.supervision(Event::TargetFailed { target, generation, failure });
            return;
        }
        if self.routes.get(&drafter) == Some(&dgen)
            && let Some(th) = self.threads.get_mut(&(drafter, dgen))
        {
            th.inbox.push_back(match item {
                Some((batch, samples)) => Msg::Features(batch, samples),
                None => Msg::Empty,
            });
            self.wake(drafter, dgen);
        }
        let clock = self.targets[target].clock;
        self.targets[target].clock = self.send_from(clock, Event::Delivered { target, generation, seq });
        self.target_work(target);
    }

    // ------------------------------------------------------------------ the disk

    fn next_write(&mut self) {
        if !self.writing && !self.writes.is_empty() {
            self.writing = true;
            // Now and then a write takes far longer than the rest (a slow or stuck disk).
            let delay = if self.rng.random_bool(self.p.slow_writes) {
                self.jitter(5_000, 40_000)
            } else {
                self.jitter(20, 300)
            };
            self.after(delay, Occ::WriteDone);
        }
    }

    fn write_done(&mut self) -> Check {
        self.writing = false;
        let (job, replica) = match self.writes.pop_front() {
            Some(DiskJob::Write(job, replica)) => (*job, replica),
            Some(DiskJob::Retire(from, to)) => {
                self.disk.retain(|s, _| !(from..=to).contains(s));
                self.next_write();
                return Ok(());
            }
            None => return Ok(()),
        };
        let result = if job.incarnation != self.rounds.incarnation() {
            // The writer's fence: the run rewound while this was written.
            Err("discarded: the run rewound".to_string())
        } else if std::mem::take(&mut self.armed.fail_write) {
            self.write_failed = true;
            Err("No space left on device".to_string())
        } else {
            self.disk.insert(job.step, OnDisk { state: job.state.clone(), replica, intact: true });
            self.retention(&job)?;
            Ok((path_of(job.step), 0.1))
        };
        let event = Event::CheckpointWritten(Written { step: job.step, incarnation: job.incarnation, result });
        self.after(ms(1), Occ::Deliver(Box::new(event)));
        self.next_write();
        Ok(())
    }

    /// The writer's retention, with the real rule, checked against what was known.
    fn retention(&mut self, job: &WriteJob) -> Check {
        let found: Vec<(u64, bool)> = self.disk.keys().map(|s| (*s, !job.invalid.contains(s))).collect();
        let newest_intact = self.disk.iter().rev().find(|(_, c)| c.intact).map(|(s, _)| *s);
        for step in to_delete(&found, self.p.keep) {
            let counted_newer = found.iter().filter(|(s, valid)| *s > step && *valid).count();
            if !job.invalid.contains(&step) && counted_newer < self.p.keep {
                return violation(format!("retention deleted step {step} with {counted_newer} valid ones newer"));
            }
            if Some(step) == newest_intact {
                return violation(format!("retention deleted the newest intact checkpoint (step {step})"));
            }
            self.disk.remove(&step);
        }
        Ok(())
    }

    /// The ledger writer's attempt: every pending line written (in order), or none while the disk is full; the
    /// outcome goes to the core in the writer's order.
    fn write_ledger(&mut self) {
        if self.ledger_pending.is_empty() {
            return;
        }
        let outcome = if self.ledger_full {
            Err("No space left on device".to_string())
        } else {
            while let Some(entry) = self.ledger_pending.pop_front() {
                match entry {
                    LedgerEntry::Commit { step, batch } => self.ledger.push((step, batch.id.epoch, batch.samples)),
                    LedgerEntry::Rewind { step } => self.ledger.retain(|(s, ..)| *s < step),
                }
                self.ledger_lines += 1;
            }
            Ok(self.ledger_lines)
        };
        self.ledger_clock = self.send_from(self.ledger_clock, Event::LedgerWritten(outcome));
    }

    fn scanned(&mut self, filter: ScanFilter) -> Event {
        if std::mem::take(&mut self.armed.fail_scan) {
            Event::CheckpointFound(Err("Input/output error".into()))
        } else {
            let (newest, rejected) = self.scan_disk(&|step| filter.allows(step));
            let rejected =
                rejected.into_iter().map(|step| (step, "its manifest does not verify".to_string())).collect();
            Event::CheckpointFound(Ok(Scan { newest, rejected }))
        }
    }

    // ------------------------------------------------------------------ faults

    /// Strikes a random fault; some reach the core as a message (a signal, a reload).
    fn fault(&mut self, core: &Core) -> Option<Event> {
        if !self.remote.is_empty() && self.rng.random_bool(0.1) {
            self.lose_host();
            return None;
        }
        let running: Vec<(usize, u64)> =
            self.threads.iter().filter(|(_, t)| t.stage != Stage::Gone).map(|(k, _)| *k).collect();
        let pick = self.rng.random_range(0..100);
        match pick {
            0..=17 => {
                if let Some(&(id, g)) = choose(&mut self.rng, &running) {
                    let kind = if self.rng.random_bool(0.3) { FailureKind::Injected } else { FailureKind::Panic };
                    self.kill(id, g, kind, "fault: panic");
                }
            }
            18..=25 => {
                // Every drafter at once: what a peer dying inside an NCCL all-reduce does to the others.
                for (id, g) in running {
                    self.kill(id, g, FailureKind::Torch, "fault: collective timed out");
                }
            }
            26..=31 => {
                // Any subset at once (a host's shared switch or power rail): each thread at even odds, at least one.
                let mut subset: Vec<(usize, u64)> =
                    running.iter().copied().filter(|_| self.rng.random_bool(0.5)).collect();
                if subset.is_empty() {
                    subset.extend(choose(&mut self.rng, &running).copied());
                }
                for (id, g) in subset {
                    self.kill(id, g, FailureKind::Panic, "fault: several at once");
                }
            }
            32..=39 => {
                let id = self.rng.random_range(0..self.p.drafters);
                self.armed.hang.insert(id);
            }
            40..=43 => {
                let id = self.rng.random_range(0..self.p.drafters);
                self.armed.slow.insert(id);
            }
            44..=45 => self.armed.target_hang = true,
            46 => {
                // A device lost, and every thread on it (two drafters a device, target copy d on device d: `setup`).
                if let Some(&(id, _)) = choose(&mut self.rng, &running) {
                    let device = id / 2;
                    let message = "fault: an illegal memory access was encountered";
                    for &(other, g) in running.iter().filter(|(other, _)| other / 2 == device) {
                        self.kill(other, g, FailureKind::Poisoned, message);
                    }
                    if device < self.targets.len() {
                        self.fail_target(device, FailureKind::Poisoned, message);
                    }
                }
            }
            47..=53 => {
                let target = self.rng.random_range(0..self.targets.len());
                self.fail_target(target, FailureKind::Torch, "fault: target error");
                // At times a drafter fails in the same instant (a host under memory pressure).
                if self.rng.random_bool(0.3)
                    && let Some(&(id, g)) = choose(&mut self.rng, &running)
                {
                    self.kill(id, g, FailureKind::Panic, "fault: beside the target");
                }
            }
            54..=58 => {
                // A batch whose ids the target cannot embed: it crashes the target every time.
                let queued: Vec<BatchId> =
                    self.targets.iter().flat_map(|t| t.queue.iter().filter_map(|q| q.3.map(|(b, _)| b))).collect();
                if let Some(&b) = choose(&mut self.rng, &queued) {
                    self.poison.insert(b);
                }
            }
            59..=63 => self.armed.fail_write = true,
            64..=69 => {
                let steps: Vec<u64> = self.disk.keys().copied().collect();
                if let Some(&s) = choose(&mut self.rng, &steps) {
                    self.note(format!("fault: checkpoint {s} damaged on disk"));
                    self.disk.get_mut(&s).expect("listed").intact = false;
                }
            }
            70..=73 => self.armed.fail_scan = true,
            74..=77 => self.armed.start_crash = true,
            78..=80 => self.armed.start_hang = true,
            81..=85 => self.armed.kill_donor_on_serve = true,
            86..=89 => self.armed.kill_founder = true,
            90..=93 => {
                if self.rng.random_bool(0.5) {
                    let signal = if self.rng.random_bool(0.5) { StopSignal::Terminate } else { StopSignal::Interrupt };
                    // A second signal of another kind does not change the status the first one asked for.
                    let signal = *self.shutdown_requested.get_or_insert(signal);
                    return Some(Event::Shutdown(signal));
                }
            }
            94..=95 => {
                // The ledger's disk fills up, for a while (longer than data.ledger_max_failures at times).
                if !self.ledger_full {
                    self.ledger_full = true;
                    let free_in = self.jitter(300, 6000);
                    self.after(free_in, Occ::LedgerFreed);
                }
            }
            96 => {
                let for_ = self.jitter(3_000, 60_000);
                self.after(Duration::ZERO, Occ::Freeze(for_));
            }
            _ => {
                let mut config = core.config().clone();
                config.checkpoint.every_steps = [0, 2, 5][self.rng.random_range(0..3)];
                config.log.every_steps = 3;
                let s = &mut config.supervision;
                s.max_restarts = self.rng.random_range(2..=6);
                s.backoff_initial_ms = self.rng.random_range(20..=300);
                s.backoff_max_ms = s.backoff_initial_ms * self.rng.random_range(1..=8);
                s.min_live_drafters = self.rng.random_range(1..=self.p.drafters);
                self.strictest = (self.strictest.0.max(s.min_live_drafters), self.strictest.1.min(s.max_restarts));
                return Some(Event::Reconfigured(Box::new(config)));
            }
        }
        None
    }

    /// The process stops for `for_` (SIGSTOP, a swapping host), every thread with it: whatever the process had
    /// scheduled happens that much later, and so does the world's next fault.
    fn freeze(&mut self, for_: Duration, step: u64) {
        self.note(format!("fault: the process stops for {:.1} s", for_.as_secs_f64()));
        self.froze_at_step.get_or_insert(step);
        let now = self.now;
        let later = |t: Duration| if t > now { t + for_ } else { t };
        self.queue =
            std::mem::take(&mut self.queue).into_iter().map(|Reverse((t, seq))| Reverse((t + for_, seq))).collect();
        for t in self.threads.values_mut() {
            t.clock = later(t.clock);
        }
        for t in &mut self.targets {
            t.clock = later(t.clock);
        }
        self.collective_clock = later(self.collective_clock);
        self.ledger_clock = later(self.ledger_clock);
        // Nothing was committed while nobody ran: the stall check measures from when the process continues.
        self.last_progress += for_;
        // Nor is the stop charged to the restart window (the core's clock skips it): earlier failures move with it.
        for t in &mut self.target_failures {
            *t += for_;
        }
    }

    // ------------------------------------------------------------------ the loop

    fn step(&mut self, driver: &mut Driver<Replica>, occ: Occ) -> Check {
        match occ {
            Occ::Deliver(event) => {
                if let Event::Shutdown(signal) = *event {
                    self.shutdown_requested.get_or_insert(signal);
                }
                self.feed(driver, *event)?
            }
            Occ::Snapshot { id, generation, replica } => {
                driver.keep_snapshot((id, generation, replica.step), replica);
                let (step, optimizer_steps) = (replica.step, replica.optimizer_steps);
                self.feed(driver, Event::Snapshot { id, generation, step, optimizer_steps })?
            }
            Occ::Built { id, generation } => self.built(id, generation)?,
            Occ::Wake { id, generation } => self.run_thread(id, generation)?,
            Occ::Computed { id, generation } => self.computed(id, generation)?,
            Occ::Served { claim, optimizer_steps } => self.served(claim, optimizer_steps),
            Occ::TargetBuilt { target, generation } => {
                let t = &mut self.targets[target];
                if t.generation == generation && t.stage == TargetStage::Building {
                    t.stage = TargetStage::Ready;
                    let clock = t.clock;
                    self.targets[target].clock = self.send_from(clock, Event::TargetReady { target, generation });
                    self.target_work(target);
                }
            }
            Occ::TargetDone { target, generation } => self.target_done(target, generation),
            Occ::Scan(filter) => {
                let found = self.scanned(filter);
                self.feed(driver, found)?
            }
            Occ::WriteDone => self.write_done()?,
            Occ::Tick => {
                self.after(ms(200), Occ::Tick);
                // The writer tries the lines that failed again (every second in the service).
                self.write_ledger();
                let watched = self.watched(driver.core());
                self.feed(driver, Event::Watch(watched))?;
            }
            Occ::Fault => {
                let mean = self.p.fault_every_s;
                let next = Duration::from_secs_f64(-mean * (1.0 - self.rng.random::<f64>()).ln());
                self.after(next, Occ::Fault);
                if let Some(event) = self.fault(driver.core()) {
                    self.feed(driver, event)?
                }
            }
            Occ::Freeze(for_) => self.freeze(for_, driver.core().status().step),
            Occ::Restart => self.start_process(driver)?,
            Occ::HostBack(rank) => self.host_back(rank),
            Occ::LedgerFreed => self.ledger_full = false,
        }
        Ok(())
    }

    fn run(&mut self, driver: &mut Driver<Replica>) -> Check {
        self.start_process(driver)?;
        let first = Duration::from_secs_f64(self.p.fault_every_s);
        self.after(first, Occ::Fault);
        if let Some((after, for_)) = self.planned_freeze {
            self.after(after, Occ::Freeze(for_));
        }
        while let Some(Reverse((when, seq))) = self.queue.pop() {
            let Some((process, occ)) = self.pending.remove(&seq) else { continue };
            // Whatever the last process left scheduled died with it; faults and restarts outlive it.
            let everlasting = matches!(occ, Occ::Fault | Occ::Restart | Occ::LedgerFreed);
            if process != self.process && !everlasting {
                continue;
            }
            if !self.alive && !everlasting {
                continue;
            }
            if matches!(occ, Occ::Fault) && !self.alive {
                if self.pending.values().any(|(_, o)| matches!(o, Occ::Restart)) {
                    self.now = when;
                    let next = Duration::from_secs_f64(self.p.fault_every_s);
                    self.after(next, Occ::Fault);
                }
                continue;
            }
            self.now = when;
            self.step(driver, occ)?;
            if self.alive && self.now.saturating_sub(self.last_progress) > STALL {
                return violation(format!(
                    "no step committed for {} s and no exit: {:?}",
                    STALL.as_secs(),
                    driver.core().status()
                ));
            }
            if self.now > HORIZON {
                break;
            }
        }
        self.check_ledger(driver.core())
    }

    /// Every sample at most once per epoch; once the run completed, every epoch whole (set-aside batches aside).
    fn check_ledger(&self, core: &Core) -> Check {
        let mut per_epoch: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (_, epoch, samples) in &self.ledger {
            per_epoch.entry(*epoch).or_default().extend(samples);
        }
        for (epoch, samples) in &mut per_epoch {
            samples.sort_unstable();
            if let Some(w) = samples.windows(2).find(|w| w[0] == w[1]) {
                return violation(format!("epoch {epoch} trained sample {} twice", w[0]));
            }
        }
        if self.completed && self.p.max_steps == 0 {
            let aside: Vec<BatchId> = core.set_aside().to_vec();
            for epoch in 0..self.p.epochs {
                let mut samples = per_epoch.remove(&epoch).unwrap_or_default();
                for b in aside.iter().filter(|b| b.epoch == epoch) {
                    samples.extend(self.batches.get(b).into_iter().flatten());
                }
                samples.sort_unstable();
                samples.dedup();
                if samples.len() != self.p.samples {
                    let missing: Vec<usize> =
                        (0..self.p.samples).filter(|s| samples.binary_search(s).is_err()).collect();
                    let batches: Vec<&BatchId> = self
                        .batches
                        .iter()
                        .filter(|(_, p)| p.iter().any(|s| missing.contains(s)))
                        .map(|(b, _)| b)
                        .collect();
                    return violation(format!(
                        "the run completed but epoch {epoch} holds {} of {} samples: missing {missing:?}, in {batches:?}",
                        samples.len(),
                        self.p.samples
                    ));
                }
            }
        }
        Ok(())
    }

    fn report(&self, error: &str) -> String {
        format!(
            "seed {} failed: {error}\nparameters: {:?}\nexits: {:?}\nlast events:\n{}\nreplay: DFLASH_SIM_SEED={} cargo \
             test --lib sim_replay -- --nocapture",
            self.seed,
            self.p,
            self.exits,
            self.trace.iter().cloned().collect::<Vec<_>>().join("\n"),
            self.seed
        )
    }
}

impl Effects for World {
    type Snapshot = Replica;

    fn now(&self) -> Duration {
        self.now
    }

    fn start_target(&mut self, target: usize, generation: u64) {
        let t = &mut self.targets[target];
        *t = TargetThread {
            generation,
            stage: TargetStage::Building,
            queue: VecDeque::new(),
            busy: false,
            clock: t.clock,
        };
        let delay = self.jitter(10, 100);
        self.after(delay, Occ::TargetBuilt { target, generation });
    }

    fn abandon_target(&mut self, target: usize, generation: u64) {
        let t = &mut self.targets[target];
        if t.generation == generation && t.stage != TargetStage::Gone {
            // Found hung: a failure like any other (it counts against the restart limit).
            t.stage = TargetStage::Gone;
            self.target_failures.push(self.now);
            self.hung_targets_found += 1;
        }
    }

    fn send_to_target(&mut self, target: usize, generation: u64, request: Request) {
        let item = self.captured(request.item);
        let t = &mut self.targets[target];
        if t.generation == generation && t.stage != TargetStage::Gone {
            t.queue.push_back((request.seq, request.drafter, request.generation, item));
            self.target_work(target);
        }
    }

    fn start_drafter(&mut self, id: usize, generation: u64, start: Start) {
        if let Some(&g) = self.routes.get(&id)
            && self.threads.get(&(id, g)).is_some_and(|t| t.stage != Stage::Gone)
            && self.rounds.is_member(id, g)
        {
            self.found(violation(format!("drafter {id} started again while its thread {g} is still a member")));
            return;
        }
        let founder = matches!(start, Start::Found(_));
        self.threads.insert(
            (id, generation),
            Thread {
                start,
                stage: Stage::Building,
                replica: Replica { step: 0, hash: 0, optimizer_steps: 0 },
                inbox: VecDeque::new(),
                items: vec![],
                samples: 0,
                taken: 0,
                joined: Rc::new(Cell::new(None)),
                snapshot_at: None,
                since: self.now,
                clock: self.now,
            },
        );
        self.routes.insert(id, generation);
        if std::mem::take(&mut self.armed.start_hang) {
            self.note(format!("fault: drafter {id}.{generation} never finishes starting"));
        } else {
            let delay = self.jitter(5, 60);
            self.after(delay, Occ::Built { id, generation });
            if std::mem::take(&mut self.armed.start_crash) || (founder && std::mem::take(&mut self.armed.kill_founder))
            {
                self.kill(id, generation, FailureKind::Panic, "fault: crash while starting");
            }
        }
    }

    fn abandon_drafter(&mut self, id: usize, generation: u64) -> Vec<(usize, u64)> {
        if self.routes.get(&id) == Some(&generation) {
            self.routes.remove(&id);
        }
        let removal = self.rounds.remove(id, generation);
        if self.threads.get(&(id, generation)).is_some_and(|t| t.stage != Stage::Gone) {
            // Its actor is stopped: the supervisor hears of it.
            self.supervision(Event::DrafterExited { id, generation });
            self.wake(id, generation);
        }
        let check = self.complete_rounds();
        self.found(check);
        removal.remaining
    }

    fn tell(&mut self, id: usize, generation: u64, order: Order) {
        if order == Order::ServeJoiners && std::mem::take(&mut self.armed.kill_donor_on_serve) {
            self.kill(id, generation, FailureKind::Panic, "fault: the donor dies as it is asked to serve");
        }
        if self.routes.get(&id) == Some(&generation)
            && let Some(t) = self.threads.get_mut(&(id, generation))
        {
            t.inbox.push_back(Msg::Order(order));
            self.wake(id, generation);
        }
    }

    fn rewind_collective(&mut self, step: u64, samples_committed: u64) -> Result<(), String> {
        self.rounds.rewind(step).map_err(|e| format!("the collective has members: {e}"))?;
        self.samples_committed = samples_committed;
        self.boundary_samples.insert((self.process, self.rounds.incarnation(), step), samples_committed);
        Ok(())
    }

    fn find_checkpoint(&mut self, filter: ScanFilter) {
        let delay = self.jitter(5, 60);
        self.after(delay, Occ::Scan(filter));
    }

    fn write_checkpoint(&mut self, job: WriteJob, replica: Replica) {
        if replica.step != job.step || job.state.step != job.step {
            self.found(violation(format!(
                "checkpoint of step {} pairs a snapshot of step {} with a state of step {}",
                job.step, replica.step, job.state.step
            )));
            return;
        }
        let key = (self.process, self.rounds.incarnation(), job.step);
        if let Some(&samples) = self.boundary_samples.get(&key)
            && samples != job.state.samples_committed
        {
            self.found(violation(format!(
                "checkpoint of step {}: {} samples committed in its state, {samples} at that boundary",
                job.step, job.state.samples_committed
            )));
            return;
        }
        self.writes.push_back(DiskJob::Write(Box::new(job), replica));
        self.next_write();
    }

    fn retire_checkpoints(&mut self, from: u64, to: u64) {
        self.writes.push_back(DiskJob::Retire(from, to));
        self.next_write();
    }

    fn append_ledger(&mut self, entry: LedgerEntry) {
        self.committing = match &entry {
            LedgerEntry::Commit { step, batch } if self.committing.0 == *step => {
                (*step, self.committing.1 + batch.samples.len() as u64)
            }
            LedgerEntry::Commit { step, batch } => (*step, batch.samples.len() as u64),
            LedgerEntry::Rewind { .. } => (u64::MAX, 0),
        };
        self.ledger_pending.push_back(entry);
        self.write_ledger();
    }

    fn export(&mut self, from: PathBuf) {
        self.after(ms(50), Occ::Deliver(Box::new(Event::Exported(Ok(from)))));
    }

    fn evaluate(&mut self, _: &Core, step: u64, _: PathBuf) {
        let e = Evaluated {
            step,
            decode_acceptance_length: 1.5,
            holdout_acceptance_length: None,
            holdout_rows: 0,
            token_match_rate: 1.0,
            lossless: true,
            prompts: 1,
            seconds: 0.1,
            best: 1.5,
            new_best: false,
        };
        self.after(ms(100), Occ::Deliver(Box::new(Event::Evaluated(Ok(e)))));
    }

    fn post_feed(&mut self, rank: usize, generation: u64, step: u64, feed: Feed) {
        let Some(at) = self.remote.iter().position(|r| r.rank == rank) else {
            return self.found(violation(format!("an assignment of step {step} for host {rank}, not in the run")));
        };
        if !self.remote[at].alive || self.remote[at].generation != generation {
            // The store keeps it; that host's shell passes on only what is for the generation it is.
            return;
        }
        let items = feed.items.into_iter().map(|(drafter, item)| (drafter, self.captured(item))).collect();
        self.remote[at].fed.insert(step, items);
    }

    fn notice(&mut self, notice: Notice) {
        if let Notice::Committed { step, .. } = notice {
            self.last_progress = self.now;
            // The core commits (its ledger's lines, before this notice) what the round trained, on every host.
            let committed = match std::mem::replace(&mut self.committing, (u64::MAX, 0)) {
                (at, samples) if step.checked_sub(1) == Some(at) => samples,
                _ => 0,
            };
            let trained = self.round_samples.get(&(self.process, self.rounds.incarnation(), step.saturating_sub(1)));
            if trained != Some(&committed) {
                let what =
                    format!("step {step} committed batches of {committed} samples; its round trained {trained:?}");
                self.found(violation(what));
            }
        }
    }

    fn exit(&mut self, core: &Core, code: i32) {
        let check = self.exited(core, code);
        self.found(check);
    }

    fn bug(&mut self, what: String) {
        self.found(violation(what));
    }

    fn saw_event(&mut self, event: &Event) {
        self.events += 1;
        self.note(format!("-> {}", short(&format!("{event:?}"))));
    }

    fn saw_action(&mut self, action: &Action) {
        self.note(format!("<- {}", short(&format!("{action:?}"))));
    }
}

fn setup(p: &Params, config: Config, resume: Option<(PathBuf, TrainerState)>, rejected: Vec<u64>) -> Setup {
    Setup {
        config,
        // Two drafters a device: hangs count per device (and a lost device takes both: `World::fault`).
        drafter_devices: (0..p.drafters).map(|i| format!("cuda:{}", i / 2)).collect(),
        target_devices: (0..p.targets).map(|i| format!("cuda:{i}")).collect(),
        feeds: (0..p.drafters).map(|i| i % p.targets).collect(),
        lengths: vec![16; p.samples],
        sample_ids: (0..p.samples as u64).map(SampleId::Number).collect(),
        resume,
        rejected,
        role: (p.hosts > 1).then_some(HostRole::Leader),
    }
}

fn path_of(step: u64) -> PathBuf {
    PathBuf::from(format!("ckpt-{step:09}"))
}

fn step_of(path: &std::path::Path) -> u64 {
    path.to_string_lossy().trim_start_matches("ckpt-").parse().expect("a path from path_of")
}

fn choose<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> Option<&'a T> {
    (!items.is_empty()).then(|| &items[rng.random_range(0..items.len())])
}

fn short(s: &str) -> String {
    if s.len() > 240 { format!("{}...", &s[..240]) } else { s.to_string() }
}

/// Runs one seed; the error is the whole report.
/// What a seed did: events fed to the core, hung target copies found, and its exits with their reasons.
#[derive(Debug, PartialEq)]
struct Outcome {
    events: u64,
    hung_targets: u64,
    remote_batches: u64,
    hosts_lost: u64,
    exits: Vec<(i32, String)>,
}

/// A driver before the first process starts (the world's `start_process` gives each process its own).
fn no_process(p: &Params) -> Driver<Replica> {
    Driver::new(Core::new(setup(p, p.config(), None, vec![])))
}

fn simulate(seed: u64, full_trace: bool) -> Result<Outcome, String> {
    let mut world = World::new(seed, full_trace);
    let mut driver = no_process(&world.p);
    match world.run(&mut driver) {
        Ok(()) => Ok(Outcome {
            events: world.events,
            hung_targets: world.hung_targets_found,
            remote_batches: world.remote_batches,
            hosts_lost: world.hosts_lost,
            exits: world.exits,
        }),
        Err(e) => Err(world.report(&e)),
    }
}

fn seeds(default: u64) -> u64 {
    std::env::var("DFLASH_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// A CI-sized set of seeds (`DFLASH_SIM_SEEDS` for more, from `DFLASH_SIM_FIRST`).
#[test]
fn sim_many_seeds_hold_every_invariant() {
    let n = seeds(48);
    let first: u64 = std::env::var("DFLASH_SIM_FIRST").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let (mut events, mut hung_targets, mut remote_batches, mut hosts_lost) = (0, 0, 0, 0);
    let mut endings: BTreeMap<String, usize> = BTreeMap::new();
    for seed in first..first + n {
        match simulate(seed, false) {
            Ok(outcome) => {
                events += outcome.events;
                hung_targets += outcome.hung_targets;
                remote_batches += outcome.remote_batches;
                hosts_lost += outcome.hosts_lost;
                for (code, why) in outcome.exits {
                    *endings.entry(format!("{code} ({why})")).or_default() += 1;
                }
            }
            Err(report) => panic!("{report}"),
        }
    }
    eprintln!(
        "{n} seeds, {events} events to the core, {hung_targets} hung target copies found, {remote_batches} batches \
         trained by other hosts, {hosts_lost} hosts lost; endings: {endings:?}"
    );
    assert!(events > n * 1000, "the schedules should be long: {events} events");
    assert!(n < 20 || hung_targets > 0, "no hung target copy was found by the watchdog");
    assert!(n < 20 || (remote_batches > 0 && hosts_lost > 0), "no run of several hosts trained and lost a host");
    for wanted in ["0 (complete)", "3 (no progress)"] {
        assert!(endings.keys().any(|k| k == wanted), "no seed ended with {wanted}: {endings:?}");
    }
}

/// Replays one seed with its whole trace: `DFLASH_SIM_SEED=<seed>`.
#[test]
fn sim_replay() {
    let Some(seed) = std::env::var("DFLASH_SIM_SEED").ok().and_then(|s| s.parse().ok()) else { return };
    if let Err(report) = simulate(seed, true) {
        panic!("{report}");
    }
}

/// A process stopped for longer than every deadline (SIGSTOP, a swapping host, a paused VM) goes on as if nothing
/// happened: the time it did not run is charged to nobody, so no drafter or target copy is failed for it, and the run
/// completes.
#[test]
fn sim_a_stopped_process_fails_nobody() {
    for seed in 0..8 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // No faults, and no slow disk: a final checkpoint slower than the ending's deadline exits 75, rightly.
        let p =
            Params { fault_every_s: 1e9, hang_floor_s: 1.0, max_steps: 0, slow_writes: 0.0, ..Params::draw(&mut rng) };
        let mut world = World::with(seed, p, rng, false);
        let mut driver = no_process(&world.p);
        world.planned_freeze = Some((Duration::from_secs(2), Duration::from_secs(40)));
        if let Err(e) = world.run(&mut driver) {
            panic!("{}", world.report(&e));
        }
        let status = driver.core().status();
        let froze_at = world.froze_at_step.expect("the process was stopped");
        assert!(
            froze_at > 0 && status.step > froze_at,
            "stopped while training: at step {froze_at} of {}",
            status.step
        );
        assert_eq!(world.exits.iter().map(|e| e.0).collect::<Vec<_>>(), [EXIT_OK], "seed {seed}");
        let restarts: Vec<u64> = status.drafters.iter().map(|d| d.restarts).collect();
        assert!(restarts.iter().all(|&r| r == 0), "seed {seed}: drafter restarts {restarts:?}");
        assert!(status.targets.iter().all(|t| t.restarts == 0), "seed {seed}: {:?}", status.targets);
    }
}

/// The same seed, the same run: the simulation (and the core) are deterministic.
#[test]
fn sim_is_deterministic() {
    let a = simulate(7, false);
    let b = simulate(7, false);
    assert_eq!(a, b);
}
