//! `dflash proxy` as a process in front of an OpenAI-compatible server the test starts: responses pass unchanged
//! (streamed chunk by chunk, other routes too), successful chat completions are recorded as sealed segments that
//! `prepare` reads, upstream errors are passed on and not recorded, a recording that cannot be written never fails a
//! client's request, and `[proxy]`'s policy (redaction, headers that opt out, retention) holds, counted at
//! `/_dflash/metrics`. A proxy killed mid-traffic and started again keeps every exchange it answered once; an
//! upstream that is down is the client's 502, not a recording.
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_dflash");

/// Answers "echo: <last user message>", as JSON or as events in three chunks with pauses between them; a message
/// containing "fail" gets a 500.
async fn completions(Json(request): Json<Value>) -> Response {
    let last = request["messages"].as_array().and_then(|m| m.last()).and_then(|m| m["content"].as_str()).unwrap_or("");
    if last.contains("fail") {
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "boom"}}))).into_response();
    }
    let answer = format!("echo: {last}");
    if request["stream"].as_bool() != Some(true) {
        let body = json!({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]});
        return Json(body).into_response();
    }
    let (a, b) = answer.split_at(answer.len() / 2);
    let events = vec![
        format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": a}}]})),
        format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": b}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_string(),
    ];
    let stream = futures::stream::unfold(events.into_iter(), |mut rest| async move {
        let next = rest.next()?;
        tokio::time::sleep(Duration::from_millis(30)).await;
        Some((Ok::<_, std::io::Error>(next), rest))
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

/// Events whose last part waits until the test says so (`/held/v1/chat/completions`): a proxy that held the
/// response until its end would never pass the first part on.
async fn held(
    axum::extract::State(release): axum::extract::State<std::sync::Arc<tokio::sync::Notify>>,
    Json(_): Json<Value>,
) -> Response {
    let first = format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": "first"}}]}));
    let stream = futures::stream::unfold(0, move |i| {
        let (release, first) = (release.clone(), first.clone());
        async move {
            match i {
                0 => Some((Ok::<_, std::io::Error>(first), 1)),
                1 => {
                    release.notified().await;
                    Some((Ok("data: [DONE]\n\n".to_string()), 2))
                }
                _ => None,
            }
        }
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

fn upstream(runtime: &tokio::runtime::Runtime) -> SocketAddr {
    upstream_with(runtime, Default::default())
}

/// The answer of `completions`, gzip-encoded as a server that compresses sends it (`/gzip/v1/chat/completions`).
async fn gzipped(body: Json<Value>) -> Response {
    use std::io::Write;
    let plain = axum::body::to_bytes(completions(body).await.into_body(), 1 << 20).await.unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&plain).unwrap();
    Response::builder()
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(Body::from(gz.finish().unwrap()))
        .unwrap()
}

fn upstream_with(runtime: &tokio::runtime::Runtime, release: std::sync::Arc<tokio::sync::Notify>) -> SocketAddr {
    upstream_at(runtime, release, 0)
}

/// The upstream on `port` (0: any free one).
fn upstream_at(
    runtime: &tokio::runtime::Runtime,
    release: std::sync::Arc<tokio::sync::Notify>,
    port: u16,
) -> SocketAddr {
    let app = Router::new()
        .route("/gzip/v1/chat/completions", post(gzipped))
        .route("/held/v1/chat/completions", post(held).with_state(release))
        .route("/v1/chat/completions", post(completions))
        .route("/v1/models", get(|| async { Json(json!({"data": [{"id": "m"}]})) }));
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    })
}

struct Proxy {
    /// `None` once stopped.
    child: Option<Child>,
    url: String,
}

/// A test that fails before `stop` leaves no proxy behind (it would hold the test's output open).
impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Proxy {
    fn start(upstream: SocketAddr, record: &Path) -> Self {
        Self::start_with(upstream, record, &[])
    }

    /// With more arguments (`--config FILE`, `--set proxy.KEY=VALUE`).
    fn start_with(upstream: SocketAddr, record: &Path, more: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(BIN)
            .args(["proxy", "--upstream", &format!("http://{upstream}"), "--listen", &format!("127.0.0.1:{port}")])
            .args(["--record", record.to_str().unwrap(), "--set", "proxy.segment_seconds=3600"])
            .args(more)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Self::listening(child, port)
    }

    /// `child`, once it listens on `port`.
    fn listening(child: Child, port: u16) -> Self {
        let proxy = Proxy { child: Some(child), url: format!("http://127.0.0.1:{port}") };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return proxy;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let (code, stderr) = proxy.stop();
        panic!("the proxy did not listen on {port} (exit {code}): {stderr}");
    }

    /// SIGKILL: the process ends at once, with no chance to seal or flush.
    fn kill(mut self) {
        let mut child = self.child.take().expect("stopped once");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM, then the exit status and what it wrote on stderr.
    fn stop(mut self) -> (i32, String) {
        let child = self.child.take().expect("stopped once");
        Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        let out = child.wait_with_output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).to_string())
    }
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, "stream": stream})
}

