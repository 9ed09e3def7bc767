//! Publishing the drafter as it improves (`[publish]`), so a serving stack loads a better one without a person in the
//! loop: an evaluation that decodes losslessly and beats the published drafter by `publish.margin` tokens per target
//! step is exported (bf16, the published DFlash format) to `publish.dir/vN`, and `publish.dir/current`, a symbolic
//! link, flips to it in one rename: a reader sees the old version or the new one, never a half-written folder. The
//! newest `publish.keep` versions stay (the current one always). Each version holds `publication.json`: its version,
//! step, acceptance and why it was published. The evaluator publishes; `POST /publish` publishes the run's best
//! checkpoint at once; a lock keeps the two apart. A candidate is weighed against the published drafter decoded on the
//! same prompts ([`Baseline`], the evaluator decodes it once a version), not against the number it was published at,
//! which other prompts may have given.
use std::path::Path;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use crate::config::PublishSettings;
use crate::model::Drafter;
use crate::train::checkpoint::DRAFTER_DIR;

/// The link to the version a serving stack loads, in `publish.dir`.
pub const CURRENT: &str = "current";
/// What a version is, in its folder.
pub const PUBLICATION_FILE: &str = "publication.json";

/// One published version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Publication {
    pub version: u64,
    /// The training step of its checkpoint.
    pub step: u64,
    /// Its decoded acceptance length when it was published, and on how many prompts.
    pub decode_acceptance_length: f64,
    pub prompts: usize,
    pub why: String,
    /// Seconds since the Unix epoch.
    pub published_at: f64,
}

/// What publishing reads of an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub step: u64,
    /// Tokens kept per target step by real speculative decoding, on `prompts` prompts.
    pub decode_acceptance_length: f64,
    pub prompts: usize,
    /// Whether every prompt decoded as greedy decoding does.
    pub lossless: bool,
}

/// The published drafter decoded on an evaluation's prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub version: u64,
    pub decode_acceptance_length: f64,
}

/// Whether an evaluated checkpoint replaces the published drafter, and why (or why not).
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Publish(String),
    Hold(String),
}

/// The decision: a lossless evaluation that beats the published drafter by `margin` (or finds none published). The
/// published drafter counts as `baseline` decoded it on the evaluation's prompts when that is its version, else as
/// it was published.
pub fn verdict(e: &Measured, published: Option<&Publication>, baseline: Option<&Baseline>, margin: f64) -> Verdict {
    let a = e.decode_acceptance_length;
    if !e.lossless {
        return Verdict::Hold(format!("step {}: speculative decoding was not lossless", e.step));
    }
    let Some(p) = published else {
        return Verdict::Publish(format!("step {} decoded {a:.3} tokens per target step; none was published", e.step));
    };
    let (theirs, measured) = match baseline.filter(|b| b.version == p.version) {
        Some(b) => (b.decode_acceptance_length, "on the same prompts"),
        None => (p.decode_acceptance_length, "when published"),
    };
    match a >= theirs + margin {
        true => Verdict::Publish(format!(
            "step {} decoded {a:.3} tokens per target step, v{} {theirs:.3} {measured} (publish.margin {margin})",
            e.step, p.version
        )),
        false => Verdict::Hold(format!(
            "step {} decoded {a:.3}, under v{}'s {theirs:.3} {measured} + publish.margin {margin}",
            e.step, p.version
        )),
    }
}

/// One publisher at a time in this process (the evaluator's thread and `POST /publish`).
static PUBLISHING: Mutex<()> = Mutex::new(());

