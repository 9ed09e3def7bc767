//! The supervisor's checkpoint bookkeeping: at most one checkpoint in flight (a live replica snapshots its state at
//! its next step boundary, then the background writer writes it), the trainer state of each recent step boundary to
//! pair a snapshot with, the newest written checkpoint, and what is known about the folders on disk: which were
//! found invalid (so retention never counts them) and which a founder could not load (so a rewind passes them
//! over).
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use crate::train::checkpoint::TrainerState;

/// The checkpoint in flight.
#[derive(Debug, Clone, PartialEq)]
enum Flight {
    /// Asked drafter `donor` (thread `generation`) for a snapshot at step boundary `at`.
    Snapshot { donor: usize, generation: u64, at: u64, since: Duration },
    /// The snapshot of `step` waits for that boundary's trainer state.
    Pairing { donor: (usize, u64), step: u64, optimizer_steps: u64 },
    /// The writer has the snapshot of drafter thread `donor` since `since`.
    Write { donor: (usize, u64), step: u64, since: Duration },
}

/// A checkpoint to write: the snapshot of `step` (held by the shell) with its trainer state.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteJob {
    /// The drafter thread `(id, generation)` whose snapshot it is.
    pub donor: (usize, u64),
    pub step: u64,
    /// The run's incarnation it belongs to: a rewind since makes the writer discard it.
    pub incarnation: u64,
    pub state: TrainerState,
    /// Steps of checkpoint folders known to be invalid: retention neither counts nor keeps them in place of valid
    /// ones.
    pub invalid: Vec<u64>,
}

/// The checkpoint this run wrote last.
#[derive(Debug, Clone, PartialEq)]
pub struct Newest {
    pub step: u64,
    pub path: PathBuf,
    pub at: Duration,
}

/// What a snapshot report leads to.
#[derive(Debug, Clone, PartialEq)]
pub enum SnapshotOutcome {
    /// Not the one asked for: drop it.
    Unwanted,
    /// Kept until its step's trainer state is known.
    Waiting,
    Write(Box<WriteJob>),
}

#[derive(Debug, Default)]
pub struct Book {
    flight: Option<Flight>,
    states: BTreeMap<u64, TrainerState>,
    newest: Option<Newest>,
    /// Writes that succeeded and that failed, so far.
    pub writes: u64,
    pub failures: u64,
    last_request: Duration,
    invalid: BTreeSet<u64>,
    shunned: BTreeSet<u64>,
    /// The step the current incarnation started from, and the checkpoints it wrote since.
    origin: u64,
    own: BTreeSet<u64>,
}

/// Which checkpoint folders a rewind may start from: not known bad, and either at or below the step the current
/// incarnation started from (its history) or written by it. Anything else on disk belongs to steps the run left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanFilter {
    pub origin: u64,
    pub own: Vec<u64>,
    pub exclude: Vec<u64>,
}

impl ScanFilter {
    pub fn allows(&self, step: u64) -> bool {
        !self.exclude.contains(&step) && (step <= self.origin || self.own.contains(&step))
    }
}

impl Book {
    pub fn in_flight(&self) -> bool {
        self.flight.is_some()
    }

    /// Whether the checkpoint in flight is of boundary `step`.
    pub fn requested_at(&self, step: u64) -> bool {
        match self.flight {
            Some(Flight::Snapshot { at, .. }) => at == step,
            Some(Flight::Pairing { step: s, .. } | Flight::Write { step: s, .. }) => s == step,
            None => false,
        }
    }

    /// The step being written and since when, while the writer has it.
    pub fn writing(&self) -> Option<(u64, Duration)> {
        match self.flight {
            Some(Flight::Write { step, since, .. }) => Some((step, since)),
            _ => None,
        }
    }

    /// A checkpoint due by time was skipped: the next is due a whole interval from now.
    pub fn skipped(&mut self, now: Duration) {
        self.last_request = now;
    }

    pub fn newest(&self) -> Option<&Newest> {
        self.newest.as_ref()
    }

    /// Since the last request (for `checkpoint.every_seconds`).
    pub fn since_request(&self, now: Duration) -> Duration {
        now.saturating_sub(self.last_request)
    }

    /// Asks drafter `donor` for a snapshot at step boundary `at`; false when one is in flight already.
    pub fn request(&mut self, donor: usize, generation: u64, at: u64, now: Duration) -> bool {
        self.last_request = now;
        if self.flight.is_some() {
            return false;
        }
        self.flight = Some(Flight::Snapshot { donor, generation, at, since: now });
        true
    }

