//! The one executor of the core's decisions, shared by the process and the simulator.
//!
//! [`Driver`] hands events to the [`Core`] and carries out the actions it answers (and what their own answers lead
//! to, in order) through [`Effects`]: the process implements them with threads, actors, disk and TCP (the shell,
//! `supervisor/effects.rs`), the simulator in memory (`sim.rs`). Everything between an event and its effects (noticing
//! time the process did not run, the queue of actions, the snapshots kept for the checkpoint writer, which action
//! is answered by which event, what counts as a supervisor bug) is written here once, so the simulator's seeds
//! drive the code that runs in production.
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Duration;

use super::core::Core;
use super::protocol::{Action, Event, Feed, LedgerEntry, Notice, Order, Request, ScanFilter, Start, WriteJob};
use super::watchdog::TickGaps;
use crate::train::checkpoint::Written;

/// What carrying out the core's actions takes from the world. Calls that answer later do so with an event
/// delivered through [`Driver::handle`] (a target copy's readiness or failure, a scan's, a write's, an export's
/// outcome).
pub trait Effects {
    /// A drafter's snapshot as the checkpoint writer takes it: the state itself in the process, a model of it in
    /// the simulator.
    type Snapshot;

    /// Monotonic time since the process started.
    fn now(&self) -> Duration;

    /// Starts target copy `target`'s thread `generation`; a failure to start arrives as `TargetFailed`.
    fn start_target(&mut self, target: usize, generation: u64);
    /// Gives up target thread `generation` (failed or hung): it delivers nothing more.
    fn abandon_target(&mut self, target: usize, generation: u64);
    /// Sends `request` to target thread `generation`, if it is still the copy's thread.
    fn send_to_target(&mut self, target: usize, generation: u64, request: Request);

    /// Starts drafter `id`'s thread `generation`.
    fn start_drafter(&mut self, id: usize, generation: u64, start: Start);
    /// Gives up drafter thread `(id, generation)`: out of the collective (its join request too) and the routes, its
    /// actor stopped, to stop quietly if it ever wakes. Returns the collective's members left, `(id, generation)`.
    fn abandon_drafter(&mut self, id: usize, generation: u64) -> Vec<(usize, u64)>;
    /// Delivers `order` to drafter thread `(id, generation)`, if it is still the drafter's thread.
    fn tell(&mut self, id: usize, generation: u64, order: Order);
    /// Moves the (empty) collective to `step` as a new incarnation; the writer discards older incarnations' writes.
    fn rewind_collective(&mut self, step: u64, samples_committed: u64) -> Result<(), String>;

    /// Looks for the newest valid checkpoint `filter` allows; answered by `CheckpointFound`.
    fn find_checkpoint(&mut self, filter: ScanFilter);
    /// Hands a checkpoint to the writer; answered by `CheckpointWritten`.
    fn write_checkpoint(&mut self, job: WriteJob, snapshot: Self::Snapshot);
    /// Moves the checkpoints of steps `from..=to` aside, in order with the writes.
    fn retire_checkpoints(&mut self, from: u64, to: u64);
    /// Appends to the run's ledger; the writer answers with `LedgerWritten`.
    fn append_ledger(&mut self, entry: LedgerEntry);
    /// Exports checkpoint `from`'s drafter; answered by `Exported`.
    fn export(&mut self, from: PathBuf);
    /// Evaluates checkpoint `path` of `step`; answered by `Evaluated`.
    fn evaluate(&mut self, core: &Core, step: u64, path: PathBuf);

    /// Several hosts, rank 0: posts host `rank`'s assignment for `step`.
    fn post_feed(&mut self, rank: usize, generation: u64, step: u64, feed: Feed);
    /// Shows what happened (metrics, the simulator's progress clock).
    fn notice(&mut self, notice: Notice);
    /// The run is over: ends the process with `code`.
    fn exit(&mut self, core: &Core, code: i32);

    /// The core asked for what cannot be (a bug of the supervisor): the process logs it, the simulator fails.
    fn bug(&mut self, what: String);
    /// Sees each event the core handles (the simulator's trace).
    fn saw_event(&mut self, _event: &Event) {}
    /// Sees each action before it is carried out (the simulator's trace).
    fn saw_action(&mut self, _action: &Action) {}
}

/// The core, and what stands between it and the world's effects.
pub struct Driver<S> {
    core: Core,
    /// Snapshots received and not yet written, by `(drafter, generation, step)`.
    snapshots: HashMap<(usize, u64, u64), S>,
    /// Gaps in the ticks: time this process did not run.
    gaps: TickGaps,
}

