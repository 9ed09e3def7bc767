//! The data ledger's writer: one JSON line per committed batch (and per rewind), appended and flushed on a thread
//! of its own, so a slow or stalled disk never holds up the supervisor (whose watchdog must keep running). Lines
//! are written in the order they are given; dropping the writer waits a bounded time for the last ones.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

pub struct LedgerWriter {
    lines: Option<Sender<String>>,
    ended: Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl LedgerWriter {
    /// How long dropping the writer waits for lines still queued.
    const DROP_WAIT: Duration = Duration::from_secs(10);

    /// Opens `path` for appending (created if missing).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let (lines, queued) = mpsc::channel::<String>();
        let (done, ended) = mpsc::channel::<()>();
        let path: PathBuf = path.to_path_buf();
        let thread = std::thread::Builder::new().name("ledger".into()).spawn(move || {
            let _done = done;
            let mut w = std::io::BufWriter::new(file);
            for line in queued {
                if let Err(e) = writeln!(w, "{line}").and_then(|()| w.flush()) {
                    tracing::error!(path = %path.display(), "data.ledger: {e}");
                }
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
}

impl Drop for LedgerWriter {
    fn drop(&mut self) {
        self.lines.take();
        if !crate::bounded_join::join_within(&mut self.thread, &self.ended, Self::DROP_WAIT) {
            tracing::warn!("the data ledger's disk is not keeping up: its last lines are left behind");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_appended_in_order_and_all_written_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        std::fs::write(&path, "{\"before\": true}\n").unwrap();
        let writer = LedgerWriter::open(&path).unwrap();
        for i in 0..500 {
            writer.append(format!("{{\"step\": {i}}}"));
        }
        drop(writer);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 501, "appended after what was there");
        assert_eq!(lines[0], "{\"before\": true}");
        assert!(lines[1..].iter().enumerate().all(|(i, l)| *l == format!("{{\"step\": {i}}}")));
    }

    #[test]
    fn an_unwritable_path_is_an_error_at_open() {
        let dir = tempfile::tempdir().unwrap();
        assert!(LedgerWriter::open(&dir.path().join("missing").join("ledger.jsonl")).is_err());
    }
}
