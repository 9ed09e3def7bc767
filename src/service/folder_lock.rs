//! One writer per checkpoint folder. Two services on one `checkpoint.dir` (a replacement pod started while the old
//! one is in its grace period) would both train and write the same checkpoint paths and ledger. The process that
//! writes checkpoints holds an OS lock (`flock`) on a file in `checkpoint.dir` for its whole life: the kernel
//! releases it when the process ends, however it ends (kill -9 included), so a stale lock is never guessed at. The
//! holder's host, pid and start time are written inside the file, so a refused process can name it.
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The lock file in `checkpoint.dir` of the process that writes into `folder`: rank 0's (or a single host's) for
/// `checkpoint.dir` itself, another host's for its `survivors/host-<rank>` (kept beside, not inside, the survivors'
/// folder, which rank 0 moves aside when it resumes).
pub fn lock_file(checkpoint_dir: &Path, rank: Option<usize>) -> PathBuf {
    match rank {
        Some(rank) if rank > 0 => checkpoint_dir.join(format!(".dflash-host-{rank}.lock")),
        _ => checkpoint_dir.join(".dflash.lock"),
    }
}

/// Who holds a folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub host: String,
    pub pid: u32,
    /// When it took the lock (RFC 3339, UTC).
    pub since: String,
}

impl Holder {
    fn this_process() -> Self {
        Holder {
            host: crate::telemetry::host_name(),
            pid: std::process::id(),
            since: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} on host {} since {}", self.pid, self.host, self.since)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "the checkpoint folder is in use by another dflash process ({holder}, holding {path}); waited {waited:.0} s \
         for it (checkpoint.lock_wait_s). Stop that process, wait for it to end, or use another checkpoint.dir"
    )]
    Held { path: PathBuf, holder: String, waited: f64 },
    #[error(
        "cannot lock {path}: {source}. The filesystem does not support file locks: put checkpoint.dir on one that \
         does, or set checkpoint.lock = false and make sure no two processes ever use the folder at once"
    )]
    Unsupported { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// A held lock on a folder; dropping it (or the process ending) releases it. Dropped while its folder holds
/// nothing but the lock file (a start that failed before writing anything), it removes the lock file and the folders
/// it created, so that a failed start leaves no empty checkpoint folder behind.
#[derive(Debug)]
pub struct FolderLock {
    _file: File,
    path: PathBuf,
    /// The folders `acquire` created, deepest first.
    created: Vec<PathBuf>,
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        let Some(dir) = self.path.parent() else { return };
        let only_the_lock =
            std::fs::read_dir(dir).map(|entries| entries.flatten().all(|e| e.path() == self.path)).unwrap_or(false);
        if self.created.is_empty() || !only_the_lock {
            return;
        }
        // Removed while still held: a process waiting on this file finds it gone once it has the lock, and retries
        // on a new one (`acquire` checks that the file it locked is still the one at the path).
        if std::fs::remove_file(&self.path).is_ok() {
            for folder in &self.created {
                if std::fs::remove_dir(folder).is_err() {
                    break;
                }
            }
        }
    }
}

/// The folders `create_dir_all(dir)` would create, deepest first.
fn missing_folders(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).map(Path::to_path_buf).collect()
}

/// Whether `file` is still the file at `path` (not removed or replaced since it was opened).
pub(crate) fn still_at(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

impl FolderLock {
    /// Locks the file `path` (created with its folder if missing), waiting up to `wait` while another process holds
    /// it; `waiting` is called once, with the holder, when it has to wait.
    pub fn acquire(path: &Path, wait: Duration, mut waiting: impl FnMut(&str)) -> Result<Self, LockError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LockError::Io { path, source }
        };
        let path = path.to_path_buf();
        // The file (with the folders it needs), and the folders this made.
        let open = || -> Result<(File, Vec<PathBuf>), LockError> {
            let mut created = Vec::new();
            if let Some(dir) = path.parent() {
                created = missing_folders(dir);
                std::fs::create_dir_all(dir).map_err(io(dir))?;
            }
            let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
            Ok((file.map_err(io(&path))?, created))
        };
        let (mut file, mut created) = open()?;
        let started = Instant::now();
        let mut said = false;
        loop {
            match file.try_lock() {
                // Locked, but the holder it waited for may have removed the file (and its folder) on its way out:
                // lock the file at the path now.
                Ok(()) if !still_at(&file, &path) => {
                    (file, created) = open()?;
                    continue;
                }
                Ok(()) => break,
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(source)) if unsupported(&source) => {
                    return Err(LockError::Unsupported { path, source });
                }
                Err(TryLockError::Error(source)) => return Err(LockError::Io { path, source }),
            }
            let holder = read_holder(&path);
            if started.elapsed() >= wait {
                let waited = started.elapsed().as_secs_f64();
                return Err(LockError::Held { path, holder, waited });
            }
            if !said {
                waiting(&holder);
                said = true;
            }
            std::thread::sleep(Duration::from_millis(200).min(wait.saturating_sub(started.elapsed())));
        }
        let holder = serde_json::to_string(&Holder::this_process()).expect("json");
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(holder.as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(io(&path))?;
        Ok(FolderLock { _file: file, path, created })
    }
}

