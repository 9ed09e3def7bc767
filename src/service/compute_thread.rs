//! The target and every drafter compute on a dedicated OS thread, owned by a thin actor. This module is that
//! pairing: it starts the thread, turns whatever ends it (an error, a libtorch error, a panic) into a classified
//! [`Failure`] sent to the actor, and makes the actor fail with it, so the supervisor sees the thread's failure as
//! its child's. A thread that returns makes its actor stop, so a return nobody asked for is seen too.
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::failure::Failure;
use crate::panic::{Panicked, catch_torch};

/// A compute thread's end, reported to its actor: a failure makes the actor fail, a return makes it stop, so the
/// supervisor sees either.
pub enum ThreadMsg {
    Died(Failure),
    Returned,
}

/// The actor's failure, carrying the thread's.
#[derive(Debug)]
pub struct ThreadFailure(pub Failure);

impl std::fmt::Display for ThreadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ThreadFailure {}

/// A compute thread's work and the name it runs under: what a [`ComputeActor`] starts.
pub struct ThreadBody {
    pub name: String,
    pub body: Box<dyn FnOnce() -> Result<(), Failure> + Send>,
}

/// The thin actor around one compute thread (a drafter's or a target copy's): it owns nothing but the thread's
/// report, and fails with the thread's failure, so the supervisor sees it as its child's.
pub struct ComputeActor;

impl Actor for ComputeActor {
    type Msg = ThreadMsg;
    type State = ();
    type Arguments = ThreadBody;

    async fn pre_start(&self, myself: ActorRef<ThreadMsg>, args: ThreadBody) -> Result<(), ActorProcessingErr> {
        spawn(args.name, myself, args.body)?;
        Ok(())
    }

    async fn handle(&self, myself: ActorRef<ThreadMsg>, msg: ThreadMsg, _: &mut ()) -> Result<(), ActorProcessingErr> {
        match msg {
            ThreadMsg::Died(failure) => Err(Box::new(ThreadFailure(failure))),
            ThreadMsg::Returned => {
                myself.stop(Some("its thread returned".into()));
                Ok(())
            }
        }
    }
}

/// Starts `body` on a new thread named `name`; when it fails, its actor `owner` is told.
fn spawn(
    name: String,
    owner: ActorRef<ThreadMsg>,
    body: impl FnOnce() -> Result<(), Failure> + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new().name(name).spawn(move || {
        let outcome = match catch_torch(body) {
            Ok(result) => result,
            Err(Panicked::Torch(m)) => Err(Failure::from_torch(&m)),
            Err(Panicked::Bug(m)) => Err(Failure::panic(m)),
        };
        let _ = owner.send_message(match outcome {
            Ok(()) => ThreadMsg::Returned,
            Err(failure) => ThreadMsg::Died(failure),
        });
    })?;
    Ok(())
}

/// A libtorch (or device) error inside a compute thread, classified.
pub fn torch(e: impl std::fmt::Display) -> Failure {
    Failure::from_torch(&e.to_string())
}
