//! One training step in the compute core, with no actors: features in, metrics out, parameters updated. The
//! service calls it from a drafter's compute thread; `bench` and `eval` call it directly.
//!
//! A step is split where data parallelism needs the seam: [`Trainer::accumulate`] runs forward and backward of one
//! micro-batch and adds the gradient of the weighted loss SUM to the flat gradient; [`Trainer::apply`] divides by
//! the summed loss weight (of every micro-batch, and later of every replica), clips, and updates. A step whose
//! gradient norm is not finite changes nothing and is reported as skipped.
use tch::{Device, Kind, Tensor};

use crate::model::{Drafter, ModelError, Target};
use crate::profile::span;
use crate::train::objective::ObjectiveKnobs;
use crate::train::objective::{
    BlockPlan, Metrics, ObjectiveSettings, PlanTensors, Row, anchor_rng, lm_head_loss, sample_anchors, valid_anchors,
};
use crate::train::optim::{Hyper, Optimizer, UpdateSettings, clip_factor};

/// A batch of conversations with the target's tapped states: what the target hands a drafter.
pub struct FeatureBatch {
    /// Stable ids of the samples (they key the anchor RNG).
    pub sample_ids: Vec<u64>,
    pub epoch: u64,
    /// Unpadded rows.
    pub input_ids: Vec<Vec<i64>>,
    pub loss_mask: Vec<Vec<u8>>,
    /// `[B, S, n*H]` on the drafter's device, in its compute dtype; `S` is the longest row.
    pub target_hidden: Tensor,
}

impl FeatureBatch {
    /// Runs `target` on right-padded rows and keeps the tapped states, cast to `kind` on `device` (the drafter's).
    pub fn capture(
        target: &Target,
        sample_ids: Vec<u64>,
        epoch: u64,
        input_ids: Vec<Vec<i64>>,
        loss_mask: Vec<Vec<u8>>,
        device: Device,
        kind: Kind,
    ) -> Result<Self, TrainError> {
        let longest = input_ids.iter().map(Vec::len).max().unwrap_or(0);
        if longest == 0 {
            return Err(TrainError::Batch("a batch needs at least one non-empty row".into()));
        }
        let pad = target.config().pad_token_id.unwrap_or(0);
        let mut flat = Vec::with_capacity(input_ids.len() * longest);
        for row in &input_ids {
            flat.extend_from_slice(row);
            flat.extend(std::iter::repeat_n(pad, longest - row.len()));
        }
        let lengths: Vec<i64> = input_ids.iter().map(|r| r.len() as i64).collect();
        let ids =
            Tensor::f_from_slice(&flat)?.f_view([input_ids.len() as i64, longest as i64])?.f_to(target.device())?;
        let _p = span("target.capture");
        let target_hidden = target.capture(&ids, &lengths)?.f_to_device(device)?.f_to_kind(kind)?;
        Ok(FeatureBatch { sample_ids, epoch, input_ids, loss_mask, target_hidden })
    }

    fn rows(&self) -> Vec<Row<'_>> {
        self.input_ids.iter().zip(&self.loss_mask).map(|(ids, mask)| Row { input_ids: ids, loss_mask: mask }).collect()
    }
    fn seq_len(&self) -> usize {
        self.target_hidden.size()[1] as usize
    }
}

/// Everything a reload may change in the training step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSettings {
    pub hyper: Hyper,
    pub objective: ObjectiveKnobs,
}

/// What an update did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct UpdateReport {
    /// Global norm of the averaged gradient, before clipping.
    pub grad_norm: f64,
    /// False when the update was skipped on every replica (the norm was not finite, or a sum across hosts did not
    /// complete).
    pub applied: bool,
    pub lr: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid batch: {0}")]
    Batch(String),
}

impl From<tch::TchError> for TrainError {
    fn from(e: tch::TchError) -> Self {
        TrainError::Model(e.into())
    }
}

/// A drafter with its optimizer and the target's frozen embedding and LM head.
pub struct Trainer {
    pub drafter: Drafter,
    pub optimizer: Optimizer,
    embed: Tensor,
    lm_head: Tensor,
    pub objective: ObjectiveSettings,
    /// Keys the anchor RNG together with epoch and sample id.
    pub seed: u64,
}

impl Trainer {
    /// `optimizer` is the state of `drafter`'s parameters (fresh, or loaded from a checkpoint); `embed` and `lm_head`
    /// (`[V, H]`, frozen) come from the target, on the drafter's device in its dtype.
    pub fn new(
        drafter: Drafter,
        optimizer: Optimizer,
        embed: Tensor,
        lm_head: Tensor,
        objective: ObjectiveSettings,
        seed: u64,
    ) -> Trainer {
        Trainer { drafter, optimizer, embed: embed.detach(), lm_head: lm_head.detach(), objective, seed }
    }

    /// Forward and backward of one micro-batch at freshly sampled anchors; returns its metric sums.
    pub fn accumulate(&mut self, batch: &FeatureBatch) -> Result<Metrics, TrainError> {
        check(&self.drafter, batch)?;
        let anchors: Vec<Vec<usize>> = batch
            .loss_mask
            .iter()
            .zip(&batch.sample_ids)
            .map(|(mask, &id)| {
                let mut rng = anchor_rng(self.seed, batch.epoch, id);
                sample_anchors(&valid_anchors(mask), self.objective.num_anchors, &mut rng)
            })
            .collect();
        run_blocks(&self.drafter, &self.heads(), &self.objective, batch, &anchors, true)
    }

    /// Evaluates every valid anchor (see [`evaluate_batch`]); nothing is updated.
    pub fn evaluate(&self, batch: &FeatureBatch) -> Result<Metrics, TrainError> {
        evaluate_batch(&self.drafter, &self.heads(), &self.objective, batch)
    }

