//! The per-step quorum across hosts, as the rendezvous host decides it: which hosts are in the run, when a step's
//! round closes, who is dropped and who is admitted. A pure state machine driven by events (a host announced
//! itself, a host's contribution arrived, time passed), so every failure path has a fast test; the store protocol
//! only carries its inputs and outputs.
//!
//! A round closes when every member has contributed, or at its deadline with those that did (a host that missed it
//! is dropped: it died, or hangs, and its contribution no longer counts even if it comes later). A host that starts
//! (again) announces itself with a new generation: an older generation of it still in the membership is dropped at
//! once (it was killed and restarted), and the new one is admitted at the next round boundary, its state copied
//! from a donor (the lowest-ranked member of the round just closed, whose state is then the newest).
use std::collections::{BTreeMap, BTreeSet};

/// A host's rank in the run.
pub type Rank = usize;

/// What closing a round decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Closed {
    pub round: u64,
    /// The hosts whose contributions make the round, in rank order (the order sums are taken in).
    pub members: Vec<Rank>,
    /// Members that missed the deadline: out of the run until they announce themselves again.
    pub dropped: Vec<Rank>,
    /// Hosts joining from the next round, each with the member that sends it its state.
    pub admitted: Vec<Admitted>,
    /// The next round's members with their generations (those that contributed, and those admitted).
    pub next: Vec<(Rank, u64)>,
}

/// A host joining at a round boundary: its rank and generation, and the member whose state it copies (itself: no
/// member had the run's state; the run must start again from its checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Admitted {
    pub rank: Rank,
    pub generation: u64,
    pub donor: Rank,
}

impl std::fmt::Display for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host {} (generation {}, its state from host {})", self.rank, self.generation, self.donor)
    }
}

/// What the rendezvous host does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Wait for more contributions until the deadline (seconds on the caller's clock).
    Wait {
        until: f64,
    },
    Close(Closed),
    /// No member contributed by the deadline and no host is starting: nothing can go on (the caller ends the run
    /// with a checkpoint).
    Stalled {
        round: u64,
    },
}

#[derive(Debug, Clone)]
pub struct HostQuorum {
    /// Live hosts and their generations.
    members: BTreeMap<Rank, u64>,
    /// Hosts announced, waiting for the next round boundary.
    joining: BTreeMap<Rank, u64>,
    round: u64,
    /// Contributions to the open round, by rank (the member's generation).
    arrived: BTreeMap<Rank, u64>,
    /// When the open round opened, and how long it may stay open.
    opened_at: f64,
    deadline_s: f64,
    /// Members that stopped beating since the last round closed (the next decision lists them as dropped).
    departed: Vec<Rank>,
}

impl HostQuorum {
    /// A run whose first round is `round`, with `founders` (rank, generation) as its members, the round opening now.
    pub fn new(round: u64, founders: &[(Rank, u64)], now: f64, deadline_s: f64) -> Self {
        HostQuorum {
            members: founders.iter().copied().collect(),
            joining: BTreeMap::new(),
            round,
            arrived: BTreeMap::new(),
            opened_at: now,
            deadline_s,
            departed: Vec::new(),
        }
    }

    pub fn round(&self) -> u64 {
        self.round
    }

    /// The members of the open round, in rank order.
    pub fn members(&self) -> Vec<Rank> {
        self.members.keys().copied().collect()
    }

    /// The generation of member `rank`, if it is one.
    pub fn generation(&self, rank: Rank) -> Option<u64> {
        self.members.get(&rank).copied()
    }

    /// Host `rank` started as `generation` (each start counts up). An older generation still a member was killed:
    /// it leaves the membership (and the open round) now. Stale announcements are ignored.
    pub fn announce(&mut self, rank: Rank, generation: u64) {
        if self.members.get(&rank).is_some_and(|&g| g >= generation)
            || self.joining.get(&rank).is_some_and(|&g| g >= generation)
        {
            return;
        }
        self.members.remove(&rank);
        self.arrived.remove(&rank);
        self.joining.insert(rank, generation);
    }

