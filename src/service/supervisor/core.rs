//! The supervisor's decisions as a state machine: events in ([`Event`]), actions out ([`Action`]), time given by the
//! caller. No threads, locks, tensors, files or actors: the ractor actor around it carries actions out and feeds
//! back what happens, and the simulation (`sim.rs`) drives it through thousands of seeded failure schedules.
//!
//! What it guarantees (and the simulation checks):
//! - **Nothing stalls silently.** Every state a drafter or target copy can be in ends by itself: backoffs expire,
//!   starts have a deadline (twice `supervision.step_timeout_s`), a drafter waiting for a donor is started as soon
//!   as the collective can take it. With no member left in the collective exactly one drafter founds it again from
//!   the newest valid checkpoint (the others join once it is live), so correlated failures recover. A run that
//!   cannot go on (fewer than `min_live_drafters` drafters that are not failed for good, a target copy past its
//!   restart limit, a poisoned device) checkpoints if a replica is live and exits with a documented code; an
//!   ending that cannot finish its checkpoint exits after `supervision.shutdown_timeout_s`.
//! - **Every sample once per epoch.** Batches are settled by round reports only ([`Schedule`]).
//! - **One founder.** The collective is founded (and rewound) only when it is known to be empty: membership is
//!   learnt from the collective itself after every removal, never assumed.
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use super::checkpoints::{Book, Newest, SnapshotOutcome};
use super::drafters::{Fate, Life, Role, Slot};
use super::protocol::{Action, Event, Found, LedgerEntry, Notice, Order, Request, Start};
use super::schedule::{Item, Position, Schedule, Settled};
use super::targets::TargetCopy;
use crate::config::Config;
use crate::data::loader::{BatchId, LoaderSettings};
use crate::service::evaluator::Evaluated;
use crate::service::failure::{Failure, FailureKind};
use crate::service::messages::{CheckpointStatus, DrafterStatus, Status, TargetStatus};
use crate::train::checkpoint::TrainerState;
use crate::train::collective::{Hyper, ObjectiveKnobs, Progress, StepSettings};
use crate::train::objective::Metrics;
use crate::train::optim::LrSchedule;

/// The run is complete, or was stopped by a signal after its checkpoint.
pub const EXIT_OK: i32 = 0;
/// An error: a checkpoint or export at the end of the run could not be written, or start-up failed.
pub const EXIT_ERROR: i32 = 1;
/// The run cannot go on: fewer than `supervision.min_live_drafters` drafters are left that are not failed for good,
/// or a target copy failed past its restart limit. The newest valid checkpoint is kept; fix the cause, then resume.
pub const EXIT_NO_PROGRESS: i32 = 3;
/// Restart the service with `--resume auto`: an error poisoned a device, or the run's end could not checkpoint in
/// time.
pub const EXIT_RESTART: i32 = 75;

/// Everything a reload may change in the training step, from the configuration. The learning-rate schedule counts
/// steps when `optim.max_steps` bounds the run (it spans `max_steps`), and committed samples otherwise (it spans
/// the epochs): either way its length and position do not depend on how many drafters are live, so the rate is
/// continuous across failures, rejoins and resuming with a different number of drafters.
pub fn step_settings(cfg: &Config, samples_per_epoch: u64, gamma: Option<f64>) -> StepSettings {
    let o = &cfg.optim;
    let (progress, total) = match o.max_steps {
        0 => (Progress::Samples, samples_per_epoch * o.epochs),
        steps => (Progress::Steps, steps),
    };
    StepSettings {
        hyper: Hyper {
            schedule: LrSchedule {
                kind: o.schedule,
                lr: o.lr,
                warmup_steps: (o.warmup_ratio * total as f64).round() as u64,
                total_steps: total.max(1),
                min_lr_ratio: o.min_lr_ratio,
            },
            progress,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            grad_clip: o.grad_clip,
        },
        objective: ObjectiveKnobs { num_anchors: cfg.objective.num_anchors, gamma },
    }
}

/// What the core starts from.
pub struct Setup {
    pub config: Config,
    /// Device names of the drafters (by id) and of the target copies, for status and hang accounting.
    pub drafter_devices: Vec<String>,
    pub target_devices: Vec<String>,
    /// Drafter id -> the target copy that feeds it.
    pub feeds: Vec<usize>,
    /// Token count and sample id of each sample, by position.
    pub lengths: Vec<usize>,
    pub sample_ids: Vec<u64>,
    /// The checkpoint to resume (`--resume auto`) and the checkpoint folders found invalid on the way.
    pub resume: Option<(PathBuf, TrainerState)>,
    pub rejected: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    StartingTargets,
    StartingDrafters,
    Running,
}

/// Where a founder's state comes from.
#[derive(Debug, Clone)]
enum Source {
    Fresh,
    Checkpoint(PathBuf, Box<TrainerState>),
}

/// Finding the state a new founder starts from, once the collective is empty.
#[derive(Debug, Clone)]
enum Rewind {
    Idle,
    Scanning,
    Scanned(Source),
    /// The last scan failed: try again at `at`.
    RetryAt(Duration),
}

struct Ending {
    code: i32,
    /// Export the final checkpoint (the run is complete).
    export: bool,
    reason: String,
    deadline: Duration,
    writes_before: u64,
    failures_before: u64,
    exporting: bool,
}

/// The members that must report their checksums at a step, and what they reported.
type Expected = (Vec<usize>, BTreeMap<usize, [i64; 3]>);

/// Replica checksums of a step, compared once every member reported.
#[derive(Default)]
struct Replicas {
    expected: BTreeMap<u64, Expected>,
    checked_step: Option<u64>,
    diverged: u64,
}

