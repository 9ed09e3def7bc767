//! Telemetry: every metric the service exports is named, described and bucketed here, in one place, and rendered
//! in Prometheus text format on the control plane's `GET /metrics`.
//!
//! Names follow Prometheus conventions: the `dflash_` prefix, base units (`_seconds`, `_bytes`, `_ratio`), `_total`
//! on counters, `_info` on the build's constant series. Per-drafter series carry a `drafter` label (its index in
//! `drafters.devices`); series that belong to one GPU also carry `device` (`cuda:N`), `gpu` and `UUID`, which are
//! the labels NVIDIA's DCGM exporter uses (see [`gpu`]), so `on(UUID)` joins survive `CUDA_VISIBLE_DEVICES`.
//! Every series is created with its first value when the service starts, so dashboards show zeros, not gaps.
pub mod gpu;
pub mod logging;
pub mod recent;
pub mod tensorboard;

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{
    Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub use gpu::GpuIdentity;

pub const BUILD_INFO: &str = "dflash_build_info";
pub const STEP: &str = "dflash_step";
pub const COMMITTED_STEPS: &str = "dflash_committed_steps_total";
pub const COMMITTED_SAMPLES: &str = "dflash_committed_samples_total";
pub const COMMITTED_TOKENS: &str = "dflash_committed_tokens_total";
pub const SKIPPED_STEPS: &str = "dflash_skipped_steps_total";
pub const LAST_STEP_TIMESTAMP: &str = "dflash_last_step_timestamp_seconds";
pub const RUN_PROGRESS: &str = "dflash_run_progress_ratio";
pub const RUN_TOTAL_STEPS: &str = "dflash_run_total_steps";
pub const RUN_TIME_LEFT: &str = "dflash_run_time_left_seconds";
pub const LOSS: &str = "dflash_loss";
pub const ACCURACY: &str = "dflash_accuracy";
pub const TRAIN_ACCEPTANCE_LENGTH: &str = "dflash_train_acceptance_length";
pub const HOLDOUT_ACCEPTANCE_LENGTH: &str = "dflash_holdout_acceptance_length";
pub const DECODE_ACCEPTANCE_LENGTH: &str = "dflash_decode_acceptance_length";
pub const DECODE_ACCEPTANCE_LENGTH_BEST: &str = "dflash_decode_acceptance_length_best";
pub const DECODE_TOKEN_MATCH: &str = "dflash_decode_token_match_ratio";
pub const EVAL_DURATION: &str = "dflash_eval_duration_seconds";
pub const EVAL_LAST_STEP: &str = "dflash_eval_last_step";
pub const EVALS: &str = "dflash_evals_total";
pub const LEARNING_RATE: &str = "dflash_learning_rate";
pub const GRAD_NORM: &str = "dflash_grad_norm";
pub const STEP_DURATION: &str = "dflash_step_duration_seconds";
pub const COLLECTIVE_DURATION: &str = "dflash_collective_duration_seconds";
pub const TARGET_CAPTURE_DURATION: &str = "dflash_target_capture_duration_seconds";
pub const MFU: &str = "dflash_mfu_ratio";
pub const FEATURE_QUEUE_DEPTH: &str = "dflash_feature_queue_depth";
pub const FEATURE_WAIT: &str = "dflash_feature_wait_ratio";
pub const MEMORY_ALLOCATED: &str = "dflash_device_memory_allocated_bytes";
pub const MEMORY_RESERVED: &str = "dflash_device_memory_reserved_bytes";
pub const DRAFTER_INFO: &str = "dflash_drafter_info";
pub const DRAFTER_STATE: &str = "dflash_drafter_state";
pub const DRAFTERS_LIVE: &str = "dflash_drafters_live";
pub const DRAFTER_RESTARTS: &str = "dflash_drafter_restarts_total";
pub const SAMPLES_REQUEUED: &str = "dflash_samples_requeued_total";
pub const REPLICA_DIVERGENCES: &str = "dflash_replica_divergences_total";
pub const CHECKPOINT_DURATION: &str = "dflash_checkpoint_duration_seconds";
pub const CHECKPOINT_LAST_SUCCESS: &str = "dflash_checkpoint_last_success_timestamp_seconds";
pub const CHECKPOINT_LAST_STEP: &str = "dflash_checkpoint_last_step";
pub const CHECKPOINTS: &str = "dflash_checkpoints_total";
pub const CHECKPOINTS_SKIPPED: &str = "dflash_checkpoints_skipped_total";
pub const CHECKPOINT_WRITER_STALLED: &str = "dflash_checkpoint_writer_stalled";
pub const LEDGER_WRITE_FAILURES: &str = "dflash_ledger_write_failures_total";
pub const LEDGER_FAILING: &str = "dflash_ledger_failing";
pub const CONFIG_RELOAD_SUCCESSFUL: &str = "dflash_config_last_reload_successful";
pub const CONFIG_RELOAD_SUCCESS_TIMESTAMP: &str = "dflash_config_last_reload_success_timestamp_seconds";
pub const CONFIG_RELOADS: &str = "dflash_config_reloads_total";
pub const CONFIG_VERSION: &str = "dflash_config_version";
pub const PUBLICATIONS: &str = "dflash_publications_total";
pub const STREAM_CONVERSATIONS: &str = "dflash_stream_conversations_total";
pub const STREAM_WAVES: &str = "dflash_stream_waves";
pub const STREAM_PENDING: &str = "dflash_stream_pending_conversations";
pub const STREAM_WAVE_DUE: &str = "dflash_stream_wave_due_seconds";
pub const PUBLISHED_VERSION: &str = "dflash_published_version";
pub const PUBLISHED_ACCEPTANCE_LENGTH: &str = "dflash_published_acceptance_length";

/// The states a drafter's `dflash_drafter_state` series cover (1 for the current one, 0 for the others).
pub const DRAFTER_STATES: [&str; 5] = ["starting", "joining", "live", "restarting", "failed"];

/// Buckets (upper bounds, seconds) of each histogram, chosen for the durations it sees: a step takes 10 ms (tiny,
/// CPU) to tens of seconds (long sequences); a collective round is sub-millisecond alone and as long as the slowest
/// peer's step when waiting; a checkpoint of an 8B drafter writes gigabytes; an evaluation decodes for minutes.
const BUCKETS: [(&str, &[f64]); 5] = [
    (STEP_DURATION, &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0]),
    (COLLECTIVE_DURATION, &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
    (TARGET_CAPTURE_DURATION, &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
    (CHECKPOINT_DURATION, &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]),
    (EVAL_DURATION, &[0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]),
];

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metrics: {0}")]
    Build(#[from] metrics_exporter_prometheus::BuildError),
    #[error("metrics: another recorder is installed in this process")]
    RecorderTaken,
}

/// Installs the process's Prometheus recorder (once) and describes every metric; returns the handle that renders
/// them.
pub fn install() -> Result<PrometheusHandle, TelemetryError> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in BUCKETS {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)?;
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| TelemetryError::RecorderTaken)?;
    describe();
    Ok(HANDLE.get_or_init(|| handle).clone())
}