async fn post_chat(client: &reqwest::Client, url: &str, body: &Value) -> (u16, String) {
    let r = client.post(format!("{url}/v1/chat/completions")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The recording's segments, oldest first (the library's listing), once nothing but sealed segments is left.
fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let sealed = dflash::proxy::segments::sealed(dir).unwrap();
    assert_eq!(sealed.len(), std::fs::read_dir(dir).unwrap().count(), "only sealed segments: {sealed:?}");
    sealed
}

fn sealed_lines(dir: &Path) -> Vec<Value> {
    segment_files(dir)
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn responses_pass_unchanged_and_chat_completions_are_recorded_as_conversations() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let upstream = upstream(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("traffic");
    let proxy = Proxy::start(upstream, &record);
    let client = reqwest::Client::new();
    runtime.block_on(async {
        // The same bytes through the proxy as from the upstream itself, streamed or not.
        for stream in [false, true] {
            let body = chat(&format!("hello {stream}"), stream);
            let direct = post_chat(&client, &format!("http://{upstream}"), &body).await;
            let proxied = post_chat(&client, &proxy.url, &body).await;
            assert_eq!(proxied, direct);
        }
        // A compressed answer passes as the upstream sent it, and is recorded as its text.
        let gzip =
            |url: &str| client.post(format!("{url}/gzip/v1/chat/completions")).json(&chat("zipped", false)).send();
        let (direct, proxied) = (gzip(&format!("http://{upstream}")).await.unwrap(), gzip(&proxy.url).await.unwrap());
        assert_eq!(proxied.headers()["content-encoding"], "gzip");
        assert_eq!(proxied.bytes().await.unwrap(), direct.bytes().await.unwrap());
        let models = client.get(format!("{}/v1/models", proxy.url)).send().await.unwrap();
        assert_eq!(models.json::<Value>().await.unwrap()["data"][0]["id"], "m", "other routes are forwarded");
        let (code, body) = post_chat(&client, &proxy.url, &chat("please fail", false)).await;
        assert!(code == 500 && body.contains("boom"), "upstream errors pass unchanged: {code} {body}");
    });
    assert!(
        std::fs::read_dir(&record).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().starts_with("segment-")),
        "nothing visible before the segment is sealed"
    );
    let (code, stderr) = proxy.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("5 requests; 3 chat completions recorded"), "{stderr}");
    assert!(stderr.contains("1 not recordable") && stderr.contains("0 lost"), "{stderr}");
    let lines = sealed_lines(&record);
    let answers: Vec<&str> = lines.iter().map(|l| l["messages"][1]["content"].as_str().unwrap()).collect();
    // Each request also went to the upstream directly; only the proxied ones are recorded.
    assert_eq!(answers, ["echo: hello false", "echo: hello true", "echo: zipped"], "{lines:#?}");
    assert_eq!(lines[1]["recorded"]["streamed"], true);
    assert_eq!(lines[0]["recorded"]["settings"], json!({"model": "m", "temperature": 0}));

    // The recording is data: prepare takes every line.
    let out = Command::new(BIN)
        .args(["prepare", "--model", "tiny-tasks", "--input"])
        .arg(segment_files(&record)[0].as_os_str())
        .args(["--out", dir.path().join("prepared").to_str().unwrap(), "--block-size", "4", "--max-len", "256"])
        .output()
        .unwrap();
    let manifest = std::fs::read_to_string(dir.path().join("prepared/manifest.json"))
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    let manifest: Value = serde_json::from_str(&manifest).unwrap();
    assert_eq!((manifest["report"]["lines"].as_u64(), &manifest["report"]["bad_lines"]), (Some(3), &json!({})));
}