impl Replicas {
    /// Some(true) when the step's members all reported and agree, Some(false) when they differ.
    fn compare(&mut self, step: u64) -> Option<bool> {
        let (members, seen) = self.expected.get(&step)?;
        if members.is_empty() || !members.iter().all(|m| seen.contains_key(m)) {
            return None;
        }
        let first = seen[&members[0]];
        let agree = members.iter().all(|m| seen[m] == first);
        if agree {
            self.checked_step = Some(step);
        } else {
            self.diverged += 1;
        }
        self.expected.retain(|s, _| *s > step);
        Some(agree)
    }
}

/// What a progress line summarises.
struct Window {
    metrics: Metrics,
    samples: u64,
    feature_wait_s: f64,
    started: Duration,
}

/// See the module documentation.
pub struct Core {
    config: Config,
    slots: Vec<Slot>,
    targets: Vec<TargetCopy>,
    feeds: Vec<usize>,
    sample_ids: Vec<u64>,
    schedule: Schedule,
    book: Book,
    replicas: Replicas,
    phase: Phase,
    ending: Option<Ending>,
    exit: Option<i32>,
    /// The collective's members `(id, generation)` as it last said, plus those that joined since.
    members: Vec<(usize, u64)>,
    incarnation: u64,
    rewind: Rewind,
    /// Scans that failed in a row.
    scan_failures: u32,
    /// The source of the first founder (the resumed checkpoint, or fresh weights).
    initial: Option<Source>,
    /// The checkpoint step the starting founder loads.
    founding_from: Option<u64>,
    gpu_hangs: HashMap<String, usize>,
    /// A checkpoint is owed (its donor was lost, or an evaluation waits for it).
    checkpoint_owed: bool,
    seq: u64,
    window: Window,
    skipped_steps: u64,
    samples_requeued: u64,
    config_version: u64,
    last_lr: f64,
    eval_due: Option<u64>,
    last_evaluation: Option<Evaluated>,
    now: Duration,
    out: Vec<Action>,
}

impl Core {
    pub fn new(setup: Setup) -> Self {
        let c = &setup.config;
        let settings = LoaderSettings { batch_size: c.data.batch_size, seed: c.objective.seed, bucket_batches: 16 };
        let schedule = Schedule::new(setup.lengths, settings, c.optim.accumulation, c.optim.epochs, c.optim.max_steps);
        let mut book = Book::default();
        book.found_invalid(&setup.rejected);
        let initial = match setup.resume {
            Some((path, state)) => Source::Checkpoint(path, Box::new(state)),
            None => Source::Fresh,
        };
        let mut core = Core {
            slots: setup.drafter_devices.into_iter().enumerate().map(|(id, d)| Slot::new(id, d)).collect(),
            targets: setup.target_devices.into_iter().enumerate().map(|(id, d)| TargetCopy::new(id, d)).collect(),
            feeds: setup.feeds,
            sample_ids: setup.sample_ids,
            schedule,
            book,
            replicas: Replicas::default(),
            phase: Phase::StartingTargets,
            ending: None,
            exit: None,
            members: vec![],
            incarnation: 0,
            rewind: Rewind::Idle,
            scan_failures: 0,
            initial: None,
            founding_from: None,
            gpu_hangs: HashMap::new(),
            checkpoint_owed: false,
            seq: 0,
            window: Window { metrics: Metrics::default(), samples: 0, feature_wait_s: 0.0, started: Duration::ZERO },
            skipped_steps: 0,
            samples_requeued: 0,
            config_version: 1,
            last_lr: 0.0,
            eval_due: None,
            last_evaluation: None,
            now: Duration::ZERO,
            out: vec![],
            config: setup.config,
        };
        // Status shows where the run starts before the first founder loads it.
        core.restore(&initial);
        core.initial = Some(initial);
        core
    }

    /// The first actions (start the first target copy).
    pub fn start(&mut self, now: Duration) -> Vec<Action> {
        self.now = now;
        self.window.started = now;
        self.advance();
        std::mem::take(&mut self.out)
    }

    /// Takes one event at `now` (never earlier than the last); returns what to do.
    pub fn handle(&mut self, now: Duration, event: Event) -> Vec<Action> {
        self.now = self.now.max(now);
        if self.exit.is_some() {
            return vec![];
        }
        match event {
            Event::Tick => {}
            Event::TargetReady { target, generation } => self.target_ready(target, generation),
            Event::TargetFailed { target, generation, failure } => self.target_failed(target, generation, failure),
            Event::TargetExited { target, generation } => {
                let failure = Failure::panic("the target thread ended without being asked to".into());
                self.target_failed(target, generation, failure)
            }
            Event::Delivered { target, generation, seq } => self.targets[target].delivered(generation, seq),
            Event::DrafterReady { id, generation } => self.drafter_ready(id, generation),
            Event::DrafterJoined { id, generation, step } => self.drafter_joined(id, generation, step),
            Event::DrafterFailed { id, generation, failure, running, injected } => {
                self.drafter_failed(id, generation, failure, &running, injected)
            }
            Event::DrafterExited { id, generation } => {
                let failure = Failure::panic("the drafter thread ended without being asked to".into());
                self.drafter_failed(id, generation, failure, &[], false)
            }
            Event::MemberRemoved { remaining } => self.members = remaining,
            Event::StepDone { id, generation, step, digest, applied, feature_wait_s } => {
                self.step_done(id, generation, step, digest, applied, feature_wait_s)
            }
            Event::Round(report) => {
                for settled in self.schedule.take_report(report) {
                    self.commit(settled);
                }
            }
            Event::Snapshot { id, generation, step, optimizer_steps } => {
                match self.book.snapshot(id, generation, step, optimizer_steps, self.now) {
                    SnapshotOutcome::Unwanted if !self.book.holds(id, generation, step) => {
                        self.out.push(Action::DropSnapshots { which: Some((id, generation, step)) })
                    }
                    SnapshotOutcome::Unwanted => {}
                    SnapshotOutcome::Waiting => {}
                    SnapshotOutcome::Write(job) => self.write(*job),
                }
            }
            Event::CheckpointWritten { step, incarnation, result } => {
                self.checkpoint_written(step, incarnation, result)
            }
            Event::CheckpointFound(result) => self.checkpoint_found(result),
            Event::Evaluated(outcome) => self.evaluated(outcome),
            Event::Exported(result) => {
                let code = match result {
                    Ok(path) => {
                        tracing::info!(path = %path.display(), "exported the drafter (bf16, published format)");
                        self.ending.as_ref().map_or(EXIT_OK, |e| e.code)
                    }
                    Err(e) => {
                        tracing::error!("export failed: {e}");
                        EXIT_ERROR
                    }
                };
                self.exit_now(code);
            }
            Event::Reconfigured(config) => {
                self.config = *config;
                self.config_version += 1;
            }
            Event::Shutdown => self.begin_ending(EXIT_OK, false, "stop requested".into()),
        }
        self.advance();
        std::mem::take(&mut self.out)
    }

