//! A thread that runs until its owner drops it: dropping raises the thread's stop flag and joins it. The rendezvous
//! host's coordinator and another host's reader of its assignments are such threads.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

pub struct Background {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Background {
    /// Runs `body` on a thread named `name`; `body` watches the flag it is given and returns soon after it is set.
    pub fn spawn(name: &str, body: impl FnOnce(Arc<AtomicBool>) + Send + 'static) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new().name(name.into()).spawn(move || body(flag))?;
        Ok(Background { stop, handle: Some(handle) })
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
