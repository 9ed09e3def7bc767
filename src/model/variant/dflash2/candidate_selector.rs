//! DFlash 2's top-K candidate selector (issue 49): the drafter's own logits (the "unary" scores) propose each slot's
//! K likeliest tokens, and a low-rank bilinear term rescores each candidate given the token chosen before it:
//! `score(c | p, h) = unary[c] + <A[p] * (W_h h), B[c]>`, with `A` (`predecessor_codebook`) and `B`
//! (`successor_codebook`) one row of rank `r` per vocabulary token and `W_h` (`hidden_projection`) the slot's hidden
//! state projected to rank `r`. Training teaches it with a K-way cross-entropy on the teacher-forced previous token;
//! where the target's token is not among the K, it takes the K-th candidate's place (speculators' rule; NeMo drops
//! such slots instead). As speculators 0.9.0 computes it (`models/dflash2/metrics.py: selector_training_candidates`,
//! `model_definitions.py: CandidateSelector`); tch operations only, so autograd differentiates it.
use tch::{Kind, Tensor};

use crate::model::ModelError;

/// The selector's sizes: the `rank` of its codebooks and the `top_k` unary candidates it rescores per slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectorShape {
    pub rank: usize,
    pub top_k: usize,
}

/// The K candidates a slot trains with: the unary top-K `candidates [N, K]`, the target `targets [N]` put in the last
/// place where it is missing. Returns the training candidates `[N, K]`, the target's place among them `[N]` and
/// whether the unary top-K held it `[N]` (what serving can reach).
pub fn training_candidates(candidates: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor, Tensor), ModelError> {
    let k = candidates.size().last().copied().unwrap_or(0);
    if k < 1 {
        return Err(ModelError::Batch("the selector needs at least one candidate per slot".into()));
    }
    let matches = candidates.f_eq_tensor(&targets.f_unsqueeze(-1)?)?;
    let contains = matches.f_any_dim(-1, false)?;
    let last = Tensor::f_full_like(&targets.f_to_kind(Kind::Int64)?, k - 1)?;
    let place = matches.f_to_kind(Kind::Int64)?.f_argmax(-1, false)?.f_where_self(&contains, &last)?;
    let last_candidate = candidates.f_select(-1, k - 1)?.f_where_self(&contains, targets)?;
    let ids = Tensor::f_cat(&[candidates.f_narrow(-1, 0, k - 1)?, last_candidate.f_unsqueeze(-1)?], -1)?;
    Ok((ids, place, contains))
}

/// The selector's weights: `predecessor_codebook` and `successor_codebook` `[V, r]`, `hidden_projection` `[r, H]`.
pub struct SelectorWeights<'a> {
    pub predecessor_codebook: &'a Tensor,
    pub successor_codebook: &'a Tensor,
    pub hidden_projection: &'a Tensor,
}

/// [`SelectorWeights`] owned (a drafter's, in its compute dtype).
pub struct SelectorTensors {
    pub predecessor_codebook: Tensor,
    pub successor_codebook: Tensor,
    pub hidden_projection: Tensor,
}

impl SelectorTensors {
    pub fn borrowed(&self) -> SelectorWeights<'_> {
        SelectorWeights {
            predecessor_codebook: &self.predecessor_codebook,
            successor_codebook: &self.successor_codebook,
            hidden_projection: &self.hidden_projection,
        }
    }
}

/// The scores of `candidates [N, K]` at slots whose unary logits are `unary [N, V]`, hidden states `hidden [N, H]`
/// and previous tokens `predecessors [N]`: `unary[c] + <A[p] * (W_h h), B[c]>`, `[N, K]` in the unary logits' dtype.
pub fn candidate_scores(
    unary: &Tensor,
    hidden: &Tensor,
    predecessors: &Tensor,
    candidates: &Tensor,
    w: &SelectorWeights,
) -> Result<Tensor, ModelError> {
    let transitions = transition_scores(hidden, &predecessors.f_unsqueeze(1)?, candidates, w)?.f_squeeze_dim(1)?;
    Ok(unary.f_gather(-1, candidates, false)? + transitions.f_to_kind(unary.kind())?)
}