fn describe() {
    describe_gauge!(BUILD_INFO, "Constant 1, labelled with the dflash version and whether CUDA is available.");
    describe_gauge!(STEP, Unit::Count, "Training steps committed in this run (rewinds to a checkpoint go back).");
    describe_counter!(COMMITTED_STEPS, Unit::Count, "Training steps committed.");
    describe_counter!(COMMITTED_SAMPLES, Unit::Count, "Samples trained on in committed steps.");
    describe_counter!(COMMITTED_TOKENS, Unit::Count, "Tokens (sequence positions) of the committed samples.");
    describe_counter!(
        SKIPPED_STEPS,
        Unit::Count,
        "Steps whose update was skipped on every replica (a non-finite gradient norm, or a sum across hosts that did not complete)."
    );
    describe_gauge!(LAST_STEP_TIMESTAMP, Unit::Seconds, "Unix time of the last committed step.");
    describe_gauge!(
        RUN_PROGRESS,
        "Part of the run done, 0 to 1 (steps of optim.max_steps, else samples of the epochs)."
    );
    describe_gauge!(
        RUN_TOTAL_STEPS,
        Unit::Count,
        "The step the run ends at: optim.max_steps, else estimated from the recent samples per step."
    );
    describe_gauge!(RUN_TIME_LEFT, Unit::Seconds, "Seconds until the run ends, at the last ten minutes' rate.");
    describe_gauge!(LOSS, "Weighted cross-entropy of the last committed step (DFLASH.md's objective).");
    describe_gauge!(ACCURACY, "Top-1 accuracy of the drafted tokens of the last committed step.");
    describe_gauge!(
        TRAIN_ACCEPTANCE_LENGTH,
        "Teacher-forced acceptance length on the training batches of the last committed step (each block drafted \
         from the target's states of the true prefix): the optimistic number, usually above the held-out and decoded ones."
    );
    describe_gauge!(
        HOLDOUT_ACCEPTANCE_LENGTH,
        "Teacher-forced acceptance length on held-out rows at the last evaluation: below the training batches' when \
         the drafter overfits."
    );
    describe_gauge!(
        DECODE_ACCEPTANCE_LENGTH,
        "Acceptance length measured by real speculative decoding of held-out prompts, at the last evaluation."
    );
    describe_gauge!(
        DECODE_ACCEPTANCE_LENGTH_BEST,
        "The best decoded acceptance length so far (the `best` checkpoint)."
    );
    describe_gauge!(
        DECODE_TOKEN_MATCH,
        "Share of greedy tokens that speculative decoding reproduced, at the last evaluation (1: lossless)."
    );
    describe_histogram!(EVAL_DURATION, Unit::Seconds, "Wall time of one decoding evaluation (off the training path).");
    describe_gauge!(EVAL_LAST_STEP, Unit::Count, "Step of the checkpoint the last evaluation decoded with.");
    describe_counter!(EVALS, Unit::Count, "Decoding evaluations, by result (success, failure).");
    describe_gauge!(LEARNING_RATE, "Learning rate of the drafter's last update.");
    describe_gauge!(GRAD_NORM, "Global norm of the averaged gradient at the drafter's last update, before clipping.");
    describe_histogram!(STEP_DURATION, Unit::Seconds, "A drafter's step: forward, backward, collective and update.");
    describe_histogram!(
        COLLECTIVE_DURATION,
        Unit::Seconds,
        "Time a drafter spent in the step's gradient round, waiting for peers included (with NCCL also its own \
         GPU's queued step work, which the all-reduce waits behind)."
    );
    describe_histogram!(TARGET_CAPTURE_DURATION, Unit::Seconds, "The target's capture of one micro-batch's features.");
    describe_gauge!(
        MFU,
        "Model FLOPs utilisation of the drafter's last step against drafters.peak_tflops (DFLASH.md's cost model)."
    );
    describe_gauge!(FEATURE_QUEUE_DEPTH, Unit::Count, "Micro-batches of features waiting for the drafter.");
    describe_gauge!(
        FEATURE_WAIT,
        "Share of the drafter's last step spent waiting for features (the target not keeping up)."
    );
    describe_gauge!(MEMORY_ALLOCATED, Unit::Bytes, "Device memory held by tensors (libtorch's caching allocator).");
    describe_gauge!(MEMORY_RESERVED, Unit::Bytes, "Device memory reserved by libtorch's caching allocator.");
    describe_gauge!(DRAFTER_INFO, "Constant 1 per drafter, labelled with its device, GPU index and UUID (for joins).");
    describe_gauge!(DRAFTER_STATE, "1 for the drafter's current state, 0 for the others.");
    describe_gauge!(DRAFTERS_LIVE, Unit::Count, "Drafters contributing to steps.");
    describe_counter!(DRAFTER_RESTARTS, Unit::Count, "Restarts of the drafter after a failure.");
    describe_counter!(SAMPLES_REQUEUED, Unit::Count, "Samples of failed drafters returned to the loader.");
    describe_counter!(REPLICA_DIVERGENCES, Unit::Count, "Checks that found the replicas' states different.");
    describe_histogram!(CHECKPOINT_DURATION, Unit::Seconds, "Writing one checkpoint (off the training path).");
    describe_gauge!(CHECKPOINT_LAST_SUCCESS, Unit::Seconds, "Unix time of the last checkpoint written.");
    describe_gauge!(CHECKPOINT_LAST_STEP, Unit::Count, "Step of the last checkpoint written.");
    describe_counter!(CHECKPOINTS, Unit::Count, "Checkpoints, by result (success, failure).");
    describe_counter!(
        CHECKPOINTS_SKIPPED,
        Unit::Count,
        "Checkpoints that fell due (checkpoint.every_steps or every_seconds) while another was still in flight."
    );
    describe_gauge!(
        CHECKPOINT_WRITER_STALLED,
        "1 while the checkpoint writer has been writing one checkpoint for longer than supervision.shutdown_timeout_s, else 0."
    );
    describe_counter!(LEDGER_WRITE_FAILURES, Unit::Count, "Writes to data.ledger that failed (each is tried again).");
    describe_gauge!(LEDGER_FAILING, "1 while the last write to data.ledger failed, else 0.");
    describe_gauge!(CONFIG_RELOAD_SUCCESSFUL, "1 if the last configuration reload succeeded, else 0.");
    describe_gauge!(CONFIG_RELOAD_SUCCESS_TIMESTAMP, Unit::Seconds, "Unix time of the last successful reload.");
    describe_counter!(CONFIG_RELOADS, Unit::Count, "Configuration reloads, by result (success, failure).");
    describe_gauge!(CONFIG_VERSION, Unit::Count, "Version of the configuration in effect (1 at start, +1 per change).");
    describe_counter!(PUBLICATIONS, Unit::Count, "Drafters published to publish.dir by this process.");
    describe_counter!(
        STREAM_CONVERSATIONS,
        Unit::Count,
        "data.stream: recorded conversations by outcome as waves took them: taken (trained once, in its wave's \
         epoch), sampled (an answer asked for with sampling, left out under stream_answers = greedy), unreadable."
    );
    describe_gauge!(STREAM_WAVES, Unit::Count, "data.stream: waves taken so far (the run's, resumes included).");
    describe_gauge!(
        STREAM_PENDING,
        Unit::Count,
        "data.stream: new conversations that qualify but make no wave yet (fewer than stream_min_conversations)."
    );
    describe_gauge!(
        STREAM_WAVE_DUE,
        Unit::Seconds,
        "data.stream: seconds until the pending conversations make a wave by having waited stream_max_wait_s \
         (-1: none pending, or no bound)."
    );
    describe_gauge!(PUBLISHED_VERSION, Unit::Count, "The version publish.dir/current points at (0: none).");
    describe_gauge!(
        PUBLISHED_ACCEPTANCE_LENGTH,
        "Decoded acceptance length of the published drafter (tokens per target step): on the evaluation's prompts once \
         an evaluation decoded it, else when it was published."
    );
}

