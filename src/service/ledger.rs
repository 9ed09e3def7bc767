//! The data ledger's writer: one JSON line per committed batch (and per rewind), appended on a thread of its own, so
//! a slow or stalled disk never holds up the supervisor (whose watchdog must keep running). Lines are written in the
//! order they are given. A write that fails is never silent: the file is cut back to its last whole line, the line
//! is kept and written again before the next one (and every second while no new line comes), and every attempt's
//! outcome goes to `on_write`, which the supervisor turns into readiness, a metric and, after
//! `data.ledger_max_failures` in a row, the run's end.
use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

/// Opens `path` for appending (created if missing): at start, so that a ledger that cannot be opened stops the run
/// before it trains.
pub fn open_ledger(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new().create(true).append(true).open(path)
}

pub struct LedgerWriter {
    lines: Option<Sender<String>>,
    ended: Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl LedgerWriter {
    /// How long [`LedgerWriter::finish`] waits by default (dropping the writer) for lines still queued.
    pub const DROP_WAIT: Duration = Duration::from_secs(10);
    /// The least [`LedgerWriter::finish`] waits, whatever time is left.
    const LEAST_WAIT: Duration = Duration::from_secs(1);
    /// How often lines that failed are tried again while no new line comes.
    const RETRY: Duration = Duration::from_secs(1);

    /// Starts the writer on `file` (opened by [`open_ledger`]); `on_write` gets each attempt's outcome: the number
    /// of lines written so far (every line given until then), or why the attempt failed.
    pub fn start(
        file: File,
        path: &Path,
        on_write: impl Fn(Result<u64, String>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (lines, queued) = mpsc::channel::<String>();
        let (done, ended) = mpsc::channel::<()>();
        let path: PathBuf = path.to_path_buf();
        let thread = std::thread::Builder::new().name("ledger".into()).spawn(move || {
            let _done = done;
            let mut ledger = Appender { file, path: path.clone(), pending: VecDeque::new(), written: 0 };
            loop {
                match queued.recv_timeout(Self::RETRY) {
                    Ok(line) => ledger.pending.push_back(line),
                    Err(RecvTimeoutError::Timeout) if ledger.pending.is_empty() => continue,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                let outcome =
                    ledger.write_pending().map(|()| ledger.written).map_err(|e| format!("{}: {e}", path.display()));
                on_write(outcome);
            }
            if !ledger.pending.is_empty() {
                tracing::error!(
                    path = %path.display(),
                    lines = ledger.pending.len(),
                    "data.ledger: the last lines could not be written"
                );
            }
        })?;
        Ok(LedgerWriter { lines: Some(lines), ended, thread: Some(thread) })
    }

    /// Queues one line (without its newline).
    pub fn append(&self, line: String) {
        if let Some(lines) = &self.lines {
            let _ = lines.send(line);
        }
    }

    /// Stops taking lines and waits at most `wait` (a second at least: a writer with every line written ends at
    /// once, and no time left must not call it behind) for those queued; false when the writer is left behind.
    pub fn finish(&mut self, wait: Duration) -> bool {
        self.lines.take();
        let wait = wait.max(Self::LEAST_WAIT);
        let done = crate::bounded_join::join_within(&mut self.thread, &self.ended, wait);
        if !done {
            tracing::warn!(
                "data.ledger: its last lines were not written within the {:.1} s left to exit (a slow or stalled \
                 disk): they are left behind",
                wait.as_secs_f64()
            );
        }
        done
    }
}

impl Drop for LedgerWriter {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.finish(Self::DROP_WAIT);
        }
    }
}

/// The file, the lines not written yet (oldest first), and how many were written.
struct Appender {
    file: File,
    path: PathBuf,
    pending: VecDeque<String>,
    written: u64,
}

impl Appender {
    /// Writes the pending lines in order; on a failure the file is cut back to its length before the line that
    /// failed (a partial line would corrupt the ledger) and that line stays pending.
    fn write_pending(&mut self) -> std::io::Result<()> {
        // Lines written into a file no longer at the path would be read by no one: a deleted or replaced ledger
        // fails every write (and so ends the run) rather than taking lines silently.
        if !self.pending.is_empty()
            && !self.path.as_os_str().is_empty()
            && !super::folder_lock::still_at(&self.file, &self.path)
        {
            return Err(std::io::Error::other(
                "the file was deleted or replaced under the run, so its lines so far are in no file at this path \
                 now: put it back (or move the new one aside) and restart with --resume auto",
            ));
        }
        while let Some(line) = self.pending.front() {
            let before = self.file.metadata().map(|m| m.len()).ok();
            let written = self.file.write_all(format!("{line}\n").as_bytes()).and_then(|()| self.file.flush());
            if let Err(e) = written {
                if let Some(len) = before {
                    // Best effort: a device (/dev/full) has no length to cut back to.
                    let _ = self.file.set_len(len);
                }
                return Err(e);
            }
            self.pending.pop_front();
            self.written += 1;
        }
        Ok(())
    }
}

/// Whether the ledger `text` holds every batch of `commits` (`(step, batches)`, a checkpoint's `recent_commits`) at
/// its step, the rewinds in it applied (a `rewind_to_step` N undoes the lines of step N and later): a run whose last
/// lines were all written after its checkpoint needs no resume to write them again.
pub fn holds(text: &str, commits: &[(u64, Vec<crate::data::loader::BatchId>)]) -> bool {
    let mut lines: std::collections::HashSet<(u64, u64, u64)> = std::collections::HashSet::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let number = |key: &str| v.get(key).and_then(serde_json::Value::as_u64);
        if let Some(to) = number("rewind_to_step") {
            lines.retain(|(step, _, _)| *step < to);
        } else if let (Some(step), Some(epoch), Some(batch)) = (number("step"), number("epoch"), number("batch")) {
            lines.insert((step, epoch, batch));
        }
    }
    commits.iter().all(|(step, ids)| ids.iter().all(|id| lines.contains(&(*step, id.epoch, id.ordinal))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    type Outcomes = Arc<Mutex<Vec<Result<u64, String>>>>;

    fn writer(path: &Path) -> (LedgerWriter, Outcomes) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let file = open_ledger(path).unwrap();
        let w = LedgerWriter::start(file, path, move |outcome| sink.lock().unwrap().push(outcome)).unwrap();
        (w, seen)
    }

    #[test]
    fn lines_are_appended_in_order_and_all_written_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        std::fs::write(&path, "{\"before\": true}\n").unwrap();
        let (writer, seen) = writer(&path);
        for i in 0..500 {
            writer.append(format!("{{\"step\": {i}}}"));
        }
        drop(writer);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 501, "appended after what was there");
        assert_eq!(lines[0], "{\"before\": true}");
        assert!(lines[1..].iter().enumerate().all(|(i, l)| *l == format!("{{\"step\": {i}}}")));
        let seen = seen.lock().unwrap();
        assert!(seen.iter().enumerate().all(|(i, o)| *o == Ok(i as u64 + 1)), "each line confirmed by its number");
    }

    /// A writer whose lines are all written finishes even with no time left (a checkpoint writer that stalled
    /// used up the exit's deadline): it is not called behind.
    #[test]
    fn a_complete_ledger_finishes_with_no_time_left() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, seen) = writer(&dir.path().join("ledger.jsonl"));
        writer.append("{\"step\": 0}".into());
        while seen.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(writer.finish(Duration::ZERO), "written, so finished");
    }

    /// A ledger deleted under the run fails every write, naming what happened, instead of writing into a file no
    /// one can read.
    #[test]
    fn a_deleted_ledger_fails_its_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let (mut writer, seen) = writer(&path);
        writer.append("{\"step\": 0}".into());
        while seen.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_file(&path).unwrap();
        writer.append("{\"step\": 1}".into());
        while seen.lock().unwrap().len() < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let second = seen.lock().unwrap()[1].clone();
        assert!(second.as_ref().is_err_and(|e| e.contains("deleted or replaced")), "{second:?}");
        writer.finish(Duration::from_secs(1));
        assert!(!path.exists(), "nothing written anywhere a reader would look");
    }

    /// A ledger holds a checkpoint's recent commits when each is a line at its step that no later rewind undid.
    #[test]
    fn a_ledger_holds_the_commits_it_has_lines_for_after_its_rewinds() {
        use crate::data::loader::BatchId;
        let id = |epoch, ordinal| BatchId { epoch, ordinal };
        let text = "{\"step\":4,\"epoch\":0,\"batch\":7,\"ids\":[1]}\n{\"rewind_to_step\":5}\n\
                    {\"step\":5,\"epoch\":1,\"batch\":0,\"ids\":[2]}\n{\"rewind_to_step\":6}\n";
        assert!(holds(text, &[]));
        assert!(holds(text, &[(4, vec![id(0, 7)]), (5, vec![id(1, 0)])]));
        assert!(!holds(text, &[(5, vec![id(1, 0), id(1, 1)])]), "a batch of step 5 missing");
        let undone = format!("{text}{{\"rewind_to_step\":5}}\n");
        assert!(!holds(&undone, &[(5, vec![id(1, 0)])]), "undone by a later rewind");
        assert!(holds(&undone, &[(4, vec![id(0, 7)])]));
    }

    /// A full disk (`/dev/full` answers every write with ENOSPC) is reported for every line, not logged and lost.
    #[test]
    fn every_failed_write_is_reported() {
        let path = Path::new("/dev/full");
        if !path.exists() {
            return;
        }
        let (mut writer, seen) = writer(path);
        for i in 0..3 {
            writer.append(format!("{{\"step\": {i}}}"));
        }
        assert!(writer.finish(Duration::from_secs(10)));
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|o| o.as_ref().is_err_and(|e| e.contains("/dev/full"))), "{seen:?}");
    }

    /// A line that failed is written again, before the next one, and nothing is duplicated.
    #[test]
    fn a_failed_line_is_written_again_in_order() {
        if !Path::new("/dev/full").exists() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let pending = VecDeque::from(["{\"step\": 0}".to_string()]);
        let mut a = Appender { file: open_ledger(&path).unwrap(), path: path.clone(), pending, written: 0 };
        a.write_pending().unwrap();
        let good = std::mem::replace(&mut a.file, open_ledger(Path::new("/dev/full")).unwrap());
        a.path = PathBuf::from("/dev/full");
        a.pending.extend(["{\"step\": 1}".to_string(), "{\"step\": 2}".to_string()]);
        assert!(a.write_pending().is_err());
        assert_eq!(a.pending.len(), 2, "nothing was taken as written");
        (a.file, a.path) = (good, path.clone());
        a.write_pending().unwrap();
        assert_eq!(a.written, 3);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"step\": 0}\n{\"step\": 1}\n{\"step\": 2}\n");
    }

    #[test]
    fn an_unwritable_path_is_an_error_at_open() {
        let dir = tempfile::tempdir().unwrap();
        assert!(open_ledger(&dir.path().join("missing").join("ledger.jsonl")).is_err());
    }
}
