//! A drafter: a thin actor around a dedicated compute thread. The thread binds its device first, builds the model
//! and optimizer inside itself, warms up, reports Ready, joins the collective (copying a live peer's state, or
//! founding it from the seed or a checkpoint), then trains: each step takes its micro-batches from a bounded
//! channel, runs forward and backward, contributes to the step's round and applies the round's update. Its loop
//! runs inside `catch_unwind`; a panic or error is reported to the actor, which fails so the supervisor sees it.
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::ActorRef;
use tch::{Device, Kind, Tensor};

use super::compute_thread::{ThreadBody, torch};
use super::failure::{Failure, FailureKind, FaultKind};
use super::messages::{Heads, SupervisorMsg, Work};
pub use super::supervisor::protocol::Start;
use super::supervisor::protocol::{Event, Order};
use super::supervisor::watchdog::Activity;
use crate::data::loader::BatchId;
use crate::device;
use crate::ffi::nccl::{NcclComm, NcclError};
use crate::model::{Drafter, DrafterConfig, Init};
use crate::telemetry::DrafterMetrics;
use crate::train::checkpoint::{DRAFTER_DIR, OPTIMIZER_FILE, Snapshot};
use crate::train::collective::{Collective, CollectiveError, Contribution, JoinBuffers, Ring, RoundResult, Summing};
use crate::train::objective::ObjectiveKnobs;
use crate::train::objective::{Metrics, ObjectiveSettings};
use crate::train::step::UpdateReport;
use crate::train::{FeatureBatch, Optimizer, OptimizerKind, Trainer};

/// What one drafter shares with the supervisor across its restarts.
#[derive(Default)]
pub struct DrafterShared {
    /// A fault to inject at its next step.
    pub fault: Mutex<Option<FaultKind>>,
    /// What its current thread is doing.
    pub phase: Mutex<Phase>,
    /// Threads of this generation or older are abandoned: they stop quietly if they ever wake.
    pub abandoned: AtomicU64,
    /// The generation of its thread that took an injected fault (0: none): that thread's failure is a rehearsal,
    /// not held against the batches it was running or its device.
    pub injected: AtomicU64,
}

/// What a drafter thread is doing since when, for the watchdog; the batches it is computing, if it is.
#[derive(Debug, Clone)]
pub struct Phase {
    pub generation: u64,
    pub activity: Activity,
    pub since: Instant,
    pub batches: Vec<BatchId>,
}

impl Default for Phase {
    fn default() -> Self {
        Phase { generation: 0, activity: Activity::Starting, since: Instant::now(), batches: vec![] }
    }
}

/// Reports what the thread does from now on.
fn now_doing(a: &DrafterSpawn, activity: Activity, batches: Vec<BatchId>) {
    *a.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) =
        Phase { generation: a.generation, activity, since: Instant::now(), batches };
}

/// Everything a drafter thread needs.
pub struct DrafterSpawn {
    pub id: usize,
    pub generation: u64,
    pub device: Device,
    pub kind: Kind,
    pub config: DrafterConfig,
    pub objective: ObjectiveSettings,
    pub optimizer: OptimizerKind,
    pub seed: u64,
    /// A new run's starting weights (`draft_model.init`, checked at start); `None`: random from `seed`.
    pub init: Option<PathBuf>,
    pub accumulation: usize,
    /// Report checksums of the state every this many steps (0: never).
    pub check_every: u64,
    pub start: Start,
    pub heads: Arc<Heads>,
    pub collective: Arc<Collective>,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub input: Receiver<Work>,
    pub shared: Arc<DrafterShared>,
    pub metrics: DrafterMetrics,
    /// The device's matrix peak (TFLOP/s), for the MFU series.
    pub peak_tflops: f64,
    /// NCCL: the deadline of joining a communicator and of one all-reduce.
    pub collective_timeout: Duration,
}

/// The drafter's compute thread, for a [`ComputeActor`](super::compute_thread::ComputeActor).
pub fn thread(args: DrafterSpawn) -> ThreadBody {
    ThreadBody { name: format!("drafter-{}", args.id), body: Box::new(move || run(args)) }
}

