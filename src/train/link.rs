//! A host's side of a run across hosts, as its in-process collective uses it: entering the run (founding it, or
//! taking a live host's state), turning the host's summed round into the run's round, and handing the state to a
//! host admitted from this one. Rank 0 also runs the coordinator (the quorum, [`Coordinator`]) on a thread of its
//! own, from the moment it founds the run.
//!
//! A round's record (what each host trained, its settings and loss weight) crosses hosts through the store. Its
//! gradient goes one of two ways: with `drafters.collective = "nccl"` every drafter of every host all-reduces over
//! one NCCL communicator per membership, whose identity the round's lowest-ranked member host posts
//! ([`HostLink::ring_id`]); otherwise it crosses as f32 bytes through the store and every host sums the members'
//! gradients in rank order (for CPU runs and tests). Either way every host applies the same sum bit for bit; with
//! NCCL, only if every host's all-reduce completed ([`HostLink::settle_sum`]). The state a joiner takes is the
//! donor's master weights, AdamW moments, update count, step and samples committed: with NCCL the weights and moments
//! come by a broadcast from the donor's device ([`Handover`]), only their header through the store.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use thiserror::Error;

use crate::cluster::background::Background;
use crate::cluster::exchange::{self, Coordinator, Entry, ExchangeError};
use crate::cluster::launch::HostPlacement;
use crate::cluster::quorum::{Admitted, Rank};
use crate::cluster::store::Connection;
use crate::data::loader::BatchId;
use crate::ffi::nccl::{NcclComm, NcclError, NcclId};
use crate::ffi::store::{Store, StoreError};
use crate::train::objective::{Metrics, ObjectiveKnobs};
use crate::train::optim::UpdateSettings;

#[derive(Debug, Error)]
pub enum LinkError {
    #[error(transparent)]
    Exchange(#[from] ExchangeError),
    #[error("the rendezvous host's coordinator stopped: {0}")]
    CoordinatorStopped(String),
    /// Rank 0 counts as lost: silent for `cluster.leader_timeout_s`, or its store's connection failed.
    #[error("rank 0 is lost: {0}")]
    LeaderLost(String),
    #[error("tensor: {0}")]
    Tensor(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("malformed {what} from host {rank}: {message}")]
    Malformed { what: &'static str, rank: Rank, message: String },
    #[error(
        "this host's training data ({mine}) is not rank 0's ({theirs}): every host must read the same prepared data \
         (data.* keys and files), since rank 0 assigns batches by position"
    )]
    DataDiffers { mine: String, theirs: String },
    #[error(
        "no live host had the run's state when this host was admitted (every host lost it at once, or rank 0 does not \
         take part): restart every host with --resume auto"
    )]
    NoDonor,
}

impl LinkError {
    /// A store read whose deadline passed (nothing against the connection or the peer).
    pub fn timed_out(&self) -> bool {
        matches!(self, LinkError::Exchange(ExchangeError::Store(StoreError::Timeout { .. })))
    }

    /// The store's connection failed (the rendezvous host's process or its network is gone), as against a
    /// deadline, a refusal, or something malformed.
    pub fn unreachable(&self) -> bool {
        matches!(self, LinkError::Exchange(ExchangeError::Store(StoreError::Failed { .. })) | LinkError::LeaderLost(_))
    }
}

impl From<StoreError> for LinkError {
    fn from(e: StoreError) -> Self {
        LinkError::Exchange(e.into())
    }
}

impl From<tch::TchError> for LinkError {
    fn from(e: tch::TchError) -> Self {
        LinkError::Tensor(e.to_string())
    }
}

/// What a host brings to a round: what each of its drafters trained, and (through the store) their summed gradient.
pub struct HostShare<'a> {
    /// Through the store (`None`: the drafters sum over NCCL, and only the round's record crosses the store).
    pub grad: Option<&'a Tensor>,
    /// The update this host would apply and the objective of its next step: the round applies its lowest-ranked
    /// member's, so that every host applies the same whatever each was configured or reloaded with.
    pub settings: (UpdateSettings, ObjectiveKnobs),
    pub weight: f64,
    pub contributions: Vec<DrafterPart>,
}

/// What one drafter of a host trained in a round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterPart {
    /// The drafter's id on its host.
    pub drafter: usize,
    /// The drafter's generation (its restarts make it a new member of the run's NCCL ring).
    pub generation: u64,
    pub batches: Vec<BatchId>,
    pub samples: u64,
    pub metrics: Metrics,
    /// Checksums of its state at the round's start, on steps where replicas are compared.
    pub digest: Option<[i64; 3]>,
}

/// What a member host trained in a round, as every host reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostRecord {
    pub rank: Rank,
    /// The generation it contributed as.
    pub generation: u64,
    pub settings: (UpdateSettings, ObjectiveKnobs),
    pub weight: f64,
    pub contributions: Vec<DrafterPart>,
}

impl HostRecord {
    pub fn samples(&self) -> u64 {
        self.contributions.iter().map(|c| c.samples).sum()
    }
}

/// A closed round of the run.
pub struct RunRound {
    /// The members' gradients summed in rank order (CPU, f32); `None` when the drafters sum over NCCL.
    pub grad: Option<Tensor>,
    /// Each member's record, in rank order (its samples and loss weight among them).
    pub hosts: Vec<HostRecord>,
    /// Hosts admitted at this boundary that take their state from this one.
    pub serve: Vec<Admitted>,
}

