//! The control plane: one HTTP port (`control.listen`) for operators, Prometheus and tests. `GET /` (the live page:
//! [`super::live`]), `GET /healthz` (liveness: the process answers), `GET /readyz` (readiness: training, with a live
//! drafter), `GET /status`, `GET /history` (the live page's charts and events), `GET /metrics` (Prometheus text), `POST /checkpoint`, `POST /reload` (reread the configuration, as SIGHUP does),
//! `POST /publish` (publish the run's best checkpoint now, with `[publish]` set: [`super::publish`]), and with `control.fault_injection = true`, `POST /drafters/{id}/fault` and `POST /targets/{id}/fault`.
//!
//! The read-only endpoints may also be served alone on an address of their own (`control.read_only_listen`, for
//! Prometheus in a cluster). The `POST` endpoints change the run, so they take a bearer token: always when one is
//! set (`DFLASH_CONTROL_TOKEN`, or the file `control.token_file`; never a configuration value, since the
//! configuration is copied into every checkpoint and reload diff), and on a listener that is not loopback they answer
//! 401 without one.
//!
//! The control plane is served before the supervisor exists, while a host of several waits for the others: `/healthz`
//! answers, `/status` and `/readyz` say the phase (`rendezvous`) and what it waits for ([`Supervised`]).
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use serde::Deserialize;
use serde_json::json;

use super::failure::{FaultKind, FaultRefused};
use super::live::{self, LiveView};
use super::messages::SupervisorMsg;
use super::publish;
use super::status::{DrafterState, Status};
use crate::config::PublishSettings;

const TIMEOUT_MS: u64 = 5000;

#[derive(Deserialize)]
struct FaultRequest {
    kind: FaultKind,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetFaultRequest {
    #[serde(default)]
    part: usize,
}

/// What the control plane asks: the supervisor once it runs; before that, a status saying the phase the process is
/// in, what it waits for and where the run stands ([`Status::before_start`]).
pub struct Supervised {
    supervisor: OnceLock<ActorRef<SupervisorMsg>>,
    before: Status,
    /// What the live page draws besides the status.
    live: Arc<LiveView>,
    /// Where `POST /publish` publishes and `/status` reads what is published (`[publish]`), and the checkpoints'
    /// folder whose best it publishes.
    publishing: Option<(PublishSettings, std::path::PathBuf)>,
}

impl Supervised {
    /// Before the supervisor: `/status` answers `before`; `/history` reads `live`.
    pub fn before(
        before: Status,
        live: Arc<LiveView>,
        publishing: Option<(PublishSettings, std::path::PathBuf)>,
    ) -> Arc<Self> {
        Arc::new(Supervised { supervisor: OnceLock::new(), before, live, publishing })
    }

    /// The supervisor runs: every request goes to it from now on.
    pub fn started(&self, supervisor: ActorRef<SupervisorMsg>) {
        let _ = self.supervisor.set(supervisor);
    }
}

/// Why the supervisor gave no answer.
enum Unanswered {
    /// It does not run yet: what `/status` says meanwhile.
    NotYet(Box<Status>),
    Failed(String),
}

/// Asks the supervisor and waits (bounded) for its answer.
async fn ask<T: Send + 'static>(
    sup: &Supervised,
    build: impl FnOnce(RpcReplyPort<T>) -> SupervisorMsg,
) -> Result<T, Unanswered> {
    let Some(sup) = sup.supervisor.get() else {
        return Err(Unanswered::NotYet(Box::new(sup.before.clone())));
    };
    match sup.call(build, Some(std::time::Duration::from_millis(TIMEOUT_MS))).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Unanswered::Failed("timed out".into())),
        Ok(CallResult::SenderError) => Err(Unanswered::Failed("no reply".into())),
        Err(e) => Err(Unanswered::Failed(e.to_string())),
    }
}

/// An error answer: every error of the control plane has this one shape, `{"error": "..."}`.
fn error(code: StatusCode, message: impl Into<String>) -> Response {
    (code, Json(json!({ "error": message.into() }))).into_response()
}

