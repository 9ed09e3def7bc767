//! The stream a long run learns from (issue 69, `data.stream`): a folder the recording proxy seals its segments into,
//! or where anyone drops chat JSONL whole (written elsewhere, then renamed in). New files are taken in waves: the
//! qualifying conversations of every file not taken before are copied into `wave-N.jsonl` and prepared with the
//! target's template into `wave-N/` (its held-out split the stream's recent traffic, never trained on), and only then
//! is the wave written to the log (`waves.jsonl`, fsynced). A wave the log does not list is unfinished work a kill
//! left: it is removed and made again, so every file is taken once, in one wave, across kills and restarts.
use std::collections::{BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::dataset::Dataset;
use super::prepare::{ModelAssets, PrepareOptions, prepare};
use super::{DataError, SampleId, TokenRow};

/// The log of waves, in the stream's own folder under the run's.
pub const LOG: &str = "waves.jsonl";

/// Which recorded answers a run learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answers {
    /// Only answers the target made greedily (what a drafter serving greedy decoding must predict).
    Greedy,
    /// Every answer, sampled ones too.
    All,
}

/// Whether a recorded line's answer was made greedily: its request asked for temperature 0 or a top-k of 1. A request
/// that names neither was sampled (an OpenAI-compatible server's default temperature is 1, or the model's
/// generation_config's). A line without the proxy's `recorded` block is the user's own data, taken as given.
pub fn made_greedily(line: &Value) -> bool {
    let Some(recorded) = line.get("recorded") else { return true };
    let settings = &recorded["settings"];
    settings["temperature"].as_f64() == Some(0.0) || settings["top_k"].as_i64() == Some(1)
}

/// A file a wave took, as it was then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakenFile {
    pub name: String,
    pub bytes: u64,
}

/// One wave of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wave {
    /// 1, 2, ...
    pub number: u64,
    pub files: Vec<TakenFile>,
    /// Conversations copied into the wave.
    pub conversations: usize,
    /// Recorded answers left out because they were sampled (with [`Answers::Greedy`]).
    pub sampled: usize,
    /// Lines that were not JSON objects (a file dropped half written is counted here, then never read again).
    pub unreadable: usize,
}

/// How waves are made.
#[derive(Debug, Clone)]
pub struct WaveSettings {
    pub answers: Answers,
    /// A wave is made once the new files hold at least this many qualifying conversations,
    pub min_conversations: usize,
    /// or once the oldest of them has waited this long with at least one (`None`: no bound).
    pub max_wait: Option<Duration>,
    /// How each wave is prepared (`inputs` and `out` are the wave's own).
    pub prepare: PrepareOptions,
}

/// See the module documentation.
pub struct Stream {
    /// Where the files arrive.
    source: PathBuf,
    /// The stream's folder under the run's: the log, the waves.
    root: PathBuf,
    waves: Vec<Wave>,
    /// What the last look found short of a wave.
    pending: Pending,
    /// What each new file held at the last look, by name: a file of the same size and modification time, counted for
    /// the same answers, is not read again.
    counted: HashMap<String, Counted>,
    /// How many times a look read a file to count what it holds.
    files_counted: u64,
}

/// What a new file held when a look counted it for `answers`, and the size and modification time it had then.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Counted {
    bytes: u64,
    modified: Option<SystemTime>,
    answers: Answers,
    lines: LineCounts,
}

/// A file's lines for a wave: the conversations that qualify, sampled answers left out, lines that are not JSON objects.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LineCounts {
    conversations: usize,
    sampled: usize,
    unreadable: usize,
}

/// What a look at the stream found short of a wave: the new conversations that qualify, and how long the oldest file
/// holding one has waited.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pending {
    pub conversations: usize,
    pub oldest_wait: Duration,
}

