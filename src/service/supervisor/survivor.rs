//! What a host other than rank 0 needs to checkpoint the run by itself when rank 0 is lost. Rank 0 keeps the loader
//! and the ledger, so only it knows where the run stands; it says so with every assignment it posts (the
//! [`RunPosition`] of its newest settled step boundary). This host records those, and what each round it took part
//! in committed (every host's batches, as the round's records name them). From a position at boundary `S` and the
//! rounds `S..T`, the run's state at boundary `T` follows ([`Survivor::state_at`]), `T` being where this host's
//! replicas stand when rank 0 goes, which may be past the newest position rank 0 could post.
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::data::loader::{BatchId, LoaderState};
use crate::train::checkpoint::TrainerState;
use crate::train::collective::RoundReport;

/// Where the run stands at a step boundary, as rank 0 tells the other hosts: a checkpoint's trainer state without
/// the optimizer's count (the replica's own) and the configuration (every host has it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunPosition {
    pub step: u64,
    pub samples_committed: u64,
    pub skipped_steps: u64,
    pub loader: LoaderState,
    pub set_aside: Vec<BatchId>,
    pub lr: f64,
    /// The commits up to `step` that rank 0's ledger had not confirmed written (from the earliest step its
    /// unconfirmed lines touched, a rewind's included), as in its own checkpoints' `recent_commits`: a checkpoint
    /// taken from here writes them again when resumed, so that the ledger holds this run's history even if rank 0's
    /// writer lost them (killed while its disk was full), its rewind line among them.
    #[serde(default)]
    pub unwritten: Vec<(u64, Vec<BatchId>)>,
}

/// What one round committed, as every host reads it.
#[derive(Debug, Clone, PartialEq)]
struct RoundTaken {
    batches: Vec<BatchId>,
    samples: u64,
    lr: f64,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Survivor {
    positions: BTreeMap<u64, RunPosition>,
    rounds: BTreeMap<u64, RoundTaken>,
    skipped: BTreeSet<u64>,
}

impl Survivor {
    /// Positions kept (the newest): enough to reach back past rounds this host's replicas did not get to.
    const POSITIONS: usize = 8;
    /// Rounds kept at most (while rank 0 posts no position: it has no live drafter, and ends the run soon).
    const ROUNDS: usize = 4096;

    /// Rank 0's position at a step boundary (it comes with each assignment).
    pub fn position(&mut self, position: RunPosition) {
        self.positions.insert(position.step, position);
        while self.positions.len() > Self::POSITIONS {
            self.positions.pop_first();
        }
        if let Some(&oldest) = self.positions.keys().next() {
            self.rounds.retain(|&r, _| r >= oldest);
            self.skipped.retain(|&r| r >= oldest);
        }
    }

    /// A round this host took part in: every host's batches in it are committed.
    pub fn round(&mut self, report: &RoundReport) {
        let local = report.contributions.iter().flat_map(|c| c.batches.iter().copied());
        let remote = report.remote.iter().flat_map(|h| h.contributions.iter().flat_map(|c| c.batches.iter().copied()));
        let taken = RoundTaken { batches: local.chain(remote).collect(), samples: report.samples(), lr: report.lr };
        self.rounds.insert(report.step, taken);
        while self.rounds.len() > Self::ROUNDS {
            self.rounds.pop_first();
        }
    }

    /// Round `round`'s update was skipped on every host (its samples stay committed).
    pub fn skipped(&mut self, round: u64) {
        self.skipped.insert(round);
    }

    /// Whether rank 0 has said where the run stands yet.
    pub fn has_position(&self) -> bool {
        !self.positions.is_empty()
    }