/// A small synthetic micro-batch through forward and backward: kernels chosen and memory allocated before Ready.
fn warm_up(trainer: &mut Trainer) -> Result<(), Failure> {
    let bs = trainer.objective.block_size;
    let len = 2 * bs + 2;
    let d = trainer.drafter.config();
    let batch = FeatureBatch {
        sample_ids: vec![u64::MAX],
        epoch: 0,
        input_ids: vec![vec![0; len]],
        loss_mask: vec![vec![1; len]],
        conversations: None,
        target_hidden: Tensor::f_zeros(
            [1, len as i64, d.context_width() as i64],
            (trainer.drafter.kind(), trainer.drafter.device()),
        )
        .map_err(torch)?,
        target_last: match trainer.objective.teacher.needs_target_predictions() {
            true => Some(
                Tensor::f_zeros(
                    [1, len as i64, d.decoder.hidden_size as i64],
                    (trainer.drafter.kind(), trainer.drafter.device()),
                )
                .map_err(torch)?,
            ),
            false => None,
        },
    };
    trainer.accumulate(&batch).map_err(torch)?;
    trainer.drafter.params_mut().zero_grad();
    device::synchronize(trainer.drafter.device()).map_err(torch)
}

/// Sums this drafter's gradient in place with the round's other contributors over NCCL, first joining the ring's
/// communicator if the membership changed since the last round (the old communicator is aborted). On a failure the
/// communicator is dropped (aborted) too: the drafter fails and is restarted.
fn nccl_sum(
    slot: &mut Option<(u64, NcclComm)>,
    ring: &Ring,
    me: usize,
    device: Device,
    timeout: Duration,
    grad: &Tensor,
) -> Result<(), NcclError> {
    if slot.as_ref().is_none_or(|(epoch, _)| *epoch != ring.epoch) {
        *slot = None;
        let rank = ring.rank_of(me).ok_or(NcclError::BadRank { rank: me, nranks: ring.members.len() })?;
        *slot = Some((ring.epoch, NcclComm::join(&ring.id, rank, ring.members.len(), device, timeout)?));
    }
    let Some((_, comm)) = slot.as_mut() else {
        unreachable!("joined above");
    };
    let summed = comm.all_reduce_sum(grad, grad, timeout);
    if summed.is_err() {
        *slot = None;
    }
    summed
}

fn state_tensors(trainer: &Trainer) -> [&Tensor; 3] {
    let [m, v, _] = trainer.optimizer.state_tensors();
    [&trainer.drafter.params().master, m, v]
}

/// The compute thread. `Ok(())` means it was told to stop or was removed.
fn run(a: DrafterSpawn) -> Result<(), Failure> {
    let ended = take_place(&a).and_then(|(mut trainer, mut step)| {
        let mut round = RoundState::default();
        loop {
            step = train_step(&a, &mut trainer, step, &mut round)?;
        }
    });
    match ended {
        Err(End::Failed(failure)) => Err(failure),
        Ok(()) | Err(End::Asked) => Ok(()),
    }
}

/// Why a drafter's thread ends: it was asked to (stopped, removed from the collective, or its state kept for the
/// run's parting), or it failed.
enum End {
    Asked,
    Failed(Failure),
}

impl From<Failure> for End {
    fn from(failure: Failure) -> Self {
        End::Failed(failure)
    }
}

impl End {
    /// A thread that ends after `last` (its parting kept, or not).
    fn after(last: Result<(), Failure>) -> Self {
        last.map_or_else(End::Failed, |()| End::Asked)
    }
}

/// What a drafter's loop carries from one step to the next.
#[derive(Default)]
struct RoundState {
    /// NCCL: this drafter's membership of the current ring's communicator (aborted when replaced or dropped).
    communicator: Option<(u64, NcclComm)>,
    /// A checkpoint asked for at a later step boundary than this one.
    snapshot_at: Option<u64>,
    /// The state's checksums at the boundary they were taken at: they go with that step's contribution too.
    boundary_digest: Option<(u64, [i64; 3])>,
}

