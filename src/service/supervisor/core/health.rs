//! What must never fail silently: the data ledger's writes and the checkpoint writer. A ledger write that fails
//! makes the service not ready at once and is counted; `data.ledger_max_failures` of them in a row end the run with a
//! checkpoint and status 75 (an audit trail that cannot be kept is not a run to go on with). A checkpoint write busy
//! for longer than `supervision.shutdown_timeout_s` (the time an ending has for one) is reported in the log, the
//! status and a metric, and makes the service not ready until it ends; every checkpoint that falls due while one is
//! in flight is counted as skipped, with a log line.
use super::*;

#[derive(Debug, Default)]
pub(super) struct Health {
    ledger_in_row: u32,
    ledger_failures: u64,
    ledger_error: Option<String>,
    /// The step of the checkpoint write found busy past its deadline, until it answers.
    stalled_write: Option<u64>,
    checkpoints_skipped: u64,
}

impl Core {
    /// The ledger writer's outcome of one attempt.
    pub(super) fn ledger_written(&mut self, outcome: Result<(), String>) {
        let h = &mut self.health;
        match outcome {
            Ok(()) => {
                if h.ledger_in_row > 0 {
                    tracing::warn!(
                        failed = h.ledger_in_row,
                        "data.ledger is written again (the lines that failed too)"
                    );
                    self.out.push(Action::Notice(Notice::LedgerWrite { ok: true }));
                }
                h.ledger_in_row = 0;
            }
            Err(e) => {
                h.ledger_in_row += 1;
                h.ledger_failures += 1;
                let (in_row, max) = (h.ledger_in_row, self.config.data.ledger_max_failures);
                if in_row == 1 {
                    tracing::error!(
                        "data.ledger cannot be written: {e}. Not ready until it can; the run checkpoints and exits \
                         75 after data.ledger_max_failures = {max} failures in a row"
                    );
                }
                h.ledger_error = Some(e.clone());
                self.out.push(Action::Notice(Notice::LedgerWrite { ok: false }));
                if in_row >= max {
                    let reason = format!("data.ledger failed {in_row} times in a row ({e})");
                    self.begin_ending(EXIT_RESTART, false, reason);
                }
            }
        }
    }

    /// A checkpoint write busy past its deadline is reported once.
    pub(super) fn check_writer(&mut self) {
        let Some((step, since)) = self.book.writing() else { return };
        let busy = self.now.saturating_sub(since);
        let deadline = Duration::from_secs_f64(self.supervision().shutdown_timeout_s);
        if busy >= deadline && self.health.stalled_write.is_none() {
            tracing::error!(
                step,
                "the checkpoint writer has been writing the checkpoint of step {step} for {:.0} s, past \
                 supervision.shutdown_timeout_s: a stalled disk? Checkpoints falling due meanwhile are skipped, and \
                 the service is not ready until it answers",
                busy.as_secs_f64()
            );
            self.health.stalled_write = Some(step);
            self.out.push(Action::Notice(Notice::WriterStalled(true)));
        }
    }

    /// The writer answered (either way).
    pub(super) fn writer_answered(&mut self) {
        if let Some(step) = self.health.stalled_write.take() {
            tracing::warn!(step, "the stalled checkpoint writer answered");
            self.out.push(Action::Notice(Notice::WriterStalled(false)));
        }
    }

    /// A checkpoint that fell due (`why`) while another is in flight.
    pub(super) fn checkpoint_skipped(&mut self, why: &str) {
        self.health.checkpoints_skipped += 1;
        let (step, busy) = match (self.book.writing(), self.book.in_flight()) {
            (Some((step, since)), _) => {
                (step.to_string(), format!("being written for {:.0} s", (self.now - since).as_secs_f64()))
            }
            (None, _) => ("?".into(), "waiting for its snapshot".into()),
        };
        tracing::warn!(
            skipped = self.health.checkpoints_skipped,
            "{why} checkpoint at step {} skipped: the checkpoint of step {step} is still {busy}",
            self.schedule.committed_step()
        );
        self.out.push(Action::Notice(Notice::CheckpointSkipped));
    }

    /// No ledger write failing, no checkpoint write stalled.
    pub(super) fn healthy(&self) -> bool {
        self.health.ledger_in_row == 0 && self.health.stalled_write.is_none()
    }

    /// What is wrong now, in words (`/status`, `/readyz`).
    pub(super) fn problems(&self) -> Vec<String> {
        let h = &self.health;
        let mut problems = Vec::new();
        if h.ledger_in_row > 0 {
            let e = h.ledger_error.as_deref().unwrap_or("");
            problems.push(format!("data.ledger: {} writes in a row failed ({e})", h.ledger_in_row));
        }
        if let (Some(step), Some((_, since))) = (h.stalled_write, self.book.writing()) {
            let busy = self.now.saturating_sub(since).as_secs_f64();
            problems.push(format!("the checkpoint of step {step} has been being written for {busy:.0} s"));
        }
        problems
    }

    pub(super) fn ledger_status(&self) -> LedgerStatus {
        let h = &self.health;
        LedgerStatus {
            failures: h.ledger_failures,
            failing_in_row: h.ledger_in_row,
            last_error: h.ledger_error.clone(),
        }
    }

    pub(super) fn writer_status(&self) -> WriterStatus {
        WriterStatus {
            writing_step: self.book.writing().map(|(step, _)| step),
            busy_s: self.book.writing().map(|(_, since)| self.now.saturating_sub(since).as_secs_f64()),
            stalled: self.health.stalled_write.is_some(),
            skipped: self.health.checkpoints_skipped,
        }
    }
}
