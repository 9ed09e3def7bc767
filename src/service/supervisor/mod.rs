//! The supervisor: a ractor actor around the pure [`Core`]. It turns what happens (thread reports, supervision
//! events, timers, control requests, signals) into [`Event`]s for the [`Driver`], the one executor of the core's
//! actions (the simulator drives the same one); its [`Shell`] owns the handles (actors, channels, tensors, files)
//! the core must not see, and is the process's `Effects` (`effects.rs`): starting and abandoning compute threads,
//! routing capture requests, rewinding the collective, writing checkpoints, the ledger, evaluation, export, metrics,
//! and the exit. Every decision is the core's.
pub mod core;
pub mod protocol;

mod checkpoints;
mod drafters;
mod driver;
mod effects;
mod hosts;
mod restarts;
pub mod run_progress;
mod schedule;
mod spawned;
mod survivor;
mod targets;
pub mod watchdog;

#[cfg(test)]
mod sim;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tch::{Device, Kind};

pub use self::core::{Core, HostRole, Setup, step_settings};
use self::driver::Driver;
pub use self::effects::export_final;
use self::protocol::{Activity, DrafterSeen, Event, Request};
pub use self::schedule::complete_at;
use self::spawned::{Registry, Spawned};
use self::watchdog::TickGaps;
use super::compute_thread::ThreadFailure;
use super::drafter::DrafterShared;
use super::evaluator::{EvalSet, EvalSpec, Evaluator, eval_set};
use super::failure::{Failure, FaultKind, FaultRefused};
use super::ledger::LedgerWriter;
use super::messages::{Heads, ReloadReply, Reread, SupervisorMsg};
use super::placement::assign_targets;
use super::reload::{Accepted, Reloaded, reread};
use super::status::{DrafterState, Status};
use super::target::Routes;
use crate::config::{CollectiveKind, Config, Layers, TargetSource};
use crate::data::dataset::Dataset;
use crate::device::{self, device_name};
use crate::model::{DrafterConfig, PartFault};
use crate::telemetry::logging::{self, LevelChange};
use crate::telemetry::tensorboard::{self, EventFile};
use crate::telemetry::{DeviceMemory, DrafterMetrics, GpuIdentity, RunMetrics, TargetMetrics};
use crate::train::checkpoint::{Checkpointer, Snapshot, TrainerState, survivor_root};
use crate::train::collective::{Collective, GradientSum};
use crate::train::decode_eval::DecodeSettings;
use crate::train::link::{HostLink, HostMember};
use crate::train::objective::ObjectiveSettings;

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
    /// Devices the (one) target copy and the evaluation's target spread their later layers over
    /// (`target.spread_to`).
    pub spread_to: Vec<Device>,
    pub drafter_devices: Vec<(Device, Kind)>,
    pub dataset: Arc<dyn Dataset>,
    /// `data.stream`: the stream the run learns from as it grows (its waves are in `dataset`).
    pub stream: Option<crate::service::stream::StreamRun>,
    pub resume: Option<(PathBuf, TrainerState)>,
    /// Checkpoint folders found invalid when looking for the one to resume.
    pub rejected: Vec<u64>,
    pub exit_code: Arc<Mutex<Option<i32>>>,
    /// Where the configuration came from, reread on a reload.
    pub layers: Layers,
    /// Renders `/metrics`; kept here for its periodic upkeep.
    pub prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// The target's vocabulary and end-of-sequence ids (evaluation prompts and decoding).
    pub vocab_size: usize,
    pub eos_token_ids: Vec<i64>,
    /// The evaluation's prompts and held-out rows, read once when evaluation is on (their keys cannot change while
    /// running).
    pub eval_set: Option<EvalSet>,
    /// Several hosts: this host's link to the others (`None`: one host).
    pub link: Option<Arc<HostLink>>,
    /// The data ledger (`data.ledger`, rank 0), opened at start.
    pub ledger: Option<(std::fs::File, PathBuf)>,
    /// The live page's progress points, which the progress lines add to.
    pub live: Arc<crate::service::live::LiveView>,
}

/// The handles of one drafter slot.
struct DrafterHandle {
    device: Device,
    kind: Kind,
    shared: Arc<DrafterShared>,
    metrics: DrafterMetrics,
}