/// Builds the drafter and its trainer, reports Ready and takes its place in the collective (founding it, entering
/// the run across hosts, or joining with a live member's state). Returns the trainer and its first step.
fn take_place(a: &DrafterSpawn) -> Result<(Trainer, u64), End> {
    device::bind_thread(a.device).map_err(torch)?;
    let mut trainer = build_trainer(a)?;
    warm_up(&mut trainer)?;
    if let Start::Join = a.start {
        // Registered before Ready, so the donor the supervisor asks finds the request. Refused when the supervisor
        // gave up on this thread while it was starting: it stops quietly.
        if a.collective.request_join(a.id, a.generation, join_buffers(&trainer)).is_err() {
            return Err(End::Asked);
        }
    }
    let _ = a.supervisor.send_message(SupervisorMsg::Core(Event::DrafterReady { id: a.id, generation: a.generation }));
    let joined = match a.start {
        // Across hosts this enters the run: founding it, or taking a live host's state.
        Start::Found(_) => a.collective.enter(a.id, a.generation, &join_buffers(&trainer), trainer.optimizer.steps()),
        Start::Join => a.collective.wait_joined(a.id, a.generation),
    };
    let step = match joined {
        Ok(info) => {
            trainer.optimizer.set_steps(info.optimizer_steps).map_err(torch)?;
            info.step
        }
        // The supervisor gave up on this thread (it was removed): it was asked to stop.
        Err(CollectiveError::Removed) => return Err(End::Asked),
        Err(e @ CollectiveError::Hosts(_)) => return Err(torch(e).into()),
        // A founder that finds members is a supervisor bug: fail loudly rather than train beside them.
        Err(e) => return Err(Failure::panic(format!("drafter {} could not take its place: {e}", a.id)).into()),
    };
    set_objective(&mut trainer, a.collective.objective_at(step));
    now_doing(a, Activity::WaitingForWork, vec![]);
    let _ = a.supervisor.send_message(SupervisorMsg::Core(Event::DrafterJoined {
        id: a.id,
        generation: a.generation,
        step,
    }));
    Ok((trainer, step))
}

/// The trainer of this start: a checkpoint's drafter and optimizer, a published drafter's weights, fresh weights
/// from the seed, or zeros a live member's state will fill.
fn build_trainer(a: &DrafterSpawn) -> Result<Trainer, Failure> {
    // A checkpoint that cannot be loaded is reported as such: the supervisor then founds from an older one.
    let unloadable = |e: crate::model::ModelError| match (torch(&e), &a.start) {
        (f, Start::Found(Some(ckpt))) if f.kind == FailureKind::Torch => {
            Failure { kind: FailureKind::CheckpointLoad, message: format!("loading {}: {}", ckpt.display(), f.message) }
        }
        (f, _) => f,
    };
    let drafter = match &a.start {
        Start::Found(Some(ckpt)) => Drafter::load(&ckpt.join(DRAFTER_DIR), a.device, a.kind).map_err(unloadable),
        Start::Found(None) => match &a.init {
            Some(dir) => Drafter::with_weights(a.config.clone(), dir, a.device, a.kind).map_err(torch),
            None => {
                let init = if a.device == Device::Cpu { Init::Portable(a.seed) } else { Init::Device(a.seed) };
                Drafter::new(a.config.clone(), a.device, a.kind, init).map_err(torch)
            }
        },
        Start::Join => Drafter::zeroed(a.config.clone(), a.device, a.kind).map_err(torch),
    }?;
    // SAFETY: the drafter trains neither the target's embedding nor its LM head: it only reads them (on the target's
    // device and dtype these are the target's own tensors, not copies).
    let [embed, lm_head] = [&a.heads.embed, &a.heads.lm_head]
        .map(|h| unsafe { h.alias() }.f_to_device(a.device).and_then(|t| t.f_to_kind(a.kind)));
    let (embed, lm_head) = (embed.map_err(torch)?, lm_head.map_err(torch)?);
    let optimizer = match &a.start {
        Start::Found(Some(ckpt)) => {
            let layout = drafter.params().layout();
            Optimizer::load(ckpt, OPTIMIZER_FILE, layout, a.device, a.optimizer).map_err(unloadable)?
        }
        _ => Optimizer::new(drafter.params(), a.optimizer).map_err(torch)?,
    };
    Ok(Trainer::new(drafter, optimizer, embed, lm_head, a.objective.clone(), a.seed))
}

