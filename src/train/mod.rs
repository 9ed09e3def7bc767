//! Training: the DFlash objective, the optimizer (AdamW, or Muon and AdamW) with saveable state and its schedule, and
//! the training step. Knows nothing of actors, so it is tested and benchmarked on its own.
pub mod checkpoint;
pub mod collective;
pub mod decode_eval;
pub mod eval;
pub mod link;
pub mod muon;
pub mod objective;
pub mod optim;
pub mod rounds;
pub mod step;

pub use objective::{Metrics, ObjectiveSettings, Teacher};
pub use optim::{LrSchedule, Optimizer, OptimizerKind, ScheduleKind, UpdateSettings};
pub use step::{FeatureBatch, Trainer, UpdateReport};