/// The handles of one target copy.
struct TargetHandle {
    device: Device,
    kind: Kind,
    /// Its current thread's generation and request channel.
    thread: Option<(u64, Sender<Request>)>,
    /// Threads of this generation or older are abandoned: they deliver nothing more.
    abandoned: Arc<AtomicU64>,
    metrics: TargetMetrics,
    /// Set by fault injection: the thread panics at its next capture, where it enters the part armed.
    fault: Arc<PartFault>,
}

/// The actor's state: the core behind its driver, and the process's effects.
pub struct State {
    driver: Driver<Snapshot>,
    shell: Shell,
}

/// What the process owns to carry out the core's actions: the handles of threads and actors, the writers, metrics.
pub struct Shell {
    a: SupervisorArgs,
    myself: ActorRef<SupervisorMsg>,
    started: Instant,
    routes: Arc<Routes>,
    collective: Arc<Collective>,
    checkpointer: Checkpointer,
    heads: Option<Arc<Heads>>,
    drafters: Vec<DrafterHandle>,
    targets: Vec<TargetHandle>,
    /// The compute actors spawned and not yet ended: what a supervision event's actor is.
    spawned: Registry,
    ledger: Option<LedgerWriter>,
    run_metrics: RunMetrics,
    memory: Vec<(Device, DeviceMemory)>,
    /// A reading of the memory statistics is under way.
    reading_memory: Arc<AtomicBool>,
    last_telemetry: Instant,
    evaluator: Option<Evaluator>,
    /// `log.tensorboard` on one host or rank 0: the run's event file (`None` also once a write failed).
    tensorboard: Option<EventFile>,
    samples_per_epoch: u64,
    /// Several hosts, rank 0: the member hosts last told to the core.
    hosts_told: Vec<HostMember>,
    /// Another host: the threads that read rank 0's assignments and watch its silence (dropped last).
    _feed_reader: Option<[crate::cluster::background::Background; 2]>,
    /// `data.stream`: the thread that makes its waves.
    _stream: Option<crate::cluster::background::Background>,
}

