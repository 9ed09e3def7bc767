//! `regenerate` against a real OpenAI-compatible HTTP server started by the test: turn-by-turn replacement,
//! retries, failures left for the next run, resuming after an interruption, and `--local` with the tiny target.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use dflash::data::regenerate::{Endpoint, RegenerateOptions, regenerate_endpoint};
use serde_json::{Map, Value, json};

/// The test server: answers "reply to <last user message> after <n> turns", fails the first attempt of every
/// request with 503, and always fails requests whose last user message contains "poison" while `poison` is set.
#[derive(Default)]
struct Server {
    attempts: HashMap<String, u32>,
    poison: bool,
    requests: Vec<Value>,
}

async fn chat(State(s): State<Arc<Mutex<Server>>>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let mut s = s.lock().unwrap();
    s.requests.push(body.clone());
    let messages = body["messages"].as_array().unwrap();
    let last_user =
        messages.iter().rev().find(|m| m["role"] == "user").unwrap()["content"].as_str().unwrap().to_string();
    let key = body["messages"].to_string();
    let n = s.attempts.entry(key).or_insert(0);
    *n += 1;
    if *n == 1 || (s.poison && last_user.contains("poison")) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "busy"})));
    }
    let assistants = messages.iter().filter(|m| m["role"] == "assistant").count();
    let reply = format!("reply to {last_user} after {assistants} turns");
    (StatusCode::OK, Json(json!({"choices": [{"message": {"role": "assistant", "content": reply}}]})))
}

async fn start(state: Arc<Mutex<Server>>) -> SocketAddr {
    let app = Router::new().route("/v1/chat/completions", post(chat)).with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `n` conversations with string ids `conv-100`, `conv-101`, ...
fn input(path: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let topic = if i == 3 { "poison".to_string() } else { format!("topic {i}") };
            json!({"id": format!("conv-{}", 100 + i), "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": topic},
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": format!("more on {i}")},
                {"role": "assistant", "content": "old answer 2"}
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn read_out(path: &Path) -> HashMap<String, Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["id"].as_str().expect("the id as given, a string").to_string(), v)
        })
        .collect()
}

fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint {
        url: format!("http://{addr}/v1"),
        model: "test-model".into(),
        api_key: None,
        concurrency: 4,
        retries: 2,
        timeout: Duration::from_secs(10),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regenerates_turn_by_turn_with_retries_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    input(&inp, 10);
    // A repeated id is a bad line, named with the line that used it first.
    let mut text = std::fs::read_to_string(&inp).unwrap();
    let first = text.lines().next().unwrap().to_string();
    text.push_str(&first);
    text.push('\n');
    std::fs::write(&inp, text).unwrap();
    let state = Arc::new(Mutex::new(Server { poison: true, ..Server::default() }));
    let addr = start(state.clone()).await;
    let opts = RegenerateOptions {
        input: inp.clone(),
        out: out.clone(),
        max_tokens: 64,
        temperature: 0.0,
        template_kwargs: serde_json::from_value::<Map<String, Value>>(json!({"enable_thinking": false})).unwrap(),
        progress: false,
    };
    let report = regenerate_endpoint(&opts, &endpoint(addr)).await.unwrap();
    assert_eq!((report.conversations, report.regenerated, report.failed), (10, 9, 1), "{report:?}");
    assert_eq!(report.bad_lines, 1);
    assert!(report.examples[0].contains(":11: id \"conv-100\" was already used at line 1"), "{report:?}");
    let written = read_out(&out);
    assert_eq!(written.len(), 9);
    assert!(!written.contains_key("conv-103"), "the failed conversation is not written");
    let c = &written["conv-105"];
    assert_eq!(c["messages"][2]["content"], "reply to topic 5 after 0 turns");
    // The second turn saw the regenerated first turn, not the old one.
    assert_eq!(c["messages"][4]["content"], "reply to more on 5 after 1 turns");
    {
        let s = state.lock().unwrap();
        let second = s
            .requests
            .iter()
            .find(|r| r["messages"].as_array().unwrap().len() == 4 && r["messages"][1]["content"] == "topic 5")
            .unwrap();
        assert_eq!(second["messages"][2]["content"], "reply to topic 5 after 0 turns");
        assert_eq!(second["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(second["model"], "test-model");
    }

    // An interrupted run may leave a torn last line; the rerun drops it, skips what is done, retries the failure.
    let mut text = std::fs::read_to_string(&out).unwrap();
    text.push_str("{\"id\": 999, \"messa");
    std::fs::write(&out, text).unwrap();
    state.lock().unwrap().poison = false;
    let report = regenerate_endpoint(&opts, &endpoint(addr)).await.unwrap();
    assert_eq!((report.already_done, report.regenerated, report.failed), (9, 1, 0), "{report:?}");
    let written = read_out(&out);
    assert_eq!(written.len(), 10);
    assert_eq!(written["conv-103"]["messages"][2]["content"], "reply to poison after 0 turns");
}

#[test]
fn local_regeneration_with_the_tiny_target() {
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    input(&inp, 2);
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(["regenerate", "--local", "--model", "tiny", "--device", "cpu", "--max-tokens", "8"])
            .args(["--input", inp.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .env("DFLASH__LOG__LEVEL", "warn")
            .output()
            .unwrap()
    };
    let o = run();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("tiny has random weights") && said.contains("tiny-tasks"), "a warning: {said}");
    let written = read_out(&out);
    assert_eq!(written.len(), 2);
    for c in written.values() {
        let reply = c["messages"][2]["content"].as_str().unwrap();
        assert_ne!(reply, "old answer");
        assert!(reply.len() <= 8 * 3, "at most 8 byte tokens (each at most one replacement character): {reply:?}");
    }
    let first = std::fs::read_to_string(&out).unwrap();
    let o = run();
    assert!(String::from_utf8_lossy(&o.stdout).contains("2 already done"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), first, "greedy and resumed: nothing changes");
}