    // ------------------------------------------------------------------ queries

    /// The exit status, once the run is over.
    pub fn exit_code(&self) -> Option<i32> {
        self.exit
    }

    /// Ready to train: running, not ending, at least one drafter live (`/readyz`).
    pub fn ready(&self) -> bool {
        self.phase == Phase::Running && self.ending.is_none() && self.exit.is_none() && self.live().next().is_some()
    }

    pub fn ending(&self) -> bool {
        self.ending.is_some()
    }

    pub fn committed_step(&self) -> u64 {
        self.schedule.committed_step()
    }

    pub fn config_version(&self) -> u64 {
        self.config_version
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn live_count(&self) -> usize {
        self.live().count()
    }

    /// A drafter's state, by id.
    pub fn drafter_state(&self, id: usize) -> Option<crate::service::messages::DrafterState> {
        self.slots.get(id).map(Slot::state)
    }

    /// The current thread `(id, generation)` of every drafter that runs one.
    pub fn running_threads(&self) -> Vec<(usize, u64)> {
        self.slots.iter().filter(|s| s.is_running()).map(|s| (s.id, s.generation)).collect()
    }

    /// Batches set aside (failed twice), in this incarnation's history.
    pub fn set_aside(&self) -> &[BatchId] {
        self.schedule.set_aside()
    }

    /// The collective's members as the core knows them.
    pub fn members(&self) -> &[(usize, u64)] {
        &self.members
    }

    pub fn status(&self) -> Status {
        let phase = match (self.exit, &self.ending, self.phase) {
            (Some(c), ..) => format!("stopped ({c})"),
            (None, Some(_), _) => "stopping".into(),
            (None, None, Phase::StartingTargets) => "starting target".into(),
            (None, None, Phase::StartingDrafters) => "starting drafters".into(),
            (None, None, Phase::Running) if self.live().next().is_none() => "recovering".into(),
            (None, None, Phase::Running) => "running".into(),
        };
        Status {
            phase,
            ready: self.ready(),
            step: self.schedule.committed_step(),
            epoch: self.schedule.epoch(),
            samples_committed: self.schedule.samples_committed(),
            samples_requeued: self.samples_requeued,
            batches_set_aside: self.schedule.set_aside().len() as u64,
            skipped_steps: self.skipped_steps,
            replicas_checked_step: self.replicas.checked_step,
            replicas_diverged: self.replicas.diverged,
            config_version: self.config_version,
            drafters: self
                .slots
                .iter()
                .map(|s| DrafterStatus {
                    id: s.id,
                    device: s.device.clone(),
                    state: s.state(),
                    step: s.step,
                    restarts: s.restarts.total,
                })
                .collect(),
            targets: self
                .targets
                .iter()
                .map(|t| TargetStatus {
                    id: t.id,
                    device: t.device.clone(),
                    ready: t.is_ready(),
                    restarts: t.restarts(),
                    drafters: (0..self.feeds.len()).filter(|&d| self.feeds[d] == t.id).collect(),
                })
                .collect(),
            last_checkpoint: self.book.newest().map(|n| CheckpointStatus {
                step: n.step,
                path: n.path.display().to_string(),
                age_s: self.now.saturating_sub(n.at).as_secs_f64(),
            }),
            last_evaluation: self.last_evaluation.clone(),
        }
    }

    /// Asks for a checkpoint at the next step boundary (`POST /checkpoint`); the step committed now.
    pub fn checkpoint_now(&mut self, now: Duration) -> (Result<u64, String>, Vec<Action>) {
        self.now = self.now.max(now);
        let answer = if self.exit.is_some() || self.ending.is_some() {
            Err("the service is stopping".to_string())
        } else if self.book.in_flight() {
            Err("a checkpoint is being written; try again shortly".to_string())
        } else if self.request_checkpoint("requested") {
            Ok(self.schedule.committed_step())
        } else {
            Err("no live drafter to checkpoint from".to_string())
        };
        (answer, std::mem::take(&mut self.out))
    }

    fn live(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().filter(|s| s.is_live())
    }

    /// The replica checkpoints are taken from and joiners are served by: the lowest-id live drafter.
    fn donor(&self) -> Option<(usize, u64)> {
        self.live().next().map(|s| (s.id, s.generation))
    }

    fn supervision(&self) -> &crate::config::SupervisionSettings {
        &self.config.supervision
    }

    /// How long a drafter or target thread may take to start (build, load, join).
    fn start_deadline(&self) -> Duration {
        Duration::from_secs_f64(2.0 * self.supervision().step_timeout_s)
    }

    fn tell(&mut self, (id, generation): (usize, u64), order: Order) {
        self.out.push(Action::Tell { id, generation, order });
    }

    // ------------------------------------------------------------------ targets

    fn target_ready(&mut self, target: usize, generation: u64) {
        let first = !self.targets[target].ever_ready;
        let Some(resend) = self.targets[target].ready(generation) else { return };
        let fed: Vec<usize> = (0..self.feeds.len()).filter(|&d| self.feeds[d] == target).collect();
        if first {
            tracing::info!(id = target, device = %self.targets[target].device, drafters = ?fed, "target ready");
        } else {
            tracing::info!(id = target, "target restarted; resending {} requests", resend.len());
        }
        for request in resend {
            self.out.push(Action::TargetRequest { target, generation, request });
        }
    }

    fn target_failed(&mut self, target: usize, generation: u64, failure: Failure) {
        let s = self.config.supervision.clone();
        let Some(outcome) = self.targets[target].failed(generation, self.now, &s) else { return };
        tracing::warn!(id = target, device = %self.targets[target].device, kind = ?failure.kind, "target failed: {}", failure.message);
        if let Some((batch, true)) = outcome.suspect {
            let ids = self.set_batch_aside(batch);
            tracing::error!(
                ?batch,
                sample_ids = ?ids,
                "batch failed the target twice: set aside (its samples are not trained this epoch); the last error: {}",
                failure.message
            );
        }
        if !failure.restartable() {
            self.begin_ending(EXIT_RESTART, false, true_reason("a target copy's device is poisoned", &failure));
        } else if outcome.restart_at.is_none() {
            let reason = format!(
                "target copy {target} failed more than supervision.max_restarts = {} times within {} s",
                s.max_restarts, s.restart_window_s
            );
            self.begin_ending(EXIT_NO_PROGRESS, false, reason);
        }
    }

    /// Sets a batch aside everywhere it is queued; returns its sample ids.
    fn set_batch_aside(&mut self, batch: BatchId) -> Vec<u64> {
        let positions = self.schedule.set_aside_now(batch).map(|b| b.samples).unwrap_or_default();
        for t in &mut self.targets {
            t.blank(batch);
        }
        positions.iter().filter_map(|&p| self.sample_ids.get(p).copied()).collect()
    }

    fn send(&mut self, drafter: usize, generation: u64, item: Item) {
        self.seq += 1;
        let request = Request { seq: self.seq, drafter, generation, item };
        let target = self.feeds[drafter];
        if let Some(request) = self.targets[target].push(request) {
            let generation = self.targets[target].generation;
            self.out.push(Action::TargetRequest { target, generation, request });
        }
    }

    fn start_targets(&mut self) {
        let now = self.now;
        for t in 0..self.targets.len() {
            if self.targets[t].due(now) {
                let generation = self.targets[t].start(now);
                self.out.push(Action::StartTarget { target: t, generation });
            }
        }
        if self.phase == Phase::StartingTargets {
            if self.targets.iter().all(|t| t.ever_ready) {
                self.phase = Phase::StartingDrafters;
            } else if self.targets.iter().all(|t| t.ever_ready || t.never_started() || t.gave_up()) {
                // One copy at a time: random preset weights come from reseeded generators, and loads do not pile up.
                if let Some(t) = self.targets.iter().position(TargetCopy::never_started) {
                    let generation = self.targets[t].start(now);
                    self.out.push(Action::StartTarget { target: t, generation });
                }
            }
        }
    }

    // ------------------------------------------------------------------ drafters

    fn drafter_ready(&mut self, id: usize, generation: u64) {
        let slot = &mut self.slots[id];
        let Life::Starting { role, since, .. } = slot.life else { return };
        if slot.generation != generation {
            return;
        }
        slot.life = Life::Starting { role, since, ready: true };
        tracing::info!(drafter = id, device = %slot.device, generation, "drafter ready");
        if role == Role::Joiner
            && let Some(donor) = self.donor()
        {
            self.tell(donor, Order::ServeJoiners);
        }
    }

    fn drafter_joined(&mut self, id: usize, generation: u64, step: u64) {
        let slot = &mut self.slots[id];
        if slot.generation != generation || !matches!(slot.life, Life::Starting { .. }) {
            return;
        }
        let founder = slot.role() == Some(Role::Founder);
        slot.life = Life::Live;
        slot.step = step;
        if !self.members.contains(&(id, generation)) {
            self.members.push((id, generation));
            self.members.sort_unstable();
        }
        if founder {
            self.founding_from = None;
        }
        tracing::info!(drafter = id, step, "drafter live");
        if self.phase == Phase::Running {
            for st in self.schedule.open_steps_from(step) {
                for item in self.schedule.assign(st, id, generation) {
                    self.send(id, generation, item);
                }
            }
        }
        let joiners_waiting =
            self.slots.iter().any(|s| matches!(s.life, Life::Starting { role: Role::Joiner, ready: true, .. }));
        if joiners_waiting {
            self.tell((id, generation), Order::ServeJoiners);
        }
    }

    fn drafter_failed(&mut self, id: usize, generation: u64, failure: Failure, running: &[BatchId], injected: bool) {
        if !self.slots[id].current(generation) {
            return;
        }
        tracing::warn!(drafter = id, generation, kind = ?failure.kind, "drafter failed: {}", failure.message);
        if !injected {
            self.schedule.note_failure(running);
        }
        if self.slots[id].role() == Some(Role::Founder)
            && let Some(step) = self.founding_from.take()
            && failure.kind == FailureKind::CheckpointLoad
        {
            tracing::error!(step, "the checkpoint of step {step} cannot be loaded: later rewinds pass it over");
            self.book.shun(step);
        }
        self.out.push(Action::Abandon { id, generation });
        if self.book.donor_lost(id, generation) {
            // The snapshot will never come: ask another replica.
            self.checkpoint_owed = true;
        }
        if !failure.restartable() {
            self.slots[id].life = Life::Failed;
            self.begin_ending(EXIT_RESTART, false, true_reason("an error poisoned a drafter's device", &failure));
            return;
        }
        let s = self.config.supervision.clone();
        let mut give_up = false;
        if failure.kind == FailureKind::Hang && !injected {
            let hangs = self.gpu_hangs.entry(self.slots[id].device.clone()).or_insert(0);
            *hangs += 1;
            give_up = *hangs >= s.gpu_hang_limit;
        }
        match self.slots[id].fail(self.now, &s, give_up) {
            Fate::RestartAt(at) => {
                tracing::info!(drafter = id, in_ms = at.saturating_sub(self.now).as_millis() as u64, "restarting");
                self.out.push(Action::Notice(Notice::Restarted { id }));
            }
            Fate::Failed => tracing::error!(
                drafter = id,
                restarts = self.slots[id].restarts.total,
                "drafter marked failed; training continues without it"
            ),
        }
    }

    fn step_done(&mut self, id: usize, generation: u64, step: u64, digest: Option<[i64; 3]>, applied: bool, wait: f64) {
        if self.slots[id].generation != generation || !self.slots[id].is_live() {
            return;
        }
        self.slots[id].step = step;
        self.window.feature_wait_s += wait;
        if !applied && self.donor().map(|d| d.0) == Some(id) {
            tracing::warn!(step, "non-finite gradient norm: the update was skipped on every replica");
        }
        if let Some(d) = digest {
            self.replicas.expected.entry(step).or_default().1.insert(id, d);
            self.compare_replicas(step);
        }
    }

    fn compare_replicas(&mut self, step: u64) {
        if self.replicas.compare(step) == Some(false) {
            self.out.push(Action::Notice(Notice::ReplicasDiverged));
            tracing::error!(step, "replicas diverged: their parameters or optimizer states differ");
        }
    }

    /// Starts every drafter whose turn it is: joiners while a member is live, one founder (after a rewind) when
    /// the collective is empty, threads that lost their donor back in line.
    fn start_drafters(&mut self) {
        if self.phase == Phase::StartingTargets || self.ending.is_some() {
            return;
        }
        let founder_starting = self.slots.iter().any(|s| s.role() == Some(Role::Founder));
        if self.members.is_empty() && !founder_starting {
            // Joiners whose donor is gone would wait forever: back in line, without it counting against them.
            for s in self.slots.iter_mut().filter(|s| s.role() == Some(Role::Joiner)) {
                tracing::warn!(drafter = s.id, "no live replica left to join: it will start again");
                self.out.push(Action::Abandon { id: s.id, generation: s.generation });
                s.life = Life::Waiting;
            }
        }
        let now = self.now;
        let due: Vec<usize> = self.slots.iter().filter(|s| s.due(now)).map(|s| s.id).collect();
        let Some(&first) = due.first() else { return };
        let starting = self.slots.iter().any(|s| matches!(s.life, Life::Starting { .. }));
        if self.phase == Phase::StartingDrafters && starting {
            return;
        }
        if self.members.is_empty() {
            if !founder_starting {
                self.found_with(first);
            }
            return;
        }
        if self.donor().is_none() {
            // A member whose Joined report is on its way: it will serve them.
            return;
        }
        let take = if self.phase == Phase::StartingDrafters { 1 } else { due.len() };
        for id in due.into_iter().take(take) {
            let generation = self.slots[id].spawn(Role::Joiner, now);
            self.out.push(Action::SpawnDrafter { id, generation, start: Start::Join });
        }
    }

    /// Founds the empty collective with drafter `id`, once the state to found it from is known (the resumed
    /// checkpoint the first time; later a scan for the newest valid checkpoint).
    fn found_with(&mut self, id: usize) {
        if matches!(self.rewind, Rewind::Idle)
            && self.initial.is_none()
            && let Some(since) = self.book.writing_since()
        {
            // The checkpoint being written may be the newest state there is: wait for it, within the start deadline.
            if self.now.saturating_sub(since) <= self.start_deadline() {
                return;
            }
            tracing::warn!("the checkpoint in flight is late: rewinding without it (the writer will discard it)");
            self.book.forget_write();
        }
        let source = match std::mem::replace(&mut self.rewind, Rewind::Idle) {
            Rewind::Scanned(source) => source,
            Rewind::Idle => match self.initial.take() {
                Some(source) => source,
                None => {
                    self.scan();
                    return;
                }
            },
            Rewind::RetryAt(at) if at <= self.now => {
                self.scan();
                return;
            }
            waiting => {
                self.rewind = waiting;
                return;
            }
        };
        let first = self.incarnation == 0;
        self.incarnation += 1;
        self.restore(&source);
        let position = self.schedule.committed_step();
        if !first {
            tracing::warn!(step = position, "no live replica: the run continues from step {position}");
        }
        self.out
            .push(Action::RewindCollective { step: position, samples_committed: self.schedule.samples_committed() });
        self.out.push(Action::DropSnapshots { which: None });
        // Checkpoints above the source belong to steps this run no longer has (or could not use): moved aside, so
        // that no later rewind or resume jumps onto them.
        self.out.push(Action::RetireCheckpoints { from: position + 1, to: u64::MAX });
        self.out.push(Action::Ledger(LedgerEntry::Rewind { step: position }));
        let path = match source {
            Source::Checkpoint(path, state) => {
                self.founding_from = Some(state.step);
                Some(path)
            }
            Source::Fresh => None,
        };
        let generation = self.slots[id].spawn(Role::Founder, self.now);
        self.out.push(Action::SpawnDrafter { id, generation, start: Start::Found(path) });
    }

    fn scan(&mut self) {
        self.rewind = Rewind::Scanning;
        self.out.push(Action::FindCheckpoint(self.book.scan_filter()));
    }

    fn checkpoint_found(&mut self, result: Result<Found, String>) {
        if !matches!(self.rewind, Rewind::Scanning) {
            return;
        }
        match result {
            Ok(found) => {
                self.scan_failures = 0;
                self.book.found_invalid(&found.rejected);
                self.rewind = Rewind::Scanned(match found.newest {
                    Some((path, state)) => {
                        tracing::warn!(step = state.step, path = %path.display(), "rewinding to the newest valid checkpoint");
                        Source::Checkpoint(path, Box::new(state))
                    }
                    None => {
                        tracing::warn!("no valid checkpoint: the run starts again from the beginning");
                        Source::Fresh
                    }
                });
            }
            Err(e) => {
                let attempts = self.scan_failures + 1;
                self.scan_failures = attempts;
                let s = self.supervision();
                let delay = s.backoff_initial_ms.saturating_mul(1 << attempts.min(16)).min(s.backoff_max_ms);
                tracing::error!("cannot look for a checkpoint to rewind to: {e}; trying again in {delay} ms");
                if attempts as usize > s.max_restarts {
                    self.rewind = Rewind::Idle;
                    self.begin_ending(EXIT_RESTART, false, format!("checkpoint.dir cannot be read: {e}"));
                } else {
                    self.rewind = Rewind::RetryAt(self.now + Duration::from_millis(delay));
                }
            }
        }
    }

    /// Puts the run at `source`'s position, in the current incarnation.
    fn restore(&mut self, source: &Source) {
        let (position, state) = match source {
            Source::Checkpoint(_, state) => (
                Position {
                    step: state.step,
                    samples_committed: state.samples_committed,
                    loader: Some(state.loader.clone()),
                    set_aside: state.set_aside.clone(),
                },
                Some(state),
            ),
            Source::Fresh => (Position::START, None),
        };
        self.schedule.restore(&position, self.incarnation);
        self.skipped_steps = state.map_or(0, |s| s.skipped_steps);
        self.last_lr = state.map_or(0.0, |s| s.lr);
        for t in &mut self.targets {
            t.clear();
        }
        self.replicas.expected.clear();
        let boundary = match state {
            Some(s) => (**s).clone(),
            None => self.boundary_state(),
        };
        let newest = match source {
            Source::Checkpoint(path, state) => Some(Newest { step: state.step, path: path.clone(), at: self.now }),
            Source::Fresh => None,
        };
        self.book.rewound(position.step, boundary, newest);
    }

    /// The trainer state at the committed step boundary (the optimizer's count comes with the snapshot).
    fn boundary_state(&self) -> TrainerState {
        let mut state =
            TrainerState::new(self.schedule.committed_step(), self.schedule.loader_state(), self.config.merged.clone());
        state.samples_committed = self.schedule.samples_committed();
        state.skipped_steps = self.skipped_steps;
        state.set_aside = self.schedule.set_aside().to_vec();
        state.lr = self.last_lr;
        state
    }
}

impl Core {
    // ------------------------------------------------------------------ steps

