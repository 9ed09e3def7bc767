//! The end of a run: one ending at a time (an error code wins over 0), its last checkpoint (the final one, at the
//! last step, for a complete run), its deadline, and the exit.
use super::*;

impl Core {
    /// The run is to end with `code` (an ending already under way keeps its own, unless this one is an error and
    /// it was not).
    pub(super) fn begin_ending(&mut self, code: i32, export: bool, reason: String) {
        if let Some(e) = &mut self.ending {
            if code != EXIT_OK && e.code == EXIT_OK {
                tracing::error!("{reason}: ending with exit status {code}");
                e.code = code;
                e.export = false;
                e.reason = reason;
            }
            return;
        }
        match code {
            EXIT_OK => tracing::info!(step = self.schedule.committed_step(), "{reason}: checkpointing, then exiting"),
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
        if done {
            return self.finish(code, export);
        }
        if self.now >= e.deadline {
            let code = if code == EXIT_OK { EXIT_RESTART } else { code };
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
            let code = if code == EXIT_OK { EXIT_ERROR } else { code };
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
            if code != EXIT_OK {
                tracing::error!("no live replica to checkpoint from: exiting with status {code}");
            }
            self.finish(code, false);
        }
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
        for (id, generation) in self.running_threads() {
            self.tell((id, generation), Order::Stop);
        }
        self.out.push(Action::Exit { code });
        self.exit = Some(code);
    }
}