/// The version `publish.dir/current` points at and its acceptance (at start, and at each evaluation that decodes it).
pub fn published(version: u64, acceptance: f64) {
    gauge!(PUBLISHED_VERSION).set(version as f64);
    gauge!(PUBLISHED_ACCEPTANCE_LENGTH).set(acceptance);
}

/// What becomes of a recorded conversation a wave reads ([`STREAM_CONVERSATIONS`]'s `outcome`).
const STREAM_OUTCOMES: [&str; 3] = ["taken", "sampled", "unreadable"];

/// A stream's wave: the run's waves so far, and what became of the conversations this one read.
pub fn stream_wave(waves: u64, taken: usize, sampled: usize, unreadable: usize) {
    gauge!(STREAM_WAVES).set(waves as f64);
    for (outcome, count) in STREAM_OUTCOMES.into_iter().zip([taken, sampled, unreadable]) {
        counter!(STREAM_CONVERSATIONS, "outcome" => outcome).increment(count as u64);
    }
}

/// `data.stream`'s last look: the conversations short of a wave, and when they make one by waiting.
pub fn stream_pending(conversations: usize, due_in: Option<Duration>) {
    gauge!(STREAM_PENDING).set(conversations as f64);
    gauge!(STREAM_WAVE_DUE).set(due_in.map_or(-1.0, |d| d.as_secs_f64()));
}