    /// Opens steps ahead until `prefetch_steps` are in flight, for the live drafters.
    fn open_steps(&mut self) {
        if self.phase != Phase::Running || self.ending.is_some() {
            return;
        }
        while self.schedule.in_flight() < self.supervision().prefetch_steps {
            let live: Vec<(usize, u64)> = self.live().map(|s| (s.id, s.generation)).collect();
            if live.is_empty() {
                return;
            }
            let Some((_, items)) = self.schedule.open_step(&live) else { return };
            for (drafter, generation, item) in items {
                self.send(drafter, generation, item);
            }
        }
    }

    fn commit(&mut self, settled: Settled) {
        let step = settled.step + 1;
        for batch in settled.committed {
            self.out.push(Action::Ledger(LedgerEntry::Commit { step: settled.step, batch }));
        }
        if settled.requeued_samples > 0 {
            self.samples_requeued += settled.requeued_samples;
            self.out.push(Action::Notice(Notice::Requeued { samples: settled.requeued_samples }));
        }
        for batch in &settled.set_aside {
            let ids: Vec<u64> = batch.samples.iter().filter_map(|&p| self.sample_ids.get(p).copied()).collect();
            tracing::error!(batch = ?batch.id, sample_ids = ?ids, "batch failed twice: set aside");
        }
        let every = self.config.supervision.check_replicas_every;
        if every > 0 && step.is_multiple_of(every) {
            let members = settled.contributors.iter().map(|(m, _)| *m).collect();
            self.replicas.expected.entry(step).or_default().0 = members;
            self.compare_replicas(step);
        }
        let skipped = !settled.total_weight.is_finite();
        if skipped {
            self.skipped_steps += 1;
        }
        self.last_lr = settled.lr;
        self.window.metrics.add(&settled.metrics);
        self.window.samples += settled.samples;
        let m = &settled.metrics;
        let loss = (m.weight > 0.0).then(|| [m.loss(), m.accuracy(), m.acceptance_length()]);
        self.out.push(Action::Notice(Notice::Committed {
            step,
            samples: settled.samples,
            tokens: settled.tokens,
            loss,
            skipped,
        }));
        if let Some(job) = self.book.boundary(step, self.boundary_state(), self.now) {
            self.write(job);
        }
        if self.config.log.every_steps > 0 && step.is_multiple_of(self.config.log.every_steps) {
            self.log_progress();
        }
        let every = self.config.checkpoint.every_steps;
        if every > 0 && step.is_multiple_of(every) {
            self.request_checkpoint("periodic");
        }
        let every = self.config.eval.every_steps;
        if every > 0 && step.is_multiple_of(every) && self.eval_due.is_none() {
            // One due evaluation at a time: a slow checkpoint or evaluation makes later ones wait, not pile up.
            self.eval_due = Some(step);
            if !self.request_checkpoint("evaluation") {
                self.checkpoint_owed = true;
            }
        }
    }

