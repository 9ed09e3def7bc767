//! The collective's bookkeeping, without tensors, locks or threads: which drafter threads are members (a member is
//! an id and the generation of its current thread), which round is open, who has contributed to it, and who waits
//! to join. The in-process [`Collective`](super::collective::Collective) runs this under its mutex with tensors as
//! payloads; the supervisor's simulation runs the very same code, single-threaded, with plain values.
//!
//! The rules it keeps:
//! - A round completes when it has a contribution and every current member has contributed. A member removed
//!   mid-round is dropped from it; a contribution it had already made still counts.
//! - Only an empty collective can be founded or rewound; every rewind starts a new incarnation, so that reports of
//!   rounds from before it can be told apart.
//! - A member at its step boundary admits waiting joiners into the open round (after copying its state into theirs):
//!   every member at a boundary holds the state the open round starts from, so any of them may serve.
//! - A thread once removed stays out: its later join request or founding is refused (a thread abandoned while it
//!   was still starting must not be admitted when it gets there).
use std::collections::BTreeMap;

pub type MemberId = usize;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoundsError {
    #[error("this replica is not a member of the collective (removed, or never admitted)")]
    Removed,
    #[error("contribution to round {got} while round {expected} is open")]
    WrongRound { expected: u64, got: u64 },
    #[error("the collective already has members {0:?}: a founder needs an empty one")]
    Occupied(Vec<MemberId>),
}

/// What a joiner learns once a member has admitted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinInfo {
    /// The first round it contributes to.
    pub step: u64,
    /// The donor's count of applied optimizer updates.
    pub optimizer_steps: u64,
}

/// What removing a member's thread found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    /// It was a member (with that generation).
    pub was_member: bool,
    /// It had contributed to the open round (that contribution still counts).
    pub contributed: bool,
    /// The members left, `(id, generation)`, in id order.
    pub remaining: Vec<(MemberId, u64)>,
}

/// A completed round: its step, the incarnation it belongs to, and the contributions in member order.
#[derive(Debug)]
pub struct Completed<C> {
    pub step: u64,
    pub incarnation: u64,
    pub contributions: Vec<(MemberId, u64, C)>,
}

/// A join request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinPoll {
    Waiting,
    Joined(JoinInfo),
    /// The request is gone (removed, or replaced by a newer thread's).
    Removed,
}

struct Joiner<J> {
    generation: u64,
    payload: J,
    /// The member `(id, generation)` copying its state into the payload.
    claimed: Option<(MemberId, u64)>,
    admitted: Option<JoinInfo>,
}

/// Joiners a member claimed to serve: it copies its state into their payloads (outside any lock), then admits them
/// with [`Rounds::admit`], or gives them back with [`Rounds::unclaim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub server: (MemberId, u64),
    pub incarnation: u64,
    /// `(id, generation)` of each joiner claimed.
    pub joiners: Vec<(MemberId, u64)>,
}

/// See the module documentation. `C`: what a member brings to a round; `J`: what a joiner lends to be filled.
pub struct Rounds<C, J> {
    members: BTreeMap<MemberId, u64>,
    round: u64,
    incarnation: u64,
    /// By `(id, generation)`: a thread that replaced a removed contributor in the same round has not contributed.
    contributions: BTreeMap<(MemberId, u64), C>,
    joiners: BTreeMap<MemberId, Joiner<J>>,
    /// The newest removed generation of each id: it and older ones are refused.
    removed: BTreeMap<MemberId, u64>,
}

impl<C, J> Rounds<C, J> {
    /// No members; the next round is `step`.
    pub fn new(step: u64) -> Self {
        Rounds {
            members: BTreeMap::new(),
            round: step,
            incarnation: 0,
            contributions: BTreeMap::new(),
            joiners: BTreeMap::new(),
            removed: BTreeMap::new(),
        }
    }