/// A drafter published (by an evaluation, or `POST /publish`).
pub fn publication(version: u64, acceptance: f64) {
    counter!(PUBLICATIONS).increment(1);
    published(version, acceptance);
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// This machine's host name (`unknown` where the system gives none): in a lock holder's description, in TensorBoard
/// event file names.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer it is given.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match ok {
        true => String::from_utf8_lossy(&buf[..end]).into_owned(),
        false => "unknown".into(),
    }
}

fn device_labels(id: Option<usize>, g: &GpuIdentity) -> Vec<(&'static str, String)> {
    let mut labels = Vec::with_capacity(4);
    if let Some(id) = id {
        labels.push(("drafter", id.to_string()));
    }
    labels.extend([("device", g.device.clone()), ("gpu", g.gpu.clone()), ("UUID", g.uuid.clone())]);
    labels
}

/// What a drafter's compute thread records.
#[derive(Clone)]
pub struct DrafterMetrics {
    pub step_duration: Histogram,
    pub collective_duration: Histogram,
    pub learning_rate: Gauge,
    pub grad_norm: Gauge,
    pub mfu: Gauge,
    pub feature_queue: Gauge,
    pub feature_wait: Gauge,
}

impl DrafterMetrics {
    pub fn new(id: usize, g: &GpuIdentity) -> Self {
        let on_device = device_labels(Some(id), g);
        let own = [("drafter", id.to_string())];
        gauge!(DRAFTER_INFO, &on_device).set(1.0);
        counter!(DRAFTER_RESTARTS, &own).absolute(0);
        DrafterMetrics {
            step_duration: histogram!(STEP_DURATION, &on_device),
            collective_duration: histogram!(COLLECTIVE_DURATION, &on_device),
            learning_rate: gauge!(LEARNING_RATE, &own),
            grad_norm: gauge!(GRAD_NORM, &own),
            mfu: gauge!(MFU, &on_device),
            feature_queue: gauge!(FEATURE_QUEUE_DEPTH, &own),
            feature_wait: gauge!(FEATURE_WAIT, &own),
        }
    }