    fn log_progress(&mut self) {
        let elapsed = self.now.saturating_sub(self.window.started).as_secs_f64().max(1e-9);
        let live = self.live_count();
        let w = &self.window;
        tracing::info!(
            "step {} · epoch {} · loss {:.4} · accuracy {:.3} · acceptance {:.2} · {:.1} samples/s · feature wait {:.1}% · \
             lr {:.2e} · drafters {}/{} live",
            self.schedule.committed_step(),
            self.schedule.epoch(),
            w.metrics.loss(),
            w.metrics.accuracy(),
            w.metrics.acceptance_length(),
            w.samples as f64 / elapsed,
            100.0 * w.feature_wait_s / (elapsed * live.max(1) as f64),
            self.last_lr,
            live,
            self.slots.len()
        );
        self.window = Window { metrics: Metrics::default(), samples: 0, feature_wait_s: 0.0, started: self.now };
    }

    // ------------------------------------------------------------------ checkpoints and evaluation

    /// Asks the donor for a snapshot at its next step boundary; false when none is live or one is in flight.
    fn request_checkpoint(&mut self, reason: &str) -> bool {
        let Some(donor) = self.donor() else { return false };
        if !self.book.request(donor.0, donor.1, self.now) {
            return false;
        }
        tracing::debug!(reason, drafter = donor.0, "checkpoint requested");
        self.checkpoint_owed = false;
        self.tell(donor, Order::Checkpoint);
        true
    }

