//! `dflash serve-train`: the long-running training service. A supervisor actor owns the target actor and one
//! drafter actor per configured device (each drafter computing on its own thread), the loader, the collective and
//! the checkpointer; an HTTP control plane reports status and takes commands.
pub mod builtin_data;
pub mod compute_thread;
pub mod control;
pub mod drafter;
pub mod evaluator;
pub mod failure;
pub mod messages;
pub mod run;
pub mod supervisor;
pub mod target;
