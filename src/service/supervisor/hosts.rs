//! The shell's side of several hosts: the thread with which a host other than rank 0 reads what rank 0 assigns it
//! (step by step, for the generation it entered the run as) and the run's end, and beats (rank 0 takes a host whose
//! beat stops for gone); on rank 0, the assignments posted for the others, the member hosts told to the core, and
//! the end handed to the others at exit.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ractor::ActorRef;

use super::protocol::Feed;
use crate::cluster::background::Background;
use crate::cluster::exchange::BEAT_EVERY;
use crate::cluster::link::{HostLink, LinkError};
use crate::service::messages::SupervisorMsg;

/// Store operations failing in a row before the rendezvous host counts as gone.
const LOST_AFTER: u32 = 3;

/// Starts the thread that reads this host's assignments and the run's end, telling `supervisor` `Fed`,
/// `RunEnded` and `RendezvousLost`, until it is dropped, the run ended, or the rendezvous host is gone.
pub(super) fn read_feeds(link: Arc<HostLink>, supervisor: ActorRef<SupervisorMsg>) -> std::io::Result<Background> {
    Background::spawn("feed-reader", move |stopped| {
        // The generation read for and its next step.
        let mut at: Option<(u64, u64)> = None;
        let mut failures = 0;
        let mut beaten: Option<Instant> = None;
        while !stopped.load(Ordering::SeqCst) {
            // The heartbeat rides on this loop (which reads the store five times a second anyway): no thread or
            // connection of its own. A failed beat is the next operation's to report.
            if beaten.is_none_or(|t| t.elapsed() >= BEAT_EVERY) {
                beaten = Some(Instant::now());
                if let Err(e) = link.beat() {
                    tracing::debug!("beat: {e}");
                }
            }
            match link.finished() {
                Ok(Some(code)) => {
                    let _ = link.acknowledge_end();
                    let _ = supervisor.send_message(SupervisorMsg::RunEnded { code });
                    return;
                }
                Ok(None) => {}
                Err(e) if lost(&mut failures, &e, &supervisor) => return,
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
                    failures = 0;
                    at = Some((generation, step + 1));
                    match serde_json::from_slice::<Feed>(&bytes) {
                        Ok(feed) => {
                            let _ = supervisor.send_message(SupervisorMsg::Fed { generation, step, feed });
                        }
                        // Its drafters then train nothing that step; rank 0 hands the batches out again.
                        Err(e) => tracing::error!(step, "rank 0's assignment cannot be read: {e}"),
                    }
                }
                Ok(None) => failures = 0,
                Err(e) if lost(&mut failures, &e, &supervisor) => return,
                Err(_) => {}
            }
        }
    })
}

/// Counts a failed store operation; true (and the supervisor told) once the rendezvous host counts as gone: at once
/// when the connection failed (its process or network is gone: trying again would wait for connects that libtorch
/// retries until their deadline, while this host's replicas wait to be checkpointed), else after [`LOST_AFTER`] in
/// a row.
fn lost(failures: &mut u32, e: &LinkError, supervisor: &ActorRef<SupervisorMsg>) -> bool {
    *failures += 1;
    tracing::warn!("reading from the rendezvous host: {e}");
    if e.unreachable() || *failures >= LOST_AFTER {
        let _ = supervisor.send_message(SupervisorMsg::RendezvousLost(e.to_string()));
        return true;
    }
    std::thread::sleep(Duration::from_millis(200));
    false
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