    /// Hands a checkpoint to the writer, as part of the current incarnation.
    fn write(&mut self, mut job: super::protocol::WriteJob) {
        job.incarnation = self.incarnation;
        self.out.push(Action::WriteCheckpoint(job));
    }

    fn checkpoint_written(&mut self, step: u64, incarnation: u64, result: Result<(PathBuf, f64), String>) {
        if incarnation != self.incarnation {
            // A write the run stopped waiting for when it rewound (the writer normally discards those).
            if result.is_ok() {
                tracing::warn!(step, "a checkpoint of steps the run rewound past was written late: it is moved aside");
                self.out.push(Action::RetireCheckpoints { from: step, to: step });
            }
            return;
        }
        match result {
            Ok((path, seconds)) => {
                tracing::info!(step, path = %path.display(), seconds = format!("{seconds:.2}"), "checkpoint written");
                self.out.push(Action::Notice(Notice::CheckpointOutcome(Some((step, seconds)))));
                self.book.written(step, Some(path.clone()), self.now);
                self.evaluate_if_due(step, path);
            }
            Err(e) => {
                tracing::error!(step, "checkpoint failed: {e}");
                self.out.push(Action::Notice(Notice::CheckpointOutcome(None)));
                self.book.written(step, None, self.now);
            }
        }
    }

