//! A host other than rank 0 when rank 0 is lost (or ends the run with an error). The run cannot go on without it
//! (it served the store and kept the loader and the ledger), but this host's replicas hold the run's state,
//! possibly newer than rank 0's newest checkpoint. So the host checkpoints one replica at the step boundary it
//! stands at, with the trainer state derived from rank 0's last word and the rounds since
//! ([`Survivor`](super::super::survivor::Survivor)), into a folder of its own (`checkpoint.dir/survivors/host-<rank>`,
//! so that no two hosts write one path on a shared disk), then exits for a restart. Rank 0, resumed with
//! `--resume auto`, takes the newest checkpoint of any host.
use super::*;

/// A checkpoint being taken on the way out.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parting {
    /// The drafter thread `(id, generation)` asked for its state.
    donor: (usize, u64),
    pub(super) deadline: Duration,
    /// The exit status once it is written (or cannot be).
    code: i32,
}

impl Core {
    /// The run ends here without rank 0 (`why`: the rendezvous host is gone, or rank 0 ended it with an error):
    /// checkpoint a live replica if there is one and rank 0 said where the run stands, then exit with `code`.
    pub(super) fn part(&mut self, why: String, code: i32) {
        if self.hosts.parting.is_some() {
            return;
        }
        let donor = self.donor().filter(|_| self.is_follower() && self.hosts.survivor.has_position());
        let Some(donor) = donor else {
            tracing::error!(
                code,
                "{why}: exiting with nothing to checkpoint here (no live replica, or rank 0 never said where the run \
                 stood); restart every host with --resume auto"
            );
            return self.exit_now(code);
        };
        tracing::error!(
            drafter = donor.0,
            code,
            "{why}: checkpointing this host's replica, then exiting; restart every host with --resume auto and rank 0 \
             continues from the newest checkpoint of any host"
        );
        let deadline = self.now + Duration::from_secs_f64(self.supervision().shutdown_timeout_s);
        self.hosts.parting = Some(Parting { donor, deadline, code });
        // At the boundary the replica stands at (a round left undecided was not applied).
        self.tell(donor, Order::Checkpoint { at: 0 });
    }

    pub(super) fn parting(&self) -> bool {
        self.hosts.parting.is_some()
    }

    /// The donor's snapshot at boundary `step`: written with the run's state there.
    pub(super) fn parting_snapshot(&mut self, id: usize, generation: u64, step: u64, optimizer_steps: u64) {
        if self.hosts.parting.map(|p| p.donor) != Some((id, generation)) {
            return self.out.push(Action::DropSnapshots { which: Some((id, generation, step)) });
        }
        let per_epoch = self.schedule.batches_per_epoch();
        match self.hosts.survivor.state_at(step, per_epoch, self.config.merged.clone()) {
            Ok(mut state) => {
                state.optimizer_steps = optimizer_steps;
                self.write(WriteJob { donor: (id, generation), step, incarnation: 0, state, invalid: vec![] });
            }
            Err(e) => {
                tracing::error!(step, "cannot checkpoint this host's replica: {e}; exiting");
                self.out.push(Action::DropSnapshots { which: None });
                self.exit_parting();
            }
        }
    }

    /// The checkpoint on the way out is written (or failed): exit.
    pub(super) fn parted(&mut self, step: u64, result: Result<(PathBuf, f64), String>) {
        match result {
            Ok((path, seconds)) => tracing::warn!(
                step,
                path = %path.display(),
                seconds = format!("{seconds:.2}"),
                "checkpointed this host's replica of the run: exiting"
            ),
            Err(e) => tracing::error!(step, "checkpoint of this host's replica failed: {e}; exiting"),
        }
        self.exit_parting();
    }

    fn exit_parting(&mut self) {
        let code = self.hosts.parting.map_or(EXIT_RESTART, |p| p.code);
        self.exit_now(code);
    }

    /// While parting nothing else goes on; past `supervision.shutdown_timeout_s` the host exits without it.
    pub(super) fn check_parting(&mut self) {
        if self.hosts.parting.is_some_and(|p| self.now >= p.deadline) {
            tracing::error!(
                seconds = self.supervision().shutdown_timeout_s,
                "this host's replica was not checkpointed within supervision.shutdown_timeout_s: exiting"
            );
            self.exit_parting();
        }
    }
}
