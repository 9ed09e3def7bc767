//! How far the run is and when it should end, for the progress line, `/status` and the metrics: the run's bound
//! (`optim.max_steps`, else the epochs' samples) against the rate of the last minutes of committed steps. The rate
//! is recent, not the run's average, so it follows a lost drafter or a resume on other hardware within minutes, and
//! long enough to include the pauses a run takes (checkpoints, evaluations). Pure: the core feeds it commits.
use std::collections::VecDeque;
use std::time::Duration;

/// What ends the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `optim.max_steps` steps.
    Steps(u64),
    /// The epochs' samples (`optim.max_steps = 0`).
    Samples(u64),
}

/// Where the run stands against its bound.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Estimate {
    /// The part of the run done, 0 to 1.
    pub fraction: f64,
    /// The step the run ends at: exact under `optim.max_steps`, estimated from the recent samples per step under
    /// epochs (absent before two steps are committed).
    pub total_steps: Option<u64>,
    pub total_steps_estimated: bool,
    /// Seconds left at the recent rate (absent before two steps are committed).
    pub eta_seconds: Option<f64>,
    /// A run without an end (`data.stream` without `optim.max_steps`): nothing above applies.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub open_ended: bool,
}

/// The recent commits: `(time, step, samples committed)`, the oldest first.
#[derive(Debug, Default)]
pub struct RunProgress {
    recent: VecDeque<(Duration, u64, u64)>,
}

/// How far back the rate looks.
const WINDOW: Duration = Duration::from_secs(600);
/// At most this many commits are kept (a fast run's window is then shorter).
const KEEP: usize = 4096;

impl RunProgress {
    /// Step `step` committed at `now`, with `samples` committed in the run so far. A step that goes back (a rewind
    /// to a checkpoint) starts the rate afresh.
    pub fn commit(&mut self, now: Duration, step: u64, samples: u64) {
        if self.recent.back().is_some_and(|&(_, s, _)| s >= step) {
            self.recent.clear();
        }
        self.recent.push_back((now, step, samples));
        while self.recent.len() > KEEP || (self.recent.len() > 2 && now.saturating_sub(self.recent[1].0) >= WINDOW) {
            self.recent.pop_front();
        }
    }

    /// Where the run stands at `step` with `samples` committed, against `bound`.
    pub fn estimate(&self, bound: Bound, step: u64, samples: u64) -> Estimate {
        let span = match (self.recent.front(), self.recent.back()) {
            (Some(a), Some(b)) if b.0 > a.0 && b.1 > a.1 => Some((b.0 - a.0, b.1 - a.1, b.2.saturating_sub(a.2))),
            _ => None,
        };
        let (done, total) = match bound {
            Bound::Steps(n) => (step, n),
            Bound::Samples(n) => (samples, n),
        };
        let left = total.saturating_sub(done);
        let fraction = if total == 0 { 1.0 } else { (done as f64 / total as f64).min(1.0) };
        let Some((seconds, steps, span_samples)) = span else {
            let total_steps = matches!(bound, Bound::Steps(_)).then_some(total);
            return Estimate {
                fraction,
                total_steps,
                total_steps_estimated: false,
                eta_seconds: None,
                open_ended: false,
            };
        };
        let per_second = match bound {
            Bound::Steps(_) => steps as f64,
            Bound::Samples(_) => span_samples as f64,
        } / seconds.as_secs_f64();
        let eta_seconds = Some(if left == 0 { 0.0 } else { left as f64 / per_second.max(f64::MIN_POSITIVE) });
        let (total_steps, total_steps_estimated) = match bound {
            Bound::Steps(n) => (Some(n), false),
            Bound::Samples(_) if span_samples == 0 => (None, true),
            Bound::Samples(_) => {
                let per_step = span_samples as f64 / steps as f64;
                (Some(step + (left as f64 / per_step).ceil() as u64), true)
            }
        };
        Estimate { fraction, total_steps, total_steps_estimated, eta_seconds, open_ended: false }
    }
}