impl Shell {
    fn new(mut a: SupervisorArgs, myself: ActorRef<SupervisorMsg>) -> (Core, Self) {
        let lengths = a.dataset.lengths();
        let (step, samples) = a.resume.as_ref().map_or((0, 0), |(_, s)| (s.step, s.samples_committed));
        let drafter_devices: Vec<Device> = a.drafter_devices.iter().map(|(d, _)| *d).collect();
        let capture: Vec<Device> = a.capture_devices.iter().map(|(d, _)| *d).collect();
        let samples_per_epoch = lengths.len() as u64;
        let follower = a.link.as_ref().is_some_and(|l| l.rank() > 0);
        let core = Core::new(Setup {
            config: a.config.clone(),
            drafter_devices: drafter_devices.iter().map(|d| device_name(*d)).collect(),
            target_devices: capture.iter().map(|d| device_name(*d)).collect(),
            feeds: assign_targets(&drafter_devices, &capture),
            lengths,
            sample_ids: (0..a.dataset.len()).map(|p| a.dataset.id(p)).collect(),
            stream: a.stream.as_ref().map(|s| s.epochs()),
            resume: a.resume.clone(),
            rejected: a.rejected.clone(),
            role: a.link.as_ref().map(|_| if follower { HostRole::Follower } else { HostRole::Leader }),
        });
        let settings = step_settings(&a.config, samples_per_epoch, a.objective.gamma);
        let sum = match a.config.drafters.collective {
            CollectiveKind::InProcess => GradientSum::DeviceCopies,
            CollectiveKind::Nccl => GradientSum::Nccl,
        };
        let collective = Collective::new(step, samples, settings, sum, to_core(&myself, Event::Round));
        let collective = Arc::new(match &a.link {
            Some(link) => collective.with_link(link.clone()),
            None => collective,
        });
        let feed_reader = match &a.link {
            Some(link) if follower => {
                let started = hosts::read_feeds(link.clone(), myself.clone())
                    .and_then(|reader| Ok([reader, hosts::watch_leader(link.clone(), myself.clone())?]));
                started.map_err(|e| tracing::error!("cannot start the threads that follow rank 0: {e}")).ok()
            }
            _ => None,
        };
        // Another host checkpoints only when rank 0 is lost, into a folder of its own.
        let root = match a.link.as_ref().filter(|_| follower) {
            Some(link) => survivor_root(&a.config.checkpoint.dir, link.rank()),
            None => a.config.checkpoint.dir.clone(),
        };
        let checkpointer =
            Checkpointer::start(root, a.config.checkpoint.keep, to_core(&myself, Event::CheckpointWritten));
        // The devices' metric labels: one NVML lookup per device, however many drafters and target copies share it.
        let mut identities: HashMap<Device, GpuIdentity> = HashMap::new();
        let mut identity = |d: Device| identities.entry(d).or_insert_with(|| GpuIdentity::of(d)).clone();
        let targets = (a.capture_devices.iter())
            .map(|&(device, kind)| TargetHandle {
                device,
                kind,
                thread: None,
                abandoned: Arc::new(AtomicU64::new(0)),
                fault: Arc::new(PartFault::default()),
                metrics: TargetMetrics::new(&identity(device)),
            })
            .collect();
        let drafters = (a.drafter_devices.iter().enumerate())
            .map(|(id, &(device, kind))| DrafterHandle {
                device,
                kind,
                shared: Arc::new(DrafterShared::default()),
                metrics: DrafterMetrics::new(id, &identity(device)),
            })
            .collect();
        let memory = identities.iter().map(|(&d, identity)| (d, DeviceMemory::new(identity))).collect();
        // Rank 0 keeps the run's ledger.
        if let Some(Ok(Some(p))) = a.config.publish.dir.as_deref().map(crate::service::publish::current) {
            crate::telemetry::published(p.version, p.decode_acceptance_length);
        }
        let ledger = a.ledger.take().and_then(|(file, path)| {
            LedgerWriter::start(file, &path, to_core(&myself, Event::LedgerWritten))
                .map_err(|e| tracing::error!(path = %path.display(), "cannot start the data.ledger writer: {e}"))
                .ok()
        });
        let tensorboard = (a.config.log.tensorboard && !follower)
            .then(|| {
                let dir = a.config.checkpoint.dir.join(tensorboard::DIR);
                EventFile::create(&dir, crate::telemetry::unix_now())
                    .map_err(
                        |e| tracing::warn!(dir = %dir.display(), "no TensorBoard event file (log.tensorboard): {e}"),
                    )
                    .ok()
            })
            .flatten();
        let stream = a.stream.take().and_then(|s| {
            let tell = to_core(&myself, |e: Event| e);
            s.start(tell).map_err(|e| tracing::error!("data.stream: cannot start its thread: {e}")).ok()
        });
        let shell = Shell {
            myself,
            started: Instant::now(),
            routes: Arc::new(Routes::default()),
            collective,
            checkpointer,
            heads: None,
            drafters,
            targets,
            spawned: Registry::default(),
            ledger,
            run_metrics: RunMetrics::new(step, samples),
            memory,
            reading_memory: Arc::new(AtomicBool::new(false)),
            last_telemetry: Instant::now(),
            evaluator: None,
            tensorboard,
            samples_per_epoch,
            hosts_told: Vec::new(),
            _feed_reader: feed_reader,
            _stream: stream,
            a,
        };
        (core, shell)
    }

    /// A drafter's thread failed: what it was computing and whether the fault was injected, for the core.
    fn drafter_failed(&self, id: usize, generation: u64, failure: Failure) -> Event {
        let seen = self.seen(id, generation).filter(|d| d.activity == Activity::Computing);
        let injected = self.drafters[id].shared.injected.load(Ordering::SeqCst) == generation;
        Event::DrafterFailed { id, generation, failure, running: seen.map(|d| d.running).unwrap_or_default(), injected }
    }

    /// What every running drafter thread is doing and for how long, for the core's watchdog.
    fn watched(&self, core: &Core) -> Vec<DrafterSeen> {
        core.running_threads().into_iter().filter_map(|(id, generation)| self.seen(id, generation)).collect()
    }

    /// What drafter thread `(id, generation)` is doing and for how long, while its slot's phase is its own.
    fn seen(&self, id: usize, generation: u64) -> Option<DrafterSeen> {
        let shared = &self.drafters[id].shared;
        let phase = shared.phase.lock().unwrap_or_else(|p| p.into_inner()).clone();
        (phase.generation == generation).then(|| DrafterSeen {
            id,
            generation,
            activity: phase.activity,
            for_: phase.since.elapsed(),
            running: phase.batches,
            injected: shared.injected.load(Ordering::SeqCst) == generation,
        })
    }

