//! The live page: `GET /` on the control plane draws the run in a browser with nothing else installed (charts by
//! uPlot, vendored into the binary: no CDN, no network), refreshed from `GET /status` and `GET /history`.
//! `/history` is what the service already keeps: the progress lines' numbers ([`Progress`], bounded however long the
//! run), the run's evaluations (`evals.jsonl` beside its checkpoints) and its recent log events
//! ([`crate::telemetry::recent`]). Reading it costs training nothing but a lock held for a copy.
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::{Value, json};

use super::evaluator::read_history;

/// The numbers of one progress line (`log.every_steps`): the window's averages since the line before.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProgressPoint {
    pub step: u64,
    pub epoch: u64,
    /// Seconds since the Unix epoch when the line was written.
    pub time: f64,
    pub loss: f64,
    pub accuracy: f64,
    /// Teacher-forced acceptance length on the training batches.
    pub acceptance: f64,
    pub samples_per_s: f64,
    /// Share of the drafters' time spent waiting for features, in percent.
    pub feature_wait_pct: f64,
    pub lr: f64,
    pub drafters_live: usize,
}

/// The progress points of the run so far, at most `capacity`: when full, every other point goes and from then on
/// only every other line is kept, so a run of any length keeps its whole curve at an even resolution. A point at a
/// step the run rewound past replaces the points after it (they were trained again).
#[derive(Debug, Clone)]
pub struct Progress {
    capacity: usize,
    /// Keep one line in this many.
    every: u64,
    /// Lines offered since the last thinning.
    offered: u64,
    points: Vec<ProgressPoint>,
}

impl Progress {
    pub fn new(capacity: usize) -> Self {
        Progress { capacity: capacity.max(2), every: 1, offered: 0, points: Vec::new() }
    }

    pub fn push(&mut self, point: ProgressPoint) {
        if self.points.last().is_some_and(|last| last.step >= point.step) {
            self.points.retain(|p| p.step < point.step);
            self.points.push(point);
            self.offered = 1;
            return;
        }
        self.offered += 1;
        if !(self.offered - 1).is_multiple_of(self.every) {
            return;
        }
        self.points.push(point);
        if self.points.len() > self.capacity {
            let kept = std::mem::take(&mut self.points).into_iter().step_by(2).collect();
            self.points = kept;
            self.every *= 2;
            self.offered = 1;
        }
    }

    pub fn points(&self) -> &[ProgressPoint] {
        &self.points
    }
}

/// Progress points a run keeps for its page.
pub const PROGRESS_POINTS: usize = 2000;

/// What the page reads besides `/status`: the shared progress points and where the run's evaluations are.
pub struct LiveView {
    pub progress: Mutex<Progress>,
    /// The run's `checkpoint.dir`, where `evals.jsonl` is.
    pub run_dir: PathBuf,
}

impl LiveView {
    pub fn new(run_dir: PathBuf) -> Arc<Self> {
        Arc::new(LiveView { progress: Mutex::new(Progress::new(PROGRESS_POINTS)), run_dir })
    }

    pub fn record(&self, point: ProgressPoint) {
        self.progress.lock().unwrap_or_else(|p| p.into_inner()).push(point);
    }

    /// `GET /history`: `{"points": [...], "evaluations": [...], "events": [...]}`.
    pub fn history(&self) -> Value {
        let points = self.progress.lock().unwrap_or_else(|p| p.into_inner()).points().to_vec();
        // No evaluation yet is an empty history, not an error.
        let evaluations = read_history(&self.run_dir).unwrap_or_default();
        json!({
            "points": points,
            "evaluations": evaluations,
            "events": crate::telemetry::recent::events(),
        })
    }
}

/// The page, and the chart library it loads (uPlot 1.6.32, MIT: assets/uplot/LICENSE).
pub const PAGE: &str = include_str!("../../assets/live.html");
pub const UPLOT_JS: &str = include_str!("../../assets/uplot/uPlot.iife.min.js");
pub const UPLOT_CSS: &str = include_str!("../../assets/uplot/uPlot.min.css");

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> ProgressPoint {
        ProgressPoint {
            step,
            epoch: 0,
            time: step as f64,
            loss: 1.0 / (step + 1) as f64,
            accuracy: 0.5,
            acceptance: 1.5,
            samples_per_s: 10.0,
            feature_wait_pct: 1.0,
            lr: 1e-3,
            drafters_live: 1,
        }
    }

    fn steps(p: &Progress) -> Vec<u64> {
        p.points().iter().map(|p| p.step).collect()
    }

    #[test]
    fn a_long_run_keeps_its_whole_curve_within_the_bound() {
        let mut p = Progress::new(4);
        for s in 1..=4 {
            p.push(at(s * 10));
        }
        assert_eq!(steps(&p), [10, 20, 30, 40]);
        p.push(at(50));
        assert_eq!(steps(&p), [10, 30, 50], "thinned to every other point");
        p.push(at(60));
        assert_eq!(steps(&p), [10, 30, 50], "from now on every other line");
        p.push(at(70));
        assert_eq!(steps(&p), [10, 30, 50, 70]);
        for s in 8..=100 {
            p.push(at(s * 10));
            assert!(p.points().len() <= 4);
        }
        let kept = steps(&p);
        assert_eq!(kept[0], 10, "the start stays: {kept:?}");
        let gaps: Vec<u64> = kept.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|&g| g == gaps[0]), "even resolution: {kept:?}");
        assert!(1000 - kept.last().unwrap() < gaps[0], "the curve reaches the last spacing: {kept:?}");
    }

    #[test]
    fn a_rewind_replaces_the_points_past_it() {
        let mut p = Progress::new(100);
        for s in 1..=5 {
            p.push(at(s * 10));
        }
        p.push(at(30));
        assert_eq!(steps(&p), [10, 20, 30]);
        p.push(at(40));
        assert_eq!(steps(&p), [10, 20, 30, 40]);
    }
}
