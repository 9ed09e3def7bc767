//! Prepared samples on disk, memory-mapped for reading. A prepared folder holds, per split (`train`, `holdout`),
//! shards of four files: `<split>-NNNNN.tokens` (u32 little-endian token ids), `.mask` (one byte per token),
//! `.index` (per sample: id key, first token, token count as u64 little-endian) and `.ids` (per sample, one line:
//! the id as the data gave it, in JSON), and `manifest.json`, written last, which lists every file with its size
//! and SHA-256. A folder without a manifest is not a finished output.
//!
//! Format 1 (before string ids) had no `.ids` file: its ids are the integer keys. It is still read.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::sample::Sample;
use super::{DataError, SampleId};

pub const FORMAT: &str = "dflash-prepared/2";
/// The format before string ids: shards without `.ids` files.
pub const FORMAT_1: &str = "dflash-prepared/1";
/// Tokens per shard (256 MiB of token ids).
pub const SHARD_TOKENS: usize = 1 << 26;
pub const SPLITS: [&str; 2] = ["train", "holdout"];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub samples: u64,
    pub tokens: u64,
    pub files: Vec<FileEntry>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitEntry {
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub shards: Vec<ShardEntry>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |err| DataError::Io { path: path.to_path_buf(), err }
}

/// SHA-256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String, DataError> {
    let mut file = File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io_err(path))?;
    Ok(hex(&hasher.finalize()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file being written, hashed on the way.
struct HashedFile {
    path: PathBuf,
    file: String,
    writer: BufWriter<File>,
    hasher: Sha256,
    bytes: u64,
}

impl HashedFile {
    fn create(dir: &Path, file: String) -> Result<Self, DataError> {
        let path = dir.join(&file);
        let f = File::create(&path).map_err(io_err(&path))?;
        Ok(HashedFile { path, file, writer: BufWriter::with_capacity(1 << 20, f), hasher: Sha256::new(), bytes: 0 })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), DataError> {
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        self.writer.write_all(bytes).map_err(io_err(&self.path))
    }

    /// Flushes and syncs the file.
    fn finish(self) -> Result<FileEntry, DataError> {
        let path = self.path;
        let f = self.writer.into_inner().map_err(|e| DataError::Io { path: path.clone(), err: e.into_error() })?;
        f.sync_all().map_err(io_err(&path))?;
        Ok(FileEntry { file: self.file, bytes: self.bytes, sha256: hex(&self.hasher.finalize()) })
    }
}

/// The files of the shard being written.
struct OpenShard {
    tokens: HashedFile,
    mask: HashedFile,
    index: HashedFile,
    ids: HashedFile,
    samples: u64,
    tokens_written: u64,
}

/// Writes the samples of one split as they come, starting a new shard every [`SHARD_TOKENS`] tokens.
pub struct SplitWriter {
    dir: PathBuf,
    split: String,
    current: Option<OpenShard>,
    entry: SplitEntry,
}

impl SplitWriter {
    pub fn new(dir: &Path, split: &str) -> Self {
        SplitWriter { dir: dir.to_path_buf(), split: split.to_string(), current: None, entry: SplitEntry::default() }
    }

    pub fn push(&mut self, sample: &Sample) -> Result<(), DataError> {
        let full = self
            .current
            .as_ref()
            .is_some_and(|c| c.tokens_written > 0 && c.tokens_written as usize + sample.input_ids.len() > SHARD_TOKENS);
        if full {
            self.close_shard()?;
        }
        if self.current.is_none() {
            let name = format!("{}-{:05}", self.split, self.entry.shards.len());
            self.current = Some(OpenShard {
                tokens: HashedFile::create(&self.dir, format!("{name}.tokens"))?,
                mask: HashedFile::create(&self.dir, format!("{name}.mask"))?,
                index: HashedFile::create(&self.dir, format!("{name}.index"))?,
                ids: HashedFile::create(&self.dir, format!("{name}.ids"))?,
                samples: 0,
                tokens_written: 0,
            });
        }
        let shard = self.current.as_mut().expect("opened above");
        let mut record = [0u8; 24];
        record[..8].copy_from_slice(&sample.id.key().to_le_bytes());
        record[8..16].copy_from_slice(&shard.tokens_written.to_le_bytes());
        record[16..].copy_from_slice(&(sample.input_ids.len() as u64).to_le_bytes());
        shard.index.write(&record)?;
        let bytes: Vec<u8> = sample.input_ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        shard.tokens.write(&bytes)?;
        shard.mask.write(&sample.loss_mask)?;
        shard.ids.write(format!("{}\n", sample.id.to_json()).as_bytes())?;
        shard.samples += 1;
        shard.tokens_written += sample.input_ids.len() as u64;
        self.entry.samples += 1;
        self.entry.tokens += sample.input_ids.len() as u64;
        self.entry.supervised_tokens += sample.supervised() as u64;
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), DataError> {
        if let Some(s) = self.current.take() {
            self.entry.shards.push(ShardEntry {
                samples: s.samples,
                tokens: s.tokens_written,
                files: vec![s.tokens.finish()?, s.mask.finish()?, s.index.finish()?, s.ids.finish()?],
            });
        }
        Ok(())
    }

    /// Closes the last shard and returns what the manifest records.
    pub fn finish(mut self) -> Result<SplitEntry, DataError> {
        self.close_shard()?;
        Ok(self.entry)
    }
}

/// One memory-mapped shard.
struct MappedShard {
    /// The tokens file's name, for messages.
    tokens_file: String,
    tokens: Mmap,
    mask: Mmap,
    /// (id key, first token, token count)
    index: Vec<(u64, u64, u64)>,
    /// The ids as given, by row.
    ids: Vec<SampleId>,
}

/// A borrowed sample of a prepared split.
#[derive(Debug, Clone, Copy)]
pub struct SampleRef<'a> {
    pub id: &'a SampleId,
    tokens: &'a [u8],
    pub loss_mask: &'a [u8],
}

impl SampleRef<'_> {
    pub fn len(&self) -> usize {
        self.loss_mask.len()
    }
    pub fn is_empty(&self) -> bool {
        self.loss_mask.is_empty()
    }
    pub fn input_ids(&self) -> Vec<i64> {
        self.tokens.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect()
    }
}