fn unavailable(e: Unanswered) -> Response {
    let message = match e {
        Unanswered::NotYet(s) => format!("not training yet ({}): {}", s.phase, s.problems.join("; ")),
        Unanswered::Failed(e) => format!("the supervisor did not answer: {e}"),
    };
    error(StatusCode::SERVICE_UNAVAILABLE, message)
}

/// The endpoints of each listener, for the answer to a path or method it does not serve.
const READ_ONLY_ENDPOINTS: &str = "GET / (the live page), /healthz, /readyz, /status, /history, /metrics";
const ALL_ENDPOINTS: &str = "GET / (the live page), /healthz, /readyz, /status, /history, /metrics; POST /checkpoint, \
     /reload, /publish, /drafters/{id}/fault, /targets/{id}/fault";

/// Answers for a path no endpoint has (404) and a method its endpoint does not take (405), in the errors' shape.
fn with_error_fallbacks(router: Router, endpoints: &'static str) -> Router {
    router
        .method_not_allowed_fallback(move |method: Method, uri: Uri| async move {
            let message = format!("{} does not take {method}: the endpoints are {endpoints}", uri.path());
            error(StatusCode::METHOD_NOT_ALLOWED, message)
        })
        .fallback(move |method: Method, uri: Uri| async move {
            error(StatusCode::NOT_FOUND, format!("no endpoint {method} {}: the endpoints are {endpoints}", uri.path()))
        })
}

/// A path's id that is not a number.
fn bad_id(what: &str, rejection: PathRejection) -> Response {
    error(StatusCode::BAD_REQUEST, format!("the {what} id must be a number: {}", rejection.body_text()))
}

type Sup = State<Arc<Supervised>>;

/// The supervisor's status; before it runs, [`Status::before_start`]'s with the pid, so that `/status` and `/readyz`
/// read the same either way.
async fn status_of(sup: &Supervised) -> Result<Status, Unanswered> {
    match ask(sup, SupervisorMsg::Status).await {
        Err(Unanswered::NotYet(before)) => Ok(Status { pid: std::process::id(), ..*before }),
        answer => answer,
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 while training can go on (running, not stopping, a drafter live, the ledger written, the checkpoint writer
/// not stalled); 503 with the phase and the problems otherwise.
async fn readyz(State(sup): Sup) -> Response {
    match status_of(&sup).await {
        Ok(s) if s.ready => (StatusCode::OK, "ready\n").into_response(),
        Ok(s) => {
            let live = s.drafters.iter().filter(|d| d.state == DrafterState::Live).count();
            let body = json!({"ready": false, "phase": s.phase, "drafters_live": live, "problems": s.problems});
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
        Err(e) => unavailable(e),
    }
}

/// `GET /history`: what the live page charts and lists ([`LiveView::history`]).
async fn history(State(sup): Sup) -> Response {
    let live = sup.live.clone();
    // It reads evals.jsonl: off the runtime's threads.
    match tokio::task::spawn_blocking(move || live.history()).await {
        Ok(h) => Json(h).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("reading the history failed: {e}")),
    }
}

/// The live page and its chart library: fixed texts in the binary.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// The status, with (under `[publish]`) the version `publish.dir/current` points at and why it was published.
async fn status(State(sup): Sup) -> Response {
    let s = match status_of(&sup).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let Some(dir) = sup.publishing.as_ref().and_then(|(p, _)| p.dir.clone()) else { return Json(s).into_response() };
    let mut answer = json!(s);
    answer["published"] = match tokio::task::spawn_blocking(move || publish::current(&dir)).await {
        Ok(Ok(current)) => json!(current),
        Ok(Err(e)) => json!({ "error": format!("{e:#}") }),
        Err(e) => json!({ "error": e.to_string() }),
    };
    Json(answer).into_response()
}

/// `POST /publish`: the run's best checkpoint (`checkpoint.dir/best`) published now as the next version, whatever
/// `publish.margin` says. 201 with the publication; 409 when there is nothing to publish or `[publish]` is off.
async fn publish_now(State(sup): Sup) -> Response {
    let Some((settings, root)) = sup.publishing.clone().filter(|(p, _)| p.dir.is_some()) else {
        let why = "publish.dir is not set: nothing is published (set [publish] dir in the configuration and restart)";
        return error(StatusCode::CONFLICT, why);
    };
    let published = tokio::task::spawn_blocking(move || {
        let (best, evaluated) = super::evaluator::best_evaluated(&root)?;
        publish::publish(&settings, &best, &evaluated.measured(), None, Some("forced: POST /publish"))
    })
    .await;
    match published {
        Ok(Ok(Ok(p))) => {
            tracing::info!(version = p.version, step = p.step, "published by POST /publish");
            crate::telemetry::publication(p.version, p.decode_acceptance_length);
            (StatusCode::CREATED, Json(p)).into_response()
        }
        Ok(Ok(Err(why))) => error(StatusCode::CONFLICT, why),
        Ok(Err(e)) => error(StatusCode::CONFLICT, format!("{e:#}")),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("publishing failed: {e}")),
    }
}

async fn checkpoint(State(sup): Sup) -> Response {
    match ask(&sup, SupervisorMsg::CheckpointNow).await {
        Ok(Ok(step)) => (StatusCode::ACCEPTED, Json(json!({"requested": true, "step": step}))).into_response(),
        Ok(Err(e)) => (StatusCode::CONFLICT, Json(json!({"error": e}))).into_response(),
        Err(e) => unavailable(e),
    }
}

async fn reload(State(sup): Sup) -> Response {
    match ask(&sup, |reply| SupervisorMsg::Reload(Some(reply))).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => error(StatusCode::UNPROCESSABLE_ENTITY, e),
        Err(e) => unavailable(e),
    }
}

async fn fault(
    State(sup): Sup,
    id: Result<Path<usize>, PathRejection>,
    req: Result<Json<FaultRequest>, JsonRejection>,
) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(rejection) => return bad_id("drafter", rejection),
    };
    let req = match req {
        Ok(Json(req)) => req,
        Err(rejection) => {
            let message = format!("the body must be {{\"kind\": KIND}}: {}", rejection.body_text());
            return error(rejection.status(), message);
        }
    };
    match ask(&sup, |reply| SupervisorMsg::Fault { id, kind: req.kind, reply }).await {
        Ok(Ok(())) => Json(json!({"injected": req.kind, "drafter": id})).into_response(),
        Ok(Err(refused)) => refused_response(refused),
        Err(e) => unavailable(e),
    }
}