impl<S> Driver<S> {
    pub fn new(core: Core) -> Self {
        Driver { core, snapshots: HashMap::new(), gaps: TickGaps::default() }
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    /// Starts the run: what the core does first.
    pub fn start<E: Effects<Snapshot = S>>(&mut self, fx: &mut E) {
        let actions = self.core.start(fx.now());
        self.perform(fx, actions);
    }

    /// A message reached the process (`tick`: the periodic one): time the process did not run before it, if any,
    /// reaches the core first, as [`Event::Stopped`].
    pub fn arrived<E: Effects<Snapshot = S>>(&mut self, fx: &mut E, tick: bool) {
        if let Some(for_) = self.gaps.observe(fx.now(), tick) {
            self.handle(fx, Event::Stopped { for_ });
        }
    }

    /// Hands `event` to the core and carries out what it answers, and what those answers lead to, in order.
    pub fn handle<E: Effects<Snapshot = S>>(&mut self, fx: &mut E, event: Event) {
        fx.saw_event(&event);
        let actions = self.core.handle(fx.now(), event);
        self.perform(fx, actions);
    }

    /// Keeps drafter thread `(id, generation)`'s state at `step` for the writer, until the core writes or drops it
    /// (the event [`Event::Snapshot`] that tells the core follows).
    pub fn keep_snapshot(&mut self, at: (usize, u64, u64), snapshot: S) {
        self.snapshots.insert(at, snapshot);
    }

    /// `POST /checkpoint`: the core's answer, its actions carried out.
    pub fn checkpoint_now<E: Effects<Snapshot = S>>(&mut self, fx: &mut E) -> Result<u64, String> {
        let (answer, actions) = self.core.checkpoint_now(fx.now());
        self.perform(fx, actions);
        answer
    }

    fn perform<E: Effects<Snapshot = S>>(&mut self, fx: &mut E, actions: Vec<Action>) {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            fx.saw_action(&action);
            if let Some(event) = self.carry_out(fx, action) {
                fx.saw_event(&event);
                queue.extend(self.core.handle(fx.now(), event));
            }
        }
    }