    /// Records the trainer state at a step boundary; a snapshot waiting for it is written now.
    pub fn boundary(&mut self, step: u64, state: TrainerState, now: Duration) -> Option<WriteJob> {
        self.states.insert(step, state);
        while self.states.len() > 64 {
            self.states.pop_first();
        }
        match self.flight {
            Some(Flight::Pairing { donor, step: s, optimizer_steps }) if s == step => {
                Some(self.pair(donor, step, optimizer_steps, now))
            }
            _ => None,
        }
    }

    fn pair(&mut self, donor: (usize, u64), step: u64, optimizer_steps: u64, now: Duration) -> WriteJob {
        let mut state = self.states[&step].clone();
        state.optimizer_steps = optimizer_steps;
        self.flight = Some(Flight::Write { donor, step, since: now });
        WriteJob { donor, step, incarnation: 0, state, invalid: self.invalid.iter().copied().collect() }
    }

    /// A snapshot from drafter `id`'s thread `generation`, at `step`.
    pub fn snapshot(
        &mut self,
        id: usize,
        generation: u64,
        step: u64,
        optimizer_steps: u64,
        now: Duration,
    ) -> SnapshotOutcome {
        match self.flight {
            Some(Flight::Snapshot { donor, generation: g, at, .. }) if donor == id && g == generation && at == step => {
                if self.states.contains_key(&step) {
                    SnapshotOutcome::Write(Box::new(self.pair((id, generation), step, optimizer_steps, now)))
                } else {
                    self.flight = Some(Flight::Pairing { donor: (id, generation), step, optimizer_steps });
                    SnapshotOutcome::Waiting
                }
            }
            _ => SnapshotOutcome::Unwanted,
        }
    }

    /// The donor asked for a snapshot is gone (failed, or too slow): the request is dropped. True if it was the
    /// one asked.
    pub fn donor_lost(&mut self, id: usize, generation: u64) -> bool {
        let lost = matches!(self.flight, Some(Flight::Snapshot { donor, generation: g, .. }) if donor == id && g == generation);
        if lost {
            self.flight = None;
        }
        lost
    }

    /// The donor asked at `since` has not answered within `deadline`: `(donor, generation)`.
    pub fn snapshot_overdue(&self, now: Duration, deadline: Duration) -> Option<(usize, u64)> {
        match self.flight {
            Some(Flight::Snapshot { donor, generation, since, .. }) if now.saturating_sub(since) > deadline => {
                Some((donor, generation))
            }
            _ => None,
        }
    }

    /// The writer's answer for the checkpoint of `step`: its folder, or `None` when the write failed.
    pub fn written(&mut self, step: u64, result: Option<PathBuf>, now: Duration) {
        if matches!(self.flight, Some(Flight::Write { step: s, .. }) if s == step) {
            self.flight = None;
        }
        match result {
            Some(path) => {
                self.invalid.remove(&step);
                self.shunned.remove(&step);
                self.own.insert(step);
                self.newest = Some(Newest { step, path, at: now });
                self.writes += 1;
            }
            None => self.failures += 1,
        }
    }

    /// The run restarts from the boundary `step` (a rewind), whose checkpoint (if any) is `source`: the snapshot in
    /// flight, if any, is dropped; a write in progress still reports.
    pub fn rewound(&mut self, step: u64, state: TrainerState, source: Option<Newest>) {
        if !matches!(self.flight, Some(Flight::Write { .. })) {
            self.flight = None;
        }
        self.states.clear();
        self.states.insert(step, state);
        self.newest = source;
        self.origin = step;
        self.own.clear();
    }

    /// Whether the snapshot of drafter thread `(id, generation)` at `step` is the one in flight (a duplicate
    /// answer to a repeated request must not make the shell drop it).
    pub fn holds(&self, id: usize, generation: u64, step: u64) -> bool {
        match self.flight {
            Some(Flight::Pairing { donor, step: s, .. } | Flight::Write { donor, step: s, .. }) => {
                donor == (id, generation) && s == step
            }
            _ => false,
        }
    }

    /// Stops waiting for the write in flight (the writer discards it if the run rewinds meanwhile).
    pub fn forget_write(&mut self) {
        if self.writing().is_some() {
            self.flight = None;
        }
    }

    /// Checkpoint folders a scan rejected.
    pub fn found_invalid(&mut self, steps: &[u64]) {
        self.invalid.extend(steps);
    }

