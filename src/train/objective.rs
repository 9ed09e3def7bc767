//! The DFlash training objective, rule by rule as DFLASH.md states it:
//! anchors (distinct positions `a` with `loss_mask[a] = loss_mask[a+1] = 1`, drawn fresh per step from a Rust RNG
//! keyed by (seed, epoch, sample id), sorted), block inputs (`[x_a, MASK x (bs-1)]`), absolute positions (`a + k`),
//! same-position labels (slot k predicts `x[a + k]`), decayed weights (`exp(-(k-1)/gamma)`, slot 0 never counts) or
//! D-PACE's weights (from the drafter's own confidence in each block, [`dpace_weights`]), the LM head and
//! cross-entropy in chunks that also produce the gradient (so `[N*bs, V]` logits never exist at once and nothing is
//! recomputed), and the metrics: weighted loss, accuracy and teacher-forced acceptance length. DFlash 2 drafters add
//! their selector's K-way loss chunk by chunk beside the unary one ([`SelectorTargets`]).
//!
//! Everything that depends only on the tokens is planned on the host ([`BlockPlan`]); the attention pattern is built
//! from the plan by [`BlockAttention`](crate::model::BlockAttention). A step calls one function per micro-batch,
//! [`micro_batch_loss`]: the plan, the drafter's pass, the target's predictions where the slots learn them, the LM
//! head's loss and (training) the backward all happen behind it.
use rand::SeedableRng;
use rand::seq::index;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::model::variant::dflash2::candidate_selector::{training_candidates, transition_scores};
use crate::model::{BlockAttention, Drafter, ModelError};
use crate::profile::span;

/// What the objective needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectiveSettings {
    /// Blocks per sequence per step (training), and per forward pass (evaluation).
    pub num_anchors: usize,
    pub block_size: usize,
    /// Decay of the slot weights; `None`: no decay. Unused with D-PACE.
    pub gamma: Option<f64>,
    /// D-PACE's smoothing alpha: the slot weights follow the drafter's confidence ([`dpace_weights`]) instead of the
    /// decay. `None`: the decay.
    pub dpace_alpha: Option<f64>,
    pub mask_token_id: i64,
    /// Blocks per attention group (see `BlockAttention`); results do not depend on it, only speed and memory.
    /// `None`: the device's measured best, [`default_group_blocks`].
    pub attention_group_blocks: Option<usize>,
    /// Rows of the LM head + cross-entropy computed at once.
    pub lm_head_chunk_rows: i64,
    /// What a slot learns to predict.
    pub teacher: Teacher,
    /// DFlash 2: the weight of the selector's loss beside the unary one (speculators' `selector_loss_alpha`).
    pub selector_loss_alpha: f64,
}

/// What a block slot learns to predict (`objective.target` with `objective.loss`). Slot k of a block at anchor `a`
/// sits at position `p = a + k`; the target's prediction for it is its next-token distribution after position
/// `p - 1` (the LM head over its normed last state there), as speculators 0.9.0 takes it (`verifier_lm_head` at
/// `anchored_block_indices - 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Teacher {
    /// Cross-entropy against the data's token `x[p]` (the paper's).
    #[default]
    Data,
    /// Cross-entropy against the target's own choice, the argmax of its logits (speculators' `ce`).
    Argmax,
    /// `KL(target || drafter)` over the whole vocabulary (speculators' `kl_div`); accuracy and acceptance count the
    /// target's argmax.
    Distribution,
}

impl Teacher {
    /// Whether batches must carry the target's last states ([`Target::capture_with_last`](crate::model::Target)).
    pub fn needs_target_predictions(self) -> bool {
        self != Teacher::Data
    }
}

impl ObjectiveSettings {
    /// Settings with the defaults for everything a user does not choose.
    pub fn new(num_anchors: usize, block_size: usize, gamma: Option<f64>, mask_token_id: i64) -> Self {
        ObjectiveSettings {
            num_anchors,
            block_size,
            gamma,
            dpace_alpha: None,
            mask_token_id,
            attention_group_blocks: None,
            lm_head_chunk_rows: 2048,
            teacher: Teacher::Data,
            selector_loss_alpha: 1.0,
        }
    }

    /// Blocks per attention group on `device`: the setting, else [`default_group_blocks`].
    pub fn group_blocks(&self, device: Device) -> usize {
        self.attention_group_blocks.unwrap_or_else(|| default_group_blocks(device))
    }
}

/// Blocks per attention group where the settings leave it open. On a GPU, 64: measured fastest and leanest on the
/// H200 at 768/256 and 3072/512 (BENCHMARKS.md), fewer and larger attention calls outweighing the masked keys a
/// larger group computes. On the CPU, where a call costs little and every masked key costs its full share, 8: the
/// default run's training steps 1.6x faster than with 64 (BENCHMARKS.md).
pub fn default_group_blocks(device: Device) -> usize {
    if device.is_cuda() { 64 } else { 8 }
}

/// The blocks per row of a plan whose fullest row has `most` anchors, on a GPU with attention groups of `group`
/// blocks: rounded up so that attention's shapes recur from step to step, since cuDNN builds an execution plan for
/// every new shape and that costs more than the attention itself (BENCHMARKS.md: packed rows, whose anchor counts
/// change every step, trained 2.6x slower): to a multiple of the group when `most` fills one, else to a power of
/// two. The added blocks are padding, which trains nothing. `None` (the CPU): `most`.
pub fn planned_blocks(most: usize, group: Option<usize>) -> usize {
    match group {
        Some(group) if most >= group.max(1) => most.div_ceil(group) * group,
        Some(_) if most > 0 => most.next_power_of_two(),
        _ => most,
    }
}

/// One conversation: its token ids and loss mask (1 on supervised tokens), of the same length.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    pub input_ids: &'a [i64],
    pub loss_mask: &'a [u8],
}

/// Positions that may anchor a block: `loss_mask[a] = 1` and `loss_mask[a+1] = 1` (so `a <= len - 2`).
pub fn valid_anchors(loss_mask: &[u8]) -> Vec<usize> {
    loss_mask.windows(2).enumerate().filter(|(_, w)| w[0] != 0 && w[1] != 0).map(|(a, _)| a).collect()
}

/// The anchor RNG of one sample in one epoch: independent of which drafter or thread trains it.
pub fn anchor_rng(seed: u64, epoch: u64, sample_id: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..24].copy_from_slice(&sample_id.to_le_bytes());
    key[24..].copy_from_slice(b"anchors\0");
    ChaCha8Rng::from_seed(key)
}

/// Up to `n` distinct anchors drawn uniformly from `valid`, ascending.
pub fn sample_anchors(valid: &[usize], n: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    if valid.len() <= n {
        return valid.to_vec();
    }
    let mut picked: Vec<usize> = index::sample(rng, valid.len(), n).into_iter().map(|i| valid[i]).collect();
    picked.sort_unstable();
    picked
}

/// Weight of block slot `k`: 0 for the anchor slot, `exp(-(k-1)/gamma)` after it (1 without decay).
pub fn slot_weight(k: usize, gamma: Option<f64>) -> f32 {
    match (k, gamma) {
        (0, _) => 0.0,
        (_, None) => 1.0,
        (_, Some(g)) => (-((k - 1) as f64) / g).exp() as f32,
    }
}

/// The blocks of one batch, planned on the host. Row-major: block j of row b is index `b * blocks + j`; slot k of
/// it is `(b * blocks + j) * block_size + k`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockPlan {
    pub batch: usize,
    /// Blocks per row (`N`): the most anchors any row has; rows with fewer get padding blocks.
    pub blocks: usize,
    pub block_size: usize,
    /// Padded sequence length of the batch.
    pub seq_len: usize,
    /// `[B * N]`; 0 for padding blocks.
    pub anchors: Vec<i64>,
    /// `[B * N]`: false for padding blocks.
    pub keep: Vec<bool>,
    /// `[B * N * bs]`: the anchor token in slot 0, MASK elsewhere (MASK everywhere in padding blocks).
    pub block_ids: Vec<i64>,
    /// `[B * N * bs]`: `a + k`.
    pub positions: Vec<i64>,
    /// `[B * N * bs]`: `input_ids[a + k]` (same position: slot 0 is the anchor itself); 0 where there is none.
    pub labels: Vec<i64>,
    /// `[B * N * bs]`: `keep * [a + k < len] * [k > 0] * loss_mask[a + k] * decay(k)`; with D-PACE without the decay
    /// (the mask `m`), the weights following from the drafter's confidence when the loss is computed.
    pub weights: Vec<f32>,
    /// D-PACE's alpha, or `None` (the decay is in `weights`).
    pub dpace_alpha: Option<f64>,
    /// `[B * N]`, packed rows only: where the conversation of each block starts in its row (the first context
    /// position it may see). `None`: every row is one conversation.
    pub context_starts: Option<Vec<i64>>,
}

