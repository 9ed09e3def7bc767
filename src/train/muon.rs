//! Muon's plan over the drafter's flat layout: which matrices it updates, which of them are orthogonalised together
//! (matrices of one shape go through Newton-Schulz as one batch of matrix products: on a small drafter the launches of
//! 28 separate iterations, not their FLOPs, are Muon's cost), and how the orthogonalisation splits across data-parallel
//! drafters, each computing its share of the matrices and one all-gather of a bf16 buffer bringing every replica all
//! of them ([`MuonShards`]: the buffer's plan; the gather is the collective's). Each matrix is still orthogonalised on
//! its own, exactly as torch.optim.Muon 2.11 does it; only the launches are shared.
use std::collections::BTreeSet;
use std::ops::Range;

use tch::Tensor;

use crate::ffi::accel::{MuonStep, muon_apply, muon_orthogonalize};
use crate::model::ModelError;
use crate::model::flat_params::FlatLayout;

/// Published names of parameters that stay on AdamW even as matrices (speculators' rule: embeddings, codebooks,
/// output heads).
const ADAMW_NAME_HINTS: [&str; 5] = ["embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2"];

/// At most this many elements in one batch: its transient copies (the f32 updates and their bf16 stack) stay small,
/// and a matrix this large has FLOPs enough to keep the GPU busy on its own (the Qwen3-8B drafter's are 17-50M).
const BATCH_ELEMENTS: i64 = 1 << 24;

/// The parameters Muon updates: every 2-D published tensor with both dimensions above 1 that is not an embedding,
/// codebook or output head (speculators 0.9.0, `train/optimizers.py: split_named_params_for_muon`). Each is
/// orthogonalised on its own, also where the flat layout stacks several (q, k and v are three matrices).
pub fn muon_names(layout: &FlatLayout) -> BTreeSet<String> {
    MuonPlan::new(layout).names
}

/// Muon's step scaled to match AdamW's update RMS (torch.optim.Muon's `match_rms_adamw`, speculators' choice):
/// `lr * 0.2 * sqrt(max(rows, cols))`.
pub fn muon_adjusted_lr(lr: f64, shape: &[i64]) -> f64 {
    let largest = shape.iter().copied().max().unwrap_or(1) as f64;
    lr * 0.2 * largest.sqrt()
}

/// The FLOPs of one Newton-Schulz iteration of a `rows x cols` matrix (torch's: the Gram matrix of the short side,
/// its square, and the product back).
pub fn newton_schulz_flops(shape: [i64; 2]) -> f64 {
    let (short, long) = (shape[0].min(shape[1]) as f64, shape[0].max(shape[1]) as f64);
    2.0 * (2.0 * short * short * long + short * short * short)
}

/// One matrix Muon updates.
#[derive(Debug, Clone, PartialEq)]
struct Matrix {
    /// Its place in [`FlatLayout::named_views`].
    view: usize,
    shape: [i64; 2],
}

/// Which matrices Muon updates and how they are batched.
#[derive(Debug, Clone)]
pub struct MuonPlan {
    names: BTreeSet<String>,
    /// In the layout's order.
    matrices: Vec<Matrix>,
    batch_elements: i64,
}

/// The views one update works on, each in [`FlatLayout::named_views`]'s order.
pub(crate) struct MuonViews<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub momentum: &'a [Tensor],
}

impl MuonPlan {
    pub fn new(layout: &FlatLayout) -> Self {
        Self::with_batch_elements(layout, BATCH_ELEMENTS)
    }

    /// A plan whose batches hold at most `batch_elements` elements (a matrix larger than that is a batch alone).
    pub fn with_batch_elements(layout: &FlatLayout, batch_elements: i64) -> Self {
        let mut names = BTreeSet::new();
        let mut matrices = Vec::new();
        for (view, (name, shape)) in layout.named_shapes().into_iter().enumerate() {
            let is_matrix = shape.len() == 2 && shape.iter().all(|&d| d > 1);
            if is_matrix && !ADAMW_NAME_HINTS.iter().any(|h| name.contains(h)) {
                matrices.push(Matrix { view, shape: [shape[0], shape[1]] });
                names.insert(name);
            }
        }
        MuonPlan { names, matrices, batch_elements }
    }

