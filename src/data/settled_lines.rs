//! Outputs written one settled item a line (`regenerate`'s conversations, `synthesize`'s conversations and
//! rejections), so that an interrupted run loses at most the line it was writing and a rerun continues: appending
//! and flushing each line ([`SettledLines`]), reading back what is settled while dropping a torn last line
//! ([`read_settled`], streamed: memory does not grow with the file), putting the lines in a fixed order once a run
//! ends ([`rewrite_in_order`]), and showing how far a run is ([`Meter`]).
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{DataError, SampleId};

/// What [`rewrite_in_order`] does with lines of ids its order does not name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Others {
    /// After the others, in the order found.
    Keep,
    /// Left out.
    Drop,
}

/// The `id` of a JSON line, if it is one with an id.
fn line_id(line: &str) -> Option<SampleId> {
    let v: Value = serde_json::from_str(line.trim_end()).ok()?;
    SampleId::from_json(Some(v.get("id")?), 0).ok()
}

/// Calls `each` on every complete line of `path` (nothing if it does not exist), in order, until one it does not
/// accept (`false`) or one without its newline (a torn last line): `path` is cut there, with a warning, so appending
/// continues from a whole line.
pub fn read_settled(path: &Path, mut each: impl FnMut(&str) -> bool) -> Result<(), DataError> {
    let io = |err| DataError::Io { path: path.to_path_buf(), err };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    let total = file.metadata().map_err(io)?.len();
    let mut reader = std::io::BufReader::new(file);
    let (mut good, mut line) = (0u64, String::new());
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(io)?;
        if n == 0 || !line.ends_with('\n') || !each(&line) {
            break;
        }
        good += n as u64;
    }
    if good < total {
        tracing::warn!(path = %path.display(), "dropping an incomplete last line left by an interrupted run");
        let f = std::fs::OpenOptions::new().write(true).open(path).map_err(io)?;
        f.set_len(good).map_err(io)?;
    }
    Ok(())
}

/// Appends settled items to an output, one flushed line each.
pub struct SettledLines {
    path: PathBuf,
    file: std::fs::File,
}

impl SettledLines {
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
        Ok(SettledLines { path: path.to_path_buf(), file })
    }
    pub fn write(&mut self, line: &Value) -> Result<(), DataError> {
        let mut text = line.to_string();
        text.push('\n');
        self.file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|err| DataError::Io { path: self.path.clone(), err })
    }
}

/// How far the run is: conversations and tokens per second and the time left, as a bar or as log lines. The lines
/// come at their interval whether or not anything finished meanwhile (a thread of their own), and give a rate and
/// the time left only once something is done.
pub struct Meter {
    bar: indicatif::ProgressBar,
    counts: Arc<Counts>,
    ticker: Option<std::thread::JoinHandle<()>>,
    pub started: Instant,
}

/// What a [`Meter`] has counted, shared with its line thread.
struct Counts {
    doing: &'static str,
    total: u64,
    /// Settled by earlier runs (a resume): counted as done, not in the rate.
    earlier: AtomicU64,
    done: AtomicU64,
    tokens: AtomicU64,
    /// Lines logged so far.
    lines: AtomicU64,
    stop: (Mutex<bool>, Condvar),
}

impl Counts {
    fn line(&self, seconds: f64) -> String {
        let (earlier, done) = (self.earlier.load(Ordering::Relaxed), self.done.load(Ordering::Relaxed));
        progress_line(self.doing, earlier, done, self.total, self.tokens.load(Ordering::Relaxed), seconds)
    }
}

/// One progress line: `done` of `total` conversations (`earlier` of them settled before this run), `tokens`
/// generated in `seconds`.
fn progress_line(doing: &str, earlier: u64, done: u64, total: u64, tokens: u64, seconds: f64) -> String {
    let seconds = seconds.max(1e-9);
    let tokens_per_s = tokens as f64 / seconds;
    let here = done.saturating_sub(earlier);
    if here == 0 {
        return format!(
            "{doing}: {done}/{total} conversations, {tokens_per_s:.0} tokens/s; none finished yet in {seconds:.0} s"
        );
    }
    let rate = here as f64 / seconds;
    let left = total.saturating_sub(done) as f64 / rate;
    format!("{doing}: {done}/{total} conversations, {rate:.1}/s, {tokens_per_s:.0} tokens/s, about {left:.0} s left")
}