/// One split of a prepared folder, memory-mapped.
pub struct PreparedSplit {
    shards: Vec<MappedShard>,
    /// (shard, row in shard) of each sample, in file order.
    rows: Vec<(usize, usize)>,
}

impl PreparedSplit {
    /// Opens `split` of the prepared folder `dir`, checking each file's size against the manifest (`verify`: and
    /// its SHA-256).
    pub fn open(dir: &Path, split: &str, verify: bool) -> Result<Self, DataError> {
        let manifest = Manifest::read(dir)?;
        let entry = manifest.splits.get(split).ok_or_else(|| DataError::File {
            path: dir.join("manifest.json"),
            reason: format!("no split {split:?} (the folder has {:?})", manifest.splits.keys().collect::<Vec<_>>()),
        })?;
        let mut shards = Vec::new();
        let mut rows = Vec::new();
        for shard in &entry.shards {
            let mut maps = Vec::new();
            for f in &shard.files {
                let path = dir.join(&f.file);
                let file = File::open(&path).map_err(io_err(&path))?;
                let len = file.metadata().map_err(io_err(&path))?.len();
                if len != f.bytes {
                    return Err(DataError::File {
                        path,
                        reason: format!(
                            "{len} bytes, the manifest says {}: the folder is damaged; prepare again",
                            f.bytes
                        ),
                    });
                }
                if verify && file_sha256(&path)? != f.sha256 {
                    return Err(DataError::File {
                        path,
                        reason: "checksum differs from the manifest: the folder is damaged; prepare again".into(),
                    });
                }
                // SAFETY: prepared folders are written once and never modified in place.
                maps.push(unsafe { Mmap::map(&file) }.map_err(io_err(&path))?);
            }
            let bad_shard = || DataError::File {
                path: dir.join("manifest.json"),
                reason: format!("a shard of {} must list its tokens, mask, index and ids files", manifest.format),
            };
            let ids_file = match manifest.format.as_str() {
                FORMAT_1 => None,
                _ => Some((dir.join(&shard.files.get(3).ok_or_else(bad_shard)?.file), maps.pop().expect("listed"))),
            };
            let [tokens, mask, index]: [Mmap; 3] = maps.try_into().map_err(|_| bad_shard())?;
            let index: Vec<(u64, u64, u64)> = index
                .chunks_exact(24)
                .map(|c| {
                    let u = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
                    (u(0), u(8), u(16))
                })
                .collect();
            let ids = match ids_file {
                Some((path, text)) => read_ids(&path, &text, &index)?,
                None => index.iter().map(|&(key, _, _)| SampleId::Number(key)).collect(),
            };
            rows.extend((0..index.len()).map(|r| (shards.len(), r)));
            shards.push(MappedShard { tokens_file: shard.files[0].file.clone(), tokens, mask, index, ids });
        }
        Ok(PreparedSplit { shards, rows })
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Sample `i` in file order.
    pub fn get(&self, i: usize) -> SampleRef<'_> {
        let (s, r) = self.rows[i];
        let shard = &self.shards[s];
        let (_, start, len) = shard.index[r];
        let (start, len) = (start as usize, len as usize);
        SampleRef {
            id: &shard.ids[r],
            tokens: &shard.tokens[start * 4..(start + len) * 4],
            loss_mask: &shard.mask[start..start + len],
        }
    }