impl BlockPlan {
    /// Plans blocks at the given anchors (ascending, valid) of each row.
    pub fn new(rows: &[Row], anchors: &[Vec<usize>], seq_len: usize, s: &ObjectiveSettings) -> Self {
        Self::packed(rows, anchors, None, seq_len, None, s)
    }

    /// [`BlockPlan::new`] for rows of several conversations each (`conversations`: per row, their lengths in order,
    /// summing to the row's length; `None`: one per row). A block belongs to the conversation of its anchor: it sees
    /// that conversation's context only, and its slots past the conversation's end weigh nothing and read no label,
    /// as past the end of a row of its own, so a conversation's blocks are the same packed or not. With `group`
    /// (on a GPU), the rows hold [`planned_blocks`].
    pub fn packed(
        rows: &[Row],
        anchors: &[Vec<usize>],
        conversations: Option<&[Vec<usize>]>,
        seq_len: usize,
        group: Option<usize>,
        s: &ObjectiveSettings,
    ) -> Self {
        let (batch, bs) = (rows.len(), s.block_size);
        let blocks = planned_blocks(anchors.iter().map(Vec::len).max().unwrap_or(0), group);
        let slots = batch * blocks * bs;
        let mut plan = BlockPlan {
            batch,
            blocks,
            block_size: bs,
            seq_len,
            anchors: vec![0; batch * blocks],
            keep: vec![false; batch * blocks],
            block_ids: vec![s.mask_token_id; slots],
            positions: vec![0; slots],
            labels: vec![0; slots],
            weights: vec![0.0; slots],
            dpace_alpha: s.dpace_alpha,
            context_starts: conversations.map(|_| vec![0; batch * blocks]),
        };
        // D-PACE weighs slots when the loss is known; here only whether they count.
        let gamma = if s.dpace_alpha.is_some() { None } else { s.gamma };
        for (b, (row, row_anchors)) in rows.iter().zip(anchors).enumerate() {
            // Where each conversation of the row starts, and the row's end.
            let mut bounds = vec![0];
            for &len in conversations.and_then(|c| c.get(b)).into_iter().flatten() {
                bounds.push(bounds[bounds.len() - 1] + len);
            }
            bounds.push(row.input_ids.len());
            for j in 0..blocks {
                let block = b * blocks + j;
                let base = block * bs;
                let Some(&a) = row_anchors.get(j) else {
                    // Padding block: anchor 0, all MASK, weight 0; it sees only itself.
                    for k in 0..bs {
                        plan.positions[base + k] = k as i64;
                    }
                    continue;
                };
                // The anchor's conversation: from the last bound at or before it to the next one.
                let next = bounds.partition_point(|&start| start <= a);
                let (start, end) = (bounds[next - 1], bounds[next.min(bounds.len() - 1)]);
                if let Some(starts) = plan.context_starts.as_mut() {
                    starts[block] = start as i64;
                }
                plan.anchors[block] = a as i64;
                plan.keep[block] = true;
                plan.block_ids[base] = row.input_ids[a];
                for k in 0..bs {
                    let p = a + k;
                    plan.positions[base + k] = p as i64;
                    if p < end {
                        plan.labels[base + k] = row.input_ids[p];
                        if row.loss_mask[p] != 0 {
                            plan.weights[base + k] = slot_weight(k, gamma);
                        }
                    }
                }
            }
        }
        plan
    }

    pub fn kept_blocks(&self) -> usize {
        self.keep.iter().filter(|&&k| k).count()
    }
}

/// A plan's tensors on the compute device.
pub struct PlanTensors {
    /// `[B, N*bs]`
    pub block_ids: Tensor,
    /// `[B, N*bs]`
    pub positions: Tensor,
    /// `[B*N*bs]`
    pub labels: Tensor,
    /// `[B*N*bs]` f32
    pub weights: Tensor,
    pub attention: BlockAttention,
}

impl PlanTensors {
    /// `[B*N*bs]`: the data's token before each slot (the anchor's own before slot 0), from the labels.
    pub fn predecessors(&self, block_size: usize) -> Result<Tensor, ModelError> {
        let blocks = self.labels.f_view([-1, block_size as i64])?;
        let before = blocks.f_narrow(1, 0, block_size as i64 - 1)?;
        Ok(Tensor::f_cat(&[blocks.f_narrow(1, 0, 1)?, before], 1)?.f_view([-1])?)
    }

    pub fn new(plan: &BlockPlan, s: &ObjectiveSettings, kind: Kind, device: Device) -> Result<Self, ModelError> {
        let (b, q) = (plan.batch as i64, (plan.blocks * plan.block_size) as i64);
        let to = |v: &[i64]| -> Result<Tensor, ModelError> { Ok(Tensor::f_from_slice(v)?.f_to(device)?) };
        Ok(PlanTensors {
            block_ids: to(&plan.block_ids)?.f_view([b, q])?,
            positions: to(&plan.positions)?.f_view([b, q])?,
            labels: to(&plan.labels)?,
            weights: Tensor::f_from_slice(&plan.weights)?.f_to(device)?,
            attention: BlockAttention::new(
                &plan.anchors,
                plan.context_starts.as_deref(),
                plan.batch,
                plan.block_size,
                plan.seq_len as i64,
                s.group_blocks(device),
                kind,
                device,
            )?,
        })
    }
}

/// Sums from which the reported metrics follow; they add up across chunks, micro-batches and replicas.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// `sum(w * CE)`
    pub weighted_loss: f64,
    /// `sum(w)`
    pub weight: f64,
    /// Positions with `w > 0` whose argmax equals the label.
    pub correct: f64,
    /// Positions with `w > 0`.
    pub predicted: f64,
    /// Sum over kept blocks of the teacher-forced acceptance length.
    pub accepted: f64,
    /// Kept blocks.
    pub blocks: f64,
}

impl Metrics {
    pub fn add(&mut self, o: &Metrics) {
        self.weighted_loss += o.weighted_loss;
        self.weight += o.weight;
        self.correct += o.correct;
        self.predicted += o.predicted;
        self.accepted += o.accepted;
        self.blocks += o.blocks;
    }
    /// `sum(w * CE) / (sum(w) + 1e-6)`, as the objective defines it.
    pub fn loss(&self) -> f64 {
        self.weighted_loss / (self.weight + 1e-6)
    }
    pub fn accuracy(&self) -> f64 {
        if self.predicted > 0.0 { self.correct / self.predicted } else { 0.0 }
    }
    /// Mean over kept blocks of 1 + the leading correctly predicted slots.
    pub fn acceptance_length(&self) -> f64 {
        if self.blocks > 0.0 { self.accepted / self.blocks } else { 0.0 }
    }
}

/// What the LM head pass returns.
pub struct HeadOutput {
    pub metrics: Metrics,
    /// `d sum(w * CE) / d hidden`, `[rows, H]` in the hidden states' dtype (with `want_grad`).
    pub grad: Option<Tensor>,
}

/// What the slots are scored against.
pub struct SlotTargets<'a> {
    /// `[rows]`: the data's token at each slot, or the target's argmax there ([`Teacher`]). `None` with
    /// `distribution`: the target's argmax at each slot from the logits its KL computes there anyway.
    pub labels: Option<&'a Tensor>,
    /// `[rows]` f32: the plan's weights ([`BlockPlan::weights`]).
    pub weights: &'a Tensor,
    /// To learn the target's distribution ([`Teacher::Distribution`]): its states and the one each slot reads.
    pub distribution: Option<TargetStates<'a>>,
    /// DFlash 2's candidate selector, trained beside the unary logits.
    pub selector: Option<SelectorTargets<'a>>,
}

impl<'a> SlotTargets<'a> {
    /// Slots scored by the cross-entropy of `labels`.
    pub fn labels(labels: &'a Tensor, weights: &'a Tensor) -> Self {
        SlotTargets { labels: Some(labels), weights, distribution: None, selector: None }
    }
}

