//! `regenerate` against an OpenAI-compatible HTTP server started by the test: turn-by-turn replacement, prompts
//! answered, retries, failures left for the next run, resuming after an interruption, the server checked before the
//! run and dying during it, and `--local` with the tiny target.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use dflash::data::SampleId;
use dflash::data::regenerate::{Endpoint, RegenerateOptions, ShowProgress, regenerate_endpoint, reply_seed};
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
        seed: 0,
        ignore_eos: false,
        template_kwargs: serde_json::from_value::<Map<String, Value>>(json!({"enable_thinking": false})).unwrap(),
        progress: ShowProgress::Off,
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
    // The retried conversation was answered last, but the file lists the input's order (prepare's sample order,
    // and so the training order, follows it).
    let ids: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, (100..110).map(|i| format!("conv-{i}")).collect::<Vec<_>>());
}

/// A server that answers every request at once (no 503s), lists `test-model` at `GET /v1/models`, says a reply
/// to a prompt containing "long" was cut at the token limit, and stops (its runtime, listener and connections gone)
/// after `die_after` replies.
struct Answering {
    replies: usize,
    die_after: usize,
    kill: Option<std::sync::mpsc::Sender<()>>,
    requests: Vec<Value>,
}

async fn answer(State(s): State<Arc<Mutex<Answering>>>, Json(body): Json<Value>) -> Json<Value> {
    let dead = {
        let mut s = s.lock().unwrap();
        s.requests.push(body.clone());
        s.replies += 1;
        if s.replies == s.die_after
            && let Some(kill) = s.kill.take()
        {
            kill.send(()).unwrap();
        }
        s.replies > s.die_after
    };
    if dead {
        // A dead server answers nothing: the request waits until the runtime goes (the connection then drops),
        // however long the server's thread takes to be scheduled and shut it down.
        std::future::pending::<()>().await;
    }
    let last = body["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_string();
    let finish = if last.contains("long") { "length" } else { "stop" };
    Json(json!({"choices": [{"message": {"content": format!("answer to {last}")}, "finish_reason": finish}],
                "usage": {"completion_tokens": 4}}))
}

/// Serves `state` on `addr` (port 0: any) from a runtime of its own, until the handler sends on its kill channel.
fn serve_until_killed(addr: SocketAddr, state: Arc<Mutex<Answering>>) -> SocketAddr {
    let (kill, killed) = std::sync::mpsc::channel();
    state.lock().unwrap().kill = Some(kill);
    let (bound, got) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let models = || async { Json(json!({"object": "list", "data": [{"id": "test-model"}]})) };
            let app = Router::new()
                .route("/v1/chat/completions", post(answer))
                .route("/v1/models", axum::routing::get(models))
                .with_state(state);
            let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
            bound.send(listener.local_addr().unwrap()).unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        });
        let _ = killed.recv();
        runtime.shutdown_background();
    });
    got.recv().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_answered_and_a_server_dying_mid_run_leaves_the_rest_for_a_rerun() {
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (dir.path().join("prompts.jsonl"), dir.path().join("out.jsonl"));
    // 40 prompts without answers (one asking for something long), and one conversation with nobody to answer.
    let mut lines: Vec<String> = (0..40)
        .map(|i| {
            let prompt = if i == 0 { "a long story".to_string() } else { format!("question {i}") };
            json!({"id": i, "messages": [{"role": "user", "content": prompt}]}).to_string()
        })
        .collect();
    lines.push(json!({"id": "greeting", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hello"}]}).to_string());
    std::fs::write(&inp, lines.join("\n") + "\n").unwrap();
    let opts = RegenerateOptions {
        input: inp.clone(),
        out: out.clone(),
        max_tokens: 16,
        temperature: 0.7,
        seed: 3,
        ignore_eos: true,
        template_kwargs: Map::new(),
        progress: ShowProgress::Off,
    };
    let state = Arc::new(Mutex::new(Answering { replies: 0, die_after: 12, kill: None, requests: vec![] }));
    let addr = serve_until_killed("127.0.0.1:0".parse().unwrap(), state.clone());
    let mut at = endpoint(addr);
    at.concurrency = 2;

    // Another model than the one served: refused before anything is asked, naming the one to pass.
    let wrong = Endpoint { model: "Qwen/Qwen3-8B".into(), ..at.clone() };
    let err = regenerate_endpoint(&opts, &wrong).await.unwrap_err().to_string();
    assert!(err.contains("it serves test-model") && err.contains("--model test-model"), "{err}");
    assert!(state.lock().unwrap().requests.is_empty() && !out.exists(), "nothing asked, nothing written");

    // The server dies after 12 replies: what was answered is kept, the rest is left for a rerun, not failed 28 times.
    let first = regenerate_endpoint(&opts, &at).await.unwrap();
    assert_eq!(first.skipped.values().sum::<u64>(), 1, "{first:?}");
    // About 12: a reply or two in flight may still get out while the server's runtime shuts down.
    assert!(first.regenerated >= 10 && first.regenerated <= 12 + at.concurrency as u64, "{first:?}");
    assert!(first.not_tried > 0, "the run stopped asking a server that is gone: {first:?}");
    assert_eq!(first.regenerated + first.failed + first.not_tried, 40, "{first:?}");
    assert!(first.failed <= 8 + 2, "at most the conversations in flight and the ones that found it gone: {first:?}");
    assert!(first.summary().contains("once it is back"), "{}", first.summary());
    let requests = state.lock().unwrap().requests.clone();
    assert!(requests.iter().all(|r| r["ignore_eos"] == true), "--ignore-eos reaches the server");
    let unpenalised = |r: &Value| r["repetition_penalty"] == 1.0 && r["repeat_penalty"] == 1.0;
    assert!(requests.iter().all(unpenalised), "no repetition penalty, under either name");

    // Back on the same port: the rerun does the rest; every prompt answered once.
    let again = Arc::new(Mutex::new(Answering { replies: 0, die_after: usize::MAX, kill: None, requests: vec![] }));
    serve_until_killed(addr, again.clone());
    let second = regenerate_endpoint(&opts, &at).await.unwrap();
    assert_eq!(second.already_done, first.regenerated, "{second:?}");
    assert_eq!(first.regenerated + second.regenerated, 40, "{second:?}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text.lines().count(), 40, "nothing lost, nothing doubled");
    let written: HashMap<i64, Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["id"].as_i64().unwrap(), v))
        .collect();
    assert_eq!(written.len(), 40);
    assert_eq!(written[&7]["messages"][1], json!({"role": "assistant", "content": "answer to question 7"}));
    assert!(!written.values().any(|v| v["id"] == "greeting"), "skipped, not written");
    // Every sampled reply is seeded by its conversation's id and turn, in either run, whatever ran beside it.
    let all = [requests, again.lock().unwrap().requests.clone()].concat();
    for body in &all {
        let prompt = body["messages"][0]["content"].as_str().unwrap();
        let id = prompt.strip_prefix("question ").unwrap_or("0");
        assert_eq!(body["seed"].as_u64(), Some(reply_seed(3, &SampleId::parse(id), 1) >> 1), "{body}");
    }
    let (cut, tokens) = (first.truncated + second.truncated, first.tokens + second.tokens);
    assert_eq!(cut, 0, "with --ignore-eos a reply runs to the limit on purpose, not cut short");
    assert_eq!(tokens, 4 * 40, "the server's usage counts");
}

#[test]
fn local_regeneration_with_the_tiny_target() {
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    input(&inp, 2);
    // A prompt alone gets the reply it asks for.
    let mut text = std::fs::read_to_string(&inp).unwrap();
    text.push_str(&format!("{}\n", json!({"id": "prompt", "messages": [{"role": "user", "content": "count to 3"}]})));
    std::fs::write(&inp, text).unwrap();
    let run_with = |max_tokens: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(["regenerate", "--local", "--model", "tiny", "--device", "cpu", "--max-tokens", max_tokens])
            .args(["--input", inp.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .env("DFLASH__LOG__LEVEL", "warn")
            .output()
            .unwrap()
    };
    let run = || run_with("8");
    let o = run();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("tiny has random weights") && said.contains("tiny-tasks"), "a warning: {said}");
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(summary.contains("3 regenerated now (1 answered from a final prompt)"), "{summary}");
    assert!(summary.contains("\n  generation: ") && summary.contains(" rows on average (of 32)"), "{summary}");
    let written = read_out(&out);
    assert_eq!(written.len(), 3);
    let answered = &written["prompt"]["messages"];
    assert_eq!((answered.as_array().unwrap().len(), &answered[1]["role"]), (2, &json!("assistant")));
    assert!(!answered[1]["content"].as_str().unwrap().is_empty());
    for c in written.values().filter(|c| c["id"] != "prompt") {
        let reply = c["messages"][2]["content"].as_str().unwrap();
        assert_ne!(reply, "old answer");
        assert!(reply.len() <= 8 * 3, "at most 8 byte tokens (each at most one replacement character): {reply:?}");
    }
    let first = std::fs::read_to_string(&out).unwrap();
    let o = run();
    assert!(String::from_utf8_lossy(&o.stdout).contains("3 already done"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), first, "greedy and resumed: nothing changes");

    // The random target rambles: every reply was cut at 8 tokens, and the lines say so. A rerun with a higher limit
    // does them again, in the input's order; one with the same limit leaves them.
    let cut: Vec<&Value> = written.values().map(|c| &c["cut_at_max_tokens"]).collect();
    assert!(cut.iter().all(|&c| c == &json!(8)), "{cut:?}");
    let o = run_with("12");
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("3 regenerated now (1 answered from a final prompt, 3 redone"), "{said}");
    let longer = read_out(&out);
    assert_eq!(longer.len(), 3, "each conversation once");
    for (id, c) in &longer {
        assert_eq!(c["cut_at_max_tokens"], json!(12), "{id}");
        let replies = |c: &Value| -> usize {
            let messages = c["messages"].as_array().unwrap().iter();
            messages.filter(|m| m["role"] == "assistant").map(|m| m["content"].as_str().unwrap().len()).sum()
        };
        assert!(replies(c) > replies(&written[id]), "{id}: the replies grew");
    }
    let ids = |text: &str| text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].clone()).collect();
    let (order_before, order_after): (Vec<Value>, Vec<Value>) =
        (ids(&first), ids(&std::fs::read_to_string(&out).unwrap()));
    assert_eq!(order_before, order_after, "the input's order");
    let o = run_with("12");
    assert!(String::from_utf8_lossy(&o.stdout).contains("3 already done"));

    // An empty input is an error naming it, not a silent run over nothing.
    std::fs::write(&inp, "\n").unwrap();
    let o = run();
    let said = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains("in.jsonl") && said.contains("no conversations"), "{said}");
}
