//! Checkpoints: `ckpt-<step>/` with the drafter in the published format (fp32 master weights), the optimizer state,
//! `trainer_state.json` (step, loader position, hyperparameters, the configuration) and `MANIFEST` (size and SHA-256
//! of every file). Written into a temporary folder, each file synced, renamed into place, the parent synced: a
//! checkpoint exists completely or not at all. Loading verifies the manifest and falls back to the previous valid
//! checkpoint. A background writer takes snapshots (host copies) so training threads never wait on disks; retention
//! keeps the newest K.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, Ordering},
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
    /// The batches each step from `recent_commits[0].0` up to `step` committed that the data ledger may not hold:
    /// written by a host other than rank 0 when rank 0 was lost (as that host derived them), or by rank 0 for the
    /// ledger lines its writer had not confirmed (a full disk). Resuming undoes the ledger from the first step and
    /// writes them to it again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_commits: Vec<(u64, Vec<BatchId>)>,
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
            recent_commits: vec![],
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
    /// With Muon: the parameters whose first-moment slot holds Muon's momentum buffer.
    pub muon: Option<BTreeSet<String>>,
}

impl Snapshot {
    /// Copies the given device tensors to host memory.
    pub fn take(
        step: u64,
        config: &DrafterConfig,
        layout: &FlatLayout,
        [master, exp_avg, exp_avg_sq]: [&Tensor; 3],
        optimizer_steps: u64,
        muon: Option<&BTreeSet<String>>,
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
            muon: muon.cloned(),
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

/// Writes a checkpoint under `root`; `after_first_file` runs after the first file is written (fault rehearsal), and
/// `still_wanted` is asked just before the checkpoint is put in place: when it says no, the write is discarded.
pub fn write_checkpoint(
    root: &Path,
    snapshot: &Snapshot,
    state: &TrainerState,
    after_first_file: &dyn Fn(),
    still_wanted: &dyn Fn() -> bool,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let name = checkpoint_name(snapshot.step);
    let tmp = root.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = write_files(&tmp, snapshot, state, after_first_file);
    if written.is_err() {
        // A failed write (a full disk) leaves no debris: gigabytes that would wait for the next start.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written?;
    if !still_wanted() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(CheckpointError::Invalid {
            path: root.join(&name),
            reason: "discarded: the run rewound to an earlier checkpoint while it was written".into(),
        });
    }
    let dest = root.join(&name);
    if dest.exists() {
        std::fs::remove_dir_all(&dest).map_err(io(&dest))?;
    }
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    sync_dir(root)?;
    Ok(dest)
}

/// Writes and syncs every file of a checkpoint into the temporary folder `tmp`, with its manifest.
fn write_files(
    tmp: &Path,
    snapshot: &Snapshot,
    state: &TrainerState,
    after_first_file: &dyn Fn(),
) -> Result<(), CheckpointError> {
    let step_tensor = Tensor::from_slice(&[snapshot.optimizer_steps as f32]).squeeze();
    save_optimizer_state(
        &tmp.join(OPTIMIZER_FILE),
        &snapshot.layout,
        &snapshot.exp_avg,
        &snapshot.exp_avg_sq,
        &step_tensor,
        snapshot.muon.as_ref(),
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
    sync_dir(tmp)
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

/// Checkpoints under `root`, newest first; a missing folder holds none.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io(root)(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix("ckpt-").and_then(|s| s.parse().ok()) {
            found.push((step, entry.path()));
        }
    }
    found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    Ok(found)
}

/// What a look for the checkpoint to resume found (and, in the supervisor's core, what a rewind's scan answers).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Scan {
    /// The newest checkpoint whose manifest verifies.
    pub newest: Option<(PathBuf, TrainerState)>,
    /// The newer ones rejected on the way: step and why.
    pub rejected: Vec<(u64, String)>,
}