    /// Sets the drafter's state series: 1 for `state`, 0 for the others.
    pub fn set_state(id: usize, state: &str) {
        for s in DRAFTER_STATES {
            gauge!(DRAFTER_STATE, "drafter" => id.to_string(), "state" => s).set(if s == state { 1.0 } else { 0.0 });
        }
    }

    pub fn restarted(id: usize) {
        counter!(DRAFTER_RESTARTS, "drafter" => id.to_string()).increment(1);
    }
}

/// What the target's compute thread records.
#[derive(Clone)]
pub struct TargetMetrics {
    pub capture_duration: Histogram,
}

impl TargetMetrics {
    pub fn new(g: &GpuIdentity) -> Self {
        TargetMetrics { capture_duration: histogram!(TARGET_CAPTURE_DURATION, &device_labels(None, g)) }
    }
}

/// One device's memory series.
#[derive(Clone)]
pub struct DeviceMemory {
    pub allocated: Gauge,
    pub reserved: Gauge,
}

impl DeviceMemory {
    pub fn new(g: &GpuIdentity) -> Self {
        let labels = device_labels(None, g);
        DeviceMemory { allocated: gauge!(MEMORY_ALLOCATED, &labels), reserved: gauge!(MEMORY_RESERVED, &labels) }
    }
}

/// Run-wide series, recorded by the supervisor.
pub struct RunMetrics {
    pub step: Gauge,
    pub committed_steps: Counter,
    pub committed_samples: Counter,
    pub committed_tokens: Counter,
    pub skipped_steps: Counter,
    pub last_step_timestamp: Gauge,
    pub run_progress: Gauge,
    pub run_total_steps: Gauge,
    pub run_time_left: Gauge,
    pub loss: Gauge,
    pub accuracy: Gauge,
    pub train_acceptance_length: Gauge,
    pub holdout_acceptance_length: Gauge,
    pub decode_acceptance_length: Gauge,
    pub decode_acceptance_length_best: Gauge,
    pub decode_token_match: Gauge,
    pub eval_duration: Histogram,
    pub eval_last_step: Gauge,
    pub drafters_live: Gauge,
    pub samples_requeued: Counter,
    pub replica_divergences: Counter,
    pub checkpoint_duration: Histogram,
    pub checkpoint_last_success: Gauge,
    pub checkpoint_last_step: Gauge,
    pub checkpoints_skipped: Counter,
    pub checkpoint_writer_stalled: Gauge,
    pub ledger_write_failures: Counter,
    pub ledger_failing: Gauge,
    pub reload_successful: Gauge,
    pub reload_success_timestamp: Gauge,
    pub config_version: Gauge,
}

/// A counter with a `result` label.
fn outcome(name: &'static str, ok: bool) -> Counter {
    counter!(name, "result" => if ok { "success" } else { "failure" })
}

