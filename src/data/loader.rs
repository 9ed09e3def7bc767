//! The exactly-once loader: per epoch, a seeded shuffle of the samples, cut into length-bucketed batches (samples of
//! similar length together, to pad little; with `data.pack`, rows of several samples packed once for the whole run
//! take the samples' place), in a shuffled batch order. A
//! ledger records what was handed out and what was committed: a batch whose drafter failed is requeued and handed
//! out again before new ones, so across epochs every sample is trained exactly once per epoch, and the position
//! (epoch, next batch, batches owed) saves into a checkpoint and restores the same order.
use std::collections::{BTreeSet, HashMap, VecDeque};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderSettings {
    /// Samples per batch (one drafter's micro-batch).
    pub batch_size: usize,
    pub seed: u64,
    /// Samples are sorted by length within windows of this many batches.
    pub bucket_batches: usize,
    /// `data.pack`: rows of several conversations, up to this many tokens each; `batch_size` then counts rows.
    pub pack: Option<usize>,
}

/// A batch: the epoch it belongs to and its place in that epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BatchId {
    pub epoch: u64,
    pub ordinal: u64,
}

impl std::fmt::Display for BatchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "batch {} of epoch {}", self.ordinal, self.epoch)
    }
}

/// Sample positions (into the prepared split) of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub id: BatchId,
    pub samples: Vec<usize>,
}

/// Where the loader stands, as a checkpoint records it (the default: a run's beginning).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    pub next_ordinal: u64,
    /// Batches handed out but not committed, and batches requeued: all are owed again after a restore.
    pub owed: Vec<BatchId>,
}

impl LoaderState {
    /// The position after `committed` (the batches rounds since this position trained) and nothing else: owed
    /// batches they trained are no longer owed; new batches handed out since (in order, up to the last one they
    /// trained) and not trained are owed; new batches start after that last one. Batches handed out later and
    /// not trained yet count as never handed out. How another host derives rank 0's position at a later step
    /// boundary from an earlier one and the rounds it took part in.
    pub fn advanced(&self, committed: &[BatchId], batches_per_epoch: usize) -> LoaderState {
        let per_epoch = batches_per_epoch.max(1) as u64;
        // Ordinal `ordinal` of `epoch`, or the next epoch's first batch past the epoch's end.
        let at = |epoch: u64, ordinal: u64| match ordinal >= per_epoch {
            true => BatchId { epoch: epoch + 1, ordinal: 0 },
            false => BatchId { epoch, ordinal },
        };
        let first_new = at(self.epoch, self.next_ordinal);
        let trained: BTreeSet<BatchId> = committed.iter().copied().collect();
        let mut owed: Vec<BatchId> = self.owed.iter().copied().filter(|b| !trained.contains(b)).collect();
        let Some(&last) = trained.range(first_new..).next_back() else {
            return LoaderState { owed, ..self.clone() };
        };
        let mut id = first_new;
        while id < last {
            if !trained.contains(&id) {
                owed.push(id);
            }
            id = at(id.epoch, id.ordinal + 1);
        }
        LoaderState { epoch: last.epoch, next_ordinal: last.ordinal + 1, owed }
    }
}

/// A stream's epochs (`data.stream`): epoch `k` is wave `k`'s samples (`waves[k]`, positions after the `base` data's
/// and the waves' before it) and replay: samples drawn without repeats from every position before the wave (the base
/// data and earlier waves), `mix / (1 - mix)` of the wave's count (as many as there are, at most), so that `mix` of
/// the epoch's samples are replay. Deterministic from the seed, the epoch and the waves' ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamEpochs {
    pub waves: Vec<std::ops::Range<usize>>,
    /// The share of each epoch's samples drawn from before its wave, in `[0, 1)`.
    pub mix: f64,
}

impl StreamEpochs {
    /// The positions of epoch `epoch`, or `None` before its wave has arrived.
    pub fn positions(&self, epoch: u64, seed: u64) -> Option<Vec<usize>> {
        let wave = self.waves.get(usize::try_from(epoch).ok()?)?.clone();
        let wanted = (wave.len() as f64 * self.mix / (1.0 - self.mix).max(1e-9)).round() as usize;
        let before = wave.start;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_57AE ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut replay = rand::seq::index::sample(&mut rng, before, wanted.min(before)).into_vec();
        replay.sort_unstable();
        Some(wave.chain(replay).collect())
    }
}

