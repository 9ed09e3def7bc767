//! The one rule by which a token is chosen from logits without sampling: the largest logit, the lowest token id among
//! equal ones. Greedy decoding, verification, the drafter's proposals, generation, the teacher-forced acceptance and
//! the evaluation's top-2 gap all call [`greedy_tokens`], so two of them can only disagree where their logits
//! differ. bf16 logits tie exactly often enough (a 49k vocabulary in 8 bits of mantissa) that two rules breaking ties
//! differently made half of a real model's greedy tokens look like drafter errors.
//!
//! libtorch's `argmax` returns the first maximal index on the CPU and on CUDA alike (its reductions combine equal
//! values by the lower index); the tests below pin that, since the whole verdict of `eval --decode` rests on it.
use tch::{Kind, Tensor};

use super::ModelError;

/// The chosen token of each row of `logits` `[..., vocab]`: the largest logit, the lowest id among equals. The shape
/// drops the last dimension; on the logits' device (a CUDA graph may capture it).
pub fn greedy_tokens(logits: &Tensor) -> Result<Tensor, ModelError> {
    Ok(logits.f_argmax(-1, false)?)
}

/// [`greedy_tokens`] of every row, read back as ids.
pub fn greedy_token_ids(logits: &Tensor) -> Result<Vec<i64>, ModelError> {
    Ok(Vec::try_from(greedy_tokens(logits)?.f_flatten(0, -1)?)?)
}

/// A token chosen from one position's logits, and how close the choice was.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub token: i64,
    /// The largest logit (f32).
    pub top: f32,
    /// The largest logit minus the next largest: 0.0 at an exact tie, infinite with a single entry.
    pub gap: f32,
}

/// [`greedy_tokens`] of one position's logits `[vocab]`, with its [`Choice::gap`].
pub fn greedy_choice(logits: &Tensor) -> Result<Choice, ModelError> {
    let token = greedy_tokens(logits)?.f_int64_value(&[])?;
    let k = logits.size().last().copied().unwrap_or(0).min(2);
    let best: Vec<f32> = Vec::try_from(logits.f_topk(k, -1, true, true)?.0.f_to_kind(Kind::Float)?)?;
    let top = best.first().copied().unwrap_or(f32::NAN);
    Ok(Choice { token, top, gap: top - best.get(1).copied().unwrap_or(f32::NEG_INFINITY) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Rows of a 49,152-token vocabulary (the real model's) with exact ties placed far apart, in reverse order and
    /// inside one reduction chunk: every row's choice is the lowest tied id.
    fn ties_resolve_to_the_lowest_id_on(device: Device) {
        let vocab = 49_152;
        let tied: [&[i64]; 5] = [&[7, 40_000], &[40_000, 7], &[0, 1, 2, 3], &[49_151, 12_288, 30_001], &[511, 512]];
        for kind in [Kind::Float, Kind::BFloat16] {
            let logits = Tensor::randn([tied.len() as i64, vocab], (Kind::Float, device)).f_to_kind(kind).unwrap();
            for (row, ids) in tied.iter().enumerate() {
                let index = Tensor::from_slice(ids).to(device);
                let _ = logits.get(row as i64).index_fill_(0, &index, 9.5);
            }
            let lowest: Vec<i64> = tied.iter().map(|ids| *ids.iter().min().unwrap()).collect();
            assert_eq!(greedy_token_ids(&logits).unwrap(), lowest, "{kind:?} on {device:?}");
            // Batched ([1, rows, vocab], as verification reads them) and one row at a time (as greedy steps) agree.
            assert_eq!(greedy_token_ids(&logits.unsqueeze(0)).unwrap(), lowest);
            for (row, want) in lowest.iter().enumerate() {
                let choice = greedy_choice(&logits.get(row as i64)).unwrap();
                assert_eq!((choice.token, choice.top, choice.gap), (*want, 9.5, 0.0), "{kind:?} row {row}");
            }
        }
    }

    #[test]
    fn exact_ties_resolve_to_the_lowest_id_in_f32_and_bf16() {
        ties_resolve_to_the_lowest_id_on(Device::Cpu);
    }

    /// On a GPU: the same rule, on CUDA's reduction kernels.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_exact_ties_resolve_to_the_lowest_id() {
        crate::device::gpu_for_tests();
        ties_resolve_to_the_lowest_id_on(Device::Cuda(0));
    }

    #[test]
    fn the_gap_is_top_one_minus_top_two() {
        let logits = Tensor::from_slice(&[1.0f32, 4.0, 2.5, -3.0]);
        assert_eq!(greedy_choice(&logits).unwrap(), Choice { token: 1, top: 4.0, gap: 1.5 });
        let single = Choice { token: 0, top: 2.0, gap: f32::INFINITY };
        assert_eq!(greedy_choice(&Tensor::from_slice(&[2.0f32])).unwrap(), single);
    }
}
