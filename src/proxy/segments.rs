//! The recording's files: exchanges are appended to a hidden open segment (`.open-*.jsonl`), which is sealed (flushed,
//! fsynced, renamed to `segment-<UTC time>-<seq>.jsonl`, the folder fsynced) once it holds `max_bytes` or is
//! `max_age` old, and when the proxy stops. A reader lists only sealed segments, so what it sees is durable and
//! whole. An open segment a crash left behind is sealed at the next start, cut after its last whole line: what was
//! written is kept, never half a line. Sealed segments past the [`Retention`] (a total size, an age) are deleted,
//! oldest first, after each seal and once a minute.
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where a sealed segment's name starts; readers take `segment-*.jsonl` in name order.
pub const SEALED_PREFIX: &str = "segment-";
const OPEN_PREFIX: &str = ".open-";

/// When an open segment is sealed.
#[derive(Debug, Clone, Copy)]
pub struct Rotation {
    pub max_bytes: u64,
    pub max_age: Duration,
}

/// How much of the recording is kept: sealed segments past either bound are deleted, oldest first (`None`: no bound).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Retention {
    pub max_bytes: Option<u64>,
    pub max_age: Option<Duration>,
}

impl Retention {
    /// How many of the sealed segments, oldest first as `(bytes, age)`, are past the bounds: the oldest ones until
    /// the rest fit in `max_bytes`, and every one older than `max_age`.
    pub fn expired(&self, segments: &[(u64, Duration)]) -> usize {
        let mut total: u64 = segments.iter().map(|s| s.0).sum();
        let mut expired = 0;
        for &(bytes, age) in segments {
            let too_big = self.max_bytes.is_some_and(|max| total > max);
            let too_old = self.max_age.is_some_and(|max| age > max);
            if !(too_big || too_old) {
                break;
            }
            total -= bytes;
            expired += 1;
        }
        expired
    }
}

/// Seconds between two retention checks when nothing is sealed.
const RETENTION_EVERY: Duration = Duration::from_secs(60);

struct Open {
    file: File,
    path: PathBuf,
    bytes: u64,
    opened: Instant,
}

/// The recording folder, written by one proxy.
pub struct Segments {
    dir: PathBuf,
    rotation: Rotation,
    retention: Retention,
    /// When sealed segments were last held to the retention.
    retained: Instant,
    /// Sealed segments deleted by the retention so far.
    pub retired: u64,
    open: Option<Open>,
    /// The next segment's number: one past the highest in the folder.
    next: u64,
}

