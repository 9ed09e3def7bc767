//! The run-level watchdog: every wait of the step protocol has a deadline, and when the run stops committing
//! rounds it finds who is stuck and fails that one, not the innocent that wait for it.
//!
//! The deadline (the hang budget) is measured from the run itself: `hang_factor` times the recent p99 of the time
//! between two committed rounds, at least `hang_floor_s` and at most `step_timeout_s`; until a few rounds have been
//! measured it is `step_timeout_s`. A drafter busy (computing, summing, applying, serving a joiner, taking a
//! snapshot) for longer than the budget is hung. When no round was committed within the budget while steps are in
//! flight, the blame goes, in order, to: a target copy holding a capture request that long; a drafter waiting for
//! work that long (its items never came); else the round itself is stuck, and every drafter waiting in it fails.
//! While a target copy restarts nobody waiting is blamed: its start has its own deadline. Across hosts, nobody is
//! blamed for waiting on another host: a round waits for the others' contributions, which rank 0's quorum judges
//! (their beats, `cluster.round_timeout_s`), another host's drafters wait for rank 0's assignments too, whose
//! silence `cluster.leader_timeout_s` judges, and an NCCL all-reduce over every host's drafters waits for all of
//! them, which `drafters.collective_timeout_s` bounds (its drafters report it as waiting for their peers).
//!
//! Time the process did not run (SIGSTOP, a host swapping, a VM paused) is charged to nobody ([`StoppedTime`]).
use std::collections::VecDeque;
use std::time::Duration;

use crate::config::SupervisionSettings;
use crate::data::loader::BatchId;

/// What a drafter thread is doing, as it reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// Building, loading, joining: timed by the start deadline, not here.
    Starting,
    /// Waiting for its step's items from its target copy.
    WaitingForWork,
    Computing,
    /// Contributed; waiting for the other members' contributions.
    WaitingForPeers,
    /// Summing the round's gradients (device copies or an NCCL all-reduce).
    Summing,
    Applying,
    /// Copying its state into joiners.
    Serving,
    /// Copying its state to host memory for a checkpoint.
    Snapshotting,
}

impl Activity {
    /// Whether the drafter itself is working (so a long time in it is its own hang).
    pub fn is_busy(self) -> bool {
        !matches!(self, Activity::Starting | Activity::WaitingForWork | Activity::WaitingForPeers)
    }

    pub fn name(self) -> &'static str {
        match self {
            Activity::Starting => "starting",
            Activity::WaitingForWork => "waiting for its features",
            Activity::Computing => "computing",
            Activity::WaitingForPeers => "waiting for its peers",
            Activity::Summing => "summing gradients",
            Activity::Applying => "applying the update",
            Activity::Serving => "serving joiners",
            Activity::Snapshotting => "taking a snapshot",
        }
    }
}

/// A live drafter thread as the shell saw it: what it does and for how long, with what failing it needs: the
/// batches it is computing, and whether a fault was injected into it (a rehearsal, not held against the batches or
/// the device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrafterSeen {
    pub id: usize,
    pub generation: u64,
    pub activity: Activity,
    pub for_: Duration,
    pub running: Vec<BatchId>,
    pub injected: bool,
}

/// A ready target copy holding an undelivered capture request, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetSeen {
    pub id: usize,
    pub generation: u64,
    pub holding_for: Duration,
}

/// Who the watchdog fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stuck {
    Drafter(DrafterSeen),
    Target { id: usize, generation: u64, for_: Duration },
}

/// What the watchdog looks at.
#[derive(Debug, Clone)]
pub struct Look<'a> {
    pub budget: Duration,
    /// Time since the last committed round (or since training began or rewound).
    pub since_commit: Duration,
    /// Whether steps are handed out and not committed yet.
    pub steps_in_flight: bool,
    /// Whether a target copy is restarting: the drafters it feeds wait for it (its start has its own deadline), so
    /// waiting is no one's fault.
    pub target_restarting: bool,
    /// The waits that are for other hosts (judged elsewhere, not here).
    pub elsewhere: &'a [Activity],
    pub drafters: &'a [DrafterSeen],
    pub targets: &'a [TargetSeen],
}