/// The holder named in a lock file, for a message.
fn read_holder(path: &Path) -> String {
    let mut text = String::new();
    let read = File::open(path).and_then(|mut f| f.read_to_string(&mut text));
    match (read, serde_json::from_str::<Holder>(&text)) {
        (Ok(_), Ok(holder)) => holder.to_string(),
        _ => format!("its holder did not say who it is in {}", path.display()),
    }
}

/// Errors of a filesystem without locks (FUSE mounts, some network filesystems).
fn unsupported(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Unsupported
        || matches!(e.raw_os_error(), Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second lock on a held folder (another open file: as another process) waits, then is refused naming the
    /// holder; once the first is dropped it is taken at once.
    #[test]
    fn a_held_folder_is_refused_naming_its_holder_and_free_once_released() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_file(&dir.path().join("ckpt"), None);
        let first = FolderLock::acquire(&path, Duration::ZERO, |_| panic!("free")).unwrap();
        let mut told = None;
        let started = Instant::now();
        let err =
            FolderLock::acquire(&path, Duration::from_millis(600), |h| told = Some(h.to_string())).expect_err("held");
        assert!(started.elapsed() >= Duration::from_millis(600), "waited the bound: {:?}", started.elapsed());
        let message = err.to_string();
        let me = format!("pid {} on host {}", std::process::id(), crate::telemetry::host_name());
        assert!(matches!(err, LockError::Held { .. }) && message.contains(&me), "{message}");
        assert!(told.is_some_and(|h| h.contains(&me)));
        let other_host = lock_file(&dir.path().join("ckpt"), Some(1));
        FolderLock::acquire(&other_host, Duration::ZERO, |_| panic!("another host's lock is its own")).unwrap();
        drop(first);
        FolderLock::acquire(&path, Duration::ZERO, |_| panic!("free")).unwrap();
    }

    /// A lock dropped while its folder holds nothing else (a start that failed) removes the folders it created,
    /// and only those; a folder with anything else in it stays as it is.
    #[test]
    fn a_failed_start_leaves_no_folder_it_created() {
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        drop(FolderLock::acquire(&lock_file(&runs.join("a"), None), Duration::ZERO, |_| {}).unwrap());
        assert!(!runs.exists(), "runs/ and runs/a were created for the lock, and removed with it");

        std::fs::create_dir_all(runs.join("b")).unwrap();
        drop(FolderLock::acquire(&lock_file(&runs.join("b"), None), Duration::ZERO, |_| {}).unwrap());
        assert!(runs.join("b").is_dir(), "a folder that was there stays");

        let c = runs.join("c");
        let lock = FolderLock::acquire(&lock_file(&c, None), Duration::ZERO, |_| {}).unwrap();
        std::fs::write(c.join("data.json"), "{}").unwrap();
        drop(lock);
        assert!(c.join("data.json").is_file() && lock_file(&c, None).is_file(), "a folder in use stays whole");
    }

    /// A waiter whose holder removes the lock file on its way out locks the file at the path, not the removed one:
    /// two processes never both hold the folder.
    #[test]
    fn a_waiter_on_a_removed_lock_file_locks_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_file(&dir.path().join("fresh"), None);
        let first = FolderLock::acquire(&path, Duration::ZERO, |_| {}).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        let second = FolderLock::acquire(&path, Duration::from_secs(30), |_| {}).unwrap();
        release.join().unwrap();
        assert!(still_at(&second._file, &path), "the lock is on the file at the path");
        FolderLock::acquire(&path, Duration::ZERO, |_| {}).expect_err("held by the second");
    }

    /// A waiter gets the folder as soon as the holder lets it go, within its bound.
    #[test]
    fn a_waiter_takes_the_folder_when_the_holder_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_file(dir.path(), None);
        let first = FolderLock::acquire(&path, Duration::ZERO, |_| {}).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        let started = Instant::now();
        FolderLock::acquire(&path, Duration::from_secs(30), |_| {}).unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        release.join().unwrap();
    }
}