/// The version `dir/current` points at, if any.
pub fn current(dir: &Path) -> Result<Option<Publication>> {
    let path = dir.join(CURRENT).join(PUBLICATION_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| format!("{}", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The versions in `dir`, oldest first.
fn versions(dir: &Path) -> Result<Vec<u64>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let name = entry?.file_name();
        if let Some(n) = name.to_str().and_then(|n| n.strip_prefix('v')).and_then(|n| n.parse().ok()) {
            found.push(n);
        }
    }
    found.sort_unstable();
    Ok(found)
}

/// Publishes the drafter of `checkpoint` (a checkpoint folder, `measured` so; the published drafter on the same
/// prompts as `baseline`) as the next version of `settings.dir` when `verdict` says so, or `forced`; returns the
/// publication, or why it was held back.
pub fn publish(
    settings: &PublishSettings,
    checkpoint: &Path,
    measured: &Measured,
    baseline: Option<&Baseline>,
    forced: Option<&str>,
) -> Result<std::result::Result<Publication, String>> {
    let Some(dir) = &settings.dir else { bail!("publish.dir is not set: nothing is published") };
    let _one = PUBLISHING.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(dir).with_context(|| format!("publish.dir {}", dir.display()))?;
    let why = match (forced, verdict(measured, current(dir)?.as_ref(), baseline, settings.margin)) {
        (Some(why), _) => why.to_string(),
        (None, Verdict::Publish(why)) => why,
        (None, Verdict::Hold(why)) => return Ok(Err(why)),
    };
    let version = versions(dir)?.last().map_or(1, |v| v + 1);
    let publication = Publication {
        version,
        step: measured.step,
        decode_acceptance_length: measured.decode_acceptance_length,
        prompts: measured.prompts,
        why,
        published_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    };
    let staged = dir.join(format!(".v{version}.tmp"));
    let _ = std::fs::remove_dir_all(&staged);
    if let Err(e) = stage(checkpoint, &staged, &publication) {
        let _ = std::fs::remove_dir_all(&staged);
        return Err(e);
    }
    let folder = dir.join(format!("v{version}"));
    std::fs::rename(&staged, &folder).with_context(|| format!("moving {} into place", folder.display()))?;
    flip_current(dir, &format!("v{version}"))?;
    retire(dir, settings.keep, version);
    Ok(Ok(publication))
}

/// The version's folder written aside: the drafter of `checkpoint` exported and `publication.json`, every file on disk
/// before the folder is renamed into place.
fn stage(checkpoint: &Path, staged: &Path, publication: &Publication) -> Result<()> {
    let exported = crate::panic::catch_torch(|| {
        Drafter::load(&checkpoint.join(DRAFTER_DIR), Device::Cpu, Kind::Float)?.save(staged, Kind::BFloat16)
    });
    exported
        .map_err(|e| anyhow::anyhow!("{e}"))
        .and_then(|saved| Ok(saved?))
        .with_context(|| format!("exporting the drafter of {}", checkpoint.display()))?;
    std::fs::write(staged.join(PUBLICATION_FILE), serde_json::to_vec_pretty(publication)?)?;
    for entry in std::fs::read_dir(staged)? {
        sync(&entry?.path())?;
    }
    sync(staged)
}

/// Points `dir/current` at `name` in one rename (a reader sees the old link or the new one).
fn flip_current(dir: &Path, name: &str) -> Result<()> {
    let link = dir.join(format!(".{CURRENT}.tmp"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(name, &link).with_context(|| format!("linking {}", link.display()))?;
    std::fs::rename(&link, dir.join(CURRENT)).with_context(|| format!("flipping {}", dir.join(CURRENT).display()))?;
    sync(dir)
}

/// Removes the oldest versions beyond `keep`, never `current`; one that cannot be removed costs a warning.
fn retire(dir: &Path, keep: usize, current: u64) {
    let Ok(all) = versions(dir) else { return };
    let old = all.len().saturating_sub(keep);
    for v in all.into_iter().take(old).filter(|&v| v != current) {
        let path = dir.join(format!("v{v}"));
        if let Err(e) = std::fs::remove_dir_all(&path) {
            tracing::warn!(path = %path.display(), "cannot remove an old published version: {e}");
        }
    }
}

/// Puts a file's contents, or a folder's entries, on disk.
fn sync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn lossless(step: u64, decode_acceptance_length: f64) -> Measured {
        Measured { step, decode_acceptance_length, prompts: 8, lossless: true }
    }

    fn publication(version: u64, acceptance: f64) -> Publication {
        Publication {
            version,
            step: 10,
            decode_acceptance_length: acceptance,
            prompts: 8,
            why: String::new(),
            published_at: 0.0,
        }
    }

    #[test]
    fn a_drafter_is_published_only_lossless_and_by_the_margin() {
        let e = lossless(40, 2.5);
        assert!(matches!(verdict(&e, None, None, 0.05), Verdict::Publish(_)));
        assert!(matches!(verdict(&e, Some(&publication(1, 2.46)), None, 0.05), Verdict::Hold(_)));
        let Verdict::Publish(why) = verdict(&e, Some(&publication(1, 2.45)), None, 0.05) else { panic!("held") };
        assert!(why.contains("v1 2.450 when published"), "{why}");
        let lossy = Measured { lossless: false, ..e.clone() };
        let Verdict::Hold(why) = verdict(&lossy, None, None, 0.0) else { panic!("published") };
        assert!(why.contains("not lossless"), "{why}");
        // Decoded on these prompts, v1 does better than it was published at: that is the bar.
        let v1_now = Baseline { version: 1, decode_acceptance_length: 2.47 };
        let Verdict::Hold(why) = verdict(&e, Some(&publication(1, 2.45)), Some(&v1_now), 0.05) else { panic!() };
        assert!(why.contains("v1's 2.470 on the same prompts"), "{why}");
        // A baseline of another version says nothing of the published one.
        let v0 = Baseline { version: 0, decode_acceptance_length: 3.0 };
        assert!(matches!(verdict(&e, Some(&publication(1, 2.45)), Some(&v0), 0.05), Verdict::Publish(_)));
    }

    fn settings(dir: &Path, keep: usize) -> PublishSettings {
        PublishSettings { dir: Some(dir.to_path_buf()), keep, margin: 0.05 }
    }

    /// A checkpoint folder holding a tiny drafter, as the evaluator stages one.
    fn checkpoint(root: &Path) -> PathBuf {
        let dir = root.join("ckpt");
        let cfg = crate::model::DrafterConfig::for_preset(crate::model::Preset::Tiny, 2);
        let drafter = Drafter::new(cfg, Device::Cpu, Kind::Float, crate::model::Init::Portable(1)).unwrap();
        drafter.save(&dir.join(DRAFTER_DIR), Kind::Float).unwrap();
        dir
    }

    #[test]
    fn versions_flip_current_and_the_oldest_go() {
        let root = tempfile::tempdir().unwrap();
        let (ckpt, out) = (checkpoint(root.path()), root.path().join("published"));
        let s = settings(&out, 2);
        for (n, acceptance) in [2.0, 2.1, 2.12, 2.3].into_iter().enumerate() {
            let e = lossless(10 * n as u64, acceptance);
            let outcome = publish(&s, &ckpt, &e, None, None).unwrap();
            // 2.12 is under 2.1 + 0.05: held back, and nothing changes.
            assert_eq!(outcome.is_ok(), acceptance != 2.12, "{outcome:?}");
        }
        let now = current(&out).unwrap().unwrap();
        assert_eq!((now.version, now.step, now.decode_acceptance_length), (3, 30, 2.3));
        assert_eq!(std::fs::read_link(out.join(CURRENT)).unwrap(), PathBuf::from("v3"));
        assert_eq!(versions(&out).unwrap(), [2, 3]);
        // The version is a drafter a serving stack loads, in bf16.
        let loaded = Drafter::load(&out.join(CURRENT), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(loaded.config().block_size, 2);
        // Forced: published whatever the margin says.
        let forced = publish(&s, &ckpt, &lossless(50, 1.0), None, Some("forced")).unwrap().unwrap();
        assert_eq!((forced.version, forced.why.as_str()), (4, "forced"));
        assert_eq!(versions(&out).unwrap(), [3, 4]);
        assert!(out.read_dir().unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with('.')));
    }

    /// An export that fails publishes nothing and leaves nothing behind: `current` stays where it was.
    #[test]
    fn a_failed_export_leaves_the_published_version_alone() {
        let root = tempfile::tempdir().unwrap();
        let (ckpt, out) = (checkpoint(root.path()), root.path().join("published"));
        let s = settings(&out, 3);
        publish(&s, &ckpt, &lossless(10, 2.0), None, None).unwrap().unwrap();
        let missing = root.path().join("no-such-checkpoint");
        let err = publish(&s, &missing, &lossless(20, 3.0), None, None).unwrap_err();
        assert!(format!("{err:#}").contains("no-such-checkpoint"), "{err:#}");
        assert_eq!(current(&out).unwrap().unwrap().version, 1);
        let names: Vec<String> =
            out.read_dir().unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn publishing_without_a_dir_says_what_to_set() {
        let root = tempfile::tempdir().unwrap();
        let off = PublishSettings { dir: None, keep: 3, margin: 0.0 };
        let err = publish(&off, root.path(), &lossless(1, 2.0), None, None).unwrap_err().to_string();
        assert!(err.contains("publish.dir"), "{err}");
    }
}