/// The low-rank term of [`candidate_scores`] alone, `<A[p] * (W_h h), B[c]>`, for each slot's candidates
/// `candidates [N, K]` after each of its predecessors `predecessors [N, P]` (one in training; every candidate of the
/// slot before in [`greedy_path`]): `[N, P, K]` in the codebooks' dtype.
pub fn transition_scores(
    hidden: &Tensor,
    predecessors: &Tensor,
    candidates: &Tensor,
    w: &SelectorWeights,
) -> Result<Tensor, ModelError> {
    let n = candidates.size()[0];
    let rows = |codebook: &Tensor, ids: &Tensor| -> Result<Tensor, ModelError> {
        Ok(codebook.f_index_select(0, &ids.f_reshape([-1])?)?.f_view([n, ids.size()[1], -1])?)
    };
    let predecessor = rows(w.predecessor_codebook, predecessors)?;
    let projected = hidden.f_linear(w.hidden_projection, None::<Tensor>)?.f_to_kind(predecessor.kind())?;
    let context = predecessor * projected.f_unsqueeze(1)?;
    let transposed = rows(w.successor_codebook, candidates)?.f_matmul(&context.f_transpose(1, 2)?)?;
    Ok(transposed.f_transpose(1, 2)?)
}

/// The drafted tokens of one block at temperature 0, as vLLM walks them (`spec_decode/dflash2/speculator.py`): at each
/// of the `S` slots with unary logits `unary [S, V]` and hidden states `hidden [S, H]`, the `top_k` likeliest unary
/// tokens rescored given the token chosen before (the verified anchor `anchor [1]` before the first), the best
/// kept. Returns `[S]` int64, on the device, without waiting for it.
///
/// As vLLM (`qwen3_dflash2.py: _score_edges_reference`) it scores every edge at once, each slot's K candidates given
/// each of the K candidates before it (`[S, K, K]`, the unary part in f32), so the walk itself is one small gather a
/// slot: a drafting pass launches about `S + 10` kernels here, not ten a slot.
pub fn greedy_path(
    unary: &Tensor,
    hidden: &Tensor,
    anchor: &Tensor,
    top_k: i64,
    w: &SelectorWeights,
) -> Result<Tensor, ModelError> {
    let slots = unary.size()[0];
    let candidates = unary.f_topk(top_k, -1, true, true)?.1;
    let edges = edge_scores(unary, hidden, anchor, &candidates, w)?;
    // Each predecessor's best successor at each slot, then the walk from the anchor (every row of slot 0's edges).
    let best = edges.f_argmax(-1, false)?;
    let mut previous = Tensor::f_zeros([1], (Kind::Int64, unary.device()))?;
    let mut chosen = Vec::with_capacity(slots as usize);
    for s in 0..slots {
        previous = best.f_select(0, s)?.f_index_select(0, &previous)?;
        chosen.push(previous.shallow_clone());
    }
    Ok(candidates.f_gather(1, &Tensor::f_stack(&chosen, 0)?, false)?.f_view([slots])?)
}

