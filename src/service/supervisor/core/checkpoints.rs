//! Checkpoints and evaluation: asking a live replica for a snapshot, the writer's answers, evaluations that wait
//! for a checkpoint.
use super::*;

impl Core {
    /// Asks the donor for a snapshot at the first step boundary not handed out yet (once the steps in flight are
    /// done); the step, or `None` when no drafter is live or a checkpoint is in flight.
    pub(super) fn request_checkpoint(&mut self, reason: &str) -> Option<u64> {
        if self.is_follower() {
            // Rank 0 writes the run's checkpoints.
            return None;
        }
        let donor = self.donor()?;
        let at = self.schedule.next_step();
        if !self.book.request(donor.0, donor.1, at, self.now) {
            return None;
        }
        tracing::debug!(reason, drafter = donor.0, at, "checkpoint requested");
        self.checkpoint_owed = false;
        self.tell(donor, Order::Checkpoint { at });
        Some(at)
    }

    /// Hands a checkpoint to the writer, as part of the current incarnation.
    pub(super) fn write(&mut self, mut job: WriteJob) {
        job.incarnation = self.incarnation;
        self.out.push(Action::WriteCheckpoint(job));
    }

    pub(super) fn checkpoint_written(&mut self, step: u64, incarnation: u64, result: Result<(PathBuf, f64), String>) {
        self.writer_answered();
        if incarnation != self.incarnation {
            // A write the run stopped waiting for when it rewound (the writer normally discards those).
            if result.is_ok() {
                tracing::warn!(step, "a checkpoint of steps the run rewound past was written late: it is moved aside");
                self.out.push(Action::RetireCheckpoints { from: step, to: step });
            }
            return;
        }
        match result {
            Ok((path, seconds)) => {
                tracing::info!(step, path = %path.display(), seconds = format!("{seconds:.2}"), "checkpoint written");
                self.out.push(Action::Notice(Notice::CheckpointOutcome(Some((step, seconds)))));
                self.book.written(step, Some(path.clone()), self.now);
                self.evaluate_if_due(step, path);
            }
            Err(e) => {
                tracing::error!(step, "checkpoint failed: {e}");
                self.out.push(Action::Notice(Notice::CheckpointOutcome(None)));
                self.book.written(step, None, self.now);
            }
        }
    }

    /// Hands checkpoint `path` of `step` to the evaluator when an evaluation is due at or before `step`.
    pub(super) fn evaluate_if_due(&mut self, step: u64, path: PathBuf) {
        let Some(due) = self.eval_due else { return };
        if step < due {
            // An older checkpoint was in flight when the evaluation came due.
            self.checkpoint_owed = true;
            return;
        }
        self.eval_due = None;
        if self.evaluating {
            tracing::warn!(step, "evaluation skipped: the previous one is still decoding (raise eval.every_steps)");
            return;
        }
        self.evaluating = true;
        self.out.push(Action::Evaluate { step, path });
    }

    pub(super) fn evaluated(&mut self, outcome: Result<Evaluated, String>) {
        self.evaluating = false;
        self.out.push(Action::Notice(Notice::Evaluated(outcome.clone())));
        match outcome {
            Ok(e) => {
                let holdout = match e.holdout_acceptance_length {
                    Some(a) => format!(" · held-out acceptance (teacher-forced, {} rows) {a:.3}", e.holdout_rows),
                    None => String::new(),
                };
                tracing::info!(
                    step = e.step,
                    "evaluation: decoded acceptance {:.3}{holdout} · token match {:.3} · {} prompts · {:.1} s · best {:.3}{}",
                    e.decode_acceptance_length,
                    e.token_match_rate,
                    e.prompts,
                    e.seconds,
                    e.best,
                    if e.new_best { " (new best: checkpoint kept as best)" } else { "" }
                );
                self.last_evaluation = Some(e);
            }
            Err(e) => tracing::error!("evaluation failed: {e}"),
        }
    }

    pub(super) fn periodic_checkpoint(&mut self) {
        if self.phase != Phase::Running || self.ending.is_some() || self.is_follower() {
            return;
        }
        let every = self.config.checkpoint.every_seconds;
        let timed = every > 0.0 && self.book.since_request(self.now).as_secs_f64() >= every;
        if self.book.in_flight() {
            if timed {
                self.book.skipped(self.now);
                self.checkpoint_skipped("periodic (time)");
            }
            return;
        }
        if timed || self.checkpoint_owed {
            self.request_checkpoint(if timed { "periodic (time)" } else { "owed" });
        }
    }
}
