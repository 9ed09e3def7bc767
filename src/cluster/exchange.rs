//! The per-step quorum across hosts carried over the c10d store: each host announces its generation and posts its
//! contribution to each round; the rendezvous host runs [`HostQuorum`] on what it reads and posts each round's
//! [`Closed`] decision, which every host waits for. A contribution carries bytes (what the host trained, and its
//! gradient unless the drafters sum over NCCL: then the store carries only the round's record, and after the
//! all-reduce the rendezvous host decides from the members' word whether the round's update applies:
//! [`sum_outcome`]). A host admitted at a round boundary finds what to start from under its own key: the state its
//! donor posts, or, admitted as its own donor, word that no member had the run's state (the run must start again).
//!
//! Keys, under `dflash/`: `host/{rank}/generation` (a counter each start increments), `host/{rank}/beat` (a counter
//! its heartbeat adds to every second: a member silent for [`GONE_AFTER`] is gone), `host/{rank}/entry/{gen}`
//! (what that generation starts from), `round/{r}/from/{rank}` (the contribution), `round/{r}/arrived/{rank}` (the
//! contributor's generation, set after the contribution), `round/{r}/closed` (the decision, JSON),
//! `round/{r}/summed/{rank}`, `round/{r}/summed` and `round/{r}/applied` (with NCCL: whether each member's drafters
//! summed round `r`, how many said, and whether its update applies), `ring/{r}` (the NCCL communicator's identity,
//! when round `r` has a new membership), `feed/{rank}/{gen}/{step}` (what rank 0 assigns a host at a step) and
//! `finished` (rank 0's exit status at the end of the run), `members` (the last round closed and the next one's
//! members, with their generations: how a host learns it was dropped). Values larger than the store's server takes
//! in one message go in pieces ([`set_large`]). Rounds older than [`KEEP_ROUNDS`] are deleted.
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::quorum::{Admitted, BeatWatch, Closed, Decision, HostQuorum, Rank, RunningClock, sum_outcome};
use super::store::KeyValueStore;
use crate::ffi::store::{Store, StoreError};

/// Rounds whose keys stay in the store after a later one closed (a host reading an older round has been dropped).
pub const KEEP_ROUNDS: u64 = 4;

/// How often a host beats ([`beat`]), and how long a member may stay silent before the rendezvous host takes its
/// process for gone and closes rounds without it (rather than at each round's deadline).
pub const BEAT_EVERY: Duration = Duration::from_secs(1);
pub const GONE_AFTER: Duration = Duration::from_secs(10);
/// A gap between two looks of rank 0's coordinator longer than this is its process not running (the coordinator
/// looks every few milliseconds).
pub const STOPPED_AFTER_S: f64 = 2.0;

#[derive(Debug, Error)]
pub enum ExchangeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("host {rank} was dropped from round {round} (it missed the deadline): it must rejoin")]
    Dropped { rank: Rank, round: u64 },
    #[error("round {round} stalled: no host contributed by the deadline")]
    Stalled { round: u64 },
    #[error("malformed {what} in the store: {message}")]
    Malformed { what: String, message: String },
}

fn generation_key(rank: Rank) -> String {
    format!("dflash/host/{rank}/generation")
}
fn entry_key(rank: Rank, generation: u64) -> String {
    format!("dflash/host/{rank}/entry/{generation}")
}
fn from_key(round: u64, rank: Rank) -> String {
    format!("dflash/round/{round}/from/{rank}")
}
fn arrived_key(round: u64, rank: Rank) -> String {
    format!("dflash/round/{round}/arrived/{rank}")
}
fn closed_key(round: u64) -> String {
    format!("dflash/round/{round}/closed")
}
fn summed_key(round: u64, rank: Rank) -> String {
    format!("dflash/round/{round}/summed/{rank}")
}
fn summed_count_key(round: u64) -> String {
    format!("dflash/round/{round}/summed")
}
fn applied_key(round: u64) -> String {
    format!("dflash/round/{round}/applied")
}
fn ring_key(round: u64) -> String {
    format!("dflash/ring/{round}")
}
fn beat_key(rank: Rank) -> String {
    format!("dflash/host/{rank}/beat")
}
fn feed_key(rank: Rank, generation: u64, step: u64) -> String {
    format!("dflash/feed/{rank}/{generation}/{step}")
}
const FINISHED: &str = "dflash/finished";
const MEMBERS: &str = "dflash/members";
const FINISHED_ACKS: &str = "dflash/finished/acks";

#[derive(Serialize, Deserialize)]
struct ClosedRecord {
    members: Vec<Rank>,
    dropped: Vec<Rank>,
    admitted: Vec<Admitted>,
    next: Vec<(Rank, u64)>,
}

/// What a (re)started host starts from, once admitted.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// A donor's state (the bytes it posted).
    State(Vec<u8>),
    /// Admitted as its own donor: no member had the run's state when it came (see [`Closed::admitted`]).
    NoDonor,
}

