//! What `GET /status` reports (and `/readyz`, `/metrics` and the progress line read): the run's phase and progress,
//! each drafter's and target copy's state, the checkpoint writer, the ledger, the last evaluation and, with several
//! hosts, the other members. The supervisor builds it; the control plane only reads it.
use std::path::Path;

use serde::Serialize;

use super::evaluator::Evaluated;
use super::supervisor::run_progress::Estimate;
use crate::train::checkpoint::TrainerState;

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
    /// `data.stream`: the waves taken so far, and whether the run is waiting for the next.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamStatus>,
}

/// See [`Status::stream`].
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct StreamStatus {
    pub waves: usize,
    pub waiting_for_a_wave: bool,
    /// New conversations that qualify but do not make a wave yet (fewer than `data.stream_min_conversations`).
    pub pending_conversations: usize,
    /// Seconds until those make a wave by having waited `data.stream_max_wait_s` (absent: none wait, or no bound).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wave_due_in_s: Option<f64>,
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
