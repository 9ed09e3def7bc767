//! Several hosts, as the core sees them. Rank 0 (the leader) keeps the loader, the ledger and the checkpoints: it
//! assigns each member host's drafters their items along with its own (as drafters `rank * drafters + id` of its
//! schedule), hands them out through the store ([`Action::Feed`]), and settles their batches with the run's rounds,
//! so every sample is committed once whichever host trained it; a host that leaves takes nothing with it (what it
//! was assigned and did not contribute goes back to the loader). The other hosts (followers) train what rank 0
//! feeds them, write neither ledger nor checkpoint, and take their state from a live host whenever their own
//! collective is empty.
use super::parting::Parting;
use super::*;
use crate::service::supervisor::survivor::{RunPosition, Survivor};
use crate::train::link::HostMember;

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
    pub(super) remote: BTreeMap<usize, HostMember>,
    /// Follower: the items rank 0 assigned, by step, as `(drafter, item)`.
    pub(super) fed: BTreeMap<u64, Vec<(usize, Item)>>,
    /// Follower: where the run stands, to checkpoint it from here if rank 0 is lost.
    pub(super) survivor: Survivor,
    /// Follower: rank 0 is lost and this host's replica is being checkpointed.
    pub(super) parting: Option<Parting>,
    /// Follower: rank 0 dropped this host from the run (when, on the watchdog's clock); its drafters start again and
    /// enter anew. Not ready meanwhile.
    pub(super) left: Option<Duration>,
}

impl Core {
    pub(super) fn is_follower(&self) -> bool {
        self.hosts.role == Some(HostRole::Follower)
    }

    pub(super) fn is_leader(&self) -> bool {
        self.hosts.role == Some(HostRole::Leader)
    }

    /// Follower: rank 0's membership no longer lists this host (rank 0 dropped it: it missed a round's deadline, or
    /// its beat stopped while it was stopped or cut off). Its drafters would wait for assignments that never come:
    /// they are failed, so that they start again and the host enters the run anew; it is not ready until one of them
    /// is live again.
    pub(super) fn left_run(&mut self) {
        if !self.is_follower() || self.hosts.left.is_some() {
            return;
        }
        tracing::warn!("rank 0 dropped this host from the run: its drafters start again and enter it anew");
        self.hosts.left = Some(self.now);
        let live: Vec<(usize, u64)> = self.live().map(|s| (s.id, s.generation)).collect();
        for (id, generation) in live {
            let failure =
                Failure { kind: FailureKind::Stalled, message: "rank 0 dropped this host from the run".into() };
            self.drafter_failed(id, generation, failure, &[], false);
        }
    }

    /// Follower: why it is not in the run, while it is not.
    pub(super) fn left_problem(&self) -> Option<String> {
        let since = self.now.saturating_sub(self.hosts.left?).as_secs_f64();
        Some(format!(
            "not in the run: rank 0 dropped this host {since:.0} s ago (it missed a round's deadline, or its beat \
             stopped); its drafters are entering it anew"
        ))
    }

    /// Leader: the other member hosts (for the status).
    pub(super) fn other_hosts(&self) -> Vec<HostMember> {
        self.hosts.remote.values().copied().collect()
    }

    /// The schedule's drafter id of drafter `id` of host `rank`.
    fn remote_id(&self, rank: usize, id: usize) -> usize {
        rank * self.slots.len() + id
    }

    /// Leader: the pseudo-drafters `(id, generation)` of the other member hosts, to assign with the local ones.
    pub(super) fn remote_drafters(&self) -> Vec<(usize, u64)> {
        let hosts = self.hosts.remote.values();
        hosts.flat_map(|h| (0..self.slots.len()).map(move |id| (self.remote_id(h.rank, id), h.generation))).collect()
    }

    /// Leader: items of step `step` for the schedule's drafter `drafter` that belongs to another host, gathered
    /// per host into one feed each.
    pub(super) fn feed_remote(&mut self, step: u64, items: Vec<(usize, u64, Item)>) {
        let per_host = self.slots.len();
        let mut feeds: BTreeMap<(usize, u64), Vec<(usize, Item)>> = BTreeMap::new();
        for (drafter, generation, item) in items {
            feeds.entry((drafter / per_host, generation)).or_default().push((drafter % per_host, item));
        }
        let position = self.run_position();
        for ((rank, generation), items) in feeds {
            let position = Box::new(position.clone());
            self.out.push(Action::Feed { rank, generation, step, items, position });
        }
    }