/// The newest checkpoint under `root` whose manifest verifies, among the steps `allowed` lets through. Fails only
/// when the folder cannot be listed.
pub fn newest_valid(root: &Path, allowed: &dyn Fn(u64) -> bool) -> Result<Scan, CheckpointError> {
    let mut scan = Scan::default();
    for (step, path) in list_checkpoints(root)? {
        if !allowed(step) {
            continue;
        }
        match verify_checkpoint(&path) {
            Ok(state) => {
                scan.newest = Some((path, state));
                break;
            }
            Err(e) => scan.rejected.push((step, e.to_string())),
        }
    }
    Ok(scan)
}

/// Which checkpoints to delete, given each one's step and whether it is valid (not known invalid, manifest
/// present): the newest `keep` valid ones stay; older valid ones go, and so do invalid ones older than the newest
/// valid one (nothing would resume them). Invalid ones newer than every valid one stay, for a person to look at;
/// they never count towards `keep`, so a valid checkpoint is never deleted because of them.
pub fn to_delete(found: &[(u64, bool)], keep: usize) -> Vec<u64> {
    let mut valid: Vec<u64> = found.iter().filter(|(_, v)| *v).map(|(s, _)| *s).collect();
    valid.sort_unstable_by_key(|s| std::cmp::Reverse(*s));
    let newest_valid = valid.first().copied();
    let mut delete: Vec<u64> = valid.into_iter().skip(keep).collect();
    delete.extend(found.iter().filter(|(s, v)| !*v && newest_valid.is_some_and(|n| *s < n)).map(|(s, _)| *s));
    delete.sort_unstable_by_key(|s| std::cmp::Reverse(*s));
    delete
}

