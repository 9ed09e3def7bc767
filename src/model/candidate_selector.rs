//! DFlash 2's top-K candidate selector (issue 49): the drafter's own logits (the "unary" scores) propose each slot's
//! K likeliest tokens, and a low-rank bilinear term rescores each candidate given the token chosen before it:
//! `score(c | p, h) = unary[c] + <A[p] * (W_h h), B[c]>`, with `A` (`predecessor_codebook`) and `B`
//! (`successor_codebook`) one row of rank `r` per vocabulary token and `W_h` (`hidden_projection`) the slot's hidden
//! state projected to rank `r`. Training teaches it with a K-way cross-entropy on the teacher-forced previous token;
//! where the target's token is not among the K, it takes the K-th candidate's place (speculators' rule; NeMo drops
//! such slots instead). As speculators 0.9.0 computes it (`models/dflash2/metrics.py: selector_training_candidates`,
//! `model_definitions.py: CandidateSelector`); tch operations only, so autograd differentiates it.
use tch::{Kind, Tensor};

use super::ModelError;

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

/// The scores of `candidates [N, K]` at slots whose unary logits are `unary [N, V]`, hidden states `hidden [N, H]`
/// and previous tokens `predecessors [N]`: `unary[c] + <A[p] * (W_h h), B[c]>`, `[N, K]` in the unary logits' dtype.
pub fn candidate_scores(
    unary: &Tensor,
    hidden: &Tensor,
    predecessors: &Tensor,
    candidates: &Tensor,
    w: &SelectorWeights,
) -> Result<Tensor, ModelError> {
    let predecessor = w.predecessor_codebook.f_index_select(0, predecessors)?;
    let projected = hidden.f_linear(w.hidden_projection, None::<Tensor>)?.f_to_kind(predecessor.kind())?;
    let context = predecessor * projected;
    let (n, k) = (candidates.size()[0], candidates.size()[1]);
    let successors = w.successor_codebook.f_index_select(0, &candidates.f_reshape([-1])?)?.f_view([n, k, -1])?;
    let transitions = successors.f_matmul(&context.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?;
    Ok(unary.f_gather(-1, candidates, false)? + transitions.f_to_kind(unary.kind())?)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// speculators 0.9.0's candidates, scores, summed K-way cross-entropy and every gradient
    /// (`scripts/make_dflash2_fixtures.py`), in f64: 8 slots, 50 tokens, rank 8, K = 4, half the targets outside the
    /// unary top-K.
    #[test]
    fn selector_matches_speculators() {
        let path = format!("{}/tests/fixtures/dflash2-selector-speculators-0.9.0.json", env!("CARGO_MANIFEST_DIR"));
        let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let case = &fixture["selector"];
        let dim = |k: &str| case["shape"][k].as_i64().unwrap();
        let (n, v, h, r, k) = (dim("slots"), dim("vocab"), dim("hidden"), dim("rank"), dim("top_k"));
        let floats = |key: &str, shape: &[i64]| {
            let values: Vec<f64> = case[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            Tensor::from_slice(&values).view(shape).to_device(Device::Cpu)
        };
        let ints = |key: &str| {
            let values: Vec<i64> = case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().or(x.as_bool().map(i64::from)).unwrap())
                .collect();
            Tensor::from_slice(&values)
        };
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
        let close = |x: &Tensor, y: &Tensor, what: &str| {
            let err = (x - y).abs().max().double_value(&[]);
            assert!(err < 1e-10, "{what}: off by {err}");
        };
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
}
