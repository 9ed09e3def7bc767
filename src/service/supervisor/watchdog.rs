//! The run-level watchdog: every wait of the step protocol has a deadline, and when the run stops committing
//! rounds it finds who is stuck and fails that one, not the innocent that wait for it.
//!
//! The deadline (the hang budget) is measured from the run itself: `hang_factor` times the recent p99 of the time
//! between two committed rounds, at least `hang_floor_s` and at most `step_timeout_s`; until a few rounds have been
//! measured it is `step_timeout_s`. A drafter busy (computing, summing, applying, serving a joiner, taking a
//! snapshot) for longer than the budget is hung. When no round was committed within the budget while steps are in
//! flight, the blame goes, in order, to: a target copy holding a capture request that long; a drafter waiting for
//! work that long (its items never came); else the round itself is stuck, and every drafter waiting in it fails.
//! While a target copy restarts nobody waiting is blamed: its start has its own deadline.
use std::collections::VecDeque;
use std::time::Duration;

use crate::config::SupervisionSettings;

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

/// A live drafter thread as the shell saw it: what it does and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrafterSeen {
    pub id: usize,
    pub generation: u64,
    pub activity: Activity,
    pub for_: Duration,
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
    Drafter { id: usize, generation: u64, activity: Activity, for_: Duration },
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
    pub drafters: &'a [DrafterSeen],
    pub targets: &'a [TargetSeen],
}

/// Who is stuck; empty when nothing is.
pub fn find_stuck(look: &Look) -> Vec<Stuck> {
    let over = |d: Duration| d > look.budget;
    let drafter =
        |d: &DrafterSeen| Stuck::Drafter { id: d.id, generation: d.generation, activity: d.activity, for_: d.for_ };
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
    for waiting in [Activity::WaitingForWork, Activity::WaitingForPeers] {
        let stuck: Vec<Stuck> =
            look.drafters.iter().filter(|d| d.activity == waiting && over(d.for_)).map(drafter).collect();
        if !stuck.is_empty() {
            return stuck;
        }
    }
    vec![]
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
        DrafterSeen { id, generation: 1, activity, for_: secs(for_) }
    }

    fn look<'a>(since_commit: u64, drafters: &'a [DrafterSeen], targets: &'a [TargetSeen]) -> Look<'a> {
        Look {
            budget: BUDGET,
            since_commit: secs(since_commit),
            steps_in_flight: true,
            target_restarting: false,
            drafters,
            targets,
        }
    }

    fn ids(stuck: &[Stuck]) -> Vec<String> {
        stuck
            .iter()
            .map(|s| match s {
                Stuck::Drafter { id, .. } => format!("drafter {id}"),
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
