//! The messages between the supervisor, the target and drafter actors and their compute threads (the status the
//! control plane reports is [`super::status`]'s).
use std::sync::Arc;

use ractor::RpcReplyPort;

use super::failure::{FaultKind, FaultRefused};
use super::reload::{Accepted, Reloaded};
use super::status::Status;
use super::supervisor::protocol::{Event, Order};
use crate::data::loader::BatchId;
use crate::model::shared::SharedTensor;
use crate::train::FeatureBatch;
use crate::train::checkpoint::Snapshot;

/// What a drafter's compute thread receives, in order.
pub enum Work {
    /// One micro-batch of its next step.
    Features { batch: BatchId, features: Box<FeatureBatch> },
    /// No batch for one micro-batch of its next step (the data ran out): it contributes nothing.
    Empty,
    /// What the core told it (at its next step boundary; a checkpoint's snapshot now if it is there, else when it
    /// gets there).
    Order(Order),
}

/// The target's frozen embedding and LM head, lent to the drafters.
pub struct Heads {
    pub embed: SharedTensor,
    pub lm_head: SharedTensor,
}

/// Where a reload's answer goes (`POST /reload`; SIGHUP has none).
pub type ReloadReply = RpcReplyPort<Result<Reloaded, String>>;

/// A reread configuration that may replace the running one, and the evaluation's prompts and rows read for it.
pub struct Reread {
    pub accepted: Accepted,
    pub eval_set: Option<crate::service::evaluator::EvalSet>,
}

/// Messages of the supervisor actor: the core's own events, which the shell passes on as they are (a drafter's
/// readiness, a delivery, a round, the export's, the ledger's and rank 0's outcomes), and what the shell itself
/// must handle first (what carries tensors, replies or files the core never holds).
pub enum SupervisorMsg {
    /// An event for the core, as is.
    Core(Event),
    TargetReady {
        target: usize,
        generation: u64,
        heads: Arc<Heads>,
    },
    Snapshot {
        id: usize,
        generation: u64,
        snapshot: Box<Snapshot>,
    },
    Tick,
    Fault {
        id: usize,
        kind: FaultKind,
        reply: RpcReplyPort<Result<(), FaultRefused>>,
    },
    /// A panic at target copy `id`'s next capture, where it enters `part` (fault injection).
    TargetFault {
        id: usize,
        part: usize,
        reply: RpcReplyPort<Result<(), FaultRefused>>,
    },
    CheckpointNow(RpcReplyPort<Result<u64, String>>),
    /// Reread the configuration (SIGHUP, `POST /reload`).
    Reload(Option<ReloadReply>),
    /// The configuration as a blocking thread reread it (with the evaluation prompts it turned on), to apply.
    Reread {
        reread: Box<Result<Option<Reread>, String>>,
        reply: Option<ReloadReply>,
    },
    Status(RpcReplyPort<Status>),
    /// Several hosts, rank > 0: word from rank 0 for this host as `generation` (an assignment, or that its
    /// membership no longer lists it), dropped when the host is another generation by now.
    ForGeneration {
        generation: u64,
        event: Event,
    },
}
