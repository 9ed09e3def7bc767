//! The copies of the target that capture features: their lifecycle (started one at a time, restarted with backoff
//! and an intensity limit like drafters) and the requests each has not delivered yet, sent again in order when it
//! restarts. A request is sent once the copy is ready (before that it only waits in the queue), so a restart never
//! delivers a batch twice. The request at the head of the queue is the one a failing copy was working on: it is the
//! suspect, and a batch that is the suspect of two failures is set aside instead of being retried forever.
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::restarts::Restarts;
use super::schedule::Item;
use crate::config::SupervisionSettings;
use crate::data::loader::BatchId;

/// A capture request (or an empty slot) for drafter `drafter`'s thread `generation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub seq: u64,
    pub drafter: usize,
    pub generation: u64,
    pub item: Item,
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
enum Life {
    #[default]
    NotStarted,
    Starting {
        since: Duration,
    },
    Ready,
    Backoff {
        at: Duration,
    },
    GaveUp,
}

/// What a target copy's failure leads to.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetFailure {
    /// The batch it was capturing, and whether this was that batch's second failure (set it aside).
    pub suspect: Option<(BatchId, bool)>,
    /// When it restarts; `None`: the intensity limit is reached.
    pub restart_at: Option<Duration>,
}

/// One copy of the target.
#[derive(Debug, Default)]
pub struct TargetCopy {
    pub id: usize,
    pub device: String,
    pub generation: u64,
    life: Life,
    pub ever_ready: bool,
    restarts: Restarts,
    undelivered: VecDeque<Request>,
    /// Since when the ready copy holds the request at the head of `undelivered` (for the watchdog).
    holding_since: Duration,
    suspects: HashMap<BatchId, u32>,
}

impl TargetCopy {
    pub fn new(id: usize, device: String) -> Self {
        TargetCopy { id, device, ..TargetCopy::default() }
    }

    pub fn is_ready(&self) -> bool {
        self.life == Life::Ready
    }

    pub fn never_started(&self) -> bool {
        self.life == Life::NotStarted
    }

    pub fn gave_up(&self) -> bool {
        self.life == Life::GaveUp
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.total
    }

    /// Starts a new thread; returns its generation.
    pub fn start(&mut self, now: Duration) -> u64 {
        self.generation += 1;
        self.life = Life::Starting { since: now };
        self.generation
    }

    /// Whether its backoff has passed (it is to be started again).
    pub fn due(&self, now: Duration) -> bool {
        matches!(self.life, Life::Backoff { at } if at <= now)
    }

    /// Whether it has been starting since before `deadline` ago.
    pub fn start_overdue(&self, now: Duration, deadline: Duration) -> bool {
        matches!(self.life, Life::Starting { since } if now.saturating_sub(since) > deadline)
    }

    /// Its thread of `generation` is ready at `now`: the requests to send it (every undelivered one, in order).
    pub fn ready(&mut self, generation: u64, now: Duration) -> Option<Vec<Request>> {
        if generation != self.generation || !matches!(self.life, Life::Starting { .. }) {
            return None;
        }
        self.life = Life::Ready;
        self.holding_since = now;
        self.ever_ready = true;
        Some(self.undelivered.iter().cloned().collect())
    }

    /// Queues a request at `now`; returns it when it is to be sent now (the copy is ready).
    pub fn push(&mut self, request: Request, now: Duration) -> Option<Request> {
        if self.undelivered.is_empty() {
            self.holding_since = now;
        }
        self.undelivered.push_back(request.clone());
        self.is_ready().then_some(request)
    }

    /// The thread of `generation` delivered request `seq` at `now`.
    pub fn delivered(&mut self, generation: u64, seq: u64, now: Duration) {
        if generation == self.generation {
            self.undelivered.retain(|r| r.seq != seq);
            self.holding_since = now;
        }
    }

    /// How long the ready copy has held its oldest undelivered request; `None` when it holds none or is not ready.
    pub fn holding_for(&self, now: Duration) -> Option<Duration> {
        (self.is_ready() && !self.undelivered.is_empty()).then(|| now.saturating_sub(self.holding_since))
    }

    /// Forgets every request (the run rewound).
    pub fn clear(&mut self) {
        self.undelivered.clear();
    }

    /// The request for `batch` becomes an empty slot (the batch was set aside).
    pub fn blank(&mut self, batch: BatchId) {
        self.blank_where(|r| matches!(r.item, Item::Capture { batch: b, .. } if b == batch));
    }

    /// The queued requests `which` picks become empty slots, in place.
    fn blank_where(&mut self, which: impl Fn(&Request) -> bool) {
        for r in self.undelivered.iter_mut().filter(|r| which(r)) {
            r.item = Item::Empty;
        }
    }

    /// Its thread of `generation` failed at `now`; `None` for a stale generation.
    /// Drafter thread `(drafter, generation)` was given up: what this copy still holds for it is blanked. Nobody
    /// reads those captures, their batches go back to the loader with their steps (to be assigned again, maybe
    /// through this copy), and a failure of the copy while it holds one must not blame a batch that is now another
    /// thread's: a batch set aside for it would leave that thread's contribution uncommitted.
    pub fn forget(&mut self, drafter: usize, generation: u64) {
        self.blank_where(|r| r.drafter == drafter && r.generation == generation);
    }