    /// Whether thread `generation` of `id` was removed (it, or a newer one).
    fn was_removed(&self, id: MemberId, generation: u64) -> bool {
        self.removed.get(&id).is_some_and(|&g| generation <= g)
    }

    /// The open round.
    pub fn round(&self) -> u64 {
        self.round
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// `(id, generation)` of every member, in id order.
    pub fn members(&self) -> Vec<(MemberId, u64)> {
        self.members.iter().map(|(m, g)| (*m, *g)).collect()
    }

    pub fn is_member(&self, id: MemberId, generation: u64) -> bool {
        self.members.get(&id) == Some(&generation)
    }

    /// Whether this thread's contribution to the open round is in.
    pub fn has_contributed(&self, id: MemberId, generation: u64) -> bool {
        self.contributions.contains_key(&(id, generation))
    }

    /// Makes `id` the only member (its state is the reference); its first round is the returned step.
    pub fn found(&mut self, id: MemberId, generation: u64) -> Result<u64, RoundsError> {
        if self.was_removed(id, generation) {
            return Err(RoundsError::Removed);
        }
        if !self.members.is_empty() {
            return Err(RoundsError::Occupied(self.members.keys().copied().collect()));
        }
        self.members.insert(id, generation);
        Ok(self.round)
    }

    /// Makes `id` the only member at round `step` (its state is another host's at that step), in the incarnation the
    /// supervisor's rewind began.
    pub fn found_at(&mut self, id: MemberId, generation: u64, step: u64) -> Result<u64, RoundsError> {
        if !self.members.is_empty() {
            return Err(RoundsError::Occupied(self.members.keys().copied().collect()));
        }
        if self.round != step {
            self.round = step;
            self.contributions.clear();
        }
        self.found(id, generation)
    }

    /// Moves an empty collective to `step` (a run rewound to a checkpoint), as a new incarnation; contributions of
    /// removed members to the old open round are dropped. Join requests stay: a founder will admit them.
    pub fn rewind(&mut self, step: u64) -> Result<u64, RoundsError> {
        if !self.members.is_empty() {
            return Err(RoundsError::Occupied(self.members.keys().copied().collect()));
        }
        self.round = step;
        self.incarnation += 1;
        self.contributions.clear();
        Ok(self.incarnation)
    }

    /// Removes the member's thread of this generation and its join request; the open round completes without it.
    pub fn remove(&mut self, id: MemberId, generation: u64) -> Removal {
        let newest = self.removed.entry(id).or_insert(generation);
        *newest = (*newest).max(generation);
        let was_member = self.is_member(id, generation);
        if was_member {
            self.members.remove(&id);
        }
        if self.joiners.get(&id).is_some_and(|j| j.generation == generation) {
            self.joiners.remove(&id);
        }
        // Joiners it was serving wait for another server.
        for j in self.joiners.values_mut().filter(|j| j.claimed == Some((id, generation))) {
            j.claimed = None;
        }
        Removal { was_member, contributed: self.has_contributed(id, generation), remaining: self.members() }
    }

    /// Records a member's contribution to the open round `step`.
    pub fn contribute(&mut self, id: MemberId, generation: u64, step: u64, contribution: C) -> Result<(), RoundsError> {
        if !self.is_member(id, generation) {
            return Err(RoundsError::Removed);
        }
        if step != self.round {
            return Err(RoundsError::WrongRound { expected: self.round, got: step });
        }
        self.contributions.insert((id, generation), contribution);
        Ok(())
    }

    /// Whether the open round has a contribution and one from every member.
    pub fn is_complete(&self) -> bool {
        !self.contributions.is_empty() && self.members.iter().all(|(m, g)| self.contributions.contains_key(&(*m, *g)))
    }

    /// Closes the open round if it is complete: its contributions in member order, and the next round opens.
    pub fn complete(&mut self) -> Option<Completed<C>> {
        if !self.is_complete() {
            return None;
        }
        let step = self.round;
        self.round += 1;
        let contributions = std::mem::take(&mut self.contributions).into_iter().map(|((m, g), c)| (m, g, c)).collect();
        Some(Completed { step, incarnation: self.incarnation, contributions })
    }

    /// Registers a join request (replacing an older thread's); a member admits it with [`Rounds::serve`]. Refused
    /// for a thread already removed.
    pub fn request_join(&mut self, id: MemberId, generation: u64, payload: J) -> Result<(), RoundsError> {
        if self.was_removed(id, generation) {
            return Err(RoundsError::Removed);
        }
        self.joiners.insert(id, Joiner { generation, payload, claimed: None, admitted: None });
        Ok(())
    }

    /// Whether a join request waits to be served.
    pub fn has_joiners(&self) -> bool {
        self.joiners.values().any(|j| j.admitted.is_none() && j.claimed.is_none())
    }

    /// Member `id` (at its step boundary) claims every waiting joiner to serve.
    pub fn claim_joiners(&mut self, id: MemberId, generation: u64) -> Result<Claim, RoundsError> {
        if !self.is_member(id, generation) {
            return Err(RoundsError::Removed);
        }
        let mut joiners = Vec::new();
        for (m, j) in self.joiners.iter_mut().filter(|(_, j)| j.admitted.is_none() && j.claimed.is_none()) {
            j.claimed = Some((id, generation));
            joiners.push((*m, j.generation));
        }
        Ok(Claim { server: (id, generation), incarnation: self.incarnation, joiners })
    }

    /// The payload of joiner `id`'s request of thread `generation`.
    pub fn payload(&self, id: MemberId, generation: u64) -> Option<&J> {
        self.joiners.get(&id).filter(|j| j.generation == generation).map(|j| &j.payload)
    }

    /// Admits the claimed joiners whose state was copied into the open round; returns those admitted. Nobody is
    /// admitted when the server was removed or the collective rewound meanwhile (the copy may no longer be the
    /// open round's state): those requests wait for another server, as do ones removed meanwhile (gone).
    pub fn admit(&mut self, claim: &Claim, optimizer_steps: u64) -> Vec<MemberId> {
        let valid = self.is_member(claim.server.0, claim.server.1) && self.incarnation == claim.incarnation;
        let info = JoinInfo { step: self.round, optimizer_steps };
        let mut admitted = Vec::new();
        for &(m, generation) in &claim.joiners {
            let Some(j) = self.joiners.get_mut(&m).filter(|j| j.generation == generation) else { continue };
            j.claimed = None;
            if valid {
                j.admitted = Some(info);
                self.members.insert(m, generation);
                admitted.push(m);
            }
        }
        admitted
    }

    /// Gives claimed joiners back unserved (the copy failed): another member may serve them.
    pub fn unclaim(&mut self, claim: &Claim) {
        for &(m, generation) in &claim.joiners {
            if let Some(j) = self.joiners.get_mut(&m).filter(|j| j.generation == generation) {
                j.claimed = None;
            }
        }
    }

    /// Claims, copies and admits in one go (single-threaded callers): `copy` fills each waiting joiner's payload
    /// with member `id`'s state. Returns the joiners admitted; a failed copy admits nobody.
    pub fn serve<E>(
        &mut self,
        id: MemberId,
        generation: u64,
        optimizer_steps: u64,
        mut copy: impl FnMut(&mut J) -> Result<(), E>,
    ) -> Result<Result<Vec<MemberId>, E>, RoundsError> {
        let claim = self.claim_joiners(id, generation)?;
        for &(m, _) in &claim.joiners {
            let j = self.joiners.get_mut(&m).expect("claimed just now");
            if let Err(e) = copy(&mut j.payload) {
                self.unclaim(&claim);
                return Ok(Err(e));
            }
        }
        Ok(Ok(self.admit(&claim, optimizer_steps)))
    }

    /// Where this join request stands; a request that was admitted is consumed by the answer.
    pub fn poll_join(&mut self, id: MemberId, generation: u64) -> JoinPoll {
        match self.joiners.get(&id) {
            Some(j) if j.generation == generation => match j.admitted {
                Some(info) => {
                    self.joiners.remove(&id);
                    JoinPoll::Joined(info)
                }
                None => JoinPoll::Waiting,
            },
            _ => JoinPoll::Removed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Rounds<&'static str, u32>;

    #[test]
    fn a_round_completes_with_every_member_in_member_order() {
        let mut r = R::new(5);
        r.found(2, 1).unwrap();
        r.request_join(0, 3, 0).unwrap();
        let copy = |p: &mut u32| -> Result<(), ()> {
            *p = 7;
            Ok(())
        };
        assert_eq!(r.serve(2, 1, 9, copy), Ok(Ok(vec![0])));
        assert_eq!(r.poll_join(0, 3), JoinPoll::Joined(JoinInfo { step: 5, optimizer_steps: 9 }));
        r.contribute(2, 1, 5, "b").unwrap();
        assert!(r.complete().is_none(), "member 0 has not contributed");
        r.contribute(0, 3, 5, "a").unwrap();
        let done = r.complete().unwrap();
        assert_eq!((done.step, done.incarnation), (5, 0));
        assert_eq!(done.contributions, vec![(0, 3, "a"), (2, 1, "b")]);
        assert_eq!(r.round(), 6);
        assert_eq!(r.contribute(0, 3, 5, "late"), Err(RoundsError::WrongRound { expected: 6, got: 5 }));
    }

    /// A host entering a run of several takes the live hosts' step, in the incarnation its supervisor began.
    #[test]
    fn a_founder_can_take_another_hosts_step_without_a_new_incarnation() {
        let mut r = R::new(0);
        assert_eq!(r.rewind(3), Ok(1));
        assert_eq!(r.found_at(0, 1, 40), Ok(40));
        assert_eq!((r.round(), r.incarnation()), (40, 1));
        assert_eq!(r.found_at(1, 1, 41), Err(RoundsError::Occupied(vec![0])));
    }

    #[test]
    fn a_removed_member_is_dropped_but_its_contribution_counts() {
        let mut r = R::new(0);
        r.found(0, 1).unwrap();
        r.request_join(1, 1, 0).unwrap();
        r.serve(0, 1, 0, |_| Ok::<(), ()>(())).unwrap().unwrap();
        r.contribute(1, 1, 0, "x").unwrap();
        let removal = r.remove(1, 1);
        assert_eq!(removal, Removal { was_member: true, contributed: true, remaining: vec![(0, 1)] });
        r.contribute(0, 1, 0, "y").unwrap();
        assert_eq!(r.complete().unwrap().contributions.len(), 2);
        // A stale generation removes nothing.
        assert!(!r.remove(0, 7).was_member);
        assert_eq!(r.contribute(1, 1, 1, "z"), Err(RoundsError::Removed));
    }

    #[test]
    fn only_an_empty_collective_is_founded_or_rewound_and_rewinds_are_incarnations() {
        let mut r = R::new(3);
        assert_eq!(r.found(1, 1), Ok(3));
        assert_eq!(r.found(0, 1), Err(RoundsError::Occupied(vec![1])));
        assert!(r.rewind(0).is_err());
        r.remove(1, 1);
        assert_eq!(r.rewind(1), Ok(1));
        assert_eq!(r.found(0, 2), Ok(1));
        r.contribute(0, 2, 1, "a").unwrap();
        assert_eq!(r.complete().unwrap().incarnation, 1);
    }

    #[test]
    fn join_requests_wait_are_replaced_by_newer_threads_and_end_when_removed() {
        let mut r = R::new(0);
        r.request_join(4, 1, 0).unwrap();
        assert_eq!(r.poll_join(4, 1), JoinPoll::Waiting);
        r.request_join(4, 2, 0).unwrap();
        assert_eq!(r.poll_join(4, 1), JoinPoll::Removed, "replaced by generation 2");
        assert!(r.has_joiners());
        // Nobody may serve who is not a member.
        assert_eq!(r.serve(0, 1, 0, |_| Ok::<(), ()>(())), Err(RoundsError::Removed));
        r.found(0, 1).unwrap();
        // A failed copy admits nobody, and gives the request back.
        assert_eq!(r.serve(0, 1, 0, |_| Err("copy failed")), Ok(Err("copy failed")));
        assert_eq!(r.poll_join(4, 2), JoinPoll::Waiting);
        assert!(r.has_joiners());
        r.remove(4, 2);
        assert_eq!(r.poll_join(4, 2), JoinPoll::Removed);
        assert!(!r.has_joiners());
    }

    /// A contributor dies and its successor is admitted into the same open round: the round waits for the
    /// successor's own contribution (the dead thread's still counts).
    #[test]
    fn a_successor_in_the_same_round_has_not_contributed() {
        let mut r = R::new(7);
        r.found(2, 1).unwrap();
        r.request_join(0, 1, 0).unwrap();
        r.serve(2, 1, 0, |_| Ok::<(), ()>(())).unwrap().unwrap();
        r.contribute(0, 1, 7, "dead").unwrap();
        r.remove(0, 1);
        r.request_join(0, 2, 0).unwrap();
        r.serve(2, 1, 0, |_| Ok::<(), ()>(())).unwrap().unwrap();
        r.contribute(2, 1, 7, "b").unwrap();
        assert!(r.complete().is_none(), "drafter 0's new thread has not contributed");
        r.contribute(0, 2, 7, "new").unwrap();
        let done = r.complete().unwrap();
        assert_eq!(done.contributions, vec![(0, 1, "dead"), (0, 2, "new"), (2, 1, "b")]);
    }

    /// The copy happens outside any lock: between the claim and the admission the server may be removed (or the
    /// collective rewound), and then nobody is admitted on its copy; a joiner removed meanwhile is simply gone.
    #[test]
    fn a_claim_admits_only_if_its_server_is_still_there() {
        let mut r = R::new(3);
        r.found(0, 1).unwrap();
        r.request_join(1, 1, 0).unwrap();
        r.request_join(2, 1, 0).unwrap();
        let claim = r.claim_joiners(0, 1).unwrap();
        assert_eq!(claim.joiners, vec![(1, 1), (2, 1)]);
        assert!(!r.has_joiners(), "claimed: nobody else serves them");
        r.remove(2, 1);
        assert_eq!(r.admit(&claim, 7), vec![1], "the one removed meanwhile is gone");
        assert_eq!(r.poll_join(1, 1), JoinPoll::Joined(JoinInfo { step: 3, optimizer_steps: 7 }));
        r.request_join(3, 1, 0).unwrap();
        let claim = r.claim_joiners(0, 1).unwrap();
        r.remove(0, 1);
        assert!(r.has_joiners(), "its server is gone: the joiner waits for another one");
        assert!(r.admit(&claim, 7).is_empty(), "its server was removed during the copy");
        assert_eq!(r.poll_join(3, 1), JoinPoll::Waiting);
    }

    /// A thread given up on while it was still starting asks to join (or found) afterwards: refused, so a member
    /// never admits it in place of its successor.
    #[test]
    fn a_thread_removed_before_it_asked_stays_out() {
        let mut r = R::new(0);
        r.remove(0, 3);
        assert_eq!(r.request_join(0, 3, 0), Err(RoundsError::Removed));
        assert_eq!(r.found(0, 2), Err(RoundsError::Removed), "older threads too");
        assert_eq!(r.found(0, 4), Ok(0), "its successor founds");
        r.remove(1, 1);
        assert_eq!(r.request_join(1, 1, 0), Err(RoundsError::Removed));
        assert_eq!(r.serve(0, 4, 0, |_| Ok::<(), ()>(())), Ok(Ok(vec![])));
        assert_eq!(r.members(), vec![(0, 4)]);
    }
}
