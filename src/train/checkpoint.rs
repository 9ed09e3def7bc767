//! Checkpoints: `ckpt-<step>/` with the drafter in the published format (fp32 master weights), the optimizer state,
//! `trainer_state.json` (step, loader position, hyperparameters, the configuration) and `MANIFEST` (size and SHA-256
//! of every file). Written into a temporary folder, each file synced, renamed into place, the parent synced: a
//! checkpoint exists completely or not at all. Loading verifies the manifest and falls back to the previous valid
//! checkpoint. A background writer takes snapshots (host copies) so training threads never wait on disks; retention
//! keeps the newest K.
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::data::loader::{BatchId, LoaderState};
use crate::data::shards::{FileEntry, file_sha256};
use crate::model::drafter::save_drafter_folder;
use crate::model::flat_params::FlatLayout;
use crate::model::{DrafterConfig, ModelError};
use crate::train::optim::save_optimizer_state;

pub const DRAFTER_DIR: &str = "drafter";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
pub const MANIFEST_FILE: &str = "MANIFEST";
const FORMAT: &str = "dflash-checkpoint/1";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |err| CheckpointError::Io { path: path.to_path_buf(), err }
}

/// Where a run stands at a step boundary: everything besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: String,
    /// Completed steps.
    pub step: u64,
    pub samples_committed: u64,
    pub optimizer_steps: u64,
    pub skipped_steps: u64,
    pub loader: LoaderState,
    /// Batches set aside after failing twice.
    pub set_aside: Vec<BatchId>,
    /// The learning rate of the last step.
    pub lr: f64,
    /// The merged configuration the run used.
    pub config: serde_json::Value,
}

impl TrainerState {
    pub fn new(step: u64, loader: LoaderState, config: serde_json::Value) -> Self {
        TrainerState {
            format: FORMAT.to_string(),
            step,
            samples_committed: 0,
            optimizer_steps: 0,
            skipped_steps: 0,
            loader,
            set_aside: vec![],
            lr: 0.0,
            config,
        }
    }
}

/// A host copy of a drafter replica's tensors at a step boundary.
pub struct Snapshot {
    pub step: u64,
    pub config: DrafterConfig,
    pub layout: FlatLayout,
    pub master: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub optimizer_steps: u64,
}

impl Snapshot {
    /// Copies the given device tensors to host memory.
    pub fn take(
        step: u64,
        config: &DrafterConfig,
        layout: &FlatLayout,
        [master, exp_avg, exp_avg_sq]: [&Tensor; 3],
        optimizer_steps: u64,
    ) -> Result<Self, ModelError> {
        // A fresh host tensor (so training cannot change it later), page-locked for a device's: the copy is the
        // training thread's pause, and pinned memory makes it run at bus speed.
        let host = |t: &Tensor| -> Result<Tensor, ModelError> { Ok(crate::device::to_pinned_host(t)?) };
        Ok(Snapshot {
            step,
            config: config.clone(),
            layout: layout.clone(),
            master: host(master)?,
            exp_avg: host(exp_avg)?,
            exp_avg_sq: host(exp_avg_sq)?,
            optimizer_steps,
        })
    }
}

/// `ckpt-<step>`.
pub fn checkpoint_name(step: u64) -> String {
    format!("ckpt-{step:09}")
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(io(path))
}

