#!/usr/bin/env python3
"""Does "Keep the drafter current" follow drifting traffic on the real model, with the proxy, the trainer and the
upstream each killed once on the way? (issue 69; BENCHMARKS.md, "Drift on the real model"). On the CPU with the tests'
real model, SmolLM2-135M-Instruct, and llama.cpp's server (`scripts/setup.sh --test`), standard library only:

1. topic A: scripts/fixtures/real_model.py's "train" prompts (explain, poems, facts about 60 everyday topics);
   topic B: requests for code (a function, a shell command, a query), which A never asks for. A's prompts are
   answered by dflash's local generation (`regenerate --local`, greedy) and a drafter is trained on them (a 1-layer
   drafter, small batches: the CPU's budget), evaluated on A's held-out prompts and published as v1;
2. llama.cpp's server serves the model, `dflash proxy` records in front of it, and clients send B's prompts through
   the proxy (greedy, as the drafter serves); serve-train from v1 with `data.stream` on the recording (A as replay),
   evaluating on the stream's recent held-out traffic and publishing past the margin;
3. while B's traffic flows, the proxy is killed (SIGKILL) and started again, then the trainer (SIGKILL, resumed from
   its checkpoint), then the upstream (SIGKILL, started again after a pause).

Prints each evaluation of the stream run (minutes since B's traffic began, step, waves, the candidate's and the
published drafter's decoded acceptance on the same recent-traffic prompts, what was published), the clients' requests
by outcome (answered; refused while the proxy was down; 502 while the upstream was down; any other failure is the
proxy's fault and fails the probe), and the checks: every answered exchange recorded once (none twice), every
recorded conversation trained exactly once in its wave's epoch; then v1 and the stream run's last checkpoint decoded
on 16 prompts of each topic that no run saw. Writes WORK/drift.jsonl and WORK/summary.json.
From the checkout's root, after `cargo build --release`:

    python3 scripts/probes/drift_real.py [WORK] [--bin target/release/dflash]
"""
import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_TEMPLATES = [
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Show me Python code that {}, with a short explanation.",
    "Write a C function that {}.",
    "Write a Java method that {}.",
    "Write a Go function that {}.",
    "Write a Rust function that {}.",
    "Write a TypeScript function that {}.",
    "Write a one-line Python expression that {}.",
    "Write a Python class with a method that {}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the largest element of a list",
    "counts the vowels in a string", "sorts a list of numbers with bubble sort", "computes the factorial of n",
    "returns the n-th Fibonacci number", "removes duplicates from a list", "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "merges two sorted lists",
    "finds the second smallest number in a list", "counts how often each word occurs in a text",
    "returns the average of a list of numbers", "flattens a nested list", "checks whether two strings are anagrams",
    "converts a binary string to an integer", "finds the greatest common divisor of two numbers",
    "capitalizes the first letter of every word", "returns the even numbers of a list",
    "computes the power of a number without using the built-in operator", "rotates a list by k positions",
    "checks whether a year is a leap year", "finds the index of an element with binary search",
    "returns the length of the longest word in a sentence", "computes the area of a circle",
    "transposes a matrix", "reads a text file and counts its lines", "checks whether a list is sorted",
    "returns the intersection of two lists", "converts a number to Roman numerals", "generates a random password",
    "computes the median of a list", "removes all whitespace from a string", "finds the missing number in 1..n",
    "counts the set bits of an integer", "returns the distinct characters of a string in order",
    "swaps the keys and values of a dictionary", "computes the dot product of two vectors",
]
# Tasks no client asks for: the unseen B prompts decoded at the end (with the first four templates).
UNSEEN_CODE_TASKS = [
    "checks whether a string contains only digits", "returns the last n elements of a list",
    "counts the words in a sentence", "finds the longest common prefix of a list of strings",
]


