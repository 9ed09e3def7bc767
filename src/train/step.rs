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
pub use crate::train::objective::FrozenHeads;
use crate::train::objective::ObjectiveKnobs;
use crate::train::objective::{
    Metrics, MicroBatch, ObjectiveSettings, Row, anchor_rng, micro_batch_loss, sample_anchors, valid_anchors,
};
use crate::train::optim::{Hyper, Optimizer, UpdateSettings, clip_factor};

/// A batch of conversations with the target's tapped states: what the target hands a drafter.
pub struct FeatureBatch {
    /// Stable ids of the samples (they key the anchor RNG), one per conversation in row order.
    pub sample_ids: Vec<u64>,
    pub epoch: u64,
    /// Unpadded rows.
    pub input_ids: Vec<Vec<i64>>,
    pub loss_mask: Vec<Vec<u8>>,
    /// Packed rows (`data.pack`): the lengths of each row's conversations, in order. `None`: one per row.
    pub conversations: Option<Vec<Vec<usize>>>,
    /// `[B, S, n*H]` on the drafter's device, in its compute dtype; `S` is the longest row.
    pub target_hidden: Tensor,
    /// `[B, S, H]`, like `target_hidden`: the target's last states after its final norm, whose LM head gives its
    /// next-token predictions; present where the objective learns from them ([`Teacher::needs_target_predictions`]).
    pub target_last: Option<Tensor>,
}

impl FeatureBatch {
    /// Runs `target` on right-padded rows and keeps the tapped states (and, `with_last`, the normed last states:
    /// needs a [`Depth::Full`](crate::model::Depth) target), cast to `to`'s dtype on its device (the drafter's).
    pub fn capture(
        target: &Target,
        sample_ids: Vec<u64>,
        epoch: u64,
        input_ids: Vec<Vec<i64>>,
        loss_mask: Vec<Vec<u8>>,
        to: (Device, Kind),
        with_last: bool,
    ) -> Result<Self, TrainError> {
        Self::capture_packed(target, sample_ids, epoch, input_ids, loss_mask, None, to, with_last)
    }

    /// [`FeatureBatch::capture`] of rows that hold several conversations each (`conversations`: their lengths per
    /// row), captured as [`Target::capture_packed`] does: each conversation as if alone.
    #[allow(clippy::too_many_arguments)]
    pub fn capture_packed(
        target: &Target,
        sample_ids: Vec<u64>,
        epoch: u64,
        input_ids: Vec<Vec<i64>>,
        loss_mask: Vec<Vec<u8>>,
        conversations: Option<Vec<Vec<usize>>>,
        to: (Device, Kind),
        with_last: bool,
    ) -> Result<Self, TrainError> {
        let (device, kind) = to;
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
        let moved = |t: Tensor| -> Result<Tensor, TrainError> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let (taps, last) = match &conversations {
            Some(rows) => {
                let rows: Vec<Vec<i64>> = rows.iter().map(|r| r.iter().map(|&l| l as i64).collect()).collect();
                target.capture_packed(&ids, &rows, with_last)?
            }
            None if with_last => {
                let (taps, last) = target.capture_with_last(&ids, &lengths)?;
                (taps, Some(last))
            }
            None => (target.capture(&ids, &lengths)?, None),
        };
        let (target_hidden, target_last) = (moved(taps)?, last.map(moved).transpose()?);
        Ok(FeatureBatch { sample_ids, epoch, input_ids, loss_mask, conversations, target_hidden, target_last })
    }

    /// Each conversation: its row, where it starts in the row, its length and its sample id, in row order.
    fn conversations(&self) -> Vec<(usize, usize, usize, u64)> {
        let mut ids = self.sample_ids.iter().copied();
        let mut out = Vec::with_capacity(self.sample_ids.len());
        for (row, tokens) in self.input_ids.iter().enumerate() {
            let lengths = match &self.conversations {
                Some(c) => c[row].clone(),
                None => vec![tokens.len()],
            };
            let mut start = 0;
            for len in lengths {
                // `check` made sure there is an id per conversation.
                out.push((row, start, len, ids.next().unwrap_or_default()));
                start += len;
            }
        }
        out
    }

    /// Per row, the anchors `pick` chooses in each of its conversations (given the conversation's loss mask and
    /// sample id), in row positions.
    fn anchors(&self, mut pick: impl FnMut(&[u8], u64) -> Vec<usize>) -> Vec<Vec<usize>> {
        let mut anchors = vec![Vec::new(); self.input_ids.len()];
        for (row, start, len, id) in self.conversations() {
            let mask = &self.loss_mask[row][start..start + len];
            anchors[row].extend(pick(mask, id).into_iter().map(|a| a + start));
        }
        anchors
    }