/// Writes a checkpoint under `root`; `after_first_file` runs after the first file is written (fault rehearsal).
pub fn write_checkpoint(
    root: &Path,
    snapshot: &Snapshot,
    state: &TrainerState,
    after_first_file: &dyn Fn(),
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let name = checkpoint_name(snapshot.step);
    let tmp = root.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let step_tensor = Tensor::from_slice(&[snapshot.optimizer_steps as f32]).squeeze();
    save_optimizer_state(
        &tmp.join(OPTIMIZER_FILE),
        &snapshot.layout,
        &snapshot.exp_avg,
        &snapshot.exp_avg_sq,
        &step_tensor,
    )?;
    after_first_file();
    save_drafter_folder(&tmp.join(DRAFTER_DIR), &snapshot.config, &snapshot.layout, &snapshot.master, Kind::Float)?;
    let state_path = tmp.join(STATE_FILE);
    std::fs::write(&state_path, serde_json::to_string_pretty(state).expect("json")).map_err(io(&state_path))?;
    let files = [
        OPTIMIZER_FILE.to_string(),
        format!("{DRAFTER_DIR}/model.safetensors"),
        format!("{DRAFTER_DIR}/config.json"),
        STATE_FILE.to_string(),
    ];
    let mut entries = Vec::new();
    for f in &files {
        let path = tmp.join(f);
        std::fs::File::open(&path).and_then(|h| h.sync_all()).map_err(io(&path))?;
        let bytes = std::fs::metadata(&path).map_err(io(&path))?.len();
        let sha256 =
            file_sha256(&path).map_err(|e| CheckpointError::Invalid { path: path.clone(), reason: e.to_string() })?;
        entries.push(FileEntry { file: f.clone(), bytes, sha256 });
    }
    let manifest = tmp.join(MANIFEST_FILE);
    std::fs::write(&manifest, serde_json::to_string_pretty(&entries).expect("json")).map_err(io(&manifest))?;
    std::fs::File::open(&manifest).and_then(|h| h.sync_all()).map_err(io(&manifest))?;
    sync_dir(&tmp.join(DRAFTER_DIR))?;
    sync_dir(&tmp)?;
    let dest = root.join(&name);
    if dest.exists() {
        std::fs::remove_dir_all(&dest).map_err(io(&dest))?;
    }
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    sync_dir(root)?;
    Ok(dest)
}

/// Checks every file against the manifest; returns the trainer state.
pub fn verify_checkpoint(dir: &Path) -> Result<TrainerState, CheckpointError> {
    let invalid = |path: &Path, reason: String| CheckpointError::Invalid { path: path.to_path_buf(), reason };
    let manifest = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest).map_err(|_| invalid(dir, "no MANIFEST: incomplete".into()))?;
    let entries: Vec<FileEntry> =
        serde_json::from_str(&text).map_err(|e| invalid(&manifest, format!("unreadable: {e}")))?;
    for e in &entries {
        let path = dir.join(&e.file);
        let bytes = std::fs::metadata(&path).map_err(|_| invalid(&path, "missing".into()))?.len();
        if bytes != e.bytes {
            return Err(invalid(&path, format!("{bytes} bytes, the manifest says {}", e.bytes)));
        }
        let sha = file_sha256(&path).map_err(|err| invalid(&path, err.to_string()))?;
        if sha != e.sha256 {
            return Err(invalid(&path, "checksum differs from the manifest".into()));
        }
    }
    let state_path = dir.join(STATE_FILE);
    let state: TrainerState = serde_json::from_str(&std::fs::read_to_string(&state_path).map_err(io(&state_path))?)
        .map_err(|e| invalid(&state_path, format!("unreadable: {e}")))?;
    if state.format != FORMAT {
        return Err(invalid(&state_path, format!("format {:?}, this build reads {FORMAT:?}", state.format)));
    }
    Ok(state)
}