    /// The id of sample `i` in file order.
    pub fn id(&self, i: usize) -> &SampleId {
        let (s, r) = self.rows[i];
        &self.shards[s].ids[r]
    }

    /// Token counts of all samples, in file order (for length bucketing).
    pub fn lengths(&self) -> Vec<usize> {
        self.rows.iter().map(|&(s, r)| self.shards[s].index[r].2 as usize).collect()
    }

    /// Checks that every sample fits the target: token ids below `vocab_size`, at most `max_positions` tokens. The
    /// error names the shard file and the sample (data prepared for another model is the usual cause). Reads every
    /// token once, at memory speed.
    pub fn check_fits(&self, dir: &Path, vocab_size: usize, max_positions: usize) -> Result<(), DataError> {
        for (i, &(s, r)) in self.rows.iter().enumerate() {
            let shard = &self.shards[s];
            let (_, _, len) = shard.index[r];
            let id = &shard.ids[r];
            let bad = |reason: String| DataError::File {
                path: dir.join(&shard.tokens_file),
                reason: format!("sample id {id} (number {i} of the split): {reason}"),
            };
            if len as usize > max_positions {
                return Err(bad(format!(
                    "{len} tokens, more than the target's {max_positions} positions; prepare the data again with \
                     --max-len {max_positions} or less"
                )));
            }
            if let Some(t) = self.get(i).input_ids().into_iter().find(|&t| t as usize >= vocab_size) {
                return Err(bad(format!(
                    "token id {t} is outside the target's vocabulary (0..{vocab_size}): the data was prepared for \
                     another model; prepare it again with this target (dflash prepare --model <the target>)"
                )));
            }
        }
        Ok(())
    }

    /// The position of the sample with this id.
    pub fn position_of(&self, id: &SampleId) -> Option<usize> {
        self.rows.iter().position(|&(s, r)| &self.shards[s].ids[r] == id)
    }
}

/// The ids of a shard's `.ids` file, checked against the keys of its index.
fn read_ids(path: &Path, text: &[u8], index: &[(u64, u64, u64)]) -> Result<Vec<SampleId>, DataError> {
    let damaged = |reason: String| DataError::File {
        path: path.to_path_buf(),
        reason: format!("{reason}: the folder is damaged; prepare again"),
    };
    let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    if lines.len() != index.len() {
        return Err(damaged(format!("{} ids for {} samples", lines.len(), index.len())));
    }
    lines
        .iter()
        .zip(index)
        .enumerate()
        .map(|(row, (line, &(key, _, _)))| {
            let id: SampleId = serde_json::from_slice(line).map_err(|e| damaged(format!("line {}: {e}", row + 1)))?;
            if id.key() != key {
                return Err(damaged(format!("line {}: id {id} does not match the index", row + 1)));
            }
            Ok(id)
        })
        .collect()
}

