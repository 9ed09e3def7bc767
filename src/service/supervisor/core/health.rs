//! What must never fail silently: the data ledger's writes and the checkpoint writer. A ledger write that fails
//! makes the service not ready at once and is counted; `data.ledger_max_failures` of them in a row end the run with a
//! checkpoint and status 75 (an audit trail that cannot be kept is not a run to go on with). The lines not yet
//! confirmed written go into the checkpoint (`recent_commits`), and resuming it writes them again, so the ledger
//! of a run that stopped for its disk is complete once the disk has room. A checkpoint write busy
//! for longer than `supervision.shutdown_timeout_s` (the time an ending has for one) is reported in the log, the
//! status and a metric, and makes the service not ready until it ends; every checkpoint that falls due while one is
//! in flight is counted as skipped, with a log line.
use std::collections::VecDeque;

use super::*;

#[derive(Debug, Default)]
pub(super) struct Health {
    /// Ledger lines given to the writer so far, and those not yet confirmed written, numbered, in order.
    ledger_given: u64,
    unwritten: VecDeque<(u64, LedgerEntry)>,
    /// The confirmed commit lines of the newest step a confirmed line touched: a repair that undoes that step (some
    /// of its lines not confirmed) must write them again too.
    written_step: Option<(u64, Vec<BatchId>)>,
    ledger_in_row: u32,
    /// Failures of the current row counted towards `data.ledger_max_failures`: at most one a second (a line comes
    /// every step, so counting each would end a fast run within a second of a disk filling up), and when the last
    /// was counted.
    ledger_counted: u32,
    ledger_counted_at: Option<Duration>,
    ledger_failures: u64,
    ledger_error: Option<String>,
    /// The step of the checkpoint write found busy past its deadline, until it answers.
    stalled_write: Option<u64>,
    checkpoints_skipped: u64,
}

impl Core {
    /// Hands a line to the ledger writer (rank 0 keeps the ledger), keeping it until it is confirmed written when
    /// `data.ledger` is set.
    pub(super) fn ledger(&mut self, entry: LedgerEntry) {
        if self.is_follower() {
            return;
        }
        if self.config.data.ledger.is_some() {
            self.health.ledger_given += 1;
            self.health.unwritten.push_back((self.health.ledger_given, entry.clone()));
        }
        self.out.push(Action::Ledger(entry));
    }

    /// The ledger writer's outcome of one attempt: the number of lines written so far, or why it failed.
    pub(super) fn ledger_written(&mut self, outcome: Result<u64, String>) {
        let h = &mut self.health;
        match outcome {
            Ok(written) => {
                while h.unwritten.front().is_some_and(|(n, _)| *n <= written) {
                    let Some((_, entry)) = h.unwritten.pop_front() else { break };
                    h.written_step = match (entry, h.written_step.take()) {
                        (LedgerEntry::Commit { step, batch }, Some((s, mut ids))) if s == step => {
                            ids.push(batch.id);
                            Some((s, ids))
                        }
                        (LedgerEntry::Commit { step, batch }, _) => Some((step, vec![batch.id])),
                        (LedgerEntry::Rewind { step }, kept) => kept.filter(|(s, _)| *s < step),
                    };
                }
                if h.ledger_in_row > 0 {
                    tracing::warn!(
                        failed = h.ledger_in_row,
                        "data.ledger is written again (the lines that failed too)"
                    );
                    self.out.push(Action::Notice(Notice::LedgerWrite { ok: true }));
                }
                h.ledger_in_row = 0;
                (h.ledger_counted, h.ledger_counted_at) = (0, None);
            }
            Err(e) => {
                h.ledger_in_row += 1;
                h.ledger_failures += 1;
                if h.ledger_counted_at.is_none_or(|at| self.now.saturating_sub(at) >= Duration::from_secs(1)) {
                    (h.ledger_counted, h.ledger_counted_at) = (h.ledger_counted + 1, Some(self.now));
                }
                let (in_row, counted, max) = (h.ledger_in_row, h.ledger_counted, self.config.data.ledger_max_failures);
                if in_row == 1 {
                    tracing::error!(
                        "data.ledger cannot be written: {e}. Not ready until it can; the run checkpoints and exits \
                         75 after data.ledger_max_failures = {max} failures in a row, counted at most one a second"
                    );
                }
                h.ledger_error = Some(e.clone());
                self.out.push(Action::Notice(Notice::LedgerWrite { ok: false }));
                if counted >= max {
                    let reason =
                        format!("data.ledger failed {in_row} times in a row ({counted} a second or more apart; {e})");
                    self.begin_ending(EXIT_RESTART, false, reason);
                }
            }
        }
    }

    /// The committed batches of the lines not confirmed written, by step, for the checkpoint's `recent_commits`
    /// (resuming it writes them again). It starts at the earliest step any of those lines touched (with no batches
    /// when that was a rewind), since resuming first undoes the ledger from there: that step's lines confirmed
    /// already are in it too.
    pub(super) fn unwritten_commits(&self) -> Vec<(u64, Vec<BatchId>)> {
        let step_of = |entry: &LedgerEntry| match entry {
            LedgerEntry::Commit { step, .. } | LedgerEntry::Rewind { step } => *step,
        };
        let Some(from) = self.health.unwritten.iter().map(|(_, e)| step_of(e)).min() else { return vec![] };
        let mut commits: Vec<(u64, Vec<BatchId>)> = match &self.health.written_step {
            Some((step, ids)) if *step == from => vec![(*step, ids.clone())],
            _ => Vec::new(),
        };
        for (_, entry) in &self.health.unwritten {
            match entry {
                LedgerEntry::Commit { step, batch } => match commits.last_mut() {
                    Some((s, ids)) if s == step => ids.push(batch.id),
                    _ => commits.push((*step, vec![batch.id])),
                },
                LedgerEntry::Rewind { step } => commits.retain(|(s, _)| s < step),
            }
        }
        if commits.first().is_none_or(|(s, _)| *s > from) {
            commits.insert(0, (from, vec![]));
        }
        commits
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
        let busy = match self.book.writing() {
            Some((step, since)) => {
                let seconds = self.now.saturating_sub(since).as_secs_f64();
                format!("the checkpoint of step {step} is still being written ({seconds:.0} s so far)")
            }
            None => "the checkpoint asked for before still waits for its snapshot".to_string(),
        };
        tracing::warn!(
            skipped = self.health.checkpoints_skipped,
            "{why} checkpoint at step {} skipped: {busy}",
            self.schedule.committed_step()
        );
        self.out.push(Action::Notice(Notice::CheckpointSkipped));
    }

