//! Evaluation of a drafter on token rows: the target captures the tapped states, the drafter is scored at every
//! valid anchor (deterministic), and the sums become the report `dflash eval` prints.
use serde::Serialize;

use crate::data::TokenRow;
use crate::model::{Drafter, Target};
use crate::train::objective::FrozenHeads;
use crate::train::objective::{Metrics, ObjectiveSettings};
use crate::train::step::{FeatureBatch, TrainError, evaluate_batch};

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub loss: f64,
    pub accuracy: f64,
    pub acceptance_length: f64,
    /// Blocks scored (every valid anchor).
    pub blocks: f64,
    /// Tokens in the evaluated rows.
    pub tokens: usize,
    /// Positions scored (`w > 0`).
    pub predicted: f64,
    pub samples: usize,
    pub block_size: usize,
    /// How the loss weighed a block's slots: `decay` (by `gamma`) or `dpace` (by `dpace_alpha`).
    pub weights: &'static str,
    pub gamma: Option<f64>,
    pub dpace_alpha: Option<f64>,
}

/// Scores `drafter` on `rows`, `batch_size` rows per target pass (rows sorted by length to limit padding; the
/// result does not depend on the order).
pub fn evaluate_rows(
    target: &Target,
    drafter: &Drafter,
    objective: &ObjectiveSettings,
    rows: &[TokenRow],
    batch_size: usize,
) -> Result<EvalReport, TrainError> {
    let embed = target.embed_tokens().to_device(drafter.device()).to_kind(drafter.kind());
    let lm_head = target.lm_head().to_device(drafter.device()).to_kind(drafter.kind());
    let heads = FrozenHeads { embed: &embed, lm_head: &lm_head };
    let mut order: Vec<&TokenRow> = rows.iter().collect();
    order.sort_by_key(|r| r.input_ids.len());
    let mut total = Metrics::default();
    for chunk in order.chunks(batch_size.max(1)) {
        let batch = FeatureBatch::capture(
            target,
            chunk.iter().map(|r| r.id.key()).collect(),
            0,
            chunk.iter().map(|r| r.input_ids.clone()).collect(),
            chunk.iter().map(|r| r.loss_mask.clone()).collect(),
            (drafter.device(), drafter.kind()),
            objective.teacher.needs_target_predictions(),
        )?;
        total.add(&evaluate_batch(drafter, &heads, objective, &batch)?);
    }
    Ok(EvalReport {
        loss: total.loss(),
        accuracy: total.accuracy(),
        acceptance_length: total.acceptance_length(),
        blocks: total.blocks,
        tokens: rows.iter().map(|r| r.input_ids.len()).sum(),
        predicted: total.predicted,
        samples: rows.len(),
        block_size: objective.block_size,
        weights: if objective.dpace_alpha.is_some() { "dpace" } else { "decay" },
        gamma: objective.gamma.filter(|_| objective.dpace_alpha.is_none()),
        dpace_alpha: objective.dpace_alpha,
    })
}
