//! `dflash regenerate`: gives every conversation the target's own replies, turn by turn (each reply sees the
//! regenerated turns before it): every assistant turn after the first user turn is replaced, and a conversation that
//! ends with a user (or tool) turn, a prompt, gets the reply it asks for. The replies come from an OpenAI-compatible
//! chat-completions server (vLLM, SGLang, llama.cpp), checked once before the run, with bounded concurrency and
//! retries, or from the built-in target (`--local`). Sampled replies are seeded per conversation id and turn, so an
//! answer never depends on what else ran beside it.
//!
//! Resumable: output lines are appended and flushed one conversation at a time, each carrying its input id; a rerun
//! skips ids already written (a torn last line from an interrupted run is dropped first). Conversations that fail
//! after all retries are not written, so a rerun retries them. A line whose reply was cut at the token limit says at
//! which (`cut_at_max_tokens`), and a rerun with a higher `--max-tokens` does it again.
//!
//! Replies finish in whatever order the source returns them, so when a run ends the output is rewritten in the
//! input's order ([`rewrite_in_order`]): the same input gives the same file, whatever the timing, and `prepare` (whose
//! sample positions, and so the training order, follow the file) the same data.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::chat::{ChatError, Conversation};
use super::sample_id::FirstUse;
pub use super::settled_lines::ShowProgress;
use super::settled_lines::{Meter, Others, SettledLines, read_settled, rewrite_in_order};
use super::{DataError, SampleId};
use crate::model::batched::GenerationStats;

#[derive(Debug, Clone)]
pub struct RegenerateOptions {
    pub input: PathBuf,
    pub out: PathBuf,
    pub max_tokens: u32,
    pub temperature: f64,
    /// Draws sampled replies, with each conversation's id and the turn (unused when greedy).
    pub seed: u64,
    /// Replies run to `max_tokens`, past the end of turn (fixed-length answers, for benchmarks).
    pub ignore_eos: bool,
    pub template_kwargs: Map<String, Value>,
    pub progress: ShowProgress,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct RegenerateReport {
    pub conversations: u64,
    /// Already in the output from an earlier run.
    pub already_done: u64,
    /// In the output with a reply cut at a lower `--max-tokens` than this run's: done again.
    pub redone: u64,
    /// Written now.
    pub regenerated: u64,
    /// Of those, conversations that ended with a prompt and got the reply it asks for.
    pub answered: u64,
    /// Replies written now, and those cut at the token limit rather than ended by the model.
    pub replies: u64,
    pub truncated: u64,
    /// Tokens of the replies written now (where the source counts them).
    pub tokens: u64,
    /// Nothing to answer, by reason (not written).
    pub skipped: BTreeMap<String, u64>,
    /// Failed after all retries (not written; a rerun retries them).
    pub failed: u64,
    /// Not tried because the server had stopped answering (not written; a rerun does them).
    pub not_tried: u64,
    /// Input lines that are not conversations (skipped).
    pub bad_lines: u64,
    /// How long the answering took.
    pub seconds: f64,
    pub examples: Vec<String>,
    /// Where the local generator's time went (`--local`; nothing generated here otherwise).
    #[serde(skip)]
    pub generation: GenerationStats,
}

/// An assistant reply: its content, the reasoning when the model reasons separately, its length in tokens where the
/// source says, and whether it stopped at the token limit rather than at its end of turn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub content: String,
    pub reasoning: Option<String>,
    pub tokens: Option<u64>,
    pub truncated: bool,
}

/// What regeneration does with one conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Replace these assistant turns in order, then (`answer_last`) reply to the final user or tool turn.
    Answer { replace: Vec<usize>, answer_last: bool },
    /// Nothing to reply to: why.
    Skip(&'static str),
}

/// Which turns of `conv` get the target's reply: each assistant turn after the first user turn (earlier ones, a
/// greeting before anyone spoke, stay as given), and a reply after a final user or tool turn.
pub fn plan(conv: &Conversation) -> Plan {
    let role = |i: usize| conv.messages[i]["role"].as_str().unwrap_or("");
    let Some(first_user) = (0..conv.messages.len()).find(|&i| role(i) == "user") else {
        return Plan::Skip("no user turn to reply to");
    };
    let replace: Vec<usize> = conv.assistant_turns().into_iter().filter(|&i| i > first_user).collect();
    let answer_last = matches!(role(conv.messages.len() - 1), "user" | "tool");
    Plan::Answer { replace, answer_last }
}

