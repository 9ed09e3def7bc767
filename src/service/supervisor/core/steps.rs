//! Steps: opened ahead for the live drafters, committed by the rounds' reports, reported as progress lines,
//! replica checks and the status.
use super::*;

impl Core {
    /// Opens steps ahead until `prefetch_steps` are in flight, for the live drafters.
    pub(super) fn open_steps(&mut self) {
        if self.phase != Phase::Running || self.ending.is_some() {
            return;
        }
        if self.is_follower() {
            return self.open_fed_steps();
        }
        while self.schedule.in_flight() < self.supervision().prefetch_steps {
            let mut live: Vec<(usize, u64)> = self.live().map(|s| (s.id, s.generation)).collect();
            if live.is_empty() {
                return;
            }
            live.extend(self.remote_drafters());
            let Some((step, items)) = self.schedule.open_step(&live) else { return };
            let local = self.slots.len();
            let (mine, remote): (Vec<_>, Vec<_>) = items.into_iter().partition(|(d, ..)| *d < local);
            for (drafter, generation, item) in mine {
                self.send(drafter, generation, item);
            }
            self.feed_remote(step, remote);
            self.due_at_boundary(step + 1);
        }
    }

    /// Periodic checkpoints and evaluations fall due at the step boundaries their settings name. They are asked
    /// for when the step that ends there is handed out, so that the checkpoint is of that very boundary
    /// (`checkpoint.every_steps = 200` writes `ckpt-000000200`, not the first boundary after the steps in flight).
    fn due_at_boundary(&mut self, boundary: u64) {
        let every = self.config.checkpoint.every_steps;
        if every > 0 && boundary.is_multiple_of(every) {
            if self.book.in_flight() {
                self.checkpoint_skipped("periodic");
            } else {
                self.request_checkpoint("periodic");
            }
        }
        let every = self.config.eval.every_steps;
        if every > 0 && boundary.is_multiple_of(every) && self.eval_due.is_none() {
            // One due evaluation at a time: a slow checkpoint or evaluation makes later ones wait, not pile up.
            self.eval_due = Some(boundary);
            if !self.book.requested_at(boundary) && self.request_checkpoint("evaluation").is_none() {
                self.checkpoint_owed = true;
            }
        }
    }

    pub(super) fn commit(&mut self, settled: Settled) {
        let step = settled.step + 1;
        if let Some(last) = self.last_commit {
            self.step_times.record(self.now.saturating_sub(last));
        }
        self.last_commit = Some(self.now);
        self.progress_at = self.now;
        for batch in settled.committed {
            self.ledger(LedgerEntry::Commit { step: settled.step, batch });
        }
        if settled.requeued_samples > 0 {
            self.samples_requeued += settled.requeued_samples;
            self.out.push(Action::Notice(Notice::Requeued { samples: settled.requeued_samples }));
        }
        for batch in &settled.set_aside {
            tracing::error!(batch = %batch.id, sample_ids = %self.ids_of(&batch.samples), "batch failed twice: set aside");
        }
        let every = self.config.supervision.check_replicas_every;
        if every > 0 && step.is_multiple_of(every) {
            // Rank 0 compares every host's replicas (the others' checksums come with their next round); another
            // host compares its own.
            let local = self.slots.len();
            let leader = self.is_leader();
            let members = settled.contributors.iter().map(|(m, _)| *m).filter(|m| leader || *m < local).collect();
            self.replicas.expected.entry(step).or_default().0 = members;
            self.compare_replicas(step);
        }
        self.last_lr = settled.lr;
        self.window.metrics.add(&settled.metrics);
        self.window.samples += settled.samples;
        let m = &settled.metrics;
        let loss = (m.weight > 0.0).then(|| [m.loss(), m.accuracy(), m.acceptance_length()]);
        // Every step's numbers, exact (JSON logs print the shortest decimal that reads back as the same f64): what
        // two runs of the same seed are compared by (`log.level = "info,dflash::steps=debug"`).
        tracing::debug!(
            target: "dflash::steps",
            step,
            loss = m.loss(),
            accuracy = m.accuracy(),
            acceptance = m.acceptance_length(),
            lr = settled.lr,
            samples = settled.samples,
            tokens = settled.tokens,
            "step committed"
        );
        self.run_progress.commit(self.now, step, self.schedule.samples_committed());
        self.out.push(Action::Notice(Notice::Committed {
            step,
            samples: settled.samples,
            tokens: settled.tokens,
            loss,
            estimate: self.estimate(),
        }));
        if let Some(job) = self.book.boundary(step, self.boundary_state(), self.now) {
            self.write(job);
        }
        if self.config.log.every_steps > 0 && step.is_multiple_of(self.config.log.every_steps) {
            self.log_progress();
        }
    }

    pub(super) fn compare_replicas(&mut self, step: u64) {
        if self.replicas.compare(step) == Some(false) {
            self.out.push(Action::Notice(Notice::ReplicasDiverged));
            tracing::error!(step, "replicas diverged: their parameters or optimizer states differ");
        }
    }