def dflash(bin_, *args, **kw):
    env = dict(os.environ, DFLASH__LOG__LEVEL=os.environ.get("DFLASH__LOG__LEVEL", "warn"))
    env.pop("RUST_LOG", None)
    return subprocess.run([bin_, *args], check=True, env=env, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


def wait_until(what, pred, limit_s=180):
    deadline = time.time() + limit_s
    while not pred():
        if time.time() > deadline:
            raise SystemExit(f"{what}: not within {limit_s} s")
        time.sleep(0.5)


class Upstream:
    """llama.cpp's server on the real model's F32 GGUF, as tests/real_server.rs starts it."""

    def __init__(self, work, port):
        self.work, self.port, self.child = work, port, None

    def start(self):
        log = open(f"{self.work}/llama-server.log", "a")
        self.child = subprocess.Popen(
            [f"{ROOT}/.llama-server/bin/python", "-m", "llama_cpp.server", "--host", "127.0.0.1", "--n_ctx", "512",
             "--n_threads", "1", "--model_alias", "smollm2", "--seed", "0", "--port", str(self.port), "--model",
             f"{ROOT}/.real-model.f32.gguf"], stdout=log, stderr=log)
        wait_until("llama.cpp's server", lambda: get(f"http://127.0.0.1:{self.port}/v1/models")[0] == 200)

    def kill(self):
        self.child.kill()
        self.child.wait()


class Proxy:
    def __init__(self, bin_, work, port, upstream_port):
        self.bin, self.work, self.port, self.upstream_port, self.child = bin_, work, port, upstream_port, None

    def start(self):
        log = open(f"{self.work}/proxy.log", "a")
        env = dict(os.environ, DFLASH__LOG__LEVEL="info")
        env.pop("RUST_LOG", None)
        # Small segments sealed every few seconds: waves form while the traffic flows.
        self.child = subprocess.Popen(
            [self.bin, "proxy", "--upstream", f"http://127.0.0.1:{self.upstream_port}", "--listen",
             f"127.0.0.1:{self.port}", "--record", f"{self.work}/traffic", "--set", "proxy.segment_seconds=20"],
            stdout=log, stderr=log, env=env)
        wait_until("the proxy", lambda: get(f"http://127.0.0.1:{self.port}/_dflash/metrics")[0] == 200)

    def kill(self):
        self.child.kill()
        self.child.wait()

    def stop(self):
        self.child.send_signal(signal.SIGTERM)
        self.child.wait()


class Clients:
    """Sends B's prompts through the proxy, `concurrency` at a time, each once; a request that fails is sent again
    after a pause, and every attempt's outcome is classified by what was down at the time."""

    def __init__(self, port, prompts, concurrency=2, max_tokens=96):
        self.port, self.todo, self.max_tokens = port, list(prompts), max_tokens
        self.lock = threading.Lock()
        self.outcomes = collections.Counter()
        self.answered = []  # the prompts answered
        self.faults = []
        self.down = set()  # "proxy", "upstream": set by the conductor around each kill
        self.threads = [threading.Thread(target=self.work) for _ in range(concurrency)]

    def start(self):
        for t in self.threads:
            t.start()

    def alive(self):
        return any(t.is_alive() for t in self.threads)

    def work(self):
        while True:
            with self.lock:
                if not self.todo:
                    return
                prompt = self.todo.pop(0)
            while not self.ask(prompt):
                time.sleep(1)

    def ask(self, prompt):
        body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        down_before = set(self.down)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                json.load(r)
            with self.lock:
                self.outcomes["answered"] += 1
                self.answered.append(prompt)
            return True
        except urllib.error.HTTPError as e:
            kind = "502 while the upstream was down" if e.code == 502 and "upstream" in down_before | self.down \
                else f"HTTP {e.code}"
        except OSError as e:
            kind = "refused or cut while the proxy was down" if "proxy" in down_before | self.down else repr(e)
        with self.lock:
            self.outcomes[kind] += 1
            if not kind.startswith(("502 while", "refused or cut")):
                self.faults.append((prompt, kind))
        return False


def recorded_prompts(traffic):
    seen = collections.Counter()
    for name in sorted(os.listdir(traffic)):
        if name.startswith("segment-") and name.endswith(".jsonl"):
            for line in open(f"{traffic}/{name}"):
                c = json.loads(line)
                seen[next(m["content"] for m in c["messages"] if m["role"] == "user")] += 1
    return seen


def ledger_entries(path):
    entries = []
    for line in open(path):
        v = json.loads(line)
        if "rewind_to_step" in v:
            entries = [e for e in entries if e["step"] < v["rewind_to_step"]]
        else:
            entries.append(v)
    return entries


def check_exactly_once(live):
    """Wave N's trained conversations (ids `FILE#LINE` of its files) are in epoch N-1's ledger entries once each, as
    many as the wave's train split holds; later epochs may replay them."""
    by_epoch = collections.defaultdict(list)
    for e in ledger_entries(f"{live}/ledger.jsonl"):
        by_epoch[e["epoch"]].extend(str(i) for i in e["ids"])
    waves = [json.loads(l) for l in open(f"{live}/stream/waves.jsonl")]
    report = []
    for wave in waves:
        n = wave["number"]
        files = {f["name"] for f in wave["files"]}
        manifest = json.load(open(f"{live}/stream/wave-{n:05}/manifest.json"))
        own = [i for i in by_epoch.get(n - 1, []) if i.split("#")[0] in files]
        assert len(own) == len(set(own)), f"wave {n}: a conversation trained twice"
        assert len(own) == manifest["report"]["kept_train"], (n, len(own), manifest["report"]["kept_train"])
        report.append({"wave": n, "conversations": wave["conversations"], "trained": len(own),
                       "held_out": manifest["report"]["kept_holdout"]})
    return report


def untaken_conversations(live, traffic):
    """Conversations in sealed segments that no wave has taken yet (fewer than data.stream_min_conversations wait
    for more traffic)."""
    try:
        taken = {f["name"] for l in open(f"{live}/stream/waves.jsonl") for f in json.loads(l)["files"]}
    except OSError:
        taken = set()
    return sum(sum(1 for _ in open(f"{traffic}/{name}")) for name in os.listdir(traffic)
               if name.startswith("segment-") and name.endswith(".jsonl") and name not in taken)


class EvalTimes(threading.Thread):
    """When each line of evals.jsonl appeared (the rows carry no time of their own)."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path, self.times = path, []

    def run(self):
        while True:
            try:
                n = sum(1 for _ in open(self.path))
            except OSError:
                n = 0
            while len(self.times) < n:
                self.times.append(time.time())
            time.sleep(1)


def decode_unseen(a, w, b, model):
    """v1 and the stream run's last checkpoint decoded (`eval --decode`, 64 tokens) on 16 prompts of each topic that
    no run saw: code requests with UNSEEN_CODE_TASKS, and A's prompts not among the ones answered for phase 1."""
    b_unseen = [{"id": i, "messages": [{"role": "user", "content": t.format(task)}]}
                for i, (t, task) in enumerate((t, k) for t in CODE_TEMPLATES[:4] for k in UNSEEN_CODE_TASKS)]
    used = set(open(f"{w}/A.jsonl").read().splitlines())
    rest = [l for l in open(f"{w}/A-all.jsonl").read().splitlines() if l not in used]
    a_unseen = [json.loads(l) for l in rest[:: max(1, len(rest) // 16)][:16]]
    last = sorted(d for d in os.listdir(f"{w}/live") if d.startswith("ckpt-"))[-1]
    drafters = {"v1": f"{w}/published/v1", last: f"{w}/live/{last}"}
    results = {}
    for topic, prompts in (("B", b_unseen), ("A", a_unseen)):
        path = f"{w}/unseen-{topic}.jsonl"
        with open(path, "w") as f:
            f.write("".join(json.dumps(p) + "\n" for p in prompts))
        for name, drafter in drafters.items():
            out = dflash(b, "eval", "--target", model, "--drafter", drafter, "--decode", "--prompts", path,
                         "--max-new-tokens", "64", "--device", "cpu", "--json", stdout=subprocess.PIPE)
            r = json.loads(out.stdout)
            results[f"{topic} {name}"] = {k: r[k] for k in ("decode_acceptance_length", "lossless", "prompts")}
            print(f"unseen {topic} prompts, {name}: {r['decode_acceptance_length']:.2f} (lossless {r['lossless']})",
                  flush=True)
    return results


def serve_train(w, model):
    """README's real-model recipe cut to the CPU's budget: a 1-layer drafter, batches of 8, 16 anchors."""
    return ["--config", "config/smollm2-135m.toml", "serve-train", "--set", f"target.model={model}",
            "--set", "target.device=cpu", "--set", "drafters.devices=[\"cpu\"]", "--set", f"data.path={w}/dataA",
            "--set", "draft_model.num_hidden_layers=1", "--set", "data.batch_size=8",
            "--set", "objective.num_anchors=16",
            "--set", "eval.cuda_graphs=false", "--set", "eval.max_new_tokens=64", "--set", "eval.num_prompts=16",
            "--set", "log.every_steps=50", "--set", f"publish.dir={w}/published"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="?", default="/tmp/dflash-drift-real")
    ap.add_argument("--bin", default="target/release/dflash")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--a-prompts", type=int, default=240, help="of the 720 prompts of topic A (the CPU's budget)")
    ap.add_argument("--b-prompts", type=int, default=400)
    ap.add_argument("--reuse", action="store_true", help="keep WORK's phase 1 (its published v1) and redo phase 2")
    a = ap.parse_args()
    w, b = a.work, os.path.abspath(a.bin)
    model = f"{ROOT}/.real-model"
    if a.reuse and os.path.exists(f"{w}/published/current"):
        for name in ("live", "traffic"):
            shutil.rmtree(f"{w}/{name}", ignore_errors=True)
        for name in ("llama-server.log", "proxy.log", "trainer.log"):
            if os.path.exists(f"{w}/{name}"):
                os.remove(f"{w}/{name}")
        for name in os.listdir(f"{w}/published"):
            if name not in ("v1", "current"):
                shutil.rmtree(f"{w}/published/{name}")
        os.makedirs(f"{w}/traffic")
        phase2(a, w, b, model)
        return
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(f"{w}/traffic")
    subprocess.run([sys.executable, f"{ROOT}/scripts/fixtures/real_model.py", "prompts", f"{w}/A-all.jsonl", "train"],
                   check=True)
    a_all = open(f"{w}/A-all.jsonl").read().splitlines()
    with open(f"{w}/A.jsonl", "w") as f:  # spread over every topic and template
        f.write("\n".join(a_all[:: max(1, len(a_all) // a.a_prompts)][: a.a_prompts]) + "\n")
    t0 = time.time()
    dflash(b, "regenerate", "--local", "--model", model, "--device", "cpu", "--input", f"{w}/A.jsonl", "--out",
           f"{w}/A-regen.jsonl", "--max-tokens", "96", stdout=subprocess.DEVNULL)
    dflash(b, "prepare", "--model", model, "--input", f"{w}/A-regen.jsonl", "--out", f"{w}/dataA", "--max-len", "192",
           "--holdout", "0.05", stdout=subprocess.DEVNULL)
    print(f"A: {sum(1 for _ in open(f'{w}/A-regen.jsonl'))} prompts answered and prepared in "
          f"{(time.time() - t0) / 60:.1f} min", flush=True)
    t0 = time.time()
    dflash(b, *serve_train(w, model), "--set", "control.listen=off", "--set", f"checkpoint.dir={w}/base", "--set",
           f"data.ledger={w}/base/ledger.jsonl", "--set", f"optim.max_steps={a.base_steps}",
           "--set", f"eval.every_steps={a.base_steps}", "--set", "checkpoint.every_steps=0", stdout=subprocess.DEVNULL)
    print(f"phase 1, A only: {(time.time() - t0) / 60:.1f} min, {a.base_steps} steps", flush=True)
    phase2(a, w, b, model)


def phase2(a, w, b, model):
    first = json.loads(open(f"{w}/base/evals.jsonl").read().splitlines()[-1])
    print(f"phase 1: on A's held-out prompts {first['decode_acceptance_length']:.2f}; published "
          f"{os.readlink(f'{w}/published/current')}", flush=True)
    b_prompts = [t.format(task) for t in CODE_TEMPLATES for task in CODE_TASKS][: a.b_prompts]
    up_port, proxy_port, control_port = free_port(), free_port(), free_port()
    upstream = Upstream(w, up_port)
    upstream.start()
    proxy = Proxy(b, w, proxy_port, up_port)
    proxy.start()
    stream = ["--set", f"checkpoint.dir={w}/live", "--set", f"data.ledger={w}/live/ledger.jsonl",
              "--set", f"data.stream={w}/traffic", "--set", f"draft_model.init={w}/published/current",
              "--set", "data.holdout=0.15", "--set", "eval.prompts=\"stream\"", "--set", "eval.every_steps=20",
              # A decoded evaluation on 2 CPU cores runs at batch 1 from memory: about 200 s for 16 prompts of 64
              # tokens, twice (candidate and published) per evaluation; 8 of 48 keep it beside the traffic.
              "--set", "eval.num_prompts=8", "--set", "eval.max_new_tokens=48",
              "--set", "data.stream_mix=0.25",
              "--set", "optim.schedule=\"constant\"", "--set", "optim.warmup_ratio=0", "--set", "optim.max_steps=0",
              "--set", "data.stream_min_conversations=24", "--set", "data.stream_poll_s=5",
              "--set", "checkpoint.every_steps=10", "--set", f"control.listen=\"127.0.0.1:{control_port}\""]
    env = dict(os.environ, DFLASH__LOG__LEVEL="info")
    env.pop("RUST_LOG", None)
    trainer_log = open(f"{w}/trainer.log", "a")

    def start_trainer():
        # `--resume auto`: a fresh run the first time, the last checkpoint's after the kill.
        return subprocess.Popen([b, *serve_train(w, model), *stream, "--resume", "auto"], env=env,
                                stdout=trainer_log, stderr=trainer_log)

    def status():
        code, body = get(f"http://127.0.0.1:{control_port}/status")
        return json.loads(body) if code == 200 else {}

    t1 = time.time()
    trainer = start_trainer()
    eval_times = EvalTimes(f"{w}/live/evals.jsonl")
    eval_times.start()
    clients = Clients(proxy_port, b_prompts)
    clients.start()
    events = []

    def note(what):
        events.append({"min": round((time.time() - t1) / 60, 2), "event": what})
        print(f"  +{(time.time() - t1) / 60:.1f} min: {what}", flush=True)

    def answered_at_least(n):
        wait_until(f"{n} answered", lambda: clients.outcomes["answered"] >= n, limit_s=3600)

    n = len(b_prompts)
    answered_at_least(n // 5)
    clients.down.add("proxy")
    proxy.kill()
    note(f"proxy killed (SIGKILL) after {clients.outcomes['answered']} answers")
    time.sleep(3)
    proxy.start()
    clients.down.discard("proxy")
    note("proxy started again")
    answered_at_least(2 * n // 5)
    wait_until("a wave trained", lambda: (status().get("stream") or {}).get("waves", 0) >= 1, limit_s=1800)
    step = status().get("step")
    trainer.kill()
    trainer.wait()
    note(f"trainer killed (SIGKILL) at step {step}")
    trainer = start_trainer()
    note("trainer started again (resumes from its last checkpoint)")
    answered_at_least(3 * n // 5)
    clients.down.add("upstream")
    upstream.kill()
    note("upstream killed (SIGKILL)")
    time.sleep(10)
    upstream.start()
    clients.down.discard("upstream")
    note("upstream started again")
    while clients.alive():
        time.sleep(2)
    note(f"B's traffic done: {dict(clients.outcomes)}")
    proxy.stop()  # seals the open segment
    upstream.kill()
    # Every recorded conversation taken (but a remainder below the minimum) and trained: the run waits for more.
    def drained():
        st = status().get("stream") or {}
        return st.get("waiting_for_a_wave") and untaken_conversations(f"{w}/live", f"{w}/traffic") < 24

    wait_until("the stream drained", drained, limit_s=3600)
    left = untaken_conversations(f"{w}/live", f"{w}/traffic")
    time.sleep(5)  # an evaluation under way when the last wave ended gets written
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait() == 143, trainer.returncode
    note("trainer stopped (SIGTERM)")

    recorded = recorded_prompts(f"{w}/traffic")
    answered = collections.Counter(clients.answered)
    twice = [p for p, k in recorded.items() if k > 1]
    lost = [p for p in answered if p not in recorded]
    waves = check_exactly_once(f"{w}/live")
    evals = f"{w}/live/evals.jsonl"
    rows = [json.loads(l) for l in open(evals)] if os.path.exists(evals) else []
    with open(f"{w}/drift.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("min | step | prompts | candidate | published (version) | published now | lossless")
    for r, seen in zip(rows, eval_times.times + [time.time()] * len(rows)):
        base_ = r.get("baseline") or {}
        pub = r.get("published") or {}
        at = (seen - t1) / 60
        print(f"{at:.1f} | {r['step']} | {r['prompts']} | {r['decode_acceptance_length']:.2f} | "
              f"{base_.get('decode_acceptance_length', float('nan')):.2f} (v{base_.get('version', '-')}) | "
              f"{'v' + str(pub['version']) if pub else ''} | {r['lossless']}")
    summary = {"phase1_heldout_A": first["decode_acceptance_length"], "requests": dict(clients.outcomes),
               "faults": clients.faults, "answered": len(answered), "recorded": sum(recorded.values()),
               "recorded_twice": twice, "answered_not_recorded": lost, "waves": waves, "events": events,
               "untaken_below_minimum": left,
               "published": sorted(os.listdir(f"{w}/published"))}
    summary["unseen"] = decode_unseen(a, w, b, model)
    json.dump(summary, open(f"{w}/summary.json", "w"), indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=1))
    assert not clients.faults, clients.faults
    assert not twice, twice


if __name__ == "__main__":
    sys.exit(main())
