//! A completed round's plan (under the collective's lock: its book settled, its ring found), its gradients summed
//! (outside it) and its result as every member applies it.
use std::sync::Arc;

use tch::Tensor;

use super::book::{self, Settled};
use super::ring::{GradientSum, Ring, RingMember};
use super::{CollectiveError, Contribution, DeviceErrorText, RoundReport, RoundResult, State};
use crate::ffi::nccl::NcclId;
use crate::model::shared::SharedTensor;
use crate::train::rounds::{Completed, MemberId};

/// A completed round's bookkeeping, done under the lock before its gradients are summed.
pub(super) struct Plan {
    pub(super) sum: GradientSum,
    pub(super) ring: Option<Arc<Ring>>,
    pub(super) ring_error: Option<CollectiveError>,
    pub(super) settled: Settled,
}

/// Settles the round in the book and (within one host) finds its ring. Across hosts the ring waits for the run's
/// round ([`Collective::run_ring`]).
pub(super) fn plan(s: &mut State, done: &Completed<Contribution>, across_hosts: bool) -> Plan {
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
    let settled = s.book.settle(done.step, &done.contributions);
    Plan { sum: s.sum, ring, ring_error, settled }
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
    let Plan { ring, ring_error, settled, .. } = plan;
    let (update, next_objective) = (settled.update, settled.next_objective);
    let report = book::report(settled, &done);
    let outcome = match (ring_error, summed) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(grad)) => Ok(Arc::new(RoundResult {
            step: done.step,
            grad: grad.map(SharedTensor::new),
            ring,
            total_weight: report.total_weight,
            update,
            next_objective,
            contributors: done.contributions.iter().map(|(m, ..)| *m).collect(),
        })),
    };
    (outcome, report)
}
