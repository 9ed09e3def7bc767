//! `dflash proxy`: an OpenAI-compatible pass-through in front of the served target (vLLM, SGLang, llama.cpp's
//! server) that records what the target says. Every request goes to the upstream unchanged and every response comes
//! back as the upstream sent it, streamed chunk by chunk; a successful chat completion is also recorded
//! ([`exchange`]), held to the recording's [`policy`] (headers that keep an exchange out, redaction rules that mask or
//! drop), into durable segment files ([`segments`], rotated and retained) by a writer thread of its own. Recording
//! never fails or slows a client's request: an exchange the writer cannot take or write is counted, logged and
//! dropped. `GET /_dflash/metrics` answers the proxy's own counts in Prometheus' format; every other path goes
//! upstream.
pub mod exchange;
pub mod policy;
pub mod segments;

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use futures::Stream;
use serde_json::json;

use self::policy::{Policy, Verdict};
use self::segments::{Retention, Rotation, Segments};

/// What the proxy is told.
#[derive(Debug, Clone)]
pub struct ProxySettings {
    /// The upstream's base URL (`http://localhost:8000`); request paths are appended to it.
    pub upstream: String,
    pub record: PathBuf,
    pub rotation: Rotation,
    pub retention: Retention,
    pub policy: Policy,
    /// Exchanges waiting for the writer at most; more are dropped (and counted).
    pub queue: usize,
}

/// Counts of the recording, for the summary line, the logs and `/_dflash/metrics`.
#[derive(Debug, Default)]
pub struct Counts {
    pub requests: AtomicU64,
    pub recorded: AtomicU64,
    /// Exchanges that were not recorded because the writer was behind or failed.
    pub lost: AtomicU64,
    /// Chat completions that could not be recorded (not a usable conversation, cut short, an upstream error).
    pub skipped: AtomicU64,
    /// Chat completions kept out by a `skip_headers` header.
    pub skipped_by_header: AtomicU64,
    /// Chat completions kept out by a redaction rule that drops.
    pub dropped_by_rule: AtomicU64,
    /// Matches of the redaction rules masked in recorded exchanges.
    pub masked: AtomicU64,
    /// Sealed segments deleted by the retention.
    pub retired: AtomicU64,
}

impl Counts {
    fn add(counter: &AtomicU64, n: u64) -> u64 {
        counter.fetch_add(n, Ordering::Relaxed) + n
    }

    /// The counts in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut family = |name: &str, help: &str, values: &[(&str, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
            for (labels, v) in values {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        family("dflash_proxy_requests_total", "Requests the proxy passed upstream.", &[("", n(&self.requests))]);
        family(
            "dflash_proxy_chat_completions_total",
            "Chat completions answered, by what the recording did with them.",
            &[
                ("{outcome=\"recorded\"}", n(&self.recorded)),
                ("{outcome=\"lost\"}", n(&self.lost)),
                ("{outcome=\"not_recordable\"}", n(&self.skipped)),
                ("{outcome=\"skipped_by_header\"}", n(&self.skipped_by_header)),
                ("{outcome=\"dropped_by_rule\"}", n(&self.dropped_by_rule)),
            ],
        );
        family(
            "dflash_proxy_masked_total",
            "Redaction matches masked in recorded exchanges.",
            &[("", n(&self.masked))],
        );
        family(
            "dflash_proxy_segments_retired_total",
            "Sealed segments deleted by the retention.",
            &[("", n(&self.retired))],
        );
        out
    }
}

struct Proxy {
    client: reqwest::Client,
    upstream: String,
    policy: Policy,
    to_writer: Mutex<Option<SyncSender<String>>>,
    counts: Arc<Counts>,
}

/// Where the proxy answers its own counts (every other path goes upstream).
pub const METRICS_PATH: &str = "/_dflash/metrics";

/// Bodies above this are refused (413) rather than held in memory.
const MAX_REQUEST_BYTES: usize = 64 << 20;
/// A response above this is passed on but not recorded.
const MAX_RECORDED_BYTES: usize = 16 << 20;

/// Headers that belong to one connection, not to the request: not forwarded either way.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

