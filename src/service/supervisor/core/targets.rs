//! The target copies: started one at a time, restarted after a failure (a batch that crashes one twice is set
//! aside), and the capture requests routed to the copy that feeds each drafter.
use super::*;

impl Core {
    pub(super) fn target_ready(&mut self, target: usize, generation: u64) {
        let first = !self.targets[target].ever_ready;
        let Some(resend) = self.targets[target].ready(generation, self.now) else { return };
        let fed: Vec<usize> = (0..self.feeds.len()).filter(|&d| self.feeds[d] == target).collect();
        if first {
            tracing::info!(id = target, device = %self.targets[target].device, drafters = ?fed, "target ready");
        } else {
            tracing::info!(id = target, "target restarted; resending {} requests", resend.len());
        }
        for request in resend {
            self.out.push(Action::TargetRequest { target, generation, request });
        }
    }

    pub(super) fn target_failed(&mut self, target: usize, generation: u64, failure: Failure) {
        let s = self.config.supervision.clone();
        let Some(outcome) = self.targets[target].failed(generation, self.now, &s) else { return };
        self.out.push(Action::AbandonTarget { target, generation });
        tracing::warn!(id = target, device = %self.targets[target].device, kind = ?failure.kind, "target failed: {}", failure.message);
        if let Some((batch, true)) = outcome.suspect {
            let ids = self.set_batch_aside(batch);
            tracing::error!(
                ?batch,
                sample_ids = %ids,
                "batch failed the target twice: set aside (its samples are not trained this epoch); the last error: {}",
                failure.message
            );
        }
        if !failure.restartable() {
            self.begin_ending(EXIT_RESTART, false, because("a target copy's device is poisoned", &failure));
        } else if outcome.restart_at.is_none() {
            let reason = format!(
                "target copy {target} failed more than supervision.max_restarts = {} times within {} s",
                s.max_restarts, s.restart_window_s
            );
            self.begin_ending(EXIT_NO_PROGRESS, false, reason);
        }
    }

    /// The ids of the samples at `positions`, as a JSON list (for the log).
    pub(super) fn ids_of(&self, positions: &[usize]) -> String {
        let ids: Vec<&SampleId> = positions.iter().filter_map(|&p| self.sample_ids.get(p)).collect();
        serde_json::to_string(&ids).unwrap_or_default()
    }

    /// Sets a batch aside everywhere it is queued; returns its sample ids (a JSON list, for the log).
    pub(super) fn set_batch_aside(&mut self, batch: BatchId) -> String {
        let positions = self.schedule.set_aside_now(batch).map(|b| b.samples).unwrap_or_default();
        for t in &mut self.targets {
            t.blank(batch);
        }
        self.ids_of(&positions)
    }

    pub(super) fn send(&mut self, drafter: usize, generation: u64, item: Item) {
        self.seq += 1;
        let request = Request { seq: self.seq, drafter, generation, item };
        let target = self.feeds[drafter];
        if let Some(request) = self.targets[target].push(request, self.now) {
            let generation = self.targets[target].generation;
            self.out.push(Action::TargetRequest { target, generation, request });
        }
    }

    pub(super) fn start_targets(&mut self) {
        let now = self.now;
        for t in 0..self.targets.len() {
            if self.targets[t].due(now) {
                let generation = self.targets[t].start(now);
                self.out.push(Action::StartTarget { target: t, generation });
            }
        }
        if self.phase == Phase::StartingTargets {
            if self.targets.iter().all(|t| t.ever_ready) {
                self.phase = Phase::StartingDrafters;
            } else if self.targets.iter().all(|t| t.ever_ready || t.never_started() || t.gave_up()) {
                // One copy at a time: random preset weights come from reseeded generators, and loads do not pile up.
                if let Some(t) = self.targets.iter().position(TargetCopy::never_started) {
                    let generation = self.targets[t].start(now);
                    self.out.push(Action::StartTarget { target: t, generation });
                }
            }
        }
    }
}