    pub fn failed(&mut self, generation: u64, now: Duration, s: &SupervisionSettings) -> Option<TargetFailure> {
        if generation != self.generation || !matches!(self.life, Life::Starting { .. } | Life::Ready) {
            return None;
        }
        let suspect = self.undelivered.front().and_then(|r| match r.item {
            Item::Capture { batch, .. } => {
                let n = self.suspects.entry(batch).or_insert(0);
                *n += 1;
                Some((batch, *n >= 2))
            }
            Item::Empty => None,
        });
        let restart_at = self.restarts.next(now, s);
        self.life = match restart_at {
            Some(at) => Life::Backoff { at },
            None => Life::GaveUp,
        };
        Some(TargetFailure { suspect, restart_at })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn capture(seq: u64, ordinal: u64) -> Request {
        Request {
            seq,
            drafter: 0,
            generation: 1,
            item: Item::Capture { batch: BatchId { epoch: 0, ordinal }, positions: vec![] },
        }
    }

    #[test]
    fn requests_wait_for_readiness_and_are_sent_once_per_thread() {
        let s = Config::builtin().unwrap().supervision;
        let mut t = TargetCopy::new(0, "cpu".into());
        let g = t.start(Duration::ZERO);
        let at = Duration::from_millis;
        assert_eq!(t.push(capture(1, 0), at(0)), None, "not ready: queued only");
        assert_eq!(t.holding_for(at(10)), None, "not holding anything before it is ready");
        assert_eq!(t.ready(g, at(100)).unwrap(), vec![capture(1, 0)]);
        assert_eq!(t.holding_for(at(150)), Some(at(50)), "held since it became ready");
        assert_eq!(t.push(capture(2, 1), at(200)), Some(capture(2, 1)));
        t.delivered(g, 1, at(300));
        assert_eq!(t.holding_for(at(450)), Some(at(150)), "the next request, since the last delivery");
        let failure = t.failed(g, Duration::from_secs(1), &s).unwrap();
        assert_eq!(failure.suspect, Some((BatchId { epoch: 0, ordinal: 1 }, false)));
        assert_eq!(t.holding_for(at(1100)), None, "a failed copy holds nothing");
        assert!(t.push(capture(3, 2), at(1200)).is_none(), "down: queued only");
        let g2 = t.start(failure.restart_at.unwrap());
        assert!(t.ready(g, at(2000)).is_none(), "a stale thread");
        assert_eq!(t.ready(g2, at(2000)).unwrap(), vec![capture(2, 1), capture(3, 2)], "undelivered, in order");
        t.delivered(g2, 2, at(2100));
        t.delivered(g2, 3, at(2200));
        assert_eq!(t.holding_for(at(9000)), None, "nothing left to deliver");
    }

    #[test]
    fn a_batch_failing_the_target_twice_is_named_and_the_limit_ends_restarts() {
        let mut s = Config::builtin().unwrap().supervision;
        s.max_restarts = 2;
        let mut t = TargetCopy::new(0, "cpu".into());
        let mut g = t.start(Duration::ZERO);
        t.ready(g, Duration::ZERO);
        t.push(capture(1, 7), Duration::ZERO);
        let first = t.failed(g, Duration::from_secs(1), &s).unwrap();
        assert_eq!(first.suspect, Some((BatchId { epoch: 0, ordinal: 7 }, false)));
        g = t.start(first.restart_at.unwrap());
        t.ready(g, Duration::ZERO);
        let second = t.failed(g, Duration::from_secs(2), &s).unwrap();
        assert_eq!(second.suspect, Some((BatchId { epoch: 0, ordinal: 7 }, true)));
        t.blank(BatchId { epoch: 0, ordinal: 7 });
        g = t.start(second.restart_at.unwrap());
        assert_eq!(t.ready(g, Duration::ZERO).unwrap()[0].item, Item::Empty);
        let third = t.failed(g, Duration::from_secs(3), &s).unwrap();
        assert_eq!(third, TargetFailure { suspect: None, restart_at: None });
        assert!(t.gave_up());
    }

    /// A drafter thread given up leaves its requests queued (their order is the copy's), blank: resent blank after
    /// a restart, and a failure while the copy holds one blames no batch (the batch is another thread's by then).
    #[test]
    fn what_a_given_up_thread_had_queued_is_resent_blank_and_blames_no_batch() {
        let s = Config::builtin().unwrap().supervision;
        let mut t = TargetCopy::new(0, "cpu".into());
        let g = t.start(Duration::ZERO);
        t.ready(g, Duration::ZERO);
        let other = Request { drafter: 1, ..capture(2, 8) };
        t.push(capture(1, 7), Duration::ZERO);
        t.push(other.clone(), Duration::ZERO);
        t.forget(0, 1);
        t.forget(1, 2);
        for _ in 0..2 {
            let failure = t.failed(t.generation, Duration::from_secs(1), &s).unwrap();
            assert_eq!(failure.suspect, None, "the front was the given-up thread's");
            let g = t.start(Duration::from_secs(2));
            let blank = Request { item: Item::Empty, ..capture(1, 7) };
            assert_eq!(t.ready(g, Duration::from_secs(2)).unwrap(), vec![blank, other.clone()], "generation 1 only");
        }
    }
}
