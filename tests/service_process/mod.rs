//! The harness of the whole-process tests: `serve-train` as a real process with its control plane, sample data
//! prepared once, and helpers to read its status, logs, ledger and metrics.
#![allow(dead_code)]

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub const BIN: &str = env!("CARGO_BIN_EXE_dflash");

/// The status of a run SIGTERM stopped before completion, after its checkpoint: restartable, not success.
pub const STOPPED: i32 = 143;

/// Prepared sample data shared by the tests of this file (made once): the built-in sample conversations, every
/// other one in ShareGPT form with a string id (as public chat sets give them), the rest with integer ids.
pub fn prepared() -> &'static PathBuf {
    static DATA: OnceLock<PathBuf> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("service-data");
        std::fs::create_dir_all(&dir).unwrap();
        let conversations = dir.join("conversations.jsonl");
        let run = |args: &[&str]| {
            let o = Command::new(BIN).args(args).env("DFLASH__LOG__LEVEL", "warn").output().unwrap();
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        };
        run(&["sample-data", "--count", "160", "--seed", "3", "--out", conversations.to_str().unwrap()]);
        let mixed: Vec<String> = std::fs::read_to_string(&conversations)
            .unwrap()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                let id = v["id"].as_u64().unwrap();
                if id % 2 == 1 {
                    return l.to_string();
                }
                sharegpt(&v, json!(format!("sg-{id:04x}_0"))).to_string()
            })
            .collect();
        std::fs::write(&conversations, mixed.join("\n") + "\n").unwrap();
        let out = dir.join("prepared");
        run(&[
            "prepare",
            "--model",
            "tiny",
            "--input",
            conversations.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--max-len",
            "192",
            "--block-size",
            "4",
            "--holdout",
            "0.1",
            // A folder of this fixture's, made again by every test binary (an earlier build's may be there).
            "--force",
        ]);
        out
    })
}

/// An OpenAI-form conversation (`{"messages": [{"role", "content"}]}`) in ShareGPT form, with `id`:
/// `{"id", "conversations": [{"from", "value"}]}`, roles as ShareGPT names them.
pub fn sharegpt(conversation: &Value, id: Value) -> Value {
    let turns: Vec<Value> = conversation["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let from = match m["role"].as_str().unwrap() {
                "user" => "human",
                "assistant" => "gpt",
                other => other,
            };
            json!({"from": from, "value": m["content"]})
        })
        .collect();
    json!({"id": id, "conversations": turns})
}