fn refused_response(refused: FaultRefused) -> Response {
    let code = match refused {
        FaultRefused::Off => StatusCode::FORBIDDEN,
        FaultRefused::NoSuchDrafter { .. } | FaultRefused::NoSuchTarget { .. } | FaultRefused::NoSuchPart { .. } => {
            StatusCode::NOT_FOUND
        }
        FaultRefused::Conflict(_) => StatusCode::CONFLICT,
    };
    error(code, refused.to_string())
}

/// `POST /targets/{id}/fault`, optionally with `{"part": N}`: target copy `id` panics at its next capture, where the
/// hidden state enters part N (default 0) of a spread target.
async fn target_fault(State(sup): Sup, id: Result<Path<usize>, PathRejection>, body: axum::body::Bytes) -> Response {
    let Path(id) = match id {
        Ok(id) => id,
        Err(rejection) => return bad_id("target copy", rejection),
    };
    // An empty body (curl -X POST) is part 0.
    let part = match body.iter().all(u8::is_ascii_whitespace) {
        true => 0,
        false => match serde_json::from_slice::<TargetFaultRequest>(&body) {
            Ok(r) => r.part,
            Err(e) => {
                return error(StatusCode::BAD_REQUEST, format!("the body must be empty or {{\"part\": N}}: {e}"));
            }
        },
    };
    match ask(&sup, |reply| SupervisorMsg::TargetFault { id, part, reply }).await {
        Ok(Ok(())) => Json(json!({"injected": "panic", "target": id, "part": part})).into_response(),
        Ok(Err(refused)) => refused_response(refused),
        Err(e) => unavailable(e),
    }
}

