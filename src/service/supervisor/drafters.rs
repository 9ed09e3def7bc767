//! One drafter slot's lifecycle, as the supervisor sees it: waiting for its turn, backing off after a failure,
//! starting (as the founder of the collective or as a joiner), live, or failed for good. Every state but `Live` and
//! `Failed` ends by itself: a backoff expires, a start has a deadline, a waiting slot is started as soon as the
//! collective can take it. Which slot founds and which joins is the core's decision; this module keeps the facts.
use std::time::Duration;

use super::restarts::Restarts;
use crate::config::SupervisionSettings;
use crate::service::status::DrafterState;

/// How a drafter thread gets its first state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The only member of an empty collective: its state comes from a checkpoint or the seed.
    Founder,
    /// Copies a live member's state at that member's step boundary.
    Joiner,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Life {
    /// Not running: to be started when the collective can take it (never started yet, or its donor was lost).
    Waiting,
    /// Restarting after a failure, once `at` has passed.
    Backoff {
        at: Duration,
    },
    /// Its thread is building, loading or joining; `ready`: it reported ready (a joiner's request is registered).
    Starting {
        role: Role,
        since: Duration,
        ready: bool,
    },
    Live,
    /// Restarted too often (or poisoned): the run goes on without it.
    Failed,
}

/// One entry of `drafters.devices`.
#[derive(Debug)]
pub struct Slot {
    pub id: usize,
    pub device: String,
    /// Of its current (or last) thread; 0 before the first.
    pub generation: u64,
    pub life: Life,
    pub restarts: Restarts,
    /// The step its thread last reported done.
    pub step: u64,
}

impl Slot {
    pub fn new(id: usize, device: String) -> Self {
        Slot { id, device, generation: 0, life: Life::Waiting, restarts: Restarts::default(), step: 0 }
    }

    /// The state `/status` and the metrics show.
    pub fn state(&self) -> DrafterState {
        match self.life {
            Life::Waiting if self.generation == 0 => DrafterState::Starting,
            Life::Waiting | Life::Backoff { .. } => DrafterState::Restarting,
            Life::Starting { role: Role::Founder, .. } => DrafterState::Starting,
            Life::Starting { role: Role::Joiner, .. } => DrafterState::Joining,
            Life::Live => DrafterState::Live,
            Life::Failed => DrafterState::Failed,
        }
    }

    pub fn is_live(&self) -> bool {
        self.life == Life::Live
    }

    /// Whether a thread of its current generation runs (starting or live).
    pub fn is_running(&self) -> bool {
        matches!(self.life, Life::Starting { .. } | Life::Live)
    }

    pub fn is_failed(&self) -> bool {
        self.life == Life::Failed
    }

    /// Whether it is to be started now.
    pub fn due(&self, now: Duration) -> bool {
        match self.life {
            Life::Waiting => true,
            Life::Backoff { at } => at <= now,
            _ => false,
        }
    }

    pub fn role(&self) -> Option<Role> {
        match self.life {
            Life::Starting { role, .. } => Some(role),
            _ => None,
        }
    }

    /// A thread of `generation` of this slot, in a state where it may report.
    pub fn current(&self, generation: u64) -> bool {
        self.generation == generation && self.is_running()
    }

    /// Starts a new thread; returns its generation.
    pub fn spawn(&mut self, role: Role, now: Duration) -> u64 {
        self.generation += 1;
        self.life = Life::Starting { role, since: now, ready: false };
        self.generation
    }

    /// Whether it has been starting for longer than `deadline`.
    pub fn start_overdue(&self, now: Duration, deadline: Duration) -> bool {
        matches!(self.life, Life::Starting { since, .. } if now.saturating_sub(since) > deadline)
    }

    /// Its current thread failed: back off and restart (when, returned), or (past the intensity limit, or
    /// `give_up`) fail for good (`None`).
    pub fn fail(&mut self, now: Duration, s: &SupervisionSettings, give_up: bool) -> Option<Duration> {
        let next = if give_up { None } else { self.restarts.next(now, s) };
        self.life = next.map_or(Life::Failed, |at| Life::Backoff { at });
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_slot_shows_its_state_and_fails_for_good_past_its_restarts() {
        let mut s = Config::builtin().unwrap().supervision;
        s.max_restarts = 1;
        let mut slot = Slot::new(0, "cpu".into());
        assert_eq!(slot.state(), DrafterState::Starting);
        assert!(slot.due(Duration::ZERO));
        let g = slot.spawn(Role::Joiner, Duration::ZERO);
        assert_eq!((g, slot.state()), (1, DrafterState::Joining));
        assert!(slot.start_overdue(Duration::from_secs(11), Duration::from_secs(10)));
        let Some(at) = slot.fail(Duration::from_secs(1), &s, false) else { panic!("restarts") };
        assert_eq!(slot.state(), DrafterState::Restarting);
        assert!(!slot.due(at - Duration::from_millis(1)) && slot.due(at));
        slot.spawn(Role::Founder, at);
        assert!(!slot.current(1) && slot.current(2));
        assert_eq!(slot.fail(at, &s, false), None, "failed for good");
        assert_eq!(slot.state(), DrafterState::Failed);
        assert!(!slot.due(at * 10));
    }
}
