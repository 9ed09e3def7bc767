//! Why a compute thread stopped, and what that allows: panics, libtorch errors (out-of-memory included) and hangs
//! are restarted in process; errors that poison a CUDA context or the process (an illegal address, a device lost)
//! are not: the service checkpoints from a healthy replica and exits for an outside restart.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    Panic,
    Torch,
    OutOfMemory,
    /// Busy (computing, summing, applying, copying) past the hang budget: counted against its device.
    Hang,
    /// Waited past the hang budget for work or peers that never came, with no one else to blame: restarted, not
    /// counted against its device.
    Stalled,
    /// An injected fault of kind `error`.
    Injected,
    Poisoned,
    /// A founder could not load the checkpoint it was to start from (the supervisor passes that one over).
    CheckpointLoad,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

/// Messages of CUDA errors after which the context (or the process) cannot be trusted.
const POISONED: [&str; 9] = [
    "illegal memory access",
    "an illegal address",
    "misaligned address",
    "illegal instruction",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ecc error",
    "gpu has fallen off the bus",
    "device lost",
];

impl Failure {
    /// Classifies a libtorch error message.
    pub fn from_torch(message: &str) -> Self {
        let lower = message.to_lowercase();
        let kind = if POISONED.iter().any(|p| lower.contains(p)) {
            FailureKind::Poisoned
        } else if lower.contains("out of memory") {
            FailureKind::OutOfMemory
        } else {
            FailureKind::Torch
        };
        Failure { kind, message: message.to_string() }
    }

    pub fn panic(message: String) -> Self {
        Failure { kind: FailureKind::Panic, message }
    }

    /// A compute thread that returned without being asked to.
    pub fn ended() -> Self {
        Failure::panic("the thread ended without being asked to".into())
    }

    /// Whether the drafter may restart in this process.
    pub fn restartable(&self) -> bool {
        self.kind != FailureKind::Poisoned
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// Faults an operator (or a test) can inject into a drafter's next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    Panic,
    Error,
    Hang,
    /// The next checkpoint write pauses after its first file.
    CheckpointStall,
}

/// Why a fault was not injected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultRefused {
    #[error("fault injection is off (control.fault_injection = false)")]
    Off,
    #[error("no drafter {id}: {}", ids_of(*count))]
    NoSuchDrafter { id: usize, count: usize },
    #[error("no target copy {id}: {}", ids_of(*count))]
    NoSuchTarget { id: usize, count: usize },
    #[error(
        "target copy {id} has no part {part}: {}, one per device of [target.device] + target.spread_to",
        ids_of(*parts)
    )]
    NoSuchPart { id: usize, part: usize, parts: usize },
    /// The drafter cannot take it now: one is pending already, or it runs no thread.
    #[error("{0}")]
    Conflict(String),
}

/// The ids of `count` things numbered from 0, in words.
fn ids_of(count: usize) -> String {
    match count {
        0 => "there are none".into(),
        1 => "the only id is 0".into(),
        n => format!("the ids are 0 to {}", n - 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_classified_by_message() {
        assert_eq!(
            Failure::from_torch("CUDA error: an illegal memory access was encountered").kind,
            FailureKind::Poisoned
        );
        assert_eq!(Failure::from_torch("CUDA error: device-side assert triggered").kind, FailureKind::Poisoned);
        assert_eq!(
            Failure::from_torch("CUDA out of memory. Tried to allocate 2.00 GiB").kind,
            FailureKind::OutOfMemory
        );
        assert_eq!(Failure::from_torch("shape '[2, 3]' is invalid").kind, FailureKind::Torch);
        assert!(Failure::from_torch("CUDA out of memory").restartable());
        assert!(!Failure::from_torch("unspecified launch failure").restartable());
        let k: FaultKind = serde_json::from_str("\"checkpoint_stall\"").unwrap();
        assert_eq!(k, FaultKind::CheckpointStall);
    }
}