/// Handles on the trainer's state (master weights and AdamW moments): where a joiner's state is copied to, or what
/// a founder hands to hosts that join.
fn join_buffers(trainer: &Trainer) -> JoinBuffers {
    let [master, exp_avg, exp_avg_sq] = state_tensors(trainer).map(Tensor::shallow_clone);
    JoinBuffers { master, exp_avg, exp_avg_sq }
}

/// One training step: its micro-batches, forward and backward, the round, the update. Returns the next step.
fn train_step(a: &DrafterSpawn, trainer: &mut Trainer, step: u64, round: &mut RoundState) -> Result<u64, End> {
    if round.snapshot_at.is_some_and(|at| at <= step) {
        round.snapshot_at = None;
        send_snapshot(a, trainer, step)?;
    }
    let (items, feature_wait_s) = take_work(a, trainer, step, &mut round.snapshot_at)?;
    let started = Instant::now();
    let batches: Vec<BatchId> = items.iter().map(|(b, _)| *b).collect();
    now_doing(a, Activity::Computing, batches.clone());
    inject_fault(a)?;
    let mut metrics = Metrics::default();
    let mut samples = 0;
    let mut flops = 0.0;
    for (_, features) in &items {
        metrics.add(&trainer.accumulate(features).map_err(torch)?);
        // Conversations, not rows: a packed row holds several.
        samples += features.sample_ids.len() as u64;
        let anchors = trainer.objective.num_anchors;
        flops += match &features.conversations {
            // Each conversation's own work (its length, its anchors), whatever row it shares.
            Some(rows) => {
                rows.iter().flatten().map(|&len| a.config.training_flops_per_sample(len as i64, anchors)).sum()
            }
            None => {
                let seq = features.input_ids.iter().map(Vec::len).max().unwrap_or(0) as i64;
                features.input_ids.len() as f64 * a.config.training_flops_per_sample(seq, anchors)
            }
        };
    }
    // Waiting for the peers is not computing: a hung peer must not make this one look hung.
    now_doing(a, Activity::WaitingForPeers, vec![]);
    let own = trainer.drafter.params().grad.shallow_clone();
    let digest = round.boundary_digest.filter(|(at, _)| *at == step).map(|(_, d)| d);
    let contribution =
        Contribution { grad: own.shallow_clone(), weight: metrics.weight, samples, batches, metrics, digest };
    let in_round = Instant::now();
    let summing = |s: Summing| {
        let activity = if s == Summing::Local { Activity::Summing } else { Activity::WaitingForPeers };
        now_doing(a, activity, vec![]);
    };
    let result = a
        .collective
        .contribute(a.id, a.generation, step, contribution, summing)
        .map_err(|e| collective_end(a, trainer, step, e))?;
    let applies = take_sum(a, trainer, &mut round.communicator, &result, &own, step)?;
    a.metrics.collective_duration.record(in_round.elapsed().as_secs_f64());
    now_doing(a, Activity::Applying, vec![]);
    let report = if applies {
        trainer.apply(result.total_weight, &result.update).map_err(torch)?
    } else {
        trainer.drafter.params_mut().zero_grad();
        UpdateReport { grad_norm: f64::NAN, applied: false, lr: result.update.adamw.lr }
    };
    set_objective(trainer, result.next_objective);
    let step = result.step + 1;
    let seconds = started.elapsed().as_secs_f64();
    a.metrics.step_duration.record(seconds);
    a.metrics.feature_wait.set(feature_wait_s / (feature_wait_s + seconds).max(1e-9));
    a.metrics.learning_rate.set(report.lr);
    a.metrics.grad_norm.set(report.grad_norm);
    a.metrics.mfu.set(flops / seconds.max(1e-9) / (a.peak_tflops * 1e12));
    let digest = match a.check_every > 0 && step.is_multiple_of(a.check_every) {
        true => Some(checksums(state_tensors(trainer)).map_err(torch)?),
        false => None,
    };
    round.boundary_digest = digest.map(|d| (step, d));
    let (id, generation, applied) = (a.id, a.generation, report.applied);
    let done = Event::StepDone { id, generation, step, digest, applied, feature_wait_s };
    let _ = a.supervisor.send_message(SupervisorMsg::Core(done));
    if a.collective.has_joiners() {
        serve(a, trainer)?;
    }
    now_doing(a, Activity::WaitingForWork, vec![]);
    Ok(step)
}