impl Estimate {
    /// ` of 800 (50%) · 12m30s left` (` of ~1200` when the end is estimated), for the progress line after its step.
    pub fn describe(&self) -> String {
        if self.open_ended {
            return " (open-ended: data.stream)".into();
        }
        let total = match (self.total_steps, self.total_steps_estimated) {
            (Some(t), false) => format!(" of {t}"),
            (Some(t), true) => format!(" of ~{t}"),
            (None, _) => String::new(),
        };
        let left = self.eta_seconds.map_or(String::new(), |s| format!(" · {} left", duration_words(s)));
        format!("{total} ({:.0}%){left}", 100.0 * self.fraction)
    }
}

/// `45s`, `12m30s`, `3h05m`, `2d04h`.
fn duration_words(seconds: f64) -> String {
    let s = seconds.round().max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Under `optim.max_steps` the end is known; the time left is the steps left at the recent rate.
    #[test]
    fn max_steps_gives_the_end_and_the_rate_the_time_left() {
        let mut p = RunProgress::default();
        let first = p.estimate(Bound::Steps(800), 0, 0);
        assert_eq!((first.total_steps, first.eta_seconds, first.fraction), (Some(800), None, 0.0));
        for step in 1..=400 {
            p.commit(Duration::from_millis(500 * step), step, step * 16); // 2 steps a second
        }
        let e = p.estimate(Bound::Steps(800), 400, 6400);
        assert_eq!((e.total_steps, e.total_steps_estimated, e.fraction), (Some(800), false, 0.5));
        let eta = e.eta_seconds.unwrap();
        assert!((eta - 200.0).abs() < 2.0, "400 steps at 2 a second: {eta}");
        assert_eq!(e.describe(), " of 800 (50%) · 3m20s left");
    }

    /// Under epochs the end is the samples left at the recent samples per step, and says it is estimated.
    #[test]
    fn epochs_estimate_the_last_step_from_the_samples_per_step() {
        let mut p = RunProgress::default();
        for step in 1..=100 {
            p.commit(secs(step), step, step * 32); // 32 samples a step, a step a second
        }
        let e = p.estimate(Bound::Samples(6400), 100, 3200);
        assert_eq!((e.total_steps, e.total_steps_estimated), (Some(200), true));
        assert!((e.eta_seconds.unwrap() - 100.0).abs() < 1.0, "{e:?}");
        assert_eq!(e.describe(), " of ~200 (50%) · 1m40s left");
    }

    /// The rate is the last ten minutes': a run that slowed down (a drafter lost) says so within them.
    #[test]
    fn the_rate_follows_the_recent_steps() {
        let mut p = RunProgress::default();
        for step in 1..=1000 {
            p.commit(secs(step), step, 0); // a step a second for 1000 s
        }
        for step in 1001..=1400 {
            p.commit(secs(1000 + 4 * (step - 1000)), step, 0); // then a step every 4 s for 1600 s
        }
        let eta = p.estimate(Bound::Steps(2400), 1400, 0).eta_seconds.unwrap();
        assert!((eta - 4000.0).abs() < 20.0, "1000 steps at the recent 4 s each: {eta}");
    }

    /// A rewind to a checkpoint starts the rate afresh; a finished run has nothing left.
    #[test]
    fn a_rewind_restarts_the_rate_and_the_end_is_zero_left() {
        let mut p = RunProgress::default();
        for step in 1..=10 {
            p.commit(secs(step), step, 0);
        }
        p.commit(secs(20), 5, 0);
        assert_eq!(p.estimate(Bound::Steps(10), 5, 0).eta_seconds, None, "one commit since the rewind");
        for step in 6..=10 {
            p.commit(secs(15 + step), step, 0);
        }
        let e = p.estimate(Bound::Steps(10), 10, 0);
        assert_eq!((e.fraction, e.eta_seconds), (1.0, Some(0.0)));
        assert_eq!(duration_words(3.0 * 3600.0 + 300.0), "3h05m");
        assert_eq!(duration_words(2.0 * 86400.0 + 4.0 * 3600.0), "2d04h");
    }
}