    /// Leader: where the run stands at the committed step boundary (a follower checkpoints from it if rank 0 is
    /// lost).
    fn run_position(&self) -> RunPosition {
        RunPosition {
            step: self.schedule.committed_step(),
            samples_committed: self.schedule.samples_committed(),
            skipped_steps: self.skipped_steps,
            loader: self.schedule.loader_state(),
            set_aside: self.schedule.set_aside().to_vec(),
            lr: self.last_lr,
            unwritten: self.unwritten_commits(),
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
        for h in &joined {
            tracing::info!(host = h.rank, generation = h.generation, from = h.from, "host joined the run");
        }
        if self.phase != Phase::Running {
            // Steps open once training begins, with every member host.
            return;
        }
        for h in joined {
            let drafters: Vec<(usize, u64)> =
                (0..self.slots.len()).map(|id| (self.remote_id(h.rank, id), h.generation)).collect();
            for step in self.schedule.open_steps_from(h.from) {
                let items = self.schedule.assign_all(step, &drafters);
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

    /// Follower: rank 0's items for `step` (the shell passes only those for the generation this host is). While
    /// the host enters the run they are all kept: its schedule moves to the step it enters at only once its founder
    /// has the state, and rank 0 may feed that step first (it feeds an admitted host at once).
    pub(super) fn fed(&mut self, step: u64, items: Vec<(usize, Item)>, position: Option<Box<RunPosition>>) {
        if let Some(position) = position {
            self.hosts.survivor.position(*position);
        }
        if self.entering_run() || step >= self.schedule.next_step() {
            self.hosts.fed.insert(step, items);
        }
    }

    /// Follower: whether this host is entering the run (its founder waits for a live host's state).
    fn entering_run(&self) -> bool {
        self.is_follower() && self.slots.iter().any(|s| s.role() == Some(Role::Founder))
    }

    /// Follower: opens the steps rank 0 has fed, in order, for the live drafters (none while entering the run).
    pub(super) fn open_fed_steps(&mut self) {
        if self.entering_run() {
            return;
        }
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

    /// Follower: founding the empty collective means entering the run again from a live host; no checkpoint is
    /// read and nothing is rewound but this host's collective (a new incarnation, so that reports of its rounds
    /// before are told apart; the founder moves it to the step it enters at).
    pub(super) fn enter_again(&mut self, id: usize) {
        self.incarnation += 1;
        let step = self.schedule.committed_step();
        self.out.push(Action::RewindCollective { step, samples_committed: 0 });
        let generation = self.slots[id].spawn(Role::Founder, self.now);
        self.out.push(Action::SpawnDrafter { id, generation, start: Start::Found(None) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::exit::{EXIT_INTERRUPTED, EXIT_TERMINATED, StopSignal};
    use crate::service::supervisor::core::tests::written;
    use crate::service::supervisor::protocol::Request;
    use crate::train::link::{DrafterPart, HostRecord};

    fn core(role: HostRole) -> Core {
        resumed(role, None)
    }

    fn resumed(role: HostRole, resume: Option<(PathBuf, TrainerState)>) -> Core {
        let mut config = Config::builtin().unwrap();
        config.drafters.devices = vec![config.drafters.devices[0]];
        Core::new(Setup {
            config,
            drafter_devices: vec!["cpu".into()],
            target_devices: vec!["cpu".into()],
            feeds: vec![0],
            lengths: vec![8; 64],
            sample_ids: (0..64).map(SampleId::Number).collect(),
            stream: None,
            resume,
            rejected: vec![],
            role: Some(role),
        })
    }

    fn id(ordinal: u64) -> BatchId {
        BatchId { epoch: 0, ordinal }
    }

    /// Another host whose only drafter entered the run at `step`.
    fn follower_at(step: u64) -> Core {
        let mut c = core(HostRole::Follower);
        c.start(at(0.0));
        c.handle(at(0.1), Event::TargetReady { target: 0, generation: 1 });
        c.handle(at(0.2), Event::DrafterJoined { id: 0, generation: 1, step });
        c
    }

    /// Rank 0's word at boundary `step`: `samples` committed, `skipped` steps skipped, new batches from `next`,
    /// `owed` owed.
    fn position(step: u64, samples: u64, skipped: u64, next: u64, owed: Vec<BatchId>) -> Option<Box<RunPosition>> {
        let loader = crate::data::loader::LoaderState { epoch: 0, next_ordinal: next, owed };
        let position = RunPosition {
            step,
            samples_committed: samples,
            skipped_steps: skipped,
            loader,
            set_aside: vec![],
            lr: 1e-3,
            unwritten: vec![],
        };
        Some(Box::new(position))
    }

    fn at(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn member(rank: usize, generation: u64, from: u64) -> HostMember {
        HostMember { rank, generation, from }
    }

    /// The batches of the captures asked of the target.
    fn captured(actions: &[Action]) -> Vec<BatchId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::TargetRequest { request: Request { item: Item::Capture { batch, .. }, .. }, .. } => {
                    Some(*batch)
                }
                _ => None,
            })
            .collect()
    }

    /// The feeds posted: `(rank, generation, step, batches)`.
    fn fed(actions: &[Action]) -> Vec<(usize, u64, u64, Vec<BatchId>)> {
        let batch = |i: &Item| match i {
            Item::Capture { batch, .. } => Some(*batch),
            Item::Empty => None,
        };
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Feed { rank, generation, step, items, .. } => {
                    Some((*rank, *generation, *step, items.iter().filter_map(|(_, i)| batch(i)).collect()))
                }
                _ => None,
            })
            .collect()
    }

    fn committed(actions: &[Action]) -> Vec<BatchId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Ledger(LedgerEntry::Commit { batch, .. }) => Some(batch.id),
                _ => None,
            })
            .collect()
    }

    fn contributed(member: usize, batches: Vec<BatchId>) -> Contributed {
        Contributed { member, generation: 1, batches, metrics: Metrics::default(), samples: 4 }
    }

    fn report(step: u64, incarnation: u64, local: Vec<Contributed>, remote: Vec<HostRecord>) -> RoundReport {
        let samples = 4 * (local.len() + remote.len()) as u64;
        RoundReport {
            step,
            incarnation,
            contributions: local,
            total_weight: 1.0,
            lr: 1e-3,
            samples_committed: samples,
            remote,
        }
    }

    fn record(rank: usize, generation: u64, batches: Vec<BatchId>) -> HostRecord {
        let settings = (
            crate::train::optim::Hyper::constant_for_tests(1e-3).update(0, 0),
            ObjectiveKnobs { num_anchors: 4, gamma: None },
        );
        let part =
            DrafterPart { drafter: 0, generation: 1, batches, samples: 4, metrics: Metrics::default(), digest: None };
        HostRecord { rank, generation, settings, weight: 1.0, contributions: vec![part] }
    }

    /// Rank 0 assigns a joined host its part of every open step, commits what that host trained with the round,
    /// and takes back what a host that left was assigned: each batch is committed once, by whichever host.
    #[test]
    fn rank_0_assigns_the_other_hosts_and_commits_their_batches_once() {
        let mut c = core(HostRole::Leader);
        c.start(at(0.0));
        c.handle(at(0.1), Event::TargetReady { target: 0, generation: 1 });
        let actions = c.handle(at(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        let local = captured(&actions);
        assert_eq!(local.len(), 2, "two steps ahead, one batch each");
        let actions = c.handle(at(0.3), Event::Hosts(vec![member(0, 1, 0), member(1, 1, 0)]));
        let feeds = fed(&actions);
        assert_eq!(
            feeds.iter().map(|f| (f.0, f.1, f.2, f.3.len())).collect::<Vec<_>>(),
            vec![(1, 1, 0, 1), (1, 1, 1, 1)]
        );
        let remote: Vec<BatchId> = feeds.iter().map(|f| f.3[0]).collect();
        assert!(remote.iter().all(|b| !local.contains(b)), "no batch goes to two hosts");

        // Round 0: both hosts trained theirs; both are committed.
        let r = report(0, 1, vec![contributed(0, vec![local[0]])], vec![record(1, 1, vec![remote[0]])]);
        let actions = c.handle(at(0.4), Event::Round(r));
        assert_eq!(committed(&actions), vec![local[0], remote[0]]);
        let opened = fed(&actions);
        assert_eq!(opened.len(), 1, "the next step opened feeds host 1 too: {opened:?}");
        let position = actions.iter().find_map(|a| match a {
            Action::Feed { position, .. } => Some(position.clone()),
            _ => None,
        });
        let position = position.unwrap();
        assert_eq!((position.step, position.samples_committed), (1, 8), "where the run stands comes with the feed");
        assert!(remote[1..].iter().all(|b| position.loader.owed.contains(b)), "handed out, not committed: owed");

        // Host 1 leaves before round 1: what it was assigned goes back and is handed out again (here, to rank 0).
        c.handle(at(0.5), Event::Hosts(vec![member(0, 1, 0)]));
        let r = report(1, 1, vec![contributed(0, vec![local[1]])], vec![]);
        let actions = c.handle(at(0.6), Event::Round(r));
        assert_eq!(committed(&actions), vec![local[1]]);
        assert!(actions.contains(&Action::Notice(Notice::Requeued { samples: 4 })), "{actions:?}");
        assert!(fed(&actions).is_empty(), "nothing more for a host that left");
        assert_eq!(captured(&actions), vec![remote[1]], "the batch host 1 did not train is handed out first");
    }

    /// A follower that rank 0 dropped (it was stopped past its beat's silence) is not ready and says why; its
    /// drafters, which would wait for assignments that never come, start again; it is ready once one is live again.
    /// Rank 0 ignores the word.
    #[test]
    fn a_follower_dropped_from_the_run_is_not_ready_until_it_is_back() {
        let mut c = follower_at(0);
        assert!(c.ready());
        let actions = c.handle(at(20.0), Event::LeftRun);
        assert!(actions.contains(&Action::Abandon { id: 0, generation: 1 }), "{actions:?}");
        let status = c.status();
        assert!(!status.ready && status.problems.iter().any(|p| p.contains("rank 0 dropped this host")), "{status:?}");
        c.handle(at(20.0), Event::MemberRemoved { remaining: vec![] });
        let actions = c.handle(at(25.0), Event::Tick);
        assert!(actions.iter().any(|a| matches!(a, Action::SpawnDrafter { id: 0, generation: 2, .. })), "{actions:?}");
        c.handle(at(25.1), Event::DrafterReady { id: 0, generation: 2 });
        c.handle(at(25.2), Event::DrafterJoined { id: 0, generation: 2, step: 30 });
        assert!(c.ready() && c.status().problems.is_empty(), "{:?}", c.status());

        let mut leader = core(HostRole::Leader);
        leader.start(at(0.0));
        assert!(leader.handle(at(1.0), Event::LeftRun).is_empty());
    }

    /// Seeded schedules of what a follower lives through, driving the core: steps trained as fed, rank 0 silent
    /// for up to two minutes (its drafter fed and waiting for its round), this process stopped for up to two
    /// minutes (its drafter computing across the gap), rank 0 dropping this host (it restarts its drafter and comes
    /// back), and at the end rank 0 lost. Checked: no wait for rank 0 and no stop fails the drafter; a dropped host
    /// is not ready until its drafter is live again; rank 0 lost, the host checkpoints its replica and exits 75.
    #[test]
    fn sim_a_follower_rides_out_silences_stops_and_drops() {
        use rand::{Rng, SeedableRng};

        use crate::service::supervisor::watchdog::{Activity, DrafterSeen};
        let abandons = |actions: &[Action]| {
            actions.iter().any(|a| matches!(a, Action::Abandon { .. } | Action::AbandonTarget { .. }))
        };
        'seeds: for seed in 0..64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut c = follower_at(0);
            // A hang budget of 10 s (unmeasured: rank 0 commits the rounds): every silence and stop is longer.
            c.config.supervision.step_timeout_s = 10.0;
            let (mut t, mut step, mut generation) = (0.3, 0, 1);
            let watch = |generation, activity, for_: f64| {
                Event::Watch(vec![DrafterSeen {
                    id: 0,
                    generation,
                    activity,
                    for_: at(for_),
                    running: vec![],
                    injected: false,
                }])
            };
            // The drafter's step: fed and captured, then (after `wait` s: rank 0 silent, the drafter waiting for its
            // round) the round and the update applied. Returns the actions of the time in between.
            let train = |c: &mut Core, t: &mut f64, step: &mut u64, generation: u64, wait: Option<f64>| {
                let item = Item::Capture { batch: id(*step), positions: vec![0, 1] };
                let position = position(*step, 4 * *step, 0, *step + 1, vec![]);
                for action in c.handle(at(*t), Event::Fed { step: *step, items: vec![(0, item)], position }) {
                    if let Action::TargetRequest { target, generation, request } = action {
                        c.handle(at(*t), Event::Delivered { target, generation, seq: request.seq });
                    }
                }
                let waited = match wait {
                    Some(silent) => {
                        *t += silent;
                        c.handle(at(*t), watch(generation, Activity::WaitingForPeers, silent))
                    }
                    None => vec![],
                };
                let mine = Contributed { generation, ..contributed(0, vec![id(*step)]) };
                let r = report(*step, c.incarnation, vec![mine], vec![record(0, 1, vec![])]);
                c.handle(at(*t + 0.05), Event::Round(r));
                let done = Event::StepDone {
                    id: 0,
                    generation,
                    step: *step + 1,
                    digest: None,
                    applied: true,
                    feature_wait_s: 0.0,
                };
                c.handle(at(*t + 0.06), done);
                (*t, *step) = (*t + 0.1, *step + 1);
                waited
            };
            for _ in 0..40 {
                match rng.random_range(0..10) {
                    0..=5 => {
                        train(&mut c, &mut t, &mut step, generation, None);
                    }
                    6 | 7 => {
                        let silent = rng.random_range(15.0..120.0);
                        let actions = train(&mut c, &mut t, &mut step, generation, Some(silent));
                        assert!(!abandons(&actions), "seed {seed}: waited {silent:.0} s for rank 0: {actions:?}");
                    }
                    8 => {
                        let stopped = rng.random_range(15.0..120.0);
                        c.handle(at(t + stopped), Event::Stopped { for_: at(stopped) });
                        let actions = c.handle(at(t + stopped + 0.2), watch(generation, Activity::Computing, stopped));
                        assert!(!abandons(&actions), "seed {seed}: stopped {stopped:.0} s: {actions:?}");
                        t += stopped + 0.2;
                    }
                    _ => {
                        let actions = c.handle(at(t), Event::LeftRun);
                        assert!(actions.contains(&Action::Abandon { id: 0, generation }), "seed {seed}: {actions:?}");
                        if actions.contains(&Action::Exit { code: EXIT_NO_PROGRESS }) {
                            // Dropped more often than `max_restarts` allows within its window: a flapping host ends.
                            let restarts = c.status().drafters[0].restarts;
                            assert!(restarts >= c.supervision().max_restarts as u64, "seed {seed}: {restarts}");
                            continue 'seeds;
                        }
                        c.handle(at(t), Event::MemberRemoved { remaining: vec![] });
                        assert!(!c.ready(), "seed {seed}: dropped, yet ready");
                        t += 10.0;
                        let actions = c.handle(at(t), Event::Tick);
                        let Some(Action::SpawnDrafter { generation: g, .. }) =
                            actions.iter().find(|a| matches!(a, Action::SpawnDrafter { .. }))
                        else {
                            panic!("seed {seed}: no restart: {actions:?}")
                        };
                        generation = *g;
                        assert!(!c.ready(), "seed {seed}: restarting, yet ready");
                        c.handle(at(t + 0.1), Event::DrafterReady { id: 0, generation });
                        c.handle(at(t + 0.2), Event::DrafterJoined { id: 0, generation, step });
                        assert!(c.ready(), "seed {seed}: back, yet not ready: {:?}", c.status().problems);
                        t += 0.3;
                    }
                }
            }
            let actions = c.handle(at(t), Event::RendezvousLost("no answer for 60.0 s".into()));
            if step == 0 {
                assert_eq!(actions.last(), Some(&Action::Exit { code: EXIT_RESTART }), "seed {seed}: nothing to keep");
                continue;
            }
            assert!(
                actions.contains(&Action::Tell { id: 0, generation, order: Order::Checkpoint { at: 0 } }),
                "seed {seed}: {actions:?}"
            );
            let snapshot = Event::Snapshot { id: 0, generation, step, optimizer_steps: step };
            let actions = c.handle(at(t + 0.1), snapshot);
            assert!(
                matches!(&actions[..], [Action::WriteCheckpoint(job)] if job.step == step),
                "seed {seed}: {actions:?}"
            );
            let written = written(step, c.incarnation, "x", 0.1);
            assert_eq!(
                c.handle(at(t + 0.2), written).last(),
                Some(&Action::Exit { code: EXIT_RESTART }),
                "seed {seed}"
            );
        }
    }

    /// A follower's drafter waiting for rank 0 (its round's decision, its next assignment) is not failed for it,
    /// however long rank 0 is silent: `cluster.leader_timeout_s` judges rank 0 (the shell's feed reader). A drafter
    /// of its own that hangs is still failed.
    #[test]
    fn a_follower_waiting_for_rank_0_is_not_failed_for_waiting() {
        use crate::service::supervisor::watchdog::{Activity, DrafterSeen};
        let mut c = follower_at(0);
        c.config.supervision.step_timeout_s = 10.0;
        let watched = |activity, for_| {
            Event::Watch(vec![DrafterSeen {
                id: 0,
                generation: 1,
                activity,
                for_: at(for_),
                running: vec![],
                injected: false,
            }])
        };
        let item = Item::Capture { batch: id(3), positions: vec![0, 1] };
        for action in c.handle(at(0.3), Event::Fed { step: 0, items: vec![(0, item)], position: None }) {
            if let Action::TargetRequest { target, generation, request } = action {
                c.handle(at(0.4), Event::Delivered { target, generation, seq: request.seq });
            }
        }
        for activity in [Activity::WaitingForPeers, Activity::WaitingForWork] {
            let actions = c.handle(at(60.0), watched(activity, 59.0));
            assert!(!actions.iter().any(|a| matches!(a, Action::Abandon { .. })), "{activity:?}: {actions:?}");
        }
        let actions = c.handle(at(61.0), watched(Activity::Computing, 11.0));
        assert!(actions.contains(&Action::Abandon { id: 0, generation: 1 }), "{actions:?}");
    }

    /// Another host trains what rank 0 feeds it from the step it entered at, writes no ledger and no checkpoint,
    /// enters again (no checkpoint read, nothing rewound) when its collective is empty, and ends with the run.
    #[test]
    fn another_host_trains_what_it_is_fed_and_writes_nothing() {
        let mut c = core(HostRole::Follower);
        c.start(at(0.0));
        let actions = c.handle(at(0.1), Event::TargetReady { target: 0, generation: 1 });
        assert!(actions.contains(&Action::SpawnDrafter { id: 0, generation: 1, start: Start::Found(None) }));
        assert!(!actions.iter().any(|a| matches!(a, Action::FindCheckpoint(_))));
        assert!(actions.iter().any(|a| matches!(a, Action::RewindCollective { .. })), "a new incarnation here");
        c.handle(at(0.2), Event::DrafterJoined { id: 0, generation: 1, step: 7 });
        let batch = BatchId { epoch: 0, ordinal: 3 };
        let item = Item::Capture { batch, positions: vec![0, 1] };
        let actions = c.handle(at(0.3), Event::Fed { step: 6, items: vec![(0, item.clone())], position: None });
        assert!(captured(&actions).is_empty(), "a step before it entered");
        let actions = c.handle(at(0.3), Event::Fed { step: 7, items: vec![(0, item)], position: None });
        assert_eq!(captured(&actions), vec![batch]);
        let r = report(7, 1, vec![contributed(0, vec![batch])], vec![record(0, 1, vec![])]);
        let actions = c.handle(at(0.4), Event::Round(r));
        assert!(committed(&actions).is_empty(), "rank 0 keeps the ledger");
        assert!(c.checkpoint_now(at(0.5)).0.is_err());
        for (step, ordinal) in [(8, 4), (9, 6)] {
            let item = Item::Capture { batch: BatchId { epoch: 0, ordinal }, positions: vec![2, 3] };
            assert_eq!(
                captured(&c.handle(at(0.5), Event::Fed { step, items: vec![(0, item)], position: None })).len(),
                1
            );
        }

        let failure = Failure::panic("boom".into());
        let actions =
            c.handle(at(0.6), Event::DrafterFailed { id: 0, generation: 1, failure, running: vec![], injected: false });
        let removed = c.handle(at(0.6), Event::MemberRemoved { remaining: vec![] });
        let actions: Vec<Action> = actions.into_iter().chain(removed).chain(c.handle(at(5.0), Event::Tick)).collect();
        assert!(
            actions
                .iter()
                .any(|a| matches!(a, Action::SpawnDrafter { id: 0, generation: 2, start: Start::Found(None) })),
            "{actions:?}"
        );
        // Admitted again at step 8 (steps 8 and 9 were open for generation 1): rank 0 feeds the new generation
        // step 8 before its founder has the state, and the step is kept for it.
        let batch = BatchId { epoch: 0, ordinal: 5 };
        let item = Item::Capture { batch, positions: vec![0, 1] };
        assert!(
            captured(&c.handle(at(5.1), Event::Fed { step: 8, items: vec![(0, item)], position: None })).is_empty()
        );
        let actions = c.handle(at(5.2), Event::DrafterJoined { id: 0, generation: 2, step: 8 });
        assert_eq!(captured(&actions), vec![batch], "{actions:?}");
        assert!(!actions.iter().any(|a| matches!(
            a,
            Action::FindCheckpoint(_)
                | Action::RetireCheckpoints { .. }
                | Action::Ledger(_)
                | Action::WriteCheckpoint(_)
        )));
        assert_eq!(c.handle(at(6.0), Event::RunEnded { code: 0 }).last(), Some(&Action::Exit { code: 0 }));
    }

    /// Rank 0 lost: another host checkpoints its replica at the boundary it stands at, with the run's state there
    /// derived from rank 0's last word and the round since, into its own folder, then exits for a restart.
    #[test]
    fn another_host_checkpoints_its_replica_when_rank_0_is_lost() {
        let mut c = follower_at(7);
        let item = Item::Capture { batch: id(7), positions: vec![0, 1] };
        let fed = Event::Fed { step: 7, items: vec![(0, item)], position: position(7, 28, 1, 9, vec![id(7), id(8)]) };
        assert_eq!(captured(&c.handle(at(0.3), fed)), vec![id(7)]);
        let r = report(7, c.incarnation, vec![contributed(0, vec![id(7)])], vec![record(0, 1, vec![id(9)])]);
        c.handle(at(0.4), Event::Round(r));

        let actions = c.handle(at(1.0), Event::RendezvousLost("connection reset".into()));
        assert_eq!(actions, vec![Action::Tell { id: 0, generation: 1, order: Order::Checkpoint { at: 0 } }]);
        assert!(c.handle(at(1.1), Event::Tick).is_empty(), "nothing else goes on meanwhile");
        // The orchestrator stopping every pod of the job (SIGTERM) does not cut the checkpoint short.
        assert!(c.handle(at(1.1), Event::Shutdown(StopSignal::Terminate)).is_empty());
        let actions = c.handle(at(1.2), Event::Snapshot { id: 0, generation: 1, step: 8, optimizer_steps: 6 });
        let [Action::WriteCheckpoint(job)] = &actions[..] else { panic!("{actions:?}") };
        assert_eq!((job.donor, job.step, job.state.step, job.state.optimizer_steps), ((0, 1), 8, 8, 6));
        let loader = &job.state.loader;
        assert_eq!((loader.next_ordinal, &loader.owed), (10, &vec![id(8)]), "7 and 9 trained; 8 owed");
        assert_eq!(job.state.samples_committed, 36);
        assert_eq!(job.state.recent_commits, vec![(7, vec![id(7), id(9)])]);
        let written = written(8, c.incarnation, "x", 0.1);
        assert_eq!(c.handle(at(1.5), written).last(), Some(&Action::Exit { code: EXIT_RESTART }));

        // With no word from rank 0 yet there is nothing to checkpoint: the host exits at once.
        let mut c = follower_at(7);
        let actions = c.handle(at(1.0), Event::RendezvousLost("connection reset".into()));
        assert_eq!(actions.last(), Some(&Action::Exit { code: EXIT_RESTART }));
    }

    /// Rank 0 ending the run with an error (it may have had no replica left to checkpoint) is parted from the same
    /// way, exiting with rank 0's status; a complete run's end is not.
    #[test]
    fn rank_0_ending_the_run_with_an_error_has_the_others_checkpoint_too() {
        let started = || {
            let mut c = follower_at(3);
            c.handle(at(0.3), Event::Fed { step: 3, items: vec![], position: position(3, 12, 0, 5, vec![id(4)]) });
            c
        };
        let mut c = started();
        let actions = c.handle(at(1.0), Event::RunEnded { code: EXIT_NO_PROGRESS });
        assert_eq!(actions, vec![Action::Tell { id: 0, generation: 1, order: Order::Checkpoint { at: 0 } }]);
        let actions = c.handle(at(1.1), Event::Snapshot { id: 0, generation: 1, step: 3, optimizer_steps: 3 });
        assert!(matches!(&actions[..], [Action::WriteCheckpoint(job)] if job.state.loader.owed == vec![id(4)]));
        let written =
            Event::CheckpointWritten(Written { step: 3, incarnation: c.incarnation, result: Err("disk full".into()) });
        assert_eq!(c.handle(at(1.2), written).last(), Some(&Action::Exit { code: EXIT_NO_PROGRESS }));

        // Complete, or stopped with its checkpoint (preemption): the others end with rank 0's status, restartable.
        for code in [EXIT_OK, EXIT_TERMINATED, EXIT_INTERRUPTED] {
            let mut c = started();
            assert_eq!(c.handle(at(1.0), Event::RunEnded { code }).last(), Some(&Action::Exit { code }));
        }
    }

    /// A replica whose snapshot never comes does not keep the host: it exits at `shutdown_timeout_s`.
    #[test]
    fn a_host_parting_without_a_snapshot_exits_at_the_deadline() {
        let mut c = follower_at(7);
        c.handle(at(0.3), Event::Fed { step: 7, items: vec![], position: position(7, 28, 0, 9, vec![]) });
        c.handle(at(1.0), Event::RendezvousLost("connection reset".into()));
        let timeout = c.supervision().shutdown_timeout_s;
        assert!(c.handle(at(1.0 + timeout / 2.0), Event::Tick).is_empty());
        // A snapshot of another thread is not the one asked for.
        let actions =
            c.handle(at(1.0 + timeout / 2.0), Event::Snapshot { id: 0, generation: 9, step: 7, optimizer_steps: 0 });
        assert!(matches!(actions[..], [Action::DropSnapshots { .. }]), "{actions:?}");
        let actions = c.handle(at(1.1 + timeout), Event::Tick);
        assert_eq!(actions.last(), Some(&Action::Exit { code: EXIT_RESTART }));
    }

    /// Rank 0 resuming a checkpoint another host wrote puts the rounds that host derived back into the ledger (rank
    /// 0's own may have stopped short of them): the steps from the first are undone, then written again.
    #[test]
    fn rank_0_resuming_another_hosts_checkpoint_writes_its_rounds_to_the_ledger() {
        let loader = crate::data::loader::LoaderState { epoch: 0, next_ordinal: 6, owed: vec![] };
        let mut state = TrainerState::new(7, loader, serde_json::Value::Null);
        state.recent_commits = vec![(5, vec![id(2), id(3)]), (6, vec![id(4)])];
        let mut c = resumed(HostRole::Leader, Some(("survivor".into(), state)));
        c.start(at(0.0));
        let actions = c.handle(at(0.1), Event::TargetReady { target: 0, generation: 1 });
        let ledger: Vec<String> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Ledger(LedgerEntry::Rewind { step }) => Some(format!("rewind {step}")),
                Action::Ledger(LedgerEntry::Commit { step, batch }) => Some(format!("{step}: {}", batch.id.ordinal)),
                _ => None,
            })
            .collect();
        assert_eq!(ledger, ["rewind 5", "5: 2", "5: 3", "6: 4", "rewind 7"]);
        let commit = actions.iter().find_map(|a| match a {
            Action::Ledger(LedgerEntry::Commit { batch, .. }) => Some(batch.clone()),
            _ => None,
        });
        assert_eq!(commit, c.schedule.batch(id(2)), "with the batch's samples");
        assert_eq!(commit.unwrap().samples.len(), c.config.data.batch_size);
    }
}
