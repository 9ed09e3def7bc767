//! A completed round's bookkeeping (under the collective's lock), its gradients summed (outside it) and its result
//! as every member applies it.
use std::sync::Arc;

use tch::Tensor;

use super::ring::{GradientSum, Ring, RingMember};
use super::{CollectiveError, Contributed, Contribution, DeviceErrorText, RoundReport, RoundResult, State};
use crate::ffi::nccl::NcclId;
use crate::model::shared::SharedTensor;
use crate::train::link::HostRecord;
use crate::train::objective::ObjectiveKnobs;
use crate::train::optim::UpdateSettings;
use crate::train::rounds::{Completed, MemberId};

/// A completed round's bookkeeping, done under the lock before its gradients are summed.
pub(super) struct Plan {
    pub(super) sum: GradientSum,
    pub(super) ring: Option<Arc<Ring>>,
    pub(super) update: UpdateSettings,
    pub(super) next_objective: ObjectiveKnobs,
    pub(super) samples_committed: u64,
    pub(super) ring_error: Option<CollectiveError>,
    /// The run's loss weight, across hosts (`None`: this host's contributions').
    pub(super) total_weight: Option<f64>,
    /// Across hosts: the other members' records.
    pub(super) remote: Vec<HostRecord>,
}

/// Advances the settings, the progress and (within one host) the ring for a completed round. Across hosts the
/// ring waits for the run's round ([`Collective::run_ring`]).
pub(super) fn plan(s: &mut State, done: &Completed<Contribution>, across_hosts: bool) -> Plan {
    let step = done.step;
    if s.pending.is_some_and(|(from, _)| from <= step) {
        s.settings = s.settings_at(step);
        s.pending = None;
    }
    let mut ring_error = None;
    let ring = match s.sum {
        GradientSum::Nccl if !across_hosts => {
            let members: Vec<RingMember> = done
                .contributions
                .iter()
                .map(|&(member, generation, _)| RingMember { host: 0, host_generation: 0, member, generation })
                .collect();
            match s.rings.current(&members) {
                Some(ring) => Some(ring),
                None => match NcclId::new() {
                    Ok(id) => Some(s.rings.next(members, id)),
                    Err(e) => {
                        ring_error = Some(DeviceErrorText(e.to_string()).into());
                        None
                    }
                },
            }
        }
        _ => None,
    };
    let update = s.settings.hyper.update(step, s.samples_committed);
    let next_objective = s.settings_at(step + 1).objective;
    s.samples_committed += done.contributions.iter().map(|(.., c)| c.samples).sum::<u64>();
    Plan {
        sum: s.sum,
        ring,
        update,
        next_objective,
        samples_committed: s.samples_committed,
        ring_error,
        total_weight: None,
        remote: vec![],
    }
}

/// The contributions' gradients summed in member order (device copies), or `None` when NCCL sums them.
pub(super) fn sum_gradients(
    sum: GradientSum,
    contributions: &[(MemberId, u64, Contribution)],
) -> Result<Option<Tensor>, CollectiveError> {
    if sum == GradientSum::Nccl {
        return Ok(None);
    }
    let mut total: Option<Tensor> = None;
    for (_, _, c) in contributions {
        total = Some(match total {
            None if contributions.len() == 1 => c.grad.shallow_clone(),
            None => c.grad.f_detach_copy().map_err(|e| DeviceErrorText(e.to_string()))?,
            Some(mut acc) => {
                let part = c.grad.f_to_device(acc.device()).map_err(|e| DeviceErrorText(e.to_string()))?;
                let _ = acc.f_add_(&part).map_err(|e| DeviceErrorText(e.to_string()))?;
                acc
            }
        });
    }
    Ok(total)
}

/// The round's result (or its failure) and its report.
pub(super) fn finish(
    plan: Plan,
    done: Completed<Contribution>,
    summed: Result<Option<Tensor>, CollectiveError>,
) -> (Result<Arc<RoundResult>, CollectiveError>, RoundReport) {
    let Completed { step, incarnation, contributions } = done;
    let total_weight = plan.total_weight.unwrap_or_else(|| contributions.iter().map(|(.., c)| c.weight).sum());
    let report = RoundReport {
        step,
        incarnation,
        contributions: contributions
            .iter()
            .map(|(m, g, c)| Contributed {
                member: *m,
                generation: *g,
                batches: c.batches.clone(),
                metrics: c.metrics,
                samples: c.samples,
            })
            .collect(),
        total_weight,
        lr: plan.update.adamw.lr,
        samples_committed: plan.samples_committed,
        remote: plan.remote,
    };
    let outcome = match (plan.ring_error, summed) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(grad)) => Ok(Arc::new(RoundResult {
            step,
            grad: grad.map(SharedTensor::new),
            ring: plan.ring,
            total_weight,
            update: plan.update,
            next_objective: plan.next_objective,
            contributors: contributions.iter().map(|(m, ..)| *m).collect(),
        })),
    };
    (outcome, report)
}
