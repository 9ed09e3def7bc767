//! The supervisor: owns the target actors (one per `target.capture_devices` entry), one drafter actor per configured
//! device, the loader and its ledger, the collective, the checkpointer, the evaluator and the run's progress; applies
//! configuration reloads.
//!
//! Steps are assigned ahead (`prefetch_steps`): for each step every live drafter gets `accumulation` micro-batches
//! (or `Empty` when the data ran out), sent through the target copy that feeds it, which captures their features. A step is committed
//! when its round completes: the contributors' batches are consumed; a drafter that fails has its uncontributed
//! batches requeued. A failed drafter is restarted alone with backoff and an intensity limit, on a new thread that
//! copies a live peer's state; with no live peer the run rewinds to the newest valid checkpoint. Hung threads are
//! abandoned, never joined. Errors that poison a device end the service with a checkpoint and exit code 75.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tch::{Device, Kind};

use super::compute_thread::ComputeActor;
use super::compute_thread::ThreadFailure;
use super::drafter::{self, DrafterShared, DrafterSpawn, Phase, Start};
use super::evaluator::{EvalSpec, Evaluated, Evaluator, eval_prompts};
use super::failure::{Failure, FailureKind, FaultKind};
use super::messages::{
    CheckpointStatus, DrafterState, DrafterStatus, Heads, Reloaded, Status, SupervisorMsg, TargetStatus, ThreadMsg,
    Work,
};
use super::placement::assign_targets;
use super::reload::{Accepted, reread};
use super::target::{self, Route, Routes, TargetSpawn, TargetWork};
use crate::config::{CollectiveKind, Config, Layers, TargetSource};
use crate::data::dataset::Dataset;
use crate::data::loader::{Batch, BatchId, Loader, LoaderSettings};
use crate::data::prompts::Prompt;
use crate::device::{self, device_name};
use crate::model::{Drafter, DrafterConfig};
use crate::telemetry::logging::{self, LevelChange};
use crate::telemetry::{DeviceMemory, DrafterMetrics, GpuIdentity, RunMetrics, TargetMetrics};
use crate::train::checkpoint::{Checkpointer, DRAFTER_DIR, Snapshot, TrainerState, Written, newest_valid};
use crate::train::collective::{Collective, GradientSum, Hyper, ObjectiveKnobs, RoundReport, StepSettings};
use crate::train::decode_eval::DecodeSettings;
use crate::train::objective::{Metrics, ObjectiveSettings};
use crate::train::optim::LrSchedule;

/// Exit status asking an outside supervisor (systemd, Kubernetes) to restart with `--resume auto`.
pub const EXIT_RESTART: i32 = 75;

pub struct SupervisorArgs {
    pub config: Config,
    pub drafter_config: DrafterConfig,
    pub objective: ObjectiveSettings,
    pub target_source: TargetSource,
    pub taps: Vec<usize>,
    /// The configured target device (evaluation runs there).
    pub target_device: (Device, Kind),
    /// The devices of the target copies that capture features (`target.capture_devices`).
    pub capture_devices: Vec<(Device, Kind)>,
    pub drafter_devices: Vec<(Device, Kind)>,
    pub dataset: Arc<dyn Dataset>,
    pub resume: Option<(PathBuf, TrainerState)>,
    pub exit_code: Arc<Mutex<Option<i32>>>,
    /// Where the configuration came from, reread on a reload.
    pub layers: Layers,
    /// Metric labels of each target copy's device and of each drafter's.
    pub capture_identities: Vec<GpuIdentity>,
    pub drafter_identities: Vec<GpuIdentity>,
    /// Renders `/metrics`; kept here for its periodic upkeep.
    pub prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// The target's vocabulary and end-of-sequence ids (evaluation prompts and decoding).
    pub vocab_size: usize,
    pub eos_token_ids: Vec<i64>,
    /// The evaluation prompts, read once when evaluation is on (their keys cannot change while running).
    pub eval_prompts: Option<Vec<Prompt>>,
}

struct Slot {
    id: usize,
    device: Device,
    kind: Kind,
    state: DrafterState,
    generation: u64,
    actor: Option<ActorRef<ThreadMsg>>,
    input: Option<SyncSender<Work>>,
    restarts: VecDeque<Instant>,
    total_restarts: u64,
    step: u64,
    shared: Arc<DrafterShared>,
    /// Steps from which it is a member (after joining).
    member_from: Option<u64>,
    metrics: DrafterMetrics,
}

