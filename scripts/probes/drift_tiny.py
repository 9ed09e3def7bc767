#!/usr/bin/env python3
"""Does the loop of "Keep the drafter current" follow drifting traffic? (issue 69; BENCHMARKS.md, "Drift on the
built-in target"). On the CPU with the built-in tiny-tasks target, standard library only:

1. the built-in tasks split by kind: topics A (counting, sums, repeating) and B (spelling, reversing), each
   conversation of one kind only, answered by the target itself (`regenerate --local`);
2. a drafter trained on A with `make run`'s recipe for 700 steps, evaluated on A's held-out prompts and published
   (v1, and v2 when the second evaluation beats it);
3. serve-train from v1 with `data.stream` on a folder into which B's conversations are dropped a file at a time while
   it runs (`data.path` A as replay), evaluating on the stream's recent held-out traffic (`eval.prompts = "stream"`)
   and publishing past the margin.

Prints each evaluation of the stream run (minutes since it started, step, waves, the candidate's and the published
drafter's decoded acceptance on the same recent-traffic prompts, what was published) and writes them to
WORK/drift.jsonl. Run from the checkout's root after `cargo build --release`:

    python3 scripts/probes/drift_tiny.py [WORK] [--bin target/release/dflash]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import signal
import socket
import threading
import time
import urllib.request

A_KINDS = ("Count from", "What is", "Repeat after me")
B_KINDS = ("Spell these words", "Reverse the words")


def run(bin_, *args, **kw):
    env = dict(os.environ, DFLASH__LOG__LEVEL=os.environ.get("DFLASH__LOG__LEVEL", "warn"))
    env.pop("RUST_LOG", None)
    subprocess.run([bin_, *args], check=True, env=env, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kind_of(conversation):
    """A or B when every user turn is of that topic set, else None."""
    kinds = set()
    for m in conversation["messages"]:
        if m["role"] != "user":
            continue
        if m["content"].startswith(A_KINDS):
            kinds.add("A")
        elif m["content"].startswith(B_KINDS):
            kinds.add("B")
        else:
            kinds.add("?")
    return kinds.pop() if len(kinds) == 1 and "?" not in kinds else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="?", default="/tmp/dflash-drift")
    ap.add_argument("--bin", default="target/release/dflash")
    ap.add_argument("--files", type=int, default=4, help="B files dropped into the stream, one at a time")
    ap.add_argument("--every", type=float, default=45.0, help="seconds between two files")
    a = ap.parse_args()
    w, b = a.work, a.bin
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(f"{w}/traffic")
    run(b, "sample-data", "--count", "6000", "--seed", "7", "--out", f"{w}/all.jsonl")
    split = {"A": [], "B": []}
    for line in open(f"{w}/all.jsonl"):
        c = json.loads(line)
        k = kind_of(c)
        if k:
            c.pop("id", None)
            split[k].append(c)
    print(f"topics: {len(split['A'])} conversations of A, {len(split['B'])} of B", flush=True)
    for k in "AB":
        with open(f"{w}/{k}.jsonl", "w") as f:
            for i, c in enumerate(split[k]):
                f.write(json.dumps({"id": f"{k}{i}", **c}) + "\n")
        run(b, "regenerate", "--local", "--model", "tiny-tasks", "--input", f"{w}/{k}.jsonl", "--out",
            f"{w}/{k}-regen.jsonl", "--max-tokens", "80", stdout=subprocess.DEVNULL)
    run(b, "prepare", "--model", "tiny-tasks", "--input", f"{w}/A-regen.jsonl", "--out", f"{w}/dataA",
        "--max-len", "512", "--holdout", "0.05", stdout=subprocess.DEVNULL)
    base = ["--config", "config/make-run.toml", "serve-train", "--set", f"data.path={w}/dataA",
            "--set", f"publish.dir={w}/published"]
    t0 = time.time()
    run(b, *base, "--set", "control.listen=off", "--set", f"checkpoint.dir={w}/base", "--set", "optim.max_steps=700",
        "--set", "eval.every_steps=350",
        "--set", "eval.num_prompts=16", stdout=subprocess.DEVNULL)
    print(f"phase 1, A only: {(time.time() - t0) / 60:.1f} min; published {os.readlink(f'{w}/published/current')}",
          flush=True)

    # B's conversations, a file at a time, while the stream run trains.
    b_lines = open(f"{w}/B-regen.jsonl").read().splitlines()
    per = len(b_lines) // a.files

    def feed():
        for i in range(a.files):
            time.sleep(a.every if i else 5)
            tmp = f"{w}/b-{i}.jsonl"
            with open(tmp, "w") as f:
                f.write("\n".join(b_lines[i * per:(i + 1) * per]) + "\n")
            os.rename(tmp, f"{w}/traffic/b-{i}.jsonl")
            print(f"  +{(time.time() - t1) / 60:.1f} min: dropped b-{i}.jsonl ({per} conversations of B)", flush=True)

    t1 = time.time()
    feeder = threading.Thread(target=feed)
    feeder.start()
    port = free_port()
    stream = ["--set", f"checkpoint.dir={w}/live", "--set", f"data.stream={w}/traffic",
              "--set", f"draft_model.init={w}/published/current", "--set", "data.holdout=0.15",
              "--set", "eval.prompts=\"stream\"", "--set", "eval.every_steps=100", "--set", "eval.num_prompts=16",
              "--set", "optim.schedule=\"constant\"", "--set", "optim.warmup_ratio=0",
              "--set", "data.stream_min_conversations=50", "--set", "data.stream_poll_s=2",
              "--set", f"control.listen=\"127.0.0.1:{port}\""]
    env = dict(os.environ, DFLASH__LOG__LEVEL="warn")
    env.pop("RUST_LOG", None)
    live = subprocess.Popen([b, *base, *stream], env=env, stdout=subprocess.DEVNULL)
    # Open-ended: once every file is taken and trained, the run waits for more; stop it there (SIGTERM: it
    # checkpoints and exits 143).
    while True:
        time.sleep(2)
        assert live.poll() is None, f"the stream run ended by itself ({live.returncode})"
        try:
            status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5))
        except OSError:
            continue
        s = status.get("stream") or {}
        if not feeder.is_alive() and s.get("waves") == a.files and s.get("waiting_for_a_wave"):
            break
    live.send_signal(signal.SIGTERM)
    assert live.wait() == 143, live.returncode
    feeder.join()
    print(f"phase 2, the stream: {(time.time() - t1) / 60:.1f} min, to step {status['step']}", flush=True)
    rows = [json.loads(l) for l in open(f"{w}/live/evals.jsonl")]
    with open(f"{w}/drift.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("min | step | prompts | candidate | published (version) | published now")
    for r in rows:
        at = (r["published"]["published_at"] - t1) / 60 if r.get("published") else float("nan")
        base_ = r.get("baseline") or {}
        pub = r.get("published") or {}
        print(f"{at:.1f} | {r['step']} | {r['prompts']} | {r['decode_acceptance_length']:.2f} | "
              f"{base_.get('decode_acceptance_length', float('nan')):.2f} (v{base_.get('version', '-')}) | "
              f"{'v' + str(pub['version']) if pub else ''} | lossless {r['lossless']}")
    versions = sorted(os.listdir(f"{w}/published"))
    print("published:", versions, "->", os.readlink(f"{w}/published/current"))


if __name__ == "__main__":
    sys.exit(main())