/// The path of the manifest of a prepared folder.
pub fn manifest_path(dir: &Path) -> PathBuf {
    dir.join("manifest.json")
}

/// What a run did, kept in the manifest and printed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PrepareReport {
    /// Conversations read (lines but blank ones): kept, dropped or bad.
    pub lines: u64,
    /// Conversations kept (each one sample, or with `--long split` several).
    #[serde(default)]
    pub kept_lines: u64,
    /// Blank lines, skipped.
    #[serde(default)]
    pub blank: u64,
    pub kept_train: u64,
    pub kept_holdout: u64,
    /// Samples dropped, by reason.
    pub dropped: BTreeMap<String, u64>,
    /// Lines that could not be used, by kind of problem.
    pub bad_lines: BTreeMap<String, u64>,
    /// The first few bad lines, `file:line: problem`.
    pub examples: Vec<String>,
    pub truncated: u64,
    /// Conversations longer than `max_len` cut into pieces (`--long split`), each piece counted as kept.
    #[serde(default)]
    pub split: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub seconds: f64,
    pub conversations_per_s: f64,
    pub tokens_per_s: f64,
    /// Thread-seconds spent rendering templates and locating assistant spans, and tokenizing: where the work is.
    pub render_thread_s: f64,
    pub tokenize_thread_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputEntry {
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// `manifest.json` of a prepared folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub fingerprint: String,
    /// The model whose tokenizer and template were used.
    pub model: String,
    /// The hash of that tokenizer and template (`ModelAssets::identity`): a run refuses data whose tokenizer is not
    /// its target's. Absent for token rows and for folders of dflash before 2026-12-06.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    pub settings: Value,
    pub inputs: Vec<InputEntry>,
    pub splits: BTreeMap<String, SplitEntry>,
    pub report: PrepareReport,
}

impl Manifest {
    pub fn read(dir: &Path) -> Result<Self, DataError> {
        let path = manifest_path(dir);
        let text = std::fs::read_to_string(&path).map_err(|_| DataError::File {
            path: dir.to_path_buf(),
            reason: "no manifest.json: not a prepared folder (or an unfinished one); run `dflash prepare`".into(),
        })?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| DataError::File { path: path.clone(), reason: format!("not a dflash manifest: {e}") })?;
        if m.format != FORMAT && m.format != FORMAT_1 {
            return Err(DataError::File {
                path,
                reason: format!(
                    "format {:?}; this build reads {FORMAT:?} and {FORMAT_1:?}: prepare the data again",
                    m.format
                ),
            });
        }
        Ok(m)
    }
}

impl PrepareReport {
    /// A few lines for people.
    pub fn summary(&self) -> String {
        let bad: u64 = self.bad_lines.values().sum();
        // Every conversation read is kept, dropped or bad (`dropped` also counts pieces of kept ones).
        let whole_lines_dropped = self.lines.saturating_sub(self.kept_lines + bad);
        let blank = if self.blank > 0 { format!(" ({} blank lines skipped)", self.blank) } else { String::new() };
        let mut s = format!(
            "{} conversations read{blank}: {} kept, {whole_lines_dropped} dropped, {bad} bad; {} samples for \
             training, {} held out; {} tokens ({} supervised), {} truncated, {} split; {:.1} s ({:.0} conversations/s, \
             {:.0} tokens/s)",
            self.lines,
            self.kept_lines,
            self.kept_train,
            self.kept_holdout,
            self.tokens,
            self.supervised_tokens,
            self.truncated,
            self.split,
            self.seconds,
            self.conversations_per_s,
            self.tokens_per_s
        );
        for (reason, n) in &self.dropped {
            s.push_str(&format!("\n  dropped {n}: {reason}"));
        }
        for (kind, n) in &self.bad_lines {
            s.push_str(&format!("\n  skipped {n} bad lines: {kind}"));
        }
        for e in &self.examples {
            s.push_str(&format!("\n    {e}"));
        }
        s
    }
}