/// One copy of the target that captures features, and the requests it has not delivered yet.
struct TargetSlot {
    id: usize,
    device: Device,
    kind: Kind,
    generation: u64,
    handle: Option<(ActorRef<ThreadMsg>, SyncSender<TargetWork>)>,
    /// Requests sent and not yet reported delivered, in order (resent when it restarts).
    undelivered: VecDeque<(TargetWork, BatchId)>,
    ready: bool,
    ever_ready: bool,
    restarts: u64,
    metrics: TargetMetrics,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase0 {
    StartingTarget,
    StartingDrafters,
    Running,
    /// Finishing: waiting for a checkpoint, then exiting with this code.
    Stopping(i32),
}

struct Ending {
    code: i32,
    export: bool,
}

/// The members that must report checksums for a step, and what they reported.
type StepDigests = (Vec<usize>, BTreeMap<usize, [i64; 3]>);

pub struct Sup {
    a: SupervisorArgs,
    myself: ActorRef<SupervisorMsg>,
    phase: Phase0,
    routes: Arc<Routes>,
    collective: Arc<Collective>,
    checkpointer: Checkpointer,
    loader: Loader,
    loader_settings: LoaderSettings,
    lengths: Vec<usize>,
    heads: Option<Arc<Heads>>,
    targets: Vec<TargetSlot>,
    /// Drafter id -> the target copy that feeds it.
    feeds: Vec<usize>,
    slots: Vec<Slot>,
    /// step -> drafter -> its micro-batches (None: Empty)
    assigned: BTreeMap<u64, BTreeMap<usize, Vec<Option<BatchId>>>>,
    batches: HashMap<BatchId, Batch>,
    next_step: u64,
    committed_step: u64,
    samples_committed: u64,
    samples_requeued: u64,
    skipped_steps: u64,
    failures_per_batch: HashMap<BatchId, u32>,
    set_aside: Vec<BatchId>,
    /// Trainer states at recent step boundaries, for pairing with snapshots.
    states: BTreeMap<u64, TrainerState>,
    pending_snapshots: BTreeMap<u64, Snapshot>,
    checkpoint_in_flight: bool,
    /// The drafter asked for the snapshot of the checkpoint in flight, until it arrives.
    checkpoint_donor: Option<(usize, u64)>,
    /// step -> the members that must report checksums for it, and what they reported
    digests: BTreeMap<u64, StepDigests>,
    replicas_checked_step: Option<u64>,
    replicas_diverged: u64,
    ledger: Option<std::io::BufWriter<std::fs::File>>,
    last_checkpoint: Option<(Written, Instant)>,
    last_checkpoint_request: Instant,
    ending: Option<Ending>,
    gpu_hangs: HashMap<Device, usize>,
    window: Metrics,
    window_samples: u64,
    /// Seconds the drafters waited for features since the last progress line, summed over drafters.
    window_feature_wait_s: f64,
    window_started: Instant,
    last_lr: f64,
    /// Samples the learning-rate schedule spans.
    total_samples: u64,
    config_version: u64,
    run_metrics: RunMetrics,
    memory: Vec<(Device, DeviceMemory)>,
    last_telemetry: Instant,
    evaluator: Option<Evaluator>,
    /// An evaluation is due at the first checkpoint of this step or later.
    eval_due: Option<u64>,
    last_evaluation: Option<Evaluated>,
}

/// What a reload may change, from the configuration.
fn step_settings(cfg: &Config, total_samples: u64, gamma: Option<f64>) -> StepSettings {
    StepSettings {
        hyper: hyper(cfg, total_samples),
        objective: ObjectiveKnobs { num_anchors: cfg.objective.num_anchors, gamma },
    }
}

fn hyper(cfg: &Config, total_samples: u64) -> Hyper {
    let o = &cfg.optim;
    Hyper {
        schedule: LrSchedule {
            kind: o.schedule,
            lr: o.lr,
            warmup_steps: (o.warmup_ratio * total_samples as f64).round() as u64,
            total_steps: total_samples.max(1),
            min_lr_ratio: o.min_lr_ratio,
        },
        beta1: o.beta1,
        beta2: o.beta2,
        eps: o.eps,
        weight_decay: o.weight_decay,
        grad_clip: o.grad_clip,
    }
}

impl Sup {
    pub fn new(a: SupervisorArgs, myself: ActorRef<SupervisorMsg>) -> Self {
        let lengths = a.dataset.lengths();
        let loader_settings =
            LoaderSettings { batch_size: a.config.data.batch_size, seed: a.config.objective.seed, bucket_batches: 16 };
        let (step, samples, loader, set_aside) = match &a.resume {
            Some((_, s)) => (
                s.step,
                s.samples_committed,
                Loader::restore(lengths.clone(), loader_settings, s.loader.clone()),
                s.set_aside.clone(),
            ),
            None => (0, 0, Loader::new(lengths.clone(), loader_settings), vec![]),
        };
        let o = &a.config.optim;
        let per_step = (a.config.data.batch_size * o.accumulation * a.drafter_devices.len()) as u64;
        let mut total = lengths.len() as u64 * o.epochs;
        if o.max_steps > 0 {
            total = total.min(o.max_steps * per_step);
        }
        let me = myself.clone();
        let settings = step_settings(&a.config, total, a.objective.gamma);
        let sum = match a.config.drafters.collective {
            CollectiveKind::InProcess => GradientSum::DeviceCopies,
            CollectiveKind::Nccl => GradientSum::Nccl,
        };
        let collective = Arc::new(Collective::new(step, samples, settings, sum, move |r| {
            let _ = me.send_message(SupervisorMsg::Round(r));
        }));
        let me = myself.clone();
        let checkpointer = Checkpointer::start(a.config.checkpoint.dir.clone(), a.config.checkpoint.keep, move |r| {
            let _ = me.send_message(SupervisorMsg::CheckpointWritten(r));
        });
        let slots = a
            .drafter_devices
            .iter()
            .enumerate()
            .map(|(id, &(device, kind))| Slot {
                id,
                device,
                kind,
                state: DrafterState::Starting,
                generation: 0,
                actor: None,
                input: None,
                restarts: VecDeque::new(),
                total_restarts: 0,
                step,
                shared: Arc::new(DrafterShared::default()),
                member_from: None,
                metrics: DrafterMetrics::new(id, &a.drafter_identities[id]),
            })
            .collect();
        let targets: Vec<TargetSlot> = a
            .capture_devices
            .iter()
            .zip(&a.capture_identities)
            .enumerate()
            .map(|(id, (&(device, kind), identity))| TargetSlot {
                id,
                device,
                kind,
                generation: 0,
                handle: None,
                undelivered: VecDeque::new(),
                ready: false,
                ever_ready: false,
                restarts: 0,
                metrics: TargetMetrics::new(identity),
            })
            .collect();
        let drafter_devices: Vec<Device> = a.drafter_devices.iter().map(|(d, _)| *d).collect();
        let feeds = assign_targets(&drafter_devices, &targets.iter().map(|t| t.device).collect::<Vec<_>>());
        let mut memory: Vec<(Device, DeviceMemory)> = Vec::new();
        let devices = a
            .capture_devices
            .iter()
            .map(|(d, _)| *d)
            .zip(&a.capture_identities)
            .chain(drafter_devices.iter().copied().zip(&a.drafter_identities));
        for (device, identity) in devices {
            if !memory.iter().any(|(d, _)| *d == device) {
                memory.push((device, DeviceMemory::new(identity)));
            }
        }
        let mut states = BTreeMap::new();
        let mut initial = TrainerState::new(step, loader.state(), a.config.merged.clone());
        initial.samples_committed = samples;
        initial.set_aside = set_aside.clone();
        if let Some((_, s)) = &a.resume {
            initial.optimizer_steps = s.optimizer_steps;
            initial.skipped_steps = s.skipped_steps;
            initial.lr = s.lr;
        }
        states.insert(step, initial);
        Sup {
            myself,
            phase: Phase0::StartingTarget,
            routes: Arc::new(Routes::default()),
            collective,
            checkpointer,
            loader,
            loader_settings,
            lengths,
            heads: None,
            targets,
            feeds,
            slots,
            assigned: BTreeMap::new(),
            batches: HashMap::new(),
            next_step: step,
            committed_step: step,
            samples_committed: samples,
            samples_requeued: 0,
            skipped_steps: a.resume.as_ref().map_or(0, |(_, s)| s.skipped_steps),
            failures_per_batch: HashMap::new(),
            set_aside,
            states,
            pending_snapshots: BTreeMap::new(),
            checkpoint_in_flight: false,
            checkpoint_donor: None,
            digests: BTreeMap::new(),
            replicas_checked_step: None,
            replicas_diverged: 0,
            ledger: a.config.data.ledger.as_ref().and_then(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| tracing::error!(path = %p.display(), "cannot open data.ledger: {e}"))
                    .ok()
                    .map(std::io::BufWriter::new)
            }),
            last_checkpoint: None,
            last_checkpoint_request: Instant::now(),
            ending: None,
            gpu_hangs: HashMap::new(),
            window: Metrics::default(),
            window_samples: 0,
            window_feature_wait_s: 0.0,
            window_started: Instant::now(),
            last_lr: 0.0,
            total_samples: total,
            config_version: 1,
            run_metrics: RunMetrics::new(step, samples),
            memory,
            last_telemetry: Instant::now(),
            evaluator: None,
            eval_due: None,
            last_evaluation: None,
            a,
        }
    }

    /// The drafters' state series and the live count.
    fn publish_states(&self) {
        for s in &self.slots {
            let name = match s.state {
                DrafterState::Starting => "starting",
                DrafterState::Joining => "joining",
                DrafterState::Live => "live",
                DrafterState::Restarting => "restarting",
                DrafterState::Failed => "failed",
            };
            DrafterMetrics::set_state(s.id, name);
        }
        self.run_metrics.drafters_live.set(self.live_members().len() as f64);
    }

    // ------------------------------------------------------------------ target

    async fn start_target(&mut self, id: usize) -> Result<(), ActorProcessingErr> {
        let feeds = self.feeds.iter().filter(|&&t| t == id).count().max(1);
        let cap = 64 + feeds * self.a.config.supervision.prefetch_steps * self.a.config.optim.accumulation * 2;
        let (tx, rx) = sync_channel(cap);
        let t = &mut self.targets[id];
        t.generation += 1;
        t.ready = false;
        let spawn = TargetSpawn {
            id,
            generation: t.generation,
            source: self.a.target_source.clone(),
            taps: self.a.taps.clone(),
            device: t.device,
            kind: t.kind,
            dataset: self.a.dataset.clone(),
            routes: self.routes.clone(),
            supervisor: self.myself.clone(),
            requests: rx,
            metrics: t.metrics.clone(),
        };
        let name = format!("target-{id}-{}", t.generation);
        let (actor, _) =
            Actor::spawn_linked(Some(name), ComputeActor, target::thread(spawn), self.myself.get_cell()).await?;
        self.targets[id].handle = Some((actor, tx));
        Ok(())
    }

    /// Returns the next target copy to start: copies start one at a time, each once the one before is ready, as
    /// drafters do (random preset weights are drawn from the reseeded generators, and loads do not pile up).
    fn on_target_ready(&mut self, id: usize, generation: u64, heads: Arc<Heads>) -> Option<usize> {
        let t = &mut self.targets[id];
        if generation != t.generation {
            return None;
        }
        t.ready = true;
        if !t.ever_ready {
            t.ever_ready = true;
            let fed: Vec<usize> = (0..self.feeds.len()).filter(|&d| self.feeds[d] == id).collect();
            tracing::info!(target = %self.a.target_source, id, device = %device_name(t.device), drafters = ?fed, "target ready");
            self.heads.get_or_insert(heads);
            if self.phase == Phase0::StartingTarget && self.targets.iter().all(|t| t.ready) {
                self.phase = Phase0::StartingDrafters;
                self.start_next_drafter();
            }
            return self.targets.iter().position(|t| t.generation == 0);
        }
        tracing::info!(id, "target restarted; resending {} requests", t.undelivered.len());
        let pending: Vec<TargetWork> = t.undelivered.iter().map(|(w, _)| clone_work(w)).collect();
        if let Some((_, tx)) = &t.handle {
            for w in pending {
                let _ = tx.send(w);
            }
        }
        None
    }

    fn on_delivered(&mut self, id: usize, generation: u64, batch: BatchId) {
        let t = &mut self.targets[id];
        if generation == t.generation && t.undelivered.front().is_some_and(|(_, b)| *b == batch) {
            t.undelivered.pop_front();
        }
    }

    /// A target copy failed: restart it after the initial backoff (or end, for a poisoned device).
    fn target_failed(&mut self, id: usize, generation: u64, failure: Failure) {
        let t = &mut self.targets[id];
        if generation != t.generation {
            return;
        }
        tracing::warn!(id, device = %device_name(t.device), kind = ?failure.kind, "target failed: {}; restarting it", failure.message);
        t.handle = None;
        t.ready = false;
        t.restarts += 1;
        if !failure.restartable() {
            self.ending = Some(Ending { code: EXIT_RESTART, export: false });
            self.request_checkpoint("emergency");
            self.end_if_idle();
        } else {
            let me = self.myself.clone();
            let delay = self.a.config.supervision.backoff_initial_ms;
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let _ = me.send_message(SupervisorMsg::RestartTarget { target: id });
            });
        }
    }

    // ------------------------------------------------------------------ drafters

    fn spawn_drafter(&mut self, id: usize, start: Start) {
        let Some(heads) = self.heads.clone() else {
            return;
        };
        let s = &mut self.slots[id];
        s.generation += 1;
        s.member_from = None;
        s.state = match start {
            Start::Join => DrafterState::Joining,
            Start::Found(_) => DrafterState::Starting,
        };
        *s.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) = Phase::Idle;
        let cap = 8 + self.a.config.supervision.prefetch_steps * self.a.config.optim.accumulation * 2;
        let (tx, rx) = sync_channel(cap);
        s.metrics.feature_queue.set(0.0);
        let route = Route {
            generation: s.generation,
            sender: tx.clone(),
            device: s.device,
            kind: s.kind,
            queued: s.metrics.feature_queue.clone(),
        };
        self.routes.set(id, route);
        s.input = Some(tx);
        let spawn = DrafterSpawn {
            id,
            generation: s.generation,
            device: s.device,
            kind: s.kind,
            config: self.a.drafter_config.clone(),
            objective: self.a.objective.clone(),
            seed: self.a.config.objective.seed,
            accumulation: self.a.config.optim.accumulation,
            check_every: self.a.config.supervision.check_replicas_every,
            start,
            heads,
            collective: self.collective.clone(),
            supervisor: self.myself.clone(),
            input: rx,
            shared: s.shared.clone(),
            metrics: s.metrics.clone(),
            peak_tflops: self.a.config.drafters.peak_tflops,
            collective_timeout: self.a.config.drafters.collective_timeout,
        };
        // The actor's handle arrives with its ActorStarted supervision event.
        let name = format!("drafter-{id}-{}", s.generation);
        self.publish_states();
        let cell = self.myself.get_cell();
        tokio::spawn(async move {
            if let Err(e) = Actor::spawn_linked(Some(name), ComputeActor, drafter::thread(spawn), cell).await {
                tracing::error!(drafter = id, "could not start the drafter actor: {e}");
            }
        });
    }

    /// During start-up drafters start one at a time: the first founds the collective, the others join.
    fn start_next_drafter(&mut self) {
        let next = self.slots.iter().find(|s| s.state == DrafterState::Starting && s.generation == 0).map(|s| s.id);
        match next {
            Some(id) => {
                let start = if self.collective.members().is_empty()
                    && !self.slots.iter().any(|s| s.generation > 0 && s.state != DrafterState::Failed)
                {
                    Start::Found(self.a.resume.as_ref().map(|(p, _)| p.clone()))
                } else {
                    Start::Join
                };
                self.spawn_drafter(id, start);
            }
            None => {
                if self.phase == Phase0::StartingDrafters {
                    self.phase = Phase0::Running;
                    tracing::info!(
                        drafters = self.slots.len(),
                        step = self.committed_step,
                        samples = self.lengths.len(),
                        "training"
                    );
                    self.top_up();
                }
            }
        }
    }

    fn donor(&self) -> Option<usize> {
        self.collective.members().first().copied()
    }

    fn send_work(&self, id: usize, work: Work) {
        let s = &self.slots[id];
        if !self.routes.send(id, s.generation, work) {
            tracing::debug!(drafter = id, "work for a drafter thread that is gone");
        }
    }

    fn on_ready(&mut self, id: usize, generation: u64) {
        if self.slots[id].generation != generation {
            return;
        }
        tracing::info!(drafter = id, device = %device_name(self.slots[id].device), generation, "drafter ready");
        if self.slots[id].state == DrafterState::Joining
            && let Some(donor) = self.donor()
        {
            self.send_work(donor, Work::ServeJoiners);
        }
    }

    fn on_joined(&mut self, id: usize, generation: u64, step: u64) {
        if self.slots[id].generation != generation {
            return;
        }
        let s = &mut self.slots[id];
        s.state = DrafterState::Live;
        s.step = step;
        s.member_from = Some(step);
        tracing::info!(drafter = id, step, "drafter live");
        self.publish_states();
        match self.phase {
            Phase0::StartingDrafters => self.start_next_drafter(),
            Phase0::Running => {
                // It is a member from `step`: give it micro-batches for every step already assigned from there.
                let steps: Vec<u64> = self.assigned.range(step..).map(|(s, _)| *s).collect();
                for st in steps {
                    self.assign_to(st, id);
                }
                self.top_up();
            }
            _ => {}
        }
    }

    // ------------------------------------------------------------------ steps

    fn live_members(&self) -> Vec<usize> {
        self.slots.iter().filter(|s| s.state == DrafterState::Live).map(|s| s.id).collect()
    }

    fn data_left(&self) -> bool {
        let o = &self.a.config.optim;
        if o.max_steps > 0 && self.next_step >= o.max_steps {
            return false;
        }
        self.loader.next_epoch().is_some_and(|e| e < o.epochs)
    }

    /// Assigns steps ahead until `prefetch_steps` are in flight.
    fn top_up(&mut self) {
        if self.phase != Phase0::Running || self.ending.is_some() {
            return;
        }
        while self.assigned.len() < self.a.config.supervision.prefetch_steps && self.data_left() {
            let step = self.next_step;
            self.next_step += 1;
            self.assigned.insert(step, BTreeMap::new());
            for id in self.live_members() {
                self.assign_to(step, id);
            }
        }
        if self.assigned.is_empty() && !self.data_left() {
            self.finish_run();
        }
    }

    /// Gives drafter `id` its micro-batches of `step`, through the target.
    fn assign_to(&mut self, step: u64, id: usize) {
        let generation = self.slots[id].generation;
        let mut items = Vec::new();
        for _ in 0..self.a.config.optim.accumulation {
            let batch = if self.data_left_for_batch() { self.loader.next_batch() } else { None };
            match batch {
                Some(b) => {
                    let work =
                        TargetWork::Capture { drafter: id, generation, batch: b.id, positions: b.samples.clone() };
                    items.push(Some(b.id));
                    self.send_target(id, work, b.id);
                    self.batches.insert(b.id, b);
                }
                None => {
                    items.push(None);
                    if let Some((_, tx)) = &self.targets[self.feeds[id]].handle {
                        let _ = tx.send(TargetWork::Empty { drafter: id, generation });
                    }
                }
            }
        }
        if let Some(step_map) = self.assigned.get_mut(&step) {
            step_map.insert(id, items);
        }
    }

    fn data_left_for_batch(&self) -> bool {
        self.loader.next_epoch().is_some_and(|e| e < self.a.config.optim.epochs)
    }

    /// Sends drafter `drafter`'s capture request to the target copy that feeds it.
    fn send_target(&mut self, drafter: usize, work: TargetWork, batch: BatchId) {
        let t = &mut self.targets[self.feeds[drafter]];
        if let Some((_, tx)) = &t.handle {
            let _ = tx.send(clone_work(&work));
        }
        t.undelivered.push_back((work, batch));
    }

    fn on_round(&mut self, r: RoundReport) {
        let Some(step_map) = self.assigned.remove(&r.step) else {
            return;
        };
        let mut metrics = Metrics::default();
        let mut tokens = 0;
        for (_, batches, m, samples) in &r.contributions {
            for b in batches {
                self.loader.commit(*b);
                if let Some(batch) = self.batches.remove(b) {
                    tokens += batch.samples.iter().map(|&p| self.lengths[p] as u64).sum::<u64>();
                    self.write_ledger(r.step, &batch);
                }
            }
            metrics.add(m);
            self.window_samples += samples;
        }
        let every = self.a.config.supervision.check_replicas_every;
        if every > 0 && (r.step + 1).is_multiple_of(every) {
            let members = r.contributions.iter().map(|(m, ..)| *m).collect();
            self.digests.entry(r.step + 1).or_insert_with(|| (vec![], BTreeMap::new())).0 = members;
            self.compare_digests(r.step + 1);
        }
        // Members of this step that did not contribute had their batches requeued when they failed.
        let _ = step_map;
        self.window.add(&metrics);
        let m = &self.run_metrics;
        m.committed_samples.increment(r.samples_committed.saturating_sub(self.samples_committed));
        m.committed_tokens.increment(tokens);
        m.committed_steps.increment(1);
        m.step.set((r.step + 1) as f64);
        m.last_step_timestamp.set(crate::telemetry::unix_now());
        if metrics.weight > 0.0 {
            m.loss.set(metrics.loss());
            m.accuracy.set(metrics.accuracy());
            m.acceptance_length.set(metrics.acceptance_length());
        }
        self.samples_committed = r.samples_committed;
        self.committed_step = r.step + 1;
        self.last_lr = r.lr;
        if !r.total_weight.is_finite() {
            self.skipped_steps += 1;
            self.run_metrics.skipped_steps.increment(1);
        }
        let mut state = TrainerState::new(self.committed_step, self.loader.state(), self.a.config.merged.clone());
        state.samples_committed = self.samples_committed;
        state.skipped_steps = self.skipped_steps;
        state.set_aside = self.set_aside.clone();
        state.lr = r.lr;
        self.states.insert(self.committed_step, state);
        while self.states.len() > 64 {
            self.states.pop_first();
        }
        self.pair_snapshots();
        if self.committed_step.is_multiple_of(self.a.config.log.every_steps) {
            self.log_progress();
        }
        let every = self.a.config.checkpoint.every_steps;
        if every > 0 && self.committed_step.is_multiple_of(every) {
            self.request_checkpoint("periodic");
        }
        let every = self.a.config.eval.every_steps;
        if every > 0 && self.committed_step.is_multiple_of(every) && self.eval_due.is_none() {
            // One due evaluation at a time: a slow checkpoint or evaluation makes later ones wait, not pile up.
            self.eval_due = Some(self.committed_step);
            self.request_checkpoint("evaluation");
        }
        self.top_up();
    }

    fn write_ledger(&mut self, step: u64, batch: &Batch) {
        let Some(w) = self.ledger.as_mut() else { return };
        let ids: Vec<u64> = batch.samples.iter().map(|&p| self.a.dataset.row(p).id).collect();
        let line = serde_json::json!({"step": step, "epoch": batch.id.epoch, "batch": batch.id.ordinal, "ids": ids});
        use std::io::Write;
        let _ = writeln!(w, "{line}").and_then(|()| w.flush());
    }

    fn on_digest(&mut self, id: usize, step: u64, digest: [i64; 3]) {
        self.digests.entry(step).or_insert_with(|| (vec![], BTreeMap::new())).1.insert(id, digest);
        self.compare_digests(step);
    }

    /// Once every member of a step reported its checksums, they must agree.
    fn compare_digests(&mut self, step: u64) {
        let Some((members, seen)) = self.digests.get(&step) else { return };
        if members.is_empty() || !members.iter().all(|m| seen.contains_key(m)) {
            return;
        }
        let first = seen[&members[0]];
        if members.iter().all(|m| seen[m] == first) {
            self.replicas_checked_step = Some(step);
        } else {
            self.replicas_diverged += 1;
            self.run_metrics.replica_divergences.increment(1);
            tracing::error!(step, checksums = ?seen, "replicas diverged: their parameters or optimizer states differ");
        }
        self.digests.retain(|s, _| *s > step);
    }

    fn log_progress(&mut self) {
        let elapsed = self.window_started.elapsed().as_secs_f64().max(1e-9);
        let live = self.live_members().len();
        tracing::info!(
            "step {} · epoch {} · loss {:.4} · accuracy {:.3} · acceptance {:.2} · {:.1} samples/s · feature wait {:.1}% · \
             lr {:.2e} · drafters {}/{} live",
            self.committed_step,
            self.loader.epoch(),
            self.window.loss(),
            self.window.accuracy(),
            self.window.acceptance_length(),
            self.window_samples as f64 / elapsed,
            100.0 * self.window_feature_wait_s / (elapsed * live.max(1) as f64),
            self.last_lr,
            live,
            self.slots.len()
        );
        self.window = Metrics::default();
        self.window_samples = 0;
        self.window_feature_wait_s = 0.0;
        self.window_started = Instant::now();
    }

    fn finish_run(&mut self) {
        if self.ending.is_some() {
            return;
        }
        tracing::info!(step = self.committed_step, "run complete: final checkpoint and export");
        self.ending = Some(Ending { code: 0, export: true });
        self.request_checkpoint("final");
        self.end_if_idle();
    }

    // ------------------------------------------------------------------ failures

    fn failed(&mut self, id: usize, generation: u64, failure: Failure) {
        if self.slots[id].generation != generation
            || matches!(self.slots[id].state, DrafterState::Failed | DrafterState::Restarting)
        {
            return;
        }
        tracing::warn!(drafter = id, generation, kind = ?failure.kind, "drafter failed: {}", failure.message);
        let running = match std::mem::take(&mut *self.slots[id].shared.phase.lock().unwrap_or_else(|p| p.into_inner()))
        {
            Phase::Computing { batches, .. } => batches,
            Phase::Idle => vec![],
        };
        self.slots[id].shared.abandoned.fetch_max(generation, std::sync::atomic::Ordering::SeqCst);
        let (open_round, missing) = self.collective.waiting_for();
        let contributed_open = !missing.contains(&id);
        self.collective.remove(id, generation);
        self.routes.remove(id);
        if self.checkpoint_donor == Some((id, generation)) {
            // The snapshot will never come: ask another replica.
            self.checkpoint_in_flight = false;
            self.checkpoint_donor = None;
            self.request_checkpoint("retry after the donor failed");
        }
        if let Some(actor) = self.slots[id].actor.take() {
            actor.stop(None);
        }
        self.slots[id].input = None;
        // Its batches that no round took: requeue (or set aside after a second failure).
        let mut owed: Vec<BatchId> = Vec::new();
        for (step, map) in self.assigned.iter_mut() {
            // Rounds before the open one are complete (their reports may still be on the way): those batches were
            // trained. The open round keeps what it already took.
            if *step < open_round || (*step == open_round && contributed_open) {
                continue;
            }
            if let Some(items) = map.remove(&id) {
                owed.extend(items.into_iter().flatten());
            }
        }
        let injected = self.slots[id].shared.injected.swap(false, std::sync::atomic::Ordering::SeqCst);
        for b in owed {
            let failures = if running.contains(&b) && !injected {
                let n = self.failures_per_batch.entry(b).or_insert(0);
                *n += 1;
                *n
            } else {
                0
            };
            if failures >= 2 {
                let ids: Vec<u64> = self
                    .batches
                    .get(&b)
                    .map(|x| x.samples.iter().map(|&p| self.a.dataset.row(p).id).collect())
                    .unwrap_or_default();
                tracing::error!(?b, sample_ids = ?ids, "batch failed twice: set aside");
                self.loader.commit(b);
                self.set_aside.push(b);
            } else {
                let n = self.batches.get(&b).map_or(0, |x| x.samples.len() as u64);
                self.samples_requeued += n;
                self.run_metrics.samples_requeued.increment(n);
                self.loader.requeue(b);
            }
        }
        if !failure.restartable() {
            self.emergency(id);
            self.publish_states();
            return;
        }
        // Intensity: at most max_restarts within the window.
        let sup = &self.a.config.supervision;
        let window = Duration::from_secs_f64(sup.restart_window_s);
        let s = &mut self.slots[id];
        while s.restarts.front().is_some_and(|t| t.elapsed() > window) {
            s.restarts.pop_front();
        }
        let hang_limited = failure.kind == FailureKind::Hang
            && self.gpu_hangs.get(&s.device).copied().unwrap_or(0) >= sup.gpu_hang_limit;
        if s.restarts.len() >= sup.max_restarts || hang_limited {
            s.state = DrafterState::Failed;
            tracing::error!(
                drafter = id,
                restarts = s.total_restarts,
                "drafter marked failed; training continues without it"
            );
        } else {
            s.state = DrafterState::Restarting;
            let delay = sup.backoff_initial_ms.saturating_mul(1 << s.restarts.len().min(16)).min(sup.backoff_max_ms);
            s.restarts.push_back(Instant::now());
            s.total_restarts += 1;
            DrafterMetrics::restarted(id);
            let me = self.myself.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let _ = me.send_message(SupervisorMsg::RestartDrafter { id });
            });
        }
        self.publish_states();
        let alive = self.slots.iter().filter(|s| s.state != DrafterState::Failed).count();
        if alive < sup.min_live_drafters {
            tracing::error!(
                alive,
                min = sup.min_live_drafters,
                "below supervision.min_live_drafters: checkpointing and stopping"
            );
            self.ending.get_or_insert(Ending { code: 1, export: false });
            self.request_checkpoint("too few drafters");
            self.end_if_idle();
        }
        self.top_up();
    }

    /// A device or the process cannot be trusted: checkpoint from a healthy replica if any, then exit.
    fn emergency(&mut self, failed: usize) {
        tracing::error!(
            drafter = failed,
            "an error poisoned a device: checkpointing from a healthy replica and exiting for a restart with --resume auto"
        );
        self.slots[failed].state = DrafterState::Failed;
        self.ending = Some(Ending { code: EXIT_RESTART, export: false });
        self.request_checkpoint("emergency");
        self.end_if_idle();
    }

    fn restart(&mut self, id: usize) {
        if self.slots[id].state != DrafterState::Restarting || self.ending.is_some() {
            return;
        }
        if self.collective.members().is_empty() {
            self.rewind();
            let start = Start::Found(self.a.resume.as_ref().map(|(p, _)| p.clone()));
            self.spawn_drafter(id, start);
        } else {
            self.spawn_drafter(id, Start::Join);
        }
    }

    /// No live replica is left: the run continues from the newest valid checkpoint (or the start).
    fn rewind(&mut self) {
        let (found, rejected) = newest_valid(&self.a.config.checkpoint.dir);
        for r in rejected {
            tracing::warn!("checkpoint rejected: {r}");
        }
        self.assigned.clear();
        for t in &mut self.targets {
            t.undelivered.clear();
        }
        self.pending_snapshots.clear();
        self.checkpoint_in_flight = false;
        match found {
            Some((path, state)) => {
                tracing::warn!(step = state.step, path = %path.display(), "no live drafter: rewinding the run to the newest checkpoint");
                self.loader = Loader::restore(self.lengths.clone(), self.loader_settings, state.loader.clone());
                self.committed_step = state.step;
                self.samples_committed = state.samples_committed;
                self.set_aside = state.set_aside.clone();
                self.states.clear();
                self.states.insert(state.step, state.clone());
                self.a.resume = Some((path, state));
            }
            None => {
                tracing::warn!("no live drafter and no checkpoint: restarting the run from the beginning");
                self.loader = Loader::new(self.lengths.clone(), self.loader_settings);
                self.committed_step = 0;
                self.samples_committed = 0;
                self.set_aside.clear();
                self.states.clear();
                self.states.insert(0, TrainerState::new(0, self.loader.state(), self.a.config.merged.clone()));
                self.a.resume = None;
            }
        }
        self.next_step = self.committed_step;
        self.collective.rewind(self.committed_step, self.samples_committed);
        if let Some(w) = self.ledger.as_mut() {
            // Entries of later steps were undone with the model.
            use std::io::Write;
            let _ =
                writeln!(w, "{}", serde_json::json!({"rewind_to_step": self.committed_step})).and_then(|()| w.flush());
        }
    }

    fn tick(&mut self) {
        let timeout = Duration::from_secs_f64(self.a.config.supervision.step_timeout_s);
        let hung: Vec<(usize, u64)> = self
            .slots
            .iter()
            .filter(|s| s.state == DrafterState::Live)
            .filter_map(|s| match &*s.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) {
                Phase::Computing { generation, since, .. }
                    if *generation == s.generation && since.elapsed() > timeout =>
                {
                    Some((s.id, *generation))
                }
                _ => None,
            })
            .collect();
        for (id, generation) in hung {
            let dev = self.slots[id].device;
            if !self.slots[id].shared.injected.load(std::sync::atomic::Ordering::SeqCst) {
                *self.gpu_hangs.entry(dev).or_insert(0) += 1;
            }
            let held = device::memory_stats(dev).map(|m| m.allocated).unwrap_or(0);
            tracing::error!(drafter = id, device = %device_name(dev), held_bytes = held, "drafter hung: abandoning its thread (memory it holds stays allocated)");
            self.failed(
                id,
                generation,
                Failure { kind: FailureKind::Hang, message: format!("no progress for {:.0} s", timeout.as_secs_f64()) },
            );
        }
        let every = self.a.config.checkpoint.every_seconds;
        if every > 0.0 && self.phase == Phase0::Running && self.last_checkpoint_request.elapsed().as_secs_f64() >= every
        {
            self.request_checkpoint("periodic (time)");
        }
        if self.last_telemetry.elapsed() >= Duration::from_secs(1) {
            self.last_telemetry = Instant::now();
            for (device, gauges) in &self.memory {
                if let Ok(m) = device::memory_stats(*device) {
                    gauges.allocated.set(m.allocated as f64);
                    gauges.reserved.set(m.reserved as f64);
                }
            }
            if let Some(h) = &self.a.prometheus {
                h.run_upkeep();
            }
        }
    }

    // ------------------------------------------------------------------ checkpoints

    fn request_checkpoint(&mut self, reason: &str) -> Option<usize> {
        self.last_checkpoint_request = Instant::now();
        if self.checkpoint_in_flight {
            return None;
        }
        let donor = self.donor()?;
        tracing::debug!(reason, drafter = donor, "checkpoint requested");
        self.checkpoint_in_flight = true;
        self.checkpoint_donor = Some((donor, self.slots[donor].generation));
        self.send_work(donor, Work::Checkpoint);
        Some(donor)
    }

    fn on_snapshot(&mut self, id: usize, generation: u64, snapshot: Snapshot) {
        if self.slots[id].generation != generation {
            return;
        }
        self.checkpoint_donor = None;
        self.pending_snapshots.insert(snapshot.step, snapshot);
        self.pair_snapshots();
    }

    /// Writes each snapshot whose step boundary's trainer state is known.
    fn pair_snapshots(&mut self) {
        let ready: Vec<u64> = self.pending_snapshots.keys().filter(|s| self.states.contains_key(s)).copied().collect();
        for step in ready {
            let snapshot = self.pending_snapshots.remove(&step).expect("listed");
            let mut state = self.states[&step].clone();
            state.optimizer_steps = snapshot.optimizer_steps;
            self.checkpointer.write(snapshot, state);
        }
    }

    fn on_written(&mut self, result: Result<Written, String>) {
        self.checkpoint_in_flight = false;
        match result {
            Ok(w) => {
                tracing::info!(step = w.step, path = %w.path.display(), seconds = format!("{:.2}", w.seconds), "checkpoint written");
                self.run_metrics.checkpoint(Some((w.step, w.seconds)));
                self.evaluate_if_due(w.step, &w.path);
                self.last_checkpoint = Some((w, Instant::now()));
            }
            Err(e) => {
                self.run_metrics.checkpoint(None);
                tracing::error!("checkpoint failed: {e}");
            }
        }
        self.end_if_idle();
    }

    /// Ends the service once the checkpoint it waits for is written.
    fn end_if_idle(&mut self) {
        let Some(ending) = &self.ending else { return };
        if self.checkpoint_in_flight {
            return;
        }
        let code = ending.code;
        if ending.export
            && let Some((w, _)) = &self.last_checkpoint
        {
            let out = self.a.config.checkpoint.dir.join("final");
            let exported = crate::panic::catch_torch(|| {
                Drafter::load(&w.path.join(DRAFTER_DIR), Device::Cpu, Kind::Float)
                    .and_then(|d| d.save(&out, Kind::BFloat16))
            });
            match exported {
                Ok(Ok(())) => {
                    tracing::info!(path = %out.display(), "exported the drafter (bf16, published format)")
                }
                Ok(Err(e)) => tracing::error!("export failed: {e}"),
                Err(e) => tracing::error!("export failed: {e}"),
            }
        }
        for s in &self.slots {
            if let Some(tx) = &s.input {
                let _ = tx.try_send(Work::Stop);
            }
        }
        *self.a.exit_code.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
        self.phase = Phase0::Stopping(code);
        self.myself.stop(Some(format!("exit {code}")));
    }

    fn status(&self) -> Status {
        Status {
            phase: match self.phase {
                Phase0::StartingTarget => "starting target".into(),
                Phase0::StartingDrafters => "starting drafters".into(),
                Phase0::Running if self.ending.is_some() => "stopping".into(),
                Phase0::Running => "running".into(),
                Phase0::Stopping(c) => format!("stopped ({c})"),
            },
            step: self.committed_step,
            epoch: self.loader.epoch(),
            samples_committed: self.samples_committed,
            samples_requeued: self.samples_requeued,
            batches_set_aside: self.set_aside.len() as u64,
            skipped_steps: self.skipped_steps,
            replicas_checked_step: self.replicas_checked_step,
            replicas_diverged: self.replicas_diverged,
            config_version: self.config_version,
            drafters: self
                .slots
                .iter()
                .map(|s| DrafterStatus {
                    id: s.id,
                    device: device_name(s.device),
                    state: s.state,
                    step: s.step,
                    restarts: s.total_restarts,
                })
                .collect(),
            last_checkpoint: self.last_checkpoint.as_ref().map(|(w, at)| CheckpointStatus {
                step: w.step,
                path: w.path.display().to_string(),
                age_s: at.elapsed().as_secs_f64(),
            }),
            targets: self
                .targets
                .iter()
                .map(|t| TargetStatus {
                    id: t.id,
                    device: device_name(t.device),
                    ready: t.ready,
                    restarts: t.restarts,
                    drafters: (0..self.feeds.len()).filter(|&d| self.feeds[d] == t.id).collect(),
                })
                .collect(),
            last_evaluation: self.last_evaluation.clone(),
        }
    }

    // ------------------------------------------------------------------ evaluation

    /// Hands checkpoint `path` of `step` to the evaluator when an evaluation is due at or before `step` (starting the
    /// evaluator the first time).
    fn evaluate_if_due(&mut self, step: u64, path: &std::path::Path) {
        let Some(due) = self.eval_due else { return };
        if step < due {
            // An older checkpoint was in flight when the evaluation came due.
            self.request_checkpoint("evaluation");
            return;
        }
        self.eval_due = None;
        if self.evaluator.is_none() {
            match self.start_evaluator() {
                Ok(e) => self.evaluator = Some(e),
                Err(e) => {
                    tracing::error!("evaluation unavailable: {e:#}");
                    self.run_metrics.evaluation(false);
                    return;
                }
            }
        }
        if let Some(e) = &self.evaluator
            && !e.submit(step, path.to_path_buf())
        {
            tracing::warn!(step, "evaluation skipped: the previous one is still decoding (raise eval.every_steps)");
        }
    }

    fn start_evaluator(&mut self) -> anyhow::Result<Evaluator> {
        let prompts = match self.a.eval_prompts.take() {
            Some(p) => p,
            None => eval_prompts(&self.a.config, self.a.vocab_size)?,
        };
        let (device, kind) = self.a.target_device;
        let spec = EvalSpec {
            source: self.a.target_source.clone(),
            taps: self.a.taps.clone(),
            device,
            kind,
            prompts,
            settings: DecodeSettings {
                max_new_tokens: self.a.config.eval.max_new_tokens,
                stop: self.a.eos_token_ids.clone(),
            },
            checkpoint_root: self.a.config.checkpoint.dir.clone(),
        };
        Ok(Evaluator::start(spec, self.myself.clone())?)
    }

    fn on_evaluated(&mut self, outcome: Result<Evaluated, String>) {
        let m = &self.run_metrics;
        m.evaluation(outcome.is_ok());
        match outcome {
            Ok(e) => {
                m.decode_acceptance_length.set(e.decode_acceptance_length);
                m.decode_acceptance_length_best.set(e.best);
                m.decode_token_match.set(e.token_match_rate);
                m.eval_duration.record(e.seconds);
                m.eval_last_step.set(e.step as f64);
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

    // ------------------------------------------------------------------ reload

    /// Rereads the configuration and applies what may change while running; refuses anything else whole.
    fn reload(&mut self) -> Result<Reloaded, String> {
        let result = self.try_reload();
        match &result {
            Ok(r) => {
                self.run_metrics.reload(true, self.config_version);
                if r.changes.is_empty() {
                    tracing::info!(version = self.config_version, "configuration reread: nothing changed");
                }
            }
            Err(e) => {
                self.run_metrics.reload(false, self.config_version);
                tracing::error!(version = self.config_version, "configuration reload refused: {e}");
            }
        }
        result
    }

    fn try_reload(&mut self) -> Result<Reloaded, String> {
        // Turning evaluation on reads its prompts now (kept for the evaluator), so a missing split refuses the reload.
        let needs_prompts = self.evaluator.is_none() && self.a.eval_prompts.is_none();
        let vocab = self.a.vocab_size;
        let mut loaded = None;
        let check = |c: &Config| {
            if c.eval.every_steps > 0 && needs_prompts {
                loaded = Some(eval_prompts(c, vocab).map_err(|e| format!("{e:#}"))?);
            }
            Ok(())
        };
        let Some(Accepted { config: new, changes, gamma }) =
            reread(&self.a.config, &self.a.layers, self.a.drafter_config.block_size, check)?
        else {
            return Ok(Reloaded { config_version: self.config_version, applies_from_step: None, changes: vec![] });
        };
        if loaded.is_some() {
            self.a.eval_prompts = loaded;
        }
        if changes.iter().any(|c| c.key == "log.level") {
            let level =
                logging::set_level(&new.log.level).map_err(|e| format!("{e}; the running configuration stays"))?;
            if level == LevelChange::PinnedByEnv {
                tracing::warn!("log.level changed, but RUST_LOG is set and wins");
            }
        }
        let from = self.collective.reload(step_settings(&new, self.total_samples, gamma));
        self.a.objective.num_anchors = new.objective.num_anchors;
        self.a.objective.gamma = gamma;
        self.a.config = new;
        self.config_version += 1;
        let show = |v: &Option<serde_json::Value>| v.as_ref().map_or("(unset)".to_string(), |v| v.to_string());
        for c in &changes {
            tracing::info!(key = %c.key, old = %show(&c.old), new = %show(&c.new), "configuration: {} {} -> {}", c.key, show(&c.old), show(&c.new));
        }
        tracing::info!(
            version = self.config_version,
            step = from,
            "configuration reloaded: version {} applies from step {from} on every drafter",
            self.config_version
        );
        Ok(Reloaded { config_version: self.config_version, applies_from_step: Some(from), changes })
    }
}

fn clone_work(w: &TargetWork) -> TargetWork {
    match w {
        TargetWork::Capture { drafter, generation, batch, positions } => TargetWork::Capture {
            drafter: *drafter,
            generation: *generation,
            batch: *batch,
            positions: positions.clone(),
        },
        TargetWork::Empty { drafter, generation } => TargetWork::Empty { drafter: *drafter, generation: *generation },
    }
}

/// The supervisor actor.
pub struct Supervisor;

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = Sup;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<Sup, ActorProcessingErr> {
        let mut sup = Sup::new(args, myself.clone());
        sup.start_target(0).await?;
        myself.send_interval(Duration::from_millis(200), || SupervisorMsg::Tick);
        Ok(sup)
    }

    async fn handle(
        &self,
        _: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        s: &mut Sup,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::TargetReady { target, generation, heads } => {
                if let Some(next) = s.on_target_ready(target, generation, heads) {
                    s.start_target(next).await?;
                }
            }
            SupervisorMsg::Delivered { target, generation, batch } => s.on_delivered(target, generation, batch),
            SupervisorMsg::DrafterReady { id, generation } => s.on_ready(id, generation),
            SupervisorMsg::DrafterJoined { id, generation, step } => s.on_joined(id, generation, step),
            SupervisorMsg::StepDone { id, generation, step, report, digest, feature_wait_s } => {
                if s.slots[id].generation == generation {
                    s.slots[id].step = step;
                    s.window_feature_wait_s += feature_wait_s;
                    if !report.applied && Some(id) == s.donor() {
                        tracing::warn!(step, "non-finite gradient norm: the update was skipped on every replica");
                    }
                    if let Some(d) = digest {
                        s.on_digest(id, step, d);
                    }
                }
            }
            SupervisorMsg::Snapshot { id, generation, snapshot } => s.on_snapshot(id, generation, *snapshot),
            SupervisorMsg::Round(r) => s.on_round(r),
            SupervisorMsg::CheckpointWritten(r) => s.on_written(r),
            SupervisorMsg::RestartDrafter { id } => s.restart(id),
            SupervisorMsg::RestartTarget { target } => {
                if s.ending.is_none() {
                    s.start_target(target).await?;
                }
            }
            SupervisorMsg::Tick => s.tick(),
            SupervisorMsg::Fault { id, kind, reply } => {
                let result = if !s.a.config.control.fault_injection {
                    Err("fault injection is off (control.fault_injection = false)".to_string())
                } else if id >= s.slots.len() {
                    Err(format!("no drafter {id} (ids 0..{})", s.slots.len()))
                } else if kind == FaultKind::CheckpointStall {
                    s.checkpointer.stall_next_write();
                    Ok(())
                } else {
                    *s.slots[id].shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(kind);
                    Ok(())
                };
                let _ = reply.send(result);
            }
            SupervisorMsg::CheckpointNow(reply) => {
                let r = match s.request_checkpoint("requested") {
                    Some(_) => Ok(s.committed_step),
                    None if s.checkpoint_in_flight => Err("a checkpoint is being written; try again shortly".into()),
                    None => Err("no live drafter to checkpoint from".into()),
                };
                let _ = reply.send(r);
            }
            SupervisorMsg::Status(reply) => {
                let _ = reply.send(s.status());
            }
            SupervisorMsg::Reload(reply) => {
                let result = s.reload();
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            SupervisorMsg::Evaluated(outcome) => s.on_evaluated(outcome),
            SupervisorMsg::Shutdown => {
                if s.ending.is_none() {
                    tracing::info!(
                        "stop requested: finishing the current steps, checkpointing, exiting (a second signal exits at once)"
                    );
                    s.ending = Some(Ending { code: 0, export: false });
                    if s.request_checkpoint("shutdown").is_none() && !s.checkpoint_in_flight {
                        s.end_if_idle();
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        s: &mut Sup,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, failure) = match event {
            SupervisionEvent::ActorFailed(cell, err) => {
                let failure = match err.downcast_ref::<ThreadFailure>() {
                    Some(f) => f.0.clone(),
                    None => Failure::panic(err.to_string()),
                };
                (cell, failure)
            }
            SupervisionEvent::ActorStarted(cell) => {
                // Keep a handle on each drafter actor, to stop it when its thread is replaced.
                if let Some(name) = cell.get_name()
                    && let Some((id, generation)) = parse_drafter(&name)
                    && id < s.slots.len()
                    && s.slots[id].generation == generation
                {
                    s.slots[id].actor = Some(cell.into());
                }
                return Ok(());
            }
            _ => return Ok(()),
        };
        let Some(name) = cell.get_name() else {
            return Ok(());
        };
        if let Some((id, generation)) = parse_drafter(&name) {
            if id < s.slots.len() {
                s.failed(id, generation, failure);
            }
        } else if let Some((id, generation)) = parse_target(&name)
            && id < s.targets.len()
        {
            s.target_failed(id, generation, failure);
        }
        Ok(())
    }
}

fn parse_drafter(name: &str) -> Option<(usize, u64)> {
    parse_actor(name, "drafter-")
}

fn parse_target(name: &str) -> Option<(usize, u64)> {
    parse_actor(name, "target-")
}

/// `<prefix><id>-<generation>`.
fn parse_actor(name: &str, prefix: &str) -> Option<(usize, u64)> {
    let rest = name.strip_prefix(prefix)?;
    let (id, generation) = rest.split_once('-')?;
    Some((id.parse().ok()?, generation.parse().ok()?))
}
