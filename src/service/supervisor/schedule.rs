//! Which batches each drafter trains at which step, and what becomes of them: the run's data bookkeeping, without
//! threads or tensors.
//!
//! Steps are assigned ahead: each live drafter gets `accumulation` items per step (a batch, or `Empty` once the
//! data ran out). A batch is settled only by the report of its step's round, never by a failure: batches the round
//! took are committed (written to the ledger), the others go back to the loader, or are set aside once they were
//! running during two failures. A drafter flagged failed that still contributes is therefore counted once, and a
//! failure whose report is still on its way loses nothing. Reports of an earlier incarnation (before a rewind) are
//! ignored; reports that arrive out of order wait for the ones before them.
use std::collections::{BTreeMap, HashMap};

use crate::config::Config;
use crate::data::loader::{Batch, BatchId, Loader, LoaderSettings, LoaderState, StreamEpochs};
use crate::train::checkpoint::TrainerState;
use crate::train::collective::RoundReport;
use crate::train::objective::Metrics;

/// One micro-batch slot of a drafter's step.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Item {
    /// A batch: its id and the sample positions the target captures.
    Capture { batch: BatchId, positions: Vec<usize> },
    /// No batch (the data ran out, or the batch was set aside): the drafter counts it and contributes without it.
    Empty,
}

/// An item for drafter `.0`'s thread `.1`.
pub type Sent = (usize, u64, Item);

/// A drafter's items of one step.
#[derive(Debug, Clone)]
struct Assignment {
    drafter: usize,
    generation: u64,
    batches: Vec<Option<BatchId>>,
}

/// What committing a round did.
#[derive(Debug, Default, Clone)]
pub struct Settled {
    pub step: u64,
    /// Batches trained, in contribution order (for the ledger).
    pub committed: Vec<Batch>,
    pub tokens: u64,
    pub samples: u64,
    pub metrics: Metrics,
    /// Samples of batches handed out again.
    pub requeued_samples: u64,
    /// Batches set aside after their second failure, with their sample positions.
    pub set_aside: Vec<Batch>,
    pub lr: f64,
    /// Members that contributed, `(id, generation)`.
    pub contributors: Vec<(usize, u64)>,
}

/// See the module documentation.
pub struct Schedule {
    loader: Loader,
    settings: LoaderSettings,
    lengths: Vec<usize>,
    batches: HashMap<BatchId, Batch>,
    assigned: BTreeMap<u64, Vec<Assignment>>,
    next_step: u64,
    committed_step: u64,
    samples_committed: u64,
    incarnation: u64,
    early: BTreeMap<u64, RoundReport>,
    failures: HashMap<BatchId, u32>,
    set_aside: Vec<BatchId>,
    /// The batches this process set aside, kept in case a thread already held one's features: the round that
    /// trained it commits it after all.
    aside: HashMap<BatchId, Batch>,
    accumulation: usize,
    epochs: u64,
    max_steps: u64,
    /// Another host assigns this one's batches (several hosts, rank > 0): no loader of its own, nothing requeued
    /// or set aside here, and the run ends when that host says so.
    follower: bool,
    /// The newest epoch of a batch a round committed.
    committed_epoch: u64,
    /// A follower's items of open steps for drafters that were not live when the step opened, by `(step, drafter)`:
    /// a drafter that joins takes them.
    unclaimed: BTreeMap<(u64, usize), Vec<Item>>,
}

/// Where a schedule starts: a checkpoint's position, or the beginning.
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    pub step: u64,
    pub samples_committed: u64,
    pub loader: Option<LoaderState>,
    pub set_aside: Vec<BatchId>,
}

impl Position {
    pub const START: Position = Position { step: 0, samples_committed: 0, loader: None, set_aside: vec![] };

    /// Where a checkpoint's run stood.
    pub fn of(state: &TrainerState) -> Position {
        Position {
            step: state.step,
            samples_committed: state.samples_committed,
            loader: Some(state.loader.clone()),
            set_aside: state.set_aside.clone(),
        }
    }
}

/// Whether a run configured by `config`, on data of these `lengths`, has nothing left to train from `state`'s
/// checkpoint: its steps or its epochs are done.
pub fn complete_at(config: &Config, lengths: Vec<usize>, state: &TrainerState) -> bool {
    if config.data.stream.is_some() {
        // Open-ended: only its steps bound it.
        return config.optim.max_steps > 0 && state.step >= config.optim.max_steps;
    }
    let mut schedule = Schedule::of_run(config, lengths);
    schedule.restore(&Position::of(state), 0);
    !schedule.data_left()
}

