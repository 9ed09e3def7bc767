//! The end of a run: one ending at a time (an error code wins over 0), its last checkpoint (the final one, at the
//! last step, for a complete run), its deadline, and the exit.
use super::*;

impl Core {
    /// The run is to end with `code` (an ending already under way keeps its own, unless this one is an error and
    /// it was not: a stop never turns a complete run's ending into a stop).
    pub(super) fn begin_ending(&mut self, code: i32, export: bool, reason: String) {
        if self.is_follower() {
            // Nothing to write here: rank 0 keeps the run's checkpoints; this host leaves the run.
            tracing::warn!(code, "{reason}: leaving the run");
            return self.exit_now(code);
        }
        if let Some(e) = &mut self.ending {
            if is_error(code) && !is_error(e.code) {
                tracing::error!("{reason}: ending with exit status {code}");
                e.code = code;
                e.export = false;
                e.reason = reason;
            }
            return;
        }
        match code {
            EXIT_OK => tracing::info!(step = self.schedule.committed_step(), "{reason}: checkpointing, then exiting"),
            code if is_stop(code) => tracing::info!(
                step = self.schedule.committed_step(),
                "{reason}: checkpointing, then exiting with status {code} (stopped before the run was complete)"
            ),
            _ => tracing::error!(
                step = self.schedule.committed_step(),
                code,
                "{reason}: checkpointing from a live replica if there is one, then exiting with status {code}"
            ),
        }
        self.ending = Some(Ending {
            code,
            export,
            reason,
            deadline: self.now + Duration::from_secs_f64(self.supervision().shutdown_timeout_s),
            writes_before: self.book.writes,
            failures_before: self.book.failures,
            exporting: false,
            final_evaluation: false,
        });
    }

    /// Ends the run once its last checkpoint is written (or cannot be).
    pub(super) fn try_end(&mut self) {
        let Some(e) = &self.ending else { return };
        if e.exporting {
            return;
        }
        let (code, export) = (e.code, e.export);
        let done = if export {
            self.book.written_at(self.schedule.committed_step())
        } else {
            self.book.writes > e.writes_before
        };
        let late = self.now >= e.deadline;
        if done {
            if export && !late && self.final_evaluation_pending() {
                return;
            }
            if export && self.ledger_unconfirmed() {
                // Complete means the audit trail too: its last lines, once written, or a restart that writes them.
                if !late {
                    return;
                }
                tracing::error!(
                    "the data ledger's last lines were not written within supervision.shutdown_timeout_s: exiting \
                     with status {EXIT_RESTART}; resuming writes them (the final checkpoint holds them)"
                );
                return self.finish(EXIT_RESTART, false);
            }
            return self.finish(code, export);
        }
        if late {
            let code = if is_error(code) { code } else { EXIT_RESTART };
            tracing::error!(
                seconds = self.supervision().shutdown_timeout_s,
                "the last checkpoint did not finish within supervision.shutdown_timeout_s: exiting with status \
                 {code}; the newest valid checkpoint stays"
            );
            return self.finish(code, false);
        }
        if self.book.in_flight() {
            return;
        }
        if self.book.failures > e.failures_before {
            let code = if is_error(code) { code } else { EXIT_ERROR };
            tracing::error!(
                "the last checkpoint could not be written: exiting with status {code}; the newest valid one stays"
            );
            return self.finish(code, false);
        }
        if export && !self.schedule.finished() {
            // Steps are still in flight: the final checkpoint is of the last one.
            return;
        }
        if self.request_checkpoint(if export { "final" } else { "ending" }).is_none() {
            // No live replica to checkpoint from.
            let code = if export { EXIT_RESTART } else { code };
            if is_error(code) {
                tracing::error!("no live replica to checkpoint from: exiting with status {code}");
            } else if is_stop(code) {
                tracing::warn!(
                    "no live replica to checkpoint from: exiting with status {code}; the newest valid checkpoint stays"
                );
            }
            self.finish(code, false);
        }
    }

    /// With evaluation on, a complete run's end line is about its final checkpoint: waits for an evaluation in
    /// flight, then evaluates the final checkpoint (once; a failure does not hold the end up). True while waiting.
    fn final_evaluation_pending(&mut self) -> bool {
        if self.config.eval.every_steps == 0 {
            return false;
        }
        if self.evaluating {
            return true;
        }
        let step = self.schedule.committed_step();
        let asked = self.ending.as_ref().is_some_and(|e| e.final_evaluation);
        if asked || self.last_evaluation.as_ref().is_some_and(|e| e.step >= step) {
            return false;
        }
        let Some(newest) = self.book.newest() else { return false };
        let path = newest.path.clone();
        if let Some(e) = &mut self.ending {
            e.final_evaluation = true;
        }
        self.evaluating = true;
        self.out.push(Action::Evaluate { step, path });
        true
    }

    pub(super) fn finish(&mut self, code: i32, export: bool) {
        if export && let Some(newest) = self.book.newest() {
            let from = newest.path.clone();
            if let Some(e) = &mut self.ending {
                e.exporting = true;
            }
            self.out.push(Action::Export { from });
            return;
        }
        self.exit_now(code);
    }

    pub(super) fn exit_now(&mut self, code: i32) {
        if let Some(line) = self.last_evaluation.as_ref().map(gained) {
            tracing::info!("{line}");
        }
        for (id, generation) in self.running_threads() {
            self.tell((id, generation), Order::Stop);
        }
        self.out.push(Action::Exit { code });
        self.exit = Some(code);
    }
}

/// The end-of-run line: what training gained, in the number that matters.
fn gained(e: &Evaluated) -> String {
    let output = if e.lossless {
        "the same output".to_string()
    } else {
        format!(
            "a DIFFERENT output on some prompts ({:.1}% of tokens matching up to each first difference: a bug, see \
             `dflash eval --decode --dump`)",
            100.0 * e.token_match_rate
        )
    };
    format!(
        "decoded acceptance 1.00 -> {:.2} (step {}, best {:.2}): on {} held-out prompts the target ran {:.2}x fewer \
         forward passes than greedy decoding, with {output}",
        e.decode_acceptance_length, e.step, e.best, e.prompts, e.decode_acceptance_length
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_of_run_line_says_what_was_gained() {
        let e = Evaluated {
            step: 150,
            decode_acceptance_length: 2.75,
            holdout_acceptance_length: None,
            holdout_rows: 0,
            token_match_rate: 1.0,
            lossless: true,
            prompts: 8,
            seconds: 3.0,
            best: 2.8,
            new_best: false,
        };
        let line = gained(&e);
        assert!(line.starts_with("decoded acceptance 1.00 -> 2.75 (step 150, best 2.80)"), "{line}");
        assert!(line.contains("2.75x fewer forward passes") && line.ends_with("the same output"), "{line}");
        let differs = gained(&Evaluated { lossless: false, token_match_rate: 0.97, ..e });
        assert!(differs.contains("a DIFFERENT output on some prompts (97.0% of tokens matching"), "{differs}");
    }
}
