//! A deterministic simulation of the supervisor, in the spirit of FoundationDB's and TigerBeetle's simulators: the
//! real [`Core`] behind the real [`Driver`] (the process's own executor of its actions), and the real collective
//! bookkeeping ([`Rounds`]), in a model world of drafter threads, target copies, a checkpoint writer and a disk
//! (the world is the driver's [`Effects`], in memory), with a seeded random schedule of thousands of events:
//! failures of any subset of drafters at once, failures during a rejoin, of the donor, of a founder, hangs of
//! drafters and of target copies (found by the watchdog), slow steps flagged as hangs, a lost device taking every
//! thread on it, target failures (at times with a drafter's in the same instant) and batches that crash the target,
//! failed, slow and corrupted checkpoints, unreadable checkpoint folders, a full ledger disk, SIGTERM at any point and
//! SIGKILL followed by `--resume auto` (sometimes with another number of drafters), reloads, the whole process
//! stopped for a while (SIGSTOP, a swapping host). Messages from one sender arrive in order; messages from different
//! senders interleave at random, as they do between ractor's message queue and its supervision events.
//!
//! A third of the seeds are runs of 2-3 hosts ([`Cluster`]): each host a world of its own with its own core (rank 0
//! the leader, the others followers) behind its own driver, over one store ([`Store`]) that rank 0's process serves
//! and that dies with it, holding the protocol's keys in a [`MemoryStore`] and rank 0's real [`Coordinator`] over them
//! on the simulated clock (generations, beats, arrivals, decisions, membership), the assignments, the rounds'
//! contributions, and the hosts' entries. Each host's
//! link judges rank 0 with the real [`LeaderWatch`] and its membership with the real `still_member`. Any host may be
//! stopped (shorter or longer than `cluster.leader_timeout_s`) or killed; the store is slow now and then; a host
//! killed or left out enters again at a round boundary with a live host's state; rank 0 lost, the others checkpoint
//! their replicas and end, and the run restarts from the newest checkpoint of any host.
//!
//! Checked after every event, or at the end of a run:
//! - the run commits a step within a bounded simulated time, or ends with a documented exit code (never a silent
//!   stall); no host outlives rank 0's store for long;
//! - every sample is committed at most once per epoch (rewinds undo what they undo), and a completed run committed
//!   each epoch whole, set-aside batches aside; each step commits exactly the batches its round trained on every
//!   host;
//! - every round's contributors hold the same state, at the round's step, on every host, after as many samples;
//!   founders load the state the collective was rewound to; joiners receive the state of the open round;
//! - the learning rate of every round is the schedule's value at that round (steps under `optim.max_steps`,
//!   committed samples otherwise), whatever the number of drafters, across rewinds and resumes;
//! - a checkpoint's trainer state is the one of its snapshot's step boundary (a follower's, derived from rank 0's
//!   word and the rounds since, too);
//! - retention keeps the newest `keep` checkpoints not known invalid, and never deletes one because of invalid ones;
//! - rank 0 is taken for lost only after a stop of at least `cluster.leader_timeout_s`.
//!
//! `cargo test sim_` runs a CI-sized set of seeds and the shapes of rank 0 stopped and killed;
//! `DFLASH_SIM_SEEDS=20000 cargo test --release sim_many` runs more (`DFLASH_SIM_FIRST` moves the first seed);
//! a failing seed prints its parameters, the end of its trace and the command that replays it in full
//! (`DFLASH_SIM_SEED=<seed> cargo test --lib sim_replay -- --nocapture`; `DFLASH_SIM_TRACE=1` prints the traces of
//! the shaped tests).
use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cell::RefCell;

use super::core::{Core, HostRole, Setup, step_settings};
use super::driver::{Driver, Effects};
use super::hosts::{FeedCursor, LOOKS_STALL_AFTER_S, SILENT_AFTER};
use super::protocol::{
    Action, Activity, DrafterSeen, Event, Feed, LedgerEntry, Notice, Order, Request, ScanFilter, Start, WriteJob,
};
use super::schedule::Item;
use super::spawned::Spawned;
use crate::cluster::exchange::{
    self, Coordinator, ExchangeError, ManualClock, announce, beat, contribute, generations, still_member,
};
use crate::cluster::quorum::{Closed, LeaderWatch, Reply};
use crate::cluster::store::MemoryStore;
use crate::config::Config;
use crate::data::SampleId;
use crate::data::loader::BatchId;
use crate::ffi::store::StoreError;
use crate::service::evaluator::Evaluated;
use crate::service::exit::{
    EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NO_PROGRESS, EXIT_OK, EXIT_RESTART, EXIT_TERMINATED, StopSignal,
};
use crate::service::failure::{Failure, FailureKind};
use crate::train::checkpoint::{Scan, TrainerState, Written, to_delete};
use crate::train::collective::book::{self, Book, Counted, Settled};
use crate::train::link::{DrafterPart, HostMember, HostRecord};
use crate::train::objective::Metrics;
use crate::train::optim::{LrSchedule, ScheduleKind};
use crate::train::rounds::{Claim, Completed, JoinPoll, Rounds};

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
    /// Hosts of the run, each a world of its own with its own core (rank 0 the leader), over one store.
    hosts: usize,
    /// `cluster.round_timeout_s` and `cluster.leader_timeout_s`.
    round_timeout_s: f64,
    leader_timeout_s: f64,
    /// The odds that a checkpoint write takes far longer than the rest (a slow or stuck disk), and that an
    /// operation on the store does (a slow network, a store busy serving).
    slow_writes: f64,
    slow_store: f64,
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
            round_timeout_s: [8.0, 20.0][rng.random_range(0..2)],
            leader_timeout_s: [15.0, 45.0][rng.random_range(0..2)],
            slow_writes: 0.03,
            slow_store: 0.02,
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

/// The state a replica holds after applying round `step` from `start`: the sum of every batch trained in it, in
/// the order hosts and their drafters sum.
fn applied<'a>(start: Replica, step: u64, batches: impl Iterator<Item = &'a BatchId>) -> Replica {
    let hash = batches.fold(mix(start.hash, step), |hash, b| mix(hash, b.epoch << 32 | b.ordinal));
    Replica { step: step + 1, hash, optimizer_steps: start.optimizer_steps + 1 }
}

/// Every batch of a run's round, in the order its member hosts (rank order) and their drafters sum.
fn batches_of(records: &[HostRecord]) -> impl Iterator<Item = &BatchId> {
    records.iter().flat_map(|h| &h.contributions).flat_map(|c| &c.batches)
}

fn mix(a: u64, b: u64) -> u64 {
    (a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15)).rotate_left(29).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    Building,
    /// Several hosts: a founder waiting to be admitted to the run with a live host's state.
    Entering,
    Joining,
    Collecting,
    Computing {
        hung: bool,
    },
    InRound,
    /// Copying its state into joiners it claimed.
    Serving,
    /// The store is gone mid-round: keeping the state of the round's start until asked for it, or to stop.
    Parting,
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
            Stage::Building | Stage::Entering | Stage::Joining | Stage::Gone => Activity::Starting,
            Stage::Collecting => Activity::WaitingForWork,
            Stage::Computing { .. } => Activity::Computing,
            Stage::InRound | Stage::Parting => Activity::WaitingForPeers,
            Stage::Serving => Activity::Serving,
        }
    }
}

