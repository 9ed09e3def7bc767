//! The compute actors a supervisor spawned, known by what they are (which drafter or target copy, which generation)
//! from the name it gave each, until they end: what a supervision event's actor is, and which actor to stop when the
//! core gives a thread up.
use std::collections::HashMap;

use ractor::ActorCell;

use super::protocol::Event;
use crate::service::failure::Failure;

/// A compute actor this supervisor spawned: which drafter or target copy, in which generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Spawned {
    Drafter { id: usize, generation: u64 },
    Target { id: usize, generation: u64 },
}

impl Spawned {
    /// Its thread failed with `failure` (computing nothing, as far as the supervisor knows).
    pub(super) fn failed(self, failure: Failure) -> Event {
        match self {
            Spawned::Drafter { id, generation } => {
                Event::DrafterFailed { id, generation, failure, running: vec![], injected: false }
            }
            Spawned::Target { id, generation } => Event::TargetFailed { target: id, generation, failure },
        }
    }

    /// The name it is spawned under (`drafter-<id>-<generation>`, as logs show it).
    fn name(self) -> String {
        match self {
            Spawned::Drafter { id, generation } => format!("drafter-{id}-{generation}"),
            Spawned::Target { id, generation } => format!("target-{id}-{generation}"),
        }
    }
}

/// One actor spawned: what it is, its cell once it started, and whether it was given up (it is stopped as soon as
/// it can be).
struct Entry {
    what: Spawned,
    cell: Option<ActorCell>,
    given_up: bool,
}

/// The compute actors spawned and not yet ended, by the name each was given (the one thing a supervision event
/// carries of it besides its id, which a spawn, in a task of its own, learns too late).
#[derive(Default)]
pub(super) struct Registry(HashMap<String, Entry>);

impl Registry {
    /// The name to spawn `actor` under, recorded.
    pub(super) fn name(&mut self, actor: Spawned) -> String {
        let name = actor.name();
        self.0.insert(name.clone(), Entry { what: actor, cell: None, given_up: false });
        name
    }

    /// `cell` started: kept to stop it when it is given up, or stopped now if it was given up while starting.
    pub(super) fn started(&mut self, cell: ActorCell) {
        let Some(entry) = cell.get_name().and_then(|name| self.0.get_mut(&name)) else { return };
        match entry.given_up {
            true => cell.stop(None),
            false => entry.cell = Some(cell),
        }
    }

    /// Stops `actor`'s actor, now or once it started.
    pub(super) fn give_up(&mut self, actor: Spawned) {
        if let Some(entry) = self.0.get_mut(&actor.name()) {
            entry.given_up = true;
            if let Some(cell) = entry.cell.take() {
                cell.stop(None);
            }
        }
    }

    /// What `cell` was, forgotten now that it ended.
    pub(super) fn ended(&mut self, cell: &ActorCell) -> Option<Spawned> {
        self.0.remove(&cell.get_name()?).map(|entry| entry.what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the actors spawned are known, each as what it was spawned as, until it ends; giving one up before it
    /// started marks it to be stopped when it does.
    #[test]
    fn the_registry_knows_what_it_named_until_it_ends() {
        let mut r = Registry::default();
        let drafter = Spawned::Drafter { id: 1, generation: 3 };
        let target = Spawned::Target { id: 0, generation: 2 };
        assert_eq!(r.name(drafter), "drafter-1-3");
        assert_eq!(r.name(target), "target-0-2");
        r.give_up(target);
        r.give_up(Spawned::Target { id: 0, generation: 1 });
        let given_up = |r: &Registry, name: &str| r.0.get(name).map(|e| (e.what, e.given_up));
        assert_eq!(given_up(&r, "drafter-1-3"), Some((drafter, false)));
        assert_eq!(given_up(&r, "target-0-2"), Some((target, true)));
        assert_eq!(given_up(&r, "target-0-1"), None, "never spawned: nothing recorded");
        assert_eq!(r.0.remove("target-0-2").map(|e| e.what), Some(target));
    }
}