/// One micro-batch of a step, as its compute thread receives it.
type Micro = (BatchId, Box<FeatureBatch>);

/// The micro-batches of step `step` (an empty one counts as taken) and the seconds spent waiting for them, serving
/// what else arrives meanwhile: joiners, checkpoints (now, or at `snapshot_at`).
fn take_work(
    a: &DrafterSpawn,
    trainer: &Trainer,
    step: u64,
    snapshot_at: &mut Option<u64>,
) -> Result<(Vec<Micro>, f64), End> {
    let mut items = Vec::new();
    let mut taken = 0;
    let mut waited_s = 0.0;
    while taken < a.accumulation {
        let waiting = Instant::now();
        let work = a.input.recv();
        waited_s += waiting.elapsed().as_secs_f64();
        match work {
            Ok(Work::Features { batch, features }) => {
                a.metrics.feature_queue.decrement(1.0);
                items.push((batch, features));
                taken += 1;
            }
            Ok(Work::Empty) => taken += 1,
            Ok(Work::Order(Order::ServeJoiners)) => serve(a, trainer)?,
            Ok(Work::Order(Order::Checkpoint { at })) if at <= step => send_snapshot(a, trainer, step)?,
            Ok(Work::Order(Order::Checkpoint { at })) => *snapshot_at = Some(at),
            Ok(Work::Order(Order::Stop)) | Err(_) => return Err(End::Asked),
        }
    }
    Ok((items, waited_s))
}

/// A fault injected through the control plane, if one is armed: a panic, an error, or a hang until abandoned.
fn inject_fault(a: &DrafterSpawn) -> Result<(), End> {
    let Some(fault) = a.shared.fault.lock().unwrap_or_else(|p| p.into_inner()).take() else {
        return Ok(());
    };
    a.shared.injected.store(a.generation, Ordering::SeqCst);
    match fault {
        FaultKind::Panic => panic!("injected panic (fault injection) in drafter {}", a.id),
        FaultKind::Error => Err(End::Failed(Failure {
            kind: FailureKind::Injected,
            message: format!("injected error (fault injection) in drafter {}", a.id),
        })),
        FaultKind::Hang => loop {
            std::thread::sleep(Duration::from_millis(20));
            if a.shared.abandoned.load(Ordering::SeqCst) >= a.generation {
                return Err(End::Asked);
            }
        },
        // Applied by the supervisor to the checkpointer directly.
        FaultKind::CheckpointStall => Ok(()),
    }
}

/// How the thread ends when the collective refuses it: removed (asked to stop), the rendezvous host gone (its state
/// kept for the run's parting), or failed.
fn collective_end(a: &DrafterSpawn, trainer: &Trainer, step: u64, e: CollectiveError) -> End {
    match e {
        CollectiveError::Removed => End::Asked,
        CollectiveError::RendezvousGone(why) => End::after(keep_for_parting(a, trainer, step, why)),
        e => End::Failed(torch(e)),
    }
}

/// Puts the round's summed gradient into this drafter's (`own`): copied from the member that summed, or
/// all-reduced over NCCL. Returns whether the update applies (across hosts, only if every host's sum completed).
fn take_sum(
    a: &DrafterSpawn,
    trainer: &Trainer,
    communicator: &mut Option<(u64, NcclComm)>,
    result: &RoundResult,
    own: &Tensor,
    step: u64,
) -> Result<bool, End> {
    match (&result.grad, &result.ring) {
        (Some(sum), _) => {
            now_doing(a, Activity::Summing, vec![]);
            sum.copy_into(&mut own.shallow_clone()).map_err(torch)?;
            Ok(true)
        }
        (None, Some(ring)) => {
            let across_hosts = a.collective.settles_across_hosts();
            // Across hosts one communicator spans every host's drafters: the join and the all-reduce wait for the
            // other hosts (one stopped or swapping is not this drafter hanging); `drafters.collective_timeout_s`
            // bounds them.
            let activity = if across_hosts { Activity::WaitingForPeers } else { Activity::Summing };
            now_doing(a, activity, vec![]);
            let summed = nccl_sum(communicator, ring, a.id, a.device, a.collective_timeout, own)
                .map_err(|e| format!("summing gradients over NCCL (ring {}, {:?}): {e}", ring.epoch, ring.members));
            if !across_hosts {
                summed.map_err(torch)?;
                return Ok(true);
            }
            // Across hosts a failed all-reduce (a host died inside it) is the run's to decide: every host then skips
            // the round's update, and this drafter keeps its state.
            if let Err(e) = &summed {
                tracing::warn!(drafter = a.id, step = result.step, "{e}");
            }
            // Then waiting (still) for the other hosts' word.
            a.collective.summed(a.id, result.step, summed.is_ok()).map_err(|e| collective_end(a, trainer, step, e))
        }
        (None, None) => Err(torch("a round completed without a gradient sum").into()),
    }
}