/// The largest value set in one piece: the store's server refuses messages over 8 MiB.
const PIECE: usize = 4 << 20;

/// Sets `key` to `value` of any size: the pieces under `{key}/{i}` first, then `key` itself (the piece count and
/// the length), which readers wait for.
pub fn set_large(store: &dyn KeyValueStore, key: &str, value: &[u8]) -> Result<(), ExchangeError> {
    let pieces = value.chunks(PIECE).count();
    for (i, piece) in value.chunks(PIECE).enumerate() {
        store.set(&format!("{key}/{i}"), piece)?;
    }
    let mut head = (pieces as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&(value.len() as u64).to_le_bytes());
    Ok(store.set(key, &head)?)
}

/// The piece count and length [`set_large`] wrote under `key`.
fn large_head(key: &str, head: &[u8]) -> Result<(usize, usize), ExchangeError> {
    let word = |i: usize| head.get(8 * i..8 * i + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    match (head.len(), word(0), word(1)) {
        (16, Some(pieces), Some(len)) => Ok((pieces as usize, len as usize)),
        _ => Err(ExchangeError::Malformed { what: key.into(), message: format!("a head of {} bytes", head.len()) }),
    }
}

/// Waits up to `timeout` for `key` set by [`set_large`] and reads the whole value.
pub fn get_large(store: &dyn KeyValueStore, key: &str, timeout: Duration) -> Result<Vec<u8>, ExchangeError> {
    let (pieces, len) = large_head(key, &store.get(key, timeout)?)?;
    let mut value = Vec::with_capacity(len);
    for i in 0..pieces {
        value.extend(store.get(&format!("{key}/{i}"), timeout)?);
    }
    if value.len() != len {
        let message = format!("{} bytes in its pieces, {len} announced", value.len());
        return Err(ExchangeError::Malformed { what: key.into(), message });
    }
    Ok(value)
}

/// Deletes `key` set by [`set_large`] with its pieces (nothing when it is not set).
fn delete_large(store: &dyn KeyValueStore, key: &str) -> Result<(), ExchangeError> {
    if !store.check(key)? {
        return Ok(());
    }
    let (pieces, _) = large_head(key, &store.get(key, Duration::from_secs(1))?)?;
    for i in 0..pieces {
        store.delete(&format!("{key}/{i}"))?;
    }
    Ok(store.delete(key)?)
}

/// Starts this host as a new generation (1 at its first start) and returns it.
pub fn announce(store: &dyn KeyValueStore, rank: Rank) -> Result<u64, ExchangeError> {
    Ok(store.add(&generation_key(rank), 1)? as u64)
}

/// The generation each of `hosts` hosts announced last (0: not yet).
pub fn generations(store: &dyn KeyValueStore, hosts: usize) -> Result<Vec<u64>, ExchangeError> {
    Ok((0..hosts).map(|r| store.add(&generation_key(r), 0).map(|g| g as u64)).collect::<Result<_, _>>()?)
}

/// A host's generation with one flag (`arrived`: its drafters sum over NCCL; `summed`: they did): the generation's 8
/// bytes, little-endian, then 0 or 1.
fn flagged(generation: u64, flag: bool) -> Vec<u8> {
    let mut value = generation.to_le_bytes().to_vec();
    value.push(u8::from(flag));
    value
}

/// What [`flagged`] wrote; `None` for anything else.
fn unflagged(value: &[u8]) -> Option<(u64, bool)> {
    let generation = u64::from_le_bytes(value.get(..8)?.try_into().ok()?);
    Some((generation, *value.get(8)? == 1))
}

/// Host `rank` is alive (a counter its feed reader adds to every [`BEAT_EVERY`], whatever its drafters do).
pub fn beat(store: &dyn KeyValueStore, rank: Rank) -> Result<(), ExchangeError> {
    store.add(&beat_key(rank), 1)?;
    Ok(())
}

/// Posts host `rank`'s contribution to `round` (as `generation`), with `payload` for the others to read; `settles`:
/// its drafters sum over NCCL after the round closes and say whether they summed ([`post_summed`]).
pub fn contribute(
    store: &dyn KeyValueStore,
    round: u64,
    rank: Rank,
    generation: u64,
    settles: bool,
    payload: &[u8],
) -> Result<(), ExchangeError> {
    set_large(store, &from_key(round, rank), payload)?;
    Ok(store.set(&arrived_key(round, rank), &flagged(generation, settles))?)
}

/// Waits up to `timeout` for the decision on `round`.
pub fn wait_closed(store: &dyn KeyValueStore, round: u64, timeout: Duration) -> Result<Closed, ExchangeError> {
    let bytes = store.get(&closed_key(round), timeout)?;
    let r: ClosedRecord = serde_json::from_slice(&bytes)
        .map_err(|e| ExchangeError::Malformed { what: closed_key(round), message: e.to_string() })?;
    Ok(Closed { round, members: r.members, dropped: r.dropped, admitted: r.admitted, next: r.next })
}

/// How often a member waiting for a round to close looks whether rank 0 still counts it ([`wait_closed_as`]).
const MEMBERSHIP_LOOK: Duration = Duration::from_secs(1);

/// [`wait_closed`] for host `rank`, which entered the run as `entered` (generation, first round): gives up at once
/// (`Dropped`) when the membership rank 0 posts no longer lists it. A host stopped while rank 0 closed more than
/// [`KEEP_ROUNDS`] rounds would otherwise wait out `timeout` for a round whose keys are deleted, and miss the run.
pub fn wait_closed_as(
    store: &dyn KeyValueStore,
    round: u64,
    rank: Rank,
    entered: Option<(u64, u64)>,
    timeout: Duration,
) -> Result<Closed, ExchangeError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match wait_closed(store, round, left.min(MEMBERSHIP_LOOK)) {
            Err(ExchangeError::Store(StoreError::Timeout { .. })) if left > MEMBERSHIP_LOOK => {
                let dropped = match (entered, members(store)?) {
                    (Some(entered), Some(members)) => still_member(rank, entered, &members) == Some(false),
                    _ => false,
                };
                if dropped {
                    return Err(ExchangeError::Dropped { rank, round });
                }
            }
            other => return other,
        }
    }
}

