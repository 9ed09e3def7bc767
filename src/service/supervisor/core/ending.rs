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
        let done = Done {
            code,
            steps: self.schedule.committed_step(),
            samples: self.schedule.samples_committed(),
            seconds: self.now.as_secs_f64(),
            evaluation: self.last_evaluation.as_ref(),
            evaluating: self.config.eval.every_steps > 0,
        };
        if !self.is_follower() {
            tracing::info!("{}", summary(&done, &self.config.checkpoint.dir));
        }
        for (id, generation) in self.running_threads() {
            self.tell((id, generation), Order::Stop);
        }
        self.out.push(Action::Exit { code });
        self.exit = Some(code);
    }
}

/// What a run did, for its closing summary.
struct Done<'a> {
    code: i32,
    steps: u64,
    samples: u64,
    seconds: f64,
    evaluation: Option<&'a Evaluated>,
    /// Whether the run evaluates (`eval.every_steps` > 0).
    evaluating: bool,
}

/// The closing summary: what the run did, where its drafters are, and what to run next.
fn summary(d: &Done, dir: &std::path::Path) -> String {
    let dir = dir.display();
    let minutes = d.seconds / 60.0;
    let mut s = format!("run summary: {} steps, {} samples in {minutes:.1} min", d.steps, d.samples);
    if d.code == EXIT_OK {
        s.push_str(&format!("; the drafter: {dir}/final (serve it as docs/serving.md says)"));
    } else if is_stop(d.code) {
        s.push_str(&format!(
            "; stopped before the run was complete (status {}): the same command with --resume auto continues it",
            d.code
        ));
    } else {
        s.push_str(&format!("; ended with status {} (docs/operations.md says what it means)", d.code));
    }
    match (d.evaluation, d.evaluating) {
        (Some(e), _) => s.push_str(&format!(
            "; best decoded acceptance {:.2} ({dir}/best); every evaluation is in {dir}/evals.jsonl (`dflash \
             inspect-run {dir}` tabulates and plots it)",
            e.best
        )),
        (None, true) => s.push_str("; no evaluation finished"),
        (None, false) => s.push_str(&format!(
            "; nothing was evaluated (eval.every_steps = 0): `dflash eval --decode --drafter {dir} --prompts \
             PROMPTS.jsonl` measures its tokens per target step, or set eval.every_steps and eval.prompts"
        )),
    }
    s
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
    let fewer = match e.decode_acceptance_length {
        a if a < 1.005 => "no fewer forward passes".to_string(),
        a => format!("{a:.2}x fewer forward passes"),
    };
    format!(
        "decoded acceptance 1.00 -> {:.2} (step {}, best {:.2}): on {} held-out prompts the target ran {fewer} than \
         greedy decoding, with {output}",
        e.decode_acceptance_length, e.step, e.best, e.prompts
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary says where the drafter is and what to run next: for a complete run its export and evaluations,
    /// for a stopped one how to continue, and when nothing was evaluated, how to measure it.
    #[test]
    fn the_summary_says_what_to_run_next() {
        let e = Evaluated { best: 2.75, new_best: false, ..Evaluated::lossless_at(90, 2.5) };
        let dir = std::path::Path::new("runs/r");
        let d =
            Done { code: EXIT_OK, steps: 100, samples: 1600, seconds: 90.0, evaluation: Some(&e), evaluating: true };
        let line = summary(&d, dir);
        assert!(
            line.starts_with("run summary: 100 steps, 1600 samples in 1.5 min; the drafter: runs/r/final"),
            "{line}"
        );
        assert!(line.contains("best decoded acceptance 2.75 (runs/r/best)") && line.contains("runs/r/evals.jsonl"));
        let stopped = summary(&Done { code: 143, evaluation: None, evaluating: false, ..d }, dir);
        assert!(stopped.contains("--resume auto continues") && !stopped.contains("final"), "{stopped}");
        assert!(stopped.contains("nothing was evaluated (eval.every_steps = 0): `dflash eval --decode"), "{stopped}");
    }

    #[test]
    fn the_end_of_run_line_says_what_was_gained() {
        let e = Evaluated { best: 2.8, new_best: false, ..Evaluated::lossless_at(150, 2.75) };
        let line = gained(&e);
        assert!(line.starts_with("decoded acceptance 1.00 -> 2.75 (step 150, best 2.80)"), "{line}");
        assert!(line.contains("2.75x fewer forward passes") && line.ends_with("the same output"), "{line}");
        let nothing = gained(&Evaluated { decode_acceptance_length: 1.0, ..e.clone() });
        assert!(nothing.contains("ran no fewer forward passes than greedy decoding"), "{nothing}");
        let differs = gained(&Evaluated { lossless: false, token_match_rate: 0.97, ..e });
        assert!(differs.contains("a DIFFERENT output on some prompts (97.0% of tokens matching"), "{differs}");
    }
}