/// The environment variable holding the control plane's bearer token.
pub const TOKEN_ENV: &str = "DFLASH_CONTROL_TOKEN";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{TOKEN_ENV} is set but empty: set it to the token, or unset it")]
    EmptyEnv,
    #[error("control.token_file = {path}: {source}")]
    Unreadable { path: std::path::PathBuf, source: std::io::Error },
    #[error("control.token_file = {path} is empty: write the token into it")]
    EmptyFile { path: std::path::PathBuf },
}

/// The bearer token of the `POST` endpoints: `DFLASH_CONTROL_TOKEN` (read through `env`), else the content of
/// `control.token_file`, trimmed; `None` when neither is set.
pub fn token(
    settings: &crate::config::ControlSettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Arc<str>>, TokenError> {
    if let Some(value) = env(TOKEN_ENV) {
        return match value.trim() {
            "" => Err(TokenError::EmptyEnv),
            token => Ok(Some(Arc::from(token))),
        };
    }
    let Some(path) = &settings.token_file else { return Ok(None) };
    let text = std::fs::read_to_string(path).map_err(|source| TokenError::Unreadable { path: path.clone(), source })?;
    match text.trim() {
        "" => Err(TokenError::EmptyFile { path: path.clone() }),
        token => Ok(Some(Arc::from(token))),
    }
}

/// Who may use the `POST` endpoints of a listener.
#[derive(Debug, Clone)]
pub struct Access {
    /// The bearer token, when one is set.
    pub token: Option<Arc<str>>,
    /// The listener is on a loopback address (only this machine reaches it).
    pub loopback: bool,
}

/// Why a request to a `POST` endpoint is refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// A token is set and the request did not carry it.
    WrongToken,
    /// No token is set, and the listener is reachable from other machines.
    NoTokenSet,
}

impl Refused {
    fn message(&self) -> &'static str {
        match self {
            Refused::WrongToken => {
                "this endpoint needs the header \"Authorization: Bearer <token>\" with the token \
                                    set in DFLASH_CONTROL_TOKEN or control.token_file"
            }
            Refused::NoTokenSet => {
                "control.listen is not a loopback address, so POST endpoints need a token: set \
                                    DFLASH_CONTROL_TOKEN (or control.token_file) and send \"Authorization: Bearer \
                                    <token>\"; or listen on 127.0.0.1 and serve /metrics on control.read_only_listen"
            }
        }
    }
}

/// Whether a request with this `Authorization` header may use a `POST` endpoint.
pub fn authorize(access: &Access, authorization: Option<&str>) -> Result<(), Refused> {
    use subtle::ConstantTimeEq;
    match &access.token {
        Some(token) => {
            let given = authorization.and_then(|h| h.strip_prefix("Bearer ")).unwrap_or("").trim();
            // Compared in constant time: how long a wrong guess took says nothing about the token.
            match bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
                true => Ok(()),
                false => Err(Refused::WrongToken),
            }
        }
        None if access.loopback => Ok(()),
        None => Err(Refused::NoTokenSet),
    }
}

async fn require_token(State(access): State<Access>, headers: HeaderMap, request: Request, next: Next) -> Response {
    // Only POST changes anything: another method is answered 405 by the router, not refused for want of a token.
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match authorize(&access, authorization) {
        Ok(()) => next.run(request).await,
        Err(refused) => {
            let mut answer = error(StatusCode::UNAUTHORIZED, refused.message());
            answer.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            answer
        }
    }
}

/// The read-only endpoints.
fn read_only(supervisor: Arc<Supervised>, prometheus: PrometheusHandle) -> Router {
    let metrics = move || {
        let text = prometheus.render();
        async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text) }
    };
    Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", live::PAGE) }))
        .route("/assets/uplot.js", get(|| async { asset("text/javascript; charset=utf-8", live::UPLOT_JS) }))
        .route("/assets/uplot.css", get(|| async { asset("text/css; charset=utf-8", live::UPLOT_CSS) }))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/history", get(history))
        .route("/metrics", get(metrics))
        .with_state(supervisor)
}