    pub(super) fn log_progress(&mut self) {
        let elapsed = self.now.saturating_sub(self.window.started).as_secs_f64().max(1e-9);
        let live = self.live_count();
        let w = &self.window;
        let point = ProgressPoint {
            step: self.schedule.committed_step(),
            epoch: self.schedule.epoch(),
            time: 0.0,
            loss: w.metrics.loss(),
            accuracy: w.metrics.accuracy(),
            acceptance: w.metrics.acceptance_length(),
            samples_per_s: w.samples as f64 / elapsed,
            feature_wait_pct: 100.0 * w.feature_wait_s / (elapsed * live.max(1) as f64),
            lr: self.last_lr,
            drafters_live: live,
        };
        // Its own target: the live page charts these lines rather than listing them as events.
        tracing::info!(
            target: "dflash::progress",
            "step {}{} · epoch {} · loss {:.4} · accuracy {:.3} · train acceptance (teacher-forced) {:.2} · {:.1} samples/s · feature wait {:.1}% · \
             lr {:.2e} · drafters {}/{} live",
            point.step,
            self.estimate().describe(),
            point.epoch,
            point.loss,
            point.accuracy,
            point.acceptance,
            point.samples_per_s,
            point.feature_wait_pct,
            point.lr,
            live,
            self.slots.len()
        );
        self.out.push(Action::Notice(Notice::Progress(point)));
        self.window = Window { metrics: Metrics::default(), samples: 0, feature_wait_s: 0.0, started: self.now };
    }

    /// Where the run stands against its end: `optim.max_steps`, else the epochs' samples (read from the
    /// configuration in effect, so a reload that changes either moves the end).
    pub fn estimate(&self) -> Estimate {
        let o = &self.config.optim;
        if self.schedule.stream_waves().is_some() && o.max_steps == 0 {
            return Estimate { open_ended: true, ..Estimate::default() };
        }
        let bound = match o.max_steps {
            0 => Bound::Samples(self.schedule.samples_per_epoch() as u64 * o.epochs),
            steps => Bound::Steps(steps),
        };
        self.run_progress.estimate(bound, self.schedule.committed_step(), self.schedule.samples_committed())
    }

    pub fn status(&self) -> Status {
        let phase = match (self.exit, &self.ending, self.phase) {
            (Some(c), ..) => format!("stopped ({c})"),
            (None, Some(_), _) => "stopping".into(),
            (None, None, Phase::StartingTargets) => "starting target".into(),
            (None, None, Phase::StartingDrafters) => "starting drafters".into(),
            (None, None, Phase::Running) if self.live().next().is_none() => "recovering".into(),
            (None, None, Phase::Running) => "running".into(),
        };
        Status {
            phase,
            // The shell fills it in (the core sees no process).
            pid: 0,
            ready: self.ready(),
            problems: self.problems(),
            step: self.schedule.committed_step(),
            progress: self.estimate(),
            epoch: self.schedule.epoch(),
            samples_committed: self.schedule.samples_committed(),
            samples_requeued: self.samples_requeued,
            batches_set_aside: self.schedule.set_aside().len() as u64,
            skipped_steps: self.skipped_steps,
            replicas_checked_step: self.replicas.checked_step,
            replicas_diverged: self.replicas.diverged,
            config_version: self.config_version,
            drafters: self
                .slots
                .iter()
                .map(|s| DrafterStatus {
                    id: s.id,
                    device: s.device.clone(),
                    state: s.state(),
                    step: s.step,
                    restarts: s.restarts.total,
                })
                .collect(),
            targets: self
                .targets
                .iter()
                .map(|t| TargetStatus {
                    id: t.id,
                    device: t.device.clone(),
                    ready: t.is_ready(),
                    restarts: t.restarts(),
                    drafters: (0..self.feeds.len()).filter(|&d| self.feeds[d] == t.id).collect(),
                })
                .collect(),
            last_checkpoint: self.book.newest().map(|n| CheckpointStatus {
                step: n.step,
                path: n.path.display().to_string(),
                age_s: self.now.saturating_sub(n.at).as_secs_f64(),
            }),
            checkpoint_writer: self.writer_status(),
            ledger: self.ledger_status(),
            last_evaluation: self.last_evaluation.clone(),
            host_role: self.hosts.role.map(|r| match r {
                HostRole::Leader => "rank 0",
                HostRole::Follower => "follower",
            }),
            other_hosts: self.other_hosts(),
            stream: self.schedule.stream_waves().map(|waves| crate::service::status::StreamStatus {
                waves,
                waiting_for_a_wave: self.schedule.waiting_for_a_wave(),
                pending_conversations: self.stream_pending.0,
                wave_due_in_s: self.stream_pending.1.map(|at| at.saturating_sub(self.now).as_secs_f64()),
            }),
        }
    }
}