    /// The batch as the objective reads it.
    pub fn micro_batch(&self) -> MicroBatch<'_> {
        MicroBatch {
            rows: self
                .input_ids
                .iter()
                .zip(&self.loss_mask)
                .map(|(ids, mask)| Row { input_ids: ids, loss_mask: mask })
                .collect(),
            conversations: self.conversations.as_deref(),
            target_hidden: &self.target_hidden,
            target_last: self.target_last.as_ref(),
        }
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
        check(&self.drafter, &self.objective, batch)?;
        let anchors = batch.anchors(|mask, id| {
            let mut rng = anchor_rng(self.seed, batch.epoch, id);
            sample_anchors(&valid_anchors(mask), self.objective.num_anchors, &mut rng)
        });
        Ok(micro_batch_loss(&self.drafter, &self.heads(), &self.objective, &batch.micro_batch(), &anchors, true)?)
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

/// Evaluates every valid anchor of every row (no sampling: deterministic), `num_anchors` blocks per row per
/// forward pass, without gradients.
pub fn evaluate_batch(
    drafter: &Drafter,
    heads: &FrozenHeads,
    objective: &ObjectiveSettings,
    batch: &FeatureBatch,
) -> Result<Metrics, TrainError> {
    evaluate_at(drafter, heads, objective, batch, &batch.anchors(|mask, _| valid_anchors(mask)))
}

/// Scores `drafter` at the given anchors of each row (ascending, each valid: `loss_mask[a] = loss_mask[a + 1] = 1`),
/// `objective.num_anchors` blocks a pass; nothing is updated. One anchor alone gives that block's teacher-forced
/// acceptance length (`Metrics::accepted`): what the consistency oracle compares with decoding.
pub fn evaluate_at(
    drafter: &Drafter,
    heads: &FrozenHeads,
    objective: &ObjectiveSettings,
    batch: &FeatureBatch,
    all: &[Vec<usize>],
) -> Result<Metrics, TrainError> {
    check(drafter, objective, batch)?;
    let per_pass = objective.num_anchors.max(1);
    let passes = all.iter().map(|a| a.len().div_ceil(per_pass)).max().unwrap_or(0);
    let mut total = Metrics::default();
    let view = batch.micro_batch();
    for pass in 0..passes {
        let chunk: Vec<Vec<usize>> =
            all.iter().map(|a| a.iter().skip(pass * per_pass).take(per_pass).copied().collect()).collect();
        total.add(&micro_batch_loss(drafter, heads, objective, &view, &chunk, false)?);
    }
    Ok(total)
}

fn check(drafter: &Drafter, objective: &ObjectiveSettings, batch: &FeatureBatch) -> Result<(), TrainError> {
    let n = batch.input_ids.len();
    let size = batch.target_hidden.size();
    let width = drafter.config().context_width() as i64;
    let longest = batch.input_ids.iter().map(Vec::len).max().unwrap_or(0);
    let bad = |m: String| Err(TrainError::Batch(m));
    let conversations = batch.conversations.as_ref().map_or(n, |c| c.iter().map(Vec::len).sum());
    if n == 0 || batch.loss_mask.len() != n || batch.sample_ids.len() != conversations {
        return bad(format!(
            "{n} rows, {} loss masks, {} sample ids for {conversations} conversations: need as many loss masks as \
             rows and a sample id per conversation",
            batch.loss_mask.len(),
            batch.sample_ids.len()
        ));
    }
    if let Some(c) = &batch.conversations
        && let Some(i) = (0..n).find(|&i| c.get(i).is_none_or(|l| l.iter().sum::<usize>() != batch.input_ids[i].len()))
    {
        return bad(format!("row {i}: its conversations' lengths do not add up to the row's"));
    }
    if let Some(i) = (0..n).find(|&i| batch.input_ids[i].len() != batch.loss_mask[i].len()) {
        return bad(format!("row {i}: input_ids and loss_mask differ in length"));
    }
    if size.len() != 3 || size[0] != n as i64 || size[1] < longest as i64 || size[2] != width {
        return bad(format!(
            "target_hidden is {size:?}; expected [{n}, >= {longest}, {width}] (rows, tokens, taps * hidden)"
        ));
    }
    let hidden = drafter.config().decoder.hidden_size as i64;
    match (&batch.target_last, objective.teacher.needs_target_predictions()) {
        (None, true) => {
            return bad(format!(
                "the objective learns from the target's predictions ({:?}) but the batch carries none of its last \
                 states",
                objective.teacher
            ));
        }
        (Some(last), _) if last.size() != [size[0], size[1], hidden] => {
            return bad(format!("target_last is {:?}; expected [{n}, {}, {hidden}]", last.size(), size[1]));
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::tiny;
    use crate::model::{Depth, Preset};
    use crate::train::objective::Teacher;

    /// An objective that learns from the target refuses a batch without the target's last states.
    #[test]
    fn a_batch_without_the_targets_states_is_refused_where_they_are_needed() {
        let target = Preset::Tiny.spec().build_target(Depth::ToLastTap, Device::Cpu, Kind::Float).unwrap();
        let cfg = crate::model::DrafterConfig::for_preset(Preset::Tiny, 4);
        let drafter = Drafter::new(cfg, Device::Cpu, Kind::Float, crate::model::Init::Portable(0)).unwrap();
        let optimizer = Optimizer::new(drafter.params(), crate::train::OptimizerKind::AdamW).unwrap();
        let objective =
            ObjectiveSettings { teacher: Teacher::Argmax, ..ObjectiveSettings::new(4, 4, None, tiny::MASK) };
        let (embed, head) = (target.embed_tokens().shallow_clone(), target.lm_head().shallow_clone());
        let mut trainer = Trainer::new(drafter, optimizer, embed, head, objective, 0);
        let row: Vec<i64> = (0..12).collect();
        let batch =
            FeatureBatch::capture(&target, vec![0], 0, vec![row], vec![vec![1; 12]], (Device::Cpu, Kind::Float), false)
                .unwrap();
        let err = trainer.accumulate(&batch).expect_err("refused").to_string();
        assert!(err.contains("target's predictions") && err.contains("Argmax"), "{err}");
        // And a target built only to its last tap cannot give them.
        let err = FeatureBatch::capture(
            &target,
            vec![0],
            0,
            vec![vec![1; 4]],
            vec![vec![1; 4]],
            (Device::Cpu, Kind::Float),
            true,
        )
        .err()
        .expect("refused")
        .to_string();
        assert!(!err.is_empty());
    }
}
