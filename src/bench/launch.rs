//! `dflash bench --what launch`: how the kernel-launch rate of one process holds up as compute threads are added.
//!
//! `serve-train` runs every drafter as an OS thread of one process, each launching thousands of small kernels per
//! step. If libtorch's dispatcher or the CUDA driver serialised launches across threads, adding drafters would cap
//! the whole service at one thread's launch rate and a process per GPU would be needed. This measures it: each
//! thread binds the device, then launches `launches` in-place additions on a small tensor (one kernel each, too
//! small for the GPU to be the bottleneck) as fast as it can; the report is launches per second over all threads.
//! With `own_streams` each thread launches on a stream of its own, as drafters on different GPUs do, which tells
//! contention on the one shared stream apart from contention in the dispatcher.
use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::BenchError;
use crate::device::{self, device_name};
use crate::panic::catch_torch;

#[derive(Debug, Clone)]
pub struct LaunchBenchOptions {
    /// Thread counts to measure, one run each.
    pub threads: Vec<usize>,
    /// Kernel launches per thread per run.
    pub launches: usize,
    /// Each thread launches on a stream of its own instead of the device's default stream.
    pub own_streams: bool,
}

#[derive(Debug, Serialize)]
pub struct LaunchRun {
    pub threads: usize,
    pub launches_per_s: f64,
    pub per_thread_launches_per_s: f64,
    /// `launches_per_s` over the single-thread rate of the same report (1.0 for the first run when it is 1 thread).
    pub scaling: f64,
    pub wall_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct LaunchBenchReport {
    pub what: &'static str,
    pub device: String,
    pub launches_per_thread: usize,
    pub own_streams: bool,
    pub runs: Vec<LaunchRun>,
}

/// Measures the aggregate launch rate with each thread count in `opts.threads`.
pub fn bench_launch(device: Device, opts: &LaunchBenchOptions) -> Result<LaunchBenchReport, BenchError> {
    if opts.threads.is_empty() || opts.threads.contains(&0) || opts.launches == 0 {
        return Err(BenchError::Settings(format!(
            "thread counts ({:?}) and launches ({}) must be at least 1",
            opts.threads, opts.launches
        )));
    }
    // One untimed run warms the context, the allocator and the kernels.
    launch_run(device, 1, opts.launches, opts.own_streams)?;
    let mut runs: Vec<LaunchRun> = Vec::new();
    let mut single = None;
    for &threads in &opts.threads {
        let (wall_s, done) = launch_run(device, threads, opts.launches, opts.own_streams)?;
        if done != threads * opts.launches {
            return Err(BenchError::Settings(format!(
                "{threads} threads ran {done} of {} launches",
                threads * opts.launches
            )));
        }
        let launches_per_s = done as f64 / wall_s;
        if threads == 1 {
            single.get_or_insert(launches_per_s);
        }
        runs.push(LaunchRun {
            threads,
            launches_per_s,
            per_thread_launches_per_s: launches_per_s / threads as f64,
            scaling: 0.0,
            wall_ms: wall_s * 1e3,
        });
    }
    let base = single.unwrap_or(runs[0].launches_per_s / runs[0].threads as f64);
    for run in &mut runs {
        run.scaling = run.launches_per_s / base;
    }
    Ok(LaunchBenchReport {
        what: "launch",
        device: device_name(device),
        launches_per_thread: opts.launches,
        own_streams: opts.own_streams,
        runs,
    })
}

/// Wall seconds from the first thread's start to the last thread's end, each thread launching `launches` kernels
/// and then reading its result back (which waits for its kernels), and the number of launches that ran.
fn launch_run(device: Device, threads: usize, launches: usize, own_stream: bool) -> Result<(f64, usize), BenchError> {
    let barrier = std::sync::Barrier::new(threads);
    let torch = |p: crate::panic::Panicked| BenchError::Settings(p.to_string());
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let prepared = catch_torch(|| -> Result<Tensor, BenchError> {
                        device::bind_thread(device)?;
                        if own_stream {
                            device::use_own_stream(device, device::Priority::Normal)?;
                        }
                        Ok(Tensor::f_zeros([256], (Kind::Float, device))?)
                    });
                    barrier.wait();
                    let start = Instant::now();
                    let mut x = prepared.map_err(torch)??;
                    let done = catch_torch(|| -> Result<usize, BenchError> {
                        for _ in 0..launches {
                            let _ = x.f_add_scalar_(1.0)?;
                        }
                        // Each addition added one to every element: the count proves the launches ran.
                        Ok(x.f_double_value(&[0])? as usize)
                    })
                    .map_err(torch)??;
                    Ok::<_, BenchError>((start, Instant::now(), done))
                })
            })
            .collect();
        let mut span: Option<(Instant, Instant)> = None;
        let mut done = 0;
        for worker in workers {
            let (start, end, n) =
                worker.join().map_err(|_| BenchError::Settings("a launch thread panicked".into()))??;
            span = Some(span.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
            done += n;
        }
        let (start, end) = span.expect("at least one thread ran");
        Ok(((end - start).as_secs_f64(), done))
    })
}

impl LaunchBenchReport {
    pub fn summary(&self) -> String {
        let runs: Vec<String> = self
            .runs
            .iter()
            .map(|r| {
                format!(
                    "{} thread(s): {:.0} launches/s ({:.0}/thread, x{:.2})",
                    r.threads, r.launches_per_s, r.per_thread_launches_per_s, r.scaling
                )
            })
            .collect();
        let streams = if self.own_streams { "a stream per thread" } else { "the default stream" };
        format!("kernel launches on {} ({streams}): {}", self.device, runs.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_does_its_launches() {
        let opts = LaunchBenchOptions { threads: vec![1, 3], launches: 50, own_streams: false };
        let r = bench_launch(Device::Cpu, &opts).unwrap();
        assert_eq!(r.runs.len(), 2);
        assert!(r.runs.iter().all(|run| run.launches_per_s > 0.0 && run.wall_ms > 0.0));
        assert!((r.runs[0].scaling - 1.0).abs() < 1e-12);
        assert!(
            bench_launch(Device::Cpu, &LaunchBenchOptions { threads: vec![0], launches: 1, own_streams: false })
                .is_err()
        );
    }
}