/// Who is stuck; empty when nothing is.
pub fn find_stuck(look: &Look) -> Vec<Stuck> {
    let over = |d: Duration| d > look.budget;
    let drafter = |d: &DrafterSeen| Stuck::Drafter(d.clone());
    let busy: Vec<Stuck> = look.drafters.iter().filter(|d| d.activity.is_busy() && over(d.for_)).map(drafter).collect();
    if !busy.is_empty() {
        // A target blocked behind a hung drafter, or peers waiting for it, are innocent: fail the drafter first.
        return busy;
    }
    if !look.steps_in_flight || !over(look.since_commit) {
        return vec![];
    }
    let targets: Vec<Stuck> = look
        .targets
        .iter()
        .filter(|t| over(t.holding_for))
        .map(|t| Stuck::Target { id: t.id, generation: t.generation, for_: t.holding_for })
        .collect();
    if !targets.is_empty() || look.target_restarting {
        return targets;
    }
    for waiting in
        [Activity::WaitingForWork, Activity::WaitingForPeers].into_iter().filter(|w| !look.elsewhere.contains(w))
    {
        let stuck: Vec<Stuck> =
            look.drafters.iter().filter(|d| d.activity == waiting && over(d.for_)).map(drafter).collect();
        if !stuck.is_empty() {
            return stuck;
        }
    }
    vec![]
}

/// Time this process did not run, learnt from its own periodic tick arriving late: a monotonic clock keeps counting
/// while a process is stopped (SIGSTOP, a swapping host, a paused VM), so without this a drafter computing when the
/// process stopped would be failed as hung when it continues, and so would everything waiting. CPU-time clocks would
/// not do: a drafter waiting for its GPU uses none. The shell finds the gaps ([`TickGaps`]) and tells the core
/// ([`Event::Stopped`](super::protocol::Event::Stopped)); the watchdog's clock ([`StoppedTime::clock`]) is the
/// monotonic one less the gaps, and a time measured on the monotonic clock is discounted by the gaps within it
/// ([`StoppedTime::discount`]).
#[derive(Debug, Clone, Default)]
pub struct StoppedTime {
    /// Each gap as (monotonic time it ended, time not run), oldest first.
    gaps: VecDeque<(Duration, Duration)>,
    total: Duration,
}

impl StoppedTime {
    /// Gaps remembered for discounting (older ones are folded into the clock only).
    const KEPT: usize = 64;

    /// The process did not run for `for_` up to monotonic time `end`.
    pub fn stopped(&mut self, end: Duration, for_: Duration) {
        if self.gaps.len() == Self::KEPT {
            self.gaps.pop_front();
        }
        self.gaps.push_back((end, for_));
        self.total += for_;
    }

    /// The watchdog's clock at monotonic time `now`.
    pub fn clock(&self, now: Duration) -> Duration {
        now.saturating_sub(self.total)
    }

    /// `for_`, measured on the monotonic clock up to `now`, less the gaps within it.
    pub fn discount(&self, now: Duration, for_: Duration) -> Duration {
        let began = now.saturating_sub(for_);
        let stopped: Duration =
            self.gaps.iter().filter(|(end, _)| *end > began).map(|&(end, gap)| gap.min(end - began)).sum();
        for_.saturating_sub(stopped)
    }
}

/// The shell's side of [`StoppedTime`]: a message handled later than [`GAP`](Self::GAP) after the last tick (the
/// shell ticks five times a second) ends a gap in which the process did not run. Any message counts, as the first one
/// handled after the process continues need not be the tick.
#[derive(Debug, Clone, Default)]
pub struct TickGaps {
    last_tick: Option<Duration>,
}

impl TickGaps {
    pub const GAP: Duration = Duration::from_secs(2);
    /// The shell's tick period: the part of a gap that is ordinary waiting.
    pub const TICK: Duration = Duration::from_millis(200);

    /// A message at monotonic time `now` (`tick`: the periodic one); the time not run before it, if any.
    pub fn observe(&mut self, now: Duration, tick: bool) -> Option<Duration> {
        let gap = self.last_tick.map(|last| now.saturating_sub(last)).filter(|&since| since > Self::GAP);
        if tick || gap.is_some() || self.last_tick.is_none() {
            self.last_tick = Some(now);
        }
        gap.map(|since| since - Self::TICK)
    }
}

/// The recent times between committed rounds, for the hang budget.
#[derive(Debug, Default, Clone)]
pub struct StepTimes {
    recent: VecDeque<Duration>,
}

impl StepTimes {
    /// Rounds kept.
    const KEPT: usize = 200;
    /// Rounds measured before the budget follows them.
    pub const MEASURED: usize = 8;

    pub fn record(&mut self, between_commits: Duration) {
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(between_commits);
    }