    /// Hands checkpoint `path` of `step` to the evaluator when an evaluation is due at or before `step`.
    fn evaluate_if_due(&mut self, step: u64, path: PathBuf) {
        let Some(due) = self.eval_due else { return };
        if step < due {
            // An older checkpoint was in flight when the evaluation came due.
            self.checkpoint_owed = true;
            return;
        }
        self.eval_due = None;
        self.out.push(Action::Evaluate { step, path });
    }

    fn evaluated(&mut self, outcome: Result<Evaluated, String>) {
        match outcome {
            Ok(e) => {
                tracing::info!(
                    step = e.step,
                    "evaluation: decoded acceptance {:.3} · token match {:.3} · {} prompts · {:.1} s · best {:.3}{}",
                    e.decode_acceptance_length,
                    e.token_match_rate,
                    e.prompts,
                    e.seconds,
                    e.best,
                    if e.new_best { " (new best: checkpoint kept as best)" } else { "" }
                );
                self.last_evaluation = Some(e);
            }
            Err(e) => tracing::error!("evaluation failed: {e}"),
        }
    }

    // ------------------------------------------------------------------ the end

    /// The run is to end with `code` (an ending already under way keeps its own, unless this one is an error and
    /// it was not).
    fn begin_ending(&mut self, code: i32, export: bool, reason: String) {
        if let Some(e) = &mut self.ending {
            if code != EXIT_OK && e.code == EXIT_OK {
                tracing::error!("{reason}: ending with exit status {code}");
                e.code = code;
                e.export = false;
                e.reason = reason;
            }
            return;
        }
        match code {
            EXIT_OK => tracing::info!(step = self.schedule.committed_step(), "{reason}: checkpointing, then exiting"),
            _ => tracing::error!(
                step = self.schedule.committed_step(),
                code,
                "{reason}: checkpointing from a live replica if there is one, then exiting with status {code}"
            ),
        }
        self.ending = Some(Ending {
            code,
            export,
            reason,
            deadline: self.now + Duration::from_secs_f64(self.supervision().shutdown_timeout_s),
            writes_before: self.book.writes,
            failures_before: self.book.failures,
            exporting: false,
        });
    }