    fn tick_telemetry(&mut self) {
        if self.last_telemetry.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_telemetry = Instant::now();
        // The allocator's statistics take its lock, which a thread stuck in a device call may hold: read them off
        // the runtime, one reading at a time.
        if !self.reading_memory.swap(true, Ordering::SeqCst) {
            let (memory, reading) = (self.memory.clone(), self.reading_memory.clone());
            tokio::task::spawn_blocking(move || {
                for (device, gauges) in &memory {
                    if let Ok(m) = device::memory_stats(*device) {
                        gauges.allocated.set(m.allocated as f64);
                        gauges.reserved.set(m.reserved as f64);
                    }
                }
                reading.store(false, Ordering::SeqCst);
            });
        }
        if let Some(h) = &self.a.prometheus {
            h.run_upkeep();
        }
    }

    fn publish_states(&self, core: &Core) {
        for id in 0..self.drafters.len() {
            if let Some(state) = core.drafter_state(id) {
                DrafterMetrics::set_state(id, state.name());
            }
        }
        self.run_metrics.drafters_live.set(core.live_count() as f64);
    }

    // ------------------------------------------------------------------ evaluation

    fn start_evaluator(&mut self, config: &Config) -> anyhow::Result<Evaluator> {
        let set = match self.a.eval_set.take() {
            Some(set) => set,
            None => eval_set(config, self.a.vocab_size)?,
        };
        let (device, kind) = self.a.target_device;
        // Held-out rows are scored as training scores its batches now (anchors and gamma are reloadable).
        let current = &config.objective;
        let block_size = self.a.drafter_config.block_size;
        let objective = ObjectiveSettings {
            num_anchors: current.num_anchors,
            gamma: current.gamma.resolve(block_size)?,
            ..self.a.objective.clone()
        };
        let spec = EvalSpec {
            source: self.a.target_source.clone(),
            taps: self.a.taps.clone(),
            device,
            spread_to: self.a.spread_to.clone(),
            kind,
            set,
            recent_traffic: (config.eval.prompts == crate::config::EvalPrompts::Stream)
                .then(|| crate::service::stream::stream_root(config)),
            settings: DecodeSettings {
                max_new_tokens: self.a.config.eval.max_new_tokens,
                stop: self.a.eos_token_ids.clone(),
                cuda_graphs: self.a.config.eval.cuda_graphs,
                progress: false,
            },
            objective,
            checkpoint_root: self.a.config.checkpoint.dir.clone(),
            publish: self.a.config.publish.clone(),
        };
        Ok(Evaluator::start(spec, to_core(&self.myself, Event::Evaluated))?)
    }

    // ------------------------------------------------------------------ reload

    /// Rereads the configuration on a blocking thread (files, prompts: nothing blocks the runtime); the answer
    /// comes back as [`SupervisorMsg::Reread`].
    fn reread(&self, current: &Config, reply: Option<ReloadReply>) {
        // Turning evaluation on reads its prompts now (kept for the evaluator), so a missing split refuses the reload.
        let needs_prompts = self.evaluator.is_none() && self.a.eval_set.is_none();
        let vocab = self.a.vocab_size;
        let current = current.clone();
        let layers = self.a.layers.clone();
        let block_size = self.a.drafter_config.block_size;
        let me = self.myself.clone();
        tokio::task::spawn_blocking(move || {
            let mut prompts = None;
            let check = |c: &Config| {
                if c.eval.every_steps > 0 && needs_prompts {
                    prompts = Some(eval_set(c, vocab).map_err(|e| format!("{e:#}"))?);
                }
                Ok(())
            };
            let reread = reread(&current, &layers, block_size, check);
            let reread = reread.map(|accepted| accepted.map(|accepted| Reread { accepted, eval_set: prompts }));
            let _ = me.send_message(SupervisorMsg::Reread { reread: Box::new(reread), reply });
        });
    }

    /// Whether faults may be injected (`control.fault_injection`).
    fn injecting(&self) -> Result<(), FaultRefused> {
        self.a.config.control.fault_injection.then_some(()).ok_or(FaultRefused::Off)
    }