async fn forward(State(proxy): State<Arc<Proxy>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    if parts.method == axum::http::Method::GET && parts.uri.path() == METRICS_PATH {
        let text = proxy.counts.prometheus();
        return ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response();
    }
    Counts::add(&proxy.counts.requests, 1);
    let body = match axum::body::to_bytes(body, MAX_REQUEST_BYTES).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body could not be read: {e}")),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut upstream =
        proxy.client.request(parts.method.clone(), format!("{}{path}", proxy.upstream)).body(body.clone());
    let mut headers = HeaderMap::new();
    copy_headers(&parts.headers, &mut headers);
    upstream = upstream.headers(headers);
    let answer = match upstream.send().await {
        Ok(a) => a,
        Err(e) => {
            return error(StatusCode::BAD_GATEWAY, format!("the upstream {} did not answer: {e}", proxy.upstream));
        }
    };
    let status = answer.status();
    let mut response_headers = HeaderMap::new();
    copy_headers(answer.headers(), &mut response_headers);
    let chat = parts.method == axum::http::Method::POST && parts.uri.path().ends_with("/chat/completions");
    let skip = chat.then(|| proxy.policy.skipped_by(parts.headers.keys().map(|k| k.as_str()))).flatten();
    let recorder = match (chat, status.is_success(), skip) {
        (true, _, Some(header)) => {
            Counts::add(&proxy.counts.skipped_by_header, 1);
            tracing::debug!("not recorded: the request carries {header}");
            None
        }
        (true, true, None) => Some(Recording {
            request: body,
            request_encoding: content_encoding(&parts.headers),
            response_encoding: content_encoding(answer.headers()),
            proxy: proxy.clone(),
        }),
        (true, false, None) => {
            Counts::add(&proxy.counts.skipped, 1);
            None
        }
        _ => None,
    };
    let stream = Tee { inner: Box::pin(answer.bytes_stream()), seen: Vec::new(), recorder };
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = status;
    *response.headers_mut() = response_headers;
    response
}

fn error(code: StatusCode, message: String) -> Response {
    (code, axum::Json(json!({"error": {"message": message, "type": "proxy_error"}}))).into_response()
}

/// A chat completion's request, waiting for its response to end.
struct Recording {
    request: Bytes,
    /// How each body is encoded (`Content-Encoding`): passed on as it is, decoded for the recording.
    request_encoding: Option<String>,
    response_encoding: Option<String>,
    proxy: Arc<Proxy>,
}

/// A body's `Content-Encoding`, lower case; `None` for none or `identity`.
fn content_encoding(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(axum::http::header::CONTENT_ENCODING)?.to_str().ok()?.trim().to_ascii_lowercase();
    (!value.is_empty() && value != "identity").then_some(value)
}

/// A body as the recording reads it: gzip and deflate decoded (at most [`MAX_RECORDED_BYTES`]), anything else refused.
fn decoded<'a>(body: &'a [u8], encoding: Option<&str>) -> Result<std::borrow::Cow<'a, [u8]>, String> {
    use std::io::Read;
    let mut out = Vec::new();
    let limit = MAX_RECORDED_BYTES as u64 + 1;
    let read = match encoding {
        None => return Ok(body.into()),
        Some("gzip" | "x-gzip") => flate2::read::MultiGzDecoder::new(body).take(limit).read_to_end(&mut out),
        Some("deflate") => flate2::read::ZlibDecoder::new(body).take(limit).read_to_end(&mut out),
        Some(other) => return Err(format!("a body encoded as {other:?}, which the recording does not read")),
    };
    read.map_err(|e| format!("a {} body that does not decode: {e}", encoding.unwrap_or("")))?;
    if out.len() > MAX_RECORDED_BYTES {
        return Err("a body that decodes past the recording's limit".into());
    }
    Ok(out.into())
}

impl Recording {
    fn finish(self, response: &[u8]) {
        let counts = &self.proxy.counts;
        let time = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let bodies = decoded(&self.request, self.request_encoding.as_deref())
            .and_then(|request| Ok((request, decoded(response, self.response_encoding.as_deref())?)));
        let (request, response) = match bodies {
            Ok(bodies) => bodies,
            Err(why) => {
                Counts::add(&counts.skipped, 1);
                tracing::debug!("not recorded: {why}");
                return;
            }
        };
        let mut line = match exchange::record(&request, &response, &time) {
            Ok(line) => line,
            Err(why) => {
                Counts::add(&counts.skipped, 1);
                tracing::debug!("not recorded: {why:?}");
                return;
            }
        };
        match self.proxy.policy.apply(&mut line) {
            Verdict::Keep { masked } => {
                Counts::add(&counts.masked, masked as u64);
            }
            Verdict::DroppedByRule(pattern) => {
                Counts::add(&counts.dropped_by_rule, 1);
                tracing::debug!("not recorded: the redaction rule {pattern:?} matched");
                return;
            }
        }
        let line = line.to_string();
        let sender = self.proxy.to_writer.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let sent = match sender {
            Some(tx) => tx.try_send(line),
            None => Err(TrySendError::Disconnected(line)),
        };
        if let Err(e) = sent {
            let lost = Counts::add(&counts.lost, 1);
            let why = match e {
                TrySendError::Full(_) => "the recording writer is behind",
                TrySendError::Disconnected(_) => "the recording writer has stopped",
            };
            tracing::warn!(lost, "an exchange was not recorded: {why} (the client got its answer)");
        }
    }
}