    /// Host `rank` (as `generation`) stopped beating: its process is gone. It leaves the membership and the open
    /// round now, as it would at the round's deadline, so the others need not wait for that.
    pub fn gone(&mut self, rank: Rank, generation: u64) {
        if self.members.get(&rank) == Some(&generation) {
            self.members.remove(&rank);
            self.arrived.remove(&rank);
            self.departed.push(rank);
        }
        if self.joining.get(&rank) == Some(&generation) {
            self.joining.remove(&rank);
        }
    }

    /// Host `rank` (as `generation`) contributed to round `round`. Contributions of non-members, of older
    /// generations or to other rounds do not count.
    pub fn arrive(&mut self, round: u64, rank: Rank, generation: u64) {
        if round == self.round && self.members.get(&rank) == Some(&generation) {
            self.arrived.insert(rank, generation);
        }
    }

    /// Closes the open round if it can at time `now`, opening the next one; says how long to wait otherwise.
    pub fn poll(&mut self, now: f64) -> Decision {
        let until = self.opened_at + self.deadline_s;
        let complete = !self.members.is_empty() && self.members.keys().all(|r| self.arrived.contains_key(r));
        if !complete && now < until {
            return Decision::Wait { until };
        }
        if self.arrived.is_empty() && self.joining.is_empty() {
            return Decision::Stalled { round: self.round };
        }
        // With no contribution but hosts (re)starting, no member has the run's state: the joiners are admitted as
        // their own donors (the run must start again from its checkpoint) and the members that missed the round are
        // dropped.
        self.close(now)
    }

    fn close(&mut self, now: f64) -> Decision {
        let members: Vec<Rank> = self.arrived.keys().copied().collect();
        let mut dropped: Vec<Rank> = self.members.keys().filter(|r| !self.arrived.contains_key(r)).copied().collect();
        dropped.append(&mut self.departed);
        dropped.sort_unstable();
        let donor = members.first().copied();
        // No member left to copy from: the lowest joiner founds, the others copy from it.
        let donor = donor.or_else(|| self.joining.keys().next().copied());
        let admitted: Vec<Admitted> = match donor {
            Some(donor) => {
                self.joining.iter().map(|(&rank, &generation)| Admitted { rank, generation, donor }).collect()
            }
            None => vec![],
        };
        self.members = std::mem::take(&mut self.arrived);
        self.members.append(&mut self.joining);
        let next = self.members.iter().map(|(&r, &g)| (r, g)).collect();
        let closed = Closed { round: self.round, members, dropped, admitted, next };
        self.round += 1;
        self.opened_at = now;
        Decision::Close(closed)
    }
}

/// Which member hosts stopped beating, from the beat counters rank 0 reads now and then (each other host's feed
/// reader adds to its counter every second). A member whose counter has not moved for `gone_after` seconds of
/// watching is gone. Only silence the reader watched counts: after a gap between two readings longer than
/// `stall_after` (the reader was held up, e.g. the store's server stalled, and the beats with it), every member's
/// silence starts again.
#[derive(Debug, Default)]
pub struct BeatWatch {
    /// Each member's counter as last read, and when it last moved.
    beats: BTreeMap<Rank, (i64, f64)>,
    read_at: Option<f64>,
}

impl BeatWatch {
    /// When the counters were last read.
    pub fn last_read(&self) -> Option<f64> {
        self.read_at
    }

    /// The readings `counts` (member, counter) taken at `now`; returns the members silent for `gone_after` (they
    /// are forgotten: a member read again later starts afresh). Members not read are forgotten.
    pub fn read(&mut self, now: f64, counts: &[(Rank, i64)], gone_after: f64, stall_after: f64) -> Vec<Rank> {
        let stalled = self.read_at.is_some_and(|t| now - t > stall_after);
        self.read_at = Some(now);
        self.beats.retain(|r, _| counts.iter().any(|(c, _)| c == r));
        let mut gone = Vec::new();
        for &(rank, count) in counts {
            let (last, since) = self.beats.entry(rank).or_insert((count, now));
            if *last != count || stalled {
                (*last, *since) = (count, now);
            } else if now - *since >= gone_after {
                gone.push(rank);
            }
        }
        for rank in &gone {
            self.beats.remove(rank);
        }
        gone
    }
}