    /// Makes target copy `id` panic at its next capture where the hidden state enters `part` (the layers on the
    /// part-th device of `[target.device] + target.spread_to`): a failure of the whole supervised unit, whichever of
    /// its devices it strikes.
    fn inject_target(&mut self, id: usize, part: usize) -> Result<(), FaultRefused> {
        let count = self.targets.len();
        let target = self.targets.get(id).ok_or(FaultRefused::NoSuchTarget { id, count })?;
        let parts = 1 + self.a.spread_to.len();
        if part >= parts {
            return Err(FaultRefused::NoSuchPart { id, part, parts });
        }
        if target.thread.is_none() {
            return Err(FaultRefused::Conflict(format!("target copy {id} runs no thread to fail")));
        }
        let pending = || FaultRefused::Conflict(format!("target copy {id} has a fault pending already"));
        target.fault.arm(part).then_some(()).ok_or_else(pending)
    }

    /// `POST /drafters/{id}/fault`: one pending fault per drafter (and one checkpoint stall) at a time; a drafter
    /// failed for good runs no thread to fail.
    fn inject(&mut self, core: &Core, id: usize, kind: FaultKind) -> Result<(), FaultRefused> {
        if id >= self.drafters.len() {
            return Err(FaultRefused::NoSuchDrafter { id, count: self.drafters.len() });
        }
        if kind == FaultKind::CheckpointStall {
            let pending = || FaultRefused::Conflict("a checkpoint stall is pending already".into());
            return self.checkpointer.stall_next_write().then_some(()).ok_or_else(pending);
        }
        if core.drafter_state(id) == Some(DrafterState::Failed) {
            return Err(FaultRefused::Conflict(format!("drafter {id} is failed: it runs no thread to fail")));
        }
        let mut pending = self.drafters[id].shared.fault.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(other) = pending.replace(kind) {
            *pending = Some(other);
            let why = format!("drafter {id} has a fault pending already ({other:?}); it takes effect at its next step");
            return Err(FaultRefused::Conflict(why));
        }
        Ok(())
    }
}

impl State {
    /// Hands `event` to the core through the driver, then shows the drafters' states.
    fn feed(&mut self, event: Event) {
        self.driver.handle(&mut self.shell, event);
        self.shell.publish_states(self.driver.core());
    }

    /// Rank 0: tells the core when the run's member hosts changed.
    fn tell_hosts(&mut self) {
        let Some(link) = self.shell.a.link.as_ref().filter(|l| l.rank() == 0) else { return };
        let members = link.members();
        if members != self.shell.hosts_told {
            self.shell.hosts_told = members.clone();
            self.feed(Event::Hosts(members));
        }
    }

    /// Applies what may change while running from a reread configuration; refuses anything else whole.
    fn reload(&mut self, reread: Result<Option<Reread>, String>) -> Result<Reloaded, String> {
        let result = self.apply_reload(reread);
        let version = self.driver.core().config_version();
        self.shell.run_metrics.reload(result.is_ok(), version);
        match &result {
            Ok(r) if r.changes.is_empty() => tracing::info!(version, "configuration reread: nothing changed"),
            Ok(_) => {}
            Err(e) => tracing::error!(version, "configuration reload refused: {e}"),
        }
        result
    }

    fn apply_reload(&mut self, reread: Result<Option<Reread>, String>) -> Result<Reloaded, String> {
        let version = self.driver.core().config_version();
        let Some(Reread { accepted: Accepted { config: new, changes, gamma }, eval_set: prompts }) = reread? else {
            return Ok(Reloaded { config_version: version, applies_from_step: None, changes: vec![] });
        };
        let s = &mut self.shell;
        if prompts.is_some() && s.evaluator.is_none() {
            s.a.eval_set = prompts;
        }
        if changes.iter().any(|c| c.key == "log.level") {
            let level =
                logging::set_level(&new.log.level).map_err(|e| format!("{e}; the running configuration stays"))?;
            if level == LevelChange::PinnedByEnv {
                tracing::warn!("log.level changed, but RUST_LOG is set and wins");
            }
        }
        let from = s.collective.reload(step_settings(&new, s.samples_per_epoch, gamma));
        s.a.objective.num_anchors = new.objective.num_anchors;
        s.a.objective.gamma = gamma;
        self.feed(Event::Reconfigured(Box::new(new)));
        let version = self.driver.core().config_version();
        let show = crate::config::Change::shown;
        for c in &changes {
            tracing::info!(key = %c.key, old = %show(&c.old), new = %show(&c.new), "configuration: {} {} -> {}", c.key, show(&c.old), show(&c.new));
        }
        tracing::info!(
            version,
            step = from,
            "configuration reloaded: version {version} applies from step {from} on every drafter"
        );
        Ok(Reloaded { config_version: version, applies_from_step: Some(from), changes })
    }
}

