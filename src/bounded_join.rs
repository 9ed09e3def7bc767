//! Joining a background writer thread (checkpoints, the data ledger) without letting a stalled disk hold the process:
//! the thread owns the sending end of a channel, so its end, however it ends, disconnects the receiving end; the
//! owner waits for that a bounded time, then joins, or leaves the thread behind.
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Waits at most `wait` for the thread behind `ended` to end, then joins it; false when it is still running: its
/// handle is then dropped (the thread is left behind, and `thread` is `None` either way).
pub fn join_within(thread: &mut Option<JoinHandle<()>>, ended: &Receiver<()>, wait: Duration) -> bool {
    if let Err(RecvTimeoutError::Timeout) = ended.recv_timeout(wait) {
        thread.take();
        return false;
    }
    if let Some(t) = thread.take() {
        let _ = t.join();
    }
    true
}
