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

/// The lengths of synthetic rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticLengths {
    /// Every row `data.max_len` tokens, all supervised.
    Full,
    /// Lengths drawn like regenerated chat data's (most under 1,500 tokens, a tail cut at `data.max_len`), the
    /// first quarter of each row (the prompt) unsupervised.
    Chat,
}

/// `count` rows of random tokens below `vocab` (minus a margin for special tokens): each `max_len` long and all
/// supervised, or (chat) of lengths drawn like regenerated chat data's, their first quarter unsupervised.
pub struct SyntheticData {
    rows: Vec<TokenRow>,
}

impl SyntheticData {
    pub fn new(count: usize, max_len: usize, lengths: SyntheticLengths, vocab: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let top = vocab.saturating_sub(2).max(1) as i64;
        let rows = (0..count)
            .map(|id| {
                let (len, prompt) = match lengths {
                    SyntheticLengths::Full => (max_len, 0),
                    SyntheticLengths::Chat => {
                        let len = chat_length(&mut rng, max_len);
                        (len, len / 4)
                    }
                };
                TokenRow {
                    id: SampleId::Number(id as u64),
                    input_ids: (0..len).map(|_| rng.random_range(0..top)).collect(),
                    loss_mask: (0..len).map(|i| u8::from(i >= prompt)).collect(),
                }
            })
            .collect();
        SyntheticData { rows }
    }
}

/// A conversation's length in tokens, drawn like regenerated chat data's: log-normal with a median of 800 tokens
/// (85% under 1,500, 1.3% past 3,072), at least 64, cut at `max_len`.
fn chat_length(rng: &mut impl Rng, max_len: usize) -> usize {
    let normal = rand_distr::Normal::new(800f64.ln(), 0.6).expect("a positive standard deviation");
    let len = rng.sample(normal).exp().round() as usize;
    len.clamp(64.min(max_len), max_len)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Chat lengths: most rows under 1,500 tokens, a tail cut at `max_len`, none under 64; the prompt quarter
    /// unsupervised. Full rows: every one `max_len` long and supervised.
    #[test]
    fn synthetic_chat_rows_have_chat_lengths_and_full_rows_do_not() {
        let chat = SyntheticData::new(4000, 3072, SyntheticLengths::Chat, 1000, 7);
        let mut lengths = chat.lengths();
        lengths.sort();
        let median = lengths[lengths.len() / 2];
        assert!((700..=900).contains(&median), "median {median}");
        let under = lengths.iter().filter(|&&l| l < 1500).count() as f64 / lengths.len() as f64;
        assert!((0.8..0.9).contains(&under), "{under} under 1,500");
        let cut = lengths.iter().filter(|&&l| l == 3072).count();
        assert!(cut > 10, "a tail cut at max_len: {cut} rows");
        assert!(lengths[0] >= 64);
        let row = chat.row(0);
        let prompt = row.input_ids.len() / 4;
        assert!(row.loss_mask[..prompt].iter().all(|&m| m == 0) && row.loss_mask[prompt..].iter().all(|&m| m == 1));

        let full = SyntheticData::new(10, 768, SyntheticLengths::Full, 1000, 7);
        assert!(full.lengths().iter().all(|&l| l == 768));
        assert!(full.row(3).loss_mask.iter().all(|&m| m == 1));
        // Short max_len: every chat row fits.
        let short = SyntheticData::new(100, 48, SyntheticLengths::Chat, 1000, 7);
        assert!(short.lengths().iter().all(|&l| l == 48));
    }
}
