//! What training reads samples from: a prepared split (memory-mapped) or synthetic rows (random tokens, every
//! token supervised) for benchmarking the service at real shapes without a tokenizer.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::SampleId;
use super::shards::PreparedSplit;
use super::token_rows::TokenRow;

pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Token counts, by position.
    fn lengths(&self) -> Vec<usize>;
    /// The sample at `position`.
    fn row(&self, position: usize) -> TokenRow;
    /// The id of the sample at `position`.
    fn id(&self, position: usize) -> SampleId;
}

impl Dataset for PreparedSplit {
    fn len(&self) -> usize {
        PreparedSplit::len(self)
    }
    fn lengths(&self) -> Vec<usize> {
        PreparedSplit::lengths(self)
    }
    fn row(&self, position: usize) -> TokenRow {
        let s = self.get(position);
        TokenRow { id: s.id.clone(), input_ids: s.input_ids(), loss_mask: s.loss_mask.to_vec() }
    }
    fn id(&self, position: usize) -> SampleId {
        PreparedSplit::id(self, position).clone()
    }
}

/// `count` rows of `len` random tokens below `vocab` (minus a margin for special tokens), all supervised.
pub struct SyntheticData {
    rows: Vec<TokenRow>,
}

impl SyntheticData {
    pub fn new(count: usize, len: usize, vocab: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let top = vocab.saturating_sub(2).max(1) as i64;
        let rows = (0..count)
            .map(|id| TokenRow {
                id: SampleId::Number(id as u64),
                input_ids: (0..len).map(|_| rng.random_range(0..top)).collect(),
                loss_mask: vec![1; len],
            })
            .collect();
        SyntheticData { rows }
    }
}

impl Dataset for SyntheticData {
    fn len(&self) -> usize {
        self.rows.len()
    }
    fn lengths(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.input_ids.len()).collect()
    }
    fn row(&self, position: usize) -> TokenRow {
        self.rows[position].clone()
    }
    fn id(&self, position: usize) -> SampleId {
        self.rows[position].id.clone()
    }
}