/// What DFlash 2's selector loss needs: the drafter (whose selector weights it reads, recording their gradients),
/// the token before each slot `[rows]` (teacher-forced: the data's, the anchor's own before slot 0, as speculators
/// takes them), and the loss's weight beside the unary one (`objective.selector_loss_alpha`).
pub struct SelectorTargets<'a> {
    pub drafter: &'a Drafter,
    pub predecessors: &'a Tensor,
    pub alpha: f64,
}

/// The target's normed last states `[positions, H]` (on the drafter's device, in its dtype) and, per slot `[rows]`,
/// the index of the state whose logits predict it.
pub struct TargetStates<'a> {
    pub states: &'a Tensor,
    pub rows: &'a Tensor,
}

/// LM head and weighted loss over `hidden [rows, H]` (detached), in chunks of `chunk_rows` rows with `w > 0` (only
/// those are computed at all). Each chunk's logits `[chunk, V]` give the loss, the argmax, and (with `want_grad`) the
/// gradient of `sum(w * loss)` with respect to the hidden states, the logits' gradient times the head, so the logits
/// are never recomputed. Also fills the accuracy and acceptance sums (against the labels), for blocks of
/// `block_size` rows whose kept flags are `keep`.
///
/// The loss is the label's cross-entropy, `(softmax - onehot) * w` its logits' gradient: the softmax is stored in
/// the hidden states' dtype; the label's log-probability comes from `log1p(-(1 - p))` where p > 0.5 and from the
/// label's logit, the largest logit and the largest probability elsewhere, each to that dtype's relative precision.
/// With `slots.distribution` it is `KL(target || drafter)` instead ([`chunk_kl`]), the target's logits computed
/// chunk by chunk beside the drafter's.
///
/// With D-PACE (`plan.dpace_alpha`) `weights` is the mask `m`; each chunk holds whole blocks, and once its losses
/// are known the slot weights are [`dpace_weights`] (detached): the loss sums `w * loss`, the gradient is the logits'
/// gradient times `w` times the head, and the reported weight (the normaliser) is `sum(m)`, as speculators
/// normalises (it adds 1e-5 per batch where dflash adds 1e-6 to the run's sum).
pub fn lm_head_loss(
    hidden: &Tensor,
    lm_head: &Tensor,
    slots: &SlotTargets,
    plan: &BlockPlan,
    chunk_rows: i64,
    want_grad: bool,
) -> Result<HeadOutput, ModelError> {
    let _p = span("lm_head.loss");
    let device = hidden.device();
    let (rows, h) = (hidden.size()[0], hidden.size()[1]);
    let weights = slots.weights;
    let selected = weights.f_gt(0.0)?.f_nonzero()?.f_squeeze_dim(1)?;
    let n = selected.size()[0];
    let sel_labels = slots.labels.map(|labels| labels.f_index_select(0, &selected)).transpose()?;
    let sel_weights = weights.f_index_select(0, &selected)?;
    let correct_sel = Tensor::f_zeros([n], (Kind::Bool, device))?;
    let mut sel_grad = if want_grad { Some(Tensor::f_zeros([n, h], (hidden.kind(), device))?) } else { None };
    let mut loss_sum = Tensor::f_zeros([], (Kind::Double, device))?;
    // (start, len, the blocks its rows span: D-PACE's, known here so that no chunk waits for the device to count them)
    let chunks = match plan.dpace_alpha {
        None => (0..n).step_by(chunk_rows.max(1) as usize).map(|start| (start, chunk_rows.min(n - start), 0)).collect(),
        // D-PACE weighs a slot by the losses of the slots after it: each chunk holds whole blocks.
        Some(_) => whole_block_chunks(&Vec::<i64>::try_from(&selected)?, plan.block_size as i64, chunk_rows),
    };
    for (start, len, blocks) in chunks {
        let idx = selected.narrow(0, start, len);
        let w = sel_weights.narrow(0, start, len);
        let x = hidden.f_index_select(0, &idx)?;
        let logits = x.f_linear(lm_head, None::<Tensor>)?;
        let target_logits = match &slots.distribution {
            Some(target) => {
                let states = target.states.f_index_select(0, &target.rows.f_index_select(0, &idx)?)?;
                Some(states.f_linear(lm_head, None::<Tensor>)?)
            }
            None => None,
        };
        let lab = match (&sel_labels, &target_logits) {
            (Some(labels), _) => labels.narrow(0, start, len),
            (None, Some(target_logits)) => crate::model::choice::greedy_tokens(target_logits)?,
            (None, None) => return Err(ModelError::Batch("the slots need labels or the target's distribution".into())),
        };
        let selected_by = match &slots.selector {
            Some(selector) => Some(selector_chunk(selector, &logits, &x, (&idx, blocks), &lab, &w, plan, want_grad)?),
            None => None,
        };
        let scored = match target_logits {
            None => chunk_cross_entropy(logits, &lab, &w, want_grad)?,
            Some(target_logits) => chunk_kl(logits, target_logits, &w, want_grad)?,
        };
        let mut hit = correct_sel.narrow(0, start, len);
        // DFlash 2 drafts the selector's choice, where the unary top-K holds the label (what serving can reach).
        hit.f_copy_(&match &selected_by {
            Some(sel) => sel.choice.f_eq_tensor(&lab)?.f_logical_and(&sel.reachable)?,
            None => scored.argmax.f_eq_tensor(&lab)?,
        })?;
        // With D-PACE the plan's weights are the mask (1), and the weights come from the losses now.
        let dpace = match plan.dpace_alpha {
            Some(alpha) => Some(dpace_weights(&scored.loss, &idx, plan.block_size as i64, blocks, alpha)?),
            None => None,
        };
        loss_sum += (&scored.loss * dpace.as_ref().unwrap_or(&w)).f_sum(Kind::Double)?;
        if let Some(sel) = &selected_by {
            loss_sum += &sel.loss;
        }
        if let (Some(grad), Some(d_logits)) = (sel_grad.as_mut(), scored.grad) {
            let mut g = d_logits.f_matmul(lm_head)?;
            if let Some(wd) = &dpace {
                g = g.f_mul(&wd.f_unsqueeze(1)?)?;
            }
            if let Some(SelectorChunk { grads: Some((d_unary, d_hidden)), candidates, .. }) = &selected_by {
                // The selector's gradient reaches the unary logits of its K candidates only: through those rows of
                // the head.
                let rows = lm_head.f_index_select(0, &candidates.f_reshape([-1])?)?.f_view([len, -1, h])?;
                // In the head's dtype: D-PACE's f32 weights above may have promoted `g` to f32.
                g += d_unary.f_to_kind(rows.kind())?.f_unsqueeze(1)?.f_bmm(&rows)?.f_squeeze_dim(1)?;
                g += d_hidden.f_to_kind(g.kind())?;
            }
            grad.narrow(0, start, len).f_copy_(&g)?;
        }
    }
    let correct_flags =
        Tensor::f_zeros([rows], (Kind::Bool, device))?.f_index_put_(&[Some(&selected)], &correct_sel, false)?;
    let (accepted, blocks) = acceptance(&correct_flags, weights, plan)?;
    let metrics = Metrics {
        weighted_loss: loss_sum.f_double_value(&[])?,
        weight: sel_weights.f_sum(Kind::Double)?.f_double_value(&[])?,
        correct: correct_sel.f_sum(Kind::Double)?.f_double_value(&[])?,
        predicted: n as f64,
        accepted,
        blocks,
    };
    let grad = match sel_grad {
        Some(g) => Some(Tensor::f_zeros([rows, h], (hidden.kind(), device))?.f_index_copy(0, &selected, &g)?),
        None => None,
    };
    Ok(HeadOutput { metrics, grad })
}

/// One chunk scored: per row the loss (f32) and the drafter's argmax; with `want_grad`, the gradient of
/// `sum(w * loss)` with respect to the logits, in their dtype.
struct ScoredChunk {
    loss: Tensor,
    argmax: Tensor,
    grad: Option<Tensor>,
}

/// The label's cross-entropy from [`chunk_softmax`].
fn chunk_cross_entropy(logits: Tensor, lab: &Tensor, w: &Tensor, want_grad: bool) -> Result<ScoredChunk, ModelError> {
    let soft = chunk_softmax(logits, lab, w, want_grad)?;
    // log p = log1p(-(1 - p)) where the label is likely; elsewhere (label logit - max logit) + log p_max, as
    // p_max >= 1/V never underflows however unlikely the label.
    let far = (soft.label_logit - soft.max_logit) + soft.p_max.f_log()?;
    let label_lp = (-&soft.rest).f_log1p()?.f_where_self(&soft.rest.f_lt(0.5)?, &far)?;
    Ok(ScoredChunk { loss: label_lp.f_neg()?, argmax: soft.argmax, grad: soft.grad })
}