/// Removes the temporary folders of writes that were killed (`.ckpt-<step>.tmp`: never a checkpoint, gigabytes
/// each at real sizes); returns them. Call before any writer of `root` starts.
pub fn remove_unfinished(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io(root)(e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".ckpt-") && name.ends_with(".tmp") {
            let path = entry.path();
            let is_dir = entry.file_type().map_err(io(&path))?.is_dir();
            let result = if is_dir { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            result.map_err(io(&path))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// Moves the checkpoints of steps `from..=to` under `root` aside: each `ckpt-<step>` is renamed
/// `retired-ckpt-<step>-<unix seconds>`, out of reach of resuming and retention, kept for a person to look at or
/// delete. Returns the new paths.
pub fn retire(root: &Path, from: u64, to: u64) -> Result<Vec<PathBuf>, CheckpointError> {
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut moved = Vec::new();
    for (step, path) in list_checkpoints(root)? {
        if (from..=to).contains(&step) {
            let aside = root.join(format!("retired-{}-{stamp}", checkpoint_name(step)));
            std::fs::rename(&path, &aside).map_err(io(&path))?;
            moved.push(aside);
        }
    }
    if !moved.is_empty() {
        sync_dir(root)?;
    }
    Ok(moved)
}

/// Where the other hosts' checkpoints go under `checkpoint.dir` (each host has a folder of its own, so that no two
/// write one path on a shared disk): written when rank 0 was lost, taken by rank 0's resume.
const SURVIVORS_DIR: &str = "survivors";

/// The folder of the other hosts' checkpoints under `root`.
pub fn survivors_dir(root: &Path) -> PathBuf {
    root.join(SURVIVORS_DIR)
}

/// The folder host `rank` (not rank 0) checkpoints its replica into when rank 0 is lost.
pub fn survivor_root(root: &Path, rank: usize) -> PathBuf {
    survivors_dir(root).join(format!("host-{rank}"))
}

/// Whether other hosts wrote checkpoints under `root` (rank 0 was lost; `--resume auto` takes them).
pub fn has_survivors(root: &Path) -> bool {
    std::fs::read_dir(survivors_dir(root)).is_ok_and(|mut entries| entries.next().is_some())
}

/// Checkpoints other hosts are still writing under `root`: their temporary folders (`.ckpt-N.tmp`) with a file
/// changed within `quiet` of `now` (an older one is a killed write's debris). Rank 0 resuming waits for them: a host
/// checkpointing its replica when rank 0 was lost may still be at it when every host is restarted.
pub fn survivor_writes(root: &Path, now: std::time::SystemTime, quiet: Duration) -> Vec<PathBuf> {
    let Ok(hosts) = std::fs::read_dir(survivors_dir(root)) else { return vec![] };
    let mut writing = Vec::new();
    for host in hosts.flatten() {
        let Ok(entries) = std::fs::read_dir(host.path()) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".ckpt-") && name.ends_with(".tmp") && changed_since(&entry.path(), now, quiet) {
                writing.push(entry.path());
            }
        }
    }
    writing
}

/// Whether a file under `path` (or `path` itself) changed within `quiet` of `now`.
fn changed_since(path: &Path, now: std::time::SystemTime, quiet: Duration) -> bool {
    let recent = |m: std::fs::Metadata| m.modified().is_ok_and(|t| now.duration_since(t).map_or(true, |d| d < quiet));
    if std::fs::metadata(path).is_ok_and(recent) {
        return true;
    }
    let Ok(entries) = std::fs::read_dir(path) else { return false };
    entries.flatten().any(|e| changed_since(&e.path(), now, quiet))
}

/// Rank 0 resuming: when another host wrote a newer valid checkpoint than `own` (the newest of `root`) after
/// rank 0 was lost, that one is moved into `root` and returned in its place. Either way the other hosts' folder
/// is then moved aside (`retired-survivors-<unix seconds>`): once the run resumes, what they wrote is of steps it
/// has, or of a run it no longer is. Checkpoints rejected on the way are added to `own.rejected`.
pub fn adopt_survivors(root: &Path, own: &mut Scan) -> Result<Option<PathBuf>, CheckpointError> {
    let survivors = survivors_dir(root);
    let hosts = match std::fs::read_dir(&survivors) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&survivors)(e)),
    };
    let mut best: Option<(PathBuf, TrainerState)> = None;
    for host in hosts {
        let host = host.map_err(io(&survivors))?.path();
        if !host.is_dir() {
            continue;
        }
        let scan = newest_valid(&host, &|_| true)?;
        own.rejected.extend(scan.rejected);
        if let Some((path, state)) = scan.newest
            && best.as_ref().is_none_or(|(_, b)| state.step > b.step)
        {
            best = Some((path, state));
        }
    }
    let mut adopted = None;
    if let Some((path, state)) = best
        && own.newest.as_ref().is_none_or(|(_, o)| state.step > o.step)
    {
        let into = root.join(checkpoint_name(state.step));
        if into.exists() {
            // Rank 0's folder of that step did not verify: moved aside like any abandoned one.
            retire(root, state.step, state.step)?;
        }
        std::fs::rename(&path, &into).map_err(io(&path))?;
        adopted = Some(path);
        own.newest = Some((into, state));
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let aside = (0..)
        .map(|n| match n {
            0 => root.join(format!("retired-{SURVIVORS_DIR}-{stamp}")),
            n => root.join(format!("retired-{SURVIVORS_DIR}-{stamp}-{n}")),
        })
        .find(|p| !p.exists())
        .unwrap_or_else(|| root.join(format!("retired-{SURVIVORS_DIR}")));
    std::fs::rename(&survivors, &aside).map_err(io(&survivors))?;
    sync_dir(root)?;
    Ok(adopted)
}

/// Applies retention under `root`: folders whose step is in `invalid`, or without a manifest, are not valid.
fn prune(root: &Path, keep: usize, invalid: &[u64]) -> Result<(), CheckpointError> {
    let found: Vec<(u64, bool)> = list_checkpoints(root)?
        .into_iter()
        .map(|(step, path)| (step, !invalid.contains(&step) && path.join(MANIFEST_FILE).is_file()))
        .collect();
    for step in to_delete(&found, keep) {
        let path = root.join(checkpoint_name(step));
        std::fs::remove_dir_all(&path).map_err(io(&path))?;
    }
    Ok(())
}

/// A write's outcome: the checkpoint of `step`, asked for in the run's `incarnation`, and where it went (with the
/// seconds it took) or why it failed.
#[derive(Debug, Clone)]
pub struct Written {
    pub step: u64,
    pub incarnation: u64,
    pub result: Result<(PathBuf, f64), String>,
}