/// A host's state, as a joiner takes it ([`HostState::fill`]).
#[derive(Debug)]
pub struct HostState {
    /// The first round it contributes to.
    pub step: u64,
    pub optimizer_steps: u64,
    pub samples_committed: u64,
    data: StateData,
}

/// Master weights and the two AdamW moments, as they come.
#[derive(Debug)]
enum StateData {
    /// Through the store (CPU, f32).
    Bytes([Tensor; 3]),
    /// By the donor's NCCL broadcast (the donor is rank 0 of communicator `id`).
    Broadcast { id: NcclId, rank: usize, ranks: usize, elements: [usize; 3] },
}

impl HostState {
    /// Copies the state into `into` (master weights and moments, flat f32 on this drafter's device); with the
    /// donor's broadcast, joins its communicator and receives there.
    pub fn fill(&self, into: [&Tensor; 3]) -> Result<(), LinkError> {
        match &self.data {
            StateData::Bytes(tensors) => {
                for (dst, src) in into.into_iter().zip(tensors) {
                    dst.shallow_clone().f_copy_(&src.f_view_as(dst)?)?;
                }
                Ok(())
            }
            StateData::Broadcast { id, rank, ranks, elements } => {
                if into.iter().map(|t| t.numel()).ne(elements.iter().copied()) {
                    let sizes = into.map(|t| t.numel());
                    return Err(LinkError::Nccl(format!(
                        "the donor broadcasts a state of {elements:?} elements, this drafter's is {sizes:?}"
                    )));
                }
                let started = std::time::Instant::now();
                broadcast_state(id, *rank, *ranks, into)
                    .map_err(|e| LinkError::Nccl(format!("receiving the donor's state: {e}")))?;
                let bytes: usize = into.iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum();
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    gigabytes = bytes as f64 / 1e9,
                    "took the donor's state by NCCL broadcast"
                );
                Ok(())
            }
        }
    }
}

/// How a donor hands its state to the hosts it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// As f32 bytes through the store (CPU runs and tests).
    Store,
    /// By an NCCL broadcast from the donor's device (`drafters.collective = "nccl"`); the store carries only the
    /// header and the communicator's identity, so rank 0's store never holds a state.
    Nccl,
}

/// One side of a handover by NCCL broadcast (the donor is rank 0 of communicator `id`, `state` on this thread's
/// device): broadcasts the state from the donor, then all-reduces one number, so that the donor learns every joiner
/// has received all of it before anyone closes the communicator (gracefully: over the network transport, closing
/// as soon as one's own part completes can cut a peer's receive off).
fn broadcast_state(id: &NcclId, rank: usize, ranks: usize, state: [&Tensor; 3]) -> Result<(), NcclError> {
    let device = state[0].device();
    let mut comm = NcclComm::join(id, rank, ranks, device, HANDOVER_TIMEOUT)?;
    for t in state {
        comm.broadcast(t, 0, HANDOVER_TIMEOUT)?;
    }
    let received = Tensor::f_ones([1], (Kind::Float, device)).map_err(|e| NcclError::Failed(e.to_string()))?;
    comm.all_reduce_sum(&received, &received, HANDOVER_TIMEOUT)?;
    comm.finish(HANDOVER_TIMEOUT)
}

/// How long a donor and its joiners wait for each other's NCCL communicator and for each part of the broadcast:
/// below the drafters' hang floor (30 s), so that a joiner that vanishes costs its donor less than a failure.
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(25);

/// A member host of the run: its generation and the first round it takes part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostMember {
    pub rank: Rank,
    pub generation: u64,
    pub from: u64,
}

/// How this host enters the run.
pub enum Entering {
    /// It founds the run (from its own checkpoint or seed); [`HostLink::founded`] follows.
    Found,
    Joined(HostState),
}

#[derive(Serialize, Deserialize)]
struct StateHeader {
    step: u64,
    optimizer_steps: u64,
    samples_committed: u64,
    elements: [usize; 3],
    /// Where the state comes by the donor's NCCL broadcast instead of after the header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    broadcast: Option<BroadcastHeader>,
}

/// The donor's communicator for a broadcast of its state (the donor is rank 0).
#[derive(Serialize, Deserialize)]
struct BroadcastHeader {
    id: Vec<u8>,
    rank: usize,
    ranks: usize,
}

/// Framing of a payload: its JSON header's length (8 bytes, little-endian), the header, then raw f32 data.
fn frame(header: &impl Serialize, tensors: &[&Tensor]) -> Result<Vec<u8>, LinkError> {
    let head = serde_json::to_vec(header).map_err(|e| LinkError::Tensor(e.to_string()))?;
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    for t in tensors {
        let flat = t.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)?.f_contiguous()?.f_view([-1])?;
        let values = Vec::<f32>::try_from(&flat)?;
        out.extend(values.iter().flat_map(|x| x.to_le_bytes()));
    }
    Ok(out)
}

/// The header and the f32 data after it.
fn unframe<'a, H: for<'de> Deserialize<'de>>(
    bytes: &'a [u8],
    what: &'static str,
    rank: Rank,
) -> Result<(H, &'a [u8]), LinkError> {
    let malformed = |message: String| LinkError::Malformed { what, rank, message };
    let len = bytes.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    let len = len.ok_or_else(|| malformed(format!("{} bytes", bytes.len())))? as usize;
    let head = bytes.get(8..8 + len).ok_or_else(|| malformed(format!("a header of {len} bytes is cut off")))?;
    let header = serde_json::from_slice(head).map_err(|e| malformed(e.to_string()))?;
    Ok((header, &bytes[8 + len..]))
}