/// The score of every edge of a block's walk: `[S, K, K]`, entry `[s, p, c]` the score of slot `s`'s candidate `c`
/// after the candidate `p` of slot `s - 1` (after `anchor [1]` for every `p` at slot 0), in f32.
fn edge_scores(
    unary: &Tensor,
    hidden: &Tensor,
    anchor: &Tensor,
    candidates: &Tensor,
    w: &SelectorWeights,
) -> Result<Tensor, ModelError> {
    let (slots, k) = (candidates.size()[0], candidates.size()[1]);
    let first = anchor.f_view([1, 1])?.f_expand([1, k], false)?;
    let predecessors = Tensor::f_cat(&[first, candidates.f_narrow(0, 0, slots - 1)?], 0)?;
    let transitions = transition_scores(hidden, &predecessors, candidates, w)?;
    let unary = unary.f_gather(-1, candidates, false)?.f_to_kind(Kind::Float)?;
    Ok(unary.f_unsqueeze(1)? + transitions.f_to_kind(Kind::Float)?)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;
    use crate::model::reference_fixture;

    /// speculators 0.9.0's candidates, scores, summed K-way cross-entropy and every gradient
    /// (`scripts/fixtures/make_dflash2_fixtures.py`), in f64: 8 slots, 50 tokens, rank 8, K = 4, half the targets outside the
    /// unary top-K.
    #[test]
    fn selector_matches_speculators() {
        let fixture = reference_fixture::read("dflash2-selector-speculators-0.9.0.json");
        let case = &fixture["selector"];
        let dim = |k: &str| case["shape"][k].as_i64().unwrap();
        let (n, v, h, r, k) = (dim("slots"), dim("vocab"), dim("hidden"), dim("rank"), dim("top_k"));
        let floats = |key: &str, shape: &[i64]| reference_fixture::floats(case, key, shape);
        let ints = |key: &str| reference_fixture::ints(case, key);
        let unary = floats("unary", &[n, v]).set_requires_grad(true);
        let hidden = floats("states", &[n, h]).set_requires_grad(true);
        let a = floats("predecessor_codebook", &[v, r]).set_requires_grad(true);
        let b = floats("successor_codebook", &[v, r]).set_requires_grad(true);
        let w_h = floats("hidden_projection", &[r, h]).set_requires_grad(true);
        let top = unary.topk(k, -1, true, true).1;
        let (ids, place, contains) = training_candidates(&top, &ints("targets")).unwrap();
        assert_eq!(Vec::<i64>::try_from(&ids.view([-1])).unwrap(), Vec::<i64>::try_from(&ints("candidates")).unwrap());
        assert_eq!(Vec::<i64>::try_from(&place).unwrap(), Vec::<i64>::try_from(&ints("positions")).unwrap());
        assert_eq!(
            Vec::<i64>::try_from(&contains.to_kind(Kind::Int64)).unwrap(),
            Vec::<i64>::try_from(&ints("contains")).unwrap()
        );
        let weights = SelectorWeights { predecessor_codebook: &a, successor_codebook: &b, hidden_projection: &w_h };
        let scores = candidate_scores(&unary, &hidden, &ints("predecessors"), &ids, &weights).unwrap();
        let close = |x: &Tensor, y: &Tensor, what: &str| reference_fixture::assert_close(x, y, 1e-10, what);
        close(&scores, &floats("scores", &[n, k]), "scores");
        let loss = scores.cross_entropy_loss::<Tensor>(&place, None, tch::Reduction::Sum, -100, 0.0);
        assert!((loss.double_value(&[]) - case["loss"].as_f64().unwrap()).abs() < 1e-10);
        loss.backward();
        close(&unary.grad(), &floats("grad_unary", &[n, v]), "the unary logits' gradient");
        close(&hidden.grad(), &floats("grad_states", &[n, h]), "the hidden states' gradient");
        close(&a.grad(), &floats("grad_predecessor_codebook", &[v, r]), "the predecessor codebook's gradient");
        close(&b.grad(), &floats("grad_successor_codebook", &[v, r]), "the successor codebook's gradient");
        close(&w_h.grad(), &floats("grad_hidden_projection", &[r, h]), "the hidden projection's gradient");
    }

    /// The walk keeps the best rescored candidate given the token it chose before: a transition term that favours
    /// a unary runner-up after the anchor changes the first choice, and the second follows from it; with zero
    /// codebooks it is the unary argmax at every slot (DFlash's draft).
    #[test]
    fn the_walk_rescores_each_slot_given_the_token_chosen_before() {
        let t = |v: &[f64], shape: &[i64]| Tensor::from_slice(v).view(shape);
        // 4 tokens, K = 2, rank 1, hidden 1 (h = 1, W_h = 1).
        let unary = t(&[0.0, 1.0, 0.9, -5.0, 0.5, 0.0, 0.0, 0.6], &[2, 4]);
        let hidden = t(&[1.0, 1.0], &[2, 1]);
        let w_h = t(&[1.0], &[1, 1]);
        // A[anchor 0] = 1, A[1] = 1, A[2] = -1; B[2] = 1 (after the anchor, 2 beats 1), B[0] = 1 (after 2 it loses to 3).
        let a = t(&[1.0, 1.0, -1.0, 0.0], &[4, 1]);
        let b = t(&[1.0, 0.0, 1.0, 0.0], &[4, 1]);
        let w = SelectorWeights { predecessor_codebook: &a, successor_codebook: &b, hidden_projection: &w_h };
        let anchor = Tensor::from_slice(&[0i64]);
        let path = greedy_path(&unary, &hidden, &anchor, 2, &w).unwrap();
        assert_eq!(Vec::<i64>::try_from(&path).unwrap(), [2, 3]);
        // Had it chosen 1 first (A[1] = 1), token 0 would have followed: each slot reads the choice before it.
        let after_one = candidate_scores(
            &unary.narrow(0, 1, 1),
            &hidden.narrow(0, 1, 1),
            &Tensor::from_slice(&[1i64]),
            &Tensor::from_slice(&[3i64, 0]).view([1, 2]),
            &w,
        )
        .unwrap();
        assert_eq!(after_one.argmax(-1, false).int64_value(&[0]), 1);
        let zero = Tensor::zeros([4, 1], (Kind::Double, Device::Cpu));
        let plain = SelectorWeights { predecessor_codebook: &zero, successor_codebook: &zero, hidden_projection: &w_h };
        let path = greedy_path(&unary, &hidden, &anchor, 2, &plain).unwrap();
        assert_eq!(Vec::<i64>::try_from(&path).unwrap(), Vec::<i64>::try_from(&unary.argmax(-1, false)).unwrap());
    }

    /// Scoring every edge at once walks the path that scoring each slot after the choice before it walks (in f64,
    /// where the two orders of summation agree to the last bits), on random selectors, over many blocks.
    #[test]
    fn the_walk_over_every_edge_is_the_walk_slot_by_slot() {
        let (v, h, r, k, slots) = (60, 12, 6, 5, 9);
        for seed in 0..40 {
            tch::manual_seed(seed);
            let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Double, Device::Cpu));
            let (unary, hidden) = (randn(&[slots, v]) * 2.0, randn(&[slots, h]));
            let (a, b, w_h) = (randn(&[v, r]), randn(&[v, r]), randn(&[r, h]));
            let w = SelectorWeights { predecessor_codebook: &a, successor_codebook: &b, hidden_projection: &w_h };
            let anchor = Tensor::from_slice(&[seed % v]);
            let candidates = unary.topk(k, -1, true, true).1;
            let mut previous = anchor.shallow_clone();
            let mut slot_by_slot = Vec::new();
            for s in 0..slots {
                let at = |t: &Tensor| t.narrow(0, s, 1);
                let scores = candidate_scores(&at(&unary), &at(&hidden), &previous, &at(&candidates), &w).unwrap();
                previous = at(&candidates).gather(-1, &scores.argmax(-1, true), false).view([1]);
                slot_by_slot.push(previous.int64_value(&[0]));
            }
            let path = greedy_path(&unary, &hidden, &anchor, k, &w).unwrap();
            assert_eq!(Vec::<i64>::try_from(&path).unwrap(), slot_by_slot, "seed {seed}");
        }
    }
}
