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
mod checkpoints;
mod drafters;
mod ending;
mod health;
mod hosts;
mod parting;
mod rewind;
mod steps;
mod targets;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

pub use self::hosts::HostRole;
use self::hosts::Hosts;
use super::checkpoints::{Book, Newest, SnapshotOutcome};
use super::drafters::{Life, Role, Slot};
use super::protocol::{Action, Event, LedgerEntry, Notice, Order, Request, Start, WriteJob};
use super::schedule::{Item, Position, Schedule, Settled};
use super::targets::TargetCopy;
use super::watchdog::{StepTimes, StoppedTime};
use crate::config::Config;
use crate::data::SampleId;
use crate::data::loader::BatchId;
use crate::service::evaluator::Evaluated;
use crate::service::exit::{EXIT_ERROR, EXIT_NO_PROGRESS, EXIT_OK, EXIT_RESTART, is_stop};
use crate::service::failure::{Failure, FailureKind};
use crate::service::live::ProgressPoint;
use crate::service::status::{CheckpointStatus, DrafterStatus, LedgerStatus, Status, TargetStatus, WriterStatus};
use crate::service::supervisor::run_progress::{Bound, Estimate, RunProgress};
use crate::train::checkpoint::{Scan, TrainerState, Written};
use crate::train::collective::{Contributed, RoundReport};
use crate::train::objective::Metrics;
use crate::train::objective::ObjectiveKnobs;
use crate::train::optim::LrSchedule;
use crate::train::optim::{Hyper, OptimizerKind, Progress};
use crate::train::step::StepSettings;

/// A status that says something went wrong (a stop and completion do not).
pub fn is_error(code: i32) -> bool {
    code != EXIT_OK && !is_stop(code)
}