/// Why a host's contributors did not get the run's round.
#[derive(Debug, Clone)]
enum Missed {
    /// The store cannot be reached (rank 0's process is gone, or taken for lost): the round's fate is unknown, and
    /// the drafters keep their state of its start for the checkpoint on the way out.
    Gone,
    /// Anything else (dropped from the round, the coordinator stopped): they fail.
    Failed(String),
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

impl Counted for Contribution {
    fn samples(&self) -> u64 {
        self.samples
    }
    /// A sample weighs one.
    fn weight(&self) -> f64 {
        self.samples as f64
    }
    fn batches(&self) -> &[BatchId] {
        &self.batches
    }
    fn metrics(&self) -> Metrics {
        Metrics::default()
    }
}

/// A round this host settled, waiting for the run's: the round, what the book settled, and the samples committed
/// before it.
struct Waiting {
    done: Completed<Contribution>,
    settled: Settled,
    before: u64,
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
    /// The process is killed (SIGKILL, the machine lost): nothing it held survives, nothing is said.
    Kill,
    /// The ledger's disk has room again.
    LedgerFreed,
    /// Several hosts: an entering host's founder gets the run's state from a live host (at the first round it
    /// takes part in, with the samples committed before it), or learns that no live host had one.
    Entered {
        /// The generation the host announced itself as.
        generation: u64,
        state: Result<(u64, Replica, u64), String>,
    },
    /// Several hosts: the run's round `step`, as this host's waiting contributors get it: every member host's
    /// record, in rank order, or why this host is not in it.
    RunRound {
        step: u64,
        records: Result<Vec<HostRecord>, Missed>,
    },
    /// Rank 0's coordinator looks at the store.
    Coordinate,
    /// A host's feed reader reads the assignments posted for it.
    ReadFeeds,
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

/// What the hosts of a run share: rank 0's store, served by rank 0's process (it dies with it): the protocol's keys
/// (each host's announced generation, beats, arrivals, decisions) with rank 0's real coordinator over them, the
/// contributions to rounds, the assignments and the run's end. What one host does through it reaches
/// another as an occurrence of that host's world (`mail`), which the cluster hands over after each event.
#[derive(Default)]
struct Store {
    /// Rank 0's process that serves it (0: none: rank 0 is gone, or not started yet).
    served_by: u32,
    /// Rank 0's process is stopped from `.0` until `.1`: the store does not answer meanwhile.
    stopped: (Duration, Duration),
    /// The keys the real protocol writes (generations, beats, arrivals, decisions, membership), in memory, and rank
    /// 0's real coordinator over them from the run's founding (none once it stalled), on the simulated clock: seconds
    /// since the founding.
    keys: Rc<MemoryStore>,
    coordinator: Option<Coordinator<Rc<MemoryStore>>>,
    founded_at: Duration,
    clock: ManualClock,
    stalled: bool,
    /// Contributions by round and rank, beside the arrival the coordinator reads: the host's record, the state its
    /// replicas started the round from, and the samples it had committed before it.
    posted: BTreeMap<u64, BTreeMap<usize, (HostRecord, Replica, u64)>>,
    /// The members of closed rounds, with their generations (kept a while, for contributions that come late).
    closed: BTreeMap<u64, Vec<(usize, u64)>>,
    /// The member hosts as rank 0's link knows them.
    members: Vec<HostMember>,
    ended: Option<i32>,
    /// The state every host's replicas held at the start of round `(rank 0's process, step)`.
    round_start: HashMap<(u32, u64), Replica>,
    mail: Vec<(usize, Duration, Occ)>,
}

impl Store {
    /// Whether rank 0's process serves the store and answers now.
    fn answers(&self, now: Duration) -> bool {
        self.served_by > 0 && !(self.stopped.0 <= now && now < self.stopped.1)
    }
}

/// A host's side of the link (a host other than rank 0, and rank 0 for its own generation).
struct Link {
    /// The generation this host announced itself as (0: none yet), and the one it entered the run as with its
    /// first round.
    generation: u64,
    entered: Option<(u64, u64)>,
    /// The feed reader's decisions, and the order of its messages.
    cursor: FeedCursor,
    clock: Duration,
    watch: LeaderWatch,
    /// Rank 0 found lost.
    lost: bool,
}

impl Link {
    fn new(p: &Params) -> Self {
        Link {
            generation: 0,
            entered: None,
            cursor: FeedCursor::default(),
            clock: Duration::ZERO,
            watch: LeaderWatch::new(p.leader_timeout_s, LOOKS_STALL_AFTER_S),
            lost: false,
        }
    }
}

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
    /// The collective's book: the settings and the samples committed.
    book: Book,
    rounds: Rounds<Contribution, Rc<Cell<Option<Replica>>>>,
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
    /// This process asked for the export of a completed run (its exit follows the answer).
    exported: bool,
    /// The signal that asked this process to stop, if any.
    shutdown_requested: Option<StopSignal>,
    write_failed: bool,
    target_failures: Vec<Duration>,
    /// The largest `min_live_drafters` and the smallest `max_restarts` of this process so far.
    strictest: (usize, usize),
    /// The last lines of every host's trace, in one order.
    trace: Rc<RefCell<VecDeque<String>>>,
    full_trace: bool,
    events: u64,
    /// Hung target copies the watchdog found.
    hung_targets_found: u64,
    /// Batches other hosts trained in rounds, and hosts dropped from rounds.
    remote_batches: u64,
    hosts_lost: u64,
    /// Several hosts: entries into a running run, checkpoints of a replica written when rank 0 was lost, and those
    /// rank 0 adopted.
    entries: u64,
    survivor_checkpoints: u64,
    adopted: u64,
    /// What the world saw go wrong while the driver carried out an action (the first of it).
    violation: Option<String>,
    /// This host's rank, the store every host shares, this host's link, and its summed rounds waiting for the
    /// run's round, by step.
    rank: usize,
    store: Rc<RefCell<Store>>,
    link: Link,
    waiting: BTreeMap<u64, Waiting>,
    /// The process is stopped until then: nothing reaches it before; how long it was stopped in all.
    frozen_until: Duration,
    frozen_for: Duration,
    /// A stop of the process to schedule at start `(after, for)`, and the committed step it came at; a kill to
    /// schedule at start.
    planned_freeze: Option<(Duration, Duration)>,
    planned_kill: Option<Duration>,
    froze_at_step: Option<u64>,
}

type Check = Result<(), String>;

fn violation(what: impl Into<String>) -> Check {
    Err(what.into())
}

impl World {
    /// Host `rank` of a run over `store`: its own random schedule, drawn from the seed.
    fn with(seed: u64, p: Params, rng: ChaCha8Rng, full_trace: bool, rank: usize, store: Rc<RefCell<Store>>) -> Self {
        let config = p.config();
        let rng = match rank {
            0 => rng,
            _ => ChaCha8Rng::seed_from_u64(mix(seed, rank as u64)),
        };
        World {
            rank,
            link: Link::new(&p),
            store,
            waiting: BTreeMap::new(),
            frozen_until: Duration::ZERO,
            frozen_for: Duration::ZERO,
            seed,
            book: Book::new(step_settings(&config, p.samples as u64, None), 0),
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
            exported: false,
            shutdown_requested: None,
            write_failed: false,
            target_failures: vec![],
            strictest: (0, usize::MAX),
            trace: Rc::new(RefCell::new(VecDeque::new())),
            full_trace,
            events: 0,
            hung_targets_found: 0,
            remote_batches: 0,
            hosts_lost: 0,
            entries: 0,
            survivor_checkpoints: 0,
            adopted: 0,
            violation: None,
            planned_freeze: None,
            planned_kill: None,
            froze_at_step: None,
        }
    }