/// The seed of the reply at message `turn` of conversation `id`: the same for every run, batch and concurrency.
pub fn reply_seed(seed: u64, id: &SampleId, turn: usize) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(id.key().to_le_bytes());
    h.update((turn as u64).to_le_bytes());
    let digest = h.finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// The key of an output line whose reply was cut at the token limit: the limit.
const CUT_AT: &str = "cut_at_max_tokens";

/// An output line, parsed, with the id it carries; `None` for a line that is not one (torn, or not JSON).
fn written_line(line: &str) -> Option<(SampleId, Value)> {
    let v: Value = serde_json::from_str(line.trim_end()).ok()?;
    let id = SampleId::from_json(Some(v.get("id")?), 0).ok()?;
    Some((id, v))
}

/// Reads the ids already written to `out`, each with the token limit a reply of it was cut at (if one was), dropping a
/// torn last line left by an interrupted run.
fn resume_point(out: &Path) -> Result<HashMap<SampleId, Option<u64>>, DataError> {
    let mut done = HashMap::new();
    read_settled(out, |line| match written_line(line) {
        Some((id, v)) => {
            done.insert(id, v.get(CUT_AT).and_then(Value::as_u64));
            true
        }
        None => false,
    })?;
    Ok(done)
}

/// The conversations of `input` still to do, the report so far, and the ids of every conversation in input order.
fn pending(opts: &RegenerateOptions) -> Result<(Vec<Conversation>, RegenerateReport, Vec<SampleId>), DataError> {
    let done = resume_point(&opts.out)?;
    // Lines cut at a lower limit than this run's are done again: their old lines go first.
    let redo: HashSet<&SampleId> = (done.iter())
        .filter(|(_, cut_at)| cut_at.is_some_and(|limit| limit < u64::from(opts.max_tokens)))
        .map(|(id, _)| id)
        .collect();
    if !redo.is_empty() {
        without_lines(&opts.out, &redo)?;
    }
    let mut order = Vec::new();
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
                order.push(conv.id.clone());
                if redo.contains(&conv.id) {
                    report.redone += 1;
                    todo.push(conv);
                } else if done.contains_key(&conv.id) {
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
    if report.conversations == 0 && report.bad_lines == 0 {
        return Err(DataError::File {
            path: opts.input.clone(),
            reason: "no conversations: expected JSON lines of chats (OpenAI `messages` or ShareGPT `conversations`), \
                     one a line"
                .into(),
        });
    }
    Ok((todo, report, order))
}

/// Rewrites `out` without the lines of the ids in `drop`, through a temporary file that replaces it once complete.
fn without_lines(out: &Path, drop: &HashSet<&SampleId>) -> Result<(), DataError> {
    let io = |path: &Path, err| DataError::Io { path: path.to_path_buf(), err };
    let tmp = out.with_extension("redo.tmp");
    let mut kept = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?);
    let mut written = Ok(());
    // Every line is taken (a write error is kept for after, never a reason to cut `out`).
    read_settled(out, |line| {
        if written.is_ok() && !written_line(line).is_some_and(|(id, _)| drop.contains(&id)) {
            written = kept.write_all(line.as_bytes());
        }
        true
    })?;
    written.and_then(|()| kept.flush()).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, out).map_err(|e| io(out, e))
}