impl Schedule {
    /// The schedule of a run configured by `config`, on data of these `lengths`, from its beginning.
    pub fn of_run(config: &Config, lengths: Vec<usize>) -> Self {
        let settings = LoaderSettings {
            batch_size: config.data.batch_size,
            seed: config.objective.seed,
            bucket_batches: 16,
            pack: config.data.pack,
        };
        let optim = &config.optim;
        Schedule::new(lengths, settings, optim.accumulation, optim.epochs, optim.max_steps)
    }

    pub fn new(
        lengths: Vec<usize>,
        settings: LoaderSettings,
        accumulation: usize,
        epochs: u64,
        max_steps: u64,
    ) -> Self {
        Schedule {
            loader: Loader::new(lengths.clone(), settings),
            settings,
            lengths,
            batches: HashMap::new(),
            assigned: BTreeMap::new(),
            next_step: 0,
            committed_step: 0,
            samples_committed: 0,
            incarnation: 0,
            early: BTreeMap::new(),
            failures: HashMap::new(),
            set_aside: vec![],
            aside: HashMap::new(),
            accumulation: accumulation.max(1),
            epochs,
            max_steps,
            follower: false,
            committed_epoch: 0,
            unclaimed: BTreeMap::new(),
        }
    }

    /// Makes this a stream's schedule (`data.stream`), from its beginning: epoch `k` trains wave `k` of
    /// `stream.waves` (positions after the base data's) with replay ([`StreamEpochs`]).
    pub fn stream(&mut self, stream: StreamEpochs) {
        self.loader = Loader::stream(self.lengths.clone(), self.settings, LoaderState::default(), stream);
    }

    /// A stream's waves known so far (`None`: not a stream).
    pub fn stream_waves(&self) -> Option<usize> {
        self.loader.stream_epochs().map(|s| s.waves.len())
    }

    /// A stream with nothing in flight and no wave left to train: it waits for the next.
    pub fn waiting_for_a_wave(&self) -> bool {
        self.loader.stream_epochs().is_some() && self.assigned.is_empty() && !self.loader.ready()
    }

    /// A stream's next wave arrived: samples of `lengths`, at the positions after every one known.
    pub fn add_wave(&mut self, lengths: &[usize]) {
        self.lengths.extend_from_slice(lengths);
        self.loader.add_wave(lengths);
    }

    /// Makes this the schedule of a host whose batches another host assigns ([`Schedule::open_fed_step`]).
    pub fn follow(&mut self) {
        self.follower = true;
    }

    /// A follower's next step, with the items the assigning host gave each drafter (`(drafter, item)`; a live
    /// drafter given fewer than `accumulation` gets `Empty` for the rest; the items of a drafter not live wait for
    /// it to join, and the assigning host takes back what no round took).
    pub fn open_fed_step(&mut self, drafters: &[(usize, u64)], fed: Vec<(usize, Item)>) -> Vec<Sent> {
        let step = self.open();
        for (drafter, item) in fed {
            self.unclaimed.entry((step, drafter)).or_default().push(item);
        }
        self.assign_all(step, drafters)
    }

    /// Opens the next step, assigned to nobody yet.
    fn open(&mut self) -> u64 {
        self.next_step += 1;
        self.assigned.insert(self.next_step - 1, Vec::new());
        self.next_step - 1
    }

    /// A follower's drafter takes its items of open step `step`.
    fn claim_fed(&mut self, step: u64, drafter: usize) -> (Vec<Item>, Vec<Option<BatchId>>) {
        let mut items = self.unclaimed.remove(&(step, drafter)).unwrap_or_default();
        items.resize(self.accumulation.max(items.len()), Item::Empty);
        let batches = items.iter().map(|item| match item {
            Item::Capture { batch, positions } => {
                self.batches.insert(*batch, Batch { id: *batch, samples: positions.clone() });
                Some(*batch)
            }
            Item::Empty => None,
        });
        let batches = batches.collect();
        (items, batches)
    }

    /// A follower that entered the run mid-way: the run's samples committed before `report`'s round.
    pub fn align_samples(&mut self, report: &RoundReport) {
        if self.follower && self.samples_committed == 0 && report.incarnation == self.incarnation {
            self.samples_committed = report.samples_committed.saturating_sub(report.samples());
        }
    }

