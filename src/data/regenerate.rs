//! `dflash regenerate`: replaces every assistant turn with the target's own response, turn by turn (each turn sees
//! the regenerated turns before it), from an OpenAI-compatible chat-completions server (vLLM, SGLang) with bounded
//! concurrency and retries, or from the built-in target (`--local`).
//!
//! Resumable: output lines are appended and flushed one conversation at a time, each carrying its input id; a rerun
//! skips ids already written (a torn last line from an interrupted run is dropped first). Conversations that fail
//! after all retries are not written, so a rerun retries them.
use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::chat::{ChatError, Conversation};
use super::sample_id::FirstUse;
use super::{DataError, SampleId};

#[derive(Debug, Clone)]
pub struct RegenerateOptions {
    pub input: PathBuf,
    pub out: PathBuf,
    pub max_tokens: u32,
    pub temperature: f64,
    pub template_kwargs: Map<String, Value>,
    pub progress: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct RegenerateReport {
    pub conversations: u64,
    /// Already in the output from an earlier run.
    pub already_done: u64,
    pub regenerated: u64,
    /// Failed after all retries (not written; a rerun retries them).
    pub failed: u64,
    /// Input lines that are not conversations (skipped).
    pub bad_lines: u64,
    pub examples: Vec<String>,
}

/// An assistant reply: its content and, when the model reasons separately, the reasoning.
pub type Reply = (String, Option<String>);

/// A source of assistant responses.
pub trait Responder {
    /// The assistant's reply to `messages`.
    fn respond(&mut self, messages: &[Value], tools: Option<&Value>) -> Result<Reply, String>;
}

/// Reads the ids already written to `out`, dropping a torn last line left by an interrupted run.
fn resume_point(out: &Path) -> Result<HashSet<SampleId>, DataError> {
    let io = |err| DataError::Io { path: out.to_path_buf(), err };
    let mut done = HashSet::new();
    if !out.exists() {
        return Ok(done);
    }
    let text = std::fs::read_to_string(out).map_err(io)?;
    let mut good_len = 0;
    for line in text.split_inclusive('\n') {
        let complete = line.ends_with('\n');
        let id = serde_json::from_str::<Value>(line.trim_end())
            .ok()
            .and_then(|v| v.get("id").and_then(|id| SampleId::from_json(Some(id), 0).ok()));
        match (complete, id) {
            (true, Some(id)) => {
                done.insert(id);
                good_len += line.len();
            }
            _ => break,
        }
    }
    if good_len < text.len() {
        tracing::warn!(path = %out.display(), "dropping an incomplete last line left by an interrupted run");
        let f = std::fs::OpenOptions::new().write(true).open(out).map_err(io)?;
        f.set_len(good_len as u64).map_err(io)?;
    }
    Ok(done)
}

/// The conversations of `input` still to do, and the report so far.
fn pending(opts: &RegenerateOptions) -> Result<(Vec<Conversation>, RegenerateReport), DataError> {
    let done = resume_point(&opts.out)?;
    let file = std::fs::File::open(&opts.input).map_err(|err| DataError::Io { path: opts.input.clone(), err })?;
    let mut report = RegenerateReport::default();
    let mut todo = Vec::new();
    let mut seen = FirstUse::default();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|err| DataError::Io { path: opts.input.clone(), err })?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = Conversation::from_json_line(&line, n as u64).and_then(|conv| {
            seen.record(&conv.id, || format!("line {}", n + 1)).map_err(ChatError::Shape)?;
            Ok(conv)
        });
        match parsed {
            Ok(conv) => {
                report.conversations += 1;
                if done.contains(&conv.id) {
                    report.already_done += 1;
                } else {
                    todo.push(conv);
                }
            }
            Err(e) => {
                report.bad_lines += 1;
                if report.examples.len() < 10 {
                    report.examples.push(format!("{}:{}: {e}", opts.input.display(), n + 1));
                }
            }
        }
    }
    Ok((todo, report))
}

/// Puts a reply into an assistant message (the tool calls of the old reply go with it).
fn apply_reply(message: &mut Value, content: String, reasoning: Option<String>) {
    let msg = message.as_object_mut().expect("messages are objects");
    msg.insert("content".into(), json!(content));
    msg.remove("tool_calls");
    match reasoning {
        Some(r) => msg.insert("reasoning_content".into(), json!(r)),
        None => msg.remove("reasoning_content"),
    };
}

/// The output line of a regenerated conversation.
fn output_line(conv: &Conversation, messages: Vec<Value>) -> Value {
    let mut out = json!({"id": conv.id.to_json(), "messages": messages});
    if let Some(tools) = &conv.tools {
        out["tools"] = tools.clone();
    }
    out
}

/// Replaces each assistant turn of `conv` in order, each reply seeing the regenerated turns before it.
fn regenerate_one(
    conv: &Conversation,
    respond: &mut dyn FnMut(&[Value]) -> Result<Reply, String>,
) -> Result<Value, String> {
    let mut messages = conv.messages.clone();
    for i in conv.assistant_turns() {
        let (content, reasoning) = respond(&messages[..i])?;
        apply_reply(&mut messages[i], content, reasoning);
    }
    Ok(output_line(conv, messages))
}

/// Appends finished conversations to the output, one flushed line each.
struct OutputLines {
    path: PathBuf,
    file: std::fs::File,
}

impl OutputLines {
    fn open(path: &Path) -> Result<Self, DataError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
        Ok(OutputLines { path: path.to_path_buf(), file })
    }
    fn write(&mut self, line: &Value) -> Result<(), DataError> {
        let mut text = line.to_string();
        text.push('\n');
        self.file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|err| DataError::Io { path: self.path.clone(), err })
    }
}

