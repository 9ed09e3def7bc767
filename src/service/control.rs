//! The control plane: one HTTP port (`control.listen`) for operators, Prometheus and tests. `GET /healthz`
//! (liveness: the process answers), `GET /readyz` (readiness: training, with a live drafter), `GET /status`,
//! `GET /metrics` (Prometheus text), `POST /checkpoint`, `POST /reload` (reread the configuration, as SIGHUP does),
//! and with `control.fault_injection = true`, `POST /drafters/{id}/fault` and `POST /targets/{id}/fault`.
use std::net::SocketAddr;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};
use serde::Deserialize;
use serde_json::json;

use super::failure::{FaultKind, FaultRefused};
use super::messages::{DrafterState, SupervisorMsg};

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

/// Asks the supervisor and waits (bounded) for its answer.
async fn ask<T: Send + 'static>(
    sup: &ActorRef<SupervisorMsg>,
    build: impl FnOnce(RpcReplyPort<T>) -> SupervisorMsg,
) -> Result<T, String> {
    match sup.call(build, Some(std::time::Duration::from_millis(TIMEOUT_MS))).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err("timed out".into()),
        Ok(CallResult::SenderError) => Err("no reply".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn unavailable(e: impl std::fmt::Display) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": format!("the supervisor did not answer: {e}")})))
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 while training can go on (running, not stopping, a drafter live, the ledger written, the checkpoint writer
/// not stalled); 503 with the phase and the problems otherwise.
async fn readyz(State(sup): State<ActorRef<SupervisorMsg>>) -> Response {
    match ask(&sup, SupervisorMsg::Status).await {
        Ok(s) if s.ready => (StatusCode::OK, "ready\n").into_response(),
        Ok(s) => {
            let live = s.drafters.iter().filter(|d| d.state == DrafterState::Live).count();
            let body = json!({"ready": false, "phase": s.phase, "drafters_live": live, "problems": s.problems});
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
        Err(e) => unavailable(e),
    }
}

async fn status(State(sup): State<ActorRef<SupervisorMsg>>) -> Response {
    match ask(&sup, SupervisorMsg::Status).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => unavailable(e),
    }
}

async fn checkpoint(State(sup): State<ActorRef<SupervisorMsg>>) -> Response {
    match ask(&sup, SupervisorMsg::CheckpointNow).await {
        Ok(Ok(step)) => (StatusCode::ACCEPTED, Json(json!({"requested": true, "step": step}))).into_response(),
        Ok(Err(e)) => (StatusCode::CONFLICT, Json(json!({"error": e}))).into_response(),
        Err(e) => unavailable(e),
    }
}

async fn reload(State(sup): State<ActorRef<SupervisorMsg>>) -> Response {
    match ask(&sup, |reply| SupervisorMsg::Reload(Some(reply))).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": e}))).into_response(),
        Err(e) => unavailable(e),
    }
}

async fn fault(
    State(sup): State<ActorRef<SupervisorMsg>>,
    Path(id): Path<usize>,
    Json(req): Json<FaultRequest>,
) -> Response {
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
    (code, Json(json!({"error": refused.to_string()}))).into_response()
}

/// `POST /targets/{id}/fault`, optionally with `{"part": N}`: target copy `id` panics at its next capture, where the
/// hidden state enters part N (default 0) of a spread target.
async fn target_fault(
    State(sup): State<ActorRef<SupervisorMsg>>,
    Path(id): Path<usize>,
    body: axum::body::Bytes,
) -> Response {
    // An empty body (curl -X POST) is part 0.
    let part = match body.iter().all(u8::is_ascii_whitespace) {
        true => 0,
        false => match serde_json::from_slice::<TargetFaultRequest>(&body) {
            Ok(r) => r.part,
            Err(e) => {
                let error = format!("the body must be empty or {{\"part\": N}}: {e}");
                return (StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response();
            }
        },
    };
    match ask(&sup, |reply| SupervisorMsg::TargetFault { id, part, reply }).await {
        Ok(Ok(())) => Json(json!({"injected": "panic", "target": id, "part": part})).into_response(),
        Ok(Err(refused)) => refused_response(refused),
        Err(e) => unavailable(e),
    }
}

/// Serves the control plane on `addr` until the process ends.
pub async fn serve(
    addr: SocketAddr,
    supervisor: ActorRef<SupervisorMsg>,
    prometheus: PrometheusHandle,
) -> std::io::Result<SocketAddr> {
    let metrics = move || {
        let text = prometheus.render();
        async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text) }
    };
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/checkpoint", post(checkpoint))
        .route("/reload", post(reload))
        .route("/drafters/{id}/fault", post(fault))
        .route("/targets/{id}/fault", post(target_fault))
        .with_state(supervisor);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("control plane stopped: {e}");
        }
    });
    Ok(bound)
}