/// The recording folder gone from under the proxy: every client still gets its answer; the losses are counted.
#[test]
fn a_recording_that_cannot_be_written_never_fails_a_client() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let upstream = upstream(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("traffic");
    let proxy = Proxy::start(upstream, &record);
    std::fs::remove_dir_all(&record).unwrap();
    std::fs::write(&record, "a file where the folder was").unwrap();
    let client = reqwest::Client::new();
    runtime.block_on(async {
        for i in 0..3 {
            let (code, body) = post_chat(&client, &proxy.url, &chat(&format!("q{i}"), i % 2 == 1)).await;
            assert_eq!(code, 200, "{body}");
            assert!(body.contains(&format!("q{i}")), "{body}");
        }
    });
    let (code, stderr) = proxy.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("3 requests; 0 chat completions recorded") && stderr.contains("3 lost"), "{stderr}");
    assert!(stderr.contains("an exchange was not recorded"), "the loss is logged: {stderr}");
}

/// A streamed response reaches the client part by part: the first event arrives while the upstream still holds the
/// rest back.
#[test]
fn streamed_responses_are_passed_on_as_they_come() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let upstream = upstream_with(&runtime, release.clone());
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(upstream, &dir.path().join("traffic"));
    runtime.block_on(async {
        let client = reqwest::Client::new();
        let mut response =
            client.post(format!("{}/held/v1/chat/completions", proxy.url)).json(&chat("x", true)).send().await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(30), response.chunk()).await;
        let first = first.expect("the first event did not come while the rest was held back").unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("first"));
        release.notify_one();
        let mut rest = Vec::new();
        while let Some(chunk) = response.chunk().await.unwrap() {
            rest.extend_from_slice(&chunk);
        }
        assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
    });
    let (code, stderr) = proxy.stop();
    assert!(code == 0 && stderr.contains("1 chat completions recorded"), "{stderr}");
}

/// The policy of a config file's `[proxy]`: a match masked in the request and in the answer that echoes it, an
/// exchange dropped by a rule, one kept out by its header; each exchange sealed alone (a segment of one byte) and the
/// retention keeping only the newest; every count at `/_dflash/metrics` and in the summary line.
#[test]
fn the_configured_policy_masks_drops_skips_and_retains() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let upstream = upstream(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("traffic");
    let config = dir.path().join("dflash.toml");
    std::fs::write(
        &config,
        r#"[proxy]
segment_bytes = 1
keep_bytes = 300
skip_headers = ["X-No-Record"]
redact = [{ pattern = '[\w.]+@[\w.]+\.\w+', replace = "[EMAIL]" }, { pattern = '(?i)password', drop = true }]
"#,
    )
    .unwrap();
    let proxy = Proxy::start_with(upstream, &record, &["--config", config.to_str().unwrap()]);
    let client = reqwest::Client::new();
    runtime.block_on(async {
        for (content, header) in [
            ("first", None),
            ("mail me at a@b.com", None),
            ("my PASSWORD is x", None),
            ("private", Some("x-no-record")),
        ] {
            let mut request = client.post(format!("{}/v1/chat/completions", proxy.url)).json(&chat(content, false));
            if let Some(h) = header {
                request = request.header(h, "1");
            }
            let answer = request.send().await.unwrap();
            assert_eq!(answer.status(), 200, "every client is answered, recorded or not");
            assert!(answer.text().await.unwrap().contains(content), "the answer passes unmasked");
        }
    });
    // The writer records after the answers went out: the counts settle within moments.
    let expected = [
        "dflash_proxy_requests_total 4",
        "dflash_proxy_chat_completions_total{outcome=\"recorded\"} 2",
        "dflash_proxy_chat_completions_total{outcome=\"skipped_by_header\"} 1",
        "dflash_proxy_chat_completions_total{outcome=\"dropped_by_rule\"} 1",
        "dflash_proxy_masked_total 2",
        "dflash_proxy_segments_retired_total 1",
    ];
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = runtime.block_on(async {
            client.get(format!("{}/_dflash/metrics", proxy.url)).send().await.unwrap().text().await.unwrap()
        });
        if expected.iter().all(|line| metrics.contains(line)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for line in expected {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    // Every series the dashboard's proxy panels chart is one the proxy serves.
    let dashboard =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/dashboards/dflash.json")).unwrap();
    let charted: std::collections::BTreeSet<&str> = dashboard
        .match_indices("dflash_proxy_")
        .map(|(i, _)| {
            let rest = &dashboard[i..];
            &rest[..rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len())]
        })
        .collect();
    assert!(charted.len() >= 4, "{charted:?}");
    for name in charted {
        assert!(
            metrics.lines().any(|l| l.starts_with(name)),
            "the dashboard charts {name}, which the proxy does not serve"
        );
    }
    let (code, stderr) = proxy.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("4 requests; 2 chat completions recorded"), "{stderr}");
    assert!(stderr.contains("(2 matches masked), 1 kept out by a header, 1 dropped by a redaction rule"), "{stderr}");
    let lines = sealed_lines(&record);
    assert_eq!(lines.len(), 1, "the retention keeps the newest segment alone: {lines:#?}");
    assert_eq!(
        lines[0]["messages"],
        json!([{"role": "user", "content": "mail me at [EMAIL]"}, {"role": "assistant", "content": "echo: mail me at [EMAIL]"}])
    );
}