impl RunMetrics {
    /// Creates every run-wide series; counters start from the resumed run's totals.
    pub fn new(step: u64, samples: u64) -> Self {
        gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "cuda" => tch::Cuda::is_available().to_string())
            .set(1.0);
        for name in [EVALS, CHECKPOINTS, CONFIG_RELOADS] {
            outcome(name, true).absolute(0);
            outcome(name, false).absolute(0);
        }
        let m = RunMetrics {
            step: gauge!(STEP),
            committed_steps: counter!(COMMITTED_STEPS),
            committed_samples: counter!(COMMITTED_SAMPLES),
            committed_tokens: counter!(COMMITTED_TOKENS),
            skipped_steps: counter!(SKIPPED_STEPS),
            last_step_timestamp: gauge!(LAST_STEP_TIMESTAMP),
            run_progress: gauge!(RUN_PROGRESS),
            run_total_steps: gauge!(RUN_TOTAL_STEPS),
            run_time_left: gauge!(RUN_TIME_LEFT),
            loss: gauge!(LOSS),
            accuracy: gauge!(ACCURACY),
            train_acceptance_length: gauge!(TRAIN_ACCEPTANCE_LENGTH),
            holdout_acceptance_length: gauge!(HOLDOUT_ACCEPTANCE_LENGTH),
            decode_acceptance_length: gauge!(DECODE_ACCEPTANCE_LENGTH),
            decode_acceptance_length_best: gauge!(DECODE_ACCEPTANCE_LENGTH_BEST),
            decode_token_match: gauge!(DECODE_TOKEN_MATCH),
            eval_duration: histogram!(EVAL_DURATION),
            eval_last_step: gauge!(EVAL_LAST_STEP),
            drafters_live: gauge!(DRAFTERS_LIVE),
            samples_requeued: counter!(SAMPLES_REQUEUED),
            replica_divergences: counter!(REPLICA_DIVERGENCES),
            checkpoint_duration: histogram!(CHECKPOINT_DURATION),
            checkpoint_last_success: gauge!(CHECKPOINT_LAST_SUCCESS),
            checkpoint_last_step: gauge!(CHECKPOINT_LAST_STEP),
            checkpoints_skipped: counter!(CHECKPOINTS_SKIPPED),
            checkpoint_writer_stalled: gauge!(CHECKPOINT_WRITER_STALLED),
            ledger_write_failures: counter!(LEDGER_WRITE_FAILURES),
            ledger_failing: gauge!(LEDGER_FAILING),
            reload_successful: gauge!(CONFIG_RELOAD_SUCCESSFUL),
            reload_success_timestamp: gauge!(CONFIG_RELOAD_SUCCESS_TIMESTAMP),
            config_version: gauge!(CONFIG_VERSION),
        };
        m.step.set(step as f64);
        m.committed_steps.absolute(step);
        m.committed_samples.absolute(samples);
        for c in [
            &m.committed_tokens,
            &m.skipped_steps,
            &m.samples_requeued,
            &m.replica_divergences,
            &m.checkpoints_skipped,
            &m.ledger_write_failures,
        ] {
            c.absolute(0);
        }
        counter!(PUBLICATIONS).absolute(0);
        for outcome in STREAM_OUTCOMES {
            counter!(STREAM_CONVERSATIONS, "outcome" => outcome).absolute(0);
        }
        gauge!(STREAM_WAVES).set(0.0);
        stream_pending(0, None);
        m.checkpoint_writer_stalled.set(0.0);
        m.ledger_failing.set(0.0);
        // A fresh process runs the configuration it was started with: that counts as loaded.
        m.reload_successful.set(1.0);
        m.reload_success_timestamp.set(unix_now());
        m.config_version.set(1.0);
        m
    }

    pub fn checkpoint(&self, written: Option<(u64, f64)>) {
        outcome(CHECKPOINTS, written.is_some()).increment(1);
        if let Some((step, seconds)) = written {
            self.checkpoint_duration.record(seconds);
            self.checkpoint_last_success.set(unix_now());
            self.checkpoint_last_step.set(step as f64);
        }
    }

    pub fn ledger_write(&self, ok: bool) {
        if !ok {
            self.ledger_write_failures.increment(1);
        }
        self.ledger_failing.set(if ok { 0.0 } else { 1.0 });
    }

    pub fn reload(&self, ok: bool, version: u64) {
        outcome(CONFIG_RELOADS, ok).increment(1);
        self.reload_successful.set(if ok { 1.0 } else { 0.0 });
        if ok {
            self.reload_success_timestamp.set(unix_now());
            self.config_version.set(version as f64);
        }
    }

    pub fn evaluation(&self, ok: bool) {
        outcome(EVALS, ok).increment(1);
    }
}