/// How a host other than rank 0 judges rank 0 from its own store operations (the store is served by rank 0's
/// process). A rank 0 that does not answer (stopped, swapping, its network down) is lost once it has been silent for
/// `timeout_s`; below that the host waits, and its drafters keep their places. (A connection that fails says the
/// process is gone: the caller takes it for lost at once.) Only silence the watcher saw counts: after a gap between
/// two looks longer than `stall_after_s` (this process did not run) the silence starts again.
#[derive(Debug, Clone)]
pub struct LeaderWatch {
    timeout_s: f64,
    stall_after_s: f64,
    heard_at: Option<f64>,
    looked_at: Option<f64>,
}

/// How a store operation went, for [`LeaderWatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Answered,
    /// It has waited too long for an answer.
    TimedOut,
}

impl LeaderWatch {
    pub fn new(timeout_s: f64, stall_after_s: f64) -> Self {
        LeaderWatch { timeout_s, stall_after_s, heard_at: None, looked_at: None }
    }

    /// An operation's `reply` at `now`; rank 0's silence in seconds when it counts as lost.
    pub fn observe(&mut self, now: f64, reply: Reply) -> Option<f64> {
        let stalled = self.looked_at.is_some_and(|t| now - t > self.stall_after_s);
        self.looked_at = Some(now);
        if reply == Reply::Answered || stalled || self.heard_at.is_none() {
            self.heard_at = Some(now);
        }
        let silent = now - self.heard_at.unwrap_or(now);
        (reply == Reply::TimedOut && silent >= self.timeout_s).then_some(silent)
    }
}

/// The time a process ran, from readings of a clock that goes on while the process is stopped (SIGSTOP, a swapping
/// host, a paused VM): a reading more than `stall_after_s` after the one before is a stop, and the gap is not counted.
/// Rank 0's coordinator measures the rounds' deadlines on it, so that a stop of rank 0 (shorter than
/// `cluster.leader_timeout_s`: the other hosts wait for it) is charged to no host: a round open across it waits for
/// its members as long afterwards as it would have without it, and rank 0 is not dropped from its own run.
#[derive(Debug, Clone)]
pub struct RunningClock {
    stall_after_s: f64,
    last: Option<f64>,
    stopped_s: f64,
}

impl RunningClock {
    pub fn new(stall_after_s: f64) -> Self {
        RunningClock { stall_after_s, last: None, stopped_s: 0.0 }
    }

    /// The running time at the clock's reading `now`.
    pub fn read(&mut self, now: f64) -> f64 {
        if let Some(last) = self.last
            && now - last > self.stall_after_s
        {
            self.stopped_s += now - last;
        }
        self.last = Some(now);
        now - self.stopped_s
    }
}