    /// The published names of the matrices.
    pub fn names(&self) -> &BTreeSet<String> {
        &self.names
    }

    /// Whether the view at `index` of [`FlatLayout::named_views`] is one of Muon's.
    pub fn is_muon_view(&self, index: usize) -> bool {
        self.matrices.iter().any(|m| m.view == index)
    }

    /// The matrices `which` (indices into the plan) in batches of one shape, each within the element budget, in a
    /// fixed order (by shape, then by place in the layout).
    fn batches(&self, which: &[usize]) -> Vec<Vec<usize>> {
        let mut sorted = which.to_vec();
        sorted.sort_by_key(|&i| (self.matrices[i].shape, i));
        let mut batches: Vec<Vec<usize>> = Vec::new();
        let mut elements = 0;
        for i in sorted {
            let shape = self.matrices[i].shape;
            let size = shape[0] * shape[1];
            match batches.last_mut() {
                Some(b) if self.matrices[b[0]].shape == shape && elements + size <= self.batch_elements => {
                    b.push(i);
                    elements += size;
                }
                _ => {
                    batches.push(vec![i]);
                    elements = size;
                }
            }
        }
        batches
    }

    /// How `members` drafters share the orthogonalisation: the matrices dealt out largest first, each to the member
    /// with the fewest FLOPs so far (ties to the lower id), so every member's share is within one matrix of an
    /// equal split of the FLOPs; each member's matrices lie in its segment of the gather buffer in its batches' order.
    pub fn shards(&self, members: usize) -> MuonShards {
        let members = members.max(1);
        let mut order: Vec<usize> = (0..self.matrices.len()).collect();
        let flops = |i: usize| newton_schulz_flops(self.matrices[i].shape);
        order.sort_by(|&a, &b| flops(b).total_cmp(&flops(a)).then(a.cmp(&b)));
        let mut load = vec![0.0_f64; members];
        let mut share = vec![Vec::new(); members];
        for i in order {
            let member = (0..members).min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b))).unwrap_or(0);
            load[member] += flops(i);
            share[member].push(i);
        }
        let share: Vec<Vec<Vec<usize>>> = share.iter().map(|s| self.batches(s)).collect();
        let size = |i: usize| self.matrices[i].shape[0] * self.matrices[i].shape[1];
        let segment = share.iter().map(|b| b.iter().flatten().map(|&i| size(i)).sum::<i64>()).max().unwrap_or(0);
        let mut offset = vec![0; self.matrices.len()];
        for (member, batches) in share.iter().enumerate() {
            let mut at = member as i64 * segment;
            for &i in batches.iter().flatten() {
                offset[i] = at;
                at += size(i);
            }
        }
        MuonShards { segment, share, offset }
    }

    /// One Muon step of every matrix, on one drafter: momentum, orthogonalisation and the step, batch by batch.
    pub(crate) fn step(&self, views: &MuonViews, grad_divisor: f64, hp: MuonStep) -> Result<(), ModelError> {
        let all: Vec<usize> = (0..self.matrices.len()).collect();
        for batch in self.batches(&all) {
            let [grads, momentum, params] = self.pick(&batch, [views.grads, views.momentum, views.params]);
            if let Some(updates) = muon_orthogonalize(&grads, &momentum, grad_divisor, hp, true)? {
                let updates: Vec<Tensor> = (0..batch.len() as i64).map(|k| updates.select(0, k)).collect();
                muon_apply(&params, &updates, hp, self.adjusted_lr(&batch, hp))?;
            }
        }
        Ok(())
    }

    /// A data-parallel member's part of a step: the momentum of every matrix (every replica keeps all buffers), and
    /// the orthogonalised updates of `member`'s share written into its segment of `gathered` (bf16,
    /// [`MuonShards::gather_len`] elements). Nothing is stepped until [`MuonPlan::apply_gathered`].
    pub(crate) fn orthogonalize_share(
        &self,
        views: &MuonViews,
        grad_divisor: f64,
        hp: MuonStep,
        shards: &MuonShards,
        member: usize,
        gathered: &Tensor,
    ) -> Result<(), ModelError> {
        let Some(mine) = shards.share.get(member) else {
            return Err(ModelError::Torch(format!("Muon: no share {member} of {}", shards.share.len())));
        };
        let others: Vec<usize> =
            shards.share.iter().enumerate().filter(|&(m, _)| m != member).flat_map(|(_, b)| b.concat()).collect();
        for batch in self.batches(&others) {
            let [grads, momentum] = self.pick(&batch, [views.grads, views.momentum]);
            muon_orthogonalize(&grads, &momentum, grad_divisor, hp, false)?;
        }
        for batch in mine {
            let [grads, momentum] = self.pick(batch, [views.grads, views.momentum]);
            if let Some(updates) = muon_orthogonalize(&grads, &momentum, grad_divisor, hp, true)? {
                let shape = self.matrices[batch[0]].shape;
                let elements = batch.len() as i64 * shape[0] * shape[1];
                let mut slot = gathered.f_narrow(0, shards.offset[batch[0]], elements)?;
                tch::no_grad(|| slot.f_copy_(&updates.f_reshape([-1])?))?;
            }
        }
        Ok(())
    }

    /// Every matrix stepped by its orthogonalised update from `gathered` (every member's segment filled).
    pub(crate) fn apply_gathered(
        &self,
        views: &MuonViews,
        hp: MuonStep,
        shards: &MuonShards,
        gathered: &Tensor,
    ) -> Result<(), ModelError> {
        for batch in shards.share.iter().flatten() {
            let [params] = self.pick(batch, [views.params]);
            let updates = batch
                .iter()
                .map(|&i| {
                    let shape = self.matrices[i].shape;
                    gathered.f_narrow(0, shards.offset[i], shape[0] * shape[1])?.f_view(shape)
                })
                .collect::<Result<Vec<_>, _>>()?;
            muon_apply(&params, &updates, hp, self.adjusted_lr(batch, hp))?;
        }
        Ok(())
    }

    fn pick<const N: usize>(&self, batch: &[usize], lists: [&[Tensor]; N]) -> [Vec<Tensor>; N] {
        lists.map(|l| batch.iter().map(|&i| l[self.matrices[i].view].shallow_clone()).collect())
    }

    /// The step's rate for a batch (one shape, so one rate).
    fn adjusted_lr(&self, batch: &[usize], hp: MuonStep) -> f64 {
        muon_adjusted_lr(hp.lr, &self.matrices[batch[0]].shape)
    }
}

