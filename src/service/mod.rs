//! `dflash serve-train`: the long-running training service. A supervisor actor owns the target actors and one
//! drafter actor per configured device (each computing on its own thread), the loader, the collective, the
//! checkpointer and the evaluator; an HTTP control plane reports status and metrics and takes commands.
pub mod builtin_data;
pub mod compute_thread;
pub mod control;
pub mod drafter;
pub mod drafter_init;
pub mod drafter_shape;
pub mod evaluator;
pub mod exit;
pub mod failure;
pub mod folder_lock;
pub mod ledger;
pub mod live;
pub mod messages;
pub mod placement;
pub mod publish;
pub mod reload;
pub mod run;
pub mod status;
pub mod stream;
pub mod supervisor;
pub mod target;