impl Segments {
    /// Opens `dir` (created), sealing what a crashed proxy left open.
    pub fn open(dir: &Path, rotation: Rotation, retention: Retention) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut this = Segments {
            dir: dir.to_path_buf(),
            rotation,
            retention,
            retained: Instant::now(),
            retired: 0,
            open: None,
            next: 0,
        };
        let mut leftovers = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let name = entry?.file_name().to_string_lossy().to_string();
            if let Some(seq) = sequence_of(&name) {
                this.next = this.next.max(seq + 1);
            }
            if name.starts_with(OPEN_PREFIX) && name.ends_with(".jsonl") {
                leftovers.push(dir.join(name));
            }
        }
        leftovers.sort();
        for path in leftovers {
            cut_after_last_line(&path)?;
            if std::fs::metadata(&path)?.len() == 0 {
                std::fs::remove_file(&path)?;
            } else {
                File::open(&path)?.sync_all()?;
                this.seal_file(&path)?;
            }
        }
        this.retain_or_warn();
        Ok(this)
    }

    /// Appends one JSON line, sealing the segment when it is full.
    pub fn append(&mut self, line: &str) -> io::Result<()> {
        let open = match self.open.take() {
            Some(open) => open,
            None => {
                let path = self.dir.join(format!("{OPEN_PREFIX}{:08}.jsonl", self.next));
                let file = OpenOptions::new().create_new(true).append(true).open(&path)?;
                Open { file, path, bytes: 0, opened: Instant::now() }
            }
        };
        let open = self.open.insert(open);
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\n');
        open.file.write_all(&bytes)?;
        open.bytes += bytes.len() as u64;
        if open.bytes >= self.rotation.max_bytes {
            self.seal()?;
        }
        Ok(())
    }

    /// Seals the open segment if it is older than the rotation's age, and holds the sealed ones to the retention
    /// once a minute (call it now and then).
    pub fn tick(&mut self) -> io::Result<()> {
        match &self.open {
            Some(open) if open.opened.elapsed() >= self.rotation.max_age => self.seal(),
            _ if self.retained.elapsed() >= RETENTION_EVERY => {
                self.retain_or_warn();
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Deletes the sealed segments past the retention, oldest first (one a reader removed meanwhile is passed over).
    fn retain(&mut self) -> io::Result<()> {
        self.retained = Instant::now();
        if self.retention == Retention::default() {
            return Ok(());
        }
        let now = std::time::SystemTime::now();
        let mut segments = Vec::new();
        for path in sealed(&self.dir)? {
            match std::fs::metadata(&path) {
                Ok(meta) => {
                    let age = meta.modified().ok().and_then(|m| now.duration_since(m).ok()).unwrap_or_default();
                    segments.push((path, meta.len(), age));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let sizes: Vec<(u64, Duration)> = segments.iter().map(|s| (s.1, s.2)).collect();
        for (path, _, _) in &segments[..self.retention.expired(&sizes)] {
            match std::fs::remove_file(path) {
                Ok(()) => self.retired += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Seals the open segment, if any: durable first, then visible.
    pub fn seal(&mut self) -> io::Result<()> {
        let Some(open) = self.open.take() else { return Ok(()) };
        open.file.sync_all()?;
        drop(open.file);
        self.seal_file(&open.path)
    }

    /// Makes the segment at `path`, already on disk, visible: renamed to its sealed name, the folder fsynced.
    fn seal_file(&mut self, path: &Path) -> io::Result<()> {
        let time = chrono::Utc::now().format("%Y%m%dT%H%M%SZ");
        let sealed = self.dir.join(format!("{SEALED_PREFIX}{time}-{:08}.jsonl", self.next));
        self.next += 1;
        std::fs::rename(path, &sealed)?;
        File::open(&self.dir)?.sync_all()?;
        self.retain_or_warn();
        Ok(())
    }

    /// [`Segments::retain`], its failure said and not passed on: a segment that could not be deleted (a reader
    /// removed it first, a permission) costs nothing recorded.
    fn retain_or_warn(&mut self) {
        if let Err(e) = self.retain() {
            tracing::warn!("the recording's retention could not delete old segments: {e}");
        }
    }
}

/// The segment number in a sealed or open segment's name.
fn sequence_of(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".jsonl")?;
    let digits = match stem.strip_prefix(OPEN_PREFIX) {
        Some(seq) => seq,
        None => stem.strip_prefix(SEALED_PREFIX)?.rsplit('-').next()?,
    };
    digits.parse().ok()
}

/// Truncates a file after its last newline (a torn last line is dropped).
fn cut_after_last_line(path: &Path) -> io::Result<()> {
    let bytes = std::fs::read(path)?;
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if keep < bytes.len() {
        OpenOptions::new().write(true).open(path)?.set_len(keep as u64)?;
    }
    Ok(())
}

/// The sealed segments of `dir`, oldest first.
pub fn sealed(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(SEALED_PREFIX) && n.ends_with(".jsonl"))
        })
        .collect();
    paths.sort_by_key(|p| p.file_name().and_then(|n| n.to_str()).and_then(sequence_of));
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(paths: &[PathBuf]) -> Vec<String> {
        paths
            .iter()
            .flat_map(|p| std::fs::read_to_string(p).unwrap().lines().map(String::from).collect::<Vec<_>>())
            .collect()
    }

    #[test]
    fn segments_are_sealed_by_size_age_and_stop_and_only_sealed_ones_are_visible() {
        let dir = tempfile::tempdir().unwrap();
        let rotation = Rotation { max_bytes: 20, max_age: Duration::from_millis(50) };
        let mut s = Segments::open(dir.path(), rotation, Retention::default()).unwrap();
        s.append(r#"{"a":1}"#).unwrap();
        assert!(sealed(dir.path()).unwrap().is_empty(), "nothing visible while open");
        s.append(r#"{"a":2}"#).unwrap();
        s.append(r#"{"a":3}"#).unwrap();
        assert_eq!(
            lines(&sealed(dir.path()).unwrap()),
            [r#"{"a":1}"#, r#"{"a":2}"#, r#"{"a":3}"#],
            "sealed at 20 bytes"
        );
        s.append(r#"{"a":4}"#).unwrap();
        s.tick().unwrap();
        assert_eq!(sealed(dir.path()).unwrap().len(), 1, "not yet old");
        std::thread::sleep(Duration::from_millis(60));
        s.tick().unwrap();
        assert_eq!(sealed(dir.path()).unwrap().len(), 2, "sealed by age");
        s.append(r#"{"a":5}"#).unwrap();
        s.seal().unwrap();
        let all = sealed(dir.path()).unwrap();
        assert_eq!(lines(&all).len(), 5);
        assert_eq!(all.len(), 3);
        let hidden = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'));
        assert_eq!(hidden.count(), 0, "no open segment after the seal");
    }

    /// The oldest segments go first, until the rest fit the size and none is past the age.
    #[test]
    fn retention_deletes_the_oldest_segments_past_either_bound() {
        let secs = Duration::from_secs;
        let segments = [(10, secs(500)), (10, secs(300)), (10, secs(100)), (10, secs(0))];
        let by_size = Retention { max_bytes: Some(25), max_age: None };
        assert_eq!(by_size.expired(&segments), 2);
        let by_age = Retention { max_bytes: None, max_age: Some(secs(200)) };
        assert_eq!(by_age.expired(&segments), 2);
        let both = Retention { max_bytes: Some(35), max_age: Some(secs(400)) };
        assert_eq!(both.expired(&segments), 1);
        assert_eq!(Retention::default().expired(&segments), 0);
        assert_eq!(Retention { max_bytes: Some(0), max_age: None }.expired(&segments), 4);
        // Through the folder: each seal keeps the newest two segments of 8 bytes.
        let dir = tempfile::tempdir().unwrap();
        let rotation = Rotation { max_bytes: 1, max_age: Duration::from_secs(3600) };
        let mut s = Segments::open(dir.path(), rotation, Retention { max_bytes: Some(16), max_age: None }).unwrap();
        for i in 0..5 {
            s.append(&format!(r#"{{"a":{i}}}"#)).unwrap();
        }
        assert_eq!(lines(&sealed(dir.path()).unwrap()), [r#"{"a":3}"#, r#"{"a":4}"#]);
        assert_eq!(s.retired, 3);
    }

    /// What a crashed proxy left open is sealed at the next start, without its torn last line, and numbering goes on.
    #[test]
    fn a_crashed_proxys_open_segment_is_sealed_whole_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let rotation = Rotation { max_bytes: 1 << 20, max_age: Duration::from_secs(3600) };
        let mut s = Segments::open(dir.path(), rotation, Retention::default()).unwrap();
        s.append(r#"{"a":1}"#).unwrap();
        s.seal().unwrap();
        s.append(r#"{"a":2}"#).unwrap();
        // The crash: the file stays open, half a line lands after the whole one.
        let open = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(".open-"))
            .unwrap();
        OpenOptions::new().append(true).open(open.path()).unwrap().write_all(br#"{"a":"#).unwrap();
        std::mem::forget(s);
        let mut again = Segments::open(dir.path(), rotation, Retention::default()).unwrap();
        assert_eq!(lines(&sealed(dir.path()).unwrap()), [r#"{"a":1}"#, r#"{"a":2}"#]);
        again.append(r#"{"a":3}"#).unwrap();
        again.seal().unwrap();
        let all = sealed(dir.path()).unwrap();
        assert_eq!(lines(&all), [r#"{"a":1}"#, r#"{"a":2}"#, r#"{"a":3}"#], "in order: {all:?}");
    }
}
