//! The process's [`Effects`]: how the service carries out the core's actions with threads, actors, channels, disk
//! and TCP. Each call returns at once; what answers later (an actor's start or failure, a scan, a write, an export,
//! an evaluation) comes back to the supervisor as a message. The simulator implements the same trait in memory.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, sync_channel};
use std::time::Duration;

use ractor::Actor;
use tch::{Device, Kind};

use super::core::Core;
use super::driver::Effects;
use super::hosts;
use super::protocol::{Event, Feed, LedgerEntry, Notice, Order, Request, ScanFilter, Start, WriteJob};
use super::spawned::Spawned;
use super::{Shell, to_core};
use crate::data::SampleId;
use crate::model::Drafter;
use crate::service::compute_thread::{ComputeActor, ThreadBody};
use crate::service::drafter::{self, DrafterSpawn, Phase};
use crate::service::failure::Failure;
use crate::service::messages::Work;
use crate::service::target::{self, Route, TargetSpawn};
use crate::telemetry::DrafterMetrics;
use crate::train::checkpoint::{Checkpointer, DRAFTER_DIR, Snapshot, newest_valid};

impl Shell {
    /// Spawns compute actor `what` around its thread `body`, linked to the supervisor: its handle arrives with its
    /// ActorStarted supervision event, a failure to start as its thread's failure.
    fn spawn(&mut self, what: Spawned, body: ThreadBody) {
        let name = self.spawned.name(what);
        let (cell, failed) = (self.myself.get_cell(), to_core(&self.myself, move |f| what.failed(f)));
        tokio::spawn(async move {
            if let Err(e) = Actor::spawn_linked(Some(name.clone()), ComputeActor, body, cell).await {
                failed(Failure::panic(format!("could not start the actor {name}: {e}")));
            }
        });
    }

    /// Adds `scalars` at `step` to the TensorBoard event file; the first failure to write turns it off, with a warning.
    fn add_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) {
        if let Some(file) = &mut self.tensorboard
            && let Err(e) = file.scalars(crate::telemetry::unix_now(), step, scalars)
        {
            tracing::warn!(path = %file.path().display(), "TensorBoard event file not written, and no more this run: {e}");
            self.tensorboard = None;
        }
    }
}

impl Effects for Shell {
    type Snapshot = Snapshot;

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn start_target(&mut self, id: usize, generation: u64) {
        let (tx, rx) = channel();
        let t = &self.targets[id];
        let spawn = TargetSpawn {
            id,
            generation,
            source: self.a.target_source.clone(),
            taps: self.a.taps.clone(),
            device: t.device,
            spread_to: self.a.spread_to.clone(),
            micro_batches: self.a.config.target.micro_batches,
            kind: t.kind,
            last_states: self.a.objective.teacher.needs_target_predictions(),
            pack: self.a.config.data.pack,
            dataset: self.a.dataset.clone(),
            routes: self.routes.clone(),
            supervisor: self.myself.clone(),
            requests: rx,
            abandoned: t.abandoned.clone(),
            metrics: t.metrics.clone(),
            fault: t.fault.clone(),
        };
        // Requests queue in the channel until the thread reads them.
        self.targets[id].thread = Some((generation, tx));
        self.spawn(Spawned::Target { id, generation }, target::thread(spawn));
    }

    fn abandon_target(&mut self, target: usize, generation: u64) {
        let t = &mut self.targets[target];
        t.abandoned.fetch_max(generation, Ordering::SeqCst);
        if t.thread.as_ref().is_some_and(|(g, _)| *g == generation) {
            t.thread = None;
        }
        self.spawned.give_up(Spawned::Target { id: target, generation });
    }

    fn send_to_target(&mut self, target: usize, generation: u64, request: Request) {
        if let Some((g, tx)) = &self.targets[target].thread
            && *g == generation
        {
            let _ = tx.send(request);
        }
    }

    fn start_drafter(&mut self, id: usize, generation: u64, start: Start) {
        let Some(heads) = self.heads.clone() else {
            self.bug(format!("drafter {id} was started before the target was ready"));
            return;
        };
        let c = &self.a.config;
        let h = &mut self.drafters[id];
        *h.shared.phase.lock().unwrap_or_else(|p| p.into_inner()) = Phase::default();
        let (tx, rx) = sync_channel(8 + c.supervision.prefetch_steps * c.optim.accumulation * 2);
        h.metrics.feature_queue.set(0.0);
        let route =
            Route { generation, sender: tx, device: h.device, kind: h.kind, queued: h.metrics.feature_queue.clone() };
        self.routes.set(id, route);
        let spawn = DrafterSpawn {
            id,
            generation,
            device: h.device,
            kind: h.kind,
            config: self.a.drafter_config.clone(),
            objective: self.a.objective.clone(),
            optimizer: c.optim.optimizer,
            seed: c.objective.seed,
            init: c.draft_model.init.clone(),
            accumulation: c.optim.accumulation,
            check_every: c.supervision.check_replicas_every,
            start,
            heads,
            collective: self.collective.clone(),
            supervisor: self.myself.clone(),
            input: rx,
            shared: h.shared.clone(),
            metrics: h.metrics.clone(),
            peak_tflops: c.drafters.peak_tflops,
            collective_timeout: c.drafters.collective_timeout,
        };
        self.spawn(Spawned::Drafter { id, generation }, drafter::thread(spawn));
    }