    /// Ends the run once its last checkpoint is written (or cannot be).
    fn try_end(&mut self) {
        let Some(e) = &self.ending else { return };
        if e.exporting {
            return;
        }
        let (code, export) = (e.code, e.export);
        let done = if export {
            self.book.written_at(self.schedule.committed_step())
        } else {
            self.book.writes > e.writes_before
        };
        if done {
            return self.finish(code, export);
        }
        if self.book.in_flight() {
            if self.now >= e.deadline {
                let code = if code == EXIT_OK { EXIT_RESTART } else { code };
                tracing::error!(
                    seconds = self.supervision().shutdown_timeout_s,
                    "the last checkpoint did not finish within supervision.shutdown_timeout_s: exiting with status \
                     {code}; the newest valid checkpoint stays"
                );
                self.finish(code, false);
            }
            return;
        }
        if self.book.failures > e.failures_before {
            let code = if code == EXIT_OK { EXIT_ERROR } else { code };
            tracing::error!(
                "the last checkpoint could not be written: exiting with status {code}; the newest valid one stays"
            );
            return self.finish(code, false);
        }
        if export && !self.schedule.finished() {
            // Steps are still in flight: the final checkpoint is of the last one.
            return;
        }
        if !self.request_checkpoint(if export { "final" } else { "ending" }) {
            // No live replica to checkpoint from.
            let code = if export { EXIT_RESTART } else { code };
            if code != EXIT_OK {
                tracing::error!("no live replica to checkpoint from: exiting with status {code}");
            }
            self.finish(code, false);
        }
    }

    fn finish(&mut self, code: i32, export: bool) {
        if export && let Some(newest) = self.book.newest() {
            let from = newest.path.clone();
            if let Some(e) = &mut self.ending {
                e.exporting = true;
            }
            self.out.push(Action::Export { from });
            return;
        }
        self.exit_now(code);
    }

    fn exit_now(&mut self, code: i32) {
        for (id, generation) in self.running_threads() {
            self.tell((id, generation), Order::Stop);
        }
        self.out.push(Action::Exit { code });
        self.exit = Some(code);
    }

    // ------------------------------------------------------------------ after every event

    fn advance(&mut self) {
        if self.exit.is_some() {
            return;
        }
        self.check_deadlines();
        self.start_targets();
        self.start_drafters();
        if self.phase == Phase::StartingDrafters && self.slots.iter().all(|s| s.is_live() || s.is_failed()) {
            self.phase = Phase::Running;
            self.window.started = self.now;
            tracing::info!(
                drafters = self.slots.len(),
                step = self.schedule.committed_step(),
                samples = self.schedule.samples_per_epoch(),
                "training"
            );
        }
        self.open_steps();
        if self.phase == Phase::Running && self.ending.is_none() && self.schedule.finished() {
            self.begin_ending(EXIT_OK, true, "run complete".into());
        }
        let alive = self.slots.iter().filter(|s| !s.is_failed()).count();
        let min = self.supervision().min_live_drafters;
        if alive < min {
            let reason = format!(
                "{alive} drafter(s) left that are not failed for good, below supervision.min_live_drafters = {min}"
            );
            self.begin_ending(EXIT_NO_PROGRESS, false, reason);
        }
        self.periodic_checkpoint();
        self.try_end();
    }

    fn check_deadlines(&mut self) {
        let (now, deadline) = (self.now, self.start_deadline());
        let overdue: Vec<(usize, u64)> =
            self.slots.iter().filter(|s| s.start_overdue(now, deadline)).map(|s| (s.id, s.generation)).collect();
        for (id, generation) in overdue {
            let message =
                format!("did not start within {:.0} s (twice supervision.step_timeout_s)", deadline.as_secs_f64());
            self.drafter_failed(id, generation, Failure { kind: FailureKind::Hang, message }, &[], false);
        }
        let overdue: Vec<(usize, u64)> =
            self.targets.iter().filter(|t| t.start_overdue(now, deadline)).map(|t| (t.id, t.generation)).collect();
        for (target, generation) in overdue {
            let message =
                format!("did not start within {:.0} s (twice supervision.step_timeout_s)", deadline.as_secs_f64());
            self.target_failed(target, generation, Failure { kind: FailureKind::Hang, message });
        }
        if let Some((donor, generation)) = self.book.snapshot_overdue(now, deadline) {
            tracing::warn!(drafter = donor, "no snapshot within {:.0} s: asking again", deadline.as_secs_f64());
            self.book.donor_lost(donor, generation);
            self.checkpoint_owed = true;
        }
    }

    fn periodic_checkpoint(&mut self) {
        if self.phase != Phase::Running || self.ending.is_some() || self.book.in_flight() {
            return;
        }
        let every = self.config.checkpoint.every_seconds;
        let timed = every > 0.0 && self.book.since_request(self.now).as_secs_f64() >= every;
        if timed || self.checkpoint_owed {
            self.request_checkpoint(if timed { "periodic (time)" } else { "owed" });
        }
    }
}

/// `what`: the failure's message.
fn true_reason(what: &str, failure: &Failure) -> String {
    format!("{what}: {}", failure.message)
}
