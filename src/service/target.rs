//! The target actor: a thin actor around the compute thread that holds the frozen target on its device. The thread
//! takes capture requests in order, reads the batch's rows, runs the target to the last tapped layer and sends the
//! features to the drafter they were made for, over that drafter's bounded channel (through the routing table,
//! which knows each drafter's current thread). A request for a drafter thread that is gone is dropped.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use metrics::Gauge;
use ractor::ActorRef;
use tch::{Device, Kind};

use super::compute_thread::{ThreadBody, torch};
use super::failure::Failure;
use super::messages::{Heads, SupervisorMsg, Work};
use super::supervisor::protocol::{Event, Item, Request};
use crate::config::TargetSource;
use crate::data::dataset::Dataset;
use crate::data::packing::first_fit_decreasing;
use crate::device;
use crate::model::shared::SharedTensor;
use crate::model::{Depth, PartFault};
use crate::telemetry::TargetMetrics;
use crate::train::FeatureBatch;

/// Where a drafter's current thread takes its work.
pub struct Route {
    pub generation: u64,
    pub sender: SyncSender<Work>,
    pub device: Device,
    pub kind: Kind,
    /// The drafter's feature-queue depth series (features sent, not yet taken).
    pub queued: Gauge,
}

/// Drafter id -> its current thread's channel.
#[derive(Default)]
pub struct Routes(Mutex<HashMap<usize, Route>>);

impl Routes {
    pub fn set(&self, id: usize, route: Route) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(id, route);
    }
    /// Removes drafter `id`'s route if it leads to its thread `generation`.
    pub fn remove(&self, id: usize, generation: u64) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&id).is_some_and(|r| r.generation == generation) {
            map.remove(&id);
        }
    }
    /// Sends `work` to drafter `id` if its current thread is of `generation`; false if it is not.
    pub fn send(&self, id: usize, generation: u64, work: Work) -> bool {
        let (sender, queued) = {
            let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&id) {
                Some(r) if r.generation == generation => (r.sender.clone(), r.queued.clone()),
                _ => return false,
            }
        };
        let features = matches!(work, Work::Features { .. });
        if features {
            queued.increment(1.0);
        }
        let sent = sender.send(work).is_ok();
        if features && !sent {
            queued.decrement(1.0);
        }
        sent
    }
    /// Like [`Routes::send`], without waiting: false when the thread is gone or its queue is full.
    pub fn try_send(&self, id: usize, generation: u64, work: Work) -> bool {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(&id) {
            Some(r) if r.generation == generation => r.sender.try_send(work).is_ok(),
            _ => false,
        }
    }

    fn destination(&self, id: usize, generation: u64) -> Option<(Device, Kind)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&id).filter(|r| r.generation == generation).map(|r| (r.device, r.kind))
    }
}

pub struct TargetSpawn {
    /// Its index among the target copies.
    pub id: usize,
    pub generation: u64,
    pub source: TargetSource,
    pub taps: Vec<usize>,
    pub device: Device,
    /// More devices the copy spreads its later layers over (`target.spread_to`), and the micro-batches a capture is
    /// cut into then (`target.micro_batches`, 0 for the default).
    pub spread_to: Vec<Device>,
    pub micro_batches: usize,
    pub kind: Kind,
    /// Also capture the normed last states (the whole stack runs): the objective learns from the target's
    /// predictions.
    pub last_states: bool,
    /// `data.pack`: the batch's conversations packed into rows of at most this many tokens.
    pub pack: Option<usize>,
    pub dataset: Arc<dyn Dataset>,
    pub routes: Arc<Routes>,
    pub supervisor: ActorRef<SupervisorMsg>,
    /// The core's requests, handled in order: for drafter `drafter`'s thread `generation`, capture a batch's
    /// features, or pass an empty slot on in order with them; then report request `seq` delivered.
    pub requests: Receiver<Request>,
    /// Threads of this generation or older were given up (failed or hung): they deliver nothing more.
    pub abandoned: Arc<AtomicU64>,
    pub metrics: TargetMetrics,
    /// Fault injection: panic at the next capture, where it enters the part armed.
    pub fault: Arc<PartFault>,
}

/// A target copy's compute thread, for a [`ComputeActor`](super::compute_thread::ComputeActor).
pub fn thread(args: TargetSpawn) -> ThreadBody {
    ThreadBody { name: format!("target-{}", args.id), body: Box::new(move || run(args)) }
}