pub struct Loader {
    lengths: Vec<usize>,
    /// What a batch is made of: one sample each, or (packed) the samples of one row (of every epoch; a stream's
    /// epochs make their own).
    units: Vec<Vec<usize>>,
    /// `data.stream`: each epoch is a wave of new samples with replay from before it.
    stream: Option<StreamEpochs>,
    settings: LoaderSettings,
    epoch: u64,
    next_ordinal: u64,
    plans: HashMap<u64, Vec<Vec<usize>>>,
    requeued: VecDeque<BatchId>,
    outstanding: BTreeSet<BatchId>,
}

impl Loader {
    /// A loader over samples of the given token lengths, at the start of epoch 0.
    pub fn new(lengths: Vec<usize>, settings: LoaderSettings) -> Self {
        Self::restore(lengths, settings, LoaderState::default())
    }

    /// A loader continuing from a saved position.
    pub fn restore(lengths: Vec<usize>, settings: LoaderSettings, state: LoaderState) -> Self {
        let settings = LoaderSettings {
            batch_size: settings.batch_size.max(1),
            bucket_batches: settings.bucket_batches.max(1),
            ..settings
        };
        let units = match settings.pack {
            Some(capacity) => crate::data::packing::first_fit_decreasing(&lengths, capacity),
            None => (0..lengths.len()).map(|i| vec![i]).collect(),
        };
        Loader {
            lengths,
            units,
            stream: None,
            settings,
            epoch: state.epoch,
            next_ordinal: state.next_ordinal,
            plans: HashMap::new(),
            requeued: state.owed.into_iter().collect(),
            outstanding: BTreeSet::new(),
        }
    }

    /// A loader over a stream's waves (`data.stream`), from a saved position: epoch `k` trains wave `k` (positions
    /// `stream.waves[k]`) with replay drawn from the samples before it ([`StreamEpochs`]). `lengths` covers every
    /// position; an epoch whose wave has not arrived has no batches yet ([`Loader::ready`]).
    pub fn stream(lengths: Vec<usize>, settings: LoaderSettings, state: LoaderState, stream: StreamEpochs) -> Self {
        let mut loader = Self::restore(Vec::new(), settings, state);
        loader.lengths = lengths;
        loader.stream = Some(stream);
        loader
    }

    /// A stream's epochs, the waves known so far (`None`: not a stream).
    pub fn stream_epochs(&self) -> Option<&StreamEpochs> {
        self.stream.as_ref()
    }

    /// A stream's next wave arrived: samples of `lengths`, at the positions after every one known.
    pub fn add_wave(&mut self, lengths: &[usize]) {
        let start = self.lengths.len();
        self.lengths.extend_from_slice(lengths);
        if let Some(stream) = &mut self.stream {
            stream.waves.push(start..self.lengths.len());
        }
    }

    /// Batches of the current epoch (every epoch alike, but for a stream's).
    pub fn batches_per_epoch(&self) -> usize {
        self.batches_in(self.epoch)
    }

    /// Batches of epoch `epoch`: 0 for a stream's epoch whose wave has not arrived.
    fn batches_in(&self, epoch: u64) -> usize {
        if let Some(plan) = self.plans.get(&epoch) {
            return plan.len();
        }
        match &self.stream {
            None => self.units.len().div_ceil(self.settings.batch_size),
            Some(stream) => match stream.positions(epoch, self.settings.seed) {
                Some(positions) => self.units_of(&positions).len().div_ceil(self.settings.batch_size),
                None => 0,
            },
        }
    }

    /// Whether a batch can be handed out now: one owed, one left in this epoch, or the next epoch's (a stream's
    /// next wave may not have arrived).
    pub fn ready(&self) -> bool {
        if !self.requeued.is_empty() || (self.next_ordinal as usize) < self.batches_per_epoch() {
            return true;
        }
        match &self.stream {
            None => !self.lengths.is_empty(),
            Some(stream) => (self.epoch + 1..stream.waves.len() as u64).any(|e| self.batches_in(e) > 0),
        }
    }