/// Everything a reload may change in the training step, from the configuration. The learning-rate schedule counts
/// steps when `optim.max_steps` bounds the run (it spans `max_steps`), and committed samples otherwise (it spans
/// the epochs): either way its length and position do not depend on how many drafters are live, so the rate is
/// continuous across failures, rejoins and resuming with a different number of drafters.
pub fn step_settings(cfg: &Config, samples_per_epoch: u64, gamma: Option<f64>) -> StepSettings {
    let o = &cfg.optim;
    let (progress, total) = match (o.max_steps, cfg.data.stream.is_some()) {
        (0, false) => (Progress::Samples, samples_per_epoch * o.epochs),
        // A stream without an end: the schedule counts steps (constant after any warmup_steps).
        (0, true) => (Progress::Steps, 0),
        (steps, _) => (Progress::Steps, steps),
    };
    StepSettings {
        hyper: Hyper {
            schedule: LrSchedule {
                kind: o.schedule,
                lr: o.lr,
                warmup_steps: match o.warmup_steps {
                    0 => (o.warmup_ratio * total as f64).round() as u64,
                    steps => steps,
                },
                total_steps: total.max(1),
                min_lr_ratio: o.min_lr_ratio,
            },
            progress,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            grad_clip: o.grad_clip,
            muon: (o.optimizer == OptimizerKind::Muon).then_some(o.muon),
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
    pub sample_ids: Vec<SampleId>,
    /// `data.stream`: the waves known at start, as the schedule's epochs.
    pub stream: Option<crate::data::loader::StreamEpochs>,
    /// The checkpoint to resume (`--resume auto`) and the checkpoint folders found invalid on the way.
    pub resume: Option<(PathBuf, TrainerState)>,
    pub rejected: Vec<u64>,
    /// Several hosts: this process's part (`None`: one host).
    pub role: Option<HostRole>,
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
    /// The final checkpoint's evaluation was asked for.
    final_evaluation: bool,
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
    sample_ids: Vec<SampleId>,
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
    /// An evaluation was asked for and has not answered.
    evaluating: bool,
    last_evaluation: Option<Evaluated>,
    /// Times between committed rounds, for the hang budget.
    step_times: StepTimes,
    /// The recent commits, for where the run stands against its end.
    run_progress: RunProgress,
    last_commit: Option<Duration>,
    /// The last sign of progress: a committed round, a drafter joining, training beginning.
    progress_at: Duration,
    /// `data.stream`: the conversations short of a wave, and when (on `now`'s clock) they make one by waiting.
    stream_pending: (usize, Option<Duration>),
    /// The watchdog's clock: the monotonic one less the time this process did not run.
    now: Duration,
    /// The monotonic time of the event being handled, and the gaps in it.
    monotonic: Duration,
    stopped: StoppedTime,
    out: Vec<Action>,
    hosts: Hosts,
    health: health::Health,
}

impl Core {
    pub fn new(setup: Setup) -> Self {
        let c = &setup.config;
        let mut schedule = Schedule::of_run(c, setup.lengths);
        if let Some(stream) = setup.stream {
            schedule.stream(stream);
        }
        if setup.role == Some(HostRole::Follower) {
            schedule.follow();
        }
        let mut book = Book::default();
        book.found_invalid(&setup.rejected);
        let initial = match setup.resume {
            // A follower takes the run's state from a live host: rank 0 resumes.
            Some((path, state)) if setup.role != Some(HostRole::Follower) => Source::Checkpoint(path, Box::new(state)),
            _ => Source::Fresh,
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
            evaluating: false,
            last_evaluation: None,
            step_times: StepTimes::default(),
            run_progress: RunProgress::default(),
            last_commit: None,
            progress_at: Duration::ZERO,
            stream_pending: (0, None),
            now: Duration::ZERO,
            monotonic: Duration::ZERO,
            stopped: StoppedTime::default(),
            out: vec![],
            hosts: Hosts { role: setup.role, ..Hosts::default() },
            health: health::Health::default(),
            config: setup.config,
        };
        // Status shows where the run starts before the first founder loads it.
        core.restore(&initial);
        core.initial = Some(initial);
        core
    }

    /// The first actions (start the first target copy).
    pub fn start(&mut self, now: Duration) -> Vec<Action> {
        self.set_clock(now);
        self.window.started = self.now;
        self.advance();
        std::mem::take(&mut self.out)
    }

    /// Moves the clocks to monotonic time `now`, skipping time not run.
    fn set_clock(&mut self, now: Duration) {
        self.monotonic = self.monotonic.max(now);
        self.now = self.now.max(self.stopped.clock(self.monotonic));
    }

    /// Takes one event at monotonic time `now` (never earlier than the last); returns what to do.
    pub fn handle(&mut self, now: Duration, event: Event) -> Vec<Action> {
        if let Event::Stopped { for_ } = event {
            // Before the clock moves: the watchdog's clock skips the gap.
            self.stopped.stopped(now.max(self.monotonic), for_);
            tracing::warn!(
                "this process did not run for {:.1} s (stopped, or its host stalled): that time is charged to nobody",
                for_.as_secs_f64()
            );
        }
        self.set_clock(now);
        if self.exit.is_some() {
            return vec![];
        }
        match event {
            Event::Tick | Event::Stopped { .. } => {}
            Event::Watch(drafters) => self.watch(drafters),
            Event::TargetReady { target, generation } => self.target_ready(target, generation),
            Event::TargetFailed { target, generation, failure } => self.target_failed(target, generation, failure),
            Event::Delivered { target, generation, seq } => self.targets[target].delivered(generation, seq, self.now),
            Event::DrafterReady { id, generation } => self.drafter_ready(id, generation),
            Event::DrafterJoined { id, generation, step } => self.drafter_joined(id, generation, step),
            Event::DrafterFailed { id, generation, failure, running, injected } => {
                self.drafter_failed(id, generation, failure, &running, injected)
            }
            Event::MemberRemoved { remaining } => self.members = remaining,
            Event::StepDone { id, generation, step, digest, applied, feature_wait_s } => {
                self.step_done(id, generation, step, digest, applied, feature_wait_s)
            }
            Event::Round(report) => {
                if self.is_follower() {
                    self.hosts.survivor.round(&report);
                }
                let report = if self.is_leader() { self.with_remote(report) } else { report };
                self.schedule.align_samples(&report);
                for settled in self.schedule.take_report(report) {
                    self.commit(settled);
                }
            }
            Event::Hosts(members) => self.hosts_changed(members),
            Event::Fed { step, items, position } => self.fed(step, items, position),
            // Complete, or stopped with its checkpoint written: this host ends with it (a stop is restartable).
            Event::RunEnded { code } if !is_error(code) => {
                tracing::info!(code, "rank 0 ended the run");
                self.exit_now(code);
            }
            // Rank 0 may have had no replica to checkpoint (it lost every drafter): this host's may be the newest.
            Event::RunEnded { code } => self.part(format!("rank 0 ended the run with status {code}"), code),
            Event::RendezvousLost(why) => self.part(format!("the rendezvous host is gone ({why})"), EXIT_RESTART),
            Event::LeftRun => self.left_run(),
            Event::Snapshot { id, generation, step, optimizer_steps } if self.parting() => {
                self.parting_snapshot(id, generation, step, optimizer_steps)
            }
            Event::CheckpointWritten(Written { step, result, .. }) if self.parting() => self.parted(step, result),
            Event::Snapshot { id, generation, step, optimizer_steps } => {
                match self.book.snapshot(id, generation, step, optimizer_steps, self.now) {
                    SnapshotOutcome::Unwanted if !self.book.holds(id, generation, step) => {
                        self.out.push(Action::DropSnapshots { which: Some((id, generation, step)) })
                    }
                    SnapshotOutcome::Unwanted | SnapshotOutcome::Waiting => {}
                    SnapshotOutcome::Write(job) => self.write(*job),
                }
            }
            Event::CheckpointWritten(Written { step, incarnation, result }) => {
                self.checkpoint_written(step, incarnation, result)
            }
            Event::CheckpointFound(result) => self.checkpoint_found(result),
            Event::Evaluated(outcome) => self.evaluated(outcome),
            Event::LedgerWritten(outcome) => self.ledger_written(outcome),
            Event::Wave { number, lengths, ids } => {
                tracing::info!(wave = number, conversations = lengths.len(), "data.stream: a wave to train");
                self.schedule.add_wave(&lengths);
                self.sample_ids.extend(ids);
                self.stream_pending = (0, None);
                // Waiting for it was no stall: the stall clock starts now.
                self.progress_at = self.now;
            }
            Event::StreamPending { conversations, due_in } => {
                self.stream_pending = (conversations, due_in.map(|d| self.now + d));
            }
            Event::Exported(result) if self.ending.as_ref().is_some_and(|e| e.exporting) => {
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
            Event::Exported(_) => {}
            Event::Reconfigured(config) => {
                self.config = *config;
                self.config_version += 1;
            }
            // Already ending, with this host's replica being checkpointed within its own deadline.
            Event::Shutdown(_) if self.parting() => {
                tracing::warn!("stop requested: this host's checkpoint is being written")
            }
            Event::Shutdown(signal) => {
                self.begin_ending(signal.exit_code(), false, "stop requested (a second signal exits at once)".into())
            }
        }
        self.advance();
        std::mem::take(&mut self.out)
    }

    // ------------------------------------------------------------------ queries

    /// Ready to train: running, not ending, at least one drafter live, nothing failing silently (`/readyz`).
    pub fn ready(&self) -> bool {
        self.phase == Phase::Running
            && self.ending.is_none()
            && self.exit.is_none()
            && self.live().next().is_some()
            && self.healthy()
            && self.hosts.left.is_none()
    }

    /// How long the exit may wait for the writers' queued work: what is left of the ending's deadline (at most
    /// `cap`).
    pub fn time_left_to_exit(&self, cap: Duration) -> Duration {
        let deadline = self.ending.as_ref().map(|e| e.deadline).or(self.hosts.parting.map(|p| p.deadline));
        deadline.map_or(cap, |d| d.saturating_sub(self.now).min(cap))
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
    pub fn drafter_state(&self, id: usize) -> Option<crate::service::status::DrafterState> {
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

    /// Asks for a checkpoint (`POST /checkpoint`); the step it will be of: the first step not handed out yet.
    pub fn checkpoint_now(&mut self, now: Duration) -> (Result<u64, String>, Vec<Action>) {
        self.set_clock(now);
        let answer = if self.exit.is_some() || self.ending.is_some() {
            Err("the service is stopping".to_string())
        } else if self.is_follower() {
            Err("rank 0 writes this run's checkpoints: ask it".to_string())
        } else if self.book.in_flight() {
            Err("a checkpoint is being written; try again shortly".to_string())
        } else {
            self.request_checkpoint("requested").ok_or_else(|| "no live drafter to checkpoint from".to_string())
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
        let own = Duration::from_secs_f64(2.0 * self.supervision().step_timeout_s);
        match self.hosts.role {
            // Entering a run of several hosts waits for the others at the rendezvous, or for a round to close.
            Some(_) => own + self.config.cluster.rendezvous_timeout + 2 * self.config.cluster.round_timeout,
            None => own,
        }
    }

    fn tell(&mut self, (id, generation): (usize, u64), order: Order) {
        self.out.push(Action::Tell { id, generation, order });
    }

    // ------------------------------------------------------------------ after every event

    /// What every event leads to: deadlines, starts, new steps, the end.
    fn advance(&mut self) {
        if self.exit.is_some() {
            return;
        }
        if self.parting() {
            return self.check_parting();
        }
        self.check_deadlines();
        self.check_writer();
        self.start_targets();
        self.start_drafters();
        if self.phase == Phase::StartingDrafters && self.slots.iter().all(|s| s.is_live() || s.is_failed()) {
            self.phase = Phase::Running;
            self.window.started = self.now;
            self.progress_at = self.now;
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
        let message =
            format!("did not start within {:.0} s (twice supervision.step_timeout_s)", deadline.as_secs_f64());
        let hang = || Failure { kind: FailureKind::Hang, message: message.clone() };
        let slots = self.slots.iter().filter(|s| s.start_overdue(now, deadline)).map(|s| (s.id, s.generation, hang()));
        for (id, generation, failure) in slots.collect::<Vec<_>>() {
            self.drafter_failed(id, generation, failure, &[], false);
        }
        let targets =
            self.targets.iter().filter(|t| t.start_overdue(now, deadline)).map(|t| (t.id, t.generation, hang()));
        for (target, generation, failure) in targets.collect::<Vec<_>>() {
            self.target_failed(target, generation, failure);
        }
        // A snapshot is taken once the steps handed out are done: a step's budget for each, twice over.
        let steps_ahead = self.schedule.next_step().saturating_sub(self.schedule.committed_step()) + 1;
        let snapshot_deadline = deadline.saturating_mul(steps_ahead as u32);
        if let Some((donor, generation)) = self.book.snapshot_overdue(now, snapshot_deadline) {
            let seconds = snapshot_deadline.as_secs_f64();
            tracing::warn!(drafter = donor, "no snapshot within {seconds:.0} s: asking again");
            self.book.donor_lost(donor, generation);
            self.checkpoint_owed = true;
        }
    }
}

/// `what`, and the failure's message.
fn because(what: &str, failure: &Failure) -> String {
    format!("{what}: {}", failure.message)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::service::exit::StopSignal;
    use crate::service::status::DrafterState;
    use crate::service::supervisor::watchdog::{Activity, DrafterSeen};

    /// A core's setup for `drafters` drafters on the CPU, one target copy, 64 samples (the backoffs short).
    pub(crate) fn setup(drafters: usize) -> Setup {
        let mut config = Config::builtin().unwrap();
        config.drafters.devices = vec![config.drafters.devices[0]; drafters];
        config.supervision.backoff_initial_ms = 100;
        config.supervision.backoff_max_ms = 100;
        Setup {
            config,
            drafter_devices: vec!["cpu".into(); drafters],
            target_devices: vec!["cpu".into()],
            feeds: vec![0; drafters],
            lengths: vec![8; 64],
            sample_ids: (0..64).map(SampleId::Number).collect(),
            stream: None,
            resume: None,
            rejected: vec![],
            role: None,
        }
    }

    /// The writer's answer that the checkpoint of `step` is in `folder`, written in `seconds`.
    pub(crate) fn written(step: u64, incarnation: u64, folder: &str, seconds: f64) -> Event {
        Event::CheckpointWritten(Written { step, incarnation, result: Ok((folder.into(), seconds)) })
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn spawned(actions: &[Action]) -> Vec<(usize, u64, Start)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::SpawnDrafter { id, generation, start } => Some((*id, *generation, start.clone())),
                _ => None,
            })
            .collect()
    }

    /// The target ready, then every drafter founded or joined and live, one at a time.
    fn running(drafters: usize) -> Core {
        let mut c = Core::new(setup(drafters));
        c.start(secs(0.0));
        let mut actions = c.handle(secs(0.1), Event::TargetReady { target: 0, generation: 1 });
        for _ in 0..drafters {
            let (id, generation, _) = spawned(&actions)[0].clone();
            c.handle(secs(0.2), Event::DrafterReady { id, generation });
            actions = c.handle(secs(0.2), Event::DrafterJoined { id, generation, step: 0 });
        }
        assert!(c.ready());
        c
    }

    fn fail(c: &mut Core, id: usize, generation: u64, at: f64) -> Vec<Action> {
        let failure = Failure::panic("boom".into());
        c.handle(secs(at), Event::DrafterFailed { id, generation, failure, running: vec![], injected: false })
    }

    #[test]
    fn start_up_founds_with_the_first_drafter_and_joins_the_others_one_at_a_time() {
        let mut c = Core::new(setup(3));
        assert!(matches!(c.start(secs(0.0))[..], [Action::StartTarget { target: 0, generation: 1 }]));
        let actions = c.handle(secs(0.1), Event::TargetReady { target: 0, generation: 1 });
        assert_eq!(spawned(&actions), vec![(0, 1, Start::Found(None))]);
        let actions = c.handle(secs(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        assert_eq!(spawned(&actions), vec![(1, 1, Start::Join)], "the next one, once the first is live");
        assert!(!c.ready(), "start-up is not over");
    }

    /// Every drafter failing at once: exactly one founds the run again (after the rewind's scan), the others wait
    /// for it to be live and then join it.
    #[test]
    fn when_every_drafter_fails_exactly_one_founds_and_the_others_join_it() {
        let mut c = running(3);
        let mut actions = vec![];
        for id in 0..3 {
            actions.extend(fail(&mut c, id, 1, 1.0));
            actions.extend(
                c.handle(secs(1.0), Event::MemberRemoved { remaining: ((id + 1)..3).map(|m| (m, 1)).collect() }),
            );
        }
        assert!(spawned(&actions).is_empty(), "in backoff");
        assert!(!c.ready());
        let actions = c.handle(secs(1.2), Event::Tick);
        assert!(matches!(actions[..], [Action::FindCheckpoint(_)]), "{actions:?}");
        let actions = c.handle(secs(1.3), Event::CheckpointFound(Ok(Scan::default())));
        assert_eq!(spawned(&actions), vec![(0, 2, Start::Found(None))], "one founder: {actions:?}");
        assert!(actions.iter().any(|a| matches!(a, Action::RewindCollective { step: 0, .. })));
        assert!(spawned(&c.handle(secs(1.4), Event::Tick)).is_empty(), "the others wait for the founder");
        let actions = c.handle(secs(1.5), Event::DrafterJoined { id: 0, generation: 2, step: 0 });
        assert_eq!(spawned(&actions), vec![(1, 2, Start::Join), (2, 2, Start::Join)]);
    }

    /// An update skipped on every replica is counted once, by the donor's word (each replica reports it).
    #[test]
    fn a_skipped_update_is_counted_once() {
        let mut c = running(2);
        let done = |id: usize, applied: bool| Event::StepDone {
            id,
            generation: 1,
            step: 1,
            digest: None,
            applied,
            feature_wait_s: 0.0,
        };
        let skipped = |actions: &[Action]| actions.iter().any(|a| matches!(a, Action::Notice(Notice::Skipped)));
        assert!(!skipped(&c.handle(secs(1.0), done(1, true))));
        assert!(!skipped(&c.handle(secs(1.0), done(1, false))), "not the donor");
        assert!(skipped(&c.handle(secs(1.0), done(0, false))));
        assert!(!skipped(&c.handle(secs(1.1), done(0, true))));
        assert_eq!(c.status().skipped_steps, 1);
    }

    /// A joiner whose donor dies before serving it would wait forever: it is given up on and started again, without
    /// it counting against its restart limit.
    #[test]
    fn a_joiner_that_lost_its_donor_starts_again_without_a_restart_counted() {
        let mut c = running(2);
        fail(&mut c, 1, 1, 1.0);
        c.handle(secs(1.0), Event::MemberRemoved { remaining: vec![(0, 1)] });
        let actions = c.handle(secs(1.2), Event::Tick);
        assert_eq!(spawned(&actions), vec![(1, 2, Start::Join)]);
        c.handle(secs(1.3), Event::DrafterReady { id: 1, generation: 2 });
        let actions = fail(&mut c, 0, 1, 1.4);
        assert!(actions.contains(&Action::Abandon { id: 0, generation: 1 }));
        let actions = c.handle(secs(1.4), Event::MemberRemoved { remaining: vec![] });
        assert!(actions.contains(&Action::Abandon { id: 1, generation: 2 }), "the orphan is given up on: {actions:?}");
        assert_eq!(c.status().drafters[1].restarts, 1, "only its own failure counts");
        c.handle(secs(1.4), Event::MemberRemoved { remaining: vec![] });
        let actions = c.handle(secs(1.45), Event::CheckpointFound(Ok(Scan::default())));
        assert_eq!(spawned(&actions), vec![(1, 3, Start::Found(None))], "it founds, drafter 0 is backing off");
    }

    /// A member whose `Joined` report is still on its way when the last known live drafter fails: the collective
    /// says it is there, so nobody founds over it.
    #[test]
    fn nobody_founds_while_the_collective_still_has_a_member() {
        let mut c = running(2);
        fail(&mut c, 1, 1, 1.0);
        c.handle(secs(1.0), Event::MemberRemoved { remaining: vec![(0, 1)] });
        c.handle(secs(1.2), Event::Tick);
        c.handle(secs(1.3), Event::DrafterReady { id: 1, generation: 2 });
        fail(&mut c, 0, 1, 1.4);
        let actions = c.handle(secs(1.4), Event::MemberRemoved { remaining: vec![(1, 2)] });
        assert!(
            !actions.iter().any(|a| matches!(a, Action::FindCheckpoint(_) | Action::Abandon { .. })),
            "{actions:?}"
        );
        let actions = c.handle(secs(1.5), Event::DrafterJoined { id: 1, generation: 2, step: 0 });
        assert!(c.live_count() == 1 && !actions.iter().any(|a| matches!(a, Action::RewindCollective { .. })));
    }

    /// Every drafter failed for good: the run cannot progress, so it ends with status 3 (nothing to checkpoint from).
    #[test]
    fn with_no_drafter_left_the_run_exits_3() {
        let mut s = setup(2);
        s.config.supervision.max_restarts = 0;
        let mut c = Core::new(s);
        c.start(secs(0.0));
        c.handle(secs(0.1), Event::TargetReady { target: 0, generation: 1 });
        c.handle(secs(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        c.handle(secs(0.3), Event::DrafterJoined { id: 1, generation: 1, step: 0 });
        fail(&mut c, 0, 1, 1.0);
        let actions = fail(&mut c, 1, 1, 1.0);
        assert!(actions.contains(&Action::Exit { code: EXIT_NO_PROGRESS }), "{actions:?}");
        assert_eq!(c.status().drafters.iter().filter(|d| d.state == DrafterState::Failed).count(), 2);
    }

    /// A rewind waits for the checkpoint being written (it may be the newest state), within twice the step timeout.
    #[test]
    fn a_rewind_waits_for_the_checkpoint_in_flight() {
        let mut c = running(1);
        let (answer, actions) = c.checkpoint_now(secs(1.0));
        let at = answer.unwrap();
        assert!(at > 0, "the first boundary past the steps handed out");
        assert!(actions.contains(&Action::Tell { id: 0, generation: 1, order: Order::Checkpoint { at } }));
        for step in 0..at {
            c.handle(secs(1.0), Event::Round(report(step, c.incarnation)));
        }
        let actions = c.handle(secs(1.1), Event::Snapshot { id: 0, generation: 1, step: at, optimizer_steps: at });
        assert!(matches!(actions[..], [Action::WriteCheckpoint(_)]), "{actions:?}");
        fail(&mut c, 0, 1, 1.2);
        c.handle(secs(1.2), Event::MemberRemoved { remaining: vec![] });
        assert!(c.handle(secs(1.5), Event::Tick).is_empty(), "waiting for the write");
        let written = written(at, c.incarnation, "ckpt", 0.1);
        let actions = c.handle(secs(1.6), written);
        let Some(Action::FindCheckpoint(filter)) = actions.last() else { panic!("{actions:?}") };
        assert!(filter.allows(at), "the checkpoint just written qualifies");
    }

    /// Under `optim.max_steps` the schedule counts steps; otherwise committed samples over the epochs.
    #[test]
    fn the_schedule_counts_steps_under_max_steps_and_samples_otherwise() {
        let mut cfg = Config::builtin().unwrap();
        let samples = step_settings(&cfg, 100, None).hyper;
        assert_eq!((samples.progress, samples.schedule.total_steps), (Progress::Samples, 100 * cfg.optim.epochs));
        cfg.optim.max_steps = 30;
        let steps = step_settings(&cfg, 100, None).hyper;
        assert_eq!((steps.progress, steps.schedule.total_steps), (Progress::Steps, 30));
        assert_eq!(steps.lr_at(29, 0), steps.lr_at(29, 1_000_000), "the drafter count plays no part");
        // An open-ended stream counts steps: warmup_steps, then constant, however long it runs.
        cfg.optim.max_steps = 0;
        cfg.optim.schedule = crate::train::ScheduleKind::Constant;
        cfg.optim.warmup_steps = 10;
        cfg.data.stream = Some(crate::config::StreamSettings {
            dir: "traffic".into(),
            mix: 0.5,
            answers: crate::data::stream::Answers::Greedy,
            min_conversations: 1,
            max_wait: None,
            poll: Duration::from_secs(1),
        });
        let open = step_settings(&cfg, 100, None).hyper;
        assert_eq!(open.progress, Progress::Steps);
        let lr = cfg.optim.lr;
        assert_eq!((open.lr_at(0, 0), open.lr_at(9, 0)), (lr / 10.0, lr));
        assert_eq!(open.lr_at(1_000_000, 0), lr);
    }

    fn report(step: u64, incarnation: u64) -> crate::train::collective::RoundReport {
        crate::train::collective::RoundReport {
            step,
            incarnation,
            contributions: vec![],
            total_weight: 0.0,
            lr: 1e-3,
            samples_committed: 0,
            remote: vec![],
        }
    }

    fn watched(id: usize, activity: Activity, for_: f64) -> DrafterSeen {
        DrafterSeen { id, generation: 1, activity, for_: secs(for_), running: vec![], injected: false }
    }

    fn abandoned(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Abandon { id, .. } => Some(format!("drafter {id}")),
                Action::AbandonTarget { target, .. } => Some(format!("target {target}")),
                _ => None,
            })
            .collect()
    }

    /// The watchdog fails the one that is stuck: a hung drafter (not its peers waiting for it), a target copy
    /// holding a capture (not the drafters waiting for their features).
    #[test]
    fn the_watchdog_fails_the_stuck_one_not_those_waiting_for_it() {
        let mut c = running(2);
        c.config.supervision.step_timeout_s = 10.0;
        let quiet = c.handle(secs(5.0), Event::Watch(vec![watched(0, Activity::Computing, 4.0)]));
        assert!(abandoned(&quiet).is_empty(), "within the budget");
        let hung = vec![watched(0, Activity::Applying, 11.0), watched(1, Activity::WaitingForPeers, 11.0)];
        let actions = c.handle(secs(12.0), Event::Watch(hung));
        assert_eq!(abandoned(&actions), ["drafter 0"]);
        assert_eq!(c.drafter_state(1), Some(DrafterState::Live));
        // Its peer has waited longer than the budget by then; before the round re-forms without the hung one (a
        // loaded machine's moment, CI's flake of 64e0249), it is still innocent.
        let actions = c.handle(secs(12.3), Event::Watch(vec![watched(1, Activity::WaitingForPeers, 11.3)]));
        assert!(abandoned(&actions).is_empty(), "{actions:?}");
        assert_eq!(c.drafter_state(1), Some(DrafterState::Live));
        // A round still stuck a whole budget after that is judged again (here the target copy holding the requests
        // since 0.2 s goes first, as below).
        let actions = c.handle(secs(22.5), Event::Watch(vec![watched(1, Activity::WaitingForPeers, 21.5)]));
        assert_eq!(abandoned(&actions), ["target 0"]);

        let mut c = running(2);
        c.config.supervision.step_timeout_s = 10.0;
        let waiting = vec![watched(0, Activity::WaitingForWork, 11.0), watched(1, Activity::WaitingForWork, 11.0)];
        let actions = c.handle(secs(12.0), Event::Watch(waiting));
        assert_eq!(abandoned(&actions), ["target 0"], "the copy holding the requests since 0.2 s");
        assert!(c.live().count() == 2, "its drafters are innocent");
        let actions = c.handle(secs(12.5), Event::Tick);
        assert!(actions.contains(&Action::StartTarget { target: 0, generation: 2 }), "{actions:?}");
        let actions = c.handle(secs(13.0), Event::TargetReady { target: 0, generation: 2 });
        let resent = actions.iter().filter(|a| matches!(a, Action::TargetRequest { generation: 2, .. })).count();
        assert!(resent > 0, "the undelivered requests go to the new thread: {actions:?}");
    }

    /// The budget follows the measured rounds: `hang_factor` x their p99, at least `hang_floor_s`.
    #[test]
    fn the_hang_budget_is_measured_from_the_rounds() {
        let mut c = running(1);
        (c.config.supervision.hang_factor, c.config.supervision.hang_floor_s) = (10.0, 2.0);
        assert_eq!(c.hang_budget(), secs(600.0), "step_timeout_s until measured");
        for step in 0..10 {
            c.handle(secs(1.0 + 0.5 * step as f64), Event::Round(report(step, c.incarnation)));
        }
        assert_eq!(c.hang_budget(), secs(5.0));
        let actions = c.handle(secs(7.0), Event::Watch(vec![watched(0, Activity::Computing, 5.5)]));
        assert_eq!(abandoned(&actions), ["drafter 0"], "a hang found in 5.5 s, not 600");
    }

    /// A one-drafter run of 2 steps (evaluating every `eval_every` steps) whose final checkpoint, of step 2, is
    /// being written.
    fn writing_the_final_checkpoint(eval_every: u64) -> Core {
        let mut s = setup(1);
        s.config.optim.max_steps = 2;
        s.config.eval.every_steps = eval_every;
        let mut c = Core::new(s);
        c.start(secs(0.0));
        c.handle(secs(0.1), Event::TargetReady { target: 0, generation: 1 });
        c.handle(secs(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        c.handle(secs(0.5), Event::Round(report(0, c.incarnation)));
        let actions = c.handle(secs(0.6), Event::Round(report(1, c.incarnation)));
        assert!(
            actions.contains(&Action::Tell { id: 0, generation: 1, order: Order::Checkpoint { at: 2 } }),
            "the final checkpoint, of the last step: {actions:?}"
        );
        let actions = c.handle(secs(0.7), Event::Snapshot { id: 0, generation: 1, step: 2, optimizer_steps: 2 });
        assert!(matches!(actions[..], [Action::WriteCheckpoint(_)]), "{actions:?}");
        c
    }

    /// Carries out the checkpoint `actions` asked drafter 0 for: the rounds up to its step, the snapshot, the write
    /// (at `at` seconds); what the written checkpoint leads to.
    fn write_the_checkpoint_asked_for(c: &mut Core, actions: &[Action], at: f64) -> Vec<Action> {
        let step = actions
            .iter()
            .find_map(|a| match a {
                Action::Tell { id: 0, order: Order::Checkpoint { at }, .. } => Some(*at),
                _ => None,
            })
            .expect("a checkpoint is asked for");
        for s in 0..step {
            c.handle(secs(at), Event::Round(report(s, c.incarnation)));
        }
        c.handle(secs(at), Event::Snapshot { id: 0, generation: 1, step, optimizer_steps: step });
        let written = written(step, c.incarnation, "ckpt", 0.1);
        c.handle(secs(at + 0.1), written)
    }

    /// `checkpoint.every_steps = 4` checkpoints boundary 4 itself, whatever is in flight when it falls due, and the
    /// evaluation due there takes that same checkpoint (no second one).
    #[test]
    fn a_periodic_checkpoint_is_of_the_boundary_its_setting_names() {
        let mut s = setup(1);
        (s.config.checkpoint.every_steps, s.config.eval.every_steps, s.config.supervision.prefetch_steps) = (4, 4, 3);
        let mut c = Core::new(s);
        c.start(secs(0.0));
        c.handle(secs(0.1), Event::TargetReady { target: 0, generation: 1 });
        let mut actions = c.handle(secs(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        for step in 0..4 {
            actions.extend(c.handle(secs(0.3 + 0.1 * step as f64), Event::Round(report(step, c.incarnation))));
        }
        let asked: Vec<u64> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Tell { order: Order::Checkpoint { at }, .. } => Some(*at),
                _ => None,
            })
            .collect();
        assert_eq!(asked, vec![4], "{actions:?}");
        assert_eq!(c.eval_due, Some(4));
        c.handle(secs(1.0), Event::Snapshot { id: 0, generation: 1, step: 4, optimizer_steps: 4 });
        let written = written(4, c.incarnation, "ckpt", 0.1);
        let actions = c.handle(secs(1.1), written);
        assert!(actions.iter().any(|a| matches!(a, Action::Evaluate { step: 4, .. })), "{actions:?}");
    }

    /// A stop before completion exits 143 (SIGTERM) or 130 (SIGINT) once its checkpoint is written, so that an
    /// orchestrator restarts it; 75 when the checkpoint is not written within `shutdown_timeout_s`.
    #[test]
    fn a_stop_before_completion_exits_with_the_signals_status_after_its_checkpoint() {
        for (signal, code) in [(StopSignal::Terminate, 143), (StopSignal::Interrupt, 130)] {
            let mut c = running(1);
            let actions = c.handle(secs(1.0), Event::Shutdown(signal));
            assert_eq!(write_the_checkpoint_asked_for(&mut c, &actions, 1.1).last(), Some(&Action::Exit { code }));
        }
        let mut c = running(1);
        c.handle(secs(1.0), Event::Shutdown(StopSignal::Terminate));
        let timeout = c.supervision().shutdown_timeout_s;
        assert!(!c.handle(secs(0.9 + timeout), Event::Tick).iter().any(|a| matches!(a, Action::Exit { .. })));
        let actions = c.handle(secs(1.0 + timeout), Event::Tick);
        assert_eq!(actions.last(), Some(&Action::Exit { code: EXIT_RESTART }), "to the second");
    }

    /// A signal while a complete run writes its final checkpoint does not make it a stop: it exports and exits 0.
    #[test]
    fn a_signal_during_the_final_checkpoint_still_exits_0() {
        let mut c = writing_the_final_checkpoint(0);
        c.handle(secs(0.75), Event::Shutdown(StopSignal::Terminate));
        let written = written(2, c.incarnation, "ckpt-2", 0.1);
        let actions = c.handle(secs(0.8), written);
        assert!(actions.iter().any(|a| matches!(a, Action::Export { .. })), "{actions:?}");
        let actions = c.handle(secs(0.9), Event::Exported(Ok("final".into())));
        assert_eq!(actions.last(), Some(&Action::Exit { code: EXIT_OK }));
    }

    /// A ledger write that fails makes the service not ready at once, a write that succeeds ready again; after
    /// `data.ledger_max_failures` failures in a row, counted at most one a second, the run checkpoints and exits 75.
    #[test]
    fn a_failing_ledger_is_not_ready_and_ends_the_run_after_failures_in_a_row() {
        let mut c = running(1);
        c.config.data.ledger_max_failures = 3;
        let failed = || Event::LedgerWritten(Err("ledger.jsonl: No space left on device".into()));
        let actions = c.handle(secs(1.0), failed());
        assert!(actions.contains(&Action::Notice(Notice::LedgerWrite { ok: false })));
        assert!(!c.ready(), "not ready after one failure");
        let status = c.status();
        assert!(status.problems[0].contains("No space left"), "{:?}", status.problems);
        assert_eq!((status.ledger.failures, status.ledger.failing_in_row), (1, 1));
        c.handle(secs(1.1), failed());
        c.handle(secs(1.2), Event::LedgerWritten(Ok(0)));
        assert!(c.ready() && c.status().problems.is_empty(), "the lines that failed were written after all");
        for at in [1.3, 1.4, 1.5, 1.9, 2.3, 2.5] {
            c.handle(secs(at), failed());
        }
        assert!(c.ending.is_none(), "six failures in a row, two of them a second apart (a line every step)");
        let actions = c.handle(secs(3.3), failed());
        assert!(c.ending.is_some(), "three a second apart");
        let last = write_the_checkpoint_asked_for(&mut c, &actions, 3.4);
        assert_eq!(last.last(), Some(&Action::Exit { code: EXIT_RESTART }), "after its checkpoint");
        assert_eq!(c.status().ledger.failures, 9);
    }

    /// No round committing for longer than the hang budget (the floor, before rounds are timed: 600 s here) is a
    /// problem and makes the host not ready, until a round commits.
    #[test]
    fn rounds_that_stop_committing_are_a_problem_until_one_commits() {
        let mut c = running(1);
        c.config.supervision.step_timeout_s = 40.0;
        c.handle(secs(30.0), Event::Tick);
        assert!(c.ready() && c.status().problems.is_empty(), "within the budget");
        c.handle(secs(41.0), Event::Tick);
        let problems = c.status().problems;
        assert!(!c.ready() && problems.iter().any(|p| p.starts_with("no step committed for 41 s")), "{problems:?}");
        c.progress_at = secs(41.5);
        c.handle(secs(42.0), Event::Tick);
        assert!(c.ready(), "progress again");
    }

    /// A checkpoint write busy past `shutdown_timeout_s` is reported (not ready, a notice, the status), each
    /// checkpoint falling due meanwhile is counted as skipped, and its answer clears it.
    #[test]
    fn a_stalled_checkpoint_writer_is_reported_and_skipped_checkpoints_counted() {
        let mut c = running(1);
        c.config.supervision.shutdown_timeout_s = 10.0;
        let (answer, _) = c.checkpoint_now(secs(1.0));
        let at = answer.unwrap();
        for step in 0..at {
            c.handle(secs(1.0), Event::Round(report(step, c.incarnation)));
        }
        let actions = c.handle(secs(1.1), Event::Snapshot { id: 0, generation: 1, step: at, optimizer_steps: at });
        assert!(matches!(actions[..], [Action::WriteCheckpoint(_)]), "{actions:?}");
        assert!(c.handle(secs(11.0), Event::Tick).is_empty() && c.ready(), "within the deadline");
        let actions = c.handle(secs(11.1), Event::Tick);
        assert!(actions.contains(&Action::Notice(Notice::WriterStalled(true))), "{actions:?}");
        let status = c.status();
        assert!(!status.ready && status.checkpoint_writer.stalled, "{:?}", status.checkpoint_writer);
        assert_eq!(status.checkpoint_writer.writing_step, Some(at));
        assert!(status.problems[0].contains(&format!("the checkpoint of step {at}")), "{:?}", status.problems);
        c.config.checkpoint.every_steps = 1;
        for step in at..at + 3 {
            let actions = c.handle(secs(12.0), Event::Round(report(step, c.incarnation)));
            assert!(actions.contains(&Action::Notice(Notice::CheckpointSkipped)), "step {step}: {actions:?}");
        }
        assert_eq!(c.status().checkpoint_writer.skipped, 3);
        let written = written(at, c.incarnation, "ckpt", 20.0);
        let actions = c.handle(secs(21.0), written);
        assert!(actions.contains(&Action::Notice(Notice::WriterStalled(false))), "{actions:?}");
        assert!(c.ready() && !c.status().checkpoint_writer.stalled);
    }

    /// A complete run whose final checkpoint cannot be written exits 1 and exports nothing (no `final/` from an
    /// older checkpoint).
    #[test]
    fn a_failed_final_checkpoint_exits_1_without_exporting() {
        let mut c = writing_the_final_checkpoint(0);
        let failed =
            Event::CheckpointWritten(Written { step: 2, incarnation: c.incarnation, result: Err("disk full".into()) });
        let actions = c.handle(secs(0.8), failed);
        assert!(actions.contains(&Action::Exit { code: EXIT_ERROR }), "{actions:?}");
        assert!(!actions.iter().any(|a| matches!(a, Action::Export { .. })), "nothing exported: {actions:?}");
    }

    /// With evaluation on, a complete run evaluates its final checkpoint before it exports and exits, so its end
    /// line is about what it hands over.
    #[test]
    fn a_complete_run_evaluates_its_final_checkpoint_before_the_end() {
        let mut c = writing_the_final_checkpoint(100);
        let written = written(2, c.incarnation, "ckpt-2", 0.1);
        let actions = c.handle(secs(0.8), written);
        assert!(
            actions.iter().any(|a| matches!(a, Action::Evaluate { step: 2, .. })),
            "the final checkpoint is evaluated: {actions:?}"
        );
        assert!(!actions.iter().any(|a| matches!(a, Action::Export { .. } | Action::Exit { .. })), "{actions:?}");
        assert!(c.handle(secs(1.0), Event::Tick).is_empty(), "waiting for it");
        let evaluated = Evaluated::lossless_at(2, 2.5);
        let actions = c.handle(secs(2.0), Event::Evaluated(Ok(evaluated)));
        assert!(actions.iter().any(|a| matches!(a, Action::Export { .. })), "{actions:?}");
        assert_eq!(c.last_evaluation.as_ref().map(|e| e.step), Some(2));
    }
}