fn floats(data: &[u8], elements: usize, what: &'static str, rank: Rank) -> Result<Tensor, LinkError> {
    if data.len() != 4 * elements {
        let message = format!("{} bytes of data for {elements} floats", data.len());
        return Err(LinkError::Malformed { what, rank, message });
    }
    let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Tensor::from_slice(&values))
}

/// A donor's state after its header: the f32 data itself, or the communicator it broadcasts it in.
fn state_data(h: &StateHeader, data: &[u8], rank: Rank) -> Result<StateData, LinkError> {
    let malformed = |message: String| LinkError::Malformed { what: "state", rank, message };
    let [a, b, c] = h.elements;
    if let Some(cast) = &h.broadcast {
        let id = NcclId::from_bytes(&cast.id)
            .ok_or_else(|| malformed(format!("an NCCL identity of {} bytes", cast.id.len())))?;
        if !data.is_empty() || cast.rank == 0 || cast.rank >= cast.ranks {
            let message = format!("rank {} of {} with {} bytes of data", cast.rank, cast.ranks, data.len());
            return Err(malformed(format!("a broadcast header as {message}")));
        }
        return Ok(StateData::Broadcast { id, rank: cast.rank, ranks: cast.ranks, elements: h.elements });
    }
    if data.len() != 4 * (a + b + c) {
        return Err(malformed(format!("{} bytes for {} floats", data.len(), a + b + c)));
    }
    Ok(StateData::Bytes([
        floats(&data[..4 * a], a, "state", rank)?,
        floats(&data[4 * a..4 * (a + b)], b, "state", rank)?,
        floats(&data[4 * (a + b)..], c, "state", rank)?,
    ]))
}

/// A member's gradient in its contribution: `elements` floats when this host sums through the store, nothing when
/// its drafters sum over NCCL. A member that sums the other way is refused by name.
fn gradient(data: &[u8], elements: Option<usize>, rank: Rank) -> Result<Option<Tensor>, LinkError> {
    let differs = |message: String| LinkError::Malformed {
        what: "contribution",
        rank,
        message: format!("{message}: every host must set the same drafters.collective"),
    };
    match elements {
        Some(_) if data.is_empty() => {
            Err(differs("no gradient (it sums over NCCL) where this host sums through the store".into()))
        }
        None if !data.is_empty() => {
            Err(differs(format!("{} bytes of gradient where this host's drafters sum over NCCL", data.len())))
        }
        Some(elements) => floats(data, elements, "contribution", rank).map(Some),
        None => Ok(None),
    }
}

/// Added to `cluster.leader_timeout_s` for the deadline of a store operation without one of its own (a set, an add,
/// the read after a wait), and of opening another connection once connected. Rank 0 stopped for a while must not
/// fail such an operation first: [`HostLink::silence`] judges a silent rank 0, and shuts its connections once it
/// counts as lost, which ends any operation still waiting.
const OPERATION_MARGIN: Duration = Duration::from_secs(5);

/// The coordinator's thread (rank 0), stopped when the link is dropped.
struct CoordinatorThread {
    /// Why it stopped on its own (a stalled run, a store failure).
    failed: Arc<Mutex<Option<String>>>,
    _thread: Background,
}

/// See the module documentation. Over the run's TCPStore ([`HostLink::open`]), or any [`Connection`]
/// ([`HostLink::over`]).
pub struct HostLink<S: Connection = Store> {
    placement: HostPlacement,
    /// The quorum's deadline for a round.
    deadline: Duration,
    /// The connection this link was made with (on rank 0 it serves the store: it lives as long as the link).
    origin: Mutex<S>,
    /// Spare connections, one taken per operation (operations of several threads must not share one).
    spare: Mutex<Vec<S>>,
    generation: AtomicU64,
    /// Whether this process founded the run already (rank 0 founds at its first entry, and only then).
    founded_once: AtomicBool,
    coordinator: Mutex<Option<CoordinatorThread>>,
    /// The run's member hosts as this host last learnt them (at founding, then from each round it took part in).
    members: Mutex<Vec<HostMember>>,
    /// The generation this host entered the run as, and the first round it takes part in.
    entered: Mutex<Option<(u64, u64)>>,
    /// Why rank 0 counts as lost, once it does ([`HostLink::leader_lost`]).
    leader_lost: Mutex<Option<String>>,
    /// Store operations under way (by number, since when) and when one last came back: rank 0's silence.
    operations: Mutex<Operations>,
}

#[derive(Default)]
struct Operations {
    next: u64,
    under_way: BTreeMap<u64, Instant>,
    answered: Option<Instant>,
}

impl HostLink {
    /// Serves the store (rank 0, unless the launcher's agent does) or connects to it; nothing is announced yet.
    pub fn open(placement: &HostPlacement, deadline: Duration) -> Result<HostLink, LinkError> {
        let mut store = if placement.serves_store {
            Store::serve(placement.master_port, placement.rendezvous_timeout)?
        } else {
            Store::connect(&placement.master_addr, placement.master_port, placement.rendezvous_timeout)?
        };
        store.set_timeout(placement.leader_timeout + OPERATION_MARGIN)?;
        Ok(HostLink::over(store, placement, deadline))
    }
}

impl<S: Connection> HostLink<S> {
    /// The link of the host `placement` places, over `store` (the address in `placement` is only where rank 0's
    /// connections are shut down once it counts as lost); nothing is announced yet.
    pub fn over(store: S, placement: &HostPlacement, deadline: Duration) -> Self {
        HostLink {
            placement: placement.clone(),
            deadline,
            origin: Mutex::new(store),
            spare: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            founded_once: AtomicBool::new(false),
            coordinator: Mutex::new(None),
            members: Mutex::new(Vec::new()),
            entered: Mutex::new(None),
            leader_lost: Mutex::new(None),
            operations: Mutex::new(Operations::default()),
        }
    }