/// A checkpoint to write.
struct WriteJob {
    snapshot: Snapshot,
    state: TrainerState,
    /// Steps of folders known to be invalid (retention does not count them).
    invalid: Vec<u64>,
    incarnation: u64,
}

enum Job {
    Write(Box<WriteJob>),
    Retire { from: u64, to: u64 },
    Stop,
}

/// The background checkpoint writer: jobs in, results out through `on_done`. A job of an older incarnation than
/// the current one ([`Checkpointer::fence`]) is discarded before it is put in place. Dropping it finishes the
/// queued jobs and joins the thread, waiting at most [`Checkpointer::DROP_WAIT`]: a write stalled on a disk is left
/// behind rather than holding the process (its temporary folder is never taken for a checkpoint).
pub struct Checkpointer {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// Closed when the writer thread ends.
    ended: mpsc::Receiver<()>,
    stall_next: Arc<AtomicBool>,
    incarnation: Arc<AtomicU64>,
}

impl Checkpointer {
    /// Starts the writer thread; `on_done` gets each write's outcome (the step and why, when it failed).
    /// Starts the writer thread; `on_done` gets each write's outcome.
    pub fn start(root: PathBuf, keep: usize, on_done: impl Fn(Written) + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let stall_next = Arc::new(AtomicBool::new(false));
        let incarnation = Arc::new(AtomicU64::new(0));
        let (stall, current) = (stall_next.clone(), incarnation.clone());
        let (ending, ended) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("checkpointer".into())
            .spawn(move || {
                let _ending = ending;
                loop {
                    let job = match rx.recv() {
                        Ok(Job::Write(job)) => job,
                        Ok(Job::Retire { from, to }) => {
                            match retire(&root, from, to) {
                                Ok(moved) if moved.is_empty() => {}
                                Ok(moved) => tracing::warn!(
                                    ?moved,
                                    "checkpoints of steps the run no longer has were moved aside (delete them when \
                                     no longer wanted)"
                                ),
                                Err(e) => tracing::error!("moving checkpoints aside: {e}"),
                            }
                            continue;
                        }
                        Ok(Job::Stop) | Err(_) => break,
                    };
                    let started = Instant::now();
                    let stall_once = || {
                        if stall.swap(false, Ordering::SeqCst) {
                            tracing::warn!("checkpoint write stalled on purpose (fault injection)");
                            std::thread::sleep(Duration::from_secs(3600));
                        }
                    };
                    let wanted = || current.load(Ordering::SeqCst) == job.incarnation;
                    let result = write_checkpoint(&root, &job.snapshot, &job.state, &stall_once, &wanted)
                        .map(|path| {
                            if let Err(e) = prune(&root, keep, &job.invalid) {
                                tracing::warn!("retention: {e}");
                            }
                            (path, started.elapsed().as_secs_f64())
                        })
                        .map_err(|e| e.to_string());
                    on_done(Written { step: job.snapshot.step, incarnation: job.incarnation, result });
                }
            })
            .expect("spawn the checkpoint writer");
        Checkpointer { jobs: Some(tx), thread: Some(thread), ended, stall_next, incarnation }
    }

    /// Queues a checkpoint of the run's `incarnation`; `invalid`: steps of folders known to be invalid, which
    /// retention does not count.
    pub fn write(&self, snapshot: Snapshot, state: TrainerState, invalid: Vec<u64>, incarnation: u64) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Write(Box::new(WriteJob { snapshot, state, invalid, incarnation })));
        }
    }

    /// Queues moving the checkpoints of steps `from..=to` aside ([`retire`]), after the writes queued before.
    pub fn retire(&self, from: u64, to: u64) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Retire { from, to });
        }
    }

    /// The run is now in `incarnation` (it rewound): writes of earlier ones are discarded.
    pub fn fence(&self, incarnation: u64) {
        self.incarnation.store(incarnation, Ordering::SeqCst);
    }

    /// The next write pauses after its first file (fault rehearsal: a kill mid-checkpoint is deterministic); false
    /// when a stall is pending already.
    pub fn stall_next_write(&self) -> bool {
        !self.stall_next.swap(true, Ordering::SeqCst)
    }
}

