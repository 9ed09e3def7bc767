//! The drafters' lifecycle: ready, joined, failed (abandoned, backed off or failed for good), and who starts next:
//! joiners while a member is live, one founder when the collective is empty, joiners that lost their donor back in
//! line.
use super::*;

impl Core {
    pub(super) fn drafter_ready(&mut self, id: usize, generation: u64) {
        let slot = &mut self.slots[id];
        let Life::Starting { role, since, .. } = slot.life else { return };
        if slot.generation != generation {
            return;
        }
        slot.life = Life::Starting { role, since, ready: true };
        tracing::info!(drafter = id, device = %slot.device, generation, "drafter ready");
        if role == Role::Joiner
            && let Some(donor) = self.donor()
        {
            self.tell(donor, Order::ServeJoiners);
        }
    }

    pub(super) fn drafter_joined(&mut self, id: usize, generation: u64, step: u64) {
        let slot = &mut self.slots[id];
        if slot.generation != generation || !matches!(slot.life, Life::Starting { .. }) {
            return;
        }
        let founder = slot.role() == Some(Role::Founder);
        slot.life = Life::Live;
        slot.step = step;
        self.progress_at = self.now;
        // A follower dropped from the run is back in it once a drafter of its is live again.
        self.hosts.left = None;
        if !self.members.contains(&(id, generation)) {
            self.members.push((id, generation));
            self.members.sort_unstable();
        }
        if founder {
            self.founding_from = None;
            if self.is_follower() {
                self.entered_at(step);
            }
        }
        tracing::info!(drafter = id, step, "drafter live");
        if self.phase == Phase::Running {
            for st in self.schedule.open_steps_from(step) {
                for item in self.schedule.assign(st, id, generation) {
                    self.send(id, generation, item);
                }
            }
        }
        let joiners_waiting =
            self.slots.iter().any(|s| matches!(s.life, Life::Starting { role: Role::Joiner, ready: true, .. }));
        if joiners_waiting {
            self.tell((id, generation), Order::ServeJoiners);
        }
    }

    /// Gives up drafter thread `(id, generation)`, and blanks what the target copies still hold for it.
    fn abandon(&mut self, id: usize, generation: u64) {
        for t in &mut self.targets {
            t.forget(id, generation);
        }
        self.out.push(Action::Abandon { id, generation });
    }

    pub(super) fn drafter_failed(
        &mut self,
        id: usize,
        generation: u64,
        failure: Failure,
        running: &[BatchId],
        injected: bool,
    ) {
        if !self.slots[id].current(generation) {
            return;
        }
        tracing::warn!(drafter = id, generation, kind = ?failure.kind, "drafter failed: {}", failure.message);
        if !injected {
            self.schedule.note_failure(running);
        }
        if self.slots[id].role() == Some(Role::Founder)
            && let Some(step) = self.founding_from.take()
            && failure.kind == FailureKind::CheckpointLoad
        {
            tracing::error!(step, "the checkpoint of step {step} cannot be loaded: later rewinds pass it over");
            self.book.shun(step);
        }
        self.abandon(id, generation);
        // The round goes on without it: those that waited for it (longer than the budget, when it hung) wait for
        // the round as it is now, with a budget of their own, not blamed in the moment before it re-forms.
        self.progress_at = self.now;
        if self.book.donor_lost(id, generation) {
            // The snapshot will never come: ask another replica.
            self.checkpoint_owed = true;
        }
        if !failure.restartable() {
            self.slots[id].life = Life::Failed;
            self.begin_ending(EXIT_RESTART, false, because("an error poisoned a drafter's device", &failure));
            return;
        }
        let s = self.config.supervision.clone();
        let mut give_up = false;
        if failure.kind == FailureKind::Hang && !injected {
            let hangs = self.gpu_hangs.entry(self.slots[id].device.clone()).or_insert(0);
            *hangs += 1;
            give_up = *hangs >= s.gpu_hang_limit;
        }
        match self.slots[id].fail(self.now, &s, give_up) {
            Some(at) => {
                tracing::info!(drafter = id, in_ms = at.saturating_sub(self.now).as_millis() as u64, "restarting");
                self.out.push(Action::Notice(Notice::Restarted { id }));
            }
            None => tracing::error!(
                drafter = id,
                restarts = self.slots[id].restarts.total,
                "drafter marked failed; training continues without it"
            ),
        }
    }

    pub(super) fn step_done(
        &mut self,
        id: usize,
        generation: u64,
        step: u64,
        digest: Option<[i64; 3]>,
        applied: bool,
        wait: f64,
    ) {
        if self.slots[id].generation != generation || !self.slots[id].is_live() {
            return;
        }
        self.slots[id].step = step;
        self.window.feature_wait_s += wait;
        // Every replica skips alike; the donor's word counts it once.
        if !applied && self.donor().map(|d| d.0) == Some(id) {
            tracing::warn!(
                step,
                "the update was skipped on every replica (a non-finite gradient norm, or a sum across hosts that did \
                 not complete); its samples stay committed"
            );
            self.skipped_steps += 1;
            self.hosts.survivor.skipped(step.saturating_sub(1));
            self.out.push(Action::Notice(Notice::Skipped));
        }
        if let Some(d) = digest {
            self.replicas.expected.entry(step).or_default().1.insert(id, d);
            self.compare_replicas(step);
        }
    }

    /// Starts every drafter whose turn it is: joiners while a member is live, one founder (after a rewind) when
    /// the collective is empty, threads that lost their donor back in line.
    pub(super) fn start_drafters(&mut self) {
        if self.phase == Phase::StartingTargets || self.ending.is_some() {
            return;
        }
        let founder_starting = self.slots.iter().any(|s| s.role() == Some(Role::Founder));
        if self.members.is_empty() && !founder_starting {
            // Joiners whose donor is gone would wait forever: back in line, without it counting against them.
            let mut abandoned = vec![];
            for s in self.slots.iter_mut().filter(|s| s.role() == Some(Role::Joiner)) {
                tracing::warn!(drafter = s.id, "no live replica left to join: it will start again");
                abandoned.push((s.id, s.generation));
                s.life = Life::Waiting;
            }
            for (id, generation) in abandoned {
                self.abandon(id, generation);
            }
        }
        let now = self.now;
        let due: Vec<usize> = self.slots.iter().filter(|s| s.due(now)).map(|s| s.id).collect();
        let Some(&first) = due.first() else { return };
        let starting = self.slots.iter().any(|s| matches!(s.life, Life::Starting { .. }));
        if self.phase == Phase::StartingDrafters && starting {
            return;
        }
        if self.members.is_empty() {
            if !founder_starting {
                self.found_with(first);
            }
            return;
        }
        if self.donor().is_none() {
            // A member whose Joined report is on its way: it will serve them.
            return;
        }
        let take = if self.phase == Phase::StartingDrafters { 1 } else { due.len() };
        for id in due.into_iter().take(take) {
            let generation = self.slots[id].spawn(Role::Joiner, now);
            self.out.push(Action::SpawnDrafter { id, generation, start: Start::Join });
        }
    }
}