/// How data-parallel members share Muon's orthogonalisation, and the bf16 buffer that gathers their results: member
/// `m`'s matrices lie in segment `m`, every segment as long as the largest share (an all-gather's equal parts).
#[derive(Debug, Clone)]
pub struct MuonShards {
    segment: i64,
    /// Per member, its matrices (indices into the plan) in batches.
    share: Vec<Vec<Vec<usize>>>,
    /// Per matrix, where its update starts in the buffer.
    offset: Vec<i64>,
}

impl MuonShards {
    /// Elements of the gather buffer.
    pub fn gather_len(&self) -> i64 {
        self.segment * self.share.len() as i64
    }

    /// Member `member`'s segment of the gather buffer.
    pub fn segment(&self, member: usize) -> Range<i64> {
        let start = member as i64 * self.segment;
        start..start + self.segment
    }

    /// The matrices (indices into the plan) member `member` orthogonalises.
    pub fn share(&self, member: usize) -> Vec<usize> {
        self.share.get(member).map(|b| b.concat()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::flat_params::ParamGroup;

    /// SmolLM2-135M's drafter layers: q and o square, k and v narrow, gate and up tall, down wide, 4 layers.
    fn smollm_layout() -> FlatLayout {
        let mut groups = Vec::new();
        for l in 0..4 {
            let name = |p: &str| format!("layers.{l}.{p}.weight");
            groups.push(ParamGroup::new(
                vec![(name("self_attn.q_proj"), 576), (name("self_attn.k_proj"), 192), (name("self_attn.v_proj"), 192)],
                Some(576),
                0.02,
            ));
            groups.push(ParamGroup::new(vec![(name("self_attn.o_proj"), 576)], Some(576), 0.02));
            groups.push(ParamGroup::new(
                vec![(name("mlp.gate_proj"), 1536), (name("mlp.up_proj"), 1536)],
                Some(576),
                0.02,
            ));
            groups.push(ParamGroup::new(vec![(name("mlp.down_proj"), 576)], Some(1536), 0.02));
            groups.push(ParamGroup::new(vec![(name("input_layernorm"), 576)], None, 0.0));
        }
        groups.push(ParamGroup::new(vec![("fc.weight".into(), 576)], Some(2880), 0.02));
        groups.push(ParamGroup::new(vec![("embed_tokens.weight".into(), 100)], Some(576), 0.02));
        FlatLayout::new(groups)
    }

    #[test]
    fn matrices_of_one_shape_are_one_batch_within_the_budget() {
        let plan = MuonPlan::new(&smollm_layout());
        assert_eq!(plan.matrices.len(), 29, "7 a layer and the fc; not the norms or the embedding");
        assert!(!plan.names().contains("embed_tokens.weight") && plan.names().contains("fc.weight"));
        let all: Vec<usize> = (0..29).collect();
        let shapes: Vec<([i64; 2], usize)> =
            plan.batches(&all).iter().map(|b| (plan.matrices[b[0]].shape, b.len())).collect();
        assert_eq!(
            shapes,
            [([192, 576], 8), ([576, 576], 8), ([576, 1536], 4), ([576, 2880], 1), ([1536, 576], 8)],
            "five launches' worth of batches where one matrix at a time took 29"
        );
        // A budget of two 576 x 576 matrices splits that batch, and nothing mixes shapes.
        let small = MuonPlan::with_batch_elements(&smollm_layout(), 2 * 576 * 576);
        for b in small.batches(&all) {
            let shape = small.matrices[b[0]].shape;
            assert!(b.iter().all(|&i| small.matrices[i].shape == shape));
            assert!(b.len() == 1 || b.len() as i64 * shape[0] * shape[1] <= 2 * 576 * 576, "{b:?}");
        }
    }

    #[test]
    fn shares_split_the_flops_and_every_matrix_lands_once() {
        let plan = MuonPlan::new(&smollm_layout());
        let flops = |i: usize| newton_schulz_flops(plan.matrices[i].shape);
        let largest = (0..29).map(flops).fold(0.0, f64::max);
        let total: f64 = (0..29).map(flops).sum();
        for members in [1, 2, 3, 4, 8] {
            let shards = plan.shards(members);
            let mut seen: Vec<usize> = (0..members).flat_map(|m| shards.share(m)).collect();
            seen.sort();
            assert_eq!(seen, (0..29).collect::<Vec<_>>(), "{members} members");
            for m in 0..members {
                let load: f64 = shards.share(m).iter().map(|&i| flops(i)).sum();
                assert!((load - total / members as f64).abs() <= largest, "member {m} of {members}: {load}");
                // Its updates fill its own segment, one after another.
                let segment = shards.segment(m);
                let mut spans: Vec<(i64, i64)> = shards
                    .share(m)
                    .iter()
                    .map(|&i| (shards.offset[i], plan.matrices[i].shape[0] * plan.matrices[i].shape[1]))
                    .collect();
                spans.sort();
                let mut at = segment.start;
                for (start, len) in spans {
                    assert_eq!(start, at);
                    at += len;
                }
                assert!(at <= segment.end);
            }
            assert_eq!(shards.gather_len(), shards.segment(members - 1).end);
        }
        // The deal is fixed: the same plan gives the same shares.
        assert_eq!(plan.shards(3).share, plan.shards(3).share);
    }
}
