//! What the supervisor's core takes in and gives out. Events are facts reported by threads, timers, the control
//! plane and signals; actions are what the shell (the ractor actor, or the simulation) carries out. Some actions
//! answer with an event: `Abandon` with `MemberRemoved`, `FindCheckpoint` with `CheckpointFound`, `WriteCheckpoint`
//! with `CheckpointWritten`, `Export` with `Exported`.
use std::path::PathBuf;

use super::run_progress::Estimate;
use super::survivor::RunPosition;
use crate::config::Config;
use crate::data::loader::{Batch, BatchId};
use crate::service::evaluator::Evaluated;
use crate::service::failure::Failure;
use crate::service::live::ProgressPoint;
use crate::train::checkpoint::{Scan, Written};
use crate::train::collective::RoundReport;

pub use super::checkpoints::{ScanFilter, WriteJob};
pub use super::schedule::Item;
pub use super::targets::Request;
pub use super::watchdog::{Activity, DrafterSeen};

/// Where a drafter thread's first state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// The only member of an empty collective: a checkpoint folder, or fresh weights from the seed.
    Found(Option<PathBuf>),
    /// Copies a live member's state.
    Join,
}

/// What a drafter thread is told between its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Copy this replica's state into waiting joiners.
    ServeJoiners,
    /// Snapshot the state for a checkpoint at step boundary `at` (the first step not yet handed out: the drafter
    /// cannot be past it), so that the checkpoint's step is known when it is asked for.
    Checkpoint {
        at: u64,
    },
    Stop,
}

/// A line of the data ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerEntry {
    Commit {
        step: u64,
        batch: Batch,
    },
    /// The run went back to `step`: entries of that step and later were undone.
    Rewind {
        step: u64,
    },
}

#[derive(Debug, Clone)]
pub enum Event {
    /// Time passed (the shell ticks a few times a second).
    Tick,
    /// The process did not run for `for_`, up to now (its tick came that late: see
    /// [`TickGaps`](super::watchdog::TickGaps)).
    Stopped {
        for_: std::time::Duration,
    },
    /// What each running drafter thread is doing, for the watchdog (the shell sends it with its ticks).
    Watch(Vec<DrafterSeen>),
    TargetReady {
        target: usize,
        generation: u64,
    },
    /// A target thread failed (or returned without being asked to).
    TargetFailed {
        target: usize,
        generation: u64,
        failure: Failure,
    },
    /// A target thread passed request `seq` on to its drafter.
    Delivered {
        target: usize,
        generation: u64,
        seq: u64,
    },
    /// A drafter thread built its model (a joiner has registered its join request).
    DrafterReady {
        id: usize,
        generation: u64,
    },
    /// A drafter thread is a member of the collective; its first round is `step`.
    DrafterJoined {
        id: usize,
        generation: u64,
        step: u64,
    },
    /// A drafter thread failed (or was found hung, or returned without being asked to); `running`: the batches it
    /// was computing; `injected`: a rehearsed fault, not held against those batches or the device.
    DrafterFailed {
        id: usize,
        generation: u64,
        failure: Failure,
        running: Vec<BatchId>,
        injected: bool,
    },
    /// The answer to `Abandon`: who is left in the collective, `(id, generation)`.
    MemberRemoved {
        remaining: Vec<(usize, u64)>,
    },
    /// A drafter applied a round; its state's checksums when replicas are compared at this step.
    StepDone {
        id: usize,
        generation: u64,
        step: u64,
        /// Checksums of parameters and both moments, on steps where replicas are compared.
        digest: Option<[i64; 3]>,
        /// False when the update was skipped (a gradient norm not finite, a sum across hosts not complete).
        applied: bool,
        /// Seconds the compute thread waited for this step's features (the target not keeping up).
        feature_wait_s: f64,
    },
    Round(RoundReport),
    /// A drafter took the snapshot it was asked for, at boundary `step` (the shell holds the tensors).
    Snapshot {
        id: usize,
        generation: u64,
        step: u64,
        optimizer_steps: u64,
    },
    /// The writer's answer for the checkpoint of a step written in an incarnation: its folder and seconds.
    CheckpointWritten(Written),
    /// A rewind's scan: the newest valid checkpoint (none: start from the beginning) and the folders it rejected.
    CheckpointFound(Result<Scan, String>),
    Evaluated(Result<Evaluated, String>),
    Exported(Result<PathBuf, String>),
    /// The ledger writer's outcome of one attempt: every line so far written, or why not.
    LedgerWritten(Result<u64, String>),
    /// A reload was accepted: the new configuration.
    Reconfigured(Box<Config>),
    /// SIGTERM or SIGINT.
    Shutdown(crate::service::exit::StopSignal),
    /// Several hosts, rank 0: the run's member hosts changed.
    Hosts(Vec<crate::train::link::HostMember>),
    /// Several hosts, other ranks: rank 0's items for a step, `(drafter, item)`, and where the run stood when it
    /// posted them.
    Fed {
        step: u64,
        items: Vec<(usize, Item)>,
        position: Option<Box<RunPosition>>,
    },
    /// Several hosts, other ranks: rank 0 ended the run with this status.
    RunEnded {
        code: i32,
    },
    /// Several hosts, other ranks: the rendezvous host cannot be reached.
    RendezvousLost(String),
    /// Several hosts, other ranks: rank 0 dropped this host from the run (it missed a round's deadline, or its beat
    /// stopped: it was stopped or cut off for a while).
    LeftRun,
    /// `data.stream`: wave `number` arrived, samples of `lengths` with `ids`, already in the dataset at the positions
    /// after every known one.
    Wave {
        number: u64,
        lengths: Vec<usize>,
        ids: Vec<crate::data::SampleId>,
    },
    /// `data.stream`: what its last look found short of a wave: conversations that qualify, and how long until they
    /// make one by having waited (`None`: only more conversations make it). Told when it changes.
    StreamPending {
        conversations: usize,
        due_in: Option<std::time::Duration>,
    },
}

