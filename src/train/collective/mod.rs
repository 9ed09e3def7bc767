//! The in-process collective of synchronous data parallelism with a per-step quorum.
//!
//! Each round (one training step) completes when every current member has contributed its flat gradient and
//! summed loss weight. The member that completes it sums the gradients in member-id order (so the result does not
//! depend on arrival order), computes the step's hyperparameters from the samples committed so far (the same for
//! every replica), and publishes the result; each member copies the sum into its own gradient buffer and applies
//! the same update. A member removed mid-round (it failed or hung) is dropped from that round, which completes with
//! the others' contributions; a contribution it had already made still counts.
//!
//! Joining: a (re)started replica asks to join with its own buffers; a live member, between two of its rounds,
//! copies its parameters and optimizer state into them (device to device) and adds it to the membership of its
//! next round. Replicas therefore stay bitwise identical. The membership and round bookkeeping is
//! [`Rounds`](super::rounds::Rounds), shared with the supervisor's simulation.
//!
//! Across hosts (a [`HostLink`]): the round's local sum becomes this host's share of the run's round, and every
//! member applies the run's sum (the same bits on every host); the first thread to found the collective enters the
//! run, founding it or taking a live host's state; a member serves a host admitted from this one at its boundary.
//!
//! Summing: by device-to-device copies in the member completing the round, or (`GradientSum::Nccl`) by an NCCL
//! all-reduce the contributors run after the round's bookkeeping completes, in a communicator (`Ring`) made for
//! the round's membership and replaced whenever it changes. Across hosts with NCCL, the ring holds every drafter of
//! every member host of the run's round (only the round's record crosses the store); without NCCL, the host's
//! device-copy sum crosses the store as its share.
//!
//! The round's bookkeeping, sum and result are in `round`, the NCCL communicators in `ring`, a host's share of the
//! run's round and the settling of a sum across hosts in `hosts`; this module holds the state and the calls a
//! drafter's thread makes.
pub mod book;
mod hosts;
mod ring;
mod round;

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tch::Tensor;

use self::book::{Book, Counted};
use self::hosts::{FailedSums, Settling, across_hosts};
pub use self::ring::{GradientSum, Ring, RingMember};
use self::ring::{Rings, ring_members};
use self::round::{finish, plan, sum_gradients};
use crate::cluster::quorum::Admitted;
use crate::data::loader::BatchId;
use crate::device::{self, DeviceError};
use crate::model::shared::SharedTensor;
use crate::train::link::{Entering, Handover, HostLink, HostRecord};
use crate::train::objective::{Metrics, ObjectiveKnobs};
use crate::train::optim::UpdateSettings;
pub use crate::train::rounds::{JoinInfo, MemberId, Removal};
use crate::train::rounds::{JoinPoll, Rounds, RoundsError};
use crate::train::step::StepSettings;

/// What a member brings to a round.
pub struct Contribution {
    /// The member's flat gradient (a shallow handle); left untouched until the round's result arrives.
    pub grad: Tensor,
    /// Summed loss weight of its micro-batches.
    pub weight: f64,
    pub samples: u64,
    pub batches: Vec<BatchId>,
    pub metrics: Metrics,
    /// Checksums of the member's state at this round's start, on steps where replicas are compared (across hosts
    /// they travel with the round).
    pub digest: Option<[i64; 3]>,
}

impl Counted for Contribution {
    fn samples(&self) -> u64 {
        self.samples
    }
    fn weight(&self) -> f64 {
        self.weight
    }
    fn batches(&self) -> &[BatchId] {
        &self.batches
    }
    fn metrics(&self) -> Metrics {
        self.metrics
    }
}

/// What the member completing a round is doing, for the watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summing {
    /// Summing this host's contributions (device work).
    Local,
    /// Waiting for the other hosts' (a slow host is not this member hanging).
    AcrossHosts,
}

/// A completed round, as every member applies it.
pub struct RoundResult {
    pub step: u64,
    /// With [`GradientSum::DeviceCopies`]: the summed gradient (on the first contributor's device).
    pub grad: Option<SharedTensor>,
    /// With [`GradientSum::Nccl`]: the communicator the contributors sum in.
    pub ring: Option<Arc<Ring>>,
    pub total_weight: f64,
    pub update: UpdateSettings,
    /// The objective of the next step's forward.
    pub next_objective: ObjectiveKnobs,
    pub contributors: Vec<MemberId>,
}