/// The payload member `rank` posted to `round` (after the round closed with it as a member).
pub fn payload(store: &dyn KeyValueStore, round: u64, rank: Rank, timeout: Duration) -> Result<Vec<u8>, ExchangeError> {
    get_large(store, &from_key(round, rank), timeout)
}

/// Posts the identity of the NCCL communicator the drafters of round `round` sum in (its membership is new).
pub fn post_ring(store: &dyn KeyValueStore, round: u64, id: &[u8]) -> Result<(), ExchangeError> {
    Ok(store.set(&ring_key(round), id)?)
}

/// Waits up to `timeout` for the identity [`post_ring`] posts.
pub fn ring(store: &dyn KeyValueStore, round: u64, timeout: Duration) -> Result<Vec<u8>, ExchangeError> {
    Ok(store.get(&ring_key(round), timeout)?)
}

/// Posts whether host `rank` (as `generation`) summed round `round` over NCCL (its drafters' all-reduce completed).
pub fn post_summed(
    store: &dyn KeyValueStore,
    round: u64,
    rank: Rank,
    generation: u64,
    summed: bool,
) -> Result<(), ExchangeError> {
    store.set(&summed_key(round, rank), &flagged(generation, summed))?;
    store.add(&summed_count_key(round), 1)?;
    Ok(())
}

/// Waits up to `timeout` for whether round `round`'s update applies on every host (the rendezvous host decides it
/// from the members' [`post_summed`]).
pub fn wait_applied(store: &dyn KeyValueStore, round: u64, timeout: Duration) -> Result<bool, ExchangeError> {
    Ok(store.get(&applied_key(round), timeout)? == [1])
}

/// A donor's state for the admitted host.
pub fn post_state(store: &dyn KeyValueStore, to: &Admitted, state: &[u8]) -> Result<(), ExchangeError> {
    let mut value = vec![b'S'];
    value.extend_from_slice(state);
    set_large(store, &entry_key(to.rank, to.generation), &value)
}

/// Tells host `to` that no member had the run's state when it was admitted.
fn post_no_donor(store: &dyn KeyValueStore, to: &Admitted) -> Result<(), ExchangeError> {
    set_large(store, &entry_key(to.rank, to.generation), b"F")
}

/// Waits up to `timeout` for what generation `generation` of host `rank` starts from (and deletes it).
pub fn wait_entry(
    store: &dyn KeyValueStore,
    rank: Rank,
    generation: u64,
    timeout: Duration,
) -> Result<Entry, ExchangeError> {
    let key = entry_key(rank, generation);
    let mut value = get_large(store, &key, timeout)?;
    delete_large(store, &key)?;
    let malformed = |message: String| ExchangeError::Malformed { what: key.clone(), message };
    match value.first() {
        Some(b'S') => Ok(Entry::State(value.split_off(1))),
        Some(b'F') => Ok(Entry::NoDonor),
        _ => Err(malformed(format!("{} bytes without a known tag", value.len()))),
    }
}

/// What host `rank` (as `generation`) trains at `step`, as rank 0 assigns it.
pub fn post_feed(
    store: &dyn KeyValueStore,
    rank: Rank,
    generation: u64,
    step: u64,
    items: &[u8],
) -> Result<(), ExchangeError> {
    Ok(store.set(&feed_key(rank, generation, step), items)?)
}

/// Waits up to `timeout` for this host's items of `step` and takes them (the key is deleted).
pub fn take_feed(
    store: &dyn KeyValueStore,
    rank: Rank,
    generation: u64,
    step: u64,
    timeout: Duration,
) -> Result<Vec<u8>, ExchangeError> {
    let key = feed_key(rank, generation, step);
    let items = store.get(&key, timeout)?;
    store.delete(&key)?;
    Ok(items)
}

