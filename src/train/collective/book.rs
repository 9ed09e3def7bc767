//! A run's round bookkeeping, apart from its tensors: which settings each round's update uses (a reload applies
//! from the first step no member has begun), how many samples are committed before and after each round, and the
//! report a completed round makes. Pure: the collective keeps one [`Book`] under its lock and sums the gradients
//! beside it; the cluster simulation drives the same `Book` with its tensor-free rounds, so what it checks (the
//! learning rate of every round, the samples every host commits) is what the trainer computes.
use crate::cluster::quorum::Rank;
use crate::data::loader::BatchId;
use crate::train::collective::{Contributed, RoundReport};
use crate::train::link::HostRecord;
use crate::train::objective::{Metrics, ObjectiveKnobs};
use crate::train::optim::UpdateSettings;
use crate::train::rounds::Completed;
use crate::train::step::StepSettings;

/// What the bookkeeping reads of a member's contribution to a round.
pub trait Counted {
    fn samples(&self) -> u64;
    /// Its summed loss weight.
    fn weight(&self) -> f64;
    fn batches(&self) -> &[BatchId];
    fn metrics(&self) -> Metrics;
}

/// The settings and progress the rounds advance.
#[derive(Debug, Clone)]
pub struct Book {
    settings: StepSettings,
    /// Settings of a reload and the first step they apply to.
    pending: Option<(u64, StepSettings)>,
    samples_committed: u64,
}

/// What a completed round settles besides its gradient.
#[derive(Debug, Clone)]
pub struct Settled {
    /// The update every member applies.
    pub update: UpdateSettings,
    /// The objective of the next step's forward.
    pub next_objective: ObjectiveKnobs,
    /// The samples committed once the round applies.
    pub samples_committed: u64,
    /// The run's loss weight, across hosts (`None`: this host's contributions').
    pub total_weight: Option<f64>,
    /// Across hosts: the other member hosts' records.
    pub remote: Vec<HostRecord>,
}

impl Book {
    pub fn new(settings: StepSettings, samples_committed: u64) -> Self {
        Book { settings, pending: None, samples_committed }
    }

    pub fn samples_committed(&self) -> u64 {
        self.samples_committed
    }

    /// The settings of step `step`.
    pub fn settings_at(&self, step: u64) -> StepSettings {
        match self.pending {
            Some((from, next)) if from <= step => next,
            _ => self.settings,
        }
    }

    /// New settings from step `from` on.
    pub fn reload(&mut self, from: u64, settings: StepSettings) {
        self.pending = Some((from, settings));
    }

    /// The run goes back to a checkpoint taken after `samples_committed` samples; a reload waiting applies from
    /// there.
    pub fn rewind(&mut self, samples_committed: u64) {
        self.samples_committed = samples_committed;
        if let Some((_, next)) = self.pending.take() {
            self.settings = next;
        }
    }

    /// The host entered the run with a live host's state, after `samples_committed` samples.
    pub fn entered(&mut self, samples_committed: u64) {
        self.samples_committed = samples_committed;
    }

    /// Round `step` completed with `contributions`: the update its members apply (from the samples committed
    /// before it) and the next step's objective; its samples are committed.
    pub fn settle<C: Counted>(&mut self, step: u64, contributions: &[(usize, u64, C)]) -> Settled {
        if self.pending.is_some_and(|(from, _)| from <= step) {
            self.settings = self.settings_at(step);
            self.pending = None;
        }
        let update = self.settings.hyper.update(step, self.samples_committed);
        let next_objective = self.settings_at(step + 1).objective;
        self.samples_committed += local_samples(contributions);
        Settled {
            update,
            next_objective,
            samples_committed: self.samples_committed,
            total_weight: None,
            remote: vec![],
        }
    }

    /// Across hosts: the run's round settled `local` (this host's part, [`Book::settle`]d already) as `hosts`, each
    /// member host's record in rank order (this host's among them). Every host's samples and loss weight count and
    /// every host applies the lowest-ranked member's settings (rank 0's: reloads go there). A round of an incarnation left behind (`current` false: the host entered the run again while its
    /// exchange was under way) commits nothing here: the host's count is its donor's since.
    pub fn settle_run(
        &mut self,
        local: Settled,
        local_samples: u64,
        current: bool,
        hosts: Vec<HostRecord>,
        me: Rank,
    ) -> Settled {
        if current {
            self.samples_committed += hosts.iter().map(HostRecord::samples).sum::<u64>() - local_samples;
        }
        let (update, next_objective) = hosts.first().map_or((local.update, local.next_objective), |h| h.settings);
        Settled {
            update,
            next_objective,
            samples_committed: self.samples_committed,
            total_weight: Some(hosts.iter().map(|h| h.weight).sum()),
            remote: hosts.into_iter().filter(|h| h.rank != me).collect(),
        }
    }
}

