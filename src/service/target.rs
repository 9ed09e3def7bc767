//! The target actor: a thin actor around the compute thread that holds the frozen target on its device. The thread
//! takes capture requests in order, reads the batch's rows, runs the target to the last tapped layer and sends the
//! features to the drafter they were made for, over that drafter's bounded channel (through the routing table,
//! which knows each drafter's current thread). A request for a drafter thread that is gone is dropped.
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tch::{Device, Kind};

use super::compute_thread::{self, torch};
use super::failure::Failure;
use super::messages::{Heads, SupervisorMsg, ThreadMsg, Work};
use crate::config::TargetSource;
use crate::data::dataset::Dataset;
use crate::data::loader::BatchId;
use crate::device;
use crate::model::Depth;
use crate::model::shared::SharedTensor;
use crate::train::FeatureBatch;

/// Where a drafter's current thread takes its work.
pub struct Route {
    pub generation: u64,
    pub sender: SyncSender<Work>,
    pub device: Device,
    pub kind: Kind,
}

/// Drafter id -> its current thread's channel.
#[derive(Default)]
pub struct Routes(Mutex<HashMap<usize, Route>>);

impl Routes {
    pub fn set(&self, id: usize, route: Route) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(id, route);
    }
    pub fn remove(&self, id: usize) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }
    /// Sends `work` to drafter `id` if its current thread is of `generation`; false if it is not.
    pub fn send(&self, id: usize, generation: u64, work: Work) -> bool {
        let sender = {
            let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&id) {
                Some(r) if r.generation == generation => r.sender.clone(),
                _ => return false,
            }
        };
        sender.send(work).is_ok()
    }
    fn destination(&self, id: usize, generation: u64) -> Option<(Device, Kind)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&id).filter(|r| r.generation == generation).map(|r| (r.device, r.kind))
    }
}

/// Requests to the target thread, handled in order.
pub enum TargetWork {
    Capture {
        drafter: usize,
        generation: u64,
        batch: BatchId,
        positions: Vec<usize>,
    },
    /// Passes `Work::Empty` on in order with the features.
    Empty {
        drafter: usize,
        generation: u64,
    },
}

pub struct TargetSpawn {
    pub generation: u64,
    pub source: TargetSource,
    pub taps: Vec<usize>,
    pub device: Device,
    pub kind: Kind,
    pub dataset: Arc<dyn Dataset>,
    pub routes: Arc<Routes>,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub requests: Receiver<TargetWork>,
}

pub struct TargetActor;

impl Actor for TargetActor {
    type Msg = ThreadMsg;
    type State = ();
    type Arguments = TargetSpawn;

    async fn pre_start(&self, myself: ActorRef<ThreadMsg>, args: TargetSpawn) -> Result<(), ActorProcessingErr> {
        compute_thread::spawn("target".into(), myself, move || run(args))?;
        Ok(())
    }

    async fn handle(&self, _: ActorRef<ThreadMsg>, msg: ThreadMsg, _: &mut ()) -> Result<(), ActorProcessingErr> {
        compute_thread::on_thread_msg(msg)
    }
}

fn run(a: TargetSpawn) -> Result<(), Failure> {
    device::bind_thread(a.device).map_err(torch)?;
    let target = a.source.build_target(&a.taps, Depth::ToLastTap, a.device, a.kind).map_err(torch)?;
    let heads = Heads {
        embed: SharedTensor::new(target.embed_tokens().shallow_clone()),
        lm_head: SharedTensor::new(target.lm_head().shallow_clone()),
    };
    let _ = a.supervisor.send_message(SupervisorMsg::TargetReady { generation: a.generation, heads: Arc::new(heads) });
    while let Ok(work) = a.requests.recv() {
        match work {
            TargetWork::Capture { drafter, generation, batch, positions } => {
                if let Some((device, kind)) = a.routes.destination(drafter, generation) {
                    let rows: Vec<_> = positions.iter().map(|&p| a.dataset.row(p)).collect();
                    let features = FeatureBatch::capture(
                        &target,
                        rows.iter().map(|r| r.id).collect(),
                        batch.epoch,
                        rows.iter().map(|r| r.input_ids.clone()).collect(),
                        rows.iter().map(|r| r.loss_mask.clone()).collect(),
                        device,
                        kind,
                    )
                    .map_err(torch)?;
                    a.routes.send(drafter, generation, Work::Features { batch, features: Box::new(features) });
                }
                let _ = a.supervisor.send_message(SupervisorMsg::Delivered { generation: a.generation, batch });
            }
            TargetWork::Empty { drafter, generation } => {
                a.routes.send(drafter, generation, Work::Empty);
            }
        }
    }
    Ok(())
}