impl Meter {
    /// A meter of `total` conversations, for a run `doing` something ("answering").
    pub fn new(show: ShowProgress, doing: &'static str, total: u64) -> Self {
        let started = Instant::now();
        let counts = Arc::new(Counts {
            doing,
            total,
            earlier: AtomicU64::new(0),
            done: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            lines: AtomicU64::new(0),
            stop: (Mutex::new(false), Condvar::new()),
        });
        let (mut bar, mut ticker) = (indicatif::ProgressBar::hidden(), None);
        match show {
            ShowProgress::Bar => {
                bar = indicatif::ProgressBar::new(total);
                bar.set_style(
                    indicatif::ProgressStyle::with_template(&format!(
                        "{{spinner}} {doing} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} conversations, \
                         {{per_sec}}, {{msg}} (eta {{eta}})"
                    ))
                    .expect("valid template"),
                );
            }
            ShowProgress::Lines(every) => {
                let counts = counts.clone();
                ticker = Some(std::thread::spawn(move || {
                    let (stopped, wake) = &counts.stop;
                    let mut stop = stopped.lock().unwrap_or_else(|p| p.into_inner());
                    loop {
                        let (guard, _) = wake.wait_timeout(stop, every).unwrap_or_else(|p| p.into_inner());
                        stop = guard;
                        if *stop {
                            return;
                        }
                        tracing::info!("{}", counts.line(started.elapsed().as_secs_f64()));
                        counts.lines.fetch_add(1, Ordering::Relaxed);
                    }
                }));
            }
            ShowProgress::Off => {}
        }
        Meter { bar, counts, ticker, started }
    }

    /// `n` conversations were settled by earlier runs: done, but not in the rate.
    pub fn earlier(&mut self, n: u64) {
        self.counts.earlier.fetch_add(n, Ordering::Relaxed);
        self.counts.done.fetch_add(n, Ordering::Relaxed);
        self.bar.inc(n);
    }

    /// `done` conversations more are settled, and `tokens` more generated.
    pub fn add(&mut self, done: u64, tokens: u64) {
        self.counts.done.fetch_add(done, Ordering::Relaxed);
        let tokens = self.counts.tokens.fetch_add(tokens, Ordering::Relaxed) + tokens;
        if !self.bar.is_hidden() {
            let tokens_per_s = tokens as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
            self.bar.set_message(format!("{tokens_per_s:.0} tokens/s"));
            self.bar.inc(done);
        }
    }

    pub fn finish(&mut self) {
        self.bar.finish_and_clear();
        let (stopped, wake) = &self.counts.stop;
        *stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_all();
        if let Some(ticker) = self.ticker.take() {
            let _ = ticker.join();
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.finish();
    }
}

/// How a run says how far it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ShowProgress {
    /// A bar with conversations/s, tokens/s and the time left (a terminal).
    Bar,
    /// A log line this often (a pipe or file, the built-in data before training).
    Lines(Duration),
    Off,
}