fn run(a: TargetSpawn) -> Result<(), Failure> {
    device::bind_thread(a.device).map_err(torch)?;
    let devices: Vec<Device> = std::iter::once(a.device).chain(a.spread_to.iter().copied()).collect();
    let depth = if a.last_states { Depth::Full } else { Depth::ToLastTap };
    let mut target = a.source.build_target_spread(&a.taps, depth, &devices, a.kind).map_err(torch)?;
    target.set_micro_batches(a.micro_batches);
    target.watch_faults(a.fault.clone());
    tracing::info!(id = a.id, model = %target.config().summary(), layers = %target.placement(), "target loaded");
    let heads = Heads {
        embed: SharedTensor::new(target.embed_tokens().shallow_clone()),
        lm_head: SharedTensor::new(target.lm_head().shallow_clone()),
    };
    let ready = SupervisorMsg::TargetReady { target: a.id, generation: a.generation, heads: Arc::new(heads) };
    let _ = a.supervisor.send_message(ready);
    let mut timings = CaptureTimings::new(a.device, a.metrics.clone());
    let abandoned = || a.abandoned.load(Ordering::SeqCst) >= a.generation;
    while let Ok(Request { seq, drafter, generation, item }) = a.requests.recv() {
        if abandoned() {
            return Ok(());
        }
        match item {
            Item::Capture { batch, positions } => {
                if let Some((device, kind)) = a.routes.destination(drafter, generation) {
                    let started = timings.start().map_err(torch)?;
                    let samples: Vec<_> = positions.iter().map(|&p| a.dataset.row(p)).collect();
                    // Rows of samples: one each, or (packed) first fit longest first.
                    let rows: Vec<Vec<usize>> = match a.pack {
                        Some(capacity) => {
                            let lengths: Vec<usize> = samples.iter().map(|r| r.input_ids.len()).collect();
                            first_fit_decreasing(&lengths, capacity)
                        }
                        None => (0..samples.len()).map(|i| vec![i]).collect(),
                    };
                    let input_ids = rows
                        .iter()
                        .map(|row| row.iter().flat_map(|&i| samples[i].input_ids.clone()).collect())
                        .collect();
                    let loss_mask = rows
                        .iter()
                        .map(|row| row.iter().flat_map(|&i| samples[i].loss_mask.clone()).collect())
                        .collect();
                    let conversations = a.pack.map(|_| {
                        rows.iter().map(|row| row.iter().map(|&i| samples[i].input_ids.len()).collect()).collect()
                    });
                    let features = FeatureBatch::capture_packed(
                        &target,
                        rows.iter().flatten().map(|&i| samples[i].id.key()).collect(),
                        batch.epoch,
                        input_ids,
                        loss_mask,
                        conversations,
                        (device, kind),
                        a.last_states,
                    )
                    .map_err(torch)?;
                    timings.end(started).map_err(torch)?;
                    if abandoned() {
                        // Its requests were handed to a new thread: delivering this one too would deliver it twice.
                        return Ok(());
                    }
                    a.routes.send(drafter, generation, Work::Features { batch, features: Box::new(features) });
                }
            }
            Item::Empty => {
                a.routes.send(drafter, generation, Work::Empty);
            }
        }
        let _ = a.supervisor.send_message(SupervisorMsg::Core(Event::Delivered {
            target: a.id,
            generation: a.generation,
            seq,
        }));
    }
    Ok(())
}

/// Capture durations without stalling the thread: on a GPU, a pair of events around each capture, read once the
/// device has passed the second (the thread keeps queueing work meanwhile); on the CPU, which computes as it is
/// called, the wall time.
struct CaptureTimings {
    device: Device,
    metrics: TargetMetrics,
    pending: std::collections::VecDeque<(device::TimingEvent, device::TimingEvent)>,
}

/// Where one capture started.
enum Started {
    Host(std::time::Instant),
    Device(device::TimingEvent),
}

impl CaptureTimings {
    fn new(device: Device, metrics: TargetMetrics) -> Self {
        CaptureTimings { device, metrics, pending: Default::default() }
    }

    fn start(&mut self) -> Result<Started, device::DeviceError> {
        Ok(match device::TimingEvent::new(self.device)? {
            Some(e) => {
                e.record()?;
                Started::Device(e)
            }
            None => Started::Host(std::time::Instant::now()),
        })
    }

    fn end(&mut self, started: Started) -> Result<(), device::DeviceError> {
        match started {
            Started::Host(t) => self.metrics.capture_duration.record(t.elapsed().as_secs_f64()),
            Started::Device(start) => {
                if let Some(end) = device::TimingEvent::new(self.device)? {
                    end.record()?;
                    self.pending.push_back((start, end));
                }
            }
        }
        while let Some((start, end)) = self.pending.front() {
            if !end.is_done()? {
                break;
            }
            self.metrics.capture_duration.record(start.elapsed_ms(end)? / 1e3);
            self.pending.pop_front();
        }
        Ok(())
    }
}