impl Pending {
    /// How long until these conversations make a wave by having waited (`max_wait`): `None` where none wait or
    /// there is no bound (then only more conversations make the wave).
    pub fn due_in(&self, settings: &WaveSettings) -> Option<Duration> {
        match self.conversations {
            0 => None,
            _ => settings.max_wait.map(|m| m.saturating_sub(self.oldest_wait)),
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |err| DataError::Io { path: path.to_path_buf(), err }
}

impl Stream {
    /// The stream from `source` kept in `root`: its log read, and anything a kill left unfinished removed.
    pub fn open(source: &Path, root: &Path) -> Result<Stream, DataError> {
        std::fs::create_dir_all(root).map_err(io(root))?;
        let (waves, unended) = read_log(root)?;
        if unended {
            // Rewrite without the partial line, so the next append starts a line of its own.
            let whole: String = waves.iter().map(|w| format!("{}\n", json_line(w))).collect();
            write_synced(&root.join(LOG), whole.as_bytes())?;
        }
        let stream = Stream {
            source: source.to_path_buf(),
            root: root.to_path_buf(),
            waves,
            pending: Pending::default(),
            counted: HashMap::new(),
            files_counted: 0,
        };
        stream.remove_unfinished()?;
        Ok(stream)
    }

    /// The waves made so far, oldest first.
    pub fn waves(&self) -> &[Wave] {
        &self.waves
    }

    /// What the last [`Stream::next_wave`] found short of a wave (nothing, where it made one).
    pub fn pending(&self) -> Pending {
        self.pending
    }

    /// How many times [`Stream::next_wave`] read a file to count what it holds (a file unchanged since the last look
    /// is not read again; a wave reads its files once more to copy them).
    pub fn files_counted(&self) -> u64 {
        self.files_counted
    }

    /// The prepared folder of wave `number`.
    pub fn wave_dir(&self, number: u64) -> PathBuf {
        wave_dir(&self.root, number)
    }

    fn wave_input(&self, number: u64) -> PathBuf {
        self.root.join(format!("wave-{number:05}.jsonl"))
    }

    /// Removes the files of waves the log does not list (a kill between making a wave and logging it).
    fn remove_unfinished(&self) -> Result<(), DataError> {
        let logged: BTreeSet<u64> = self.waves.iter().map(|w| w.number).collect();
        for entry in std::fs::read_dir(&self.root).map_err(io(&self.root))?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let number = name
                .strip_prefix("wave-")
                .map(|r| r.trim_end_matches(".jsonl").trim_end_matches(".partial"))
                .and_then(|r| r.parse::<u64>().ok());
            if number.is_some_and(|n| !logged.contains(&n)) {
                let path = entry.path();
                let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                removed.map_err(io(&path))?;
            }
        }
        Ok(())
    }

    /// The files in the source folder no wave has taken, in name order: visible `*.jsonl` files (the proxy's sealed
    /// segments among them; its open ones are hidden).
    pub fn new_files(&self) -> Result<Vec<PathBuf>, DataError> {
        let taken: BTreeSet<&str> = self.waves.iter().flat_map(|w| w.files.iter().map(|f| f.name.as_str())).collect();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.source)
            .map_err(io(&self.source))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                !name.starts_with('.') && name.ends_with(".jsonl") && p.is_file() && !taken.contains(name.as_str())
            })
            .collect();
        files.sort();
        Ok(files)
    }

    /// Makes the next wave from the new files once it is due ([`wave_is_due`]; `None` until then): copies their
    /// qualifying conversations into the wave's JSONL, prepares it, then logs the wave. A look reads only the files
    /// that are new or changed since the last; the wave reads its files once more, writing as it reads, so neither
    /// holds a backlog's conversations in memory.
    pub fn next_wave(&mut self, assets: &ModelAssets, settings: &WaveSettings) -> Result<Option<Wave>, DataError> {
        self.pending = Pending::default();
        let files = self.new_files()?;
        let names: BTreeSet<String> = files.iter().map(|p| file_name(p)).collect();
        self.counted.retain(|name, _| names.contains(name));
        if files.is_empty() {
            return Ok(None);
        }
        let (mut conversations, mut oldest_wait) = (0, Duration::ZERO);
        for path in &files {
            let meta = std::fs::metadata(path).map_err(io(path))?;
            let (name, modified) = (file_name(path), meta.modified().ok());
            let counted = match self.counted.get(&name) {
                Some(c) if (c.bytes, c.modified, c.answers) == (meta.len(), modified, settings.answers) => c.lines,
                _ => {
                    self.files_counted += 1;
                    let file = File::open(path).map_err(io(path))?;
                    let lines = read_lines(file, path, settings.answers, |_| Ok(()))?;
                    let answers = settings.answers;
                    self.counted.insert(name, Counted { bytes: meta.len(), modified, answers, lines });
                    lines
                }
            };
            if counted.conversations > 0 {
                // Only conversations wait: a file of sampled answers alone does not hurry the wave. A sealed
                // segment's time is its seal's (renaming keeps it); a file from the future has waited nothing.
                let waited = modified.and_then(|t| SystemTime::now().duration_since(t).ok());
                oldest_wait = oldest_wait.max(waited.unwrap_or_default());
            }
            conversations += counted.conversations;
        }
        if !wave_is_due(conversations, oldest_wait, settings) {
            self.pending = Pending { conversations, oldest_wait };
            return Ok(None);
        }
        let number = self.waves.last().map_or(1, |w| w.number + 1);
        let mut wave = Wave { number, files: Vec::new(), conversations: 0, sampled: 0, unreadable: 0 };
        let input = self.wave_input(number);
        let tmp = input.with_extension("partial");
        let mut out = BufWriter::new(File::create(&tmp).map_err(io(&tmp))?);
        for path in &files {
            let file = File::open(path).map_err(io(path))?;
            let bytes = file.metadata().map_err(io(path))?.len();
            let lines = read_lines(file, path, settings.answers, |line| writeln!(out, "{line}").map_err(io(&tmp)))?;
            wave.conversations += lines.conversations;
            wave.sampled += lines.sampled;
            wave.unreadable += lines.unreadable;
            wave.files.push(TakenFile { name: file_name(path), bytes });
        }
        let file = out.into_inner().map_err(|e| DataError::Io { path: tmp.clone(), err: e.into_error() })?;
        if wave.conversations == 0 {
            // The files changed between the look and the copy (none of theirs qualifies now): no wave yet.
            drop(file);
            std::fs::remove_file(&tmp).map_err(io(&tmp))?;
            return Ok(None);
        }
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &input).map_err(io(&input))?;
        let opts = PrepareOptions { inputs: vec![input], out: self.wave_dir(number), ..settings.prepare.clone() };
        prepare(assets, &opts)?;
        let log = self.root.join(LOG);
        let mut f = OpenOptions::new().create(true).append(true).open(&log).map_err(io(&log))?;
        f.write_all(format!("{}\n", json_line(&wave)).as_bytes()).and_then(|()| f.sync_all()).map_err(io(&log))?;
        self.waves.push(wave.clone());
        Ok(Some(wave))
    }
}

