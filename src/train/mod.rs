//! Training: the DFlash objective, AdamW with saveable state and its schedule, and the training step. Knows nothing
//! of actors, so it is tested and benchmarked on its own.
pub mod checkpoint;
pub mod collective;
pub mod decode_eval;
pub mod eval;
pub mod link;
pub mod objective;
pub mod optim;
pub mod rounds;
pub mod step;

pub use objective::{Metrics, ObjectiveSettings};
pub use optim::{AdamW, LrSchedule, ScheduleKind, UpdateSettings};
pub use step::{FeatureBatch, Trainer, UpdateReport};