/// A run's configuration in `dir` (tests add `--set` overrides when they start it).
pub fn config(dir: &Path, drafters: usize) -> PathBuf {
    let devices = vec!["\"cpu\""; drafters].join(", ");
    let text = format!(
        r#"
[target]
model = "tiny"
device = "cpu"
[draft_model]
num_hidden_layers = 1
block_size = 4
[drafters]
devices = [{devices}]
[data]
path = "{data}"
batch_size = 2
ledger = "{ledger}"
[objective]
num_anchors = 8
gamma = 2.0
[optim]
lr = 2e-3
warmup_ratio = 0.0
epochs = 1
[checkpoint]
dir = "{ckpt}"
every_steps = 0
keep = 3
[supervision]
backoff_initial_ms = 100
backoff_max_ms = 400
step_timeout_s = 3
check_replicas_every = 1
[control]
listen = "127.0.0.1:0"
fault_injection = true
[log]
format = "json"
every_steps = 5
"#,
        data = prepared().display(),
        ledger = dir.join("ledger.jsonl").display(),
        ckpt = dir.join("ckpt").display(),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

pub struct Service {
    pub child: Child,
    pub addr: SocketAddr,
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl Service {
    pub fn start(config: &Path, resume: bool, sets: &[&str]) -> Self {
        Self::start_with_env(config, resume, sets, &[])
    }

    /// With these environment variables set.
    pub fn start_with_env(config: &Path, resume: bool, sets: &[&str], env: &[(&str, &str)]) -> Self {
        let mut service = Self::spawn(config, resume, sets, env);
        service.addr = service.address("address");
        service
    }

    /// With `--resume auto`, without waiting for the control plane (a service waiting for its checkpoint folder
    /// serves none yet).
    pub fn start_waiting(config: &Path, sets: &[&str]) -> Self {
        Self::spawn(config, true, sets, &[])
    }

    fn spawn(config: &Path, resume: bool, sets: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.envs(env.iter().copied());
        cmd.args(["--config", config.to_str().unwrap(), "serve-train"]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        if resume {
            cmd.args(["--resume", "auto"]);
        }
        let mut child = cmd.env_remove("RUST_LOG").stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Service { child, addr: SocketAddr::from(([127, 0, 0, 1], 0)), logs }
    }

    /// The address the service logged in the field `field` (`address`: the control plane's), once it did.
    pub fn address(&mut self, field: &str) -> SocketAddr {
        let started = Instant::now();
        loop {
            let found = self.logs.lock().unwrap().iter().find_map(|l| {
                let v: Value = serde_json::from_str(l).ok()?;
                v["fields"][field].as_str()?.parse().ok()
            });
            if let Some(a) = found {
                return a;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the service exited ({status}) before serving: {:#?}", self.logs.lock().unwrap());
            }
            assert!(started.elapsed() < Duration::from_secs(120), "no control plane: {:#?}", self.logs.lock().unwrap());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A request to the control plane; (status, JSON body or null).
    pub fn request(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (code, payload) = self.http(method, path, &body.map(|b| b.to_string()).unwrap_or_default());
        (code, serde_json::from_str(&payload).unwrap_or(Value::Null))
    }

    /// A request to the control plane; a failure to connect saves the log and says what the service last logged.
    pub fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        http(self.addr, method, path, body).unwrap_or_else(|e| {
            let logs = self.logs.lock().unwrap().join("\n");
            let _ = std::fs::write(Path::new(env!("CARGO_TARGET_TMPDIR")).join("service-failure.log"), logs);
            panic!("control plane unreachable ({e}); last log lines: {:#?}", self.tail(30))
        })
    }

    pub fn status(&self) -> Value {
        self.request("GET", "/status", None).1
    }

    pub fn fault(&self, id: usize, kind: &str) {
        let (code, v) = self.request("POST", &format!("/drafters/{id}/fault"), Some(json!({"kind": kind})));
        assert_eq!(code, 200, "{v}");
    }

    /// Polls the status until `pred` holds.
    pub fn wait(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        self.poll(what, Self::status, pred)
    }

    /// Reads `fetch` until `pred` holds; fails if the service exits or two minutes pass.
    pub fn poll<T: std::fmt::Display>(
        &mut self,
        what: &str,
        fetch: impl Fn(&Self) -> T,
        pred: impl Fn(&T) -> bool,
    ) -> T {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("exited ({status}) while waiting for {what}: {:#?}", self.tail(40));
            }
            let seen = fetch(self);
            if pred(&seen) {
                return seen;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "timed out waiting for {what}: {seen:#}\n{:#?}",
                self.tail(40)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn exit_code(mut self) -> (i32, Vec<String>) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                let logs = self.logs.lock().unwrap().clone();
                use std::os::unix::process::ExitStatusExt;
                if let Some(sig) = status.signal() {
                    eprintln!(
                        "the service died of signal {sig}; last lines: {:#?}",
                        &logs[logs.len().saturating_sub(15)..]
                    );
                }
                return (status.code().unwrap_or(-1), logs);
            }
            assert!(started.elapsed() < Duration::from_secs(180), "the run did not end: {:#?}", self.tail(40));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn signal(&self, sig: &str) {
        Command::new("kill").args([sig, &self.child.id().to_string()]).status().unwrap();
    }

    pub fn tail(&self, n: usize) -> Vec<String> {
        let logs = self.logs.lock().unwrap();
        logs[logs.len().saturating_sub(n)..].to_vec()
    }
}

impl Service {
    /// SIGTERM: the run checkpoints and stops before completion ([`STOPPED`]). Returns its logs.
    pub fn stop(self) -> Vec<String> {
        self.signal("-TERM");
        let (code, logs) = self.exit_code();
        assert_eq!(code, STOPPED, "{:#?}", &logs[logs.len().saturating_sub(10)..]);
        logs
    }

    /// `--resume auto` of the run `config` and `sets` describe: it runs again from step `at` (a checkpoint known to
    /// be written) or later, then stops on SIGTERM.
    pub fn resumes_from(config: &Path, sets: &[&str], at: u64) {
        let mut again = Service::start(config, true, sets);
        let s = again.wait("resumed", |s| s["phase"] == "running");
        assert!(step(&s) >= at, "resumed at step {} below the checkpoint of step {at}", step(&s));
        again.stop();
    }
}

/// A test that fails leaves no service behind (a host of a run of several would wait for the others for minutes).
impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn step(s: &Value) -> u64 {
    s["step"].as_u64().unwrap()
}

pub fn drafter(s: &Value, id: usize) -> &Value {
    &s["drafters"][id]
}

pub fn logged(logs: &[String], text: &str) -> bool {
    logs.iter().any(|l| l.contains(text))
}

/// Steps of the checkpoints a run's log reports written.
pub fn checkpoints_written(logs: &[String]) -> Vec<u64> {
    logs.iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "checkpoint written")
        .filter_map(|v| v["fields"]["step"].as_u64())
        .collect()
}

pub fn state(s: &Value, id: usize) -> String {
    drafter(s, id)["state"].as_str().unwrap().to_string()
}

/// Every epoch of the ledger that was trained to its end holds each sample of `ids` (the split's ids, as JSON) exactly
/// once; none holds one twice or one that is not in `ids`. Returns the number of complete epochs.
/// The ledger's entries that stand (none where there is no ledger yet): a rewind (no live replica left, or a resume
/// behind the last line) undoes the entries of its step and later.
pub fn ledger_entries(ledger: &Path) -> Vec<Value> {
    let mut entries: Vec<Value> = Vec::new();
    for line in std::fs::read_to_string(ledger).unwrap_or_default().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        match v["rewind_to_step"].as_u64() {
            Some(to) => entries.retain(|e| e["step"].as_u64().unwrap() < to),
            None => entries.push(v),
        }
    }
    entries
}

pub fn assert_exactly_once(ledger: &Path, ids: &[String]) -> usize {
    let entries = ledger_entries(ledger);
    assert!(!entries.is_empty() || ledger.exists(), "no ledger at {}", ledger.display());
    let known: std::collections::HashSet<&String> = ids.iter().collect();
    let mut per_epoch: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
    for v in entries {
        let trained = v["ids"].as_array().unwrap().iter().map(|i| i.to_string());
        per_epoch.entry(v["epoch"].as_u64().unwrap()).or_default().extend(trained);
    }
    let mut complete = 0;
    for (epoch, mut trained) in per_epoch {
        if let Some(stranger) = trained.iter().find(|id| !known.contains(id)) {
            panic!("epoch {epoch} trained {stranger}, which is not a sample id of the split");
        }
        trained.sort_unstable();
        let before = trained.len();
        trained.dedup();
        assert_eq!(before, trained.len(), "epoch {epoch} trained a sample twice");
        if trained.len() == ids.len() {
            complete += 1;
        }
    }
    complete
}

/// The ids of a prepared folder's train split, as JSON (`17`, `"sg-0010_0"`): what the ledger writes.
pub fn train_ids(dir: &Path) -> Vec<String> {
    let split = dflash::data::shards::PreparedSplit::open(dir, "train", false).unwrap();
    (0..split.len()).map(|i| split.id(i).to_json().to_string()).collect()
}

// ---------------------------------------------------------------- observability and live control

/// The value of one series in Prometheus text (`name{labels}` exactly as rendered, or a bare name).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

impl Service {
    pub fn metrics(&self) -> String {
        self.http("GET", "/metrics", "").1
    }

    /// Polls `/metrics` until `pred` holds.
    pub fn wait_metrics(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.poll(what, Self::metrics, |t| pred(t))
    }

    /// The step a logged reload applies from.
    pub fn reload_step(&self, version: u64) -> u64 {
        let logs = self.logs.lock().unwrap();
        logs.iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| {
                v["fields"]["message"].as_str().is_some_and(|m| m.starts_with("configuration reloaded"))
                    && v["fields"]["version"] == version
            })
            .and_then(|v| v["fields"]["step"].as_u64())
            .unwrap_or_else(|| panic!("no reload to version {version} logged"))
    }
}

/// A plain HTTP/1.1 request with a JSON body (may be empty); (status, body). Both servers here answer with a
/// Content-Length, never chunked.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    http_with(addr, method, path, body, "")
}

/// [`http`] with extra header lines (`"Name: value\r\n"` each).
pub fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let payload = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((code, payload.to_string()))
}