    /// A founder could not load the checkpoint of `step`: rewinds pass it over.
    pub fn shun(&mut self, step: u64) {
        self.shunned.insert(step);
    }

    /// Checkpoints a rewind must pass over (found invalid, or could not be loaded).
    pub fn excluded(&self) -> Vec<u64> {
        self.invalid.union(&self.shunned).copied().collect()
    }

    /// What a rewind may start from.
    pub fn scan_filter(&self) -> ScanFilter {
        ScanFilter { origin: self.origin, own: self.own.iter().copied().collect(), exclude: self.excluded() }
    }

    /// Whether the newest written checkpoint is at `step`.
    pub fn written_at(&self, step: u64) -> bool {
        self.newest.as_ref().is_some_and(|n| n.step == step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::loader::LoaderState;

    fn state(step: u64) -> TrainerState {
        TrainerState::new(step, LoaderState { epoch: 0, next_ordinal: step, owed: vec![] }, serde_json::json!({}))
    }

    #[test]
    fn a_snapshot_is_written_with_its_boundary_state_whichever_comes_first() {
        let mut b = Book::default();
        assert!(b.request(1, 3, 5, Duration::ZERO));
        assert!(!b.request(0, 1, 5, Duration::ZERO), "one in flight");
        let t = Duration::ZERO;
        assert_eq!(b.snapshot(0, 1, 5, 9, t), SnapshotOutcome::Unwanted, "not the donor asked");
        assert_eq!(b.snapshot(1, 3, 4, 9, t), SnapshotOutcome::Unwanted, "not the boundary asked for");
        assert_eq!(b.snapshot(1, 3, 5, 9, t), SnapshotOutcome::Waiting, "step 5's state is not known yet");
        assert_eq!(b.snapshot(1, 3, 5, 9, t), SnapshotOutcome::Unwanted, "a duplicate answer");
        assert!(b.holds(1, 3, 5), "but the snapshot it duplicates is held");
        let job = b.boundary(5, state(5), t).unwrap();
        assert_eq!((job.step, job.state.optimizer_steps), (5, 9));
        b.written(5, Some("ckpt-5".into()), Duration::from_secs(1));
        assert!(!b.in_flight() && b.written_at(5));
        // The state first, then the snapshot.
        b.boundary(6, state(6), t);
        assert!(b.request(0, 1, 6, Duration::from_secs(2)));
        assert!(matches!(b.snapshot(0, 1, 6, 10, t), SnapshotOutcome::Write(_)));
        assert_eq!(b.writing().map(|(_, since)| since), Some(t));
        b.forget_write();
        assert!(!b.in_flight());
    }

    #[test]
    fn a_lost_donor_frees_the_slot_and_an_unloadable_checkpoint_is_shunned() {
        let mut b = Book::default();
        b.request(2, 1, 0, Duration::ZERO);
        assert!(b.snapshot_overdue(Duration::from_secs(5), Duration::from_secs(10)).is_none());
        assert_eq!(b.snapshot_overdue(Duration::from_secs(11), Duration::from_secs(10)), Some((2, 1)));
        assert!(!b.donor_lost(2, 0) && b.donor_lost(2, 1));
        assert!(!b.in_flight());
        b.found_invalid(&[40]);
        b.shun(30);
        assert_eq!(b.excluded(), vec![30, 40]);
        b.boundary(30, state(30), Duration::ZERO);
        b.request(0, 1, 30, Duration::ZERO);
        let SnapshotOutcome::Write(job) = b.snapshot(0, 1, 30, 1, Duration::ZERO) else { panic!("write") };
        assert_eq!(job.invalid, vec![40]);
        b.written(30, Some("ckpt-30".into()), Duration::ZERO);
        assert_eq!(b.excluded(), vec![40], "rewritten: no longer shunned");
        // After a rewind to 20, only its history and what it writes qualify.
        b.rewound(20, state(20), None);
        b.request(0, 2, 25, Duration::ZERO);
        b.boundary(25, state(25), Duration::ZERO);
        b.snapshot(0, 2, 25, 1, Duration::ZERO);
        b.written(25, Some("ckpt-25".into()), Duration::ZERO);
        let filter = b.scan_filter();
        assert!(filter.allows(20) && filter.allows(25) && filter.allows(3));
        assert!(!filter.allows(30), "written before the rewind, above its origin");
        assert!(!filter.allows(40));
    }
}
