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

/// What the feed reader decides, apart from the store (the reader's thread and the cluster simulation both run
/// it): the step it reads next, the event an assignment makes, and whether rank 0's membership leaving this host
/// out is news.
#[derive(Debug, Default)]
pub(super) struct FeedCursor {
    /// The generation read for and its next step.
    at: Option<(u64, u64)>,
    /// The generation rank 0's membership was last found to leave out.
    left_out: Option<u64>,
}

impl FeedCursor {
    /// The step to read next, for the generation this host entered the run as and its first step (`entered`).
    pub(super) fn next(&self, (generation, from): (u64, u64)) -> u64 {
        match self.at {
            Some((g, s)) if g == generation => s,
            _ => from,
        }
    }

    /// The assignment of `generation`'s `step` was read (it is taken: the next read is the step after): the event
    /// it makes, or why it cannot be read (the drafters then train nothing that step; rank 0 hands the batches out
    /// again).
    pub(super) fn read(&mut self, generation: u64, step: u64, bytes: &[u8]) -> Result<Event, serde_json::Error> {
        self.at = Some((generation, step + 1));
        let feed = serde_json::from_slice::<Feed>(bytes)?;
        Ok(Event::Fed { step, items: feed.items, position: feed.position })
    }

    /// Rank 0's membership says whether the generation this host entered the run as is still in it (`still`:
    /// `(entered, member)`, [`crate::cluster::exchange::still_member`]) while the host is generation `announced`:
    /// whether to say `LeftRun`, once a generation. A host that announced itself anew since it entered (its
    /// drafters failed and it enters again) is out of the membership by its own doing, not dropped by rank 0.
    pub(super) fn left_run(&mut self, announced: u64, still: Option<(u64, bool)>) -> bool {
        match still {
            Some((entered, false)) if entered == announced => self.left_out.replace(entered) != Some(entered),
            _ => false,
        }
    }
}

/// Starts the thread that reads this host's assignments and the run's end, telling `supervisor` `Fed`,
/// `RunEnded` and `RendezvousLost`, until it is dropped, the run ended, or the rendezvous host is gone.
pub(super) fn read_feeds(link: Arc<HostLink>, supervisor: ActorRef<SupervisorMsg>) -> std::io::Result<Background> {
    Background::spawn("feed-reader", move |stopped| {
        let mut cursor = FeedCursor::default();
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
                    Ok(still) => {
                        let generation = link.generation();
                        if cursor.left_run(generation, still) {
                            let _ = supervisor
                                .send_message(SupervisorMsg::ForGeneration { generation, event: Event::LeftRun });
                        }
                    }
                    Err(e) if gone(&e) => return,
                    Err(_) => {}
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
            let Some(entered) = link.entered() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let (generation, step) = (entered.0, cursor.next(entered));
            match link.wait_feed(generation, step, Duration::from_millis(200)) {
                Ok(Some(bytes)) => match cursor.read(generation, step, &bytes) {
                    Ok(event) => {
                        let _ = supervisor.send_message(SupervisorMsg::ForGeneration { generation, event });
                    }
                    Err(e) => tracing::error!(step, "rank 0's assignment cannot be read: {e}"),
                },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::supervisor::schedule::Item;

    fn feed(items: Vec<(usize, Item)>) -> Vec<u8> {
        serde_json::to_vec(&Feed { items, position: None }).unwrap()
    }

    #[test]
    fn the_reader_goes_step_by_step_and_starts_over_at_each_entry() {
        let mut cursor = FeedCursor::default();
        assert_eq!(cursor.next((1, 7)), 7);
        let event = cursor.read(1, 7, &feed(vec![(0, Item::Empty)])).unwrap();
        assert!(matches!(event, Event::Fed { step: 7, ref items, .. } if items.len() == 1));
        assert_eq!(cursor.next((1, 7)), 8);
        // A step that cannot be read is taken all the same: the reader does not stop on it.
        assert!(cursor.read(1, 8, b"not json").is_err());
        assert_eq!(cursor.next((1, 7)), 9);
        // Entered again as generation 2 at step 20: its own assignments, from its first step.
        assert_eq!(cursor.next((2, 20)), 20);
    }

    #[test]
    fn leaving_the_run_is_said_once_a_generation() {
        let mut cursor = FeedCursor::default();
        assert!(!cursor.left_run(1, None));
        assert!(!cursor.left_run(1, Some((1, true))));
        assert!(cursor.left_run(1, Some((1, false))));
        assert!(!cursor.left_run(1, Some((1, false))));
        assert!(cursor.left_run(2, Some((2, false))));
    }

    /// A host whose drafters failed announces itself anew: rank 0's next membership leaves out the generation it had
    /// entered as, while the new one waits to be admitted. That is not rank 0 dropping it (the simulation found the
    /// reader saying so: a false warning, and the host not ready until a drafter joined).
    #[test]
    fn a_host_entering_anew_is_not_told_it_left_the_run() {
        let mut cursor = FeedCursor::default();
        assert!(!cursor.left_run(5, Some((3, false))));
        // Admitted as 5, then dropped: said.
        assert!(cursor.left_run(5, Some((5, false))));
    }
}