/// A callback for another thread that hands what it is given to the core, as the event `event` makes of it.
fn to_core<T>(
    myself: &ActorRef<SupervisorMsg>,
    event: impl Fn(T) -> Event + Send + Sync + 'static,
) -> impl Fn(T) + Send + Sync + 'static {
    let me = myself.clone();
    move |x| {
        let _ = me.send_message(SupervisorMsg::Core(event(x)));
    }
}

/// The supervisor actor.
pub struct Supervisor;

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = State;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<State, ActorProcessingErr> {
        let (core, shell) = Shell::new(args, myself.clone());
        let mut s = State { driver: Driver::new(core), shell };
        s.driver.start(&mut s.shell);
        s.shell.publish_states(s.driver.core());
        myself.send_interval(TickGaps::TICK, || SupervisorMsg::Tick);
        Ok(s)
    }

    async fn handle(
        &self,
        _: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        s: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        s.driver.arrived(&mut s.shell, matches!(msg, SupervisorMsg::Tick));
        let event = match msg {
            SupervisorMsg::TargetReady { target, generation, heads } => {
                s.shell.heads.get_or_insert(heads);
                Event::TargetReady { target, generation }
            }
            SupervisorMsg::Snapshot { id, generation, snapshot } => {
                let (step, optimizer_steps) = (snapshot.step, snapshot.optimizer_steps);
                s.driver.keep_snapshot((id, generation, step), *snapshot);
                Event::Snapshot { id, generation, step, optimizer_steps }
            }
            SupervisorMsg::Tick => {
                s.shell.tick_telemetry();
                Event::Watch(s.shell.watched(s.driver.core()))
            }
            SupervisorMsg::Fault { id, kind, reply } => {
                let _ = reply.send(s.shell.injecting().and_then(|()| s.shell.inject(s.driver.core(), id, kind)));
                return Ok(());
            }
            SupervisorMsg::TargetFault { id, part, reply } => {
                let _ = reply.send(s.shell.injecting().and_then(|()| s.shell.inject_target(id, part)));
                return Ok(());
            }
            SupervisorMsg::CheckpointNow(reply) => {
                let answer = s.driver.checkpoint_now(&mut s.shell);
                s.shell.publish_states(s.driver.core());
                let _ = reply.send(answer);
                return Ok(());
            }
            SupervisorMsg::Status(reply) => {
                let status = Status { pid: std::process::id(), ..s.driver.core().status() };
                let _ = reply.send(status);
                return Ok(());
            }
            SupervisorMsg::Reload(reply) => {
                s.shell.reread(s.driver.core().config(), reply);
                return Ok(());
            }
            SupervisorMsg::Reread { reread, reply } => {
                let result = s.reload(*reread);
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
                return Ok(());
            }
            SupervisorMsg::Core(event) => event,
            SupervisorMsg::ForGeneration { generation, event } => match &s.shell.a.link {
                Some(link) if link.generation() == generation => event,
                _ => return Ok(()),
            },
        };
        s.feed(event);
        s.tell_hosts();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        s: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        // A thread that returned without being asked to failed too, though it was computing nothing.
        let (cell, failure) = match event {
            SupervisionEvent::ActorFailed(cell, err) => match err.downcast_ref::<ThreadFailure>() {
                Some(f) => (cell, Ok(f.0.clone())),
                None => (cell, Ok(Failure::panic(err.to_string()))),
            },
            SupervisionEvent::ActorTerminated(cell, ..) => (cell, Err(Failure::ended())),
            SupervisionEvent::ActorStarted(cell) => {
                s.shell.spawned.started(cell);
                return Ok(());
            }
            _ => return Ok(()),
        };
        let event = match (s.shell.spawned.ended(&cell), failure) {
            (Some(Spawned::Drafter { id, generation }), Ok(f)) => s.shell.drafter_failed(id, generation, f),
            (Some(spawned), Ok(failure) | Err(failure)) => spawned.failed(failure),
            (None, _) => return Ok(()),
        };
        s.feed(event);
        Ok(())
    }
}