    /// Ledger lines given to the writer and not confirmed written yet (with `data.ledger` set).
    pub(super) fn ledger_unconfirmed(&self) -> bool {
        !self.health.unwritten.is_empty()
    }

    /// No ledger write failing, no checkpoint write stalled, rounds closing.
    pub(super) fn healthy(&self) -> bool {
        self.health.ledger_in_row == 0 && self.health.stalled_write.is_none() && self.rounds_stalled_for().is_none()
    }

    /// How long no round has committed, once that is longer than the hang budget while training: on a host of
    /// several the watchdog blames no one for waiting on the others (rank 0 stopped, say), and the host is then
    /// not ready, with the reason, until a round commits.
    fn rounds_stalled_for(&self) -> Option<Duration> {
        if self.phase != Phase::Running || self.ending.is_some() || self.schedule.waiting_for_a_wave() {
            return None;
        }
        let since = self.now.saturating_sub(self.progress_at);
        (since > self.hang_budget()).then_some(since)
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
            problems.push(format!("the checkpoint of step {step} is still being written after {busy:.0} s"));
        }
        if let Some(since) = self.rounds_stalled_for() {
            let (since, budget) = (since.as_secs_f64(), self.hang_budget().as_secs_f64());
            let waiting = match self.hosts.role {
                Some(HostRole::Follower) => ": waiting for rank 0's rounds (is the rendezvous host running?)",
                Some(HostRole::Leader) => ": waiting for the other hosts' contributions",
                None => "",
            };
            problems.push(format!("no step committed for {since:.0} s (hang budget {budget:.0} s){waiting}"));
        }
        problems.extend(self.left_problem());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::loader::Batch;

    fn core(ledger: bool) -> Core {
        let mut setup = super::super::tests::setup(1);
        setup.config.data.ledger = ledger.then(|| PathBuf::from("ledger.jsonl"));
        Core::new(setup)
    }

    fn commit(c: &mut Core, step: u64, ordinal: u64) {
        let batch = Batch { id: BatchId { epoch: 0, ordinal }, samples: vec![ordinal as usize] };
        c.ledger(LedgerEntry::Commit { step, batch });
    }

    fn id(ordinal: u64) -> BatchId {
        BatchId { epoch: 0, ordinal }
    }

    /// A step whose lines are confirmed in part goes into the checkpoint whole: resuming undoes the ledger from that
    /// step, its confirmed lines with the rest (the simulator's seed 14560 lost a batch from the ledger this way).
    #[test]
    fn a_step_confirmed_in_part_goes_into_the_checkpoint_whole() {
        let mut c = core(true);
        commit(&mut c, 0, 0);
        commit(&mut c, 1, 1);
        commit(&mut c, 1, 2);
        c.ledger_written(Ok(2));
        assert_eq!(c.boundary_state().recent_commits, vec![(1, vec![id(1), id(2)])]);
        c.ledger_written(Ok(3));
        assert!(c.boundary_state().recent_commits.is_empty(), "every line written");
        commit(&mut c, 2, 3);
        c.ledger(LedgerEntry::Rewind { step: 1 });
        commit(&mut c, 1, 4);
        c.ledger_written(Ok(5));
        assert_eq!(c.boundary_state().recent_commits, vec![(1, vec![id(4)])], "the confirmed rewind undid step 1");
    }

    /// Lines the writer has not confirmed go into the checkpoint, from the earliest step they touched (a rewind's
    /// step included); confirmed ones do not; nothing is kept without a ledger.
    #[test]
    fn lines_not_confirmed_written_go_into_the_checkpoint() {
        let mut c = core(true);
        commit(&mut c, 0, 0);
        commit(&mut c, 1, 1);
        c.ledger_written(Ok(1));
        assert_eq!(c.boundary_state().recent_commits, vec![(1, vec![id(1)])], "line 1 (step 0) is written");
        commit(&mut c, 1, 2);
        c.ledger_written(Err("disk full".into()));
        commit(&mut c, 2, 3);
        assert_eq!(c.boundary_state().recent_commits, vec![(1, vec![id(1), id(2)]), (2, vec![id(3)])]);
        c.ledger(LedgerEntry::Rewind { step: 0 });
        commit(&mut c, 0, 4);
        assert_eq!(c.boundary_state().recent_commits, vec![(0, vec![id(4)])], "the rewind undid steps 1 and 2");
        c.ledger(LedgerEntry::Rewind { step: 0 });
        assert_eq!(c.boundary_state().recent_commits, vec![(0, vec![])], "resuming must undo from step 0");
        c.ledger_written(Ok(7));
        assert!(c.boundary_state().recent_commits.is_empty(), "every line written");

        let mut c = core(false);
        commit(&mut c, 0, 0);
        assert!(c.boundary_state().recent_commits.is_empty() && c.health.unwritten.is_empty());
    }
}