    fn note(&mut self, line: String) {
        let line = format!("{:>10.3}s h{} p{} {line}", self.now.as_secs_f64(), self.rank, self.process);
        if self.full_trace {
            println!("{line}");
        }
        let mut trace = self.trace.borrow_mut();
        trace.push_back(line);
        if trace.len() > 160 {
            trace.pop_front();
        }
    }

    fn at(&mut self, when: Duration, occ: Occ) {
        self.seq += 1;
        // Nothing reaches a stopped process before it runs again (what it had scheduled moved with the stop).
        let when = when.max(self.now).max(self.frozen_until);
        self.queue.push(Reverse((when, self.seq)));
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
        // Rank 0 resumes from its newest checkpoint (the cluster moved a newer one of another host's in first); the
        // other hosts take the run's state from a live host.
        let (resume, rejected) = if self.rank == 0 { self.scan_disk(&|_| true) } else { (None, vec![]) };
        let mut config = self.p.config();
        if self.process > 1 && self.p.hosts == 1 && self.rng.random_bool(0.4) {
            // Resumed on another machine: another number of drafters (every host of a run has as many).
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
        *driver = Driver::new(Core::new(setup(&self.p, self.rank, config.clone(), resume, rejected)));
        self.book = Book::new(step_settings(&config, self.p.samples as u64, None), samples);
        self.rounds = Rounds::new(step);
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
        self.exported = false;
        self.waiting.clear();
        self.link = Link::new(&self.p);
        if self.rank == 0 && self.p.hosts > 1 {
            // Rank 0's process serves a new store.
            let mut store = self.store.borrow_mut();
            let (round_start, mail) = (std::mem::take(&mut store.round_start), std::mem::take(&mut store.mail));
            *store = Store { served_by: self.process, round_start, mail, ..Store::default() };
        }
        self.after(ms(200), Occ::Tick);
        driver.start(self);
        self.checked()
    }

    // ------------------------------------------------------------------ several hosts

    fn leader(&self) -> bool {
        self.p.hosts > 1 && self.rank == 0
    }

    fn follower(&self) -> bool {
        self.rank > 0
    }

    /// Something for host `rank`'s world, through the store (after its latency).
    fn mail(&mut self, rank: usize, delay: Duration, occ: Occ) {
        let when = self.now + delay + self.store_latency(0, 0);
        self.store.borrow_mut().mail.push((rank, when, occ));
    }

    /// How long an operation on the store takes: `lo..=hi` ms, or now and then far longer (a slow store).
    fn store_latency(&mut self, lo: u64, hi: u64) -> Duration {
        match self.rng.random_bool(self.p.slow_store) {
            true => self.jitter(500, 8000),
            false => self.jitter(lo, hi),
        }
    }

    /// A founder enters the run: rank 0's founds it (the coordinator starts, with the hosts already announced as
    /// founders, who get its state); another host's announces itself as a new generation and waits to be admitted
    /// at a round boundary with a live host's state. Returns whether the founder goes on now (rank 0).
    fn enter_run(&mut self, id: usize, generation: u64, replica: Replica) -> bool {
        let mut store = self.store.borrow_mut();
        if store.served_by == 0 {
            drop(store);
            self.kill(id, generation, FailureKind::Torch, "the rendezvous host cannot be reached");
            return false;
        }
        self.link.generation = announce(&*store.keys, self.rank).expect("the memory store answers");
        if self.rank > 0 {
            drop(store);
            let t = self.threads.get_mut(&(id, generation)).expect("present");
            t.enter(Stage::Entering, self.now);
            self.note(format!("host {} announces itself as generation {}", self.rank, self.link.generation));
            self.mail(0, ms(1), Occ::Coordinate);
            return true;
        }
        // Rank 0 founds the run at its founder's step, with the hosts announced by now: its coordinator starts.
        let step = replica.step;
        let announced = generations(&*store.keys, self.p.hosts).expect("the memory store answers");
        let founders: Vec<(usize, u64)> =
            announced.iter().enumerate().filter(|&(_, &g)| g > 0).map(|(r, &g)| (r, g)).collect();
        store.founded_at = self.now;
        store.clock.set(0.0);
        let deadline = Duration::from_secs_f64(self.p.round_timeout_s);
        let coordinator =
            Coordinator::with_clock(store.keys.clone(), self.p.hosts, step, deadline, store.clock.clock());
        store.coordinator = Some(coordinator.expect("the memory store answers"));
        store.members =
            founders.iter().map(|&(rank, generation)| HostMember { rank, generation, from: step }).collect();
        let others: Vec<(usize, u64)> = founders.iter().copied().filter(|&(r, _)| r != 0).collect();
        let members = store.members.clone();
        drop(store);
        self.link.entered = Some((self.link.generation, step));
        self.note(format!("rank 0 founds the run at step {step} with hosts {founders:?}"));
        for (rank, generation) in others {
            let state = Ok((step, replica, self.book.samples_committed()));
            self.mail(rank, ms(3), Occ::Entered { generation, state });
        }
        self.after(ms(1), Occ::Deliver(Box::new(Event::Hosts(members))));
        true
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
        // Rank 0's end: it tells the other hosts (they end too), and its store goes with its process.
        let ended = match self.follower() {
            true => self.store.borrow().ended,
            false => None,
        };
        self.store_ends(Some(code));
        let failed = status.drafters.iter().filter(|d| d.state.name() == "failed").count();
        let why = match code {
            // Another host ends with rank 0's status (after checkpointing its replica for an error).
            _ if ended == Some(code) => "as rank 0",
            EXIT_OK => {
                if !self.exported {
                    return violation("exit 0 without completing the run");
                }
                self.completed = true;
                "complete"
            }
            EXIT_TERMINATED | EXIT_INTERRUPTED => {
                if self.shutdown_requested.map(StopSignal::exit_code) != Some(code) {
                    return violation(format!("exit {code} without that signal ({:?})", self.shutdown_requested));
                }
                if self.exported {
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
        if ended == Some(EXIT_OK) {
            self.completed = true;
        }
        self.exits.push((code, why.to_string()));
        self.ended_process();
        Ok(())
    }

    /// Rank 0's process ends, and its store with it: with the run's status (`code`) handed to the other hosts
    /// first (they end too), or with nothing said (killed).
    fn store_ends(&mut self, code: Option<i32>) {
        if !self.leader() {
            return;
        }
        let mut store = self.store.borrow_mut();
        store.served_by = 0;
        store.coordinator = None;
        if let Some(code) = code {
            store.ended = Some(code);
            for rank in 1..self.p.hosts {
                store.mail.push((rank, self.now + ms(5), Occ::Deliver(Box::new(Event::RunEnded { code }))));
            }
        }
    }

    /// The process is gone: a restart comes if the operator allows one (with several hosts the other hosts
    /// restart with rank 0, or by themselves while it runs).
    fn ended_process(&mut self) {
        self.last_progress = self.now;
        self.shutdown_requested = None;
        self.write_failed = false;
        if !self.completed && self.restarts_left > 0 {
            self.restarts_left -= 1;
            self.after(Duration::from_secs(1), Occ::Restart);
        }
    }

    /// SIGKILL, or the machine lost: the process is gone at once, with everything it held (its threads, its
    /// writers' queues), and says nothing to anyone. Rank 0's store goes with it.
    fn killed(&mut self) {
        self.note("fault: the process is killed".to_string());
        self.alive = false;
        for t in self.threads.values_mut() {
            t.enter(Stage::Gone, self.now);
        }
        self.store_ends(None);
        self.exits.push((137, "killed".to_string()));
        self.ended_process();
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
            Start::Found(None) if self.follower() => {
                self.enter_run(id, generation, Replica { step: 0, hash: 0, optimizer_steps: 0 });
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
                if self.leader() && !self.enter_run(id, generation, replica) {
                    return Ok(());
                }
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
                            // Rank 0 asks at the first boundary not handed out; another host checkpointing its
                            // replica on the way out asks "now" (at 0).
                            if at < t.replica.step && self.rank == 0 {
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
            Stage::Parting => {
                while let Some(msg) = t.inbox.pop_front() {
                    match msg {
                        Msg::Order(Order::Checkpoint { .. }) => {
                            let replica = t.replica;
                            self.thread_sends(id, generation, Occ::Snapshot { id, generation, replica });
                            return self.run_thread(id, generation);
                        }
                        Msg::Order(Order::Stop) => {
                            self.returned(id, generation);
                            return Ok(());
                        }
                        _ => {}
                    }
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
        self.supervision(Spawned::Drafter { id, generation }.failed(Failure::ended()));
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

    /// Closes every complete round: checks the contributors agree; with one host, reports it and every contributor
    /// still running applies it; with several, the host's sum goes to the run's round and waits for it.
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
            let before = self.book.samples_committed();
            let settled = self.book.settle(done.step, &done.contributions);
            if self.p.hosts == 1 {
                self.finish_round(Waiting { done, settled, before }, vec![])?;
            } else {
                self.post_round(Waiting { done, settled, before });
            }
        }
        Ok(())
    }

    /// The run's round `done.step` decided: every host's records (this one's among them), in rank order, and the
    /// book settled. Reports it and every contributor still running applies the sum of every host's.
    fn finish_round(&mut self, round: Waiting, records: Vec<HostRecord>) -> Check {
        let Waiting { done, settled, before } = round;
        let first = done.contributions[0].2.replica;
        let key = (self.process, done.incarnation, done.step);
        let expected = self.p.expected_lr(done.step, before);
        let lr = settled.update.adamw.lr;
        if (lr - expected).abs() > 1e-12 * expected.max(1e-12) {
            return violation(format!("round {}: learning rate {lr}, the schedule says {expected}", done.step));
        }
        let next = match records.is_empty() {
            true => applied(first, done.step, done.contributions.iter().flat_map(|(.., c)| &c.batches)),
            false => applied(first, done.step, batches_of(&records)),
        };
        let report = book::report(settled, &done);
        let samples = report.samples();
        self.remote_batches +=
            report.remote.iter().flat_map(|h| &h.contributions).map(|c| c.batches.len() as u64).sum::<u64>();
        self.round_samples.insert(key, samples);
        // A round of an incarnation left behind (the host entered the run again meanwhile) counts nothing here:
        // the host's count is its donor's since (the core ignores its report).
        if done.incarnation == self.rounds.incarnation() {
            if report.samples_committed != before + samples {
                return violation(format!(
                    "round {}: {} samples committed after it, {before} before and {samples} in it",
                    done.step, report.samples_committed
                ));
            }
            self.boundary_samples.insert((self.process, done.incarnation, done.step + 1), report.samples_committed);
        }
        self.collective_clock = self.send_from(self.collective_clock, Event::Round(report));
        for (m, g, _) in done.contributions {
            let Some(t) = self.threads.get_mut(&(m, g)) else { continue };
            if t.stage != Stage::InRound {
                continue;
            }
            t.replica = next;
            t.enter(Stage::Collecting, self.now);
            let digest = self.digest(next);
            let event =
                Event::StepDone { id: m, generation: g, step: next.step, digest, applied: true, feature_wait_s: 0.0 };
            self.thread_says(m, g, event);
            if self.rounds.has_joiners() {
                self.serve(m, g);
            }
            self.wake(m, g);
        }
        Ok(())
    }

    /// Several hosts: the host's summed round goes to the store as its contribution to the run's round, and waits
    /// there for the coordinator's decision (a round already closed answers at once).
    fn post_round(&mut self, round: Waiting) {
        let Waiting { done, settled, before } = &round;
        let step = done.step;
        let start = done.contributions[0].2.replica;
        let digest = self.digest(start);
        let contributions: Vec<DrafterPart> = done
            .contributions
            .iter()
            .map(|(m, g, c)| DrafterPart {
                drafter: *m,
                generation: *g,
                batches: c.batches.clone(),
                samples: c.samples,
                metrics: Metrics::default(),
                digest,
            })
            .collect();
        let weight = done.contributions.iter().map(|(.., c)| c.weight()).sum();
        let settings = (settled.update, settled.next_objective);
        let record = HostRecord { rank: self.rank, generation: self.link.generation, settings, weight, contributions };
        let before = *before;
        self.waiting.insert(step, round);
        let mut store = self.store.borrow_mut();
        let missed = if store.served_by == 0 || self.link.lost {
            Some(Missed::Gone)
        } else if store.stalled {
            Some(Missed::Failed("the rendezvous host's coordinator stopped".to_string()))
        } else {
            store.closed.get(&step).map(|_| Missed::Failed(format!("dropped from round {step}")))
        };
        if let Some(missed) = missed {
            drop(store);
            return self.after(ms(1), Occ::RunRound { step, records: Err(missed) });
        }
        let arrived = contribute(&*store.keys, step, self.rank, self.link.generation, false, &[]);
        arrived.expect("the memory store answers");
        store.posted.entry(step).or_default().insert(self.rank, (record, start, before));
        drop(store);
        self.mail(0, ms(1), Occ::Coordinate);
    }

    /// The run's round reached this host: its waiting contributors apply it, or fail (the host missed it).
    fn run_round(&mut self, step: u64, records: Result<Vec<HostRecord>, Missed>) -> Check {
        let Some(round) = self.waiting.remove(&step) else { return Ok(()) };
        let missed = match records {
            Ok(records) => {
                let Waiting { done, settled, before } = round;
                let local = book::local_samples(&done.contributions);
                let current = done.incarnation == self.rounds.incarnation();
                let settled = self.book.settle_run(settled, local, current, records.clone(), self.rank);
                return self.finish_round(Waiting { done, settled, before }, records);
            }
            Err(missed) => missed,
        };
        let done = round.done;
        self.note(format!("round {step} is missed here: {missed:?}"));
        for (m, g, _) in done.contributions {
            if self.threads.get(&(m, g)).is_none_or(|t| t.stage != Stage::InRound) {
                continue;
            }
            match &missed {
                Missed::Gone => {
                    self.threads.get_mut(&(m, g)).expect("present").enter(Stage::Parting, self.now);
                    self.wake(m, g);
                }
                Missed::Failed(why) => self.kill(m, g, FailureKind::Torch, why),
            }
        }
        Ok(())
    }

    /// The link finds the store gone: every exchange under way fails with it (the round's fate is unknown).
    fn store_gone(&mut self) {
        let steps: Vec<u64> = self.waiting.keys().copied().collect();
        for step in steps {
            self.after(ms(1), Occ::RunRound { step, records: Err(Missed::Gone) });
        }
    }

    /// Rank 0's coordinator (the real one, over the store's keys): it reads new generations, contributions to the
    /// open round and beats; a closed round goes to every host that contributed, the membership to every host, the
    /// run's state to the hosts admitted; an open one is looked at again when it falls due.
    fn coordinate(&mut self) -> Check {
        let shared = self.store.clone();
        let mut store = shared.borrow_mut();
        let store = &mut *store;
        let since = self.now.saturating_sub(store.founded_at).as_secs_f64();
        store.clock.set(since);
        let Some(coordinator) = store.coordinator.as_mut() else { return Ok(()) };
        let closed = match coordinator.poll() {
            Ok(Some(closed)) => closed,
            Ok(None) => {
                if let Some(due) = coordinator.due() {
                    let at = store.founded_at + Duration::from_secs_f64(due) + ms(1);
                    self.at(at.max(self.now + ms(1)), Occ::Coordinate);
                }
                return Ok(());
            }
            Err(ExchangeError::Stalled { round }) => {
                store.coordinator = None;
                store.stalled = true;
                let waiting: Vec<u64> = store.posted.range(round..).map(|(s, _)| *s).collect();
                self.note(format!("the coordinator stops: round {round} stalled"));
                for step in waiting {
                    for rank in store.posted.get(&step).into_iter().flat_map(|p| p.keys().copied()) {
                        let why = Missed::Failed("the rendezvous host's coordinator stopped".to_string());
                        store.mail.push((rank, self.now + ms(1), Occ::RunRound { step, records: Err(why) }));
                    }
                }
                return Ok(());
            }
            Err(e) => return violation(format!("the coordinator failed on the memory store: {e}")),
        };
        self.close(store, closed)
    }

    /// Hands out what closing a round decided.
    fn close(&mut self, store: &mut Store, closed: Closed) -> Check {
        let step = closed.round;
        let posted = store.posted.remove(&step).unwrap_or_default();
        let mut records = vec![];
        let mut starts = vec![];
        for &rank in &closed.members {
            let Some((record, start, samples)) = posted.get(&rank) else {
                return violation(format!("round {step} closed with host {rank}, which did not contribute"));
            };
            records.push(record.clone());
            starts.push((rank, *start, *samples));
        }
        // Every member host's replicas held the same state, and had committed as many samples.
        if let Some(&(_, start, samples)) = starts.first() {
            if let Some(&(rank, other, theirs)) = starts.iter().find(|(_, s, n)| *s != start || *n != samples) {
                return violation(format!(
                    "round {step}: host {rank} started from {other:?} after {theirs} samples, host {} from {start:?} \
                     after {samples}",
                    starts[0].0
                ));
            }
            if let Some(previous) = store.round_start.insert((store.served_by, step), start)
                && previous != start
            {
                return violation(format!("round {step} of rank 0's process {} ran twice", store.served_by));
            }
        }
        let generations: Vec<(usize, u64)> = records.iter().map(|r| (r.rank, r.generation)).collect();
        for (&rank, (record, ..)) in &posted {
            let outcome = match generations.contains(&(rank, record.generation)) {
                true => Ok(records.clone()),
                false => Err(Missed::Failed(format!("dropped from round {step}"))),
            };
            let when = self.now + self.store_latency(0, 3);
            store.mail.push((rank, when, Occ::RunRound { step, records: outcome }));
        }
        self.hosts_lost += closed.dropped.len() as u64;
        store.closed.insert(step, generations);
        while store.closed.len() > 64 {
            store.closed.pop_first();
        }
        // The run's state after the round, for the hosts admitted (their donor applied it).
        let after = starts.first().map(|&(_, start, samples)| {
            let samples = samples + records.iter().map(HostRecord::samples).sum::<u64>();
            (step + 1, applied(start, step, batches_of(&records)), samples)
        });
        for a in &closed.admitted {
            let state = match after {
                Some(after) if a.donor != a.rank => Ok(after),
                _ => Err("no live host had the run's state".to_string()),
            };
            let when = self.now + self.store_latency(2, 40);
            store.mail.push((a.rank, when, Occ::Entered { generation: a.generation, state }));
        }
        let known = std::mem::take(&mut store.members);
        store.members = closed
            .next
            .iter()
            .map(|&(rank, generation)| {
                let same = known.iter().find(|m| m.rank == rank && m.generation == generation);
                HostMember { rank, generation, from: same.map_or(step + 1, |m| m.from) }
            })
            .collect();
        if store.members != known {
            let members = store.members.clone();
            self.after(ms(1), Occ::Deliver(Box::new(Event::Hosts(members))));
        }
        self.after(ms(1), Occ::Coordinate);
        Ok(())
    }

    /// A founder of this host (not rank 0) is admitted to the run with a live host's state, or learns that no live
    /// host had one (it fails, and the host enters again).
    fn entered(&mut self, generation: u64, state: Result<(u64, Replica, u64), String>) -> Check {
        if generation != self.link.generation {
            return Ok(());
        }
        let entering = self.threads.iter().find(|(_, t)| t.stage == Stage::Entering).map(|(k, _)| *k);
        let Some((id, g)) = entering else { return Ok(()) };
        let (step, replica, samples) = match state {
            Ok(state) => state,
            Err(why) => {
                self.kill(id, g, FailureKind::Torch, &why);
                return Ok(());
            }
        };
        if replica.step != step {
            return violation(format!(
                "host {} entered at step {step} with the state of step {}",
                self.rank, replica.step
            ));
        }
        match self.rounds.found_at(id, g, step) {
            Ok(_) => {}
            Err(crate::train::rounds::RoundsError::Removed) => {
                self.returned(id, g);
                return Ok(());
            }
            Err(e) => return violation(format!("founder {id}.{g} could not enter at step {step}: {e}")),
        }
        self.note(format!("host {} enters the run at step {step} as generation {generation}", self.rank));
        self.entries += 1;
        self.book.entered(samples);
        self.boundary_samples.insert((self.process, self.rounds.incarnation(), step), samples);
        self.link.entered = Some((generation, step));
        let t = self.threads.get_mut(&(id, g)).expect("present");
        t.replica = replica;
        t.enter(Stage::Collecting, self.now);
        self.thread_says(id, g, Event::DrafterJoined { id, generation: g, step });
        self.wake(id, g);
        self.read_feeds();
        Ok(())
    }

    /// The feed reader: the assignments rank 0 posted for the generation this host entered as, in order (the
    /// store keeps them; one that does not answer holds the reader up).
    fn read_feeds(&mut self) {
        let Some(entered) = self.link.entered else { return };
        let (served, answers, stopped, keys) = {
            let s = self.store.borrow();
            (s.served_by > 0, s.answers(self.now), s.stopped, s.keys.clone())
        };
        if !served {
            // The store is gone: the link's next look says so.
            return;
        }
        if !answers {
            return self.at(stopped.1 + ms(1), Occ::ReadFeeds);
        }
        loop {
            let (generation, step) = (entered.0, self.link.cursor.next(entered));
            let bytes = match exchange::take_feed(&*keys, self.rank, generation, step, Duration::ZERO) {
                Ok(bytes) => bytes,
                Err(ExchangeError::Store(StoreError::Timeout { .. })) => return,
                Err(e) => return self.found(violation(format!("reading an assignment from the memory store: {e}"))),
            };
            let event = self.link.cursor.read(generation, step, &bytes).expect("the simulation's assignments are JSON");
            self.link.clock = self.send_from(self.link.clock, event);
        }
    }

    /// A host other than rank 0, with its ticks: the leader watch judges rank 0's silence (a connection that fails
    /// says at once that it is gone), the beat goes to the store, and the membership rank 0 posted says whether
    /// this host is still in the run.
    fn link_tick(&mut self) {
        if self.link.lost {
            return;
        }
        let (served, answers, stopped, keys) = {
            let s = self.store.borrow();
            (s.served_by > 0, s.answers(self.now), s.stopped, s.keys.clone())
        };
        let why = if !served {
            Some("the store's connection failed".to_string())
        } else {
            let silent = !answers && self.now.saturating_sub(stopped.0) > SILENT_AFTER;
            let reply = if silent { Reply::TimedOut } else { Reply::Answered };
            self.link.watch.observe(self.now.as_secs_f64(), reply).map(|silence| {
                format!(
                    "rank 0 is lost: no answer for {silence:.1} s (cluster.leader_timeout_s = {})",
                    self.p.leader_timeout_s
                )
            })
        };
        if let Some(why) = why {
            // A rank 0 that is alive counts as lost only after a stop of at least cluster.leader_timeout_s.
            let stop = stopped.1.saturating_sub(stopped.0).as_secs_f64();
            if served && stop < self.p.leader_timeout_s {
                self.found(violation(format!(
                    "host {} took rank 0 for lost after a stop of {stop:.1} s, under cluster.leader_timeout_s = {}",
                    self.rank, self.p.leader_timeout_s
                )));
            }
            self.link.lost = true;
            self.note(format!("host {}: {why}", self.rank));
            self.store_gone();
            self.link.clock = self.send_from(self.link.clock, Event::RendezvousLost(why));
            return;
        }
        if !answers {
            return;
        }
        beat(&*self.store.borrow().keys, self.rank).expect("the memory store answers");
        let membership = exchange::members(&*keys).expect("the memory store answers");
        let still = self
            .link
            .entered
            .zip(membership)
            .and_then(|(entered, m)| still_member(self.rank, entered, &m).map(|still| (entered.0, still)));
        if self.link.cursor.left_run(self.link.generation, still) {
            self.link.clock = self.send_from(self.link.clock, Event::LeftRun);
        }
    }

    /// What the shell reports with its ticks: the stage of every thread the core runs, and since when.
    fn watched(&self, core: &Core) -> Vec<DrafterSeen> {
        let running = core.running_threads();
        let threads = self.threads.iter().filter(|(key, t)| t.stage != Stage::Gone && running.contains(key));
        threads
            .map(|(&(id, generation), t)| DrafterSeen {
                id,
                generation,
                activity: t.stage.activity(),
                for_: self.now.saturating_sub(t.since),
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
            self.survivor_checkpoints += u64::from(self.follower());
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
        // The process killed (rank 0: the store goes with it; another host: it leaves the run), at times.
        let kill = if self.p.hosts > 1 { 0.04 } else { 0.01 };
        if self.rng.random_bool(kill) {
            self.after(Duration::ZERO, Occ::Kill);
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
        self.frozen_until = self.now + for_;
        self.frozen_for += for_;
        if self.leader() {
            // The store is served by this process: it does not answer meanwhile.
            self.store.borrow_mut().stopped = (self.now, self.now + for_);
        }
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
                if self.leader() {
                    self.coordinate()?;
                } else if self.follower() {
                    self.link_tick();
                }
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
            Occ::Kill => self.killed(),
            Occ::LedgerFreed => self.ledger_full = false,
            Occ::Entered { generation, state } => self.entered(generation, state)?,
            Occ::RunRound { step, records } => self.run_round(step, records)?,
            Occ::Coordinate => self.coordinate()?,
            Occ::ReadFeeds => self.read_feeds(),
        }
        Ok(())
    }

    /// When this world's next occurrence is due, and its order among those of the same instant.
    fn next_at(&self) -> Option<(Duration, u64)> {
        self.queue.peek().map(|Reverse(at)| *at)
    }

    /// Carries out this world's next occurrence, if it still concerns this process. Returns a restart with several
    /// hosts to the cluster (the other hosts restart with rank 0).
    fn next(&mut self, driver: &mut Driver<Replica>) -> Result<bool, String> {
        let Some(Reverse((when, seq))) = self.queue.pop() else { return Ok(false) };
        let Some((process, occ)) = self.pending.remove(&seq) else { return Ok(false) };
        // Whatever the last process left scheduled died with it; faults and restarts outlive it.
        let everlasting = matches!(occ, Occ::Fault | Occ::Restart | Occ::LedgerFreed);
        if (process != self.process || !self.alive) && !everlasting {
            return Ok(false);
        }
        if matches!(occ, Occ::Fault) && !self.alive {
            // Faults go on while a restart may come (another host is restarted with rank 0 at any time).
            if self.follower() || self.pending.values().any(|(_, o)| matches!(o, Occ::Restart)) {
                self.now = when;
                let next = Duration::from_secs_f64(self.p.fault_every_s);
                self.after(next, Occ::Fault);
            }
            return Ok(false);
        }
        self.now = when;
        if matches!(occ, Occ::Restart) && self.p.hosts > 1 {
            return Ok(true);
        }
        self.step(driver, occ)?;
        if self.rank == 0 && self.alive && self.now.saturating_sub(self.last_progress) > STALL {
            return Err(format!(
                "no step committed for {} s and no exit: {:?}",
                STALL.as_secs(),
                driver.core().status()
            ));
        }
        Ok(false)
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
            self.supervision(Spawned::Drafter { id, generation }.failed(Failure::ended()));
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
        self.book.rewind(samples_committed);
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
        self.exported = true;
        self.after(ms(50), Occ::Deliver(Box::new(Event::Exported(Ok(from)))));
    }

    fn evaluate(&mut self, _: &Core, step: u64, _: PathBuf) {
        let e = Evaluated { prompts: 1, seconds: 0.1, new_best: false, ..Evaluated::lossless_at(step, 1.5) };
        self.after(ms(100), Occ::Deliver(Box::new(Event::Evaluated(Ok(e)))));
    }

    fn post_feed(&mut self, rank: usize, generation: u64, step: u64, feed: Feed) {
        if rank == 0 || rank >= self.p.hosts {
            return self.found(violation(format!("an assignment of step {step} for host {rank}, not in the run")));
        }
        for (_, item) in &feed.items {
            self.captured(item.clone());
        }
        // The store keeps it under that host's generation; its feed reader takes what is for the generation it is.
        let bytes = serde_json::to_vec(&feed).expect("an assignment is JSON");
        let keys = self.store.borrow().keys.clone();
        exchange::post_feed(&*keys, rank, generation, step, &bytes).expect("the memory store answers");
        self.mail(rank, ms(1), Occ::ReadFeeds);
    }

    fn notice(&mut self, notice: Notice) {
        if let Notice::Committed { step, .. } = notice
            && !self.follower()
        {
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

fn setup(
    p: &Params,
    rank: usize,
    config: Config,
    resume: Option<(PathBuf, TrainerState)>,
    rejected: Vec<u64>,
) -> Setup {
    Setup {
        config,
        // Two drafters a device: hangs count per device (and a lost device takes both: `World::fault`).
        drafter_devices: (0..p.drafters).map(|i| format!("cuda:{}", i / 2)).collect(),
        target_devices: (0..p.targets).map(|i| format!("cuda:{i}")).collect(),
        feeds: (0..p.drafters).map(|i| i % p.targets).collect(),
        lengths: vec![16; p.samples],
        sample_ids: (0..p.samples as u64).map(SampleId::Number).collect(),
        stream: None,
        resume,
        rejected,
        role: match (p.hosts, rank) {
            (1, _) => None,
            (_, 0) => Some(HostRole::Leader),
            _ => Some(HostRole::Follower),
        },
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

/// The hosts of a run, each a world with its own core behind its own driver, over one store; their occurrences
/// happen in one order of time (ties: by rank, then in the order they were scheduled).
struct Cluster {
    worlds: Vec<World>,
    drivers: Vec<Driver<Replica>>,
    store: Rc<RefCell<Store>>,
}

/// What a seed did: events fed to the cores, hung target copies found, batches trained by hosts other than rank 0,
/// hosts dropped from rounds, and the exits of every host with their reasons.
#[derive(Debug, PartialEq)]
struct Outcome {
    events: u64,
    hung_targets: u64,
    remote_batches: u64,
    hosts_lost: u64,
    entries: u64,
    survivor_checkpoints: u64,
    adopted: u64,
    exits: Vec<(i32, String)>,
}

impl Cluster {
    fn new(seed: u64, full_trace: bool) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let p = Params::draw(&mut rng);
        Self::with(seed, p, rng, full_trace)
    }

    fn with(seed: u64, p: Params, rng: ChaCha8Rng, full_trace: bool) -> Self {
        let store = Rc::new(RefCell::new(Store::default()));
        let trace = Rc::new(RefCell::new(VecDeque::new()));
        let worlds: Vec<World> = (0..p.hosts)
            .map(|rank| {
                let mut w = World::with(seed, p.clone(), rng.clone(), full_trace, rank, store.clone());
                w.trace = trace.clone();
                if rank > 0 {
                    // Another host is restarted with the run, and by its operator a few times while it goes on.
                    w.restarts_left = p.process_restarts + 3;
                }
                w
            })
            .collect();
        // Drivers before the first processes start (each process gets its own).
        let drivers =
            (0..p.hosts).map(|rank| Driver::new(Core::new(setup(&p, rank, p.config(), None, vec![])))).collect();
        Cluster { worlds, drivers, store }
    }

    fn run(&mut self) -> Check {
        for rank in 0..self.worlds.len() {
            let w = &mut self.worlds[rank];
            w.start_process(&mut self.drivers[rank])?;
            let first = Duration::from_secs_f64(w.p.fault_every_s);
            w.after(first, Occ::Fault);
            if let Some((after, for_)) = w.planned_freeze {
                w.after(after, Occ::Freeze(for_));
            }
            if let Some(after) = w.planned_kill {
                w.after(after, Occ::Kill);
            }
            self.post_mail();
        }
        loop {
            let next =
                self.worlds.iter().enumerate().filter_map(|(r, w)| w.next_at().map(|(t, seq)| (t, r, seq))).min();
            let Some((when, rank, _)) = next else { break };
            if when > HORIZON {
                break;
            }
            let world = &mut self.worlds[rank];
            if world.next(&mut self.drivers[rank])? {
                self.restart(rank)?;
            }
            self.post_mail();
            if let Some(e) = self.worlds.iter_mut().find_map(|w| w.violation.take()) {
                return Err(e);
            }
            self.check_hosts(when)?;
            let over = !self.worlds[0].alive
                && !self.worlds[0].pending.values().any(|(_, o)| matches!(o, Occ::Restart))
                && self.worlds.iter().all(|w| !w.alive);
            if over {
                break;
            }
        }
        self.worlds[0].check_ledger(self.drivers[0].core())
    }

    /// Hands what crossed the store to the worlds it is for.
    fn post_mail(&mut self) {
        let mail = std::mem::take(&mut self.store.borrow_mut().mail);
        for (rank, when, occ) in mail {
            self.worlds[rank].at(when, occ);
        }
    }

    /// Checked across hosts: no other host outlives rank 0's store for long (it notices, and ends).
    fn check_hosts(&self, now: Duration) -> Check {
        if self.worlds.len() < 2 || self.worlds[0].alive {
            return Ok(());
        }
        let gone_for = now.saturating_sub(self.worlds[0].last_progress);
        let limit = Duration::from_secs_f64(self.worlds[0].p.leader_timeout_s + SHUTDOWN_TIMEOUT_S + 70.0);
        // Time another host was stopped is not its to answer for.
        match self.worlds[1..].iter().find(|w| w.alive) {
            Some(w) if gone_for > limit + w.frozen_for => {
                violation(format!("host {} still runs {} s after rank 0's process ended", w.rank, gone_for.as_secs()))
            }
            _ => Ok(()),
        }
    }

    /// A restart with several hosts. Another host restarts by itself while rank 0's store serves (else it is
    /// restarted with the run). Rank 0 restarts the run once no other host runs (`--resume auto` waits for the
    /// checkpoints they write when rank 0 is lost): it adopts a newer checkpoint of theirs, then every host starts.
    fn restart(&mut self, rank: usize) -> Check {
        if rank > 0 {
            if self.store.borrow().served_by > 0 && !self.worlds[rank].alive {
                self.worlds[rank].start_process(&mut self.drivers[rank])?;
            }
            return Ok(());
        }
        if self.worlds[1..].iter().any(|w| w.alive) {
            self.worlds[0].after(Duration::from_secs(1), Occ::Restart);
            return Ok(());
        }
        self.adopt_survivors();
        self.worlds[0].start_process(&mut self.drivers[0])?;
        self.post_mail();
        for rank in 1..self.worlds.len() {
            let now = self.worlds[0].now;
            let w = &mut self.worlds[rank];
            w.now = now;
            w.start_process(&mut self.drivers[rank])?;
            self.post_mail();
        }
        Ok(())
    }

    /// Rank 0's `--resume auto` with several hosts: the newest valid checkpoint another host wrote when rank 0 was
    /// lost replaces rank 0's newest when it is newer; the other hosts' folders are moved aside either way.
    fn adopt_survivors(&mut self) {
        let mut best: Option<(u64, OnDisk)> = None;
        for w in &mut self.worlds[1..] {
            for (step, c) in std::mem::take(&mut w.disk) {
                if c.intact && best.as_ref().is_none_or(|(b, _)| step > *b) {
                    best = Some((step, c));
                }
            }
        }
        let rank0 = &mut self.worlds[0];
        let own = rank0.disk.iter().rev().find(|(_, c)| c.intact).map(|(s, _)| *s);
        if let Some((step, c)) = best
            && own.is_none_or(|own| step > own)
        {
            rank0.note(format!("rank 0 adopts another host's checkpoint of step {step} (its own newest: {own:?})"));
            rank0.disk.insert(step, c);
            rank0.adopted += 1;
        }
    }

    fn outcome(&self) -> Outcome {
        Outcome {
            events: self.worlds.iter().map(|w| w.events).sum(),
            hung_targets: self.worlds.iter().map(|w| w.hung_targets_found).sum(),
            remote_batches: self.worlds[0].remote_batches,
            hosts_lost: self.worlds[0].hosts_lost,
            entries: self.worlds.iter().map(|w| w.entries).sum(),
            survivor_checkpoints: self.worlds.iter().map(|w| w.survivor_checkpoints).sum(),
            adopted: self.worlds[0].adopted,
            exits: self
                .worlds
                .iter()
                .flat_map(|w| w.exits.iter().map(|(c, why)| (*c, format!("h{} {why}", w.rank.min(1)))))
                .collect(),
        }
    }

    fn report(&self, error: &str) -> String {
        let w = &self.worlds[0];
        let exits: Vec<_> = self.worlds.iter().map(|w| &w.exits).collect();
        format!(
            "seed {} failed: {error}\nparameters: {:?}\nexits: {exits:?}\nlast events:\n{}\nreplay: DFLASH_SIM_SEED={} \
             cargo test --lib sim_replay -- --nocapture",
            w.seed,
            w.p,
            w.trace.borrow().iter().cloned().collect::<Vec<_>>().join("\n"),
            w.seed
        )
    }
}

/// Runs one seed; the error is the whole report.
fn simulate(seed: u64, full_trace: bool) -> Result<Outcome, String> {
    let mut cluster = Cluster::new(seed, full_trace);
    match cluster.run() {
        Ok(()) => Ok(cluster.outcome()),
        Err(e) => Err(cluster.report(&e)),
    }
}

/// Whether a test prints its whole trace (`DFLASH_SIM_TRACE=1`).
fn traced() -> bool {
    std::env::var("DFLASH_SIM_TRACE").is_ok()
}

fn seeds(default: u64) -> u64 {
    std::env::var("DFLASH_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// A CI-sized set of seeds (`DFLASH_SIM_SEEDS` for more, from `DFLASH_SIM_FIRST`; `DFLASH_SIM_LIST` prints each
/// seed's events and exits, to compare two versions seed by seed).
#[test]
fn sim_many_seeds_hold_every_invariant() {
    let n = seeds(48);
    let first: u64 = std::env::var("DFLASH_SIM_FIRST").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let (mut events, mut hung_targets, mut remote_batches, mut hosts_lost) = (0, 0, 0, 0);
    let (mut entries, mut survivor_checkpoints, mut adopted) = (0, 0, 0);
    let mut endings: BTreeMap<String, usize> = BTreeMap::new();
    for seed in first..first + n {
        match simulate(seed, false) {
            Ok(outcome) => {
                if std::env::var_os("DFLASH_SIM_LIST").is_some() {
                    eprintln!("seed {seed}: {} events, exits {:?}", outcome.events, outcome.exits);
                }
                events += outcome.events;
                hung_targets += outcome.hung_targets;
                remote_batches += outcome.remote_batches;
                hosts_lost += outcome.hosts_lost;
                entries += outcome.entries;
                survivor_checkpoints += outcome.survivor_checkpoints;
                adopted += outcome.adopted;
                for (code, why) in outcome.exits {
                    *endings.entry(format!("{code} ({why})")).or_default() += 1;
                }
            }
            Err(report) => panic!("{report}"),
        }
    }
    eprintln!(
        "{n} seeds, {events} events to the core, {hung_targets} hung target copies found, {remote_batches} batches \
         trained by other hosts, {hosts_lost} hosts dropped from rounds, {entries} entries into a running run, \
         {survivor_checkpoints} replicas checkpointed by other hosts when rank 0 was lost ({adopted} adopted); endings: \
         {endings:?}"
    );
    assert!(events > n * 1000, "the schedules should be long: {events} events");
    assert!(n < 20 || hung_targets > 0, "no hung target copy was found by the watchdog");
    assert!(n < 20 || (remote_batches > 0 && hosts_lost > 0), "no run of several hosts trained and lost a host");
    for wanted in ["0 (h0 complete)", "3 (h0 no progress)"] {
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
        let p = quiet(&mut rng, 1);
        let mut cluster = Cluster::with(seed, p, rng, false);
        cluster.worlds[0].planned_freeze = Some((Duration::from_secs(2), Duration::from_secs(40)));
        if let Err(e) = cluster.run() {
            panic!("{}", cluster.report(&e));
        }
        let (world, driver) = (&cluster.worlds[0], &cluster.drivers[0]);
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

/// A seed's shape of run on `hosts` hosts without faults, and without a slow disk or store (a final checkpoint
/// slower than the ending's deadline exits 75, rightly).
fn quiet(rng: &mut ChaCha8Rng, hosts: usize) -> Params {
    Params {
        fault_every_s: 1e9,
        hang_floor_s: 1.0,
        max_steps: 0,
        slow_writes: 0.0,
        slow_store: 0.0,
        hosts,
        ..Params::draw(rng)
    }
}

/// A run of several hosts without faults whose rank 0 is stopped (SIGSTOP, a swapping host) for `stop`, mid-run.
fn rank_0_stopped(seed: u64, stop: Duration) -> Cluster {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = Params { leader_timeout_s: 45.0, ..quiet(&mut rng, 2 + (seed % 2) as usize) };
    let mut cluster = Cluster::with(seed, p, rng, traced());
    cluster.worlds[0].planned_freeze = Some((Duration::from_secs(3), stop));
    if let Err(e) = cluster.run() {
        panic!("{}", cluster.report(&e));
    }
    assert!(cluster.worlds[0].froze_at_step.is_some_and(|s| s > 0), "seed {seed}: stopped before training");
    cluster
}

fn exit_codes(cluster: &Cluster) -> Vec<Vec<i32>> {
    cluster.worlds.iter().map(|w| w.exits.iter().map(|e| e.0).collect()).collect()
}

/// Rank 0 stopped for less than `cluster.leader_timeout_s` costs no run: the other hosts wait for it (no host
/// leaves, nothing is checkpointed on the way out) and the run completes.
#[test]
fn sim_rank_0_stopped_within_the_leader_timeout_costs_no_run() {
    for seed in 0..6 {
        let cluster = rank_0_stopped(seed, Duration::from_secs(30));
        let exits = exit_codes(&cluster);
        assert!(exits.iter().all(|e| e == &[EXIT_OK]), "seed {seed}: {exits:?}");
        // Entered once at most (a host not at the founding enters at a round boundary), never again.
        let entries: Vec<u64> = cluster.worlds[1..].iter().map(|w| w.entries).collect();
        assert!(entries.iter().all(|&n| n <= 1), "seed {seed}: hosts entered the run {entries:?} times");
        assert_eq!(cluster.worlds.iter().map(|w| w.survivor_checkpoints).sum::<u64>(), 0, "seed {seed}");
    }
}

/// Rank 0 stopped for longer than `cluster.leader_timeout_s` is taken for lost: each other host checkpoints its
/// replica and ends with 75; rank 0 goes on when it runs again, the others come back, and the run completes.
#[test]
fn sim_rank_0_stopped_past_the_leader_timeout_is_lost_and_the_run_goes_on() {
    for seed in 0..6 {
        let cluster = rank_0_stopped(seed, Duration::from_secs(70));
        let exits = exit_codes(&cluster);
        assert_eq!(exits[0], [EXIT_OK], "seed {seed}: {exits:?}");
        assert!(exits[1..].iter().all(|e| e.first() == Some(&EXIT_RESTART)), "seed {seed}: {exits:?}");
        let written = cluster.worlds.iter().map(|w| w.survivor_checkpoints).sum::<u64>();
        assert_eq!(written, cluster.worlds.len() as u64 - 1, "seed {seed}: every other host checkpoints its replica");
    }
}

/// Rank 0 killed: every other host checkpoints its replica and ends; the run restarts (`--resume auto`) from the
/// newest of every host's checkpoints, which is theirs when rank 0 wrote none since, and completes, each sample
/// committed once.
#[test]
fn sim_rank_0_killed_resumes_from_the_other_hosts_newest_replica() {
    for seed in 0..6 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let hosts = 2 + (seed % 2) as usize;
        let p = Params { every_steps: 0, every_seconds: 0.0, process_restarts: 1, ..quiet(&mut rng, hosts) };
        let mut cluster = Cluster::with(seed, p, rng, traced());
        cluster.worlds[0].planned_kill = Some(Duration::from_secs(3));
        if let Err(e) = cluster.run() {
            panic!("{}", cluster.report(&e));
        }
        let exits = exit_codes(&cluster);
        assert_eq!(exits[0], [137, EXIT_OK], "seed {seed}: {exits:?}");
        assert_eq!(cluster.worlds[0].adopted, 1, "seed {seed}: rank 0 adopts another host's checkpoint");
    }
}

/// The same seed, the same run: the simulation (and the core) are deterministic.
#[test]
fn sim_is_deterministic() {
    let a = simulate(7, false);
    let b = simulate(7, false);
    assert_eq!(a, b);
}