    /// Starts over from `position` as a new incarnation: nothing is assigned, reports from before are ignored.
    pub fn restore(&mut self, position: &Position, incarnation: u64) {
        let state = position.loader.clone().unwrap_or_default();
        // A stream's epochs are the waves its loader knows (the schedule keeps no copy of them).
        self.loader = match self.loader.stream_epochs().cloned() {
            Some(stream) => Loader::stream(self.lengths.clone(), self.settings, state, stream),
            None => Loader::restore(self.lengths.clone(), self.settings, state),
        };
        self.batches.clear();
        self.assigned.clear();
        self.early.clear();
        self.unclaimed.clear();
        self.next_step = position.step;
        self.committed_step = position.step;
        self.samples_committed = position.samples_committed;
        self.set_aside = position.set_aside.clone();
        self.aside.clear();
        self.incarnation = incarnation;
    }

    /// Steps completed (the next round to commit).
    pub fn committed_step(&self) -> u64 {
        self.committed_step
    }

    /// The first step not handed out yet: no drafter is past this boundary.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    pub fn samples_committed(&self) -> u64 {
        self.samples_committed
    }

    pub fn set_aside(&self) -> &[BatchId] {
        &self.set_aside
    }

    /// The epoch the run is in: its loader's, or on a follower (whose loader hands out nothing) the newest epoch of
    /// the batches its rounds committed.
    pub fn epoch(&self) -> u64 {
        match self.follower {
            true => self.committed_epoch,
            false => self.loader.epoch(),
        }
    }

    pub fn samples_per_epoch(&self) -> usize {
        self.lengths.len()
    }

    pub fn batches_per_epoch(&self) -> usize {
        self.loader.batches_per_epoch()
    }

    /// Batch `id` with its sample positions, from the loader's plan (whoever handed it out).
    pub fn batch(&mut self, id: BatchId) -> Option<Batch> {
        self.loader.batch(id)
    }

    pub fn loader_state(&self) -> LoaderState {
        self.loader.state()
    }

    /// Steps assigned and not committed.
    pub fn in_flight(&self) -> usize {
        self.assigned.len()
    }

    /// Whether more steps may be assigned: epochs left, or under `optim.max_steps` steps left (the epochs then loop
    /// as many times as the steps need, and `optim.epochs` plays no part).
    pub fn data_left(&self) -> bool {
        if self.follower {
            return true;
        }
        match self.max_steps {
            0 => self.batches_left(),
            max => self.next_step < max && self.batches_left(),
        }
    }

    /// Batches are left in the run's epochs (any number of them under `optim.max_steps`).
    fn batches_left(&self) -> bool {
        // A stream is open-ended: its next wave may come at any time.
        self.loader.stream_epochs().is_some()
            || self.loader.next_epoch().is_some_and(|e| self.max_steps > 0 || e < self.epochs)
    }

    /// The run's data is trained: nothing in flight and nothing left to assign.
    pub fn finished(&self) -> bool {
        self.assigned.is_empty() && !self.data_left()
    }

    /// Opens the next step (when data is left) and assigns it to `drafters`; returns the items to send, each with
    /// its drafter `(id, generation)`.
    pub fn open_step(&mut self, drafters: &[(usize, u64)]) -> Option<(u64, Vec<Sent>)> {
        // A stream between waves opens no step (its drafters wait for the next wave, rather than step on nothing).
        if !self.data_left() || (self.loader.stream_epochs().is_some() && !self.loader.ready()) {
            return None;
        }
        let step = self.open();
        Some((step, self.assign_all(step, drafters)))
    }

    /// Gives each of `drafters` `(id, generation)` its items of open step `step`.
    pub fn assign_all(&mut self, step: u64, drafters: &[(usize, u64)]) -> Vec<Sent> {
        let mut items = Vec::new();
        for &(drafter, generation) in drafters {
            items.extend(self.assign(step, drafter, generation).into_iter().map(|i| (drafter, generation, i)));
        }
        items
    }

    /// Steps opened from `from` on (a drafter admitted at round `from` takes part in them).
    pub fn open_steps_from(&self, from: u64) -> Vec<u64> {
        self.assigned.range(from..).map(|(s, _)| *s).collect()
    }

    /// Gives drafter `drafter` (thread `generation`) its items of open step `step`.
    pub fn assign(&mut self, step: u64, drafter: usize, generation: u64) -> Vec<Item> {
        let Some(list) = self.assigned.get(&step) else { return vec![] };
        if list.iter().any(|a| a.drafter == drafter && a.generation == generation) {
            return vec![];
        }
        if self.follower {
            let (items, batches) = self.claim_fed(step, drafter);
            if let Some(list) = self.assigned.get_mut(&step) {
                list.push(Assignment { drafter, generation, batches });
            }
            return items;
        }
        let mut items = Vec::new();
        let mut batches = Vec::new();
        for _ in 0..self.accumulation {
            let batch = self.batches_left().then(|| self.loader.next_batch()).flatten();
            items.push(
                batch.as_ref().map_or(Item::Empty, |b| Item::Capture { batch: b.id, positions: b.samples.clone() }),
            );
            batches.push(batch.as_ref().map(|b| b.id));
            if let Some(b) = batch {
                self.batches.insert(b.id, b);
            }
        }
        if let Some(list) = self.assigned.get_mut(&step) {
            list.push(Assignment { drafter, generation, batches });
        }
        items
    }

    /// The batches were running in a thread that failed (not an injected fault): two such failures set a batch
    /// aside when its round settles it.
    pub fn note_failure(&mut self, batches: &[BatchId]) {
        for b in batches {
            *self.failures.entry(*b).or_insert(0) += 1;
        }
    }

    /// How often `batch` was running during a failure.
    pub fn failures_of(&self, batch: BatchId) -> u32 {
        self.failures.get(&batch).copied().unwrap_or(0)
    }

    /// Sets a batch aside now (it made the target fail twice): it is never handed out again this epoch, and its
    /// slot in the step becomes empty.
    pub fn set_aside_now(&mut self, batch: BatchId) -> Option<Batch> {
        for list in self.assigned.values_mut() {
            for a in list.iter_mut() {
                for slot in a.batches.iter_mut() {
                    if *slot == Some(batch) {
                        *slot = None;
                    }
                }
            }
        }
        self.loader.commit(batch);
        self.set_aside.push(batch);
        let taken = self.batches.remove(&batch);
        if let Some(b) = &taken {
            self.aside.insert(batch, b.clone());
        }
        taken
    }

    /// A batch set aside after a thread had its features (the target delivered them before the failure that
    /// blamed the batch was heard of): the round trained it, so it is committed, and no longer aside.
    fn trained_after_all(&mut self, batch: BatchId) -> Option<Batch> {
        let taken = self.aside.remove(&batch)?;
        self.set_aside.retain(|b| *b != batch);
        Some(taken)
    }

    /// Takes a round's report; returns what each round it completes settled (none while an earlier one is missing,
    /// several when it fills a gap).
    pub fn take_report(&mut self, report: RoundReport) -> Vec<Settled> {
        if report.incarnation != self.incarnation || report.step < self.committed_step {
            return vec![];
        }
        self.early.insert(report.step, report);
        let mut settled = Vec::new();
        while let Some(r) = self.early.remove(&self.committed_step) {
            settled.push(self.settle(r));
        }
        settled
    }

    fn settle(&mut self, r: RoundReport) -> Settled {
        let mut out = Settled {
            step: r.step,
            lr: r.lr,
            samples: r.samples_committed.saturating_sub(self.samples_committed),
            ..Settled::default()
        };
        let mut taken = std::collections::HashSet::new();
        for c in &r.contributions {
            out.contributors.push((c.member, c.generation));
            out.metrics.add(&c.metrics);
            for b in &c.batches {
                taken.insert(*b);
                self.committed_epoch = self.committed_epoch.max(b.epoch);
                if !self.follower {
                    self.loader.commit(*b);
                }
                self.failures.remove(b);
                if let Some(batch) = self.batches.remove(b).or_else(|| self.trained_after_all(*b)) {
                    // (A position another host assigned is checked at start to be this data's: counted, never trusted.)
                    out.tokens +=
                        batch.samples.iter().map(|&p| self.lengths.get(p).map_or(0, |&l| l as u64)).sum::<u64>();
                    out.committed.push(batch);
                }
            }
        }
        self.unclaimed.retain(|(step, _), _| *step > r.step);
        for a in self.assigned.remove(&r.step).unwrap_or_default() {
            for b in a.batches.into_iter().flatten().filter(|b| !taken.contains(b)) {
                if self.follower {
                    // The assigning host takes it back.
                    self.batches.remove(&b);
                    continue;
                }
                if self.failures_of(b) >= 2 {
                    self.failures.remove(&b);
                    if let Some(batch) = self.set_aside_now(b) {
                        out.set_aside.push(batch);
                    }
                } else {
                    out.requeued_samples += self.batches.remove(&b).map_or(0, |x| x.samples.len() as u64);
                    self.loader.requeue(b);
                }
            }
        }
        self.samples_committed = r.samples_committed;
        self.committed_step = r.step + 1;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::collective::Contributed;

    fn schedule(samples: usize, accumulation: usize) -> Schedule {
        let settings = LoaderSettings { batch_size: 2, seed: 1, bucket_batches: 2, pack: None };
        Schedule::new(vec![10; samples], settings, accumulation, 1, 0)
    }

    fn batches(items: &[Sent], drafter: usize) -> Vec<BatchId> {
        items
            .iter()
            .filter(|(d, ..)| *d == drafter)
            .filter_map(|(_, _, i)| match i {
                Item::Capture { batch, .. } => Some(*batch),
                Item::Empty => None,
            })
            .collect()
    }

    fn report(step: u64, incarnation: u64, parts: &[(usize, Vec<BatchId>)], samples: u64) -> RoundReport {
        RoundReport {
            step,
            incarnation,
            contributions: parts
                .iter()
                .map(|(m, b)| Contributed {
                    member: *m,
                    generation: 1,
                    batches: b.clone(),
                    metrics: Metrics::default(),
                    samples: 2 * b.len() as u64,
                })
                .collect(),
            total_weight: 1.0,
            lr: 0.1,
            samples_committed: samples,
            remote: vec![],
        }
    }

    /// `optim.max_steps` ends the run at that step exactly, however many epochs that takes (here 8 samples in
    /// batches of 2 over 1 epoch would be 4 steps).
    #[test]
    fn max_steps_wins_over_the_epochs() {
        let settings = LoaderSettings { batch_size: 2, seed: 1, bucket_batches: 2, pack: None };
        let mut s = Schedule::new(vec![10; 8], settings, 1, 1, 10);
        for expected in 0..10 {
            let (step, items) = s.open_step(&[(0, 1)]).expect("a step under max_steps");
            assert_eq!(step, expected);
            let b = batches(&items, 0);
            s.take_report(report(step, 0, &[(0, b)], 2 * (step + 1)));
        }
        assert!(s.open_step(&[(0, 1)]).is_none() && s.finished(), "ends at max_steps");
        assert_eq!(s.committed_step(), 10);
        assert!(s.epoch() >= 2, "the epochs looped: epoch {}", s.epoch());
    }

    #[test]
    fn a_round_commits_what_it_took_and_requeues_the_rest() {
        let mut s = schedule(8, 1);
        let (step, items) = s.open_step(&[(0, 1), (1, 1)]).unwrap();
        let (a, b) = (batches(&items, 0), batches(&items, 1));
        // Drafter 1 failed before contributing: its batch goes back, and comes out first next time.
        let settled = s.take_report(report(step, 0, &[(0, a.clone())], 2));
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].committed.iter().map(|b| b.id).collect::<Vec<_>>(), a);
        assert_eq!(settled[0].requeued_samples, 2);
        let (_, items) = s.open_step(&[(0, 1)]).unwrap();
        assert_eq!(batches(&items, 0), b);
        assert_eq!(s.committed_step(), 1);
    }

    #[test]
    fn a_contribution_of_a_drafter_flagged_failed_still_counts_once() {
        let mut s = schedule(8, 1);
        let (step, items) = s.open_step(&[(0, 1), (1, 1)]).unwrap();
        s.note_failure(&batches(&items, 1));
        let all: Vec<_> = [batches(&items, 0), batches(&items, 1)].concat();
        let settled = s.take_report(report(step, 0, &[(0, batches(&items, 0)), (1, batches(&items, 1))], 4));
        assert_eq!(settled[0].committed.len(), 2);
        assert_eq!(settled[0].requeued_samples, 0);
        assert!(all.iter().all(|b| s.failures_of(*b) == 0));
    }

    #[test]
    fn early_reports_wait_and_old_incarnations_are_ignored() {
        let mut s = schedule(16, 1);
        let (s0, i0) = s.open_step(&[(0, 1)]).unwrap();
        let (s1, i1) = s.open_step(&[(0, 1)]).unwrap();
        assert!(s.take_report(report(s1, 0, &[(0, batches(&i1, 0))], 4)).is_empty(), "step 0 is missing");
        let settled = s.take_report(report(s0, 0, &[(0, batches(&i0, 0))], 2));
        assert_eq!(settled.iter().map(|x| x.step).collect::<Vec<_>>(), vec![0, 1]);
        s.restore(&Position { step: 1, samples_committed: 2, loader: None, set_aside: vec![] }, 1);
        assert!(s.take_report(report(1, 0, &[], 4)).is_empty(), "a report from before the rewind");
        assert_eq!((s.committed_step(), s.samples_committed()), (1, 2));
    }

    #[test]
    fn a_batch_running_in_two_failures_is_set_aside_when_its_round_settles() {
        let mut s = schedule(8, 2);
        let (step, items) = s.open_step(&[(0, 1)]).unwrap();
        let mine = batches(&items, 0);
        s.note_failure(&mine[..1]);
        s.note_failure(&mine[..1]);
        s.note_failure(&mine[1..]);
        let settled = s.take_report(report(step, 0, &[], 0));
        assert_eq!(settled[0].set_aside.iter().map(|b| b.id).collect::<Vec<_>>(), vec![mine[0]]);
        assert_eq!(settled[0].requeued_samples, 2, "the batch that failed once is handed out again");
        assert_eq!(s.set_aside(), &[mine[0]]);
    }

    /// A follower hands out only what it was fed: a drafter not live when its step opened takes its items when it
    /// joins, one given fewer than `accumulation` gets empty slots, and nothing comes from its own loader.
    #[test]
    fn a_follower_hands_out_only_what_it_was_fed() {
        let mut s = schedule(8, 2);
        s.follow();
        s.restore(&Position { step: 5, samples_committed: 0, loader: None, set_aside: vec![] }, 1);
        let b = |o| BatchId { epoch: 0, ordinal: o };
        let capture = |o| Item::Capture { batch: b(o), positions: vec![o as usize % 8] };
        let fed = vec![(0, capture(10)), (1, capture(11)), (1, capture(12))];
        let items = s.open_fed_step(&[(0, 1)], fed);
        assert_eq!(items, vec![(0, 1, capture(10)), (0, 1, Item::Empty)]);
        assert_eq!(s.assign(5, 1, 1), vec![capture(11), capture(12)], "drafter 1 joins and takes its items");
        assert_eq!(s.assign(5, 1, 2), vec![Item::Empty, Item::Empty], "its next thread finds them taken");
        let settled = s.take_report(report(5, 1, &[(0, vec![b(10)]), (1, vec![b(11)])], 4));
        assert_eq!(settled[0].committed.iter().map(|x| x.id).collect::<Vec<_>>(), vec![b(10), b(11)]);
        assert_eq!(settled[0].requeued_samples, 0, "what no round took goes back to the assigning host, not here");
        assert_eq!(s.loader_state().owed, vec![], "its own loader handed out nothing");
        assert!(s.data_left() && !s.finished());
        assert_eq!(s.epoch(), 0);
        let next = BatchId { epoch: 3, ordinal: 0 };
        s.open_fed_step(&[(0, 1)], vec![(0, Item::Capture { batch: next, positions: vec![1] })]);
        s.take_report(report(6, 1, &[(0, vec![next])], 5));
        assert_eq!(s.epoch(), 3, "the epoch of what it trained, not its idle loader's 0");
    }

    #[test]
    fn a_batch_set_aside_now_leaves_an_empty_slot() {
        let mut s = schedule(8, 1);
        let (step, items) = s.open_step(&[(0, 1)]).unwrap();
        let b = batches(&items, 0)[0];
        assert_eq!(s.set_aside_now(b).map(|x| x.id), Some(b));
        let settled = s.take_report(report(step, 0, &[(0, vec![])], 0));
        assert_eq!((settled[0].requeued_samples, settled[0].committed.len()), (0, 0));
        assert_eq!(s.loader_state().owed, vec![], "neither owed nor handed out again");
    }

    /// The target delivered a batch's features, then failed and was blamed for it a second time before its
    /// delivery was heard of: the batch is set aside, but the drafter trains it, and its round commits it.
    #[test]
    fn a_batch_set_aside_after_its_features_were_delivered_is_committed_by_its_round() {
        let mut s = schedule(8, 1);
        let (step, items) = s.open_step(&[(0, 1)]).unwrap();
        let b = batches(&items, 0)[0];
        assert!(s.set_aside_now(b).is_some());
        let settled = s.take_report(report(step, 0, &[(0, vec![b])], 2));
        assert_eq!(settled[0].committed.iter().map(|x| x.id).collect::<Vec<_>>(), vec![b]);
        assert_eq!(s.set_aside(), &[] as &[BatchId], "trained, so not aside");
        assert_eq!(s.loader_state().owed, vec![], "neither owed nor handed out again");
    }
}