    /// The run's trainer state at boundary `step` (`config`: the merged configuration; the optimizer's count is the
    /// snapshot's), from the newest position at or before it and the rounds since, with those rounds' batches as
    /// `recent_commits`. An error when no such position came or a round between is not known here.
    pub fn state_at(
        &self,
        step: u64,
        batches_per_epoch: usize,
        config: serde_json::Value,
    ) -> Result<TrainerState, String> {
        let Some((_, from)) = self.positions.range(..=step).next_back() else {
            return Err(format!("rank 0 never said where the run stood at or before step {step}"));
        };
        let (mut samples, mut skipped, mut lr) = (from.samples_committed, from.skipped_steps, from.lr);
        let mut recent = from.unwritten.clone();
        for round in from.step..step {
            let Some(r) = self.rounds.get(&round) else {
                return Err(format!("round {round} is not known here (rank 0's position is of step {})", from.step));
            };
            samples += r.samples;
            skipped += u64::from(self.skipped.contains(&round));
            lr = r.lr;
            recent.push((round, r.batches.clone()));
        }
        let rounds = &recent[from.unwritten.len()..];
        let committed: Vec<BatchId> = rounds.iter().flat_map(|(_, b)| b.iter().copied()).collect();
        let mut state = TrainerState::new(step, from.loader.advanced(&committed, batches_per_epoch), config);
        state.samples_committed = samples;
        state.skipped_steps = skipped;
        state.set_aside = from.set_aside.clone();
        state.lr = lr;
        state.recent_commits = recent;
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::collective::Contributed;
    use crate::train::link::{DrafterPart, HostRecord};
    use crate::train::objective::Metrics;

    fn id(epoch: u64, ordinal: u64) -> BatchId {
        BatchId { epoch, ordinal }
    }

    fn position(step: u64, next_ordinal: u64, owed: Vec<BatchId>) -> RunPosition {
        RunPosition {
            step,
            samples_committed: 100,
            skipped_steps: 1,
            loader: LoaderState { epoch: 0, next_ordinal, owed },
            set_aside: vec![id(0, 1)],
            lr: 1e-3,
            unwritten: vec![],
        }
    }

    /// A round where this host trained `mine` and rank 0 trained `theirs`, two samples a batch.
    fn round(step: u64, mine: Vec<BatchId>, theirs: Vec<BatchId>, lr: f64) -> RoundReport {
        let part = |batches: Vec<BatchId>| DrafterPart {
            drafter: 0,
            generation: 1,
            samples: 2 * batches.len() as u64,
            batches,
            metrics: Metrics::default(),
            digest: None,
        };
        let settings = (
            crate::train::optim::UpdateSettings {
                adamw: crate::ffi::accel::AdamwStep { lr, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
                muon: None,
                grad_clip: None,
            },
            crate::train::objective::ObjectiveKnobs { num_anchors: 4, gamma: None },
        );
        RoundReport {
            step,
            incarnation: 1,
            contributions: vec![Contributed {
                member: 0,
                generation: 1,
                samples: 2 * mine.len() as u64,
                batches: mine,
                metrics: Metrics::default(),
            }],
            total_weight: 1.0,
            lr,
            samples_committed: 0,
            remote: vec![HostRecord {
                rank: 0,
                generation: 1,
                settings,
                weight: 1.0,
                contributions: vec![part(theirs)],
            }],
        }
    }

    /// Rank 0's position at step 10 (batches 8 and 9 handed out for steps 10-11, batch 3 owed) and rounds 10-12
    /// give the state at 13: every host's batches of those rounds committed, the rest owed or new.
    #[test]
    fn the_state_at_a_later_boundary_follows_from_a_position_and_the_rounds_since() {
        let mut s = Survivor::default();
        s.position(position(10, 10, vec![id(0, 3), id(0, 8), id(0, 9)]));
        s.round(&round(10, vec![id(0, 8)], vec![id(0, 3)], 1e-3));
        s.round(&round(11, vec![id(0, 11)], vec![id(0, 9)], 9e-4));
        s.skipped(11);
        s.round(&round(12, vec![], vec![id(0, 13)], 8e-4));
        let state = s.state_at(13, 100, serde_json::json!({"k": 1})).unwrap();
        assert_eq!(state.step, 13);
        assert_eq!(state.loader, LoaderState { epoch: 0, next_ordinal: 14, owed: vec![id(0, 10), id(0, 12)] });
        assert_eq!(state.samples_committed, 100 + 2 * 5, "five batches of two samples");
        assert_eq!(state.skipped_steps, 2);
        assert_eq!(state.lr, 8e-4);
        assert_eq!(state.set_aside, vec![id(0, 1)]);
        assert_eq!(state.config, serde_json::json!({"k": 1}));
        let rounds: Vec<u64> = state.recent_commits.iter().map(|(r, _)| *r).collect();
        assert_eq!(rounds, vec![10, 11, 12]);
        assert_eq!(state.recent_commits[1].1, vec![id(0, 11), id(0, 9)]);

        // At the position's own boundary: the position itself.
        let at = s.state_at(10, 100, serde_json::Value::Null).unwrap();
        assert_eq!((at.loader.next_ordinal, at.recent_commits.len(), at.samples_committed), (10, 0, 100));
    }

    /// Commits rank 0's ledger had not confirmed when it posted its position (its start's rewind among them) go
    /// first into the checkpoint's `recent_commits`, so that resuming it writes them again from their earliest step;
    /// they are not counted again in the loader or the samples (the position has them).
    #[test]
    fn lines_rank_0_had_not_written_come_first_in_the_recent_commits() {
        let mut s = Survivor::default();
        let unwritten = vec![(0, vec![]), (8, vec![id(0, 6)]), (9, vec![id(0, 7)])];
        s.position(RunPosition { unwritten: unwritten.clone(), ..position(10, 10, vec![id(0, 8)]) });
        s.round(&round(10, vec![id(0, 8)], vec![], 1e-3));
        let state = s.state_at(11, 100, serde_json::Value::Null).unwrap();
        let steps: Vec<u64> = state.recent_commits.iter().map(|(r, _)| *r).collect();
        assert_eq!(steps, vec![0, 8, 9, 10], "from the unwritten rewind's step on");
        assert_eq!(state.recent_commits[..3], unwritten[..]);
        assert_eq!(state.loader, LoaderState { epoch: 0, next_ordinal: 10, owed: vec![] });
        assert_eq!(state.samples_committed, 102, "the round's batch only");
    }

    /// A newer position than this host's replicas (rank 0 settled a round this host never got the word of) is
    /// passed over for an older one; a round missing between, or no position at all, is an error.
    #[test]
    fn the_newest_position_not_past_the_replicas_is_used_and_gaps_are_errors() {
        let mut s = Survivor::default();
        assert!(s.state_at(5, 100, serde_json::Value::Null).unwrap_err().contains("never said"));
        s.position(position(4, 6, vec![id(0, 4), id(0, 5)]));
        s.round(&round(4, vec![id(0, 4)], vec![id(0, 5)], 1e-3));
        s.position(position(6, 8, vec![id(0, 6), id(0, 7)]));
        let state = s.state_at(5, 100, serde_json::Value::Null).unwrap();
        assert_eq!(state.loader, LoaderState { epoch: 0, next_ordinal: 6, owed: vec![] });
        assert!(s.state_at(8, 100, serde_json::Value::Null).unwrap_err().contains("round 6"));
        for step in 7..20 {
            s.position(position(step, step + 2, vec![]));
        }
        assert!(s.state_at(5, 100, serde_json::Value::Null).unwrap_err().contains("never said"), "old ones pruned");
        assert_eq!(s.rounds.len(), 0, "rounds before the oldest position kept are dropped");
    }
}