    /// The 99th percentile (nearest rank), once enough rounds were measured.
    pub fn p99(&self) -> Option<Duration> {
        if self.recent.len() < Self::MEASURED {
            return None;
        }
        let mut sorted: Vec<Duration> = self.recent.iter().copied().collect();
        sorted.sort_unstable();
        let rank = (sorted.len() * 99).div_ceil(100);
        Some(sorted[rank.saturating_sub(1)])
    }

    /// The hang budget: `hang_factor` x p99 within [`hang_floor_s`, `step_timeout_s`]; `step_timeout_s` until
    /// measured.
    pub fn budget(&self, s: &SupervisionSettings) -> Duration {
        let ceiling = Duration::from_secs_f64(s.step_timeout_s);
        match self.p99() {
            None => ceiling,
            Some(p99) => p99.mul_f64(s.hang_factor).max(Duration::from_secs_f64(s.hang_floor_s)).min(ceiling),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Duration = Duration::from_secs(10);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn seen(id: usize, activity: Activity, for_: u64) -> DrafterSeen {
        DrafterSeen { id, generation: 1, activity, for_: secs(for_), running: vec![], injected: false }
    }

    fn look<'a>(since_commit: u64, drafters: &'a [DrafterSeen], targets: &'a [TargetSeen]) -> Look<'a> {
        Look {
            budget: BUDGET,
            since_commit: secs(since_commit),
            steps_in_flight: true,
            target_restarting: false,
            elsewhere: &[],
            drafters,
            targets,
        }
    }

    fn ids(stuck: &[Stuck]) -> Vec<String> {
        stuck
            .iter()
            .map(|s| match s {
                Stuck::Drafter(d) => format!("drafter {}", d.id),
                Stuck::Target { id, .. } => format!("target {id}"),
            })
            .collect()
    }

    #[test]
    fn a_drafter_busy_past_the_budget_is_hung_whatever_it_is_doing() {
        for activity in
            [Activity::Computing, Activity::Summing, Activity::Applying, Activity::Serving, Activity::Snapshotting]
        {
            let drafters = [seen(0, activity, 11), seen(1, Activity::WaitingForPeers, 11)];
            // Even while rounds still commit (the hung drafter is not a member of them).
            assert_eq!(ids(&find_stuck(&look(1, &drafters, &[]))), ["drafter 0"], "{activity:?}");
            let drafters = [seen(0, activity, 9)];
            assert!(find_stuck(&look(1, &drafters, &[])).is_empty());
        }
    }

    #[test]
    fn a_target_stuck_on_a_request_is_failed_not_the_drafters_waiting_for_it() {
        let drafters = [seen(0, Activity::WaitingForWork, 12), seen(1, Activity::WaitingForPeers, 12)];
        let targets = [TargetSeen { id: 0, generation: 3, holding_for: secs(12) }];
        assert_eq!(ids(&find_stuck(&look(12, &drafters, &targets))), ["target 0"]);
        // Rounds still commit: nothing is wrong yet.
        assert!(find_stuck(&look(5, &drafters, &targets)).is_empty());
    }

    #[test]
    fn a_target_blocked_behind_a_hung_drafter_is_innocent() {
        let drafters = [seen(0, Activity::Computing, 30), seen(1, Activity::WaitingForPeers, 29)];
        let targets = [TargetSeen { id: 0, generation: 1, holding_for: secs(29) }];
        assert_eq!(ids(&find_stuck(&look(30, &drafters, &targets))), ["drafter 0"]);
    }

    #[test]
    fn with_nobody_busy_the_drafters_holding_the_round_up_are_failed() {
        // The target delivered everything, yet drafter 1 never got its items: it is the one to restart.
        let drafters = [seen(0, Activity::WaitingForPeers, 20), seen(1, Activity::WaitingForWork, 20)];
        assert_eq!(ids(&find_stuck(&look(20, &drafters, &[]))), ["drafter 1"]);
        // Everyone contributed and the round never completed: the round itself is stuck.
        let drafters = [seen(0, Activity::WaitingForPeers, 20), seen(1, Activity::WaitingForPeers, 20)];
        assert_eq!(ids(&find_stuck(&look(20, &drafters, &[]))), ["drafter 0", "drafter 1"]);
        // A target copy restarting (loading a large model takes minutes): waiting for it is nobody's fault.
        let restarting = Look { target_restarting: true, ..look(20, &drafters, &[]) };
        assert!(find_stuck(&restarting).is_empty());
    }

    /// Waits for other hosts are not blamed, however long: on rank 0 the round's (the other hosts' contributions),
    /// on another host also its work (rank 0's assignments). Its own waits, a busy drafter and a stuck target copy
    /// are.
    #[test]
    fn waiting_for_another_host_is_not_failed() {
        let drafters = [seen(0, Activity::WaitingForPeers, 40), seen(1, Activity::WaitingForPeers, 40)];
        let leader = Look { elsewhere: &[Activity::WaitingForPeers], ..look(40, &drafters, &[]) };
        assert!(find_stuck(&leader).is_empty());
        let drafters = [seen(0, Activity::WaitingForPeers, 40), seen(1, Activity::WaitingForWork, 40)];
        assert_eq!(ids(&find_stuck(&Look { drafters: &drafters, ..leader })), ["drafter 1"], "its own target's work");
        let both = [Activity::WaitingForPeers, Activity::WaitingForWork];
        let follower = Look { elsewhere: &both, ..look(40, &drafters, &[]) };
        assert!(find_stuck(&follower).is_empty());
        let drafters = [seen(0, Activity::Computing, 40), seen(1, Activity::WaitingForPeers, 40)];
        assert_eq!(ids(&find_stuck(&Look { drafters: &drafters, ..follower.clone() })), ["drafter 0"]);
        let targets = [TargetSeen { id: 0, generation: 1, holding_for: secs(40) }];
        assert_eq!(ids(&find_stuck(&Look { targets: &targets, ..follower })), ["target 0"]);
    }

    /// A tick (or any message) later than the gap after the last tick ends a gap; ordinary ticks, messages between
    /// them and a delay within scheduling do not.
    #[test]
    fn a_late_message_ends_a_gap_in_the_ticks() {
        let ms = Duration::from_millis;
        let mut g = TickGaps::default();
        for i in 0..10 {
            assert_eq!(g.observe(ms(200 * i), true), None);
        }
        assert_eq!(g.observe(ms(1_900), false), None, "a message between ticks");
        assert_eq!(g.observe(ms(3_700), true), None, "1.9 s late: within scheduling");
        // Stopped from 3.7 s to 38.7 s: the first message after it (not the tick) ends the gap, and the late tick
        // that follows is not a second one.
        assert_eq!(g.observe(ms(38_700), false), Some(ms(34_800)));
        assert_eq!(g.observe(ms(38_800), true), None);
    }

    /// The watchdog's clock skips the time not run, and a time measured across a gap is discounted by the part of it
    /// within the time measured.
    #[test]
    fn time_the_process_was_stopped_is_charged_to_nobody() {
        let ms = Duration::from_millis;
        let mut t = StoppedTime::default();
        assert_eq!(t.clock(ms(1_900)), ms(1_900));
        t.stopped(ms(36_800), ms(34_800));
        assert_eq!(t.clock(ms(36_900)), ms(2_100));
        // Computing since 1.5 s: 35.4 s on the monotonic clock, 0.6 s of it run.
        assert_eq!(t.discount(ms(36_900), ms(35_400)), ms(600));
        // Begun after the gap, or 30 s before it: the gap counts only where it lies within.
        assert_eq!(t.discount(ms(40_000), ms(3_000)), ms(3_000));
        assert_eq!(t.discount(ms(40_000), ms(70_000)), ms(70_000 - 34_800));
        t.stopped(ms(50_000), ms(5_000));
        assert_eq!(t.discount(ms(50_100), ms(13_000)), ms(8_000), "only the second gap lies within");
    }

    #[test]
    fn waiting_is_not_a_hang_while_nothing_is_in_flight() {
        let drafters = [seen(0, Activity::WaitingForWork, 100)];
        let idle = Look { steps_in_flight: false, ..look(100, &drafters, &[]) };
        assert!(find_stuck(&idle).is_empty());
    }

    #[test]
    fn the_budget_follows_the_measured_steps_within_floor_and_ceiling() {
        let mut s = crate::config::Config::builtin().unwrap().supervision;
        (s.step_timeout_s, s.hang_factor, s.hang_floor_s) = (600.0, 20.0, 30.0);
        let mut times = StepTimes::default();
        assert_eq!(times.budget(&s), secs(600), "unmeasured: the ceiling");
        for _ in 0..StepTimes::MEASURED {
            times.record(Duration::from_millis(400));
        }
        assert_eq!(times.budget(&s), secs(30), "20 x 0.4 s is under the floor");
        for _ in 0..50 {
            times.record(secs(4));
        }
        assert_eq!(times.budget(&s), secs(80));
        times.record(secs(100));
        assert_eq!(times.budget(&s), secs(600), "capped by step_timeout_s");
        for _ in 0..StepTimes::KEPT {
            times.record(secs(2));
        }
        assert_eq!(times.budget(&s), secs(40), "old rounds age out");
    }
}