/// Binds a control-plane address: at start, before any long work, so that an address in use is found at once.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Serves the whole control plane on `listener` (from [`bind`]) until the process ends (a task on the current tokio
/// runtime); `token`: the bearer token of the `POST` endpoints, if one is set.
pub fn serve(
    listener: std::net::TcpListener,
    supervisor: Arc<Supervised>,
    prometheus: PrometheusHandle,
    token: Option<Arc<str>>,
) -> std::io::Result<SocketAddr> {
    let access = Access { token, loopback: listener.local_addr()?.ip().is_loopback() };
    let mutating = Router::new()
        .route("/checkpoint", post(checkpoint))
        .route("/reload", post(reload))
        .route("/publish", post(publish_now))
        .route("/drafters/{id}/fault", post(fault))
        .route("/targets/{id}/fault", post(target_fault))
        .route_layer(middleware::from_fn_with_state(access, require_token))
        .with_state(supervisor.clone());
    listen(listener, with_error_fallbacks(read_only(supervisor, prometheus).merge(mutating), ALL_ENDPOINTS))
}

/// Serves only the read-only endpoints on `listener` (`control.read_only_listen`).
pub fn serve_read_only(
    listener: std::net::TcpListener,
    supervisor: Arc<Supervised>,
    prometheus: PrometheusHandle,
) -> std::io::Result<SocketAddr> {
    listen(listener, with_error_fallbacks(read_only(supervisor, prometheus), READ_ONLY_ENDPOINTS))
}