    /// Divides the accumulated gradient by `total_weight`, clips it, and applies the optimizer unless its norm is not
    /// finite; the gradient is zeroed either way.
    pub fn apply(&mut self, total_weight: f64, settings: &UpdateSettings) -> Result<UpdateReport, TrainError> {
        let _p = span("optimizer");
        let divisor = total_weight.max(1e-6);
        let params = self.drafter.params();
        let grad_norm = params.grad.f_norm()?.f_double_value(&[])? / divisor;
        let applied = grad_norm.is_finite();
        if applied {
            let clip = clip_factor(grad_norm, settings.grad_clip);
            self.optimizer.update(params, settings, divisor / clip)?;
        }
        self.drafter.params_mut().zero_grad();
        Ok(UpdateReport { grad_norm, applied, lr: settings.adamw.lr })
    }

    /// One whole step over `micro_batches`: accumulate each, then update with their summed weight.
    pub fn train_step(
        &mut self,
        micro_batches: &[FeatureBatch],
        settings: &UpdateSettings,
    ) -> Result<(Metrics, UpdateReport), TrainError> {
        let mut metrics = Metrics::default();
        for batch in micro_batches {
            metrics.add(&self.accumulate(batch)?);
        }
        let report = self.apply(metrics.weight, settings)?;
        Ok((metrics, report))
    }

    fn heads(&self) -> FrozenHeads<'_> {
        FrozenHeads { embed: &self.embed, lm_head: &self.lm_head }
    }
}

/// The target's frozen embedding and LM head (`[V, H]`, on the drafter's device in its dtype).
pub struct FrozenHeads<'a> {
    pub embed: &'a Tensor,
    pub lm_head: &'a Tensor,
}

/// Evaluates every valid anchor of every row (no sampling: deterministic), `num_anchors` blocks per row per
/// forward pass, without gradients.
pub fn evaluate_batch(
    drafter: &Drafter,
    heads: &FrozenHeads,
    objective: &ObjectiveSettings,
    batch: &FeatureBatch,
) -> Result<Metrics, TrainError> {
    check(drafter, batch)?;
    let all: Vec<Vec<usize>> = batch.loss_mask.iter().map(|m| valid_anchors(m)).collect();
    let per_pass = objective.num_anchors.max(1);
    let passes = all.iter().map(|a| a.len().div_ceil(per_pass)).max().unwrap_or(0);
    let mut total = Metrics::default();
    for pass in 0..passes {
        let chunk: Vec<Vec<usize>> =
            all.iter().map(|a| a.iter().skip(pass * per_pass).take(per_pass).copied().collect()).collect();
        total.add(&run_blocks(drafter, heads, objective, batch, &chunk, false)?);
    }
    Ok(total)
}

fn check(drafter: &Drafter, batch: &FeatureBatch) -> Result<(), TrainError> {
    let n = batch.input_ids.len();
    let size = batch.target_hidden.size();
    let width = drafter.config().context_width() as i64;
    let longest = batch.input_ids.iter().map(Vec::len).max().unwrap_or(0);
    let bad = |m: String| Err(TrainError::Batch(m));
    if n == 0 || batch.loss_mask.len() != n || batch.sample_ids.len() != n {
        return bad(format!(
            "{n} rows, {} loss masks, {} sample ids: need the same non-zero count",
            batch.loss_mask.len(),
            batch.sample_ids.len()
        ));
    }
    if let Some(i) = (0..n).find(|&i| batch.input_ids[i].len() != batch.loss_mask[i].len()) {
        return bad(format!("row {i}: input_ids and loss_mask differ in length"));
    }
    if size.len() != 3 || size[0] != n as i64 || size[1] < longest as i64 || size[2] != width {
        return bad(format!(
            "target_hidden is {size:?}; expected [{n}, >= {longest}, {width}] (rows, tokens, taps * hidden)"
        ));
    }
    Ok(())
}

/// Plans blocks at `anchors`, runs the drafter and the LM head; with `train`, backpropagates the weighted loss sum
/// into the drafter's flat gradient.
fn run_blocks(
    drafter: &Drafter,
    heads: &FrozenHeads,
    objective: &ObjectiveSettings,
    batch: &FeatureBatch,
    anchors: &[Vec<usize>],
    train: bool,
) -> Result<Metrics, TrainError> {
    let rows = batch.rows();
    let plan = BlockPlan::new(&rows, anchors, batch.seq_len(), objective);
    if plan.kept_blocks() == 0 {
        return Ok(Metrics::default());
    }
    let t = PlanTensors::new(&plan, objective, drafter.kind(), drafter.device())?;
    let forward = || {
        let emb = Tensor::embedding(heads.embed, &t.block_ids, -1, false, false);
        let h = drafter.forward(&batch.target_hidden, &emb, &t.positions, &t.attention);
        let flat = h.view([-1, h.size()[2]]);
        (h, flat)
    };
    let chunk = objective.lm_head_chunk_rows;
    if !train {
        let (_, flat) = tch::no_grad(forward);
        let out = lm_head_loss(&flat, heads.lm_head, &t.labels, &t.weights, &plan, chunk, false)?;
        return Ok(out.metrics);
    }
    let (h, flat) = forward();
    let out = tch::no_grad(|| lm_head_loss(&flat.detach(), heads.lm_head, &t.labels, &t.weights, &plan, chunk, true))?;
    let grad = out.grad.expect("requested").view_as(&h);
    let _p = span("drafter.backward");
    (h * grad).f_sum(Kind::Float)?.f_backward()?;
    Ok(out.metrics)
}