/// Puts a reply into an assistant message (the tool calls of the old reply go with it).
fn apply_reply(message: &mut Value, reply: &Reply) {
    let msg = message.as_object_mut().expect("messages are objects");
    msg.insert("content".into(), json!(reply.content));
    msg.remove("tool_calls");
    match &reply.reasoning {
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

/// A conversation with the target's replies, and what they were.
struct Regenerated {
    line: Value,
    answered: bool,
    replies: Vec<Reply>,
}

impl Regenerated {
    /// The replies' tokens, where the source counts them.
    fn tokens(&self) -> u64 {
        self.replies.iter().filter_map(|r| r.tokens).sum()
    }
}

/// The turns `plan` names: each `respond(messages before it, seed)` in order, each reply seeing the ones before.
async fn regenerate_one<F, Fut>(
    conv: &Conversation,
    seed: u64,
    replace: &[usize],
    answer_last: bool,
    respond: &F,
) -> Result<Regenerated, Failure>
where
    F: Fn(&Conversation, Vec<Value>, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Reply, Failure>>,
{
    let mut messages = conv.messages.clone();
    if answer_last {
        messages.push(json!({"role": "assistant", "content": ""}));
    }
    let turns = replace.iter().copied().chain(answer_last.then_some(messages.len() - 1));
    let mut replies = Vec::new();
    for i in turns {
        let reply = respond(conv, messages[..i].to_vec(), reply_seed(seed, &conv.id, i)).await?;
        apply_reply(&mut messages[i], &reply);
        replies.push(reply);
    }
    Ok(Regenerated { line: output_line(conv, messages), answered: answer_last, replies })
}

fn record_failure(report: &mut RegenerateReport, id: &SampleId, e: &str) {
    report.failed += 1;
    if report.examples.len() < 10 {
        report.examples.push(format!("id {id}: {e}"));
    }
}

impl RegenerateReport {
    /// Counts a conversation written.
    fn record(&mut self, done: &Regenerated) {
        self.regenerated += 1;
        self.answered += done.answered as u64;
        self.replies += done.replies.len() as u64;
        self.truncated += done.replies.iter().filter(|r| r.truncated).count() as u64;
        self.tokens += done.tokens();
    }

    fn skip(&mut self, why: &str) {
        *self.skipped.entry(why.to_string()).or_default() += 1;
    }
}

/// Regenerates with replies from `respond`, `concurrency` conversations in flight at once, on the calling thread: for
/// an in-process model that answers many at once (`regenerate --local`, the built-in data), whose futures need no
/// async runtime.
pub fn regenerate_concurrently<F, Fut>(
    opts: &RegenerateOptions,
    concurrency: usize,
    respond: F,
) -> Result<RegenerateReport, DataError>
where
    F: Fn(&Conversation, Vec<Value>, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Reply, Failure>>,
{
    let (todo, report, order) = pending(opts)?;
    futures::executor::block_on(drive(opts, todo, report, &order, concurrency, respond))
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
    fn base(&self) -> &str {
        let base = self.url.trim_end_matches('/');
        base.strip_suffix("/chat/completions").unwrap_or(base)
    }
    fn completions_url(&self) -> String {
        format!("{}/chat/completions", self.base())
    }
    fn models_url(&self) -> String {
        format!("{}/models", self.base())
    }
    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }
}

/// An error with every cause under it ("error sending request: client error (Connect): tcp connect error:
/// Connection refused (os error 111)"), not only the top one.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// What the server's model list says about `--model`.
#[derive(Debug, PartialEq)]
enum ModelsVerdict {
    Serves,
    /// No usable list (a server without `GET /models`): one tiny completion decides instead.
    Unknown,
    Refused(String),
}

/// Reads the answer to `GET /models` (status and body) for `model`.
fn models_verdict(status: u16, body: &str, model: &str) -> ModelsVerdict {
    match status {
        200 => {}
        401 | 403 => {
            return ModelsVerdict::Refused(format!(
                "HTTP {status}: the server wants an API key (--api-key or $OPENAI_API_KEY) or refused the one given"
            ));
        }
        _ => return ModelsVerdict::Unknown,
    }
    let ids: Vec<String> = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v["data"].as_array().map(|d| d.iter().filter_map(|m| m["id"].as_str().map(String::from)).collect())
        })
        .unwrap_or_default();
    if ids.is_empty() {
        return ModelsVerdict::Unknown;
    }
    if ids.iter().any(|id| id == model) {
        return ModelsVerdict::Serves;
    }
    ModelsVerdict::Refused(format!("it serves {}, not {model:?}: pass --model {}", ids.join(", "), ids[0]))
}

/// Asks the server once, before any conversation, whether it answers and serves `--model`: a dead server, a wrong
/// URL, a missing key or another model is one clear error at once, not minutes of retries.
pub async fn check_endpoint(client: &reqwest::Client, endpoint: &Endpoint) -> Result<(), String> {
    let here = endpoint.base();
    let ask = endpoint.request(client.get(endpoint.models_url())).timeout(Duration::from_secs(30));
    let response = ask.send().await.map_err(|e| {
        format!(
            "no server answers at {here}: {}. Start it first (vllm serve MODEL --port 8000, or SGLang's or \
             llama.cpp's server) or correct --endpoint",
            with_causes(&e)
        )
    })?;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    match models_verdict(status, &body, &endpoint.model) {
        ModelsVerdict::Serves => Ok(()),
        ModelsVerdict::Refused(why) => Err(format!("the server at {here} cannot be used: {why}")),
        ModelsVerdict::Unknown => {
            let body =
                json!({"model": endpoint.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
            complete(client, endpoint, &body)
                .await
                .map(|_| ())
                .map_err(|f| format!("the server at {here} did not answer a one-token request: {}", f.text))
        }
    }
}

/// Whether a failed request means the server is not there (rather than a request it refused).
fn unreachable(e: &reqwest::Error) -> bool {
    e.is_connect() || e.is_timeout()
}

/// Why a reply failed, and whether its source was unreachable (a server gone: see [`UNREACHABLE_IN_A_ROW`]).
#[derive(Debug)]
pub struct Failure {
    pub text: String,
    pub unreachable: bool,
}

impl Failure {
    /// A failure of the request itself.
    pub fn new(text: impl Into<String>) -> Self {
        Failure { text: text.into(), unreachable: false }
    }
}

/// One chat completion with retries: connection errors, 429 and 5xx are retried with backoff.
async fn complete(client: &reqwest::Client, endpoint: &Endpoint, body: &Value) -> Result<Reply, Failure> {
    let mut delay = Duration::from_millis(200);
    let mut last = Failure::new("");
    for attempt in 0..=endpoint.retries {
        if attempt > 0 {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(10));
        }
        let request = endpoint.request(client.post(endpoint.completions_url()).json(body).timeout(endpoint.timeout));
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                last = Failure { text: format!("request failed: {}", with_causes(&e)), unreachable: unreachable(&e) };
                continue;
            }
        };
        let status = response.status();
        if status.is_success() {
            let bad = Failure::new;
            let v: Value = response.json().await.map_err(|e| bad(format!("response is not JSON: {e}")))?;
            return reply_of(&v).map_err(bad);
        }
        let text = response.text().await.unwrap_or_default();
        last = Failure::new(format!("HTTP {status}: {}", text.chars().take(200).collect::<String>()));
        if !(status.is_server_error() || status.as_u16() == 429) {
            break; // the request itself is wrong; retrying will not help
        }
    }
    Err(last)
}