fn progress_bar(show: bool, len: u64) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} regenerating [{elapsed_precise}] {wide_bar} {pos}/{len} conversations (eta {eta})",
        )
        .expect("valid template"),
    );
    bar
}

fn record_failure(report: &mut RegenerateReport, id: &SampleId, e: &str) {
    report.failed += 1;
    if report.examples.len() < 10 {
        report.examples.push(format!("id {id}: {e}"));
    }
}

/// Regenerates with an in-process responder (the built-in target), one conversation at a time.
pub fn regenerate_with(opts: &RegenerateOptions, responder: &mut dyn Responder) -> Result<RegenerateReport, DataError> {
    let (todo, mut report) = pending(opts)?;
    let mut out = OutputLines::open(&opts.out)?;
    let bar = progress_bar(opts.progress, todo.len() as u64);
    for conv in &todo {
        let tools = conv.tools.clone();
        let result = regenerate_one(conv, &mut |m| responder.respond(m, tools.as_ref()));
        match result {
            Ok(line) => {
                out.write(&line)?;
                report.regenerated += 1;
            }
            Err(e) => record_failure(&mut report, &conv.id, &e),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(report)
}

/// An OpenAI-compatible chat-completions server.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Base URL, e.g. `http://localhost:8000/v1` (`/chat/completions` is appended).
    pub url: String,
    pub model: String,
    pub api_key: Option<String>,
    pub concurrency: usize,
    /// Attempts per request after the first, with exponential backoff.
    pub retries: u32,
    pub timeout: Duration,
}

impl Endpoint {
    fn completions_url(&self) -> String {
        let base = self.url.trim_end_matches('/');
        if base.ends_with("/chat/completions") { base.to_string() } else { format!("{base}/chat/completions") }
    }
}

/// One chat completion with retries: connection errors, 429 and 5xx are retried with backoff.
async fn complete(client: &reqwest::Client, endpoint: &Endpoint, body: &Value) -> Result<Reply, String> {
    let mut delay = Duration::from_millis(200);
    let mut last = String::new();
    for attempt in 0..=endpoint.retries {
        if attempt > 0 {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(10));
        }
        let mut request = client.post(endpoint.completions_url()).json(body).timeout(endpoint.timeout);
        if let Some(key) = &endpoint.api_key {
            request = request.bearer_auth(key);
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                last = format!("request failed: {e}");
                continue;
            }
        };
        let status = response.status();
        if status.is_success() {
            let v: Value = response.json().await.map_err(|e| format!("response is not JSON: {e}"))?;
            let message = &v["choices"][0]["message"];
            let content = message["content"]
                .as_str()
                .ok_or_else(|| format!("response has no choices[0].message.content: {v}"))?;
            let reasoning = message["reasoning_content"].as_str().map(str::to_string);
            return Ok((content.to_string(), reasoning));
        }
        let text = response.text().await.unwrap_or_default();
        last = format!("HTTP {status}: {}", text.chars().take(200).collect::<String>());
        if !(status.is_server_error() || status.as_u16() == 429) {
            break; // the request itself is wrong; retrying will not help
        }
    }
    Err(last)
}

/// Regenerates through `endpoint`, `endpoint.concurrency` conversations at a time.
pub async fn regenerate_endpoint(opts: &RegenerateOptions, endpoint: &Endpoint) -> Result<RegenerateReport, DataError> {
    let (todo, report) = pending(opts)?;
    let client = reqwest::Client::new();
    let out = Arc::new(Mutex::new(OutputLines::open(&opts.out)?));
    let report = Arc::new(Mutex::new(report));
    let bar = progress_bar(opts.progress, todo.len() as u64);
    let results = futures::stream::iter(todo.into_iter().map(|conv| {
        let (client, endpoint, out, report, bar) = (&client, endpoint, out.clone(), report.clone(), bar.clone());
        async move {
            let mut messages = conv.messages.clone();
            let mut failure = None;
            for i in conv.assistant_turns() {
                let mut body = json!({
                    "model": endpoint.model,
                    "messages": &messages[..i],
                    "max_tokens": opts.max_tokens,
                    "temperature": opts.temperature,
                });
                if let Some(tools) = &conv.tools {
                    body["tools"] = tools.clone();
                }
                if !opts.template_kwargs.is_empty() {
                    body["chat_template_kwargs"] = Value::Object(opts.template_kwargs.clone());
                }
                match complete(client, endpoint, &body).await {
                    Ok((content, reasoning)) => apply_reply(&mut messages[i], content, reasoning),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            let written = match failure {
                Some(e) => {
                    record_failure(&mut report.lock().expect("report lock"), &conv.id, &e);
                    Ok(())
                }
                None => {
                    let w = out.lock().expect("output lock").write(&output_line(&conv, messages));
                    if w.is_ok() {
                        report.lock().expect("report lock").regenerated += 1;
                    }
                    w
                }
            };
            bar.inc(1);
            written
        }
    }))
    .buffer_unordered(endpoint.concurrency.max(1))
    .collect::<Vec<_>>()
    .await;
    bar.finish_and_clear();
    results.into_iter().collect::<Result<Vec<()>, DataError>>()?;
    let report = report.lock().expect("report lock").clone();
    Ok(report)
}

impl RegenerateReport {
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} conversations: {} regenerated now, {} already done, {} failed, {} bad lines",
            self.conversations, self.regenerated, self.already_done, self.failed, self.bad_lines
        );
        for e in &self.examples {
            s.push_str(&format!("\n  {e}"));
        }
        if self.failed > 0 {
            s.push_str("\n  run the same command again to retry the failed conversations");
        }
        s
    }
}
