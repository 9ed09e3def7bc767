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
    BlockPlan, Metrics, ObjectiveSettings, PlanTensors, Row, SelectorTargets, SlotTargets, TargetStates, Teacher,
    anchor_rng, lm_head_loss, sample_anchors, valid_anchors,
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
        check(&self.drafter, &self.objective, batch)?;
        let anchors = batch.anchors(|mask, id| {
            let mut rng = anchor_rng(self.seed, batch.epoch, id);
            sample_anchors(&valid_anchors(mask), self.objective.num_anchors, &mut rng)
        });
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
    for pass in 0..passes {
        let chunk: Vec<Vec<usize>> =
            all.iter().map(|a| a.iter().skip(pass * per_pass).take(per_pass).copied().collect()).collect();
        total.add(&run_blocks(drafter, heads, objective, batch, &chunk, false)?);
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
    let device = drafter.device();
    let group = device.is_cuda().then(|| objective.group_blocks(device));
    let plan = BlockPlan::packed(&rows, anchors, batch.conversations.as_deref(), batch.seq_len(), group, objective);
    if plan.kept_blocks() == 0 {
        return Ok(Metrics::default());
    }
    let t = PlanTensors::new(&plan, objective, drafter.kind(), drafter.device())?;
    let chunk = objective.lm_head_chunk_rows;
    let teacher = TeacherTargets::new(objective.teacher, batch, heads.lm_head, &t, chunk)?;
    let predecessors = match drafter.config().variant.dflash2() {
        Some(_) => Some(t.predecessors(plan.block_size)?),
        None => None,
    };
    let slots = SlotTargets {
        labels: teacher.as_ref().map_or(&t.labels, |s| &s.labels),
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
        let h = drafter.forward(&batch.target_hidden, &emb, &t.positions, &t.attention);
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
/// position before each slot as its label and, for KL, the normed last states with the one each slot reads.
struct TeacherTargets {
    labels: Tensor,
    /// `[B * S, H]` and `[B * N * bs]`, with [`Teacher::Distribution`].
    states: Option<(Tensor, Tensor)>,
}

impl TeacherTargets {
    /// `None` where the slots learn the data's tokens.
    fn new(
        teacher: Teacher,
        batch: &FeatureBatch,
        lm_head: &Tensor,
        plan: &PlanTensors,
        chunk_rows: i64,
    ) -> Result<Option<Self>, TrainError> {
        let (Some(last), true) = (&batch.target_last, teacher.needs_target_predictions()) else {
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
        let labels = tch::no_grad(|| target_argmax(&states, lm_head, chunk_rows))?.f_index_select(0, &rows)?;
        let states = (teacher == Teacher::Distribution).then_some((states, rows));
        Ok(Some(TeacherTargets { labels, states }))
    }

    fn distribution(&self) -> Option<TargetStates<'_>> {
        self.states.as_ref().map(|(states, rows)| TargetStates { states, rows })
    }
}

/// The target's next-token choice after each of `states [positions, H]`: the argmax of its LM head, `chunk_rows`
/// positions at a time.
fn target_argmax(states: &Tensor, lm_head: &Tensor, chunk_rows: i64) -> Result<Tensor, TrainError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::tiny;
    use crate::model::{Depth, Preset};

    /// A slot at position `p` learns what the target predicts after `p - 1`: the argmax of its logits there, as
    /// `Target::logits` computes them over the whole row; and the states the KL reads are the ones whose LM head
    /// gives those logits.
    #[test]
    fn target_predictions_come_from_the_position_before_each_slot() {
        let target = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let rows: Vec<Vec<i64>> = vec![(0..19).map(|t| (t * 7 + 3) % 200).collect(), (0..12).collect()];
        let masks: Vec<Vec<u8>> = rows.iter().map(|r| (0..r.len()).map(|t| u8::from(t >= 2)).collect()).collect();
        let batch =
            FeatureBatch::capture(&target, vec![0, 1], 0, rows.clone(), masks, (Device::Cpu, Kind::Float), true)
                .unwrap();
        let alone = target.capture(&Tensor::from_slice(&rows[0]).view([1, 19]), &[19]).unwrap();
        assert!(batch.target_hidden.get(0).allclose(&alone.get(0), 1e-5, 1e-5, false), "the taps are unchanged");
        let objective = ObjectiveSettings { teacher: Teacher::Distribution, ..ObjectiveSettings::new(8, 4, None, 9) };
        let anchors = vec![vec![2, 5, 15, 17], vec![3, 9, 10]];
        let plan = BlockPlan::new(&batch.rows(), &anchors, batch.seq_len(), &objective);
        let t = PlanTensors::new(&plan, &objective, Kind::Float, Device::Cpu).unwrap();
        let teacher = TeacherTargets::new(objective.teacher, &batch, target.lm_head(), &t, 5).unwrap().unwrap();
        let labels = Vec::<i64>::try_from(&teacher.labels).unwrap();
        let (states, state_rows) = teacher.states.as_ref().unwrap();
        let state_rows = Vec::<i64>::try_from(state_rows).unwrap();
        let seq = batch.seq_len() as i64;
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