/// Checkpoints under `root`, newest first.
pub fn list_checkpoints(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("ckpt-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    found
}

/// The newest checkpoint whose manifest verifies, with the ones rejected on the way (and why).
pub fn newest_valid(root: &Path) -> (Option<(PathBuf, TrainerState)>, Vec<String>) {
    let mut rejected = Vec::new();
    for (_, path) in list_checkpoints(root) {
        match verify_checkpoint(&path) {
            Ok(state) => return (Some((path, state)), rejected),
            Err(e) => rejected.push(e.to_string()),
        }
    }
    (None, rejected)
}

/// Which checkpoints to delete so that the newest `keep` remain (`steps` in any order).
pub fn to_delete(steps: &[u64], keep: usize) -> Vec<u64> {
    let mut sorted = steps.to_vec();
    sorted.sort_unstable_by_key(|s| std::cmp::Reverse(*s));
    sorted.into_iter().skip(keep).collect()
}

/// A written checkpoint.
#[derive(Debug, Clone)]
pub struct Written {
    pub step: u64,
    pub path: PathBuf,
    pub seconds: f64,
}

enum Job {
    Write(Box<Snapshot>, Box<TrainerState>),
    Stop,
}

/// The background checkpoint writer: jobs in, results out through `on_done`. Dropping it finishes the queued jobs
/// and joins the thread.
pub struct Checkpointer {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    stall_next: Arc<AtomicBool>,
}

impl Checkpointer {
    pub fn start(root: PathBuf, keep: usize, on_done: impl Fn(Result<Written, String>) + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let stall_next = Arc::new(AtomicBool::new(false));
        let stall = stall_next.clone();
        let thread = std::thread::Builder::new()
            .name("checkpointer".into())
            .spawn(move || {
                while let Ok(Job::Write(snapshot, state)) = rx.recv() {
                    let started = Instant::now();
                    let stall_once = || {
                        if stall.swap(false, Ordering::SeqCst) {
                            tracing::warn!("checkpoint write stalled on purpose (fault injection)");
                            std::thread::sleep(Duration::from_secs(3600));
                        }
                    };
                    let result = write_checkpoint(&root, &snapshot, &state, &stall_once)
                        .map(|path| {
                            let steps: Vec<u64> = list_checkpoints(&root).iter().map(|(s, _)| *s).collect();
                            for step in to_delete(&steps, keep) {
                                let _ = std::fs::remove_dir_all(root.join(checkpoint_name(step)));
                            }
                            Written { step: snapshot.step, path, seconds: started.elapsed().as_secs_f64() }
                        })
                        .map_err(|e| e.to_string());
                    on_done(result);
                }
            })
            .expect("spawn the checkpoint writer");
        Checkpointer { jobs: Some(tx), thread: Some(thread), stall_next }
    }

    /// Queues a checkpoint.
    pub fn write(&self, snapshot: Snapshot, state: TrainerState) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Write(Box::new(snapshot), Box::new(state)));
        }
    }

    /// The next write pauses after its first file (fault rehearsal: a kill mid-checkpoint is deterministic).
    pub fn stall_next_write(&self) {
        self.stall_next.store(true, Ordering::SeqCst);
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(Job::Stop);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Drafter, Init, Preset};
    use crate::train::AdamW;
    use tch::Device;

    #[test]
    fn retention_keeps_the_newest() {
        assert_eq!(to_delete(&[10, 30, 20, 40], 2), vec![20, 10]);
        assert!(to_delete(&[5, 6], 3).is_empty());
    }

    fn snapshot(step: u64) -> Snapshot {
        let d =
            Drafter::new(DrafterConfig::for_preset(Preset::Tiny, 4), Device::Cpu, Kind::Float, Init::Portable(step))
                .unwrap();
        let opt = AdamW::new(d.params()).unwrap();
        let [m, v, _] = opt.state_tensors();
        Snapshot::take(step, d.config(), d.params().layout(), [&d.params().master, m, v], 3).unwrap()
    }

    fn state(step: u64) -> TrainerState {
        TrainerState::new(step, LoaderState { epoch: 1, next_ordinal: 4, owed: vec![] }, serde_json::json!({"k": 1}))
    }

    #[test]
    fn a_corrupted_checkpoint_is_rejected_and_the_previous_one_used() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20] {
            write_checkpoint(dir.path(), &snapshot(step), &state(step), &|| {}).unwrap();
        }
        let (found, rejected) = newest_valid(dir.path());
        assert_eq!(found.unwrap().1.step, 20);
        assert!(rejected.is_empty());
        // Flip one byte of the newest checkpoint's weights.
        let weights = dir.path().join(checkpoint_name(20)).join("drafter/model.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&weights, bytes).unwrap();
        let (found, rejected) = newest_valid(dir.path());
        assert_eq!(found.unwrap().1.step, 10);
        assert!(rejected[0].contains("checksum"), "{rejected:?}");
    }

    #[test]
    fn a_checkpoint_loads_back_bitwise() {
        let dir = tempfile::tempdir().unwrap();
        let snap = snapshot(7);
        let path = write_checkpoint(dir.path(), &snap, &state(7), &|| {}).unwrap();
        let d = Drafter::load(&path.join(DRAFTER_DIR), Device::Cpu, Kind::Float).unwrap();
        assert!(d.params().master.equal(&snap.master));
        let opt = AdamW::load(&path, OPTIMIZER_FILE, d.params().layout(), Device::Cpu).unwrap();
        assert_eq!(opt.steps(), 3);
        assert!(opt.moments().0.equal(&snap.exp_avg));
        assert_eq!(verify_checkpoint(&path).unwrap(), state(7));
    }

    #[test]
    fn an_unfinished_write_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join(format!(".{}.tmp", checkpoint_name(5)));
        std::fs::create_dir_all(&tmp).unwrap();
        assert!(list_checkpoints(dir.path()).is_empty());
        let half = dir.path().join(checkpoint_name(6));
        std::fs::create_dir_all(&half).unwrap();
        let (found, rejected) = newest_valid(dir.path());
        assert!(found.is_none() && rejected[0].contains("no MANIFEST"));
    }
}