/// Whether the new files make a wave now: `conversations` qualify, the oldest file holding one has waited
/// `oldest_wait`. Enough conversations make it at once; fewer make it once they have waited `max_wait`, so a quiet
/// stream's traffic is still learned; none never do.
pub fn wave_is_due(conversations: usize, oldest_wait: Duration, settings: &WaveSettings) -> bool {
    conversations > 0
        && (conversations >= settings.min_conversations || settings.max_wait.is_some_and(|m| oldest_wait >= m))
}

/// A wave that trains nothing (its split could not be read).
pub struct NoSamples;

impl Dataset for NoSamples {
    fn len(&self) -> usize {
        0
    }
    fn lengths(&self) -> Vec<usize> {
        Vec::new()
    }
    fn row(&self, position: usize) -> TokenRow {
        unreachable!("an empty wave has no sample {position}")
    }
    fn id(&self, position: usize) -> SampleId {
        unreachable!("an empty wave has no sample {position}")
    }
}

/// The samples a stream's run trains from: the base data (`data.path`) and each wave's train split after it, in wave
/// order. Positions only grow: a wave is added before the schedule hears of it, so every position handed out is
/// there.
pub struct StreamData {
    parts: RwLock<Vec<Part>>,
}

struct Part {
    start: usize,
    data: Arc<dyn Dataset>,
}