/// How long a replica whose round lost the rendezvous host waits for the supervisor to ask for its state.
const PARTING_WAIT: Duration = Duration::from_secs(60);

/// The rendezvous host went away inside a round: its update was not applied, so the state is still the one of
/// boundary `step`, possibly the run's newest. It is kept for the supervisor, which learns of the loss from its own
/// reads of the store and checkpoints a replica on the way out: a snapshot is taken when asked, and the thread ends
/// when stopped, or fails after [`PARTING_WAIT`] if the supervisor never asks.
fn keep_for_parting(a: &DrafterSpawn, trainer: &Trainer, step: u64, why: String) -> Result<(), Failure> {
    tracing::warn!(drafter = a.id, step, "the rendezvous host is gone ({why}): keeping this replica's state");
    now_doing(a, Activity::WaitingForPeers, vec![]);
    let until = Instant::now() + PARTING_WAIT;
    loop {
        match a.input.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(Work::Order(Order::Checkpoint { .. })) => send_snapshot(a, trainer, step)?,
            Ok(Work::Order(Order::Stop)) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
            Ok(Work::Features { .. }) => a.metrics.feature_queue.decrement(1.0),
            Ok(Work::Empty | Work::Order(Order::ServeJoiners)) => {}
            Err(RecvTimeoutError::Timeout) => {
                return Err(torch(format!("across hosts, the rendezvous host is gone: {why}")));
            }
        }
    }
}

/// Copies the state at step boundary `step` to host memory and hands it to the supervisor for a checkpoint.
fn send_snapshot(a: &DrafterSpawn, trainer: &Trainer, step: u64) -> Result<(), Failure> {
    let previous = a.shared.phase.lock().unwrap_or_else(|p| p.into_inner()).clone();
    now_doing(a, Activity::Snapshotting, vec![]);
    let snapshot = Snapshot::take(
        step,
        trainer.drafter.config(),
        trainer.drafter.params().layout(),
        state_tensors(trainer),
        trainer.optimizer.steps(),
        trainer.optimizer.muon_names(),
    )
    .map_err(torch)?;
    let message = SupervisorMsg::Snapshot { id: a.id, generation: a.generation, snapshot: Box::new(snapshot) };
    let _ = a.supervisor.send_message(message);
    *a.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) = previous;
    Ok(())
}

/// The objective's reloadable settings, from the step they apply to.
fn set_objective(trainer: &mut Trainer, knobs: ObjectiveKnobs) {
    trainer.objective.num_anchors = knobs.num_anchors;
    trainer.objective.gamma = knobs.gamma;
}

/// Bit-exact checksums of the state: each tensor's bits read as integers, summed (one reduction each).
fn checksums(tensors: [&Tensor; 3]) -> Result<[i64; 3], tch::TchError> {
    let mut out = [0i64; 3];
    for (o, t) in out.iter_mut().zip(tensors) {
        *o = t.f_view_dtype(Kind::Int)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    }
    Ok(out)
}

fn serve(a: &DrafterSpawn, trainer: &Trainer) -> Result<(), Failure> {
    let previous = a.shared.phase.lock().unwrap_or_else(|p| p.into_inner()).clone();
    now_doing(a, Activity::Serving, vec![]);
    let served = a.collective.serve_joiners(a.id, a.generation, state_tensors(trainer), trainer.optimizer.steps());
    *a.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) = previous;
    match served {
        Ok(_) | Err(CollectiveError::Removed) => Ok(()),
        Err(e) => Err(torch(e)),
    }
}