    /// The units (a sample each, or packed rows) of `positions`.
    fn units_of(&self, positions: &[usize]) -> Vec<Vec<usize>> {
        match self.settings.pack {
            Some(capacity) => {
                let lengths: Vec<usize> = positions.iter().map(|&p| self.lengths[p]).collect();
                crate::data::packing::first_fit_decreasing(&lengths, capacity)
                    .into_iter()
                    .map(|row| row.into_iter().map(|i| positions[i]).collect())
                    .collect()
            }
            None => positions.iter().map(|&p| vec![p]).collect(),
        }
    }

    /// The epoch new batches come from.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch of the batch `next_batch` would hand out (an owed batch's, or a new one's).
    pub fn next_epoch(&self) -> Option<u64> {
        if self.lengths.is_empty() && self.stream.is_none() {
            return None;
        }
        Some(match self.requeued.front() {
            Some(id) => id.epoch,
            None if self.next_ordinal as usize >= self.batches_per_epoch() => self.epoch + 1,
            None => self.epoch,
        })
    }

    /// Samples per epoch.
    pub fn samples(&self) -> usize {
        self.lengths.len()
    }

    /// The order of one epoch: deterministic from the seed and the epoch.
    fn plan(&mut self, epoch: u64) -> &Vec<Vec<usize>> {
        let stream_units = match (&self.stream, self.plans.contains_key(&epoch)) {
            (Some(stream), false) => {
                Some(self.units_of(&stream.positions(epoch, self.settings.seed).unwrap_or_default()))
            }
            _ => None,
        };
        let (lengths, s) = (&self.lengths, self.settings);
        let units = stream_units.as_ref().unwrap_or(&self.units);
        self.plans.entry(epoch).or_insert_with(|| {
            let mut rng = ChaCha8Rng::seed_from_u64(s.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let tokens = |u: usize| -> usize { units[u].iter().map(|&i| lengths[i]).sum() };
            let mut order: Vec<usize> = (0..units.len()).collect();
            order.shuffle(&mut rng);
            let mut batches: Vec<Vec<usize>> = Vec::new();
            for window in order.chunks(s.batch_size * s.bucket_batches) {
                let mut window = window.to_vec();
                window.sort_by_key(|&u| std::cmp::Reverse(tokens(u)));
                batches.extend(window.chunks(s.batch_size).map(|b| b.iter().flat_map(|&u| units[u].clone()).collect()));
            }
            batches.shuffle(&mut rng);
            batches
        })
    }

    /// The next batch: an owed one first, else the next of the current epoch (moving to the next epoch when this
    /// one is all handed out). `None` only when there are no samples.
    pub fn next_batch(&mut self) -> Option<Batch> {
        // An owed batch of a stream's wave that now trains nothing (its folder could not be read: logged) goes with
        // it.
        while let Some(&id) = self.requeued.front() {
            if self.lengths.is_empty() || self.plan(id.epoch).get(id.ordinal as usize).is_some() {
                break;
            }
            self.requeued.pop_front();
        }
        if self.lengths.is_empty() || !self.ready() {
            return None;
        }
        let id = match self.requeued.pop_front() {
            Some(id) => id,
            None => {
                // The next epoch (a stream's next wave with batches: a wave held out whole has none).
                while self.next_ordinal as usize >= self.batches_per_epoch() {
                    self.plans.retain(|&e, _| e >= self.epoch);
                    self.epoch += 1;
                    self.next_ordinal = 0;
                }
                let id = BatchId { epoch: self.epoch, ordinal: self.next_ordinal };
                self.next_ordinal += 1;
                id
            }
        };
        self.outstanding.insert(id);
        let samples = self.plan(id.epoch)[id.ordinal as usize].clone();
        Some(Batch { id, samples })
    }

    /// The sample positions of batch `id` (any epoch's), as `next_batch` hands it out.
    pub fn batch(&mut self, id: BatchId) -> Option<Batch> {
        let samples = self.plan(id.epoch).get(id.ordinal as usize)?.clone();
        Some(Batch { id, samples })
    }

    /// The batch was trained: it is consumed.
    pub fn commit(&mut self, id: BatchId) {
        self.outstanding.remove(&id);
    }

    /// The batch was not trained (its drafter failed): it is owed and handed out again before new ones.
    pub fn requeue(&mut self, id: BatchId) {
        if self.outstanding.remove(&id) {
            self.requeued.push_back(id);
        }
    }

    /// The position to save: batches handed out but not committed count as owed.
    pub fn state(&self) -> LoaderState {
        let mut owed: Vec<BatchId> = self.requeued.iter().copied().collect();
        owed.extend(self.outstanding.iter().copied());
        LoaderState { epoch: self.epoch, next_ordinal: self.next_ordinal, owed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn settings(batch: usize) -> LoaderSettings {
        LoaderSettings { batch_size: batch, seed: 7, bucket_batches: 4, pack: None }
    }

    fn lengths(n: usize) -> Vec<usize> {
        (0..n).map(|i| 10 + (i * 37) % 200).collect()
    }

    #[test]
    fn every_sample_once_per_epoch_whatever_is_requeued() {
        let mut loader = Loader::new(lengths(103), settings(4));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut seen: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut in_flight: Vec<Batch> = Vec::new();
        for _ in 0..400 {
            in_flight.push(loader.next_batch().unwrap());
            if rng.random_bool(0.5) && !in_flight.is_empty() {
                let b = in_flight.swap_remove(rng.random_range(0..in_flight.len()));
                if rng.random_bool(0.3) {
                    loader.requeue(b.id);
                } else {
                    loader.commit(b.id);
                    seen.entry(b.id.epoch).or_default().extend(b.samples);
                }
            }
        }
        for b in in_flight.drain(..) {
            loader.commit(b.id);
            seen.entry(b.id.epoch).or_default().extend(b.samples);
        }
        // Finish the epochs that were started by draining what is still owed.
        while let Some(b) = loader.next_batch().filter(|b| b.id.epoch < loader.epoch()) {
            loader.commit(b.id);
            seen.entry(b.id.epoch).or_default().extend(b.samples);
        }
        let complete: Vec<u64> = (0..loader.epoch()).collect();
        assert!(complete.len() >= 3, "the test should cover several epochs");
        for e in complete {
            let mut samples = seen.remove(&e).unwrap_or_default();
            samples.sort_unstable();
            assert_eq!(samples, (0..103).collect::<Vec<_>>(), "epoch {e}");
        }
    }

    /// Packed, a batch is `batch_size` rows of conversations up to the capacity each; every sample once per epoch,
    /// and as many batches in every epoch.
    #[test]
    fn packed_batches_are_rows_of_conversations_every_sample_once() {
        let lengths = lengths(103);
        let mut loader = Loader::new(lengths.clone(), LoaderSettings { pack: Some(400), ..settings(2) });
        let per_epoch = loader.batches_per_epoch();
        assert!(per_epoch < 103 / 2, "{per_epoch} packed batches of 2 rows for 103 samples");
        for epoch in 0..3 {
            let mut seen = Vec::new();
            for _ in 0..per_epoch {
                let b = loader.next_batch().unwrap();
                assert_eq!(b.id.epoch, epoch);
                let rows = crate::data::packing::first_fit_decreasing(
                    &b.samples.iter().map(|&i| lengths[i]).collect::<Vec<_>>(),
                    400,
                );
                assert!(rows.len() <= 3, "a batch of two rows packs into at most a few: {rows:?}");
                loader.commit(b.id);
                seen.extend(b.samples);
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..103).collect::<Vec<_>>(), "epoch {epoch}");
        }
        let unpacked = Loader::new(lengths.clone(), settings(2));
        assert_eq!(unpacked.batches_per_epoch(), 52, "unpacked: a sample per row");
    }

    #[test]
    fn restoring_a_saved_position_replays_the_same_order() {
        let mut a = Loader::new(lengths(50), settings(3));
        let mut handed = Vec::new();
        for _ in 0..25 {
            handed.push(a.next_batch().unwrap());
        }
        // Commit most; one batch failed and one is still in flight when the checkpoint is taken.
        for b in &handed[..23] {
            a.commit(b.id);
        }
        a.requeue(handed[23].id);
        let state = a.state();
        assert_eq!(state.owed.len(), 2);
        let json = serde_json::to_string(&state).unwrap();
        let mut b = Loader::restore(lengths(50), settings(3), serde_json::from_str(&json).unwrap());
        let from_b: Vec<Batch> = (0..30).map(|_| b.next_batch().unwrap()).collect();
        // The owed batches come first, then the same sequence the original would hand out.
        assert_eq!(from_b[0].id, handed[23].id);
        assert_eq!(from_b[1].id, handed[24].id);
        assert_eq!(from_b[1].samples, handed[24].samples);
        let mut c = Loader::restore(lengths(50), settings(3), state);
        assert_eq!(from_b, (0..30).map(|_| c.next_batch().unwrap()).collect::<Vec<_>>());
        let expected: Vec<Batch> = (0..29).map(|_| a.next_batch().unwrap()).collect();
        assert_eq!(&from_b[2..], &expected[1..], "after the owed batches the order continues unchanged");
    }

    /// A position advanced by the rounds since equals the loader's own position after them, whatever was owed,
    /// handed out ahead, or trained across an epoch's end.
    #[test]
    fn a_position_advanced_by_the_rounds_since_is_the_loaders_own() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for _ in 0..200 {
            let mut loader = Loader::new(lengths(21), settings(4));
            let per_epoch = loader.batches_per_epoch();
            let mut in_flight: Vec<BatchId> = Vec::new();
            let mut since: Option<(LoaderState, Vec<BatchId>)> = None;
            for round in 0..rng.random_range(1..30) {
                while in_flight.len() < 4 {
                    in_flight.push(loader.next_batch().unwrap().id);
                }
                let mut trained = Vec::new();
                for _ in 0..rng.random_range(0..3) {
                    let b = in_flight.remove(rng.random_range(0..in_flight.len()));
                    if rng.random_bool(0.2) {
                        loader.requeue(b);
                    } else {
                        loader.commit(b);
                        trained.push(b);
                    }
                }
                match &mut since {
                    Some((_, all)) => all.extend(trained),
                    None if round >= 2 => since = Some((loader.state(), vec![])),
                    None => {}
                }
            }
            let Some((earlier, trained)) = since else { continue };
            let now = loader.state();
            let derived = earlier.advanced(&trained, per_epoch);
            // The same batches are owed or new; batches the loader handed out ahead count as new in the derived one.
            let next = |s: &LoaderState| {
                let mut l = Loader::restore(lengths(21), settings(4), s.clone());
                let mut ids: Vec<BatchId> = (0..2 * per_epoch).map(|_| l.next_batch().unwrap().id).collect();
                ids.sort_unstable();
                ids
            };
            assert_eq!(next(&derived), next(&now), "from {earlier:?} after {trained:?}: {derived:?} vs {now:?}");
        }
    }

    #[test]
    fn a_batch_is_found_by_its_id() {
        let mut a = Loader::new(lengths(30), settings(4));
        let handed: Vec<Batch> = (0..12).map(|_| a.next_batch().unwrap()).collect();
        let mut b = Loader::new(lengths(30), settings(4));
        for h in &handed {
            assert_eq!(b.batch(h.id).as_ref(), Some(h));
        }
        assert_eq!(b.batch(BatchId { epoch: 0, ordinal: 99 }), None);
    }

    #[test]
    fn batches_are_length_bucketed_and_epochs_differ() {
        let mut l = Loader::new(lengths(64), settings(8));
        let first: Vec<Batch> = (0..8).map(|_| l.next_batch().unwrap()).collect();
        let spread = |b: &Batch| {
            let ls: Vec<usize> = b.samples.iter().map(|&i| lengths(64)[i]).collect();
            ls.iter().max().unwrap() - ls.iter().min().unwrap()
        };
        let mean_spread: f64 = first.iter().map(|b| spread(b) as f64).sum::<f64>() / 8.0;
        assert!(mean_spread < 100.0, "buckets should group similar lengths: {mean_spread}");
        let second: Vec<Batch> = (0..8).map(|_| l.next_batch().unwrap()).collect();
        assert_eq!(second[0].id.epoch, 1);
        assert_ne!(
            first.iter().map(|b| b.samples.clone()).collect::<Vec<_>>(),
            second.iter().map(|b| b.samples.clone()).collect::<Vec<_>>()
        );
    }

    fn stream_loader(base: usize, mix: f64) -> Loader {
        Loader::stream(lengths(base), settings(4), LoaderState::default(), StreamEpochs { waves: vec![], mix })
    }

    /// Until a wave arrives there is nothing to hand out; each wave is an epoch of its samples, each once, and
    /// then the loader waits for the next.
    #[test]
    fn a_streams_epochs_are_its_waves_each_sample_once() {
        let mut loader = stream_loader(0, 0.0);
        assert!(!loader.ready() && loader.next_batch().is_none(), "no wave yet");
        for (wave, count) in [(0u64, 10usize), (1, 7)] {
            let start = loader.lengths.len();
            loader.add_wave(&lengths(count));
            assert!(loader.ready());
            let mut seen = Vec::new();
            while let Some(b) = loader.next_batch() {
                assert_eq!(b.id.epoch, wave);
                loader.commit(b.id);
                seen.extend(b.samples);
            }
            seen.sort_unstable();
            assert_eq!(seen, (start..start + count).collect::<Vec<_>>(), "wave {wave}");
            assert!(!loader.ready(), "waiting for the next wave");
        }
        // Owed batches of a wave that now trains nothing (its folder lost) go with it, and the loader waits.
        let owed = LoaderState { epoch: 0, next_ordinal: 3, owed: vec![BatchId { epoch: 0, ordinal: 1 }] };
        let empty = StreamEpochs { waves: std::iter::once(0..0).collect(), mix: 0.0 };
        let mut lost = Loader::stream(lengths(4), settings(4), owed, empty);
        assert!(lost.next_batch().is_none() && !lost.ready());
        // A wave with nothing to train (held out whole) is passed over.
        loader.add_wave(&[]);
        assert!(!loader.ready());
        loader.add_wave(&lengths(3));
        let b = loader.next_batch().unwrap();
        assert_eq!((b.id.epoch, b.samples.len()), (3, 3));
    }

    /// With `mix`, an epoch is its wave plus that share of replay from before it, without repeats, the same after a
    /// restore; a batch requeued while the loader waits is handed out again.
    #[test]
    fn a_streams_replay_comes_from_before_the_wave_and_restores_alike() {
        let mut loader = stream_loader(30, 0.5);
        loader.add_wave(&lengths(10));
        let first = loader.next_batch().unwrap();
        let saved = loader.state();
        let mut all = first.samples.clone();
        loader.commit(first.id);
        let mut last = None;
        while let Some(b) = loader.next_batch() {
            all.extend(b.samples.iter().copied());
            last = Some(b.id);
            loader.commit(b.id);
        }
        all.sort_unstable();
        let (new, replay): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&p| p >= 30);
        assert_eq!(new, (30..40).collect::<Vec<_>>());
        assert_eq!(replay.len(), 10, "half the epoch is replay");
        assert!(replay.windows(2).all(|w| w[0] < w[1]), "no repeats: {replay:?}");
        let mut restored = Loader::stream(
            lengths(40),
            settings(4),
            saved,
            StreamEpochs { waves: std::iter::once(30..40).collect(), mix: 0.5 },
        );
        // Saved with the first batch handed out and not committed: it is owed, and handed out again.
        let mut again: Vec<usize> = Vec::new();
        while let Some(b) = restored.next_batch() {
            again.extend(b.samples.iter().copied());
            restored.commit(b.id);
        }
        again.sort_unstable();
        assert_eq!(again, all, "the same epoch after a restore");
        // A batch that failed while the stream waits is owed: handed out again before the next wave's.
        let last = last.unwrap();
        loader.outstanding.insert(last);
        loader.requeue(last);
        assert!(loader.ready());
        assert_eq!(loader.next_batch().map(|b| b.id), Some(last));
    }
}
