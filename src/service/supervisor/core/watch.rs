//! The watchdog's verdicts carried out: who is stuck (see [`find_stuck`]) is failed like any other failure, a
//! drafter abandoned and restarted, a target copy restarted.
use super::*;
use crate::service::supervisor::watchdog::{Activity, DrafterSeen, Look, Stuck, TargetSeen, find_stuck};

impl Core {
    /// The hang budget now: measured from the recent rounds (see [`StepTimes::budget`]).
    pub(super) fn hang_budget(&self) -> Duration {
        self.step_times.budget(self.supervision())
    }

    pub(super) fn watch(&mut self, seen: Vec<DrafterSeen>) {
        if self.phase != Phase::Running || self.ending.is_some() {
            return;
        }
        let drafters: Vec<DrafterSeen> = seen
            .into_iter()
            .filter(|d| self.slots.get(d.id).is_some_and(|s| s.is_live() && s.current(d.generation)))
            .map(|d| DrafterSeen { for_: self.stopped.discount(self.monotonic, d.for_), ..d })
            .collect();
        let now = self.now;
        let targets: Vec<TargetSeen> = self
            .targets
            .iter()
            .filter_map(|t| {
                t.holding_for(now).map(|d| TargetSeen { id: t.id, generation: t.generation, holding_for: d })
            })
            .collect();
        let budget = self.hang_budget();
        let look = Look {
            budget,
            since_commit: now.saturating_sub(self.progress_at),
            steps_in_flight: self.schedule.in_flight() > 0,
            target_restarting: self.targets.iter().any(|t| !t.is_ready()),
            elsewhere: match self.hosts.role {
                None => &[],
                Some(HostRole::Leader) => &[Activity::WaitingForPeers],
                Some(HostRole::Follower) => &[Activity::WaitingForPeers, Activity::WaitingForWork],
            },
            drafters: &drafters,
            targets: &targets,
        };
        let stuck = find_stuck(&look);
        let over = |for_: Duration| format!("{:.1} s (hang budget {:.1} s)", for_.as_secs_f64(), budget.as_secs_f64());
        for verdict in stuck {
            match verdict {
                Stuck::Drafter(d) => {
                    let kind = if d.activity.is_busy() { FailureKind::Hang } else { FailureKind::Stalled };
                    let message = format!("{} for {}", d.activity.name(), over(d.for_));
                    let running = if d.activity == Activity::Computing { d.running } else { vec![] };
                    self.drafter_failed(d.id, d.generation, Failure { kind, message }, &running, d.injected);
                }
                Stuck::Target { id, generation, for_ } => {
                    let message = format!("no capture delivered for {}", over(for_));
                    self.target_failed(id, generation, Failure { kind: FailureKind::Hang, message });
                }
            }
        }
    }
}
