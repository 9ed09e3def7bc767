//! The NCCL communicators a collective's rounds sum in: one per membership of the round's contributors (across
//! hosts, every drafter of every member host), numbered in order and replaced whenever the membership changes or a
//! sum in one did not complete on every host.
use std::sync::Arc;

use crate::cluster::quorum::Rank;
use crate::ffi::nccl::NcclId;
use crate::train::link::HostRecord;
use crate::train::rounds::MemberId;

/// How a round's gradients are summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientSum {
    /// The member completing the round adds the others' gradients by device-to-device copies.
    DeviceCopies,
    /// The contributors all-reduce over NCCL, in the round's [`Ring`].
    Nccl,
}

/// One rank of a [`Ring`]: a drafter of a host, as the generations they contributed as (within one host, host 0 of
/// generation 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingMember {
    pub host: Rank,
    pub host_generation: u64,
    pub member: MemberId,
    pub generation: u64,
}

/// The NCCL communicator a round's contributors sum in: one per membership, numbered in order; rank `r` is
/// `members[r]`. A new membership (a member removed, joined or restarted, on any host) gets a new one, and the old
/// one is aborted. Across hosts every drafter of every member host is a rank.
#[derive(Debug, PartialEq, Eq)]
pub struct Ring {
    pub epoch: u64,
    /// This host (its members find their rank among `members` by it).
    pub host: Rank,
    pub members: Vec<RingMember>,
    pub id: NcclId,
}

impl Ring {
    pub fn rank_of(&self, member: MemberId) -> Option<usize> {
        self.members.iter().position(|m| m.host == self.host && m.member == member)
    }
}

/// The ranks of a round across hosts: each member host's drafters, in rank order then in member order (what every
/// host reads alike from the round's records).
pub(super) fn ring_members(hosts: &[HostRecord]) -> Vec<RingMember> {
    hosts
        .iter()
        .flat_map(|h| {
            h.contributions.iter().map(|c| RingMember {
                host: h.rank,
                host_generation: h.generation,
                member: c.drafter,
                generation: c.generation,
            })
        })
        .collect()
}

/// The current ring of a host's rounds, and whether it may still be used.
#[derive(Debug, Default)]
pub(super) struct Rings {
    current: Option<Arc<Ring>>,
    /// A round's sum in `current` did not complete on every host: the next round needs a new communicator.
    stale: bool,
    /// This host's rank across hosts (0 within one).
    pub(super) host: Rank,
}

impl Rings {
    /// The ring, while its membership is `members` (and no sum in it was abandoned).
    pub(super) fn current(&self, members: &[RingMember]) -> Option<Arc<Ring>> {
        self.current.clone().filter(|r| r.members == members && !self.stale)
    }

    /// The next ring, numbered after the last (its members abort their old communicators when they see it).
    pub(super) fn next(&mut self, members: Vec<RingMember>, id: NcclId) -> Arc<Ring> {
        let epoch = self.current.as_ref().map_or(0, |r| r.epoch + 1);
        let ring = Arc::new(Ring { epoch, host: self.host, members, id });
        self.current = Some(ring.clone());
        self.stale = false;
        ring
    }

    /// A sum in the current ring did not complete on every host.
    pub(super) fn abandon(&mut self) {
        self.stale = true;
    }
}