/// Rank 0 ended the run with exit status `code`.
pub fn post_finished(store: &dyn KeyValueStore, code: i32) -> Result<(), ExchangeError> {
    Ok(store.set(FINISHED, &code.to_le_bytes())?)
}

/// The run's exit status, once rank 0 ended it.
pub fn finished(store: &dyn KeyValueStore) -> Result<Option<i32>, ExchangeError> {
    if !store.check(FINISHED)? {
        return Ok(None);
    }
    let bytes = store.get(FINISHED, Duration::from_secs(1))?;
    let code = bytes.get(..4).and_then(|b| b.try_into().ok()).map(i32::from_le_bytes);
    code.map(Some)
        .ok_or_else(|| ExchangeError::Malformed { what: FINISHED.into(), message: format!("{} bytes", bytes.len()) })
}

/// The last round closed and the next round's members `(rank, generation)`.
pub type Membership = (u64, Vec<(Rank, u64)>);

/// The membership rank 0 posted at the last round it closed, once it closed one.
pub fn members(store: &dyn KeyValueStore) -> Result<Option<Membership>, ExchangeError> {
    if !store.check(MEMBERS)? {
        return Ok(None);
    }
    let bytes = store.get(MEMBERS, Duration::from_secs(1))?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ExchangeError::Malformed { what: MEMBERS.into(), message: e.to_string() })
}

/// Whether host `rank`, which entered the run as `generation` from round `from`, is still a member, by the
/// membership `members` rank 0 posted; `None` when that membership is older than the host's entry.
pub fn still_member(rank: Rank, (generation, from): (u64, u64), members: &Membership) -> Option<bool> {
    let (closed, next) = members;
    (closed + 1 >= from).then(|| next.contains(&(rank, generation)))
}

/// Another host saw the run's end.
pub fn acknowledge_finished(store: &dyn KeyValueStore) -> Result<(), ExchangeError> {
    store.add(FINISHED_ACKS, 1)?;
    Ok(())
}

/// How many hosts saw the run's end.
pub fn finished_acks(store: &dyn KeyValueStore) -> Result<usize, ExchangeError> {
    Ok(store.add(FINISHED_ACKS, 0)?.max(0) as usize)
}

/// Seconds since some fixed start: the time the coordinator's deadlines and beats are measured against.
pub type Clock = Box<dyn Fn() -> f64 + Send>;

/// The process's clock: seconds since the call.
pub fn wall_clock() -> Clock {
    let started = Instant::now();
    Box::new(move || started.elapsed().as_secs_f64())
}

/// A clock set by hand, in seconds (tests and the simulation): its [`ManualClock::clock`] reads what
/// [`ManualClock::set`] last set.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct ManualClock(std::sync::Arc<std::sync::atomic::AtomicU64>);