/// `KL(p || q)` per row from the target's distribution `p = softmax(target_logits)` to the drafter's
/// `q = softmax(logits)`, as speculators 0.9.0's `kl_div_loss` computes it (both log-softmaxes in f32,
/// `xlogy(p, p) - p log q` summed over the vocabulary); its logits' gradient is `(q - p) * w`. On a GPU in bf16 by
/// the fused kernel ([`crate::model::fused::kl_rows`]: two passes over the two rows, the gradient written over the
/// logits), elsewhere by [`chunk_kl_plain`].
fn chunk_kl(mut logits: Tensor, target_logits: Tensor, w: &Tensor, want_grad: bool) -> Result<ScoredChunk, ModelError> {
    match crate::model::fused::kl_rows(&mut logits, &target_logits, w, want_grad) {
        Some(fused) => Ok(ScoredChunk { loss: fused.loss, argmax: fused.argmax, grad: want_grad.then_some(logits) }),
        None => chunk_kl_plain(logits, target_logits, w, want_grad),
    }
}

/// [`chunk_kl`] by libtorch operations: holds a few `[rows, V]` f32 buffers at once, where the cross-entropy holds
/// one in the logits' dtype.
fn chunk_kl_plain(
    logits: Tensor,
    target_logits: Tensor,
    w: &Tensor,
    want_grad: bool,
) -> Result<ScoredChunk, ModelError> {
    let argmax = crate::model::choice::greedy_tokens(&logits)?;
    let kind = logits.kind();
    let log_q = logits.f_log_softmax(-1, Kind::Float)?;
    drop(logits);
    let p = target_logits.f_softmax(-1, Kind::Float)?;
    drop(target_logits);
    let loss = (p.f_xlogy(&p)? - &p * &log_q).f_sum_dim_intlist(-1, false, Kind::Float)?;
    let grad = if want_grad {
        let mut q = log_q;
        let _ = q.f_exp_()?.f_sub_(&p)?.f_mul_(&w.unsqueeze(1))?;
        Some(q.f_to_kind(kind)?)
    } else {
        None
    };
    Ok(ScoredChunk { loss, argmax, grad })
}

/// DFlash 2's selector over one chunk: its loss (weighted and scaled by its alpha), per row the token it would
/// draft given the teacher-forced token before and whether serving could reach the label (the unary top-K holds
/// it), and with `want_grad` the gradients of its loss with respect to the chunk's unary logits at its candidates
/// `[len, K]` and to the hidden states `[len, H]`; the selector's own weights receive theirs in the drafter's flat
/// gradient.
struct SelectorChunk {
    loss: Tensor,
    choice: Tensor,
    reachable: Tensor,
    candidates: Tensor,
    grads: Option<(Tensor, Tensor)>,
}

/// The selector's K-way cross-entropy (speculators 0.9.0, `models/dflash2/metrics.py: compute_selector_loss`): the
/// unary top-K of `logits [len, V]` with the label put last where it is missing ([`training_candidates`]), scored
/// given the hidden states `x [len, H]` and each slot's predecessor, weighted as the unary loss is (the decayed
/// weights `w`, or D-PACE's from the selector's own cross-entropies) and scaled by `alpha`. `(idx, blocks)`: the
/// chunk's rows and the blocks they span.
#[allow(clippy::too_many_arguments)]
fn selector_chunk(
    selector: &SelectorTargets,
    logits: &Tensor,
    x: &Tensor,
    (idx, blocks): (&Tensor, i64),
    labels: &Tensor,
    w: &Tensor,
    plan: &BlockPlan,
    want_grad: bool,
) -> Result<SelectorChunk, ModelError> {
    let _p = span("lm_head.selector");
    let Some(shape) = selector.drafter.config().variant.selector() else {
        return Err(ModelError::Batch("the selector's loss needs a drafter with a candidate selector".into()));
    };
    let top_k = shape.top_k as i64;
    let (candidates, place, reachable) = training_candidates(&logits.f_topk(top_k, -1, true, true)?.1, labels)?;
    let unary =
        logits.f_gather(1, &candidates, false)?.f_to_kind(Kind::Float)?.f_detach()?.set_requires_grad(want_grad);
    let hidden = x.f_detach()?.set_requires_grad(want_grad);
    let predecessors = selector.predecessors.f_index_select(0, idx)?;
    let chunk = || {
        let weights = selector.drafter.selector_weights()?;
        let transitions = transition_scores(&hidden, &predecessors.f_unsqueeze(1)?, &candidates, &weights.borrowed())?
            .f_squeeze_dim(1)?;
        let scores = &unary + transitions.f_to_kind(Kind::Float)?;
        let ce = scores.f_cross_entropy_loss::<Tensor>(&place, None, tch::Reduction::None, -100, 0.0)?;
        let slot_weights = match plan.dpace_alpha {
            Some(alpha) => dpace_weights(&ce.f_detach()?, idx, plan.block_size as i64, blocks, alpha)?,
            None => w.shallow_clone(),
        };
        let loss = (ce * slot_weights).f_sum(Kind::Double)? * selector.alpha;
        let choice = candidates.f_gather(1, &scores.f_argmax(-1, true)?, false)?.f_squeeze_dim(1)?;
        let grads = match want_grad {
            true => {
                loss.f_backward()?;
                Some((unary.grad(), hidden.grad()))
            }
            false => None,
        };
        Ok(SelectorChunk { loss: loss.f_detach()?, choice, reachable, candidates: candidates.shallow_clone(), grads })
    };
    // Its own small graph when training (the caller runs without one), none when evaluating.
    if want_grad { tch::with_grad(chunk) } else { tch::no_grad(chunk) }
}

/// Chunks `(start, len, blocks)` of the selected rows `selected` (ascending row indices; block `row / block_size`) of
/// at most `chunk_rows` rows, each ending where a block ends (a block longer than `chunk_rows` is one chunk), with the
/// blocks each spans from its first row's to its last's.
fn whole_block_chunks(selected: &[i64], block_size: i64, chunk_rows: i64) -> Vec<(i64, i64, i64)> {
    let n = selected.len();
    let block = |i: usize| selected[i] / block_size;
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < n {
        let mut end = (start + chunk_rows.max(1) as usize).min(n);
        while end < n && end > start && block(end) == block(end - 1) {
            end -= 1;
        }
        if end == start {
            // One block alone is longer than a chunk: take it whole.
            end = start + 1;
            while end < n && block(end) == block(start) {
                end += 1;
            }
        }
        chunks.push((start as i64, (end - start) as i64, block(end - 1) - block(start) + 1));
        start = end;
    }
    chunks
}

/// D-PACE's slot weights (speculators 0.9.0, `losses/utils.py: dpace_loss_decay`) for the selected rows `rows`
/// (ascending row indices, whole blocks of `block_size` slots, the supervised slots `m_k = 1`) with cross-entropies
/// `ce`, without gradient: `q_k = exp(-CE_k)`, `s_k = (1 - alpha) q_k + alpha` where `m_k` (else 1),
/// `P_k = prod_{i <= k} s_i`, `w_k = m_k sum_{j >= k} m_j P_j`. In f32, `[rows]`. `blocks`: the blocks the rows span,
/// from the first row's to the last's, as the caller knows them (counting them here would wait for the device).
pub fn dpace_weights(
    ce: &Tensor,
    rows: &Tensor,
    block_size: i64,
    blocks: i64,
    alpha: f64,
) -> Result<Tensor, ModelError> {
    let device = ce.device();
    let len = rows.size()[0];
    if len == 0 {
        return Ok(Tensor::f_zeros([0], (Kind::Float, device))?);
    }
    let block = rows.f_floor_divide_scalar(block_size)?;
    let local = &block - block.f_min()?;
    let slot = rows.f_remainder(block_size)?;
    let at = [Some(local), Some(slot)];
    let dense = |fill: f64, values: &Tensor| -> Result<Tensor, ModelError> {
        Ok(Tensor::f_full([blocks, block_size], fill, (Kind::Float, device))?.f_index_put_(&at, values, false)?)
    };
    let q = ce.f_to_kind(Kind::Float)?.f_neg()?.f_exp()?;
    let m = dense(0.0, &Tensor::f_ones([len], (Kind::Float, device))?)?;
    // Unsupervised slots keep the product as it is (s = 1).
    let smooth = dense(1.0, &(q * (1.0 - alpha) + alpha))?;
    let prefix = smooth.f_cumprod(1, Kind::Float)?;
    let suffix = (prefix * &m).f_flip([1])?.f_cumsum(1, Kind::Float)?.f_flip([1])?;
    Ok((suffix * m).f_index(&at)?)
}

