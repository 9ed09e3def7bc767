//! A host's rounds as shares of the run's rounds (across hosts): this host's summed round goes to the run and the
//! run's sum comes back, and a sum over NCCL settles: each contributor says whether its all-reduce completed, and the
//! run decides whether the update applies on every host.
use tch::Tensor;

use super::round::Plan;
use super::{CollectiveError, Contribution, DeviceErrorText};
use crate::train::link::{DrafterPart, HostLink, HostShare, RunRound};
use crate::train::rounds::{Completed, MemberId};

/// A round summed over NCCL across hosts, while its local contributors say whether their all-reduce completed.
pub(super) struct Settling {
    pub(super) step: u64,
    /// Contributors yet to say.
    pub(super) waiting: Vec<MemberId>,
    /// Whether every contributor that said completed.
    pub(super) completed: bool,
    /// Whether a contributor is telling the run.
    pub(super) claimed: bool,
    /// Whether the update applies on every host (or why that could not be learnt).
    pub(super) decision: Option<Result<bool, CollectiveError>>,
}

impl Settling {
    pub(super) fn new(step: u64, contributors: Vec<MemberId>) -> Self {
        Settling { step, waiting: contributors, completed: true, claimed: false, decision: None }
    }

    /// Member `id` says (once) whether its all-reduce completed.
    pub(super) fn said(&mut self, id: MemberId, completed: bool) {
        if let Some(i) = self.waiting.iter().position(|&m| m == id) {
            self.waiting.remove(i);
            self.completed &= completed;
        }
    }
}

/// Rounds in a row whose all-reduce failed on this host: one is a peer dying inside it (the round is skipped and
/// the run goes on); at [`FailedSums::LIMIT`] in a row the host's drafters fail and restart (a faulty host leaves and
/// rejoins) rather than have every host skip round after round.
#[derive(Debug, Default)]
pub(super) struct FailedSums(u32);

impl FailedSums {
    const LIMIT: u32 = 2;

    /// This host's outcome of a round (`completed`: every local all-reduce completed) and the run's `decision`,
    /// as this host's drafters take it.
    pub(super) fn settle(
        &mut self,
        completed: bool,
        decision: Result<bool, CollectiveError>,
    ) -> Result<bool, CollectiveError> {
        self.0 = if completed { 0 } else { self.0 + 1 };
        match decision {
            Ok(_) if self.0 >= Self::LIMIT => Err(CollectiveError::Hosts(format!(
                "the all-reduce failed on this host in {} rounds in a row: its drafters restart (a network fault on \
                 this host?)",
                self.0
            ))),
            other => other,
        }
    }
}

/// This host's summed round (`summed`) as its share of the run's round: the run's gradient (on the local sum's
/// device and dtype) and the round as every host sees it.
pub(super) fn across_hosts(
    link: &HostLink,
    step: u64,
    plan: &Plan,
    done: &Completed<Contribution>,
    summed: Result<Option<Tensor>, CollectiveError>,
) -> (Result<Option<Tensor>, CollectiveError>, Option<RunRound>) {
    let local = match summed {
        Ok(local) => local,
        Err(e) => return (Err(e), None),
    };
    match exchange_share(link, step, plan, done, local.as_ref()) {
        Ok((grad, run)) => (Ok(grad), Some(run)),
        Err(e) => (Err(e), None),
    }
}

fn exchange_share(
    link: &HostLink,
    step: u64,
    plan: &Plan,
    done: &Completed<Contribution>,
    local: Option<&Tensor>,
) -> Result<(Option<Tensor>, RunRound), CollectiveError> {
    let share = HostShare {
        grad: local,
        settings: (plan.settled.update, plan.settled.next_objective),
        weight: done.contributions.iter().map(|(.., c)| c.weight).sum(),
        contributions: done
            .contributions
            .iter()
            .map(|(m, g, c)| DrafterPart {
                drafter: *m,
                generation: *g,
                batches: c.batches.clone(),
                samples: c.samples,
                metrics: c.metrics,
                digest: c.digest,
            })
            .collect(),
    };
    let mut run = link.exchange(step, share)?;
    let grad = match (run.grad.take(), local) {
        (Some(sum), Some(local)) => Some(
            sum.f_view_as(local)
                .and_then(|g| g.f_to(local.device()))
                .and_then(|g| g.f_to_kind(local.kind()))
                .map_err(|e| DeviceErrorText(e.to_string()))?,
        ),
        _ => None,
    };
    Ok((grad, run))
}
