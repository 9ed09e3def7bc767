//! The shell's side of several hosts: the thread with which a host other than rank 0 reads what rank 0 assigns it
//! (step by step, for the generation it entered the run as) and the run's end, and beats (rank 0 takes a host whose
//! beat stops for gone); on rank 0, the assignments posted for the others, the member hosts told to the core, and
//! the end handed to the others at exit.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ractor::ActorRef;

use super::protocol::{Event, Feed};
use crate::cluster::background::Background;
use crate::cluster::exchange::BEAT_EVERY;
use crate::cluster::quorum::{LeaderWatch, Reply};
use crate::service::messages::SupervisorMsg;
use crate::train::link::{HostLink, LinkError};

/// Starts the thread that reads this host's assignments and the run's end, telling `supervisor` `Fed`,
/// `RunEnded` and `RendezvousLost`, until it is dropped, the run ended, or the rendezvous host is gone.
pub(super) fn read_feeds(link: Arc<HostLink>, supervisor: ActorRef<SupervisorMsg>) -> std::io::Result<Background> {
    Background::spawn("feed-reader", move |stopped| {
        // The generation read for and its next step.
        let mut at: Option<(u64, u64)> = None;
        let mut beaten: Option<Instant> = None;
        // Whether to stop after an operation failed: rank 0's connection failed (its process is gone, or the leader
        // watch took it for lost and shut the connections down).
        let gone = |e: &LinkError| {
            if e.unreachable() {
                if link.leader_lost(e.to_string()) {
                    let _ = supervisor.send_message(SupervisorMsg::Core(Event::RendezvousLost(e.to_string())));
                }
                return true;
            }
            tracing::warn!("reading from the rendezvous host: {e}");
            std::thread::sleep(Duration::from_millis(200));
            false
        };
        // The generation rank 0's membership was last found to leave out.
        let mut left_out = None;
        while !stopped.load(Ordering::SeqCst) {
            // The heartbeat and the membership check ride on this loop (which reads the store five times a second
            // anyway): no thread or connection of their own.
            if beaten.is_none_or(|t| t.elapsed() >= BEAT_EVERY) {
                beaten = Some(Instant::now());
                if let Err(e) = link.beat()
                    && gone(&e)
                {
                    return;
                }
                match link.still_member() {
                    Ok(Some(false)) => {
                        let generation = link.generation();
                        if left_out.replace(generation) != Some(generation) {
                            let _ = supervisor
                                .send_message(SupervisorMsg::ForGeneration { generation, event: Event::LeftRun });
                        }
                    }
                    Err(e) if gone(&e) => return,
                    _ => {}
                }
            }
            match link.finished() {
                Ok(Some(code)) => {
                    let _ = link.acknowledge_end();
                    let _ = supervisor.send_message(SupervisorMsg::Core(Event::RunEnded { code }));
                    return;
                }
                Ok(None) => {}
                Err(e) if gone(&e) => return,
                Err(_) => continue,
            }
            let Some((generation, from)) = link.entered() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let step = match at {
                Some((g, s)) if g == generation => s,
                _ => from,
            };
            match link.wait_feed(generation, step, Duration::from_millis(200)) {
                Ok(Some(bytes)) => {
                    at = Some((generation, step + 1));
                    match serde_json::from_slice::<Feed>(&bytes) {
                        Ok(feed) => {
                            let event = Event::Fed { step, items: feed.items, position: feed.position };
                            let _ = supervisor.send_message(SupervisorMsg::ForGeneration { generation, event });
                        }
                        // Its drafters then train nothing that step; rank 0 hands the batches out again.
                        Err(e) => tracing::error!(step, "rank 0's assignment cannot be read: {e}"),
                    }
                }
                Err(e) if gone(&e) => return,
                _ => {}
            }
        }
    })
}

/// The leader watch's look: a gap between two looks longer than this is this process not running (the silence
/// starts again), and a store operation waiting longer than [`SILENT_AFTER`] counts as silence (one is slow now and
/// then).
pub(super) const LOOKS_STALL_AFTER_S: f64 = 2.0;
pub(super) const SILENT_AFTER: Duration = Duration::from_secs(1);

/// Starts the thread that judges rank 0's silence ([`LeaderWatch`]) from the store operations this host waits on
/// (the feed reader's beat and reads ask something of rank 0 several times a second): once rank 0 has kept them
/// waiting for `cluster.leader_timeout_s`, it is taken for lost as if its process had died. The store's operations
/// cannot judge it themselves: against a process that is stopped they block past every deadline.
pub(super) fn watch_leader(link: Arc<HostLink>, supervisor: ActorRef<SupervisorMsg>) -> std::io::Result<Background> {
    Background::spawn("leader-watch", move |stopped| {
        const LOOK_EVERY: Duration = Duration::from_millis(250);
        // A look later than this after the last one is this process not running: the silence starts again.
        let timeout = link.leader_timeout();
        let mut watch = LeaderWatch::new(timeout.as_secs_f64(), LOOKS_STALL_AFTER_S);
        let started = Instant::now();
        while !stopped.load(Ordering::SeqCst) {
            std::thread::sleep(LOOK_EVERY);
            // An operation is slow now and then; only one waiting over a second counts as silence.
            let reply = match link.silence() {
                Some(silent) if silent > SILENT_AFTER => Reply::TimedOut,
                _ => Reply::Answered,
            };
            if let Some(silent) = watch.observe(started.elapsed().as_secs_f64(), reply) {
                let why = format!("no answer for {silent:.1} s (cluster.leader_timeout_s = {})", timeout.as_secs_f64());
                if link.leader_lost(why.clone()) {
                    let _ = supervisor
                        .send_message(SupervisorMsg::Core(Event::RendezvousLost(format!("rank 0 is lost: {why}"))));
                }
                return;
            }
        }
    })
}

/// Rank 0: posts what host `rank` (as `generation`) trains at `step`. A host that does not get it misses the
/// round and rejoins; its batches go back to the loader.
pub(super) fn post_feed(link: &HostLink, rank: usize, generation: u64, step: u64, feed: &Feed) {
    let posted = serde_json::to_vec(feed)
        .map_err(|e| e.to_string())
        .and_then(|bytes| link.feed(rank, generation, step, &bytes).map_err(|e| e.to_string()));
    if let Err(e) = posted {
        tracing::warn!(host = rank, step, "cannot hand the host its batches: {e}");
    }
}