impl StreamData {
    pub fn new(base: Arc<dyn Dataset>) -> Self {
        StreamData { parts: RwLock::new(vec![Part { start: 0, data: base }]) }
    }

    /// Adds a wave's samples after every one there; returns their positions.
    pub fn push(&self, wave: Arc<dyn Dataset>) -> std::ops::Range<usize> {
        let mut parts = self.parts.write().unwrap_or_else(|p| p.into_inner());
        let start = parts.last().map_or(0, |p| p.start + p.data.len());
        let range = start..start + wave.len();
        parts.push(Part { start, data: wave });
        range
    }

    /// The part holding `position`, and the position within it.
    fn locate<T>(&self, position: usize, f: impl FnOnce(&dyn Dataset, usize) -> T) -> T {
        let parts = self.parts.read().unwrap_or_else(|p| p.into_inner());
        let i = parts.partition_point(|p| p.start <= position).saturating_sub(1);
        f(parts[i].data.as_ref(), position - parts[i].start)
    }
}

impl Dataset for StreamData {
    fn len(&self) -> usize {
        let parts = self.parts.read().unwrap_or_else(|p| p.into_inner());
        parts.last().map_or(0, |p| p.start + p.data.len())
    }
    fn lengths(&self) -> Vec<usize> {
        let parts = self.parts.read().unwrap_or_else(|p| p.into_inner());
        parts.iter().flat_map(|p| p.data.lengths()).collect()
    }
    fn row(&self, position: usize) -> TokenRow {
        self.locate(position, |d, p| d.row(p))
    }
    fn id(&self, position: usize) -> SampleId {
        self.locate(position, |d, p| d.id(p))
    }
}

/// The waves the log in the stream folder `root` lists, oldest first (none before the first). Only whole lines count:
/// a kill while appending leaves at most a part of the last one. Reads only: another thread may be making the next.
pub fn logged_waves(root: &Path) -> Result<Vec<Wave>, DataError> {
    read_log(root).map(|(waves, _)| waves)
}

/// [`logged_waves`], and whether the log's last line is unended (a kill while appending).
fn read_log(root: &Path) -> Result<(Vec<Wave>, bool), DataError> {
    let log = root.join(LOG);
    let text = match std::fs::read_to_string(&log) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), false)),
        Err(err) => return Err(DataError::Io { path: log, err }),
    };
    let mut waves = Vec::new();
    let lines = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        match serde_json::from_str::<Wave>(line) {
            Ok(w) => waves.push(w),
            Err(_) if i + 1 == lines && !text.ends_with('\n') => {}
            Err(e) => return Err(DataError::Line { path: log, line: i + 1, reason: format!("not a wave: {e}") }),
        }
    }
    Ok((waves, !text.is_empty() && !text.ends_with('\n')))
}

/// The prepared folder of wave `number` in the stream folder `root`.
pub fn wave_dir(root: &Path, number: u64) -> PathBuf {
    root.join(format!("wave-{number:05}"))
}

fn json_line(w: &Wave) -> String {
    serde_json::to_string(w).expect("a wave serializes")
}

/// A path's file name, as the log records it.
fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Reads `file` (at `path`) for a wave: each conversation that qualifies (`answers`) goes to `keep` as one JSON line,
/// named by its file and line where it has no id (the proxy's lines: unique in the stream, where a line number alone
/// would repeat from file to file); sampled answers and lines that are not JSON objects are counted.
fn read_lines(
    file: File,
    path: &Path,
    answers: Answers,
    mut keep: impl FnMut(String) -> Result<(), DataError>,
) -> Result<LineCounts, DataError> {
    let name = file_name(path);
    let mut counts = LineCounts::default();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io(path))?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(&line) {
            Ok(mut v) if v.is_object() => match answers == Answers::All || made_greedily(&v) {
                true => {
                    if v.get("id").is_none_or(Value::is_null) {
                        v["id"] = Value::String(format!("{name}#{i}"));
                    }
                    keep(v.to_string())?;
                    counts.conversations += 1;
                }
                false => counts.sampled += 1,
            },
            _ => counts.unreadable += 1,
        }
    }
    Ok(counts)
}