/// One contributor's part of a completed round, as the supervisor commits it.
#[derive(Debug, Clone)]
pub struct Contributed {
    pub member: MemberId,
    pub generation: u64,
    pub batches: Vec<BatchId>,
    pub metrics: Metrics,
    pub samples: u64,
}

/// A completed round, as the supervisor commits it.
#[derive(Debug, Clone)]
pub struct RoundReport {
    pub step: u64,
    /// Rounds from before a rewind have an older incarnation.
    pub incarnation: u64,
    pub contributions: Vec<Contributed>,
    pub total_weight: f64,
    pub lr: f64,
    pub samples_committed: u64,
    /// Across hosts: the other member hosts' parts of the round (their drafters' ids are their own).
    pub remote: Vec<HostRecord>,
}

impl RoundReport {
    /// The samples every host's contributions to the round trained.
    pub fn samples(&self) -> u64 {
        self.contributions.iter().map(|c| c.samples).sum::<u64>() + self.remote.iter().map(|h| h.samples()).sum::<u64>()
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    #[error("this replica was removed from the collective")]
    Removed,
    #[error("contribution to round {got} while round {expected} is open")]
    WrongRound { expected: u64, got: u64 },
    #[error("cannot found the collective: it has members {0:?}")]
    Occupied(Vec<MemberId>),
    #[error(transparent)]
    Device(#[from] DeviceErrorText),
    #[error("across hosts: {0}")]
    Hosts(String),
    /// The rendezvous host's store cannot be reached (its connection failed, not a deadline): the round's fate
    /// will never be known, and the replica's state is still that of the round's start.
    #[error("across hosts, the rendezvous host is gone: {0}")]
    RendezvousGone(String),
}

impl From<crate::train::link::LinkError> for CollectiveError {
    fn from(e: crate::train::link::LinkError) -> Self {
        if e.unreachable() {
            CollectiveError::RendezvousGone(e.to_string())
        } else {
            CollectiveError::Hosts(e.to_string())
        }
    }
}

impl From<RoundsError> for CollectiveError {
    fn from(e: RoundsError) -> Self {
        match e {
            RoundsError::Removed => CollectiveError::Removed,
            RoundsError::WrongRound { expected, got } => CollectiveError::WrongRound { expected, got },
            RoundsError::Occupied(m) => CollectiveError::Occupied(m),
        }
    }
}

/// A device error, as text (so the error type stays `Clone`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceErrorText(pub String);

impl From<DeviceError> for CollectiveError {
    fn from(e: DeviceError) -> Self {
        CollectiveError::Device(DeviceErrorText(e.to_string()))
    }
}

impl From<crate::ffi::DeviceFailure> for CollectiveError {
    fn from(e: crate::ffi::DeviceFailure) -> Self {
        CollectiveError::Device(DeviceErrorText(e.to_string()))
    }
}

/// The buffers a joiner lends for the donor to fill.
pub struct JoinBuffers {
    pub master: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
}

impl JoinBuffers {
    /// Handles on the same storage (the donor fills them while the joiner waits for its admission).
    pub fn alias(&self) -> JoinBuffers {
        JoinBuffers {
            master: self.master.shallow_clone(),
            exp_avg: self.exp_avg.shallow_clone(),
            exp_avg_sq: self.exp_avg_sq.shallow_clone(),
        }
    }
}

/// A round's outcome, as its contributors find it: the result, or why the sum failed (every contributor then fails,
/// rather than waiting for a result that never comes).
struct Published {
    step: u64,
    incarnation: u64,
    outcome: Result<Arc<RoundResult>, CollectiveError>,
}

struct State {
    rounds: Rounds<Contribution, JoinBuffers>,
    results: VecDeque<Published>,
    book: Book,
    sum: GradientSum,
    rings: Rings,
    settling: Option<Settling>,
    failed_sums: FailedSums,
    /// Hosts admitted at this boundary that take their state from this host.
    remote_joiners: Vec<Admitted>,
}

/// See the module documentation.
pub struct Collective {
    state: Mutex<State>,
    changed: Condvar,
    on_round: Box<dyn Fn(RoundReport) + Send + Sync>,
    link: Option<Arc<HostLink>>,
}

impl Collective {
    /// A collective whose next round is `step`, after `samples_committed` samples.
    pub fn new(
        step: u64,
        samples_committed: u64,
        settings: StepSettings,
        sum: GradientSum,
        on_round: impl Fn(RoundReport) + Send + Sync + 'static,
    ) -> Self {
        Collective {
            state: Mutex::new(State {
                rounds: Rounds::new(step),
                results: VecDeque::new(),
                book: Book::new(settings, samples_committed),
                sum,
                rings: Rings::default(),
                settling: None,
                failed_sums: FailedSums::default(),
                remote_joiners: Vec::new(),
            }),
            changed: Condvar::new(),
            on_round: Box::new(on_round),
            link: None,
        }
    }

    /// Makes this collective one host's part of a run across hosts.
    pub fn with_link(mut self, link: Arc<HostLink>) -> Self {
        self.lock().rings.host = link.rank();
        self.link = Some(link);
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `id` the first member (its own state is the reference); its first round is the returned step.
    /// Fails when there are members already: the supervisor founds only an empty collective.
    pub fn found(&self, id: MemberId, generation: u64) -> Result<u64, CollectiveError> {
        Ok(self.lock().rounds.found(id, generation)?)
    }

    /// Founds the collective with this thread's state (`state`, `optimizer_steps` updates applied). Across hosts the
    /// host enters the run first: founding it (its state then goes to the hosts that wait for it), or taking a live
    /// host's state into `state` and starting at that host's step. Returns the first round and the update count.
    pub fn enter(
        &self,
        id: MemberId,
        generation: u64,
        state: &JoinBuffers,
        optimizer_steps: u64,
    ) -> Result<JoinInfo, CollectiveError> {
        let Some(link) = &self.link else {
            return Ok(JoinInfo { step: self.found(id, generation)?, optimizer_steps });
        };
        let hosts = |e: crate::train::link::LinkError| CollectiveError::Hosts(e.to_string());
        match link.enter().map_err(hosts)? {
            Entering::Found => {
                let step = self.found(id, generation)?;
                let samples = self.lock().book.samples_committed();
                let tensors = [&state.master, &state.exp_avg, &state.exp_avg_sq];
                link.founded(step, samples, optimizer_steps, tensors, self.handover(state.master.device()))
                    .map_err(hosts)?;
                Ok(JoinInfo { step, optimizer_steps })
            }
            Entering::Joined(host) => {
                let targets = [&state.master, &state.exp_avg, &state.exp_avg_sq];
                host.fill(targets).map_err(|e| CollectiveError::Hosts(format!("the donor's state: {e}")))?;
                device::synchronize(state.master.device())?;
                let mut s = self.lock();
                s.rounds.found_at(id, generation, host.step)?;
                s.book.entered(host.samples_committed);
                s.results.clear();
                drop(s);
                self.changed.notify_all();
                Ok(JoinInfo { step: host.step, optimizer_steps: host.optimizer_steps })
            }
        }
    }

    /// How this host hands its state (on `device`) to joining hosts: over NCCL where its drafters sum over NCCL
    /// (on a CPU, where only tests sum "over NCCL" with stand-in all-reduces, through the store).
    fn handover(&self, device: tch::Device) -> Handover {
        match self.lock().sum {
            GradientSum::Nccl if device.is_cuda() => Handover::Nccl,
            _ => Handover::Store,
        }
    }

    /// The ring of the run's round `step` (across hosts, summing over NCCL): the current one while the membership
    /// holds, else a new one whose identity the round's lowest-ranked member host makes and the others read.
    fn run_ring(&self, link: &HostLink, step: u64, hosts: &[HostRecord]) -> Result<Arc<Ring>, CollectiveError> {
        let members = ring_members(hosts);
        if let Some(ring) = self.lock().rings.current(&members) {
            return Ok(ring);
        }
        let maker = hosts.first().map_or(link.rank(), |h| h.rank);
        let id = link.ring_id(step, maker)?;
        Ok(self.lock().rings.next(members, id))
    }

    /// Moves an empty collective to `step` after `samples_committed` samples (a run rewound to a checkpoint);
    /// returns its new incarnation.
    pub fn rewind(&self, step: u64, samples_committed: u64) -> Result<u64, CollectiveError> {
        let mut s = self.lock();
        let incarnation = s.rounds.rewind(step)?;
        s.book.rewind(samples_committed);
        s.results.clear();
        drop(s);
        self.changed.notify_all();
        Ok(incarnation)
    }

    /// New settings (a reload): they apply from the returned step on every member, the first step none has begun
    /// (members may be computing the open round, whose update still uses the old settings).
    pub fn reload(&self, settings: StepSettings) -> u64 {
        let mut s = self.lock();
        let from = s.rounds.round() + 1;
        s.book.reload(from, settings);
        from
    }

    /// The objective of step `step`'s forward (for a member's first step; later ones come with each round).
    pub fn objective_at(&self, step: u64) -> ObjectiveKnobs {
        self.lock().book.settings_at(step).objective
    }

    pub fn members(&self) -> Vec<MemberId> {
        self.lock().rounds.members().into_iter().map(|(m, _)| m).collect()
    }

    /// Removes the member's thread of this generation (and its join request); the open round completes without it.
    /// Says, from the same look at the state, whether it was a member, whether it had contributed to the open
    /// round, and who is left.
    pub fn remove(&self, id: MemberId, generation: u64) -> Removal {
        let mut s = self.lock();
        let removal = s.rounds.remove(id, generation);
        // A contributor gone before saying whether its all-reduce completed: the round cannot count as summed.
        if removal.was_member
            && let Some(settling) = s.settling.as_mut()
        {
            settling.said(id, false);
        }
        drop(s);
        self.changed.notify_all();
        removal
    }

    /// Whether rounds are summed over NCCL across hosts (then each contributor says, after its all-reduce, whether
    /// it completed: [`Collective::summed`]).
    pub fn settles_across_hosts(&self) -> bool {
        self.link.is_some() && self.lock().sum == GradientSum::Nccl
    }

    /// Across hosts with NCCL, after round `step`'s all-reduce: member `id` says whether its all-reduce completed,
    /// and learns whether the round's update applies. The host's last contributor to say tells the run (every
    /// local all-reduce completed, or not) and the rendezvous host decides for every host: the update applies only
    /// if every member host summed. Otherwise every host skips it and keeps its state (a host that died inside the
    /// all-reduce leaves the survivors identical), and the next round has a new communicator.
    pub fn summed(&self, id: MemberId, step: u64, completed: bool) -> Result<bool, CollectiveError> {
        let Some(link) = &self.link else {
            return Ok(completed);
        };
        let mut s = self.lock();
        loop {
            let Some(settling) = s.settling.as_mut().filter(|st| st.step == step) else {
                return Err(CollectiveError::Hosts(format!("round {step} is not settling its sum")));
            };
            settling.said(id, completed);
            if let Some(decision) = &settling.decision {
                return decision.clone();
            }
            if settling.waiting.is_empty() && !settling.claimed {
                settling.claimed = true;
                let all = settling.completed;
                drop(s);
                let decision = link.settle_sum(step, all).map_err(CollectiveError::from);
                let mut s = self.lock();
                let decision = s.failed_sums.settle(all, decision);
                if let Some(settling) = s.settling.as_mut().filter(|st| st.step == step) {
                    settling.decision = Some(decision.clone());
                }
                if decision != Ok(true) {
                    s.rings.abandon();
                }
                drop(s);
                self.changed.notify_all();
                return decision;
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Contributes to round `step` and waits for its result. The member completing the round calls
    /// `summing(Summing::Local)`, sums the gradients outside the lock (device work never holds it), across hosts
    /// calls `summing(Summing::AcrossHosts)` and waits for the run's round, then publishes the result, or the error,
    /// to every contributor.
    pub fn contribute(
        &self,
        id: MemberId,
        generation: u64,
        step: u64,
        contribution: Contribution,
        summing: impl Fn(Summing),
    ) -> Result<Arc<RoundResult>, CollectiveError> {
        let mut s = self.lock();
        s.rounds.contribute(id, generation, step, contribution)?;
        let incarnation = s.rounds.incarnation();
        loop {
            if let Some(p) = s.results.iter().find(|p| p.step == step && p.incarnation == incarnation) {
                return p.outcome.clone();
            }
            if let Some(done) = s.rounds.complete() {
                let plan = plan(&mut s, &done, self.link.is_some());
                drop(s);
                summing(Summing::Local);
                let summed = sum_gradients(plan.sum, &done.contributions);
                let (summed, run) = match &self.link {
                    Some(link) => {
                        summing(Summing::AcrossHosts);
                        across_hosts(link, step, &plan, &done, summed)
                    }
                    None => (summed, None),
                };
                let mut plan = plan;
                if let (Some(run), Some(link)) = (&run, &self.link)
                    && plan.sum == GradientSum::Nccl
                {
                    match self.run_ring(link, step, &run.hosts) {
                        Ok(ring) => plan.ring = Some(ring),
                        Err(e) => plan.ring_error = Some(e),
                    }
                }
                if let (Some(run), Some(link)) = (run, &self.link) {
                    // The run's round: every host's samples count, and the joiners this host serves wait (a round
                    // of an incarnation left behind commits nothing, and its state is not the one the hosts
                    // admitted after that round are to copy).
                    let mut s = self.lock();
                    let current = s.rounds.incarnation() == incarnation;
                    if current {
                        s.remote_joiners.extend(run.serve);
                    }
                    let local = book::local_samples(&done.contributions);
                    plan.settled = s.book.settle_run(plan.settled, local, current, run.hosts, link.rank());
                }
                let settles = self.link.is_some() && plan.sum == GradientSum::Nccl;
                let (outcome, report) = finish(plan, done, summed);
                let mut s = self.lock();
                if s.rounds.incarnation() == incarnation {
                    if let (true, Ok(result)) = (settles, &outcome) {
                        s.settling = Some(Settling::new(step, result.contributors.clone()));
                    }
                    s.results.push_back(Published { step, incarnation, outcome: outcome.clone() });
                    while s.results.len() > 4 {
                        s.results.pop_front();
                    }
                }
                drop(s);
                self.changed.notify_all();
                if outcome.is_ok() {
                    (self.on_round)(report);
                }
                return outcome;
            }
            if !s.rounds.is_member(id, generation) && !s.rounds.has_contributed(id, generation) {
                return Err(CollectiveError::Removed);
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Asks to join: registers `buffers` for a live member to fill. Then [`Collective::wait_joined`]. Refused
    /// (`Removed`) for a thread the supervisor already gave up on.
    pub fn request_join(&self, id: MemberId, generation: u64, buffers: JoinBuffers) -> Result<(), CollectiveError> {
        Ok(self.lock().rounds.request_join(id, generation, buffers)?)
    }

    /// Blocks until a member has copied its state into the buffers of this join request, or the request is removed.
    pub fn wait_joined(&self, id: MemberId, generation: u64) -> Result<JoinInfo, CollectiveError> {
        let mut s = self.lock();
        loop {
            match s.rounds.poll_join(id, generation) {
                JoinPoll::Joined(info) => return Ok(info),
                JoinPoll::Removed => return Err(CollectiveError::Removed),
                JoinPoll::Waiting => s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    /// [`Collective::request_join`] then [`Collective::wait_joined`].
    pub fn join(&self, id: MemberId, generation: u64, buffers: JoinBuffers) -> Result<JoinInfo, CollectiveError> {
        self.request_join(id, generation, buffers)?;
        self.wait_joined(id, generation)
    }

    /// Whether anyone waits to join (a thread of this host, or a host admitted from this one).
    pub fn has_joiners(&self) -> bool {
        let s = self.lock();
        s.rounds.has_joiners() || !s.remote_joiners.is_empty()
    }

    /// Called by a member between its rounds: copies its state (`master`, moments, update count) into every
    /// waiting joiner and adds them to the membership of the open round. Any member may serve: every member at its
    /// step boundary holds the state the open round starts from. The copies happen outside the lock (a device that
    /// hangs during them holds no one else up); a joiner removed meanwhile is skipped.
    pub fn serve_joiners(
        &self,
        id: MemberId,
        generation: u64,
        [master, exp_avg, exp_avg_sq]: [&Tensor; 3],
        optimizer_steps: u64,
    ) -> Result<usize, CollectiveError> {
        let (claim, buffers, hosts) = {
            let mut s = self.lock();
            let claim = s.rounds.claim_joiners(id, generation)?;
            let buffers: Vec<JoinBuffers> =
                claim.joiners.iter().filter_map(|&(m, g)| s.rounds.payload(m, g).map(JoinBuffers::alias)).collect();
            let hosts = std::mem::take(&mut s.remote_joiners);
            (claim, buffers, (hosts, s.rounds.round(), s.book.samples_committed()))
        };
        if let (Some(link), (joiners, step, samples)) = (&self.link, &hosts)
            && !joiners.is_empty()
        {
            // A host that does not get the state times out and enters again: this member goes on either way.
            let state = [master, exp_avg, exp_avg_sq];
            if let Err(e) =
                link.serve(joiners, (*step, *samples, optimizer_steps), state, self.handover(master.device()))
            {
                tracing::warn!(?joiners, "handing the state to joining hosts failed: {e}");
            }
        }
        let copied = buffers.iter().try_for_each(|j| -> Result<(), crate::ffi::DeviceFailure> {
            let mut dst = j.master.shallow_clone();
            dst.copy_(master);
            let mut dst = j.exp_avg.shallow_clone();
            dst.copy_(exp_avg);
            let mut dst = j.exp_avg_sq.shallow_clone();
            dst.copy_(exp_avg_sq);
            device::synchronize(j.master.device())?;
            device::synchronize(master.device())
        });
        let mut s = self.lock();
        let admitted = match copied {
            Ok(()) => s.rounds.admit(&claim, optimizer_steps),
            Err(e) => {
                s.rounds.unclaim(&claim);
                return Err(e.into());
            }
        };
        drop(s);
        self.changed.notify_all();
        Ok(admitted.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::Hyper;
    use std::sync::mpsc;
    use tch::{Device, Kind};

    fn settings() -> StepSettings {
        StepSettings { hyper: hyper(), objective: ObjectiveKnobs { num_anchors: 4, gamma: None } }
    }

    fn hyper() -> Hyper {
        Hyper::constant_for_tests(0.1)
    }

    fn contribution(values: &[f32], weight: f64) -> Contribution {
        Contribution {
            grad: Tensor::from_slice(values),
            weight,
            samples: 2,
            batches: vec![],
            metrics: Metrics::default(),
            digest: None,
        }
    }

    fn zero_buffers() -> JoinBuffers {
        let z = || Tensor::zeros([2], (Kind::Float, Device::Cpu));
        JoinBuffers { master: z(), exp_avg: z(), exp_avg_sq: z() }
    }

    /// Admits `m` (generation 1) as member 0 (generation 1) would, without copying state.
    fn admit(c: &Collective, m: MemberId) {
        let mut s = c.lock();
        s.rounds.request_join(m, 1, zero_buffers()).unwrap();
        s.rounds.serve(0, 1, 0, |_| Ok::<(), ()>(())).unwrap().unwrap();
        assert!(matches!(s.rounds.poll_join(m, 1), JoinPoll::Joined(_)));
    }

    fn collective() -> (Arc<Collective>, mpsc::Receiver<RoundReport>) {
        collective_summing(GradientSum::DeviceCopies)
    }

    fn collective_summing(sum: GradientSum) -> (Arc<Collective>, mpsc::Receiver<RoundReport>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let c = Arc::new(Collective::new(5, 0, settings(), sum, move |r| {
            let _ = tx.lock().unwrap().send(r);
        }));
        (c, rx)
    }

    /// With NCCL the round only does the bookkeeping: no gradient, and a ring of the contributors, the same while
    /// the membership holds and a new one (next epoch, new id) when it changes.
    #[test]
    fn nccl_rounds_carry_a_ring_per_membership_and_no_gradient() {
        let (c, rx) = collective_summing(GradientSum::Nccl);
        c.found(0, 1).unwrap();
        admit(&c, 1);
        let round = |step: u64, members: &[usize]| {
            let handles: Vec<_> = members
                .iter()
                .map(|&m| {
                    let c = c.clone();
                    std::thread::spawn(move || c.contribute(m, 1, step, contribution(&[1.0], 1.0), |_| {}).unwrap())
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert!(results.iter().all(|r| r.grad.is_none() && r.total_weight == members.len() as f64));
            let ring = results[0].ring.clone().expect("an NCCL round has a ring");
            assert!(results.iter().all(|r| r.ring.as_ref() == Some(&ring)));
            rx.recv().unwrap();
            ring
        };
        let ids = |r: &Ring| r.members.iter().map(|m| m.member).collect::<Vec<_>>();
        let first = round(5, &[0, 1]);
        assert_eq!((first.epoch, ids(&first), first.rank_of(1)), (0, vec![0, 1], Some(1)));
        let same = round(6, &[0, 1]);
        assert!(Arc::ptr_eq(&first, &same));
        c.remove(1, 1);
        let smaller = round(7, &[0]);
        assert_eq!((smaller.epoch, ids(&smaller), smaller.rank_of(1)), (1, vec![0], None));
        assert_ne!(smaller.id, first.id);
    }

    /// One failed all-reduce on this host is a skipped round; two in a row make its drafters restart; a round that
    /// summed here starts the count again.
    #[test]
    fn a_host_whose_all_reduce_keeps_failing_restarts_its_drafters() {
        let mut failed = FailedSums::default();
        assert_eq!(failed.settle(false, Ok(false)), Ok(false));
        assert_eq!(failed.settle(true, Ok(false)), Ok(false), "another host's failure");
        assert_eq!(failed.settle(false, Ok(false)), Ok(false));
        let err = failed.settle(false, Ok(false)).unwrap_err().to_string();
        assert!(err.contains("2 rounds in a row"), "{err}");
        assert_eq!(failed.settle(true, Ok(true)), Ok(true));
        let lost = Err(CollectiveError::Hosts("store gone".into()));
        assert_eq!(failed.settle(false, lost.clone()), lost);
    }

    #[test]
    fn a_round_sums_in_member_order_and_every_member_gets_it() {
        let (c, rx) = collective();
        c.found(0, 1).unwrap();
        for m in [1, 2] {
            admit(&c, m);
        }
        let handles: Vec<_> = [(2usize, [3.0f32, 0.5]), (0, [1.0, 0.25]), (1, [2.0, 0.125])]
            .into_iter()
            .map(|(m, v)| {
                let c = c.clone();
                std::thread::spawn(move || {
                    let r = c.contribute(m, 1, 5, contribution(&v, 1.5), |_| {}).unwrap();
                    (
                        r.step,
                        Vec::<f32>::try_from(&r.grad.as_ref().unwrap().to_copy().unwrap()).unwrap(),
                        r.total_weight,
                        r.contributors.clone(),
                    )
                })
            })
            .collect();
        for h in handles {
            let (step, grad, weight, who) = h.join().unwrap();
            assert_eq!((step, weight, who), (5, 4.5, vec![0, 1, 2]));
            assert_eq!(grad, vec![6.0, 0.875]);
        }
        let report = rx.recv().unwrap();
        assert_eq!((report.step, report.samples_committed, report.incarnation), (5, 6, 0));
        let who: Vec<(usize, u64)> = report.contributions.iter().map(|c| (c.member, c.generation)).collect();
        assert_eq!(who, vec![(0, 1), (1, 1), (2, 1)]);
        let round = c.lock().rounds.round();
        assert_eq!((round, c.members()), (6, vec![0, 1, 2]));
    }

    #[test]
    fn a_reload_applies_from_the_first_step_no_member_has_begun() {
        let (c, rx) = collective();
        c.found(0, 1).unwrap();
        let mut next = settings();
        next.hyper.schedule.lr = 0.5;
        next.objective.num_anchors = 9;
        // Round 5 is open (a member may be computing it): the reload applies from step 6.
        assert_eq!(c.reload(next), 6);
        assert_eq!(c.objective_at(5).num_anchors, 4);
        assert_eq!(c.objective_at(6).num_anchors, 9);
        let r = c.contribute(0, 1, 5, contribution(&[1.0], 1.0), |_| {}).unwrap();
        assert_eq!((r.update.adamw.lr, r.next_objective.num_anchors), (0.1, 9));
        assert_eq!(rx.recv().unwrap().lr, 0.1);
        let r = c.contribute(0, 1, 6, contribution(&[1.0], 1.0), |_| {}).unwrap();
        assert_eq!((r.update.adamw.lr, r.next_objective.num_anchors), (0.5, 9));
        assert_eq!(rx.recv().unwrap().lr, 0.5);
        assert_eq!(c.objective_at(6).num_anchors, 9);
    }

    #[test]
    fn a_member_removed_mid_round_is_dropped_and_stale_threads_are_refused() {
        let (c, _rx) = collective();
        c.found(0, 1).unwrap();
        admit(&c, 1);
        let c2 = c.clone();
        let waiter = std::thread::spawn(move || {
            c2.contribute(0, 1, 5, contribution(&[1.0], 1.0), |_| {}).unwrap().contributors.clone()
        });
        while !c.lock().rounds.has_contributed(0, 1) {
            std::thread::yield_now();
        }
        let removal = c.remove(1, 1);
        assert_eq!(removal, Removal { was_member: true, contributed: false, remaining: vec![(0, 1)] });
        assert_eq!(waiter.join().unwrap(), vec![0]);
        assert_eq!(c.contribute(1, 1, 6, contribution(&[1.0], 1.0), |_| {}).err(), Some(CollectiveError::Removed));
    }

    /// A sum that fails (here: gradients of different sizes) fails the round for every contributor, each with the
    /// error, instead of leaving the others waiting for a result that never comes; no report is sent.
    #[test]
    fn a_failed_sum_fails_the_round_for_every_contributor() {
        let (c, rx) = collective();
        c.found(0, 1).unwrap();
        admit(&c, 1);
        let (tx, outcomes) = mpsc::channel();
        for (m, values) in [(0usize, vec![1.0f32, 2.0]), (1, vec![1.0, 2.0, 3.0])] {
            let (c, tx) = (c.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tx.send((m, c.contribute(m, 1, 5, contribution(&values, 1.0), |_| {}).map(|r| r.step)));
            });
        }
        for _ in 0..2 {
            let (m, outcome) = outcomes.recv_timeout(std::time::Duration::from_secs(10)).expect("nobody hangs");
            assert!(matches!(outcome, Err(CollectiveError::Device(_))), "member {m}: {outcome:?}");
        }
        assert!(rx.try_recv().is_err(), "a failed round is not reported as committed");
    }

    #[test]
    fn a_joiner_receives_the_donor_state_and_joins_the_next_round() {
        let (c, _rx) = collective();
        c.found(0, 1).unwrap();
        let donor = [
            Tensor::from_slice(&[1.0f32, 2.0]),
            Tensor::from_slice(&[0.1f32, 0.2]),
            Tensor::from_slice(&[0.01f32, 0.02]),
        ];
        let buffers = zero_buffers();
        let (m, v) = (buffers.master.shallow_clone(), buffers.exp_avg_sq.shallow_clone());
        let c2 = c.clone();
        let joiner = std::thread::spawn(move || c2.join(3, 7, buffers).unwrap());
        while !c.has_joiners() {
            std::thread::yield_now();
        }
        assert_eq!(c.serve_joiners(0, 1, [&donor[0], &donor[1], &donor[2]], 9).unwrap(), 1);
        assert_eq!(joiner.join().unwrap(), JoinInfo { step: 5, optimizer_steps: 9 });
        assert!(m.equal(&donor[0]) && v.equal(&donor[2]));
        assert_eq!(c.members(), vec![0, 3]);
        // A thread that is not a member cannot serve; a removed joiner stops waiting.
        let c3 = c.clone();
        let late = std::thread::spawn(move || c3.join(4, 1, zero_buffers()));
        while !c.has_joiners() {
            std::thread::yield_now();
        }
        assert_eq!(c.serve_joiners(3, 6, [&donor[0], &donor[1], &donor[2]], 9), Err(CollectiveError::Removed));
        c.remove(4, 1);
        assert_eq!(late.join().unwrap(), Err(CollectiveError::Removed));
    }
}