/// What the loss needs of the softmax of one chunk of logits `[len, V]`: per row (f32) the largest logit, its index,
/// the label's logit, the probability at the argmax and the summed probability of every other token than the label
/// (the label's `1 - p`, precise where `p` is near 1); with `want_grad`, the logits' gradient `(softmax - onehot) * w`
/// in their dtype.
struct ChunkSoftmax {
    max_logit: Tensor,
    argmax: Tensor,
    label_logit: Tensor,
    p_max: Tensor,
    rest: Tensor,
    grad: Option<Tensor>,
}

/// [`ChunkSoftmax`] of `logits` (consumed: the gradient is written over them), by one fused kernel pair on a GPU in
/// bf16, otherwise by [`chunk_softmax_plain`].
fn chunk_softmax(mut logits: Tensor, lab: &Tensor, w: &Tensor, want_grad: bool) -> Result<ChunkSoftmax, ModelError> {
    let Some(fused) = crate::model::fused::softmax_rows(&mut logits, lab, w, want_grad) else {
        return chunk_softmax_plain(logits, lab, w, want_grad);
    };
    let column = |i: i64| fused.stats.select(1, i);
    Ok(ChunkSoftmax {
        max_logit: column(0),
        argmax: fused.argmax,
        label_logit: column(1),
        p_max: column(2),
        rest: column(3),
        grad: want_grad.then_some(logits),
    })
}

/// [`ChunkSoftmax`] by libtorch operations: the softmax accumulated in f32 but stored in the logits' dtype (on a GPU,
/// bf16), the only full pass besides the max, the sum and the scaling.
fn chunk_softmax_plain(logits: Tensor, lab: &Tensor, w: &Tensor, want_grad: bool) -> Result<ChunkSoftmax, ModelError> {
    let argmax = crate::model::choice::greedy_tokens(&logits)?;
    let max_logit = logits.f_gather(1, &argmax.unsqueeze(1), false)?.f_squeeze_dim(1)?;
    let lab1 = lab.unsqueeze(1);
    let label_logit = logits.f_gather(1, &lab1, false)?.f_squeeze_dim(1)?.f_to_kind(Kind::Float)?;
    let mut probs = logits.f_softmax(-1, logits.kind())?;
    drop(logits);
    let p_max = probs.f_gather(1, &argmax.unsqueeze(1), false)?.f_squeeze_dim(1)?.f_to_kind(Kind::Float)?;
    // The other tokens' mass, summed in f32 with the label's entry zeroed: 1 - p to the storage dtype's relative
    // precision even where p is near 1 (where 1 - p itself would cancel).
    let _ = probs.f_scatter_value_(1, &lab1, 0.0)?;
    let rest = probs.f_sum_dim_intlist(-1, false, Kind::Float)?;
    let grad = if want_grad {
        // The other entries scaled in place (computed in f32, rounded once), the label's entry -(1 - p) * w from the
        // precise sum.
        let _ = probs.f_mul_(&w.unsqueeze(1))?;
        let label_grad = (-(&rest * w)).f_unsqueeze(1)?.f_to_kind(probs.kind())?;
        let _ = probs.f_scatter_(1, &lab1, &label_grad)?;
        Some(probs)
    } else {
        None
    };
    Ok(ChunkSoftmax { max_logit: max_logit.f_to_kind(Kind::Float)?, argmax, label_logit, p_max, rest, grad })
}

/// Sum of teacher-forced acceptance lengths over kept blocks, and their count: per block, 1 + the number of leading
/// slots k = 1, 2, ... whose argmax equals the label, stopping at the first miss or the first slot without a valid
/// label (`w = 0`).
fn acceptance(correct: &Tensor, weights: &Tensor, plan: &BlockPlan) -> Result<(f64, f64), ModelError> {
    let kept = plan.kept_blocks();
    if kept == 0 {
        return Ok((0.0, 0.0));
    }
    let bs = plan.block_size as i64;
    let nb = (plan.batch * plan.blocks) as i64;
    let hits = correct.f_logical_and(&weights.f_gt(0.0)?)?.f_view([nb, bs])?;
    let run = hits.narrow(1, 1, bs - 1).f_to_kind(Kind::Int64)?.f_cumprod(1, Kind::Int64)?;
    let keep = Tensor::f_from_slice(&plan.keep)?.f_to(correct.device())?;
    let accepted = (run.f_sum_dim_intlist(1, false, Kind::Int64)? + 1)
        .f_masked_select(&keep)?
        .f_sum(Kind::Double)?
        .f_double_value(&[])?;
    Ok((accepted, kept as f64))
}

/// The target's frozen embedding and LM head (`[V, H]`, on the drafter's device in its dtype).
pub struct FrozenHeads<'a> {
    pub embed: &'a Tensor,
    pub lm_head: &'a Tensor,
}

/// One micro-batch as the objective reads it: its rows, their conversations (packed rows) and the target's states.
pub struct MicroBatch<'a> {
    pub rows: Vec<Row<'a>>,
    /// Packed rows: the lengths of each row's conversations, in order. `None`: one per row.
    pub conversations: Option<&'a [Vec<usize>]>,
    /// `[B, S, n*H]`: the target's tapped states, `S` the longest row.
    pub target_hidden: &'a Tensor,
    /// `[B, S, H]`: the target's normed last states, where the slots learn from its predictions.
    pub target_last: Option<&'a Tensor>,
}

impl MicroBatch<'_> {
    fn seq_len(&self) -> usize {
        self.target_hidden.size()[1] as usize
    }
}

/// The whole objective of one micro-batch at `anchors` (per row, ascending): plans the blocks, runs the drafter and
/// the LM head and scores every slot; with `train`, backpropagates the weighted loss sum into the drafter's flat
/// gradient. The one call a training or evaluation step makes per micro-batch.
pub fn micro_batch_loss(
    drafter: &Drafter,
    heads: &FrozenHeads,
    objective: &ObjectiveSettings,
    batch: &MicroBatch,
    anchors: &[Vec<usize>],
    train: bool,
) -> Result<Metrics, ModelError> {
    let device = drafter.device();
    let group = device.is_cuda().then(|| objective.group_blocks(device));
    let plan = BlockPlan::packed(&batch.rows, anchors, batch.conversations, batch.seq_len(), group, objective);
    if plan.kept_blocks() == 0 {
        return Ok(Metrics::default());
    }
    let t = PlanTensors::new(&plan, objective, drafter.kind(), drafter.device())?;
    let chunk = objective.lm_head_chunk_rows;
    let teacher = TeacherTargets::new(objective.teacher, batch, heads.lm_head, &t, chunk)?;
    let predecessors = match drafter.config().variant.selector() {
        Some(_) => Some(t.predecessors(plan.block_size)?),
        None => None,
    };
    let slots = SlotTargets {
        labels: match &teacher {
            Some(teacher) => teacher.labels.as_ref(),
            None => Some(&t.labels),
        },
        weights: &t.weights,
        distribution: teacher.as_ref().and_then(TeacherTargets::distribution),
        selector: predecessors.as_ref().map(|predecessors| SelectorTargets {
            drafter,
            predecessors,
            alpha: objective.selector_loss_alpha,
        }),
    };
    let forward = || {
        let emb = Tensor::embedding(heads.embed, &t.block_ids, -1, false, false);
        let h = drafter.forward(batch.target_hidden, &emb, &t.positions, &t.attention);
        let flat = h.view([-1, h.size()[2]]);
        (h, flat)
    };
    if !train {
        let (_, flat) = tch::no_grad(forward);
        let out = lm_head_loss(&flat, heads.lm_head, &slots, &plan, chunk, false)?;
        return Ok(out.metrics);
    }
    let (h, flat) = forward();
    let out = tch::no_grad(|| lm_head_loss(&flat.detach(), heads.lm_head, &slots, &plan, chunk, true))?;
    let grad = out.grad.expect("requested").view_as(&h);
    let _p = span("drafter.backward");
    (h * grad).f_sum(Kind::Float)?.f_backward()?;
    Ok(out.metrics)
}