/// Rewrites `out` with its lines in the order of `order` (the input's ids); lines of ids not in it follow, in the
/// order found, or are left out (`Others::Drop`). The lines are copied as they are, by their place in the file (only ids and offsets are held in
/// memory), into a temporary file that replaces `out` once complete: an interrupted rewrite leaves `out` as it was.
/// A file already in order is left alone.
pub fn rewrite_in_order(out: &Path, order: &[SampleId], others: Others) -> Result<(), DataError> {
    use std::os::unix::fs::FileExt;
    let io = |path: &Path, err| DataError::Io { path: path.to_path_buf(), err };
    let file = match std::fs::File::open(out) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(out, e)),
    };
    // Each line's id, where it starts and its length (newline included).
    let mut lines: Vec<(Option<SampleId>, u64, usize)> = Vec::new();
    let (mut reader, mut offset, mut text) = (std::io::BufReader::new(&file), 0u64, String::new());
    loop {
        text.clear();
        let n = reader.read_line(&mut text).map_err(|e| io(out, e))?;
        if n == 0 {
            break;
        }
        lines.push((line_id(&text), offset, n));
        offset += n as u64;
    }
    let rank: std::collections::HashMap<&SampleId, usize> = order.iter().enumerate().map(|(i, id)| (id, i)).collect();
    let place = |line: &(Option<SampleId>, u64, usize)| line.0.as_ref().and_then(|id| rank.get(id).copied());
    let mut sorted: Vec<usize> = (0..lines.len()).collect();
    // Stable: lines of unknown ids keep their order after the others.
    sorted.sort_by_key(|&i| place(&lines[i]).unwrap_or(usize::MAX));
    if others == Others::Drop {
        sorted.retain(|&i| place(&lines[i]).is_some());
    }
    if sorted.len() == lines.len() && sorted.iter().enumerate().all(|(at, &i)| at == i) {
        return Ok(());
    }
    let name = out.file_name().map_or("out".into(), |n| n.to_string_lossy().into_owned());
    let tmp = out.with_file_name(format!(".{name}.ordering"));
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?);
    let mut buf = Vec::new();
    for &i in &sorted {
        let (_, at, len) = lines[i];
        buf.resize(len, 0);
        file.read_exact_at(&mut buf, at).map_err(|e| io(out, e))?;
        if !buf.ends_with(b"\n") {
            buf.push(b'\n');
        }
        w.write_all(&buf).map_err(|e| io(&tmp, e))?;
    }
    let written = w.into_inner().map_err(|e| io(&tmp, e.into_error()))?;
    written.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, out).map_err(|e| io(out, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line gives a rate and the time left once something finished in this run, never an endless estimate before;
    /// conversations settled by an earlier run count as done but not in the rate.
    #[test]
    fn a_progress_line_gives_a_rate_only_once_something_is_done() {
        let line = progress_line("answering", 0, 0, 100, 5000, 10.0);
        assert_eq!(line, "answering: 0/100 conversations, 500 tokens/s; none finished yet in 10 s");
        let line = progress_line("answering", 0, 20, 100, 5000, 10.0);
        assert_eq!(line, "answering: 20/100 conversations, 2.0/s, 500 tokens/s, about 40 s left");
        let resumed = progress_line("synthesizing", 50, 50, 100, 0, 10.0);
        assert!(resumed.contains("50/100") && resumed.contains("none finished yet"), "{resumed}");
        let resumed = progress_line("synthesizing", 50, 60, 100, 800, 10.0);
        assert!(resumed.contains("1.0/s") && resumed.contains("about 40 s left"), "{resumed}");
    }

    /// Lines come at their interval while nothing finishes, and stop with the meter.
    #[test]
    fn progress_lines_come_while_nothing_finishes_and_stop_with_the_meter() {
        let mut meter = Meter::new(ShowProgress::Lines(Duration::from_millis(20)), "answering", 3);
        meter.add(0, 10);
        let waited = Instant::now();
        while meter.counts.lines.load(Ordering::Relaxed) < 2 {
            assert!(waited.elapsed() < Duration::from_secs(30), "no line while nothing finished");
            std::thread::sleep(Duration::from_millis(10));
        }
        meter.finish();
        assert!(meter.ticker.is_none(), "joined");
        let after = meter.counts.lines.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(meter.counts.lines.load(Ordering::Relaxed), after, "no line once finished");
    }
    use serde_json::json;

    #[test]
    fn the_output_is_put_in_the_input_order_lines_unknown_to_it_last() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let line = |id: Value| format!("{}\n", json!({"id": id, "messages": [{"role": "user", "content": "é"}]}));
        // Finished in another order than the input's, with a line of an id the input no longer has, and a last line
        // without its newline.
        let written = [line(json!("b")), line(json!(7)), line(json!("gone")), line(json!("a"))].concat();
        std::fs::write(&out, written.trim_end()).unwrap();
        let order = [SampleId::parse("a"), SampleId::Number(7), SampleId::parse("b"), SampleId::parse("never")];
        rewrite_in_order(&out, &order, Others::Keep).unwrap();
        let expected = [line(json!("a")), line(json!(7)), line(json!("b")), line(json!("gone"))].concat();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), expected);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
        // In order already: not rewritten.
        let before = std::fs::metadata(&out).unwrap().modified().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        rewrite_in_order(&out, &order, Others::Keep).unwrap();
        assert_eq!(std::fs::metadata(&out).unwrap().modified().unwrap(), before);
        // Lines of ids not in the order left out.
        rewrite_in_order(&out, &order[..2], Others::Drop).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), [line(json!("a")), line(json!(7))].concat());
        // No output yet: nothing to do.
        rewrite_in_order(&dir.path().join("none.jsonl"), &order, Others::Keep).unwrap();
    }

    /// Lines are read up to a torn or unaccepted one, and the file is cut there.
    #[test]
    fn reading_back_stops_at_a_torn_line_and_cuts_the_file_there() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        std::fs::write(&out, "{\"id\": 1}\n{\"id\": 2}\n{\"id\": 3").unwrap();
        let mut seen = Vec::new();
        read_settled(&out, |l| {
            seen.push(l.trim_end().to_string());
            true
        })
        .unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "{\"id\": 1}\n{\"id\": 2}\n");
        read_settled(&out, |l| l.contains('1')).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "{\"id\": 1}\n");
        read_settled(&dir.path().join("none"), |_| true).unwrap();
    }
}
