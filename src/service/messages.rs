//! The messages between the supervisor, the target and drafter actors and their compute threads, and the status
//! the control plane reports.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ractor::RpcReplyPort;
use serde::Serialize;

use super::evaluator::Evaluated;
use super::failure::{Failure, FaultKind, FaultRefused};
use super::reload::Accepted;
use super::supervisor::run_progress::Estimate;
use crate::config::Change;
use crate::data::loader::BatchId;
use crate::model::shared::SharedTensor;
use crate::train::FeatureBatch;
use crate::train::checkpoint::{Scan, Snapshot, TrainerState, Written};
use crate::train::collective::RoundReport;
use crate::train::step::UpdateReport;

/// What a drafter's compute thread receives, in order.
pub enum Work {
    /// One micro-batch of its next step.
    Features {
        batch: BatchId,
        features: Box<FeatureBatch>,
    },
    /// No batch for one micro-batch of its next step (the data ran out): it contributes nothing.
    Empty,
    /// Copy this replica's state into waiting joiners (at its next step boundary).
    ServeJoiners,
    /// Snapshot the state for a checkpoint at step boundary `at` (now if it is there, else when it gets there).
    Checkpoint {
        at: u64,
    },
    Stop,
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

/// Messages of the supervisor actor.
pub enum SupervisorMsg {
    TargetReady {
        target: usize,
        generation: u64,
        heads: Arc<Heads>,
    },
    /// A target copy passed request `seq` (a batch's features, or an empty slot) on to its drafter.
    Delivered {
        target: usize,
        generation: u64,
        seq: u64,
    },
    DrafterReady {
        id: usize,
        generation: u64,
    },
    /// The drafter has the peers' state; its first round is `step`.
    DrafterJoined {
        id: usize,
        generation: u64,
        step: u64,
    },
    StepDone {
        id: usize,
        generation: u64,
        step: u64,
        report: UpdateReport,
        /// Checksums of parameters and both moments, on steps where replicas are compared.
        digest: Option<[i64; 3]>,
        /// Seconds the compute thread waited for this step's features (the target not keeping up).
        feature_wait_s: f64,
    },
    Snapshot {
        id: usize,
        generation: u64,
        snapshot: Box<Snapshot>,
    },
    Round(RoundReport),
    /// The writer's answer.
    CheckpointWritten(Written),
    /// The answer to a look for the checkpoint to rewind to.
    CheckpointFound(Result<Scan, String>),
    /// The final export finished.
    Exported(Result<PathBuf, String>),
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
    /// The evaluation thread finished a job.
    Evaluated(Result<Evaluated, String>),
    Status(RpcReplyPort<Status>),
    /// The ledger writer's outcome of one attempt.
    LedgerWritten(Result<u64, String>),
    /// SIGTERM/SIGINT: finish the current steps, checkpoint, exit 143/130 (0 when the run is complete meanwhile).
    Shutdown(super::exit::StopSignal),
    /// Several hosts, rank > 0: rank 0's assignment of a step, for the generation this host entered as.
    Fed {
        generation: u64,
        step: u64,
        feed: crate::service::supervisor::protocol::Feed,
    },
    /// Several hosts, rank > 0: rank 0 ended the run.
    RunEnded {
        code: i32,
    },
    /// Several hosts, rank > 0: the rendezvous host cannot be reached.
    RendezvousLost(String),
    /// Several hosts, rank > 0: rank 0's membership no longer lists this host as `generation`.
    LeftRun {
        generation: u64,
    },
}

/// A compute thread's end, reported to its actor: a failure makes the actor fail, a return makes it stop, so the
/// supervisor sees either.
pub enum ThreadMsg {
    Died(Failure),
    Returned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DrafterState {
    Starting,
    Live,
    Restarting,
    Joining,
    Failed,
}

impl DrafterState {
    /// As `/status` and the `dflash_drafter_state` series spell it.
    pub fn name(self) -> &'static str {
        match self {
            DrafterState::Starting => "starting",
            DrafterState::Live => "live",
            DrafterState::Restarting => "restarting",
            DrafterState::Joining => "joining",
            DrafterState::Failed => "failed",
        }
    }
}

/// The data ledger's writes (`data.ledger`).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct LedgerStatus {
    /// Write attempts that failed in this process.
    pub failures: u64,
    /// Failed since the last write that succeeded (not ready while above 0).
    pub failing_in_row: u32,
    pub last_error: Option<String>,
}