fn listen(listener: std::net::TcpListener, app: Router) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("control plane stopped: {e}");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(token: Option<&str>, loopback: bool) -> Access {
        Access { token: token.map(Arc::from), loopback }
    }

    /// A set token is always required; without one, loopback listeners are open and others refuse every request.
    #[test]
    fn post_endpoints_need_the_token_off_loopback_and_whenever_one_is_set() {
        let open = access(None, true);
        assert_eq!(authorize(&open, None), Ok(()));
        let exposed = access(None, false);
        assert_eq!(authorize(&exposed, None), Err(Refused::NoTokenSet));
        assert_eq!(authorize(&exposed, Some("Bearer anything")), Err(Refused::NoTokenSet));
        for loopback in [true, false] {
            let guarded = access(Some("s3cret"), loopback);
            assert_eq!(authorize(&guarded, Some("Bearer s3cret")), Ok(()));
            assert_eq!(authorize(&guarded, None), Err(Refused::WrongToken));
            assert_eq!(authorize(&guarded, Some("Bearer s3cre")), Err(Refused::WrongToken));
            assert_eq!(authorize(&guarded, Some("Bearer s3cret2")), Err(Refused::WrongToken));
            assert_eq!(authorize(&guarded, Some("s3cret")), Err(Refused::WrongToken), "the scheme is required");
            assert_eq!(authorize(&guarded, Some("Bearer ")), Err(Refused::WrongToken));
        }
    }

    /// Before the supervisor runs, `/status` says where a resumed run stands (the step and checkpoint it resumes,
    /// as the supervisor will), not step 0, and what the process waits for; a new run says step 0 and no checkpoint.
    #[test]
    fn before_the_supervisor_status_says_where_a_resumed_run_stands() {
        let loader = crate::data::loader::LoaderState { epoch: 2, next_ordinal: 5, owed: vec![] };
        let mut state = crate::train::checkpoint::TrainerState::new(12, loader, json!({}));
        state.samples_committed = 96;
        let checkpoint = std::path::Path::new("/ckpt/ckpt-000000012");
        let sup = Supervised::before(
            Status::before_start("starting", "starting".into(), Some((checkpoint, &state))),
            LiveView::new(std::env::temp_dir()),
            None,
        );
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let Ok(s) = runtime.block_on(status_of(&sup)) else { panic!("no answer before the supervisor runs") };
        assert_eq!((s.phase.as_str(), s.step, s.epoch, s.samples_committed, s.ready), ("starting", 12, 2, 96, false));
        assert_eq!(s.pid, std::process::id());
        let c = s.last_checkpoint.expect("the checkpoint it resumes");
        assert_eq!((c.step, c.path.as_str()), (12, "/ckpt/ckpt-000000012"));

        let fresh = Status::before_start("rendezvous", "waiting for rank 0's store".into(), None);
        assert_eq!((fresh.step, fresh.last_checkpoint.is_none()), (0, true));
        assert_eq!(fresh.problems, ["waiting for rank 0's store"]);
    }

    /// The environment wins over the file; blank values are errors, not "no token".
    async fn body(answer: impl std::future::Future<Output = Response>) -> (StatusCode, serde_json::Value) {
        let answer = answer.await;
        let code = answer.status();
        let bytes = axum::body::to_bytes(answer.into_body(), 1 << 20).await.unwrap();
        (code, serde_json::from_slice(&bytes).unwrap())
    }

    /// `POST /publish` publishes the run's best checkpoint as the next version and `/status` then names it; without
    /// an evaluated checkpoint, or with `[publish]` off, the answer says why.
    #[test]
    fn post_publish_publishes_the_best_checkpoint_and_status_names_it() {
        let root = tempfile::tempdir().unwrap();
        let (checkpoints, out) = (root.path().join("run"), root.path().join("published"));
        let settings = PublishSettings { dir: Some(out.clone()), keep: 3, margin: 0.05 };
        let supervised = |publishing| {
            let before = Status::before_start("starting", "starting".into(), None);
            Supervised::before(before, LiveView::new(checkpoints.clone()), publishing)
        };
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (code, answer) = runtime.block_on(body(publish_now(State(supervised(None)))));
        assert_eq!(code, StatusCode::CONFLICT);
        assert!(answer["error"].as_str().unwrap().contains("publish.dir"), "{answer}");
        let sup = supervised(Some((settings, checkpoints.clone())));
        let (code, answer) = runtime.block_on(body(publish_now(State(sup.clone()))));
        assert_eq!(code, StatusCode::CONFLICT);
        assert!(answer["error"].as_str().unwrap().contains("no evaluated checkpoint yet"), "{answer}");

        let best = checkpoints.join(crate::service::evaluator::BEST_DIR);
        let cfg = crate::model::DrafterConfig::for_preset(crate::model::Preset::Tiny, 2);
        let drafter =
            crate::model::Drafter::new(cfg, tch::Device::Cpu, tch::Kind::Float, crate::model::Init::Portable(1))
                .unwrap();
        drafter.save(&best.join(crate::train::checkpoint::DRAFTER_DIR), tch::Kind::Float).unwrap();
        let evaluated = crate::service::evaluator::Evaluated::lossless_at(30, 2.25);
        std::fs::write(best.join(crate::service::evaluator::EVAL_FILE), serde_json::to_vec(&evaluated).unwrap())
            .unwrap();
        let (code, answer) = runtime.block_on(body(publish_now(State(sup.clone()))));
        assert_eq!(code, StatusCode::CREATED, "{answer}");
        assert_eq!((answer["version"].as_u64(), answer["step"].as_u64()), (Some(1), Some(30)));
        let (code, status) = runtime.block_on(body(status(State(sup))));
        assert_eq!(code, StatusCode::OK);
        assert_eq!(status["published"]["version"], json!(1));
        assert!(status["published"]["why"].as_str().unwrap().contains("POST /publish"), "{status}");
        assert!(out.join(publish::CURRENT).join("config.json").exists());
    }

    #[test]
    fn the_token_comes_from_the_environment_or_else_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let mut settings = crate::config::Config::builtin().unwrap().control;
        let none = |_: &str| None;
        assert_eq!(token(&settings, none).unwrap(), None);
        settings.token_file = Some(file.clone());
        assert_eq!(token(&settings, none).unwrap().as_deref(), Some("from-file"));
        let env = |k: &str| (k == TOKEN_ENV).then(|| " from-env ".to_string());
        assert_eq!(token(&settings, env).unwrap().as_deref(), Some("from-env"));
        let blank = |_: &str| Some(String::new());
        assert!(matches!(token(&settings, blank), Err(TokenError::EmptyEnv)));
        std::fs::write(&file, " \n").unwrap();
        assert!(matches!(token(&settings, none), Err(TokenError::EmptyFile { .. })));
        settings.token_file = Some(dir.path().join("missing"));
        let err = token(&settings, none).unwrap_err().to_string();
        assert!(err.contains("control.token_file") && err.contains("missing"), "{err}");
    }
}