    pub fn rank(&self) -> Rank {
        self.placement.rank
    }

    pub fn hosts(&self) -> usize {
        self.placement.hosts
    }

    /// The generation this host entered the run as (0: not yet).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The generation this host entered the run as and the first round it takes part in, once it has.
    pub fn entered(&self) -> Option<(u64, u64)> {
        *self.entered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long rank 0 may stay silent before this host takes it for lost (`cluster.leader_timeout_s`).
    pub fn leader_timeout(&self) -> Duration {
        self.placement.leader_timeout
    }

    /// Rank 0 counts as lost (`why`): every later store operation fails with [`LinkError::LeaderLost`], and the
    /// connections to the store are shut down, so that operations blocked on a rank 0 that does not answer (libtorch's
    /// store has no deadline for a server that accepts and never replies) fail now, as they would had it died.
    /// Returns whether this call was the first to say so.
    pub fn leader_lost(&self, why: String) -> bool {
        {
            let mut lost = self.leader_lost.lock().unwrap_or_else(|p| p.into_inner());
            if lost.is_some() {
                return false;
            }
            *lost = Some(why);
        }
        let severed = sever_connections(&self.placement.master_addr, self.placement.master_port);
        tracing::debug!(severed, "connections to the rendezvous host shut down");
        true
    }

    /// How long rank 0 has kept a store operation waiting: the time since an operation last came back, while one is
    /// under way (`None` while none is: nothing is asked of rank 0).
    pub fn silence(&self) -> Option<Duration> {
        let ops = self.operations.lock().unwrap_or_else(|p| p.into_inner());
        let oldest = ops.under_way.values().min()?;
        Some(ops.answered.map_or(*oldest, |a| a.max(*oldest)).elapsed())
    }

    /// The run's member hosts, as this host last learnt them.
    pub fn members(&self) -> Vec<HostMember> {
        self.members.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How long a host waits for a round's decision or its entry: past the quorum's deadline, by the time a donor
    /// needs to finish its step.
    fn wait(&self) -> Duration {
        2 * self.deadline + Duration::from_secs(10)
    }

    /// Runs `f` with a connection of its own (refused once rank 0 counts as lost), keeping count of the
    /// operations waiting for rank 0.
    fn with_store<T>(&self, f: impl FnOnce(&S) -> Result<T, LinkError>) -> Result<T, LinkError> {
        if let Some(why) = self.leader_lost.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(LinkError::LeaderLost(why));
        }
        let number = {
            let mut ops = self.operations.lock().unwrap_or_else(|p| p.into_inner());
            ops.next += 1;
            let number = ops.next;
            ops.under_way.insert(number, Instant::now());
            number
        };
        let out = self.on_connection(f);
        let mut ops = self.operations.lock().unwrap_or_else(|p| p.into_inner());
        ops.under_way.remove(&number);
        if !matches!(&out, Err(e) if e.unreachable()) {
            ops.answered = Some(Instant::now());
        }
        out
    }

    fn on_connection<T>(&self, f: impl FnOnce(&S) -> Result<T, LinkError>) -> Result<T, LinkError> {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let store = match spare {
            Some(s) => s,
            None => self.origin.lock().unwrap_or_else(|p| p.into_inner()).another()?,
        };
        let out = f(&store);
        // A connection whose operation failed may be broken: it is not reused. A read that timed out, or a decision
        // against this host, says nothing against the connection.
        let broken = matches!(&out, Err(e @ LinkError::Exchange(ExchangeError::Store(_))) if !e.timed_out());
        if !broken {
            self.spare.lock().unwrap_or_else(|p| p.into_inner()).push(store);
        }
        out
    }

    fn check_coordinator(&self) -> Result<(), LinkError> {
        let guard = self.coordinator.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref().and_then(|c| c.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()) {
            Some(why) => Err(LinkError::CoordinatorStopped(why)),
            None => Ok(()),
        }
    }

    /// Checks that this host reads the same training data as rank 0 (`fingerprint`: what identifies it), which
    /// posts its own; waits up to the rendezvous timeout for it.
    pub fn agree_on_data(&self, fingerprint: &str) -> Result<(), LinkError> {
        let Some(theirs) = self.rank0_posts("dflash/data", fingerprint)? else {
            return Ok(());
        };
        if theirs != fingerprint {
            return Err(LinkError::DataDiffers { mine: fingerprint.into(), theirs });
        }
        Ok(())
    }

    /// Rank 0's settings (`settings`: [`crate::config::join_settings`] of each host), which rank 0 posts from its
    /// own: `None` on rank 0. What differs is for the caller to judge.
    pub fn rank0_settings(&self, settings: &serde_json::Value) -> Result<Option<serde_json::Value>, LinkError> {
        let Some(theirs) = self.rank0_posts("dflash/settings", &settings.to_string())? else {
            return Ok(None);
        };
        let theirs = serde_json::from_str(&theirs).map_err(|e| LinkError::Malformed {
            what: "settings",
            rank: 0,
            message: e.to_string(),
        })?;
        Ok(Some(theirs))
    }

    /// Rank 0 posts `mine` under `key` (`None`); another host reads what rank 0 posted, waiting up to the rendezvous
    /// timeout for it.
    fn rank0_posts(&self, key: &str, mine: &str) -> Result<Option<String>, LinkError> {
        if self.rank() == 0 {
            self.with_store(|s| Ok(s.set(key, mine.as_bytes())?))?;
            return Ok(None);
        }
        let theirs = self.with_store(|s| Ok(s.get(key, self.placement.rendezvous_timeout)?))?;
        Ok(Some(String::from_utf8_lossy(&theirs).into_owned()))
    }

    /// Enters the run as a new generation: rank 0 founds it the first time; every other entry waits to be admitted
    /// and takes a live host's state (and fails when no live host had one).
    pub fn enter(&self) -> Result<Entering, LinkError> {
        let rank = self.rank();
        let generation = self.with_store(|s| Ok(exchange::announce(s, rank)?))?;
        self.generation.store(generation, Ordering::SeqCst);
        if rank == 0 && !self.founded_once.load(Ordering::SeqCst) {
            return Ok(Entering::Found);
        }
        let wait = self.wait() + self.placement.rendezvous_timeout;
        match self.with_store(|s| Ok(exchange::wait_entry(s, rank, generation, wait)?))? {
            Entry::NoDonor => Err(LinkError::NoDonor),
            Entry::State(bytes) => {
                let (h, data): (StateHeader, &[u8]) = unframe(&bytes, "state", rank)?;
                let data = state_data(&h, data, rank)?;
                *self.entered.lock().unwrap_or_else(|p| p.into_inner()) = Some((generation, h.step));
                Ok(Entering::Joined(HostState {
                    step: h.step,
                    optimizer_steps: h.optimizer_steps,
                    samples_committed: h.samples_committed,
                    data,
                }))
            }
        }
    }

    /// Rank 0 founded the run at round `step` with `state` (master, moments), after [`Entering::Found`]: waits for
    /// the other hosts to announce themselves (up to the rendezvous timeout), starts the coordinator with those
    /// present as founders and hands them its state.
    pub fn founded(
        &self,
        step: u64,
        samples_committed: u64,
        optimizer_steps: u64,
        state: [&Tensor; 3],
        handover: Handover,
    ) -> Result<(), LinkError> {
        *self.entered.lock().unwrap_or_else(|p| p.into_inner()) = Some((self.generation(), step));
        debug_assert!(self.rank() == 0 && !self.founded_once.load(Ordering::SeqCst), "only rank 0 founds, once");
        self.founded_once.store(true, Ordering::SeqCst);
        let founders = self.rendezvous()?;
        self.start_coordinator(step)?;
        let me = HostMember { rank: 0, generation: self.generation(), from: step };
        let others = founders.iter().map(|a| HostMember { rank: a.rank, generation: a.generation, from: step });
        *self.members.lock().unwrap_or_else(|p| p.into_inner()) = std::iter::once(me).chain(others).collect();
        self.serve(&founders, (step, samples_committed, optimizer_steps), state, handover)
    }

    /// Waits until every host announced itself or the rendezvous timeout passed; returns the others present.
    fn rendezvous(&self) -> Result<Vec<Admitted>, LinkError> {
        let hosts = self.hosts();
        let started = std::time::Instant::now();
        loop {
            let generations = self.with_store(|s| Ok(exchange::generations(s, hosts)?))?;
            let all = generations.iter().all(|&g| g > 0);
            if all || started.elapsed() >= self.placement.rendezvous_timeout {
                if !all {
                    let missing: Vec<usize> = (0..hosts).filter(|&r| generations[r] == 0).collect();
                    tracing::warn!(?missing, "hosts missing at the rendezvous: the run starts without them");
                }
                let present = generations.iter().enumerate().skip(1).filter(|&(_, &g)| g > 0);
                return Ok(present.map(|(rank, &generation)| Admitted { rank, generation, donor: 0 }).collect());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn start_coordinator(&self, step: u64) -> Result<(), LinkError> {
        let store = self.origin.lock().unwrap_or_else(|p| p.into_inner()).another()?;
        let mut coordinator = Coordinator::new(store, self.hosts(), step, self.deadline)?;
        let failed = Arc::new(Mutex::new(None));
        let failed2 = failed.clone();
        let thread = Background::spawn("coordinator", move |stop| {
            while !stop.load(Ordering::SeqCst) {
                match coordinator.poll() {
                    Ok(Some(closed)) if !closed.dropped.is_empty() || !closed.admitted.is_empty() => {
                        let list = |items: Vec<String>| if items.is_empty() { "none".into() } else { items.join(", ") };
                        let ranks = |r: &[usize]| list(r.iter().map(|r| r.to_string()).collect());
                        tracing::info!(
                            round = closed.round,
                            members = %ranks(&closed.members),
                            dropped = %ranks(&closed.dropped),
                            admitted = %list(closed.admitted.iter().map(|a| a.to_string()).collect()),
                            "hosts changed"
                        );
                    }
                    Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                    Err(e) => {
                        tracing::error!("the coordinator stops: {e}");
                        *failed2.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                        return;
                    }
                }
            }
        })
        .map_err(|e| LinkError::CoordinatorStopped(e.to_string()))?;
        *self.coordinator.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(CoordinatorThread { failed, _thread: thread });
        Ok(())
    }

    /// Hands this host's state (at the boundary of round `step`) to each admitted host, as `handover` says (by
    /// NCCL: from this thread's device, where `state` lies).
    pub fn serve(
        &self,
        joiners: &[Admitted],
        (step, samples_committed, optimizer_steps): (u64, u64, u64),
        state: [&Tensor; 3],
        handover: Handover,
    ) -> Result<(), LinkError> {
        if joiners.is_empty() {
            return Ok(());
        }
        let elements = state.map(|t| t.numel());
        let header = |broadcast| StateHeader { step, optimizer_steps, samples_committed, elements, broadcast };
        if handover == Handover::Store {
            let bytes = frame(&header(None), &state)?;
            return self.with_store(|s| joiners.iter().try_for_each(|j| Ok(exchange::post_state(s, j, &bytes)?)));
        }
        let nccl = |e: NcclError| LinkError::Nccl(format!("broadcasting the state to {joiners:?}: {e}"));
        let id = NcclId::new().map_err(nccl)?;
        let ranks = joiners.len() + 1;
        self.with_store(|s| {
            joiners.iter().enumerate().try_for_each(|(i, j)| {
                let broadcast = BroadcastHeader { id: id.bytes().to_vec(), rank: i + 1, ranks };
                Ok(exchange::post_state(s, j, &frame(&header(Some(broadcast)), &[])?)?)
            })
        })?;
        broadcast_state(&id, 0, ranks, state).map_err(nccl)
    }

    /// Contributes this host's share to round `round` and waits for the run's round: the members' gradients summed
    /// in rank order. A host the round closed without is told so (`Dropped`): it must enter again.
    pub fn exchange(&self, round: u64, share: HostShare<'_>) -> Result<RunRound, LinkError> {
        self.check_coordinator()?;
        let (rank, generation) = (self.rank(), self.generation());
        let record = HostRecord {
            rank,
            generation,
            settings: share.settings,
            weight: share.weight,
            contributions: share.contributions,
        };
        let bytes = frame(&record, &Vec::from_iter(share.grad))?;
        let wait = self.wait();
        self.with_store(|s| {
            exchange::contribute(s, round, rank, generation, share.grad.is_none(), &bytes)?;
            let closed = exchange::wait_closed_as(s, round, rank, self.entered(), wait)?;
            if !closed.members.contains(&rank) {
                return Err(ExchangeError::Dropped { rank, round }.into());
            }
            let elements = share.grad.map(Tensor::numel);
            let mut sum: Option<Tensor> = None;
            let mut hosts = Vec::new();
            for &m in &closed.members {
                // This host's own share is the bytes it posted: no need to read them back.
                let theirs = if m == rank { None } else { Some(exchange::payload(s, round, m, wait)?) };
                let (record, data): (HostRecord, &[u8]) =
                    unframe(theirs.as_deref().unwrap_or(&bytes), "contribution", m)?;
                if let Some(grad) = gradient(data, elements, m)? {
                    sum = Some(match sum {
                        None => grad,
                        Some(mut acc) => {
                            let _ = acc.f_add_(&grad)?;
                            acc
                        }
                    });
                }
                hosts.push(record);
            }
            {
                let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
                let known = members.clone();
                *members = closed
                    .next
                    .iter()
                    .map(|&(rank, generation)| {
                        let same = known.iter().find(|m| m.rank == rank && m.generation == generation);
                        HostMember { rank, generation, from: same.map_or(round + 1, |m| m.from) }
                    })
                    .collect();
            }
            let serve = closed.admitted.iter().filter(|a| a.donor == rank && a.rank != rank).copied().collect();
            Ok(RunRound { grad: sum, hosts, serve })
        })
    }

    /// The identity of the NCCL communicator the run's drafters sum round `round` in, its membership being new: the
    /// round's lowest-ranked member host (`maker`) makes it, the others wait for it.
    pub fn ring_id(&self, round: u64, maker: Rank) -> Result<NcclId, LinkError> {
        let wait = self.wait();
        self.with_store(|s| {
            if maker == self.rank() {
                let id = NcclId::new().map_err(|e| LinkError::Nccl(e.to_string()))?;
                exchange::post_ring(s, round, id.bytes())?;
                return Ok(id);
            }
            let bytes = exchange::ring(s, round, wait)?;
            NcclId::from_bytes(&bytes).ok_or_else(|| LinkError::Malformed {
                what: "NCCL identity",
                rank: maker,
                message: format!("{} bytes, not 128", bytes.len()),
            })
        })
    }

    /// With NCCL, after round `round`'s all-reduce: says whether this host's drafters all summed, and waits for
    /// whether the round's update applies on every host (only if every member host summed; rank 0 decides).
    pub fn settle_sum(&self, round: u64, summed: bool) -> Result<bool, LinkError> {
        self.check_coordinator()?;
        let (rank, generation, wait) = (self.rank(), self.generation(), self.wait());
        self.with_store(|s| {
            exchange::post_summed(s, round, rank, generation, summed)?;
            Ok(exchange::wait_applied(s, round, wait)?)
        })
    }

    /// Rank 0: what host `rank` (as `generation`) trains at step `step` (bytes the supervisor reads back).
    pub fn feed(&self, rank: Rank, generation: u64, step: u64, items: &[u8]) -> Result<(), LinkError> {
        self.with_store(|s| Ok(exchange::post_feed(s, rank, generation, step, items)?))
    }

    /// Says this host's process is alive (its feed reader calls this about every [`exchange::BEAT_EVERY`], through a
    /// connection it already holds): rank 0 takes a member silent for [`exchange::GONE_AFTER`] for gone.
    pub fn beat(&self) -> Result<(), LinkError> {
        self.with_store(|s| Ok(exchange::beat(s, self.rank())?))
    }

    /// What this host trains at `step`, waiting up to `timeout`; `None` when it has not been posted by then.
    pub fn wait_feed(&self, generation: u64, step: u64, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let rank = self.rank();
        match self.with_store(|s| Ok(exchange::take_feed(s, rank, generation, step, timeout)?)) {
            Err(e) if e.timed_out() => Ok(None),
            other => other.map(Some),
        }
    }

    /// Rank 0: the run ended with exit status `code`; waits up to `timeout` for `hosts` other hosts to have seen
    /// it (they end too), so that they do not find the store gone first. The coordinator stops.
    pub fn finish(&self, code: i32, hosts: usize, timeout: Duration) -> Result<(), LinkError> {
        self.coordinator.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.with_store(|s| Ok(exchange::post_finished(s, code)?))?;
        let started = std::time::Instant::now();
        while started.elapsed() < timeout {
            if self.with_store(|s| Ok(exchange::finished_acks(s)?))? >= hosts {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Another host saw the run end.
    pub fn acknowledge_end(&self) -> Result<(), LinkError> {
        self.with_store(|s| Ok(exchange::acknowledge_finished(s)?))
    }

    /// The generation this host entered the run as, and whether it is still a member, by the membership rank 0
    /// posted at its last round (`None`: not entered yet, or nothing posted since it entered).
    pub fn still_member(&self) -> Result<Option<(u64, bool)>, LinkError> {
        let Some(entered) = self.entered() else { return Ok(None) };
        let members = self.with_store(|s| Ok(exchange::members(s)?))?;
        Ok(members.and_then(|m| exchange::still_member(self.rank(), entered, &m)).map(|still| (entered.0, still)))
    }

    /// The run's exit status, once rank 0 ended it.
    pub fn finished(&self) -> Result<Option<i32>, LinkError> {
        self.with_store(|s| Ok(exchange::finished(s)?))
    }
}

/// Shuts down this process's TCP connections to `addr:port` (the store's): operations blocked on them fail at once.
/// Returns how many it shut down.
fn sever_connections(addr: &str, port: u16) -> usize {
    use std::net::ToSocketAddrs;
    let peers: Vec<std::net::IpAddr> =
        (addr, port).to_socket_addrs().map(|a| a.map(|a| a.ip()).collect()).unwrap_or_default();
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return 0 };
    let mut severed = 0;
    for fd in fds.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()) {
        // SAFETY: sockaddr_storage is plain old data, valid when all zero.
        let mut peer: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: `peer` is a writable sockaddr_storage of `len` bytes; a descriptor that is not a connected socket
        // makes getpeername fail, and it is then left alone.
        if unsafe { libc::getpeername(fd, (&raw mut peer).cast(), &mut len) } != 0 {
            continue;
        }
        let (ip, peer_port) = match i32::from(peer.ss_family) {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in.
                let a = unsafe { *(&raw const peer).cast::<libc::sockaddr_in>() };
                (std::net::IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes()), u16::from_be(a.sin_port))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the storage holds a sockaddr_in6.
                let a = unsafe { *(&raw const peer).cast::<libc::sockaddr_in6>() };
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                (ip.to_ipv4_mapped().map_or(std::net::IpAddr::V6(ip), std::net::IpAddr::V4), u16::from_be(a.sin6_port))
            }
            _ => continue,
        };
        if peer_port == port && peers.contains(&ip) {
            // SAFETY: shutting down a connected socket this process owns; the descriptor stays open (libtorch's
            // store object closes it), its blocked reads return.
            if unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } == 0 {
                severed += 1;
            }
        }
    }
    severed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member that sums the other way (NCCL against the store) is refused by name, whichever side this host is.
    #[test]
    fn a_member_summing_the_other_way_is_refused_by_name() {
        let floats: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let sum = gradient(&floats, Some(2), 1).unwrap().unwrap();
        assert_eq!(Vec::<f32>::try_from(&sum).unwrap(), [1.0, 2.0]);
        assert!(gradient(&[], None, 1).unwrap().is_none());
        for err in [gradient(&[], Some(2), 3).unwrap_err(), gradient(&floats, None, 3).unwrap_err()] {
            let err = err.to_string();
            assert!(err.contains("host 3") && err.contains("drafters.collective"), "{err}");
        }
    }

    /// Two hosts' links over one in-memory store, without TCP: rank 1 announces itself and waits; rank 0 founds the
    /// run and hands it its state; then both contribute to the first round and get the same run's round (the
    /// gradients summed in rank order, every host's record, the loss weight and samples of both).
    #[test]
    fn two_links_over_one_memory_store_enter_and_sum_a_round() {
        use crate::cluster::store::MemoryStore;
        let store = Arc::new(MemoryStore::new());
        let placement = |rank| HostPlacement {
            hosts: 2,
            rank,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            serves_store: rank == 0,
            rendezvous_timeout: Duration::from_secs(20),
            leader_timeout: Duration::from_secs(30),
        };
        let deadline = Duration::from_secs(20);
        let links = [0, 1].map(|rank| Arc::new(HostLink::over(store.clone(), &placement(rank), deadline)));
        let joiner = {
            let link = links[1].clone();
            std::thread::spawn(move || match link.enter() {
                Ok(Entering::Joined(state)) => {
                    let into = [
                        Tensor::zeros([3], (Kind::Float, Device::Cpu)),
                        Tensor::zeros([2], (Kind::Float, Device::Cpu)),
                        Tensor::zeros([1], (Kind::Float, Device::Cpu)),
                    ];
                    state.fill([&into[0], &into[1], &into[2]]).unwrap();
                    (
                        state.step,
                        state.samples_committed,
                        state.optimizer_steps,
                        into.map(|t| Vec::<f32>::try_from(&t).unwrap()),
                    )
                }
                Ok(Entering::Found) => panic!("rank 1 founded the run"),
                Err(e) => panic!("rank 1 did not enter: {e}"),
            })
        };
        assert!(matches!(links[0].enter().unwrap(), Entering::Found));
        let state = [
            Tensor::from_slice(&[1.0f32, 2.0, 3.0]),
            Tensor::from_slice(&[4.0f32, 5.0]),
            Tensor::from_slice(&[6.0f32]),
        ];
        links[0].founded(4, 100, 4, [&state[0], &state[1], &state[2]], Handover::Store).unwrap();
        let (step, samples, updates, got) = joiner.join().unwrap();
        assert_eq!((step, samples, updates), (4, 100, 4));
        assert_eq!(got, [vec![1.0, 2.0, 3.0], vec![4.0, 5.0], vec![6.0]]);
        assert_eq!(links.each_ref().map(|l| l.entered()), [Some((1, 4)), Some((1, 4))]);

        let settings = (
            crate::train::optim::Hyper::constant_for_tests(1e-3).update(0, 0),
            ObjectiveKnobs { num_anchors: 4, gamma: None },
        );
        let rounds: Vec<_> = links
            .iter()
            .map(|link| {
                let link = link.clone();
                std::thread::spawn(move || {
                    let r = link.rank() as f32;
                    let grad = Tensor::from_slice(&[r + 1.0, 10.0 * (r + 1.0)]);
                    let part = DrafterPart {
                        drafter: 0,
                        generation: 1,
                        batches: vec![],
                        samples: 3 + link.rank() as u64,
                        metrics: Metrics::default(),
                        digest: None,
                    };
                    let share = HostShare { grad: Some(&grad), settings, weight: 1.5, contributions: vec![part] };
                    link.exchange(4, share).unwrap()
                })
            })
            .collect();
        for round in rounds.into_iter().map(|r| r.join().unwrap()) {
            assert_eq!(Vec::<f32>::try_from(round.grad.as_ref().unwrap()).unwrap(), [3.0, 30.0]);
            let samples: u64 = round.hosts.iter().map(HostRecord::samples).sum();
            let weight: f64 = round.hosts.iter().map(|h| h.weight).sum();
            assert_eq!((samples, weight), (7, 3.0));
            assert_eq!(round.hosts.iter().map(|h| h.rank).collect::<Vec<_>>(), [0, 1]);
        }
    }

    fn state_of(bytes: &[u8]) -> Result<HostState, LinkError> {
        let (h, data): (StateHeader, &[u8]) = unframe(bytes, "state", 2)?;
        let data = state_data(&h, data, 2)?;
        Ok(HostState { step: h.step, optimizer_steps: h.optimizer_steps, samples_committed: h.samples_committed, data })
    }

    /// Through the store the state follows its header; by broadcast only the header and the donor's communicator
    /// travel, each joiner with its own rank. Either way a joiner's buffers of another size are refused before
    /// anything is copied or any communicator is joined.
    #[test]
    fn a_state_comes_after_its_header_or_by_the_donors_broadcast() {
        let state = [Tensor::from_slice(&[1.0f32, 2.0]), Tensor::from_slice(&[3.0f32]), Tensor::from_slice(&[4.0f32])];
        let header = |broadcast| StateHeader {
            step: 7,
            optimizer_steps: 5,
            samples_committed: 28,
            elements: [2, 1, 1],
            broadcast,
        };
        let bytes = frame(&header(None), &[&state[0], &state[1], &state[2]]).unwrap();
        let into = [
            Tensor::zeros([2], (Kind::Float, Device::Cpu)),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        ];
        let host = state_of(&bytes).unwrap();
        assert_eq!((host.step, host.optimizer_steps, host.samples_committed), (7, 5, 28));
        host.fill([&into[0], &into[1], &into[2]]).unwrap();
        assert!(into.iter().zip(&state).all(|(a, b)| a.equal(b)));
        assert!(state_of(&bytes[..bytes.len() - 4]).unwrap_err().to_string().contains("bytes for 4 floats"));

        let id = NcclId::new().unwrap();
        let cast = |rank, ranks| BroadcastHeader { id: id.bytes().to_vec(), rank, ranks };
        let announced = frame(&header(Some(cast(2, 3))), &[]).unwrap();
        let host = state_of(&announced).unwrap();
        assert!(matches!(host.data, StateData::Broadcast { rank: 2, ranks: 3, elements: [2, 1, 1], id: i } if i == id));
        let small = [Tensor::zeros([1], (Kind::Float, Device::Cpu)), into[1].shallow_clone(), into[2].shallow_clone()];
        let err = host.fill([&small[0], &small[1], &small[2]]).unwrap_err().to_string();
        assert!(err.contains("[2, 1, 1]") && err.contains("[1, 1, 1]"), "{err}");

        // The donor is rank 0; data after a broadcast header, or an identity of another length, is malformed.
        let mut bad_id = header(Some(cast(1, 2)));
        bad_id.broadcast.as_mut().unwrap().id.pop();
        for bad in [
            frame(&header(Some(cast(0, 2))), &[]).unwrap(),
            frame(&header(Some(cast(2, 2))), &[]).unwrap(),
            frame(&header(Some(cast(1, 2))), &[&state[0], &state[1], &state[2]]).unwrap(),
            frame(&bad_id, &[]).unwrap(),
        ] {
            let err = state_of(&bad).unwrap_err().to_string();
            assert!(err.starts_with("malformed state from host 2"), "{err}");
        }
    }
}