/// The checkpoint writer.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct WriterStatus {
    /// The step of the checkpoint being written, and for how long.
    pub writing_step: Option<u64>,
    pub busy_s: Option<f64>,
    /// Busy past `supervision.shutdown_timeout_s` (not ready while so).
    pub stalled: bool,
    /// Checkpoints that fell due while another was in flight, in this process.
    pub skipped: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DrafterStatus {
    pub id: usize,
    pub device: String,
    pub state: DrafterState,
    pub step: u64,
    pub restarts: u64,
}

/// A copy of the target that captures features (`target.capture_devices`).
#[derive(Debug, Clone, Serialize)]
pub struct TargetStatus {
    pub id: usize,
    pub device: String,
    pub ready: bool,
    pub restarts: u64,
    /// The drafters it feeds.
    pub drafters: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckpointStatus {
    pub step: u64,
    pub path: String,
    pub age_s: f64,
}

/// A reload that was applied.
#[derive(Debug, Clone, Serialize)]
pub struct Reloaded {
    pub config_version: u64,
    /// The first step trained with the new values (on every drafter); `None` when nothing changed.
    pub applies_from_step: Option<u64>,
    pub changes: Vec<Change>,
}

/// `GET /status` (before the supervisor runs: [`Status::before_start`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    pub phase: String,
    /// The service's process id (to signal it: `kill -HUP <pid>` rereads the configuration).
    pub pid: u32,
    /// Training can go on: running, not stopping, at least one drafter live, the ledger written, the checkpoint
    /// writer not stalled (`GET /readyz`).
    pub ready: bool,
    /// What is wrong now, in words (empty when nothing is).
    pub problems: Vec<String>,
    pub step: u64,
    /// How far the run is, the step it ends at and the time left at the recent rate.
    pub progress: Estimate,
    pub epoch: u64,
    pub samples_committed: u64,
    pub samples_requeued: u64,
    pub batches_set_aside: u64,
    pub skipped_steps: u64,
    /// The last step at which every replica's checksums agreed, and how many checks found them different.
    pub replicas_checked_step: Option<u64>,
    pub replicas_diverged: u64,
    pub config_version: u64,
    pub drafters: Vec<DrafterStatus>,
    pub targets: Vec<TargetStatus>,
    pub last_checkpoint: Option<CheckpointStatus>,
    pub checkpoint_writer: WriterStatus,
    pub ledger: LedgerStatus,
    pub last_evaluation: Option<Evaluated>,
    /// Several hosts: `"rank 0"` or `"follower"` (absent on one host).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_role: Option<&'static str>,
    /// Several hosts, rank 0: the other member hosts, each with its generation and first round.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub other_hosts: Vec<crate::train::link::HostMember>,
}

impl Status {
    /// What `/status` says before the supervisor runs: the `phase`, what the process waits for, and where the run
    /// stands: the checkpoint it resumes (`resume`), as the supervisor says from its first answer on. Without this a
    /// resumed run said step 0 until its supervisor ran (for minutes while several hosts meet).
    pub fn before_start(phase: &str, waiting_for: String, resume: Option<(&Path, &TrainerState)>) -> Status {
        let mut status = Status { phase: phase.into(), problems: vec![waiting_for], ..Status::default() };
        if let Some((path, state)) = resume {
            status.step = state.step;
            status.epoch = state.loader.epoch;
            status.samples_committed = state.samples_committed;
            status.skipped_steps = state.skipped_steps;
            status.batches_set_aside = state.set_aside.len() as u64;
            status.last_checkpoint =
                Some(CheckpointStatus { step: state.step, path: path.display().to_string(), age_s: 0.0 });
        }
        status
    }
}