    fn abandon_drafter(&mut self, id: usize, generation: u64) -> Vec<(usize, u64)> {
        self.drafters[id].shared.abandoned.fetch_max(generation, Ordering::SeqCst);
        self.spawned.give_up(Spawned::Drafter { id, generation });
        self.routes.remove(id, generation);
        self.collective.remove(id, generation).remaining
    }

    fn tell(&mut self, id: usize, generation: u64, order: Order) {
        if !self.routes.try_send(id, generation, Work::Order(order)) {
            tracing::debug!(drafter = id, ?order, "an order for a drafter thread that is gone or busy");
        }
    }

    fn rewind_collective(&mut self, step: u64, samples_committed: u64) -> Result<(), String> {
        let incarnation = self.collective.rewind(step, samples_committed).map_err(|e| e.to_string())?;
        self.checkpointer.fence(incarnation);
        Ok(())
    }

    fn find_checkpoint(&mut self, filter: ScanFilter) {
        let dir = self.a.config.checkpoint.dir.clone();
        let found = to_core(&self.myself, Event::CheckpointFound);
        tokio::task::spawn_blocking(move || {
            let scan = newest_valid(&dir, &|step| filter.allows(step)).map_err(|e| e.to_string());
            for (_, why) in scan.iter().flat_map(|scan| &scan.rejected) {
                tracing::warn!("checkpoint rejected: {why}");
            }
            found(scan);
        });
    }

    fn write_checkpoint(&mut self, job: WriteJob, snapshot: Snapshot) {
        self.checkpointer.write(snapshot, job.state, job.invalid, job.incarnation);
    }

    fn retire_checkpoints(&mut self, from: u64, to: u64) {
        self.checkpointer.retire(from, to);
    }

    fn append_ledger(&mut self, entry: LedgerEntry) {
        let Some(w) = self.ledger.as_ref() else { return };
        let line = match entry {
            LedgerEntry::Commit { step, batch } => {
                let ids: Vec<SampleId> = batch.samples.iter().map(|&p| self.a.dataset.id(p)).collect();
                serde_json::json!({"step": step, "epoch": batch.id.epoch, "batch": batch.id.ordinal, "ids": ids})
            }
            // Entries of this step and later were undone with the model.
            LedgerEntry::Rewind { step } => serde_json::json!({"rewind_to_step": step}),
        };
        w.append(line.to_string());
    }

    fn export(&mut self, from: PathBuf) {
        let dir = self.a.config.checkpoint.dir.clone();
        let exported = to_core(&self.myself, Event::Exported);
        tokio::task::spawn_blocking(move || exported(export_final(&from, &dir)));
    }

    fn evaluate(&mut self, core: &Core, step: u64, path: PathBuf) {
        // The core waits for every evaluation it asks for to answer.
        let failed = to_core(&self.myself, Event::Evaluated);
        if self.evaluator.is_none() {
            match self.start_evaluator(core.config()) {
                Ok(e) => self.evaluator = Some(e),
                Err(e) => return failed(Err(format!("unavailable: {e:#}"))),
            }
        }
        if let Some(e) = &self.evaluator
            && !e.submit(step, path)
        {
            failed(Err("skipped: the previous one is still decoding (a supervisor bug)".to_string()));
        }
    }

    fn post_feed(&mut self, rank: usize, generation: u64, step: u64, feed: Feed) {
        if let Some(link) = &self.a.link {
            hosts::post_feed(link, rank, generation, step, &feed);
        }
    }

