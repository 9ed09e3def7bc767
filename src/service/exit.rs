//! How a run ends: the exit statuses `serve-train` reports to its orchestrator, and the signals that stop it.
//! Every part of the service reads them (the supervisor decides them, the actors' messages carry the signal).

/// The run is complete (and only then: a stop before completion is not a success an orchestrator may stop at).
pub const EXIT_OK: i32 = 0;
/// An error: a checkpoint or export at the end of the run could not be written, or start-up failed.
pub const EXIT_ERROR: i32 = 1;
/// The run cannot go on: fewer than `supervision.min_live_drafters` drafters are left that are not failed for good,
/// or a target copy failed past its restart limit. The newest valid checkpoint is kept; fix the cause, then resume.
pub const EXIT_NO_PROGRESS: i32 = 3;
/// Restart the service with `--resume auto`: an error poisoned a device, the run's end could not checkpoint in
/// time, the data ledger cannot be written, or another process holds `checkpoint.dir`.
pub const EXIT_RESTART: i32 = 75;
/// Stopped by SIGINT before the run was complete, after its checkpoint (128 + 2, as a shell reports it).
pub const EXIT_INTERRUPTED: i32 = 130;
/// Stopped by SIGTERM before the run was complete, after its checkpoint (128 + 15): preemption. Kubeflow retries
/// 128-255 and treats 1-127 as permanent; Kubernetes Jobs and systemd restart any status but 0.
pub const EXIT_TERMINATED: i32 = 143;

/// The signal that asks the run to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGTERM: an orchestrator stopping (or preempting) the process.
    Terminate,
    /// SIGINT: Ctrl-C.
    Interrupt,
}

impl StopSignal {
    /// The status a run stopped by this signal before completion exits with.
    pub fn exit_code(self) -> i32 {
        match self {
            StopSignal::Terminate => EXIT_TERMINATED,
            StopSignal::Interrupt => EXIT_INTERRUPTED,
        }
    }
}

/// A stop before completion that went as asked (its checkpoint written): restartable, but not an error.
pub fn is_stop(code: i32) -> bool {
    code == EXIT_TERMINATED || code == EXIT_INTERRUPTED
}