/// The proxy killed (SIGKILL) while clients keep sending, then started again on the same folder: every exchange a
/// client had its answer to before the kill is in the recording once, the restart seals what the killed proxy left
/// open (whole lines only), and what the restarted proxy records joins it; nothing is recorded twice.
#[test]
fn a_killed_proxy_keeps_what_it_recorded_and_records_nothing_twice() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let upstream = upstream(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("traffic");
    // Small segments: some are sealed before the kill, one is left open by it.
    let small = ["--set", "proxy.segment_bytes=2048"];
    let client = reqwest::Client::new();
    let send = |proxy: &Proxy, range: std::ops::Range<usize>| {
        runtime.block_on(async {
            for i in range {
                let (code, body) = post_chat(&client, &proxy.url, &chat(&format!("question {i}"), i % 3 == 0)).await;
                assert_eq!(code, 200, "{body}");
            }
        })
    };
    let proxy = Proxy::start_with(upstream, &record, &small);
    send(&proxy, 0..40);
    // The writer takes an exchange once its answer has ended: give it the moment it needs, then kill.
    std::thread::sleep(Duration::from_millis(500));
    proxy.kill();
    let left_open =
        std::fs::read_dir(&record).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with('.'));
    assert!(left_open, "the kill left a segment open");
    let proxy = Proxy::start_with(upstream, &record, &small);
    send(&proxy, 40..50);
    let (code, stderr) = proxy.stop();
    assert_eq!(code, 0, "{stderr}");
    let asked: Vec<String> =
        sealed_lines(&record).iter().map(|l| l["messages"][0]["content"].as_str().unwrap().to_string()).collect();
    let expected: Vec<String> = (0..50).map(|i| format!("question {i}")).collect();
    assert_eq!(asked, expected, "every answered exchange once, in order");
}

/// An upstream that is down is the client's 502 from the proxy, saying so, and nothing is recorded; once the upstream
/// is up, the same proxy passes and records again.
#[test]
fn an_upstream_that_is_down_is_a_502_and_no_recording() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let down: SocketAddr = ([127, 0, 0, 1], port).into();
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("traffic");
    let proxy = Proxy::start(down, &record);
    let client = reqwest::Client::new();
    let (code, body) = runtime.block_on(post_chat(&client, &proxy.url, &chat("anyone there?", false)));
    assert!(code == 502 && body.contains("did not answer"), "{code} {body}");
    upstream_at(&runtime, Default::default(), port);
    let (code, body) = runtime.block_on(post_chat(&client, &proxy.url, &chat("back again", false)));
    assert_eq!((code, body.contains("echo: back again")), (200, true), "{body}");
    let (code, stderr) = proxy.stop();
    assert_eq!(code, 0, "{stderr}");
    let lines = sealed_lines(&record);
    assert_eq!(lines.len(), 1, "only the answered exchange: {lines:#?}");
    assert_eq!(lines[0]["messages"][0]["content"], "back again");
}