    fn notice(&mut self, notice: Notice) {
        let m = &self.run_metrics;
        match notice {
            Notice::Committed { step, samples, tokens, loss, estimate } => {
                m.run_progress.set(estimate.fraction);
                if let Some(total) = estimate.total_steps {
                    m.run_total_steps.set(total as f64);
                }
                if let Some(left) = estimate.eta_seconds {
                    m.run_time_left.set(left);
                }
                m.committed_samples.increment(samples);
                m.committed_tokens.increment(tokens);
                m.committed_steps.increment(1);
                m.step.set(step as f64);
                m.last_step_timestamp.set(crate::telemetry::unix_now());
                if let Some([loss, accuracy, acceptance]) = loss {
                    m.loss.set(loss);
                    m.accuracy.set(accuracy);
                    m.train_acceptance_length.set(acceptance);
                }
            }
            Notice::Skipped => m.skipped_steps.increment(1),
            Notice::Requeued { samples } => m.samples_requeued.increment(samples),
            Notice::Restarted { id } => DrafterMetrics::restarted(id),
            Notice::ReplicasDiverged => m.replica_divergences.increment(1),
            Notice::CheckpointOutcome(written) => m.checkpoint(written),
            Notice::LedgerWrite { ok } => m.ledger_write(ok),
            Notice::WriterStalled(stalled) => m.checkpoint_writer_stalled.set(if stalled { 1.0 } else { 0.0 }),
            Notice::CheckpointSkipped => m.checkpoints_skipped.increment(1),
            Notice::Progress(mut point) => {
                point.time = crate::telemetry::unix_now();
                let p = &point;
                self.add_scalars(
                    p.step,
                    &[
                        ("train/loss", p.loss),
                        ("train/accuracy", p.accuracy),
                        ("train/acceptance_length", p.acceptance),
                        ("train/lr", p.lr),
                        ("train/samples_per_s", p.samples_per_s),
                        ("train/feature_wait_pct", p.feature_wait_pct),
                    ],
                );
                self.a.live.record(point);
            }
            Notice::Evaluated(outcome) => {
                m.evaluation(outcome.is_ok());
                if let Ok(e) = outcome {
                    let mut scalars = vec![
                        ("eval/decoded_acceptance_length", e.decode_acceptance_length),
                        ("eval/token_match", e.token_match_rate),
                    ];
                    scalars.extend(e.holdout_acceptance_length.map(|v| ("eval/holdout_acceptance_length", v)));
                    scalars.extend(e.holdout_loss.map(|v| ("eval/holdout_loss", v)));
                    self.add_scalars(e.step, &scalars);
                    let m = &self.run_metrics;
                    m.decode_acceptance_length.set(e.decode_acceptance_length);
                    if let Some(holdout) = e.holdout_acceptance_length {
                        m.holdout_acceptance_length.set(holdout);
                    }
                    m.decode_acceptance_length_best.set(e.best);
                    m.decode_token_match.set(e.token_match_rate);
                    m.eval_duration.record(e.seconds);
                    m.eval_last_step.set(e.step as f64);
                    if let Some(b) = &e.baseline {
                        crate::telemetry::published(b.version, b.decode_acceptance_length);
                    }
                    if let Some(p) = &e.published {
                        crate::telemetry::publication(p.version, p.decode_acceptance_length);
                    }
                }
            }
        }
    }

    fn exit(&mut self, core: &Core, code: i32) {
        // The writers' queued work gets what is left of the ending's deadline, not more.
        let wait = core.time_left_to_exit(Checkpointer::DROP_WAIT);
        let started = std::time::Instant::now();
        self.checkpointer.finish(wait);
        if let Some(ledger) = &mut self.ledger {
            // What the checkpoint writer left of it.
            ledger.finish(wait.saturating_sub(started.elapsed()));
        }
        if let Some(link) = self.a.link.as_ref().filter(|l| l.rank() == 0) {
            // The others end with the run; waits a little for them to have seen it.
            let others = link.members().iter().filter(|m| m.rank != 0).count();
            if let Err(e) = link.finish(code, others, Duration::from_secs(10)) {
                tracing::warn!("cannot tell the other hosts the run ended: {e}");
            }
        }
        *self.a.exit_code.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
        self.myself.stop(Some(format!("exit {code}")));
    }

    fn bug(&mut self, what: String) {
        tracing::error!("{what} (a supervisor bug)");
    }
}

/// Exports the drafter of the checkpoint `from` into `checkpoint_dir/final` (bf16, the published format); returns
/// that folder. Written aside and put in place whole: a failed export leaves no partial or older `final/`.
pub fn export_final(from: &Path, checkpoint_dir: &Path) -> Result<PathBuf, String> {
    let out = checkpoint_dir.join("final");
    let staged = out.with_file_name(".final.tmp");
    let _ = std::fs::remove_dir_all(&staged);
    let saved = crate::panic::catch_torch(|| {
        Drafter::load(&from.join(DRAFTER_DIR), Device::Cpu, Kind::Float).and_then(|d| d.save(&staged, Kind::BFloat16))
    });
    saved.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string()))?;
    match std::fs::remove_dir_all(&out) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("removing the old {}: {e}", out.display())),
        _ => std::fs::rename(&staged, &out).map(|()| out).map_err(|e| format!("moving it into place: {e}")),
    }
}