/// The reply in a chat-completions response: the first choice's message, its finish reason (`length`: cut at
/// `max_tokens`) and the completion's token count where the server reports usage.
fn reply_of(v: &Value) -> Result<Reply, String> {
    let choice = &v["choices"][0];
    let message = &choice["message"];
    let content =
        message["content"].as_str().ok_or_else(|| format!("response has no choices[0].message.content: {v}"))?;
    Ok(Reply {
        content: content.to_string(),
        reasoning: message["reasoning_content"].as_str().or(message["reasoning"].as_str()).map(str::to_string),
        tokens: v["usage"]["completion_tokens"].as_u64(),
        truncated: choice["finish_reason"] == "length",
    })
}

/// Conversations whose every request found the server unreachable, in a row, after which the run stops starting
/// new ones (a server that died mid-run): the rest are left for a rerun rather than each failing after its retries.
const UNREACHABLE_IN_A_ROW: u64 = 8;

/// Regenerates through `endpoint`, `endpoint.concurrency` conversations at a time, after checking it answers.
pub async fn regenerate_endpoint(opts: &RegenerateOptions, endpoint: &Endpoint) -> Result<RegenerateReport, DataError> {
    let (todo, report, order) = pending(opts)?;
    let client = reqwest::Client::new();
    if !todo.is_empty() {
        check_endpoint(&client, endpoint)
            .await
            .map_err(|reason| DataError::File { path: opts.input.clone(), reason })?;
    }
    let respond = |conv: &Conversation, messages: Vec<Value>, seed: u64| {
        // No repetition penalty: the target's own distribution, as dflash decodes and vLLM serves it by default
        // (llama-cpp-python's server applies 1.1 unless told, which changes even greedy answers). vLLM and SGLang
        // read `repetition_penalty`, llama.cpp `repeat_penalty`; each ignores the other's.
        let mut body = json!({
            "model": endpoint.model,
            "messages": messages,
            "max_tokens": opts.max_tokens,
            "temperature": opts.temperature,
            "repetition_penalty": 1.0,
            "repeat_penalty": 1.0,
        });
        if opts.temperature > 0.0 {
            body["seed"] = json!(seed >> 1); // servers take a signed 64-bit seed
        }
        if opts.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(tools) = &conv.tools {
            body["tools"] = tools.clone();
        }
        if !opts.template_kwargs.is_empty() {
            body["chat_template_kwargs"] = Value::Object(opts.template_kwargs.clone());
        }
        let client = &client;
        async move {
            let reply = complete(client, endpoint, &body).await?;
            // Run to the limit on purpose: not cut short.
            Ok(Reply { truncated: reply.truncated && !opts.ignore_eos, ..reply })
        }
    };
    drive(opts, todo, report, &order, endpoint.concurrency, respond).await
}