/// The slots' targets where the objective learns from the target's predictions: the target's argmax after the
/// position before each slot as its label or, for KL, the normed last states with the one each slot reads (whose
/// logits give the labels as the loss computes them).
struct TeacherTargets {
    /// `[B * N * bs]`, with [`Teacher::Argmax`].
    labels: Option<Tensor>,
    /// `[B * S, H]` and `[B * N * bs]`, with [`Teacher::Distribution`].
    states: Option<(Tensor, Tensor)>,
}

impl TeacherTargets {
    /// `None` where the slots learn the data's tokens.
    fn new(
        teacher: Teacher,
        batch: &MicroBatch,
        lm_head: &Tensor,
        plan: &PlanTensors,
        chunk_rows: i64,
    ) -> Result<Option<Self>, ModelError> {
        let (Some(last), true) = (batch.target_last, teacher.needs_target_predictions()) else {
            return Ok(None);
        };
        let _p = span("target.predictions");
        let (b, s) = (last.size()[0], last.size()[1]);
        let states = last.f_reshape([b * s, -1])?;
        // Slot at position p reads the state at p - 1 of its row (slot 0 and slots past the row weigh nothing: any
        // index in the row serves them).
        let rows = (plan.positions.f_sub_scalar(1)?.f_clamp(0, s - 1)?
            + Tensor::f_arange(b, (Kind::Int64, last.device()))?.f_mul_scalar(s)?.f_unsqueeze(1)?)
        .f_reshape([-1])?;
        if teacher == Teacher::Distribution {
            return Ok(Some(TeacherTargets { labels: None, states: Some((states, rows)) }));
        }
        let labels = tch::no_grad(|| target_argmax(&states, lm_head, chunk_rows))?.f_index_select(0, &rows)?;
        Ok(Some(TeacherTargets { labels: Some(labels), states: None }))
    }

    fn distribution(&self) -> Option<TargetStates<'_>> {
        self.states.as_ref().map(|(states, rows)| TargetStates { states, rows })
    }
}

/// The target's next-token choice after each of `states [positions, H]`: the argmax of its LM head, `chunk_rows`
/// positions at a time.
fn target_argmax(states: &Tensor, lm_head: &Tensor, chunk_rows: i64) -> Result<Tensor, ModelError> {
    let n = states.size()[0];
    let step = chunk_rows.max(1);
    let chunks = (0..n)
        .step_by(step as usize)
        .map(|start| {
            crate::model::choice::greedy_tokens(
                &states.f_narrow(0, start, step.min(n - start))?.f_linear(lm_head, None::<Tensor>)?,
            )
        })
        .collect::<Result<Vec<Tensor>, ModelError>>()?;
    Ok(Tensor::f_cat(&chunks, 0)?)
}

