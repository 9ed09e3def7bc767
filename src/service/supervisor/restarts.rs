//! Restart intensity and backoff, for drafters and target copies alike: at most `max_restarts` restarts within
//! `restart_window_s`; each restart waits `backoff_initial_ms` doubled per recent restart, up to `backoff_max_ms`.
use std::collections::VecDeque;
use std::time::Duration;

use crate::config::SupervisionSettings;

/// One supervised thread's restart history.
#[derive(Debug, Default, Clone)]
pub struct Restarts {
    recent: VecDeque<Duration>,
    pub total: u64,
}

impl Restarts {
    /// After a failure at `now`: `Some(when)` to restart at, or `None` when the intensity limit is reached.
    pub fn next(&mut self, now: Duration, s: &SupervisionSettings) -> Option<Duration> {
        let window = Duration::from_secs_f64(s.restart_window_s);
        while self.recent.front().is_some_and(|t| now.saturating_sub(*t) > window) {
            self.recent.pop_front();
        }
        if self.recent.len() >= s.max_restarts {
            return None;
        }
        let delay = s.backoff_initial_ms.saturating_mul(1 << self.recent.len().min(16)).min(s.backoff_max_ms);
        self.recent.push_back(now);
        self.total += 1;
        Some(now + Duration::from_millis(delay))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn backoff_doubles_and_the_window_limits_restarts() {
        let mut s = Config::builtin().unwrap().supervision;
        s.max_restarts = 3;
        s.restart_window_s = 10.0;
        s.backoff_initial_ms = 100;
        s.backoff_max_ms = 300;
        let mut r = Restarts::default();
        let t = Duration::from_secs;
        assert_eq!(r.next(t(0), &s), Some(t(0) + Duration::from_millis(100)));
        assert_eq!(r.next(t(1), &s), Some(t(1) + Duration::from_millis(200)));
        assert_eq!(r.next(t(2), &s), Some(t(2) + Duration::from_millis(300)));
        assert_eq!(r.next(t(3), &s), None, "a fourth restart within 10 s");
        // Once the first restarts leave the window, restarts are allowed again.
        assert_eq!(r.next(t(13), &s), Some(t(13) + Duration::from_millis(100)));
        assert_eq!(r.total, 4);
    }
}