/// The samples of a round's contributions.
pub fn local_samples<C: Counted>(contributions: &[(usize, u64, C)]) -> u64 {
    contributions.iter().map(|(.., c)| c.samples()).sum()
}

/// The report of a completed round, as the supervisor commits it.
pub fn report<C: Counted>(settled: Settled, done: &Completed<C>) -> RoundReport {
    let total_weight =
        settled.total_weight.unwrap_or_else(|| done.contributions.iter().map(|(.., c)| c.weight()).sum());
    RoundReport {
        step: done.step,
        incarnation: done.incarnation,
        contributions: done
            .contributions
            .iter()
            .map(|(m, g, c)| Contributed {
                member: *m,
                generation: *g,
                batches: c.batches().to_vec(),
                metrics: c.metrics(),
                samples: c.samples(),
            })
            .collect(),
        total_weight,
        lr: settled.update.adamw.lr,
        samples_committed: settled.samples_committed,
        remote: settled.remote,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::Hyper;

    struct Part(u64);

    impl Counted for Part {
        fn samples(&self) -> u64 {
            self.0
        }
        fn weight(&self) -> f64 {
            2.0 * self.0 as f64
        }
        fn batches(&self) -> &[BatchId] {
            &[]
        }
        fn metrics(&self) -> Metrics {
            Metrics::default()
        }
    }

    fn settings(lr: f64, anchors: usize) -> StepSettings {
        StepSettings {
            hyper: Hyper::constant_for_tests(lr),
            objective: ObjectiveKnobs { num_anchors: anchors, gamma: None },
        }
    }

    fn done(step: u64, parts: &[u64]) -> Completed<Part> {
        Completed {
            step,
            incarnation: 0,
            contributions: parts.iter().enumerate().map(|(m, &n)| (m, 0, Part(n))).collect(),
        }
    }

    #[test]
    fn a_round_commits_its_samples_and_reports_its_weight() {
        let mut book = Book::new(settings(1e-3, 4), 10);
        let round = done(3, &[2, 5]);
        let settled = book.settle(round.step, &round.contributions);
        assert_eq!((settled.samples_committed, book.samples_committed()), (17, 17));
        let report = report(settled, &round);
        assert_eq!((report.step, report.total_weight, report.samples_committed, report.lr), (3, 14.0, 17, 1e-3));
        assert_eq!(report.samples(), 7);
    }

    #[test]
    fn a_reload_applies_from_its_step_and_its_objective_one_step_earlier() {
        let mut book = Book::new(settings(1e-3, 4), 0);
        book.reload(6, settings(5e-4, 8));
        let settled = book.settle(5, &done(5, &[1]).contributions);
        assert_eq!((settled.update.adamw.lr, settled.next_objective.num_anchors), (1e-3, 8));
        let settled = book.settle(6, &done(6, &[1]).contributions);
        assert_eq!((settled.update.adamw.lr, settled.next_objective.num_anchors), (5e-4, 8));
    }

    #[test]
    fn across_hosts_every_host_counts_and_rank_0_sets_the_update() {
        let mut book = Book::new(settings(1e-3, 4), 100);
        let round = done(0, &[3]);
        let local = book.settle(0, &round.contributions);
        // Rank 0 trained 6 samples of weight 12, this host (rank 1) its 3 of weight 6.
        let record = |rank, lr, samples| HostRecord {
            rank,
            generation: 1,
            settings: (settings(lr, 4).hyper.update(0, 100), ObjectiveKnobs { num_anchors: 4, gamma: None }),
            weight: 2.0 * samples as f64,
            contributions: vec![crate::train::link::DrafterPart {
                drafter: 0,
                generation: 1,
                batches: vec![],
                samples,
                metrics: Metrics::default(),
                digest: None,
            }],
        };
        let hosts = vec![record(0, 2e-3, 6), record(1, 1e-3, 3)];
        let settled = book.settle_run(local.clone(), 3, true, hosts.clone(), 1);
        assert_eq!((settled.samples_committed, settled.update.adamw.lr, settled.total_weight), (109, 2e-3, Some(18.0)));
        assert_eq!(settled.remote.iter().map(|h| h.rank).collect::<Vec<_>>(), vec![0]);
        // Left behind: the host entered again meanwhile, its count is its donor's.
        book.entered(500);
        assert_eq!(book.settle_run(local, 3, false, hosts, 1).samples_committed, 500);
    }
}