/// The objective's settings a reload may change; each drafter's forward reads them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ObjectiveKnobs {
    pub num_anchors: usize,
    pub gamma: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Depth, Preset};

    /// On a GPU: the fused softmax kernels run (the test fails if they cannot be built) and give what the libtorch
    /// operations give, within one bf16 rounding; without a gradient the logits are left alone.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_fused_chunk_softmax_matches_libtorch() {
        let dev = crate::device::gpu_for_tests();
        let (rows, vocab) = (37, 1000);
        // Row 0 is confident in its label (rest near 0, the log1p branch); the others are spread out.
        let logits = Tensor::randn([rows, vocab], (Kind::Float, dev)) * 3.0;
        let labels = Tensor::randint(vocab, [rows], (Kind::Int64, dev));
        let _ = logits.get(0).index_fill_(0, &labels.get(0).unsqueeze(0), 40.0);
        let _ = logits.get(1).index_fill_(0, &Tensor::from_slice(&[900i64, 3]).to(dev), 30.0);
        let _ = logits.get(2).index_fill_(0, &Tensor::from_slice(&[5i64, 6, 999]).to(dev), 30.0);
        let logits = logits.to_kind(Kind::BFloat16);
        let w = Tensor::rand([rows], (Kind::Float, dev)) + 0.1;
        let fused_ran = crate::model::fused::softmax_rows(&mut logits.copy(), &labels, &w, false).is_some();
        assert!(fused_ran, "the fused kernels did not run (see the warning above)");
        for want_grad in [true, false] {
            let fused = chunk_softmax(logits.copy(), &labels, &w, want_grad).unwrap();
            let plain = chunk_softmax_plain(logits.copy(), &labels, &w, want_grad).unwrap();
            let max_rel = |a: &Tensor, b: &Tensor| ((a - b).abs() / (b.abs() + 1e-30)).max().double_value(&[]);
            assert!(fused.max_logit.equal(&plain.max_logit));
            assert!(fused.label_logit.equal(&plain.label_logit));
            // Both choose by the one rule: the lowest id among equal maxima (rows 1 and 2 hold exact ties).
            assert!(fused.argmax.equal(&plain.argmax));
            assert_eq!(Vec::<i64>::try_from(plain.argmax.narrow(0, 1, 2)).unwrap(), [3, 5]);
            assert!(max_rel(&fused.p_max, &plain.p_max) <= 1.0 / 128.0);
            assert!(max_rel(&fused.rest, &plain.rest) <= 1e-3, "rest {}", max_rel(&fused.rest, &plain.rest));
            assert!(fused.rest.get(0).double_value(&[]) < 1e-6);
            match (fused.grad, plain.grad) {
                (Some(f), Some(p)) => {
                    let err = (f.to_kind(Kind::Float) - p.to_kind(Kind::Float)).abs().max().double_value(&[]);
                    assert!(err <= 1.1 / 128.0, "gradient differs by {err}");
                }
                (None, None) => assert!(!want_grad),
                _ => panic!("one path returned a gradient, the other not"),
            }
        }
    }

    /// On a GPU: the fused KL kernel runs and gives what the libtorch operations give: the loss within f32's
    /// summation error, the same argmax, the gradient within one bf16 rounding; without a gradient the logits are
    /// left alone.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_fused_chunk_kl_matches_libtorch() {
        let dev = crate::device::gpu_for_tests();
        let (rows, vocab) = (37, 1000);
        let target = Tensor::randn([rows, vocab], (Kind::Float, dev)) * 3.0;
        // Row 0: the drafter agrees with the target (a KL near 0); row 1: one confident target token; row 2: the
        // drafter's maximum tied between ids 3 and 900.
        let logits = Tensor::randn([rows, vocab], (Kind::Float, dev)) * 3.0;
        logits.get(0).copy_(&target.get(0));
        let _ = target.get(1).index_fill_(0, &Tensor::from_slice(&[7i64]).to(dev), 40.0);
        let _ = logits.get(2).index_fill_(0, &Tensor::from_slice(&[900i64, 3]).to(dev), 30.0);
        let (logits, target) = (logits.to_kind(Kind::BFloat16), target.to_kind(Kind::BFloat16));
        let w = Tensor::rand([rows], (Kind::Float, dev)) + 0.1;
        let untouched = logits.copy();
        let fused_ran = crate::model::fused::kl_rows(&mut untouched.shallow_clone(), &target, &w, false).is_some();
        assert!(fused_ran, "the fused kernels did not run (see the warning above)");
        assert!(untouched.equal(&logits), "without a gradient the logits are left alone");
        for want_grad in [true, false] {
            let fused = chunk_kl(logits.copy(), target.copy(), &w, want_grad).unwrap();
            let plain = chunk_kl_plain(logits.copy(), target.copy(), &w, want_grad).unwrap();
            let loss_err = ((&fused.loss - &plain.loss).abs() - plain.loss.abs() * 1e-4).max().double_value(&[]);
            assert!(loss_err <= 1e-5, "the losses differ by {loss_err} beyond 1e-4 of theirs");
            assert!(fused.loss.get(0).double_value(&[]).abs() < 1e-5, "equal distributions, no divergence");
            assert!(fused.argmax.equal(&plain.argmax));
            assert_eq!(plain.argmax.get(2).int64_value(&[]), 3);
            match (fused.grad, plain.grad) {
                (Some(f), Some(p)) => {
                    let (f, p) = (f.to_kind(Kind::Float), p.to_kind(Kind::Float));
                    let err = ((&f - &p).abs() - p.abs() / 128.0).max().double_value(&[]);
                    assert!(err <= 1e-6, "the gradients differ by {err} beyond one bf16 rounding");
                }
                (None, None) => assert!(!want_grad),
                _ => panic!("one path returned a gradient, the other not"),
            }
        }
    }

    fn settings(bs: usize, gamma: Option<f64>) -> ObjectiveSettings {
        ObjectiveSettings::new(8, bs, gamma, 99)
    }

    /// On a GPU a plan's rows hold a multiple of the attention group (a power of two below one), so that attention's
    /// shapes recur; on the CPU exactly the anchors.
    #[test]
    fn planned_blocks_recur_on_a_gpu() {
        let gpu = |most| planned_blocks(most, Some(64));
        assert_eq!(
            [gpu(0), gpu(1), gpu(3), gpu(33), gpu(64), gpu(65), gpu(2047), gpu(2049)],
            [0, 1, 4, 64, 64, 128, 2048, 2112]
        );
        assert_eq!([planned_blocks(3, None), planned_blocks(65, None)], [3, 65]);
    }

    #[test]
    fn anchors_need_two_supervised_tokens_in_a_row() {
        assert_eq!(valid_anchors(&[0, 1, 1, 1, 0, 1, 1, 0]), vec![1, 2, 5]);
        assert_eq!(valid_anchors(&[1, 1]), vec![0]);
        assert!(valid_anchors(&[1]).is_empty() && valid_anchors(&[]).is_empty());
    }

    #[test]
    fn sampling_is_keyed_distinct_sorted_and_fresh_per_epoch() {
        let valid: Vec<usize> = (0..1000).collect();
        let a = sample_anchors(&valid, 50, &mut anchor_rng(1, 0, 7));
        assert_eq!(a, sample_anchors(&valid, 50, &mut anchor_rng(1, 0, 7)));
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a.len() == 50);
        assert_ne!(a, sample_anchors(&valid, 50, &mut anchor_rng(1, 1, 7)), "a new epoch draws anew");
        assert_ne!(a, sample_anchors(&valid, 50, &mut anchor_rng(1, 0, 8)));
        assert_ne!(a, sample_anchors(&valid, 50, &mut anchor_rng(2, 0, 7)));
        assert_eq!(sample_anchors(&[3, 9], 50, &mut anchor_rng(1, 0, 7)), vec![3, 9]);
    }

    #[test]
    fn weights_match_a_hand_computed_example() {
        // bs = 4, gamma = 2: slot weights 0, 1, exp(-1/2), exp(-1).
        let ids: Vec<i64> = (10..20).collect();
        let mask = [0, 0, 1, 1, 1, 0, 1, 1, 1, 1];
        let rows = [Row { input_ids: &ids, loss_mask: &mask }];
        let plan = BlockPlan::new(&rows, &[vec![2, 7]], 10, &settings(4, Some(2.0)));
        let (e1, e2) = ((-0.5f64).exp() as f32, (-1.0f64).exp() as f32);
        // Block at 2: positions 2..6, mask 1 1 1 0 -> w = [0, 1, e^-1/2, 0].
        // Block at 7: positions 7..11, 10 is past the end -> w = [0, 1, e^-1/2, 0].
        assert_eq!(plan.weights, vec![0.0, 1.0, e1, 0.0, 0.0, 1.0, e1, 0.0]);
        assert_eq!(plan.labels, vec![12, 13, 14, 15, 17, 18, 19, 0]);
        assert_eq!(plan.block_ids, vec![12, 99, 99, 99, 17, 99, 99, 99]);
        assert_eq!(plan.positions, vec![2, 3, 4, 5, 7, 8, 9, 10]);
        let no_decay = BlockPlan::new(&rows, &[vec![2]], 10, &settings(4, None));
        assert_eq!(no_decay.weights, vec![0.0, 1.0, 1.0, 0.0]);
        assert!(e2 < e1); // the decay keeps falling
        assert_eq!(slot_weight(3, Some(2.0)), e2);
    }

    #[test]
    fn rows_with_fewer_anchors_get_padding_blocks() {
        let ids: Vec<i64> = (0..8).collect();
        let mask = [1u8; 8];
        let rows = [Row { input_ids: &ids, loss_mask: &mask }, Row { input_ids: &ids[..4], loss_mask: &mask[..4] }];
        let plan = BlockPlan::new(&rows, &[vec![0, 2, 5], vec![1]], 8, &settings(2, None));
        assert_eq!(plan.blocks, 3);
        assert_eq!(plan.keep, vec![true, true, true, true, false, false]);
        assert_eq!(plan.kept_blocks(), 4);
        assert_eq!(&plan.block_ids[8..], &[99, 99, 99, 99]);
        assert!(plan.weights[8..].iter().all(|&w| w == 0.0));
    }

    /// A fixture `scripts/fixtures/make_recipe_fixtures.py` wrote into tests/fixtures/.
    fn fixture(name: &str) -> serde_json::Value {
        crate::model::reference_fixture::read(name)
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }

    /// Equal within 2e-6, relative to values above 1.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 2e-6 * b.abs().max(1.0)
    }

    /// D-PACE as speculators 0.9.0 computes it (`scripts/fixtures/make_recipe_fixtures.py`): the slot weights, the loss and
    /// its gradient, for three alphas, with the LM head in chunks of 7 rows (two blocks a chunk: the chunking keeps
    /// blocks whole) over "hidden states" that are the logits themselves (an identity head).
    #[test]
    fn dpace_matches_speculators() {
        let fixture = fixture("dpace-speculators-0.9.0.json");
        let (bs, vocab) = (fixture["block_size"].as_u64().unwrap() as usize, fixture["vocab"].as_i64().unwrap());
        let labels: Vec<i64> = fixture["labels"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
        let mask = floats(&fixture["mask"]);
        let rows = labels.len();
        let blocks = rows / bs;
        let logits = Tensor::from_slice(&floats(&fixture["logits"])).view([rows as i64, vocab]);
        let keep: Vec<bool> = (0..blocks).map(|b| mask[b * bs..(b + 1) * bs].iter().any(|&m| m > 0.0)).collect();
        for case in fixture["cases"].as_array().unwrap() {
            let alpha = case["alpha"].as_f64().unwrap();
            let plan = BlockPlan {
                batch: 1,
                blocks,
                block_size: bs,
                seq_len: rows,
                anchors: (0..blocks as i64).map(|b| b * bs as i64).collect(),
                keep: keep.clone(),
                block_ids: vec![0; rows],
                positions: (0..rows as i64).collect(),
                labels: labels.clone(),
                weights: mask.clone(),
                dpace_alpha: Some(alpha),
                context_starts: None,
            };
            let (lab, w) = (Tensor::from_slice(&labels), Tensor::from_slice(&mask));
            let slots = SlotTargets::labels(&lab, &w);
            let out =
                lm_head_loss(&logits, &Tensor::eye(vocab, (Kind::Float, Device::Cpu)), &slots, &plan, 7, true).unwrap();
            let m = out.metrics;
            assert_eq!(m.weight, mask.iter().sum::<f32>() as f64, "the normaliser is the supervised slots");
            let norm = m.weight + 1e-5;
            let loss = case["loss"].as_f64().unwrap();
            assert!(
                close(m.weighted_loss / norm, loss),
                "alpha {alpha}: loss {} against {loss}",
                m.weighted_loss / norm
            );
            let grad = Vec::<f32>::try_from(out.grad.unwrap().view([-1]) / norm).unwrap();
            for (i, (g, e)) in grad.iter().zip(floats(&case["grad"])).enumerate() {
                assert!(close(*g as f64, e as f64), "alpha {alpha}: gradient {i}: {g} against {e}");
            }
            // The weights alone, from the same cross-entropies.
            let selected: Vec<i64> = (0..rows as i64).filter(|&r| mask[r as usize] > 0.0).collect();
            let sel = Tensor::from_slice(&selected);
            let ce = logits
                .log_softmax(-1, Kind::Float)
                .gather(1, &lab.unsqueeze(1), false)
                .squeeze_dim(1)
                .neg()
                .index_select(0, &sel);
            let blocks = selected[selected.len() - 1] / bs as i64 - selected[0] / bs as i64 + 1;
            let weights = Vec::<f32>::try_from(dpace_weights(&ce, &sel, bs as i64, blocks, alpha).unwrap()).unwrap();
            let expected = floats(&case["weights"]);
            for (w, &r) in weights.iter().zip(&selected) {
                assert!(close(*w as f64, expected[r as usize] as f64), "alpha {alpha}: weight of row {r}");
            }
        }
    }

    /// Learning the target's predictions as speculators 0.9.0 computes it (`scripts/fixtures/make_recipe_fixtures.py`): the
    /// cross-entropy against the target's argmax and the KL from its distribution, each with D-PACE (alpha 0.5) and
    /// with the decay (gamma 2), loss and gradient; identity heads over "hidden states" that are the logits, each
    /// slot reading its own row of the target's. speculators normalises the decay by the supervised slots where
    /// dflash normalises by the summed weights: the sums are compared, each divided by the fixture's normaliser.
    #[test]
    fn targets_from_the_target_match_speculators() {
        let fixture = fixture("teacher-speculators-0.9.0.json");
        let (bs, vocab) = (fixture["block_size"].as_u64().unwrap() as usize, fixture["vocab"].as_i64().unwrap());
        let mask = floats(&fixture["mask"]);
        let rows = mask.len();
        let blocks = rows / bs;
        let logits = Tensor::from_slice(&floats(&fixture["logits"])).view([rows as i64, vocab]);
        let targets = Tensor::from_slice(&floats(&fixture["targets"])).view([rows as i64, vocab]);
        let head = Tensor::eye(vocab, (Kind::Float, Device::Cpu));
        let labels = targets.argmax(-1, false);
        let own_rows = Tensor::arange(rows as i64, (Kind::Int64, Device::Cpu));
        let supervised = mask.iter().sum::<f32>() as f64 + 1e-5;
        let mut seen = vec![];
        for case in fixture["cases"].as_array().unwrap() {
            let (loss_fn, weighing) = (case["loss_fn"].as_str().unwrap(), case["weights"].as_str().unwrap());
            let dpace = weighing == "dpace";
            let s = ObjectiveSettings { dpace_alpha: dpace.then_some(0.5), ..settings(bs, Some(2.0)) };
            // The plan of blocks at 0, bs, 2 bs, ... over a row whose loss mask is the fixture's aligned mask (slot 0
            // of each block is an anchor: weight 0 either way).
            let ids = vec![0i64; rows];
            let row_mask: Vec<u8> = mask.iter().map(|&m| m as u8).collect();
            let anchors: Vec<usize> = (0..blocks).map(|b| b * bs).collect();
            let plan = BlockPlan::new(&[Row { input_ids: &ids, loss_mask: &row_mask }], &[anchors], rows, &s);
            let w = Tensor::from_slice(&plan.weights);
            let distribution = (loss_fn == "kl").then_some(TargetStates { states: &targets, rows: &own_rows });
            let slots = SlotTargets { labels: Some(&labels), weights: &w, distribution, selector: None };
            let out = lm_head_loss(&logits, &head, &slots, &plan, 7, true).unwrap();
            let loss = out.metrics.weighted_loss / supervised;
            let expected = case["loss"].as_f64().unwrap();
            assert!(close(loss, expected), "{loss_fn} {weighing}: loss {loss} against {expected}");
            let grad = Vec::<f32>::try_from(out.grad.as_ref().unwrap().view([-1]) / supervised).unwrap();
            for (i, (g, e)) in grad.iter().zip(floats(&case["grad"])).enumerate() {
                assert!(close(*g as f64, e as f64), "{loss_fn} {weighing}: gradient {i}: {g} against {e}");
            }
            // Accuracy counts the target's argmax whatever the loss; with KL and no labels given, the same argmax
            // from the target's logits as the loss computes them.
            let agree = logits.argmax(-1, false).eq_tensor(&labels).to_kind(Kind::Float) * Tensor::from_slice(&mask);
            assert_eq!(out.metrics.correct, agree.sum(Kind::Double).double_value(&[]), "{loss_fn} {weighing}");
            if let Some(distribution) = slots.distribution {
                let slots = SlotTargets { labels: None, distribution: Some(distribution), ..slots };
                let unlabelled = lm_head_loss(&logits, &head, &slots, &plan, 7, true).unwrap();
                assert_eq!(unlabelled.metrics, out.metrics, "{loss_fn} {weighing}");
                assert!(unlabelled.grad.unwrap().equal(out.grad.as_ref().unwrap()));
            }
            seen.push(format!("{loss_fn} {weighing}"));
        }
        assert_eq!(seen, ["ce dpace", "ce decay", "kl dpace", "kl decay"]);
    }

    #[test]
    fn chunks_end_where_blocks_end() {
        // Blocks of 4: rows 1-3 (block 0), 5-7 (1), 9 (2), 13-15 (3).
        let selected = [1, 2, 3, 5, 6, 7, 9, 13, 14, 15];
        assert_eq!(whole_block_chunks(&selected, 4, 7), vec![(0, 7, 3), (7, 3, 1)]);
        assert_eq!(whole_block_chunks(&selected, 4, 5), vec![(0, 3, 1), (3, 4, 2), (7, 3, 1)]);
        // A chunk shorter than a block takes the block whole.
        assert_eq!(whole_block_chunks(&selected, 4, 2), vec![(0, 3, 1), (3, 3, 1), (6, 1, 1), (7, 3, 1)]);
        assert!(whole_block_chunks(&[], 4, 2).is_empty());
    }

    /// A slot at position `p` learns what the target predicts after `p - 1`: the argmax of its logits there, as
    /// `Target::logits` computes them over the whole row; and the states the KL reads are the ones whose LM head
    /// gives those logits.
    #[test]
    fn target_predictions_come_from_the_position_before_each_slot() {
        let target = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let rows: Vec<Vec<i64>> = vec![(0..19).map(|t| (t * 7 + 3) % 200).collect(), (0..12).collect()];
        let masks: Vec<Vec<u8>> = rows.iter().map(|r| (0..r.len()).map(|t| u8::from(t >= 2)).collect()).collect();
        let batch = crate::train::step::FeatureBatch::capture(
            &target,
            vec![0, 1],
            0,
            rows.clone(),
            masks,
            (Device::Cpu, Kind::Float),
            true,
        )
        .unwrap();
        let alone = target.capture(&Tensor::from_slice(&rows[0]).view([1, 19]), &[19]).unwrap();
        assert!(batch.target_hidden.get(0).allclose(&alone.get(0), 1e-5, 1e-5, false), "the taps are unchanged");
        let objective = ObjectiveSettings { teacher: Teacher::Distribution, ..ObjectiveSettings::new(8, 4, None, 9) };
        let anchors = vec![vec![2, 5, 15, 17], vec![3, 9, 10]];
        let batch_view = batch.micro_batch();
        let plan = BlockPlan::new(&batch_view.rows, &anchors, batch_view.seq_len(), &objective);
        let t = PlanTensors::new(&plan, &objective, Kind::Float, Device::Cpu).unwrap();
        let teacher = |teacher| TeacherTargets::new(teacher, &batch_view, target.lm_head(), &t, 5).unwrap().unwrap();
        let (argmax, distribution) = (teacher(Teacher::Argmax), teacher(Teacher::Distribution));
        assert!(argmax.states.is_none() && distribution.labels.is_none(), "each takes what its loss reads");
        let labels = Vec::<i64>::try_from(argmax.labels.as_ref().unwrap()).unwrap();
        let (states, state_rows) = distribution.states.as_ref().unwrap();
        let state_rows = Vec::<i64>::try_from(state_rows).unwrap();
        let seq = batch_view.seq_len() as i64;
        let mut checked = 0;
        for (b, row) in rows.iter().enumerate() {
            let logits = target.logits(&Tensor::from_slice(row).view([1, -1]), &[row.len() as i64]).unwrap().get(0);
            for slot in 0..plan.blocks * plan.block_size {
                let at = b * plan.blocks * plan.block_size + slot;
                if plan.weights[at] == 0.0 {
                    continue;
                }
                let p = plan.positions[at];
                let expected = logits.get(p - 1).argmax(-1, false).int64_value(&[]);
                assert_eq!(labels[at], expected, "row {b}, slot {slot} at position {p}");
                let state = states.get(state_rows[at]);
                let from_state = state.unsqueeze(0).linear(target.lm_head(), None::<Tensor>).get(0);
                assert!(from_state.allclose(&logits.get(p - 1), 1e-4, 1e-4, false), "row {b}, position {p}");
                assert_eq!(state_rows[at], b as i64 * seq + p - 1);
                checked += 1;
            }
        }
        assert!(checked >= 15, "{checked} slots checked");
        // A random target's choices are not the data's tokens: the labels are the target's.
        assert_ne!(labels, plan.labels);
    }
}