    /// Carries out one action; some answer with an event at once.
    fn carry_out<E: Effects<Snapshot = S>>(&mut self, fx: &mut E, action: Action) -> Option<Event> {
        match action {
            Action::StartTarget { target, generation } => fx.start_target(target, generation),
            Action::AbandonTarget { target, generation } => fx.abandon_target(target, generation),
            Action::TargetRequest { target, generation, request } => fx.send_to_target(target, generation, request),
            Action::SpawnDrafter { id, generation, start } => fx.start_drafter(id, generation, start),
            Action::Abandon { id, generation } => {
                let remaining = fx.abandon_drafter(id, generation);
                return Some(Event::MemberRemoved { remaining });
            }
            Action::Tell { id, generation, order } => fx.tell(id, generation, order),
            Action::RewindCollective { step, samples_committed } => {
                if let Err(e) = fx.rewind_collective(step, samples_committed) {
                    fx.bug(format!("rewinding the collective to step {step}: {e}"));
                }
            }
            Action::FindCheckpoint(filter) => fx.find_checkpoint(filter),
            Action::WriteCheckpoint(job) => match self.snapshots.remove(&(job.donor.0, job.donor.1, job.step)) {
                Some(snapshot) => fx.write_checkpoint(job, snapshot),
                None => {
                    let (step, incarnation) = (job.step, job.incarnation);
                    fx.bug(format!("a checkpoint of step {step} without its snapshot"));
                    let result = Err("its snapshot is missing (a supervisor bug)".to_string());
                    return Some(Event::CheckpointWritten(Written { step, incarnation, result }));
                }
            },
            Action::RetireCheckpoints { from, to } => fx.retire_checkpoints(from, to),
            Action::DropSnapshots { which: Some(key) } => {
                self.snapshots.remove(&key);
            }
            Action::DropSnapshots { which: None } => self.snapshots.clear(),
            Action::Evaluate { step, path } => fx.evaluate(&self.core, step, path),
            Action::Ledger(entry) => fx.append_ledger(entry),
            Action::Export { from } => fx.export(from),
            Action::Notice(notice) => fx.notice(notice),
            Action::Feed { rank, generation, step, items, position } => {
                fx.post_feed(rank, generation, step, Feed { items, position: Some(position) })
            }
            Action::Exit { code } => fx.exit(&self.core, code),
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::loader::LoaderState;
    use crate::service::failure::Failure;
    use crate::service::supervisor::core::tests::setup;
    use crate::train::checkpoint::TrainerState;

    /// Effects that record what they were asked, with a clock the test moves.
    #[derive(Default)]
    struct Recorder {
        now: Duration,
        seen: Vec<String>,
        bugs: Vec<String>,
        written: Vec<(u64, &'static str)>,
        /// What the collective has left after an abandon.
        remaining: Vec<(usize, u64)>,
    }

    impl Effects for Recorder {
        type Snapshot = &'static str;
        fn now(&self) -> Duration {
            self.now
        }
        fn start_target(&mut self, _: usize, _: u64) {}
        fn abandon_target(&mut self, _: usize, _: u64) {}
        fn send_to_target(&mut self, _: usize, _: u64, _: Request) {}
        fn start_drafter(&mut self, _: usize, _: u64, _: Start) {}
        fn abandon_drafter(&mut self, id: usize, generation: u64) -> Vec<(usize, u64)> {
            self.remaining.retain(|m| *m != (id, generation));
            self.remaining.clone()
        }
        fn tell(&mut self, _: usize, _: u64, _: Order) {}
        fn rewind_collective(&mut self, _: u64, _: u64) -> Result<(), String> {
            Ok(())
        }
        fn find_checkpoint(&mut self, _: ScanFilter) {}
        fn write_checkpoint(&mut self, job: WriteJob, snapshot: &'static str) {
            self.written.push((job.step, snapshot));
        }
        fn retire_checkpoints(&mut self, _: u64, _: u64) {}
        fn append_ledger(&mut self, _: LedgerEntry) {}
        fn export(&mut self, _: PathBuf) {}
        fn evaluate(&mut self, _: &Core, _: u64, _: PathBuf) {}
        fn post_feed(&mut self, _: usize, _: u64, _: u64, _: Feed) {}
        fn notice(&mut self, _: Notice) {}
        fn exit(&mut self, _: &Core, _: i32) {}
        fn bug(&mut self, what: String) {
            self.bugs.push(what);
        }
        fn saw_event(&mut self, event: &Event) {
            self.seen.push(format!("{event:?}"));
        }
        fn saw_action(&mut self, action: &Action) {
            self.seen.push(format!("<- {action:?}"));
        }
    }

    fn driver(drafters: usize) -> Driver<&'static str> {
        Driver::new(Core::new(setup(drafters)))
    }

    fn job(step: u64) -> WriteJob {
        let loader = LoaderState::default();
        WriteJob {
            donor: (0, 1),
            step,
            incarnation: 0,
            state: TrainerState::new(step, loader, serde_json::Value::Null),
            invalid: vec![],
        }
    }

    /// An action that answers at once (a drafter given up: the members left) has its answer handled before the
    /// next action is carried out, so the core decides on what the collective holds now.
    #[test]
    fn an_answer_reaches_the_core_before_the_next_action() {
        let mut d = driver(2);
        let mut fx = Recorder { remaining: vec![(0, 1), (1, 1)], ..Recorder::default() };
        d.start(&mut fx);
        d.handle(&mut fx, Event::TargetReady { target: 0, generation: 1 });
        d.handle(&mut fx, Event::DrafterJoined { id: 0, generation: 1, step: 0 });
        d.handle(&mut fx, Event::DrafterJoined { id: 1, generation: 1, step: 0 });
        fx.seen.clear();
        let failure = Failure::panic("boom".into());
        d.handle(&mut fx, Event::DrafterFailed { id: 1, generation: 1, failure, running: vec![], injected: false });
        let abandon = fx.seen.iter().position(|s| s.starts_with("<- Abandon { id: 1, generation: 1 }"));
        let abandon = abandon.unwrap_or_else(|| panic!("drafter 1 was not given up: {:?}", fx.seen));
        assert_eq!(fx.seen[abandon + 1], "MemberRemoved { remaining: [(0, 1)] }", "{:?}", fx.seen);
        assert!(fx.bugs.is_empty(), "{:?}", fx.bugs);
    }

    /// The writer gets the snapshot the core names, once; a write of a snapshot not kept (or dropped) is a bug and
    /// a failed write, never a write of something else.
    #[test]
    fn a_checkpoint_is_written_from_its_own_snapshot_or_fails_as_a_bug() {
        let mut d = driver(1);
        let mut fx = Recorder::default();
        d.keep_snapshot((0, 1, 4), "step 4");
        d.keep_snapshot((0, 1, 6), "step 6");
        assert_eq!(d.carry_out(&mut fx, Action::WriteCheckpoint(job(6))).map(|e| format!("{e:?}")), None);
        assert_eq!(fx.written, [(6, "step 6")]);
        let again = d.carry_out(&mut fx, Action::WriteCheckpoint(job(6)));
        assert!(matches!(again, Some(Event::CheckpointWritten(Written { step: 6, result: Err(_), .. }))));
        assert_eq!(fx.bugs.len(), 1, "{:?}", fx.bugs);
        d.carry_out(&mut fx, Action::DropSnapshots { which: None });
        let dropped = d.carry_out(&mut fx, Action::WriteCheckpoint(job(4)));
        assert!(matches!(dropped, Some(Event::CheckpointWritten(Written { step: 4, result: Err(_), .. }))));
        assert_eq!((fx.written.len(), fx.bugs.len()), (1, 2));
    }

    /// A message after a silence longer than the tick gap tells the core first how long the process did not run
    /// (less the tick it would have waited anyway); a message within the gap tells it nothing.
    #[test]
    fn time_the_process_did_not_run_reaches_the_core_before_the_message() {
        let mut d = driver(1);
        let mut fx = Recorder::default();
        d.start(&mut fx);
        d.arrived(&mut fx, true);
        fx.now = Duration::from_secs(1);
        d.arrived(&mut fx, true);
        assert!(fx.seen.iter().all(|s| !s.starts_with("Stopped")), "{:?}", fx.seen);
        fx.now = Duration::from_secs(31);
        d.arrived(&mut fx, false);
        let stopped = format!("{:?}", Event::Stopped { for_: Duration::from_secs(30) - TickGaps::TICK });
        assert_eq!(fx.seen.last(), Some(&stopped), "{:?}", fx.seen);
    }
}
