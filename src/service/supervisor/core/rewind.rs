//! Founding the collective again: the state a founder starts from (the resumed checkpoint, then the newest valid
//! checkpoint of this run, found by a scan that passes over bad and abandoned ones), and the run put back at it.
use super::*;
use crate::data::loader::Batch;

impl Core {
    /// Founds the empty collective with drafter `id`, once the state to found it from is known (the resumed
    /// checkpoint the first time; later a scan for the newest valid checkpoint).
    pub(super) fn found_with(&mut self, id: usize) {
        if self.is_follower() {
            return self.enter_again(id);
        }
        if self.is_leader() && self.incarnation > 0 {
            // The run's batches of the rounds closed meanwhile would pass rank 0's ledger by: the run restarts.
            return self.begin_ending(
                EXIT_RESTART,
                false,
                "rank 0 lost every drafter: the run restarts from its newest checkpoint (resume with --resume auto)"
                    .into(),
            );
        }
        if matches!(self.rewind, Rewind::Idle)
            && self.initial.is_none()
            && let Some((_, since)) = self.book.writing()
        {
            // The checkpoint being written may be the newest state there is: wait for it, within the start deadline.
            if self.now.saturating_sub(since) <= self.start_deadline() {
                return;
            }
            tracing::warn!("the checkpoint in flight is late: rewinding without it (the writer will discard it)");
            self.book.forget_write();
        }
        let source = match std::mem::replace(&mut self.rewind, Rewind::Idle) {
            Rewind::Scanned(source) => source,
            Rewind::Idle if self.initial.is_some() => self.initial.take().unwrap_or(Source::Fresh),
            Rewind::Idle => return self.scan(),
            Rewind::RetryAt(at) if at <= self.now => return self.scan(),
            waiting => {
                self.rewind = waiting;
                return;
            }
        };
        let first = self.incarnation == 0;
        self.incarnation += 1;
        self.restore(&source);
        let position = self.schedule.committed_step();
        if !first {
            tracing::warn!(step = position, "no live replica: the run continues from step {position}");
        }
        self.out
            .push(Action::RewindCollective { step: position, samples_committed: self.schedule.samples_committed() });
        self.out.push(Action::DropSnapshots { which: None });
        // Checkpoints above the source belong to steps this run no longer has (or could not use): moved aside, so
        // that no later rewind or resume jumps onto them.
        self.out.push(Action::RetireCheckpoints { from: position + 1, to: u64::MAX });
        if let Source::Checkpoint(_, state) = &source
            && let Some(&(from, _)) = state.recent_commits.first()
        {
            // Written by another host when rank 0 was lost, or by rank 0 while its ledger failed: the ledger may not
            // have reached these steps.
            self.ledger(LedgerEntry::Rewind { step: from });
            let mut commits: Vec<(u64, Batch)> = Vec::new();
            for (step, ids) in &state.recent_commits {
                commits.extend(ids.iter().filter_map(|&id| self.schedule.batch(id)).map(|b| (*step, b)));
            }
            for (step, batch) in commits {
                self.ledger(LedgerEntry::Commit { step, batch });
            }
        }
        self.ledger(LedgerEntry::Rewind { step: position });
        let path = match source {
            Source::Checkpoint(path, state) => {
                self.founding_from = Some(state.step);
                Some(path)
            }
            Source::Fresh => None,
        };
        let generation = self.slots[id].spawn(Role::Founder, self.now);
        self.out.push(Action::SpawnDrafter { id, generation, start: Start::Found(path) });
    }

    pub(super) fn scan(&mut self) {
        self.rewind = Rewind::Scanning;
        self.out.push(Action::FindCheckpoint(self.book.scan_filter()));
    }

    pub(super) fn checkpoint_found(&mut self, result: Result<Scan, String>) {
        if !matches!(self.rewind, Rewind::Scanning) {
            return;
        }
        match result {
            Ok(found) => {
                self.scan_failures = 0;
                self.book.found_invalid(&found.rejected.iter().map(|(step, _)| *step).collect::<Vec<_>>());
                self.rewind = Rewind::Scanned(match found.newest {
                    Some((path, state)) => {
                        tracing::warn!(step = state.step, path = %path.display(), "rewinding to the newest valid checkpoint");
                        Source::Checkpoint(path, Box::new(state))
                    }
                    None => {
                        tracing::warn!("no valid checkpoint: the run starts again from the beginning");
                        Source::Fresh
                    }
                });
            }
            Err(e) => {
                let attempts = self.scan_failures + 1;
                self.scan_failures = attempts;
                let s = self.supervision();
                let delay = s.backoff_initial_ms.saturating_mul(1 << attempts.min(16)).min(s.backoff_max_ms);
                tracing::error!("cannot look for a checkpoint to rewind to: {e}; trying again in {delay} ms");
                if attempts as usize > s.max_restarts {
                    self.rewind = Rewind::Idle;
                    self.begin_ending(EXIT_RESTART, false, format!("checkpoint.dir cannot be read: {e}"));
                } else {
                    self.rewind = Rewind::RetryAt(self.now + Duration::from_millis(delay));
                }
            }
        }
    }

    /// Puts the run at `source`'s position, in the current incarnation.
    pub(super) fn restore(&mut self, source: &Source) {
        let (position, state) = match source {
            Source::Checkpoint(_, state) => (Position::of(state), Some(state)),
            Source::Fresh => (Position::START, None),
        };
        self.schedule.restore(&position, self.incarnation);
        self.skipped_steps = state.map_or(0, |s| s.skipped_steps);
        self.last_lr = state.map_or(0.0, |s| s.lr);
        for t in &mut self.targets {
            t.clear();
        }
        self.replicas.expected.clear();
        let boundary = match state {
            Some(s) => (**s).clone(),
            None => self.boundary_state(),
        };
        let newest = match source {
            Source::Checkpoint(path, state) => Some(Newest { step: state.step, path: path.clone(), at: self.now }),
            Source::Fresh => None,
        };
        self.book.rewound(position.step, boundary, newest);
    }

    /// The trainer state at the committed step boundary (the optimizer's count comes with the snapshot).
    pub(super) fn boundary_state(&self) -> TrainerState {
        let mut state =
            TrainerState::new(self.schedule.committed_step(), self.schedule.loader_state(), self.config.merged.clone());
        state.samples_committed = self.schedule.samples_committed();
        state.skipped_steps = self.skipped_steps;
        state.set_aside = self.schedule.set_aside().to_vec();
        state.lr = self.last_lr;
        state.recent_commits = self.unwritten_commits();
        state
    }
}