/// The upstream's body passed on chunk by chunk, kept aside for the recording when it is a chat completion; recorded
/// once it ends whole (a client that goes away, or an upstream that fails mid-way, records nothing).
struct Tee {
    inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    seen: Vec<u8>,
    recorder: Option<Recording>,
}

impl Stream for Tee {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(chunk))) if self.recorder.is_some() => {
                if self.seen.len() + chunk.len() > MAX_RECORDED_BYTES {
                    self.recorder = None;
                    self.seen = Vec::new();
                } else {
                    self.seen.extend_from_slice(chunk);
                }
            }
            Poll::Ready(Some(Err(_))) => self.recorder = None,
            Poll::Ready(None) => {
                if let Some(r) = self.recorder.take() {
                    let seen = std::mem::take(&mut self.seen);
                    r.finish(&seen);
                }
            }
            _ => {}
        }
        polled
    }
}

/// The writer thread: appends each exchange, seals segments by size and age, and seals the last when the channel
/// closes. A failed write loses that exchange (counted) and the next one starts a new segment.
fn write_segments(mut segments: Segments, rx: Receiver<String>, counts: Arc<Counts>) {
    loop {
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => match segments.append(&line) {
                Ok(()) => {
                    Counts::add(&counts.recorded, 1);
                }
                Err(e) => {
                    Counts::add(&counts.lost, 1);
                    tracing::error!("an exchange was not recorded: {e}");
                    let _ = segments.seal();
                }
            },
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if let Err(e) = segments.tick() {
            tracing::error!("cannot seal or retire the recording's segments: {e}");
        }
        counts.retired.store(segments.retired, Ordering::Relaxed);
    }
    if let Err(e) = segments.seal() {
        tracing::error!("cannot seal the recording's last segment: {e}");
    }
}

/// Serves the proxy on `listener` until `stop` resolves; then lets the requests in flight finish, seals the last
/// segment and returns the counts.
pub async fn serve(
    listener: tokio::net::TcpListener,
    settings: ProxySettings,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Arc<Counts>> {
    let segments = Segments::open(&settings.record, settings.rotation, settings.retention)
        .map_err(|e| anyhow::anyhow!("the recording folder {}: {e}", settings.record.display()))?;
    let counts = Arc::new(Counts::default());
    let (tx, rx) = sync_channel(settings.queue.max(1));
    let writer = {
        let counts = counts.clone();
        std::thread::Builder::new()
            .name("proxy-recording".into())
            .spawn(move || write_segments(segments, rx, counts))?
    };
    let proxy = Arc::new(Proxy {
        client: reqwest::Client::builder().build()?,
        upstream: settings.upstream.trim_end_matches('/').to_string(),
        policy: settings.policy,
        to_writer: Mutex::new(Some(tx)),
        counts: counts.clone(),
    });
    let app = axum::Router::new().fallback(forward).with_state(proxy.clone());
    // Without TCP_NODELAY a response written in parts (headers, then the body's chunks) waited for the client's
    // delayed acknowledgement: 40 ms more per request in the local benchmark (BENCHMARKS.md).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, app).with_graceful_shutdown(stop).await?;
    // Closing the channel ends the writer once it has written what it holds.
    proxy.to_writer.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(proxy);
    writer.join().map_err(|_| anyhow::anyhow!("the recording writer panicked"))?;
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// gzip and deflate bodies are read as their text; another encoding, a corrupt body and one that decodes past the
    /// limit are refused (and so not recorded), never guessed at.
    #[test]
    fn encoded_bodies_are_decoded_for_the_recording_or_refused() {
        let text = br#"{"choices": []}"#;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(text).unwrap();
        let gz = gz.finish().unwrap();
        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        zlib.write_all(text).unwrap();
        let zlib = zlib.finish().unwrap();
        assert_eq!(&*decoded(text, None).unwrap(), text);
        assert_eq!(&*decoded(&gz, Some("gzip")).unwrap(), text);
        assert_eq!(&*decoded(&zlib, Some("deflate")).unwrap(), text);
        assert!(decoded(text, Some("br")).unwrap_err().contains("\"br\""));
        assert!(decoded(text, Some("gzip")).is_err(), "not gzip");
        let mut bomb = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        bomb.write_all(&vec![b' '; MAX_RECORDED_BYTES + 10]).unwrap();
        assert!(decoded(&bomb.finish().unwrap(), Some("gzip")).unwrap_err().contains("limit"));
        let mut headers = HeaderMap::new();
        headers.insert(axum::http::header::CONTENT_ENCODING, "GZip".parse().unwrap());
        assert_eq!(content_encoding(&headers).as_deref(), Some("gzip"));
        headers.insert(axum::http::header::CONTENT_ENCODING, "identity".parse().unwrap());
        assert_eq!(content_encoding(&headers), None);
    }
}
