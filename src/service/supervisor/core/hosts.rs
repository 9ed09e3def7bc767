//! Several hosts, as the core sees them. Rank 0 (the leader) keeps the loader, the ledger and the checkpoints: it
//! assigns each member host's drafters their items along with its own (as drafters `rank * drafters + id` of its
//! schedule), hands them out through the store ([`Action::Feed`]), and settles their batches with the run's rounds,
//! so every sample is committed once whichever host trained it; a host that leaves takes nothing with it (what it
//! was assigned and did not contribute goes back to the loader). The other hosts (followers) train what rank 0
//! feeds them, write neither ledger nor checkpoint, and take their state from a live host whenever their own
//! collective is empty.
use super::*;
use crate::cluster::link::HostMember;

/// This process's part in a run of several hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostRole {
    /// Rank 0: loader, ledger, checkpoints, evaluation; assigns every host's work.
    Leader,
    /// Another rank: trains what rank 0 assigns it.
    Follower,
}

#[derive(Default)]
pub(super) struct Hosts {
    pub(super) role: Option<HostRole>,
    /// Leader: the other member hosts, by rank.
    remote: BTreeMap<usize, HostMember>,
    /// Follower: the items rank 0 assigned, by step, as `(drafter, item)`.
    fed: BTreeMap<u64, Vec<(usize, Item)>>,
}

impl Hosts {
    pub(super) fn new(role: Option<HostRole>) -> Self {
        Hosts { role, ..Hosts::default() }
    }
}

impl Core {
    pub(super) fn is_follower(&self) -> bool {
        self.hosts.role == Some(HostRole::Follower)
    }

    pub(super) fn is_leader(&self) -> bool {
        self.hosts.role == Some(HostRole::Leader)
    }

    /// The schedule's drafter id of drafter `id` of host `rank`.
    fn remote_id(&self, rank: usize, id: usize) -> usize {
        rank * self.slots.len() + id
    }

    /// Leader: the pseudo-drafters `(id, generation)` of the other member hosts, to assign with the local ones.
    pub(super) fn remote_drafters(&self) -> Vec<(usize, u64)> {
        let per_host = self.slots.len();
        let hosts = self.hosts.remote.values();
        hosts.flat_map(|h| (0..per_host).map(move |id| (h.rank * per_host + id, h.generation))).collect()
    }

    /// Leader: items of step `step` for the schedule's drafter `drafter` that belongs to another host, gathered
    /// per host into one feed each.
    pub(super) fn feed_remote(&mut self, step: u64, items: Vec<(usize, u64, Item)>) {
        let per_host = self.slots.len();
        let mut feeds: BTreeMap<(usize, u64), Vec<(usize, Item)>> = BTreeMap::new();
        for (drafter, generation, item) in items {
            feeds.entry((drafter / per_host, generation)).or_default().push((drafter % per_host, item));
        }
        for ((rank, generation), items) in feeds {
            self.out.push(Action::Feed { rank, generation, step, items });
        }
    }

    /// Leader: the member hosts of the run changed (`members`: every host with its generation and first round).
    /// Hosts that left are forgotten (their items are settled by the rounds they miss); a host that joined gets
    /// its items of every open step from its first round on.
    pub(super) fn hosts_changed(&mut self, members: Vec<HostMember>) {
        if !self.is_leader() {
            return;
        }
        let me = 0;
        let now: BTreeMap<usize, HostMember> =
            members.into_iter().filter(|h| h.rank != me).map(|h| (h.rank, h)).collect();
        let joined: Vec<HostMember> = now
            .values()
            .filter(|h| self.hosts.remote.get(&h.rank).is_none_or(|o| o.generation != h.generation))
            .copied()
            .collect();
        for h in self.hosts.remote.values().filter(|h| now.get(&h.rank).is_none_or(|n| n.generation != h.generation)) {
            tracing::warn!(host = h.rank, generation = h.generation, "host left the run");
        }
        self.hosts.remote = now;
        if self.phase != Phase::Running {
            return;
        }
        for h in joined {
            tracing::info!(host = h.rank, generation = h.generation, from = h.from, "host joined the run");
            for step in self.schedule.open_steps_from(h.from) {
                let mut items = Vec::new();
                for id in 0..self.slots.len() {
                    let drafter = self.remote_id(h.rank, id);
                    items.extend(
                        self.schedule
                            .assign(step, drafter, h.generation)
                            .into_iter()
                            .map(|i| (drafter, h.generation, i)),
                    );
                }
                self.feed_remote(step, items);
            }
        }
    }

    /// Leader: the other hosts' parts of a round, as contributions of the schedule's drafters.
    /// Their checksums of the round's starting state join the local replicas' in the replica check.
    pub(super) fn with_remote(&mut self, mut report: RoundReport) -> RoundReport {
        let mut digests = false;
        for h in std::mem::take(&mut report.remote) {
            for part in &h.contributions {
                let member = self.remote_id(h.rank, part.drafter);
                if let Some(d) = part.digest {
                    self.replicas.expected.entry(report.step).or_default().1.insert(member, d);
                    digests = true;
                }
                report.contributions.push(Contributed {
                    member,
                    generation: h.generation,
                    batches: part.batches.clone(),
                    metrics: part.metrics,
                    samples: part.samples,
                });
            }
        }
        if digests {
            self.compare_replicas(report.step);
        }
        report
    }

    /// Follower: rank 0's items for `step`.
    pub(super) fn fed(&mut self, step: u64, items: Vec<(usize, Item)>) {
        if step >= self.schedule.next_step() {
            self.hosts.fed.insert(step, items);
        }
    }

    /// Follower: opens the steps rank 0 has fed, in order, for the live drafters.
    pub(super) fn open_fed_steps(&mut self) {
        loop {
            let next = self.schedule.next_step();
            self.hosts.fed.retain(|&s, _| s >= next);
            let Some(items) = self.hosts.fed.remove(&next) else { return };
            let live: Vec<(usize, u64)> = self.live().map(|s| (s.id, s.generation)).collect();
            for (drafter, generation, item) in self.schedule.open_fed_step(&live, items) {
                self.send(drafter, generation, item);
            }
        }
    }

    /// Follower: the host entered the run at `step` (its founder took a live host's state): its schedule starts
    /// there.
    pub(super) fn entered_at(&mut self, step: u64) {
        let position = Position { step, samples_committed: 0, loader: None, set_aside: vec![] };
        self.schedule.restore(&position, self.incarnation);
        for t in &mut self.targets {
            t.clear();
        }
        self.replicas.expected.clear();
    }

    /// Follower: founding the empty collective means entering the run again from a live host; nothing is rewound
    /// here (the run goes on elsewhere) and no checkpoint is read.
    pub(super) fn enter_again(&mut self, id: usize) {
        self.incarnation += 1;
        let generation = self.slots[id].spawn(Role::Founder, self.now);
        self.out.push(Action::SpawnDrafter { id, generation, start: Start::Found(None) });
    }
}