impl Checkpointer {
    /// How long dropping the writer waits for the jobs queued before it.
    pub const DROP_WAIT: Duration = Duration::from_secs(10);
}

impl Checkpointer {
    /// Finishes the jobs queued, waiting at most `wait`; false when the writer is left behind (its temporary
    /// folder is never taken for a checkpoint).
    pub fn finish(&mut self, wait: Duration) -> bool {
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(Job::Stop);
        }
        let done = crate::bounded_join::join_within(&mut self.thread, &self.ended, wait);
        if !done {
            tracing::warn!(
                "the checkpoint writer is still busy after the {:.1} s left to exit (a stalled disk?): leaving it \
                 behind",
                wait.as_secs_f64()
            );
        }
        done
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.finish(Self::DROP_WAIT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Drafter, Init, Preset};
    use crate::train::optim::{Optimizer, OptimizerKind};
    use tch::Device;

    #[test]
    fn retention_keeps_the_newest_valid_and_never_counts_invalid_ones() {
        let all_valid = |steps: &[u64]| steps.iter().map(|&s| (s, true)).collect::<Vec<_>>();
        assert_eq!(to_delete(&all_valid(&[10, 30, 20, 40]), 2), vec![20, 10]);
        assert!(to_delete(&all_valid(&[5, 6]), 3).is_empty());
        // Corrupt checkpoints at higher steps (an older run, a bad disk): the new valid ones are kept, the
        // invalid ones above them stay for inspection, the invalid one below the newest valid goes.
        let found = [(60, false), (50, false), (34, true), (32, true), (30, true), (25, false)];
        assert_eq!(to_delete(&found, 2), vec![30, 25]);
        assert!(to_delete(&[(9, false), (8, false)], 2).is_empty(), "no valid one: nothing is deleted");
    }

