//! The compute actors a supervisor spawned, known by what they are (which drafter or target copy, which generation)
//! from the name it gave each, until they end: what a supervision event's actor is.
use std::collections::HashMap;

use ractor::ActorCell;

/// A compute actor this supervisor spawned: which drafter or target copy, in which generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Spawned {
    Drafter { id: usize, generation: u64 },
    Target { id: usize, generation: u64 },
}

/// The compute actors spawned and not yet ended, by the name each was given (the one thing a supervision event
/// carries of it besides its id, which a drafter's spawn, in a task of its own, learns too late).
#[derive(Default)]
pub(super) struct Registry(HashMap<String, Spawned>);

impl Registry {
    /// The name to spawn `actor` under (`drafter-<id>-<generation>`, as logs show it), recorded.
    pub(super) fn name(&mut self, actor: Spawned) -> String {
        let name = match actor {
            Spawned::Drafter { id, generation } => format!("drafter-{id}-{generation}"),
            Spawned::Target { id, generation } => format!("target-{id}-{generation}"),
        };
        self.0.insert(name.clone(), actor);
        name
    }

    /// What `cell` is, if this supervisor spawned it.
    pub(super) fn of(&self, cell: &ActorCell) -> Option<Spawned> {
        self.0.get(&cell.get_name()?).copied()
    }

    /// What `cell` was, forgotten now that it ended.
    pub(super) fn ended(&mut self, cell: &ActorCell) -> Option<Spawned> {
        self.0.remove(&cell.get_name()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the actors spawned are known, each as what it was spawned as, until it ends.
    #[test]
    fn the_registry_knows_what_it_named_until_it_ends() {
        let mut r = Registry::default();
        let drafter = Spawned::Drafter { id: 1, generation: 3 };
        let target = Spawned::Target { id: 0, generation: 2 };
        assert_eq!(r.name(drafter), "drafter-1-3");
        assert_eq!(r.name(target), "target-0-2");
        assert_eq!(r.0.get("drafter-1-3"), Some(&drafter));
        assert_eq!(r.0.remove("target-0-2"), Some(target));
        assert_eq!(r.0.get("target-0-2"), None);
    }
}