/// Regenerates `todo` through `respond`, `concurrency` conversations at a time: each conversation's plan, its
/// replies in order, its line written once all came, the report and the progress; after
/// [`UNREACHABLE_IN_A_ROW`] conversations found the source unreachable in a row, the rest are left for a rerun; at the
/// end the output in `order`, the input's.
async fn drive<F, Fut>(
    opts: &RegenerateOptions,
    todo: Vec<Conversation>,
    report: RegenerateReport,
    order: &[SampleId],
    concurrency: usize,
    respond: F,
) -> Result<RegenerateReport, DataError>
where
    F: Fn(&Conversation, Vec<Value>, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Reply, Failure>>,
{
    let out = Mutex::new(SettledLines::open(&opts.out)?);
    let report = Mutex::new(report);
    let meter = Mutex::new(Meter::new(opts.progress, "answering", todo.len() as u64));
    let (unreachable_in_a_row, gone) = (AtomicU64::new(0), AtomicBool::new(false));
    let respond = &respond;
    let results = futures::stream::iter(todo.into_iter().map(|conv| {
        let (out, report, meter) = (&out, &report, &meter);
        let (unreachable_in_a_row, gone) = (&unreachable_in_a_row, &gone);
        async move {
            let (replace, answer_last) = match plan(&conv) {
                Plan::Answer { replace, answer_last } => (replace, answer_last),
                Plan::Skip(why) => {
                    report.lock().expect("report lock").skip(why);
                    meter.lock().expect("meter lock").add(1, 0);
                    return Ok(());
                }
            };
            if gone.load(Ordering::Relaxed) {
                report.lock().expect("report lock").not_tried += 1;
                return Ok(());
            }
            let result = regenerate_one(&conv, opts.seed, &replace, answer_last, respond).await;
            let mut tokens = 0;
            let written = match result {
                Err(failure) => {
                    if failure.unreachable
                        && unreachable_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= UNREACHABLE_IN_A_ROW
                    {
                        gone.store(true, Ordering::Relaxed);
                    }
                    record_failure(&mut report.lock().expect("report lock"), &conv.id, &failure.text);
                    Ok(())
                }
                Ok(mut done) => {
                    unreachable_in_a_row.store(0, Ordering::Relaxed);
                    tokens = done.tokens();
                    if done.replies.iter().any(|r| r.truncated) {
                        done.line[CUT_AT] = json!(opts.max_tokens);
                    }
                    let w = out.lock().expect("output lock").write(&done.line);
                    if w.is_ok() {
                        report.lock().expect("report lock").record(&done);
                    }
                    w
                }
            };
            meter.lock().expect("meter lock").add(1, tokens);
            written
        }
    }))
    .buffer_unordered(concurrency.max(1))
    .collect::<Vec<_>>()
    .await;
    let mut meter = meter.into_inner().expect("meter lock");
    meter.finish();
    results.into_iter().collect::<Result<Vec<()>, DataError>>()?;
    drop(out);
    rewrite_in_order(&opts.out, order, Others::Keep)?;
    let mut report = report.into_inner().expect("report lock");
    report.seconds = meter.started.elapsed().as_secs_f64();
    Ok(report)
}

impl RegenerateReport {
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} conversations: {} regenerated now ({} answered from a final prompt{}), {} already done, {} skipped, {} \
             failed, {} bad lines; {} replies, {} cut at --max-tokens",
            self.conversations,
            self.regenerated,
            self.answered,
            match self.redone {
                0 => String::new(),
                n => format!(", {n} redone: cut at a lower --max-tokens before"),
            },
            self.already_done,
            self.skipped.values().sum::<u64>(),
            self.failed,
            self.bad_lines,
            self.replies,
            self.truncated
        );
        if self.tokens > 0 {
            let rate = self.tokens as f64 / self.seconds.max(1e-9);
            s.push_str(&format!("; {} tokens in {:.1} s ({rate:.0} tokens/s)", self.tokens, self.seconds));
        }
        let generation = self.generation.summary();
        if !generation.is_empty() {
            s.push_str(&format!("\n  generation: {generation}"));
        }
        for (why, n) in &self.skipped {
            s.push_str(&format!("\n  skipped {n}: {why}"));
        }
        for e in &self.examples {
            s.push_str(&format!("\n  {e}"));
        }
        if self.truncated > 0 {
            s.push_str(
                "\n  replies cut at --max-tokens train the drafter on unfinished answers: run the same command with a \
                 higher --max-tokens to redo them whole",
            );
        }
        if self.not_tried > 0 {
            s.push_str(&format!(
                "\n  the server stopped answering ({UNREACHABLE_IN_A_ROW} conversations in a row could not reach it): {} \
                 conversations not tried; run the same command again once it is back",
                self.not_tried
            ));
        } else if self.failed > 0 {
            s.push_str("\n  run the same command again to retry the failed conversations");
        }
        s
    }

    /// Whether anything is left for a rerun.
    pub fn incomplete(&self) -> bool {
        self.failed > 0 || self.not_tried > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn conversation(roles: &[&str]) -> Conversation {
        let messages: Vec<Value> = roles.iter().map(|r| json!({"role": r, "content": format!("{r} says")})).collect();
        Conversation::from_json_line(&json!({"id": 7, "messages": messages}).to_string(), 0).unwrap()
    }

    #[test]
    fn the_plan_replies_to_prompts_and_replaces_answers_after_the_first_user_turn() {
        let answer = |replace: &[usize], answer_last| Plan::Answer { replace: replace.to_vec(), answer_last };
        // A prompt alone, with or without a system turn: the reply it asks for.
        assert_eq!(plan(&conversation(&["user"])), answer(&[], true));
        assert_eq!(plan(&conversation(&["system", "user"])), answer(&[], true));
        // A whole chat: every answer replaced; a chat ending with a question also gets its reply.
        assert_eq!(plan(&conversation(&["system", "user", "assistant", "user", "assistant"])), answer(&[2, 4], false));
        assert_eq!(plan(&conversation(&["user", "assistant", "user"])), answer(&[1], true));
        // A tool result asks for the assistant's next turn.
        assert_eq!(plan(&conversation(&["user", "assistant", "tool"])), answer(&[1], true));
        // A greeting before anyone spoke stays as given.
        assert_eq!(plan(&conversation(&["assistant", "user", "assistant"])), answer(&[2], false));
        // Nothing to reply to.
        assert_eq!(plan(&conversation(&["system", "assistant"])), Plan::Skip("no user turn to reply to"));
    }

    #[test]
    fn reply_seeds_depend_on_the_seed_the_id_and_the_turn_only() {
        let (a, b) = (SampleId::parse("conv-1"), SampleId::parse("conv-2"));
        assert_eq!(reply_seed(0, &a, 1), reply_seed(0, &a, 1));
        let seeds = [reply_seed(0, &a, 1), reply_seed(0, &a, 3), reply_seed(0, &b, 1), reply_seed(1, &a, 1)];
        let distinct: HashSet<u64> = seeds.iter().copied().collect();
        assert_eq!(distinct.len(), 4, "{seeds:?}");
        // An integer id and its text are one id, so one seed.
        assert_eq!(
            reply_seed(5, &SampleId::parse("17"), 2),
            reply_seed(5, &SampleId::from_json(Some(&json!(17)), 0).unwrap(), 2)
        );
    }

    #[test]
    fn the_model_list_decides_whether_the_server_can_be_used() {
        let list = r#"{"object": "list", "data": [{"id": "models/Qwen3-8B"}, {"id": "other"}]}"#;
        assert_eq!(models_verdict(200, list, "models/Qwen3-8B"), ModelsVerdict::Serves);
        let ModelsVerdict::Refused(why) = models_verdict(200, list, "Qwen/Qwen3-8B") else { panic!() };
        assert!(why.contains("models/Qwen3-8B, other") && why.contains("--model models/Qwen3-8B"), "{why}");
        let ModelsVerdict::Refused(why) = models_verdict(401, "", "m") else { panic!() };
        assert!(why.contains("--api-key"), "{why}");
        // No list to go by (no such route, or not the OpenAI shape): one tiny request decides.
        assert_eq!(models_verdict(404, "not found", "m"), ModelsVerdict::Unknown);
        assert_eq!(models_verdict(200, "{}", "m"), ModelsVerdict::Unknown);
    }

    #[test]
    fn a_reply_says_whether_it_was_cut_and_how_long_it_is() {
        let full = json!({"choices": [{"message": {"content": "hi", "reasoning_content": "think"}, "finish_reason": "stop"}],
                          "usage": {"completion_tokens": 3}});
        let r = reply_of(&full).unwrap();
        assert_eq!(
            (r.content.as_str(), r.reasoning.as_deref(), r.tokens, r.truncated),
            ("hi", Some("think"), Some(3), false)
        );
        let cut = json!({"choices": [{"message": {"content": "h"}, "finish_reason": "length"}]});
        let r = reply_of(&cut).unwrap();
        assert_eq!((r.tokens, r.truncated), (None, true));
        assert!(reply_of(&json!({"error": "x"})).unwrap_err().contains("no choices[0].message.content"));
    }

    #[test]
    fn a_refused_connection_names_its_cause() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let endpoint = Endpoint {
            url: format!("http://127.0.0.1:{port}/v1"),
            model: "m".into(),
            api_key: None,
            concurrency: 1,
            retries: 5,
            timeout: Duration::from_secs(5),
        };
        let started = Instant::now();
        let err = runtime.block_on(check_endpoint(&reqwest::Client::new(), &endpoint)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "at once, without retries");
        assert!(err.contains(&format!("no server answers at http://127.0.0.1:{port}/v1")), "{err}");
        assert!(err.to_lowercase().contains("connection refused"), "the cause under the request error: {err}");
    }

    #[test]
    fn the_summary_names_skips_cuts_and_what_a_rerun_does() {
        let mut report = RegenerateReport {
            conversations: 5,
            regenerated: 3,
            answered: 2,
            replies: 4,
            truncated: 1,
            ..Default::default()
        };
        report.skip("no user turn to reply to");
        report.not_tried = 1;
        let text = report.summary();
        assert!(text.contains("3 regenerated now (2 answered from a final prompt)"), "{text}");
        assert!(text.contains("skipped 1: no user turn to reply to"), "{text}");
        assert!(text.contains("1 cut at --max-tokens") && text.contains("higher --max-tokens to redo"), "{text}");
        assert!(text.contains("the server stopped answering") && text.contains("once it is back"), "{text}");
        assert!(report.incomplete());
    }
}