/// Writes `bytes` to `path` through a temporary file, fsynced, then renamed.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let tmp = path.with_extension("partial");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prepare::LongConversations;
    use crate::data::shards::PreparedSplit;
    use serde_json::json;

    fn line(content: &str, temperature: Option<f64>) -> String {
        let mut v = json!({"messages": [
            {"role": "user", "content": content}, {"role": "assistant", "content": format!("answer to {content}")}]});
        if let Some(t) = temperature {
            v["recorded"] = json!({"settings": {"model": "m", "temperature": t}});
        }
        v.to_string()
    }

    fn settings(dir: &Path, min_conversations: usize) -> WaveSettings {
        WaveSettings {
            answers: Answers::Greedy,
            min_conversations,
            max_wait: None,
            prepare: PrepareOptions {
                inputs: vec![],
                out: dir.join("unused"),
                max_len: 256,
                long: LongConversations::Truncate,
                block_size: 4,
                holdout: 0.0,
                seed: 0,
                template_kwargs: Default::default(),
                strict: false,
                progress: false,
                force: false,
            },
        }
    }

    /// Positions run on from the base data through each wave, and each finds its own sample.
    #[test]
    fn stream_data_runs_on_through_the_waves() {
        use crate::data::dataset::{SyntheticData, SyntheticLengths};
        let part = |n, seed| Arc::new(SyntheticData::new(n, 8, SyntheticLengths::Full, 50, seed)) as Arc<dyn Dataset>;
        let (base, wave) = (part(3, 1), part(2, 2));
        let data = StreamData::new(base.clone());
        assert_eq!(data.push(Arc::new(NoSamples)), 3..3, "an empty wave takes no position");
        assert_eq!(data.push(wave.clone()), 3..5);
        assert_eq!(data.len(), 5);
        assert_eq!(data.lengths().len(), 5);
        assert_eq!(data.row(2).input_ids, base.row(2).input_ids);
        assert_eq!(data.row(3).input_ids, wave.row(0).input_ids);
        assert_eq!(data.id(4), wave.id(1));
    }

    /// A test's folder, with an empty source folder (`traffic`) and the stream's root under a run's folder.
    fn folders() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let (source, root) = (dir.path().join("traffic"), dir.path().join("run/stream"));
        std::fs::create_dir_all(&source).unwrap();
        (dir, source, root)
    }

    #[test]
    fn only_an_answer_asked_greedily_counts_as_greedy() {
        let greedy = |settings: Value| made_greedily(&json!({"messages": [], "recorded": {"settings": settings}}));
        assert!(greedy(json!({"temperature": 0})));
        assert!(greedy(json!({"temperature": 0.7, "top_k": 1})));
        assert!(!greedy(json!({"temperature": 0.7})));
        assert!(!greedy(json!({"model": "m"})), "no temperature: the server's default samples");
        assert!(made_greedily(&json!({"messages": []})), "the user's own data is taken as given");
    }

    /// Files are taken once, in name order, after the minimum; sampled answers and unreadable lines are counted and
    /// left out; hidden (open) segments wait; a reopened stream knows what it took.
    #[test]
    fn waves_take_each_new_file_once() {
        let (dir, source, root) = folders();
        let assets = ModelAssets::tiny(&Default::default());
        let s = settings(dir.path(), 3);
        let mut stream = Stream::open(&source, &root).unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "nothing yet");
        let a = [line("one", Some(0.0)), line("two", Some(1.0)), "{not json".into(), line("three", Some(0.0))];
        std::fs::write(source.join("segment-a.jsonl"), a.join("\n")).unwrap();
        std::fs::write(source.join(".open-b.jsonl"), line("hidden", Some(0.0))).unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "two greedy conversations, three wanted");
        assert_eq!(stream.pending().conversations, 2);
        assert_eq!(stream.pending().due_in(&s), None, "no bound: only a third conversation makes the wave");
        std::fs::write(source.join("mine.jsonl"), line("four", None)).unwrap();
        let wave = stream.next_wave(&assets, &s).unwrap().expect("three now");
        assert_eq!(stream.pending(), Pending::default(), "a wave leaves nothing pending");
        assert_eq!((wave.number, wave.conversations, wave.sampled, wave.unreadable), (1, 3, 1, 1));
        let names: Vec<&str> = wave.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["mine.jsonl", "segment-a.jsonl"]);
        let split = PreparedSplit::open(&stream.wave_dir(1), "train", true).unwrap();
        assert_eq!(split.len(), 3);
        let ids: Vec<String> = (0..3).map(|p| split.id(p).to_json().as_str().unwrap().to_string()).collect();
        assert_eq!(ids, ["mine.jsonl#0", "segment-a.jsonl#0", "segment-a.jsonl#3"], "named by file and line");
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "nothing new");
        let reopened = Stream::open(&source, &root).unwrap();
        assert_eq!(reopened.waves(), [wave]);
        assert!(reopened.new_files().unwrap().is_empty());
    }

    /// A look reads only the files that are new or changed since the last one; the wave reads its files once more
    /// and takes them as they are then.
    #[test]
    fn a_look_reads_only_new_or_changed_files() {
        let (dir, source, root) = folders();
        let assets = ModelAssets::tiny(&Default::default());
        let s = settings(dir.path(), 3);
        let mut stream = Stream::open(&source, &root).unwrap();
        std::fs::write(source.join("segment-a.jsonl"), line("one", Some(0.0)) + "\n").unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None);
        assert_eq!((stream.pending().conversations, stream.files_counted()), (1, 1));
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None);
        assert_eq!((stream.pending().conversations, stream.files_counted()), (1, 1), "nothing changed, nothing read");
        let all = WaveSettings { answers: Answers::All, ..s.clone() };
        assert_eq!(stream.next_wave(&assets, &all).unwrap(), None);
        assert_eq!(stream.files_counted(), 2, "counted again for other answers");
        std::fs::write(source.join("segment-b.jsonl"), line("two", Some(0.0))).unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None);
        assert_eq!((stream.pending().conversations, stream.files_counted()), (2, 4), "the new file, and a for greedy");
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None);
        assert_eq!(stream.files_counted(), 4, "only new or changed files are read");
        let mut grown = OpenOptions::new().append(true).open(source.join("segment-a.jsonl")).unwrap();
        grown.write_all(line("three", Some(0.0)).as_bytes()).unwrap();
        let wave = stream.next_wave(&assets, &s).unwrap().expect("three now: the grown file read again");
        assert_eq!((wave.conversations, stream.files_counted()), (3, 5));
        let size = |name: &str| std::fs::metadata(source.join(name)).unwrap().len();
        let taken: Vec<(&str, u64)> = wave.files.iter().map(|f| (f.name.as_str(), f.bytes)).collect();
        assert_eq!(taken, [("segment-a.jsonl", size("segment-a.jsonl")), ("segment-b.jsonl", size("segment-b.jsonl"))]);
        let copied = std::fs::read_to_string(root.join("wave-00001.jsonl")).unwrap();
        assert_eq!(copied.lines().count(), 3);
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "nothing new");
        assert_eq!(stream.files_counted(), 5, "taken files are not looked at again");
    }

    #[test]
    fn fewer_conversations_than_the_minimum_wait_at_most_max_wait() {
        let mut s = settings(Path::new("unused"), 10);
        let minute = Duration::from_secs(60);
        assert!(!wave_is_due(9, 10 * minute, &s), "no bound: the minimum alone");
        assert!(wave_is_due(10, Duration::ZERO, &s), "the minimum makes a wave at once");
        s.max_wait = Some(5 * minute);
        assert!(!wave_is_due(9, 4 * minute, &s));
        assert!(wave_is_due(9, 5 * minute, &s), "waited long enough");
        assert!(wave_is_due(1, 6 * minute, &s));
        assert!(!wave_is_due(0, 60 * minute, &s), "nothing to train makes no wave");
        let pending = |conversations, minutes| Pending { conversations, oldest_wait: minutes * minute };
        assert_eq!(pending(9, 2).due_in(&s), Some(3 * minute));
        assert_eq!(pending(9, 7).due_in(&s), Some(Duration::ZERO), "overdue: the next look makes it");
        assert_eq!(pending(0, 7).due_in(&s), None, "nothing waits");
    }

    /// The wait is the oldest new file's that holds a qualifying conversation: its modification time (a sealed
    /// segment's seal) against the clock.
    #[test]
    fn conversations_that_waited_past_max_wait_make_a_wave_below_the_minimum() {
        let (dir, source, root) = folders();
        let assets = ModelAssets::tiny(&Default::default());
        let mut s = settings(dir.path(), 3);
        s.max_wait = Some(Duration::from_secs(600));
        let mut stream = Stream::open(&source, &root).unwrap();
        std::fs::write(source.join("segment-1.jsonl"), line("fresh", Some(0.0))).unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "one conversation, just sealed");
        let due = stream.pending().due_in(&s).expect("one conversation waits for the bound");
        assert!(due > Duration::from_secs(590) && due <= Duration::from_secs(600), "{due:?}");
        std::fs::write(source.join("segment-0.jsonl"), line("sampled long ago", Some(1.0))).unwrap();
        let sampled = File::options().write(true).open(source.join("segment-0.jsonl")).unwrap();
        sampled.set_modified(SystemTime::now() - Duration::from_secs(3600)).unwrap();
        assert_eq!(stream.next_wave(&assets, &s).unwrap(), None, "a file of sampled answers alone does not count");
        let old = SystemTime::now() - Duration::from_secs(601);
        File::options().write(true).open(source.join("segment-1.jsonl")).unwrap().set_modified(old).unwrap();
        std::fs::write(source.join("segment-2.jsonl"), line("fresh too", Some(0.0))).unwrap();
        let wave = stream.next_wave(&assets, &s).unwrap().expect("the first file waited past 600 s");
        assert_eq!((wave.conversations, wave.files.len()), (2, 3), "every new file goes with it");
    }

    /// A kill after a wave was prepared but before it was logged (or halfway through the log's line): the reopened
    /// stream removes the unlogged wave and makes it again from the same files, once.
    #[test]
    fn a_wave_a_kill_left_unlogged_is_made_again() {
        let (dir, source, root) = folders();
        let assets = ModelAssets::tiny(&Default::default());
        let s = settings(dir.path(), 1);
        std::fs::write(source.join("segment-1.jsonl"), line("first", Some(0.0))).unwrap();
        let mut stream = Stream::open(&source, &root).unwrap();
        let first = stream.next_wave(&assets, &s).unwrap().unwrap();
        std::fs::write(source.join("segment-2.jsonl"), line("second", Some(0.0))).unwrap();
        stream.next_wave(&assets, &s).unwrap().unwrap();
        // The kill: wave 2 is on disk, its log line only half written.
        let log = root.join(LOG);
        let text = std::fs::read_to_string(&log).unwrap();
        let cut = text.trim_end().rfind('\n').unwrap() + 1 + 10;
        std::fs::write(&log, &text[..cut]).unwrap();
        let mut stream = Stream::open(&source, &root).unwrap();
        assert_eq!(stream.waves(), std::slice::from_ref(&first));
        assert!(!stream.wave_dir(2).exists(), "the unlogged wave is removed");
        let again = stream.next_wave(&assets, &s).unwrap().unwrap();
        assert_eq!((again.number, again.files[0].name.as_str()), (2, "segment-2.jsonl"));
        let reopened = Stream::open(&source, &root).unwrap();
        assert_eq!(reopened.waves().len(), 2);
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 2, "one line a wave");
    }
}