#[cfg(test)]
impl ManualClock {
    pub(crate) fn set(&self, seconds: f64) {
        self.0.store(seconds.to_bits(), std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn clock(&self) -> Clock {
        let cell = self.0.clone();
        Box::new(move || f64::from_bits(cell.load(std::sync::atomic::Ordering::SeqCst)))
    }
}

/// The rendezvous host's side: reads announcements and contributions, decides with [`HostQuorum`], posts decisions.
/// Over any [`KeyValueStore`] and [`Clock`]: the process's are a TCPStore and the wall clock.
pub struct Coordinator<S: KeyValueStore = Store> {
    store: S,
    hosts: usize,
    quorum: HostQuorum,
    /// The generation last seen of each host.
    seen: Vec<u64>,
    clock: Clock,
    /// The time the coordinator ran, which the rounds' deadlines are measured in.
    running: RunningClock,
    /// Closed rounds whose update waits for the members to say they summed (NCCL): their members with generations,
    /// and when they closed.
    unsettled: BTreeMap<u64, (Vec<(Rank, u64)>, f64)>,
    /// Whether a member of the open round said its drafters sum over NCCL (then the round waits to be settled).
    open_round_settles: bool,
    deadline_s: f64,
    /// Whose beat stopped.
    beats: BeatWatch,
    /// Members found gone by their silence, `(rank, generation)`: they will never say whether they summed.
    gone: BTreeSet<(Rank, u64)>,
    /// When the open round falls due on the clock, as the last look found it.
    due: Option<f64>,
}

impl<S: KeyValueStore> Coordinator<S> {
    /// Coordinates `hosts` hosts from round `round`, the founders being those announced now (their generations).
    pub fn new(store: S, hosts: usize, round: u64, deadline: Duration) -> Result<Self, ExchangeError> {
        Self::with_clock(store, hosts, round, deadline, wall_clock())
    }

    /// [`Coordinator::new`] measuring time by `clock`.
    pub fn with_clock(
        store: S,
        hosts: usize,
        round: u64,
        deadline: Duration,
        clock: Clock,
    ) -> Result<Self, ExchangeError> {
        let seen = generations(&store, hosts)?;
        let founders: Vec<(Rank, u64)> =
            seen.iter().enumerate().filter(|&(_, &g)| g > 0).map(|(r, &g)| (r, g)).collect();
        // The founding is the running clock's first reading: the first round's deadline counts from it, and a gap
        // from it to the first look is a stop like any other.
        let mut running = RunningClock::new(STOPPED_AFTER_S);
        let start = running.read(clock());
        let quorum = HostQuorum::new(round, &founders, start, deadline.as_secs_f64());
        Ok(Coordinator {
            store,
            hosts,
            quorum,
            seen,
            clock,
            running,
            unsettled: BTreeMap::new(),
            open_round_settles: false,
            deadline_s: deadline.as_secs_f64(),
            beats: BeatWatch::default(),
            gone: BTreeSet::new(),
            due: None,
        })
    }

    /// When, on the coordinator's clock, the open round falls due (its deadline, moved on by any stop of this
    /// process), as the last [`Coordinator::poll`] found it: a caller that looks only when something happens (a
    /// simulation) looks again then. `None` before the first look and once a round closed or stalled.
    pub fn due(&self) -> Option<f64> {
        self.due
    }

    pub fn members(&self) -> Vec<Rank> {
        self.quorum.members()
    }

    /// One look at the store: new generations, contributions to the open round; posts the decision when the round
    /// closes and returns it.
    pub fn poll(&mut self) -> Result<Option<Closed>, ExchangeError> {
        for (rank, generation) in generations(&self.store, self.hosts)?.into_iter().enumerate() {
            if generation > self.seen[rank] {
                self.seen[rank] = generation;
                self.quorum.announce(rank, generation);
            }
        }
        // Deadlines count the time this process ran: a stop of rank 0 is charged to no host.
        let clock = (self.clock)();
        let now = self.running.read(clock);
        self.due = None;
        let round = self.quorum.round();
        for rank in self.quorum.members() {
            let key = arrived_key(round, rank);
            if self.store.check(&key)?
                && let Some((generation, settles)) = unflagged(&self.store.get(&key, Duration::from_secs(1))?)
            {
                self.quorum.arrive(round, rank, generation);
                self.open_round_settles |= settles;
            }
        }
        self.settle_sums(now)?;
        // Beats are judged on the clock, not the running time: a silence is a silence however long this process
        // was stopped (the beat watch discounts a reader that did not run).
        self.read_beats(clock)?;
        match self.quorum.poll(now) {
            Decision::Wait { until } => {
                self.due = Some(clock + (until - now).max(0.0));
                Ok(None)
            }
            Decision::Stalled { round } => Err(ExchangeError::Stalled { round }),
            Decision::Close(closed) => {
                let record = ClosedRecord {
                    members: closed.members.clone(),
                    dropped: closed.dropped.clone(),
                    admitted: closed.admitted.clone(),
                    next: closed.next.clone(),
                };
                let bytes = serde_json::to_vec(&record).expect("plain data serialises");
                self.store.set(&closed_key(closed.round), &bytes)?;
                let members = serde_json::to_vec(&(closed.round, &closed.next)).expect("plain data serialises");
                self.store.set(MEMBERS, &members)?;
                for a in closed.admitted.iter().filter(|a| a.donor == a.rank) {
                    post_no_donor(&self.store, a)?;
                }
                if std::mem::take(&mut self.open_round_settles) {
                    let members = closed.next.iter().filter(|(r, _)| closed.members.contains(r)).copied().collect();
                    self.unsettled.insert(closed.round, (members, now));
                }
                if let Some(old) = closed.round.checked_sub(KEEP_ROUNDS) {
                    self.delete_round(old)?;
                    self.unsettled.retain(|&r, _| r > old);
                }
                Ok(Some(closed))
            }
        }
    }

    /// Every [`BEAT_EVERY`] / 2: a member host other than this one (rank 0, which does not beat) whose beat has not
    /// moved for [`GONE_AFTER`] is gone (its process died without a restart announcing it): the quorum closes
    /// rounds without it from now on.
    fn read_beats(&mut self, clock: f64) -> Result<(), ExchangeError> {
        if self.beats.last_read().is_some_and(|t| clock - t < BEAT_EVERY.as_secs_f64() / 2.0) {
            return Ok(());
        }
        let others = self.quorum.members().into_iter().filter(|&r| r != 0);
        let counts: Vec<(Rank, i64)> =
            others.map(|rank| Ok((rank, self.store.add(&beat_key(rank), 0)?))).collect::<Result<_, ExchangeError>>()?;
        // The time after the reads: a store that held them up shows as a gap, not as silence.
        let now = (self.clock)();
        let stall = 4.0 * BEAT_EVERY.as_secs_f64();
        for rank in self.beats.read(now, &counts, GONE_AFTER.as_secs_f64(), stall) {
            if let Some(generation) = self.quorum.generation(rank) {
                tracing::warn!(host = rank, generation, "a host stopped beating: it leaves the run");
                self.quorum.gone(rank, generation);
                self.gone.insert((rank, generation));
            }
        }
        Ok(())
    }

    /// Decides the update of every closed round whose members said whether they summed (see [`sum_outcome`]).
    fn settle_sums(&mut self, now: f64) -> Result<(), ExchangeError> {
        let mut settled = Vec::new();
        for (&round, (members, closed_at)) in &self.unsettled {
            if self.store.add(&summed_count_key(round), 0)? == 0 {
                continue;
            }
            let mut posted = BTreeMap::new();
            for &(rank, _) in members {
                let key = summed_key(round, rank);
                if self.store.check(&key)?
                    && let Some(said) = unflagged(&self.store.get(&key, Duration::from_secs(1))?)
                {
                    posted.insert(rank, said);
                }
            }
            let outcome = sum_outcome(members, &posted, &self.seen, &self.gone, now - closed_at, self.deadline_s);
            if let Some(applies) = outcome {
                if !applies {
                    tracing::warn!(
                        round,
                        ?members,
                        ?posted,
                        "the sum across hosts did not complete on every member host: every host skips this round's \
                         update (its samples stay committed) and keeps its state"
                    );
                }
                self.store.set(&applied_key(round), &[u8::from(applies)])?;
                settled.push(round);
            }
        }
        for round in settled {
            self.unsettled.remove(&round);
        }
        Ok(())
    }

    fn delete_round(&self, round: u64) -> Result<(), ExchangeError> {
        for rank in 0..self.hosts {
            delete_large(&self.store, &from_key(round, rank))?;
            self.store.delete(&arrived_key(round, rank))?;
            self.store.delete(&summed_key(round, rank))?;
        }
        self.store.delete(&summed_count_key(round))?;
        self.store.delete(&applied_key(round))?;
        self.store.delete(&ring_key(round))?;
        Ok(self.store.delete(&closed_key(round))?)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::cluster::store::MemoryStore;

    const WAIT: Duration = Duration::from_secs(20);

    /// A host waiting for a round that rank 0 closed without it, and whose keys are gone, learns it was dropped from
    /// the posted membership instead of waiting out the round's deadline; a member keeps waiting.
    #[test]
    fn a_dropped_host_waiting_for_a_deleted_round_is_told_so() {
        let server = Store::serve(0, WAIT).unwrap();
        let store = Store::connect("127.0.0.1", server.port(), WAIT).unwrap();
        store.set(MEMBERS, &serde_json::to_vec(&(9u64, vec![(0usize, 1u64), (2, 1)])).unwrap()).unwrap();
        let dropped = wait_closed_as(&store, 4, 1, Some((1, 2)), Duration::from_secs(120)).unwrap_err();
        assert!(matches!(dropped, ExchangeError::Dropped { rank: 1, round: 4 }), "{dropped}");
        let still = wait_closed_as(&store, 4, 2, Some((1, 2)), Duration::from_secs(3)).unwrap_err();
        assert!(matches!(still, ExchangeError::Store(StoreError::Timeout { .. })), "{still}");
    }

    /// Two hosts announced in `store`, rank 0's coordinator over it on a clock the test sets, with a round deadline of 30 s, and rank 0's contribution to round 0.
    fn rank_0_contributed(store: &MemoryStore) -> (Coordinator<&MemoryStore>, ManualClock) {
        for rank in 0..2 {
            announce(store, rank).unwrap();
        }
        let now = ManualClock::default();
        let c = Coordinator::with_clock(store, 2, 0, Duration::from_secs(30), now.clock()).unwrap();
        contribute(store, 0, 0, 1, false, b"rank 0").unwrap();
        (c, now)
    }

    /// The coordinator over an in-memory store and a clock of the test's: a host that stops beating is dropped
    /// after [`GONE_AFTER`] of the coordinator's time, one that beats but does not contribute at the round's
    /// deadline, and neither waits a second of wall time.
    #[test]
    fn a_silent_host_goes_at_its_beats_and_a_late_one_at_the_deadline_on_the_coordinators_clock() {
        let started = Instant::now();
        for beating in [false, true] {
            let store = MemoryStore::new();
            let (mut c, now) = rank_0_contributed(&store);
            let mut t = 0.0;
            let closed = loop {
                if let Some(closed) = c.poll().unwrap() {
                    break closed;
                }
                assert!(t < 60.0, "round 0 never closed");
                t += 0.25;
                now.set(t);
                if beating {
                    beat(&store, 1).unwrap();
                }
            };
            assert_eq!((closed.members.clone(), closed.dropped.clone()), (vec![0], vec![1]));
            let expected = if beating { 30.0 } else { GONE_AFTER.as_secs_f64() };
            assert!((expected..expected + 2.0).contains(&t), "beating {beating}: closed at {t} s");
            assert_eq!(wait_closed(&store, 0, WAIT).unwrap().members, vec![0], "the decision is posted");
        }
        assert!(started.elapsed() < Duration::from_secs(5), "no waiting on the wall clock");
    }

    /// After rank 0's process was stopped for a while, beats are still read every half beat: a host that stops
    /// beating goes after GONE_AFTER, not the stop's length later. (The beat reads were once spaced by running time
    /// against a clock reading, which spaced them by every stop so far: found when the simulation began to drive
    /// this coordinator.)
    #[test]
    fn a_stop_of_rank_0_does_not_slow_the_beat_reads_after_it() {
        let store = MemoryStore::new();
        let (mut c, now) = rank_0_contributed(&store);
        let mut t: f64 = 0.0;
        let closed = loop {
            if let Some(closed) = c.poll().unwrap() {
                break closed;
            }
            assert!(t < 80.0, "round 0 never closed");
            // Rank 0 is stopped from 5 s to 25 s (no looks); host 1 beats until 30 s, then dies.
            t = if (5.0..25.0).contains(&t) { 25.0 } else { t + 0.25 };
            now.set(t);
            if t <= 30.0 {
                beat(&store, 1).unwrap();
            }
        };
        assert_eq!(closed.dropped, vec![1]);
        let gone_at = 30.0 + GONE_AFTER.as_secs_f64();
        assert!((gone_at..gone_at + 1.5).contains(&t), "host 1 dropped at {t} s; its silence began at 30 s");
    }

    /// A host is still a member while rank 0's last membership lists its generation; a membership from before the
    /// round it entered at says nothing.
    #[test]
    fn a_host_left_out_of_the_posted_membership_is_no_longer_a_member() {
        let members = (9, vec![(0, 1), (1, 2)]);
        assert_eq!(still_member(1, (2, 5), &members), Some(true));
        assert_eq!(still_member(2, (1, 3), &members), Some(false), "dropped");
        assert_eq!(still_member(1, (1, 3), &members), Some(false), "an older generation of it");
        assert_eq!(still_member(2, (3, 11), &members), None, "it enters at round 11: rank 0 has not closed round 10");
        assert_eq!(
            still_member(2, (3, 10), &members),
            Some(false),
            "entering at round 10, it must be among its members"
        );
    }

    /// A generation and its flag read back as written; a value without the flag, or cut short, reads as nothing.
    #[test]
    fn a_flagged_generation_reads_back_and_nothing_else_does() {
        assert_eq!(unflagged(&flagged(7, true)), Some((7, true)));
        assert_eq!(unflagged(&flagged(u64::MAX, false)), Some((u64::MAX, false)));
        assert_eq!(unflagged(&7u64.to_le_bytes()), None);
        assert_eq!(unflagged(b"x"), None);
    }

    /// A value larger than the server takes in one message (8 MiB) goes in pieces and comes back whole; deleting it
    /// removes the pieces.
    #[test]
    fn a_large_value_crosses_in_pieces() {
        let store = Store::serve(0, WAIT).unwrap();
        let value: Vec<u8> = (0..(9 << 20) + 123).map(|i: usize| (i * 7 % 251) as u8).collect();
        set_large(&store, "big", &value).unwrap();
        assert!(store.check("big/2").unwrap(), "three pieces");
        assert_eq!(get_large(&store, "big", WAIT).unwrap(), value);
        delete_large(&store, "big").unwrap();
        assert!(!store.check("big").unwrap() && !store.check("big/0").unwrap() && !store.check("big/2").unwrap());
        set_large(&store, "empty", &[]).unwrap();
        assert_eq!(get_large(&store, "empty", WAIT).unwrap(), Vec::<u8>::new());
    }

    /// Rounds whose hosts sum over NCCL wait for the members' word: one host's failed all-reduce skips the update
    /// for every host, all summed applies it; rounds summed through the store are never settled.
    #[test]
    fn nccl_rounds_apply_only_when_every_member_summed() {
        let store = Store::serve(0, WAIT).unwrap();
        for rank in 0..2 {
            announce(&store, rank).unwrap();
        }
        let mut c = Coordinator::new(store.try_clone().unwrap(), 2, 0, Duration::from_secs(30)).unwrap();
        let mut round = |r: u64, settles: bool| {
            for rank in 0..2 {
                contribute(&store, r, rank, 1, settles, &[]).unwrap();
            }
            while c.poll().unwrap().is_none() {}
        };
        round(0, true);
        post_summed(&store, 0, 0, 1, true).unwrap();
        post_summed(&store, 0, 1, 1, false).unwrap();
        round(1, true);
        for rank in 0..2 {
            post_summed(&store, 1, rank, 1, true).unwrap();
        }
        round(2, false);
        c.poll().unwrap();
        assert!(!wait_applied(&store, 0, WAIT).unwrap(), "host 1's all-reduce failed");
        assert!(wait_applied(&store, 1, WAIT).unwrap());
        assert!(!store.check(&applied_key(2)).unwrap() && c.unsettled.is_empty(), "nothing to settle");
    }

    /// A host's round as a CPU collective over the store: post its numbers, wait for the decision, sum the members'
    /// numbers in rank order.
    fn sum_round(
        store: &Store,
        round: u64,
        rank: Rank,
        generation: u64,
        mine: &[f32],
    ) -> Result<(Closed, Vec<f32>), ExchangeError> {
        let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
        contribute(store, round, rank, generation, false, &bytes)?;
        let closed = wait_closed(store, round, WAIT)?;
        if !closed.members.contains(&rank) {
            return Err(ExchangeError::Dropped { rank, round });
        }
        let mut sum = vec![0f32; mine.len()];
        for &m in &closed.members {
            let theirs = payload(store, round, m, WAIT)?;
            for (s, c) in sum.iter_mut().zip(theirs.chunks_exact(4)) {
                *s += f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        Ok((closed, sum))
    }

    /// Three hosts (threads, each with its own connection) sum over the store; host 2 dies silently after round 2:
    /// round 3 closes at its deadline without it; it restarts as generation 2, is admitted (its state from host 0)
    /// and sums with the others again. Every host gets the same sums, bit for bit.
    #[test]
    fn hosts_sum_in_rounds_survive_a_silent_death_and_readmit_the_restarted_host() {
        let server = Store::serve(0, WAIT).unwrap();
        let port = server.port();
        let connect = move || Store::connect("127.0.0.1", port, WAIT).unwrap();
        for rank in 0..3 {
            assert_eq!(announce(&server, rank).unwrap(), 1);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let coordinator = {
            let (store, stop) = (connect(), stop.clone());
            std::thread::spawn(move || {
                let mut c = Coordinator::new(store, 3, 0, Duration::from_millis(400)).unwrap();
                let mut decisions = vec![];
                while !stop.load(Ordering::SeqCst) {
                    if let Some(closed) = c.poll().unwrap() {
                        decisions.push(closed);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                decisions
            })
        };
        let numbers = |rank: Rank, round: u64| [rank as f32 + 0.1, round as f32];
        // Hosts 0 and 1 go on until host 2 is a member again after its death.
        let survivor = |rank: Rank| {
            let store = connect();
            std::thread::spawn(move || {
                let mut sums = vec![];
                for round in 0.. {
                    let (closed, sum) = sum_round(&store, round, rank, 1, &numbers(rank, round)).unwrap();
                    sums.push(sum);
                    if round > 3 && closed.members.contains(&2) {
                        return sums;
                    }
                }
                unreachable!()
            })
        };
        let (a, b) = (survivor(0), survivor(1));
        let store = connect();
        let before: Vec<Vec<f32>> = (0..3).map(|r| sum_round(&store, r, 2, 1, &numbers(2, r)).unwrap().1).collect();
        // Host 2 dies (posts nothing to round 3); once round 3 closed without it, it restarts as generation 2.
        assert_eq!(wait_closed(&store, 3, WAIT).unwrap().dropped, vec![2]);
        assert_eq!(announce(&store, 2).unwrap(), 2);
        let mut round = 4;
        let back_sum: Vec<f32> = loop {
            match sum_round(&store, round, 2, 2, &numbers(2, round)) {
                Ok((_, sum)) => break sum,
                Err(ExchangeError::Dropped { .. }) => round += 1,
                Err(e) => panic!("{e}"),
            }
        };
        let (a_sums, b_sums) = (a.join().unwrap(), b.join().unwrap());
        stop.store(true, Ordering::SeqCst);
        let decisions = coordinator.join().unwrap();

        assert_eq!(a_sums, b_sums, "every member gets the same sums");
        assert_eq!(&a_sums[..3], &before[..], "host 2 too, while it was a member");
        let all = 0.1f32 + 1.1 + 2.1;
        assert_eq!(a_sums[0], vec![all, 0.0]);
        assert_eq!((decisions[3].members.clone(), decisions[3].dropped.clone()), (vec![0, 1], vec![2]));
        assert_eq!(a_sums[3], vec![0.1 + 1.1, 6.0], "round 3 without host 2");
        let admitted = decisions.iter().find(|d| !d.admitted.is_empty()).expect("host 2 was admitted");
        let host2 = Admitted { rank: 2, generation: 2, donor: 0 };
        assert_eq!(admitted.admitted, vec![host2], "its state comes from host 0");
        assert_eq!(round, admitted.round + 1, "it contributes from the round after its admission");
        assert_eq!(a_sums.len() as u64, round + 1);
        assert_eq!(back_sum, a_sums[round as usize], "the readmitted host sums what the others do");
        assert_eq!(back_sum, vec![all, 3.0 * round as f32]);
    }
}