/// Whether a closed round's update applies, when its member hosts sum over NCCL after it closed: every member says
/// whether its drafters' all-reduce completed (`posted`: rank -> (generation, summed)). The update applies only if
/// every member summed (`Some(true)`); it is skipped on every host (`Some(false)`) as soon as one did not, or one
/// will never say: it restarted since (`generations`: each host's newest), its process is gone (`gone`: members that
/// stopped beating, `(rank, generation)`), or the deadline passed. A survivor whose
/// all-reduce failed because a peer died then keeps its state, and so does every other host: they stay identical.
/// `None`: wait (also while nobody posted: hosts that sum through the store never do).
pub fn sum_outcome(
    members: &[(Rank, u64)],
    posted: &BTreeMap<Rank, (u64, bool)>,
    generations: &[u64],
    gone: &BTreeSet<(Rank, u64)>,
    waited_s: f64,
    deadline_s: f64,
) -> Option<bool> {
    if posted.is_empty() {
        return None;
    }
    let said = |&(rank, generation): &(Rank, u64)| posted.get(&rank).filter(|(g, _)| *g == generation).map(|p| p.1);
    if members.iter().any(|m| said(m) == Some(false)) {
        return Some(false);
    }
    if members.iter().all(|m| said(m) == Some(true)) {
        return Some(true);
    }
    let silent_for_good = members.iter().any(|&(rank, generation)| {
        said(&(rank, generation)).is_none()
            && (generations.get(rank).is_some_and(|&g| g > generation) || gone.contains(&(rank, generation)))
    });
    (silent_for_good || waited_s >= deadline_s).then_some(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(rank: Rank, generation: u64, donor: Rank) -> Admitted {
        Admitted { rank, generation, donor }
    }

    fn closed(d: Decision) -> Closed {
        match d {
            Decision::Close(c) => c,
            other => panic!("expected the round to close, got {other:?}"),
        }
    }

    #[test]
    fn a_round_closes_when_every_member_contributed_and_not_before() {
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1), (2, 1)], 0.0, 30.0);
        q.arrive(0, 2, 1);
        q.arrive(0, 0, 1);
        assert_eq!(q.poll(1.0), Decision::Wait { until: 30.0 });
        q.arrive(0, 1, 1);
        let c = closed(q.poll(2.0));
        assert_eq!((c.round, c.members, c.dropped, c.admitted), (0, vec![0, 1, 2], vec![], vec![]));
        assert_eq!(q.round(), 1);
        assert_eq!(q.poll(3.0), Decision::Wait { until: 32.0 }, "the next round opened when this one closed");
    }

    #[test]
    fn a_member_that_misses_the_deadline_is_dropped_and_its_late_contribution_ignored() {
        let mut q = HostQuorum::new(5, &[(0, 1), (1, 1)], 0.0, 30.0);
        q.arrive(5, 0, 1);
        assert!(matches!(q.poll(29.9), Decision::Wait { .. }));
        let c = closed(q.poll(30.0));
        assert_eq!((c.members, c.dropped), (vec![0], vec![1]));
        q.arrive(5, 1, 1);
        q.arrive(6, 1, 1);
        assert_eq!(q.members(), vec![0]);
        q.arrive(6, 0, 1);
        assert_eq!(closed(q.poll(31.0)).members, vec![0], "host 1 is out until it announces itself again");
    }

    #[test]
    fn a_killed_host_restarting_leaves_at_once_and_joins_at_the_next_boundary_from_a_donor() {
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1), (2, 1)], 0.0, 30.0);
        q.arrive(0, 1, 1);
        // Host 1 is killed -9 after contributing and restarts as generation 2 before the round closes: its old
        // contribution leaves with it, and the round need not wait for it.
        q.announce(1, 2);
        q.arrive(0, 0, 1);
        q.arrive(0, 2, 1);
        let c = closed(q.poll(1.0));
        assert_eq!((c.members, c.dropped, c.admitted), (vec![0, 2], vec![], vec![a(1, 2, 0)]));
        assert_eq!(c.next, vec![(0, 1), (1, 2), (2, 1)], "the next round's members, the joiner among them");
        assert_eq!(q.members(), vec![0, 1, 2]);
        assert_eq!(q.generation(1), Some(2));
        // An old generation's contribution or announcement changes nothing.
        q.arrive(1, 1, 1);
        q.announce(1, 1);
        assert_eq!(q.generation(1), Some(2));
        for r in [0, 1, 2] {
            q.arrive(1, r, if r == 1 { 2 } else { 1 });
        }
        assert_eq!(closed(q.poll(2.0)).members, vec![0, 1, 2]);
    }

    #[test]
    fn the_donor_is_the_lowest_member_that_contributed() {
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1), (2, 1)], 0.0, 10.0);
        q.announce(3, 1);
        q.arrive(0, 2, 1);
        q.arrive(0, 1, 1);
        let c = closed(q.poll(10.0));
        assert_eq!((c.members, c.dropped, c.admitted), (vec![1, 2], vec![0], vec![a(3, 1, 1)]));
    }

    #[test]
    fn a_round_nobody_contributes_to_stalls_unless_a_host_comes_back_to_found_it_again() {
        let mut q = HostQuorum::new(7, &[(0, 1), (1, 1), (2, 1)], 0.0, 10.0);
        assert_eq!(q.poll(10.0), Decision::Stalled { round: 7 });
        // Hosts 1 and 2 were restarted, host 0 hangs: the lowest joiner founds the run again, host 0 is dropped.
        q.announce(2, 2);
        q.announce(1, 2);
        let c = closed(q.poll(11.0));
        assert_eq!((c.members, c.dropped, c.admitted), (vec![], vec![0], vec![a(1, 2, 1), a(2, 2, 1)]));
        assert_eq!(q.members(), vec![1, 2]);
        // Every member restarted before the deadline: no one is dropped, both found again.
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1)], 0.0, 10.0);
        q.announce(0, 2);
        q.announce(1, 2);
        assert!(matches!(q.poll(5.0), Decision::Wait { .. }), "the founders wait for the deadline");
        let c = closed(q.poll(10.0));
        assert_eq!((c.members, c.dropped, c.admitted), (vec![], vec![], vec![a(0, 2, 0), a(1, 2, 0)]));
    }

    /// A member whose process is gone (it stopped beating) leaves the open round at once: the round closes with the
    /// others without waiting for the deadline, and lists it as dropped; a stale generation's silence changes nothing.
    #[test]
    fn a_member_that_stopped_beating_leaves_the_round_at_once() {
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1), (2, 1)], 0.0, 120.0);
        q.arrive(0, 0, 1);
        q.arrive(0, 1, 1);
        assert!(matches!(q.poll(1.0), Decision::Wait { .. }));
        q.gone(2, 7);
        assert!(matches!(q.poll(1.5), Decision::Wait { .. }), "another generation's silence");
        q.gone(2, 1);
        let c = closed(q.poll(2.0));
        assert_eq!((c.members, c.dropped, c.next), (vec![0, 1], vec![2], vec![(0, 1), (1, 1)]));
        // Restarted, it is admitted as usual.
        q.announce(2, 2);
        q.arrive(1, 0, 1);
        q.arrive(1, 1, 1);
        assert_eq!(closed(q.poll(3.0)).admitted, vec![a(2, 2, 0)]);
    }

    /// A member is gone once its counter stood still for the whole silence; a moving counter, or a gap in the
    /// readings (the reader held up), starts the silence again.
    #[test]
    fn a_host_is_gone_after_a_silence_the_reader_watched() {
        let mut w = BeatWatch::default();
        let read = |w: &mut BeatWatch, now: f64, counts: &[(Rank, i64)]| w.read(now, counts, 10.0, 2.0);
        assert!(read(&mut w, 0.0, &[(1, 5), (2, 7)]).is_empty());
        for t in 1..10 {
            assert!(read(&mut w, t as f64, &[(1, 5 + t), (2, 7)]).is_empty(), "at {t} s");
        }
        assert_eq!(read(&mut w, 10.0, &[(1, 15), (2, 7)]), vec![2], "host 2 silent for 10 s");
        assert!(read(&mut w, 11.0, &[(1, 16), (2, 7)]).is_empty(), "forgotten once gone, then watched afresh");
        // The reader was held up 12 s (a stalled store), then 9 s: neither host's silence counts across the gaps.
        assert!(read(&mut w, 23.0, &[(1, 16), (2, 7)]).is_empty());
        assert!(read(&mut w, 32.0, &[(1, 16), (2, 7)]).is_empty());
        assert!(read(&mut w, 33.0, &[(1, 16), (2, 7)]).is_empty());
        // Watched without a gap, a still counter is gone after exactly the silence.
        let mut w = BeatWatch::default();
        for t in 0..=10 {
            assert_eq!(read(&mut w, t as f64, &[(1, 3)]).is_empty(), t < 10, "at {t} s");
        }
    }

    /// Rank 0 is lost once silent for the timeout; an answer ends a silence, and a gap in the looking (this process
    /// did not run) starts it again.
    #[test]
    fn rank_0_is_lost_after_a_silence_the_watcher_saw_or_a_failed_connection() {
        let mut w = LeaderWatch::new(60.0, 15.0);
        assert_eq!(w.observe(0.0, Reply::Answered), None);
        for t in 1..60 {
            assert_eq!(w.observe(t as f64, Reply::TimedOut), None, "silent for {t} s");
        }
        assert_eq!(w.observe(60.0, Reply::TimedOut), Some(60.0));
        let mut w = LeaderWatch::new(60.0, 15.0);
        w.observe(0.0, Reply::Answered);
        assert_eq!(w.observe(35.0, Reply::TimedOut), None, "a gap in the looking: the silence starts now");
        for t in [45.0, 55.0, 65.0, 75.0, 85.0, 94.0] {
            assert_eq!(w.observe(t, Reply::TimedOut), None, "silent since 35 s, at {t} s");
        }
        assert_eq!(w.observe(95.0, Reply::TimedOut), Some(60.0));
        let mut w = LeaderWatch::new(60.0, 15.0);
        w.observe(0.0, Reply::Answered);
        assert_eq!(w.observe(10.0, Reply::TimedOut), None);
        assert_eq!(w.observe(11.0, Reply::Answered), None, "it answered: the silence ends");
        assert_eq!(w.observe(20.0, Reply::TimedOut), None);
        assert_eq!(w.observe(71.0, Reply::TimedOut), None, "a gap in the looking: the silence starts again");
    }

    /// The coordinator's clock skips the time its process did not run: a round open across a stop of rank 0 is
    /// not closed for it, and closes at its deadline counted in running time.
    #[test]
    fn a_round_waits_its_deadline_in_time_rank_0_ran() {
        let mut clock = RunningClock::new(2.0);
        let mut q = HostQuorum::new(0, &[(0, 1), (1, 1)], clock.read(0.0), 10.0);
        for t in 1..=5 {
            assert!(matches!(q.poll(clock.read(t as f64 * 0.5)), Decision::Wait { .. }));
        }
        // Stopped from 2.5 s to 32.5 s: 30 s that count for nothing.
        let now = clock.read(32.5);
        assert_eq!(now, 2.5);
        q.arrive(0, 1, 1);
        assert!(matches!(q.poll(now), Decision::Wait { .. }), "rank 0's own part is still to come");
        let mut t = 32.5;
        while t < 39.5 {
            t += 0.5;
            assert!(matches!(q.poll(clock.read(t)), Decision::Wait { .. }), "at {t} s");
        }
        let Decision::Close(closed) = q.poll(clock.read(40.0)) else { panic!("the deadline passed in running time") };
        assert_eq!((closed.members, closed.dropped), (vec![1], vec![0]));
    }

    /// A round's update applies only when every member summed; one failure, a member restarted since, or the
    /// deadline skips it everywhere; nobody posting (the store sums) decides nothing.
    #[test]
    fn an_update_applies_only_when_every_member_summed() {
        let members = [(0, 1), (1, 1), (2, 3)];
        let gens = [1, 1, 3];
        let none = BTreeSet::new();
        let posts = |p: &[(Rank, u64, bool)]| p.iter().map(|&(r, g, ok)| (r, (g, ok))).collect::<BTreeMap<_, _>>();
        assert_eq!(sum_outcome(&members, &posts(&[]), &gens, &none, 99.0, 10.0), None);
        assert_eq!(sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true)]), &gens, &none, 1.0, 10.0), None);
        assert_eq!(
            sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true), (2, 3, true)]), &gens, &none, 1.0, 10.0),
            Some(true)
        );
        // One member's all-reduce failed: skip at once, whoever else has not said yet.
        assert_eq!(sum_outcome(&members, &posts(&[(1, 1, false)]), &gens, &none, 0.0, 10.0), Some(false));
        // Host 2 restarted (generation 4): its old generation will never say.
        assert_eq!(
            sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true)]), &[1, 1, 4], &none, 1.0, 10.0),
            Some(false)
        );
        // A post of another generation is not the member's.
        assert_eq!(
            sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true), (2, 2, true)]), &gens, &none, 1.0, 10.0),
            None
        );
        // Host 2's process is gone (it stopped beating): it will never say either.
        let gone = BTreeSet::from([(2, 3)]);
        assert_eq!(sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true)]), &gens, &gone, 1.0, 10.0), Some(false));
        // Silent past the deadline.
        assert_eq!(sum_outcome(&members, &posts(&[(0, 1, true), (1, 1, true)]), &gens, &none, 10.0, 10.0), Some(false));
    }
}