    #[test]
    fn the_scan_passes_over_excluded_steps_and_reports_an_unreadable_folder() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20] {
            write_checkpoint(dir.path(), &snapshot(step), &state(step), &|| {}, &|| true).unwrap();
        }
        assert_eq!(newest_valid(dir.path(), &|s| s != 20).unwrap().newest.unwrap().1.step, 10);
        assert!(newest_valid(&dir.path().join("absent"), &|_| true).unwrap().newest.is_none());
        let file = dir.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        assert!(
            newest_valid(&file, &|_| true).is_err(),
            "a folder that cannot be listed is an error, not 'no checkpoint'"
        );
    }

    /// Rank 0 resuming takes another host's checkpoint when it is newer than its own (moved in beside them), and
    /// moves the other hosts' folder aside whichever it takes.
    #[test]
    fn rank_0_resuming_takes_another_hosts_newer_checkpoint_and_retires_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write_checkpoint(root, &snapshot(10), &state(10), &|| {}, &|| true).unwrap();
        for (rank, step) in [(1, 14), (2, 13)] {
            let host = survivor_root(root, rank);
            std::fs::create_dir_all(&host).unwrap();
            write_checkpoint(&host, &snapshot(step), &state(step), &|| {}, &|| true).unwrap();
        }
        let mut scan = newest_valid(root, &|_| true).unwrap();
        let adopted = adopt_survivors(root, &mut scan).unwrap();
        assert_eq!(adopted, Some(survivor_root(root, 1).join(checkpoint_name(14))));
        let (path, found) = scan.newest.unwrap();
        assert_eq!((path, found.step), (root.join(checkpoint_name(14)), 14));
        assert!(verify_checkpoint(&root.join(checkpoint_name(14))).is_ok());
        assert!(!root.join(SURVIVORS_DIR).exists(), "the other hosts' folder is moved aside");
        let names: Vec<String> =
            std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().any(|n| n.starts_with("retired-survivors-")), "{names:?}");

        // Rank 0's own is newer: it stays the one; the others' older one is moved aside unused.
        let host = survivor_root(root, 1);
        std::fs::create_dir_all(&host).unwrap();
        write_checkpoint(&host, &snapshot(12), &state(12), &|| {}, &|| true).unwrap();
        let mut scan = newest_valid(root, &|_| true).unwrap();
        assert_eq!(adopt_survivors(root, &mut scan).unwrap(), None);
        assert_eq!(scan.newest.unwrap().1.step, 14);
        assert!(!root.join(SURVIVORS_DIR).exists());
        let mut scan = newest_valid(root, &|_| true).unwrap();
        assert_eq!(adopt_survivors(root, &mut scan).unwrap(), None, "no other hosts' folder: nothing to do");
    }

    /// A write in progress (a file changed recently) is waited for; a killed write's debris (nothing changed for
    /// a while) and rank 0's own temporary folders are not.
    #[test]
    fn only_other_hosts_writes_still_changing_count_as_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let now = std::time::SystemTime::now();
        let quiet = Duration::from_secs(30);
        assert!(survivor_writes(root, now, quiet).is_empty(), "no other hosts' folder");
        let writing = survivor_root(root, 1).join(".ckpt-000000007.tmp");
        std::fs::create_dir_all(writing.join("drafter")).unwrap();
        std::fs::write(writing.join("drafter/model.safetensors"), b"part").unwrap();
        std::fs::create_dir_all(root.join(".ckpt-000000005.tmp")).unwrap();
        assert_eq!(survivor_writes(root, now, quiet), vec![writing.clone()]);
        let later = now + Duration::from_secs(120);
        assert!(survivor_writes(root, later, quiet).is_empty(), "two minutes without a change: debris");
    }

    fn snapshot(step: u64) -> Snapshot {
        let d =
            Drafter::new(DrafterConfig::for_preset(Preset::Tiny, 4), Device::Cpu, Kind::Float, Init::Portable(step))
                .unwrap();
        let opt = Optimizer::new(d.params(), OptimizerKind::AdamW).unwrap();
        let [m, v, _] = opt.state_tensors();
        Snapshot::take(step, d.config(), d.params().layout(), [&d.params().master, m, v], 3, None).unwrap()
    }

    fn state(step: u64) -> TrainerState {
        TrainerState::new(step, LoaderState { epoch: 1, next_ordinal: 4, owed: vec![] }, serde_json::json!({"k": 1}))
    }

    #[test]
    fn a_corrupted_checkpoint_is_rejected_and_the_previous_one_used() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20] {
            write_checkpoint(dir.path(), &snapshot(step), &state(step), &|| {}, &|| true).unwrap();
        }
        let scan = newest_valid(dir.path(), &|_| true).unwrap();
        assert_eq!(scan.newest.unwrap().1.step, 20);
        assert!(scan.rejected.is_empty());
        // Flip one byte of the newest checkpoint's weights.
        let weights = dir.path().join(checkpoint_name(20)).join("drafter/model.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&weights, bytes).unwrap();
        let scan = newest_valid(dir.path(), &|_| true).unwrap();
        assert_eq!(scan.newest.unwrap().1.step, 10);
        assert!(scan.rejected[0].0 == 20 && scan.rejected[0].1.contains("checksum"), "{:?}", scan.rejected);
    }

    #[test]
    fn a_checkpoint_loads_back_bitwise() {
        let dir = tempfile::tempdir().unwrap();
        let snap = snapshot(7);
        let path = write_checkpoint(dir.path(), &snap, &state(7), &|| {}, &|| true).unwrap();
        let d = Drafter::load(&path.join(DRAFTER_DIR), Device::Cpu, Kind::Float).unwrap();
        assert!(d.params().master.equal(&snap.master));
        let opt =
            Optimizer::load(&path, OPTIMIZER_FILE, d.params().layout(), Device::Cpu, OptimizerKind::AdamW).unwrap();
        assert_eq!(opt.steps(), 3);
        assert!(opt.moments().0.equal(&snap.exp_avg));
        assert_eq!(verify_checkpoint(&path).unwrap(), state(7));
    }

    #[test]
    fn retiring_moves_checkpoints_out_of_reach_and_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20, 30] {
            write_checkpoint(dir.path(), &snapshot(step), &state(step), &|| {}, &|| true).unwrap();
        }
        let moved = retire(dir.path(), 11, u64::MAX).unwrap();
        assert_eq!(moved.len(), 2);
        assert!(moved.iter().all(|p| p.join(MANIFEST_FILE).is_file()), "kept whole");
        let left: Vec<u64> = list_checkpoints(dir.path()).unwrap().iter().map(|(s, _)| *s).collect();
        assert_eq!(left, vec![10]);
        assert_eq!(newest_valid(dir.path(), &|_| true).unwrap().newest.unwrap().1.step, 10);
    }

    #[test]
    fn a_write_no_longer_wanted_is_discarded_before_it_is_put_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_checkpoint(dir.path(), &snapshot(3), &state(3), &|| {}, &|| false).unwrap_err();
        assert!(err.to_string().contains("discarded"), "{err}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "nothing left behind");
    }

    /// A write that fails half way (here its drafter folder cannot be made, as on a full disk) removes its
    /// temporary folder at once rather than leaving it for the next start.
    #[test]
    fn a_failed_write_leaves_no_temporary_folder() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join(format!(".{}.tmp", checkpoint_name(3)));
        let sabotage = || std::fs::write(tmp.join(DRAFTER_DIR), b"not a folder").unwrap();
        let err = write_checkpoint(dir.path(), &snapshot(3), &state(3), &sabotage, &|| true).unwrap_err();
        assert!(err.to_string().contains(DRAFTER_DIR), "{err}");
        assert!(!tmp.exists(), "the temporary folder is removed");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "nothing left behind");
    }

    /// A write stalled on its disk does not hold whoever drops the writer for longer than `DROP_WAIT`.
    #[test]
    fn dropping_the_writer_leaves_a_stalled_write_behind() {
        let dir = tempfile::tempdir().unwrap();
        let writer = Checkpointer::start(dir.path().to_path_buf(), 2, |_| {});
        assert!(writer.stall_next_write());
        assert!(!writer.stall_next_write(), "one pending at a time");
        writer.write(snapshot(4), state(4), vec![], 0);
        while !dir.path().join(format!(".{}.tmp", checkpoint_name(4))).join(OPTIMIZER_FILE).exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let started = Instant::now();
        drop(writer);
        let waited = started.elapsed();
        assert!(waited >= Checkpointer::DROP_WAIT && waited < Checkpointer::DROP_WAIT * 2, "{waited:?}");
        assert!(list_checkpoints(dir.path()).unwrap().is_empty(), "the stalled write is no checkpoint");
    }

    #[test]
    fn an_unfinished_write_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join(format!(".{}.tmp", checkpoint_name(5)));
        std::fs::create_dir_all(&tmp).unwrap();
        assert!(list_checkpoints(dir.path()).unwrap().is_empty());
        let half = dir.path().join(checkpoint_name(6));
        std::fs::create_dir_all(&half).unwrap();
        let scan = newest_valid(dir.path(), &|_| true).unwrap();
        assert!(scan.newest.is_none() && scan.rejected[0].1.contains("no MANIFEST"));
    }

    #[test]
    fn debris_of_killed_writes_is_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join(format!(".{}.tmp", checkpoint_name(5)));
        std::fs::create_dir_all(folder.join("inner")).unwrap();
        let file = dir.path().join(format!(".{}.tmp", checkpoint_name(7)));
        std::fs::write(&file, b"half").unwrap();
        let kept = [checkpoint_name(4), "retired-ckpt-9-1".to_string(), "notes.tmp".to_string()];
        for name in &kept {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
        }
        let mut removed = remove_unfinished(dir.path()).unwrap();
        removed.sort();
        assert_eq!(removed, vec![folder.clone(), file.clone()]);
        assert!(!folder.exists() && !file.exists());
        assert!(kept.iter().all(|name| dir.path().join(name).exists()));
        assert!(remove_unfinished(&dir.path().join("absent")).unwrap().is_empty());
    }
}