/// What the shell reports to metrics and logs (the core decides nothing more by them).
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    Committed {
        step: u64,
        samples: u64,
        tokens: u64,
        loss: Option<[f64; 3]>,
        /// Where the run stands against its end after this step.
        estimate: Estimate,
    },
    /// A step's update was skipped on every replica.
    Skipped,
    Requeued {
        samples: u64,
    },
    Restarted {
        id: usize,
    },
    ReplicasDiverged,
    CheckpointOutcome(Option<(u64, f64)>),
    /// A ledger write failed, or succeeded after failures.
    LedgerWrite {
        ok: bool,
    },
    /// The checkpoint writer was found busy past its deadline (true), or answered after that (false).
    WriterStalled(bool),
    /// A checkpoint fell due while another was in flight.
    CheckpointSkipped,
    Evaluated(Result<Evaluated, String>),
    /// A progress line's numbers (`time` is the shell's to fill in), for the live page's charts.
    Progress(ProgressPoint),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Stop target thread `generation` (it failed or hung): it must deliver nothing more.
    AbandonTarget {
        target: usize,
        generation: u64,
    },
    StartTarget {
        target: usize,
        generation: u64,
    },
    /// Send to target copy `target`'s thread `generation`.
    TargetRequest {
        target: usize,
        generation: u64,
        request: Request,
    },
    SpawnDrafter {
        id: usize,
        generation: u64,
        start: Start,
    },
    /// Give up on the thread: remove it from the collective (its join request too) and from the routes, stop its
    /// actor, let it stop quietly if it ever wakes. Answered by `MemberRemoved`.
    Abandon {
        id: usize,
        generation: u64,
    },
    Tell {
        id: usize,
        generation: u64,
        order: Order,
    },
    /// Move the (empty) collective to `step` after `samples_committed` samples, as a new incarnation; the writer
    /// discards writes of older incarnations still in progress.
    RewindCollective {
        step: u64,
        samples_committed: u64,
    },
    /// Find the newest valid checkpoint the filter allows. Answered by `CheckpointFound`.
    FindCheckpoint(ScanFilter),
    WriteCheckpoint(WriteJob),
    /// Move the checkpoint folders of steps `from..=to` aside (renamed, never deleted), in order with the writes.
    RetireCheckpoints {
        from: u64,
        to: u64,
    },
    /// The shell may drop the snapshot it holds from this drafter thread `(id, generation)` at this step (or every
    /// one it holds, `None`).
    DropSnapshots {
        which: Option<(usize, u64, u64)>,
    },
    Evaluate {
        step: u64,
        path: PathBuf,
    },
    Ledger(LedgerEntry),
    /// Export the drafter of checkpoint `from` (bf16, published format) to `checkpoint.dir/final`. Answered by
    /// `Exported`.
    Export {
        from: PathBuf,
    },
    Notice(Notice),
    /// Several hosts, rank 0: what host `rank` (as `generation`) trains at `step`, `(drafter, item)`, with where
    /// the run stands (the host checkpoints from it if rank 0 is lost).
    Feed {
        rank: usize,
        generation: u64,
        step: u64,
        items: Vec<(usize, Item)>,
        position: Box<RunPosition>,
    },
    /// The run is over: stop with this exit status.
    Exit {
        code: i32,
    },
}

/// What rank 0 posts another host for one step, as it crosses the store (JSON).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Feed {
    /// `(drafter, item)`.
    pub items: Vec<(usize, Item)>,
    pub position: Option<Box<RunPosition>>,
}
