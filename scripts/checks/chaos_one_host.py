#!/usr/bin/env python3
"""The reliability cases of one host (issue 34), re-run against a built dflash on loopback, CPU: two services on
one checkpoint folder, preemption of one host and of three, a second signal, a data ledger on a full filesystem, a
stalled checkpoint writer, the control plane's token. Each case prints what it expected and what it saw; the exit
status is the number of cases that failed. Standard library only.

    scripts/checks/chaos_one_host.py [--bin target/release/dflash] [--work /tmp/dflash-chaos] [--device cuda:0] [CASE ...]

The full-disk case mounts a 256 KiB tmpfs when run as root (else it uses /dev/full, which fails every write).
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
import tempfile
import time
import urllib.error
import urllib.request

ARGS = None
RESULTS = []
# Every service started, so that a case that breaks leaves none running.
STARTED = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One serve-train process, its log (JSON lines) and its control plane."""

    def __init__(self, run, sets=(), resume=True, env=None, name="svc", wait_for_address=True):
        self.run, self.name = run, name
        self.log_path = os.path.join(run, f"{name}.log")
        cmd = [ARGS.bin, "--config", os.path.join(run, "run.toml"), "serve-train"]
        for s in sets:
            cmd += ["--set", s]
        if resume:
            cmd += ["--resume", "auto"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ, **(env or {})})
        STARTED.append(self)
        self.addr = self.address() if wait_for_address else None

    def lines(self):
        out = []
        with open(self.log_path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def logged(self, text):
        with open(self.log_path) as f:
            return text in f.read()

    def address(self, field="address", timeout=120):
        start = time.time()
        while time.time() - start < timeout:
            for v in self.lines():
                if field in v.get("fields", {}):
                    return v["fields"][field]
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before serving")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no {field}")

    def http(self, method, path, headers=None, addr=None):
        req = urllib.request.Request(f"http://{addr or self.addr}{path}", method=method, headers=headers or {},
                                     data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status(self):
        return json.loads(self.http("GET", "/status")[1])

    def metric(self, name):
        for line in self.http("GET", "/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def wait(self, what, pred, timeout=180):
        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} waiting for {what}")
            try:
                if pred(self):
                    return
            except (OSError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: timed out waiting for {what}")

    def fault(self, kind):
        req = urllib.request.Request(f"http://{self.addr}/drafters/0/fault", method="POST",
                                     data=json.dumps({"kind": kind}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    def signal(self, sig):
        self.proc.send_signal(sig)

    def exit(self, timeout=300):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"{self.name} did not end")
        self.log.close()
        return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


def step(s):
    return s.status()["step"]


def check(case, expected, seen, ok):
    RESULTS.append((case, expected, seen, ok))
    print(f"[{'ok' if ok else 'FAIL'}] {case}: expected {expected}; saw {seen}", flush=True)


def ledger_verdict(path):
    """Duplicate (epoch, batch) entries after applying rewinds, and complete epochs."""
    entries = []
    with open(path) as f:
        for line in f:
            v = json.loads(line)
            if "rewind_to_step" in v:
                entries = [e for e in entries if e["step"] < v["rewind_to_step"]]
            else:
                entries.append(v)
    per_epoch = collections.defaultdict(list)
    for e in entries:
        per_epoch[e["epoch"]].extend(json.dumps(i) for i in e["ids"])
    duplicates = sum(len(ids) - len(set(ids)) for ids in per_epoch.values())
    return duplicates, {e: len(ids) for e, ids in per_epoch.items()}


def new_run(name, drafters=2, extra=""):
    run = os.path.join(ARGS.work, name)
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    devices = ", ".join([f'"{ARGS.device}"'] * drafters)
    with open(os.path.join(run, "run.toml"), "w") as f:
        f.write(f"""
[target]
model = "tiny"
device = "{ARGS.device}"
[draft_model]
num_hidden_layers = 1
block_size = 4
[drafters]
devices = [{devices}]
[data]
path = "{ARGS.data}"
batch_size = 2
ledger = "{run}/ledger.jsonl"
[objective]
num_anchors = 8
gamma = 2.0
[optim]
epochs = 40
[checkpoint]
dir = "{run}/ckpt"
every_steps = 50
[supervision]
shutdown_timeout_s = 4
[control]
listen = "127.0.0.1:0"
fault_injection = true
[log]
format = "json"
{extra}
""")
    return run


def prepare_data():
    data = os.path.join(ARGS.work, "data")
    if not os.path.isdir(os.path.join(data, "prepared")):
        os.makedirs(data, exist_ok=True)
        chats = os.path.join(data, "chats.jsonl")
        subprocess.run([ARGS.bin, "sample-data", "--count", "160", "--seed", "3", "--out", chats], check=True,
                       capture_output=True)
        subprocess.run([ARGS.bin, "prepare", "--model", "tiny", "--input", chats, "--out",
                        os.path.join(data, "prepared"), "--max-len", "192", "--block-size", "4", "--holdout", "0.1"],
                       check=True, capture_output=True)
    ARGS.data = os.path.join(data, "prepared")


# ---------------------------------------------------------------------------------------------------- the cases

def two_services_on_one_folder():
    run = new_run("two-services")
    a = Service(run, ["optim.epochs=30"], name="a")
    a.wait("step 20", lambda s: step(s) >= 20)
    b = Service(run, ["optim.epochs=30", "checkpoint.lock_wait_s=3"], name="b", wait_for_address=False)
    code = b.exit()
    check("second service, lock_wait_s=3", "exit 75 naming the holder's pid",
          f"exit {code}, names pid {a.proc.pid}: {b.logged(f'pid {a.proc.pid} on host')}",
          code == 75 and b.logged(f"pid {a.proc.pid} on host"))
    c = Service(run, ["optim.epochs=30", "checkpoint.lock_wait_s=120"], name="c", wait_for_address=False)
    deadline = time.time() + 60
    while not c.logged("waiting up to") and time.time() < deadline:
        time.sleep(0.05)
    a.signal(signal.SIGTERM)
    code_a, code_c = a.exit(), c.exit()
    duplicates, epochs = ledger_verdict(os.path.join(run, "ledger.jsonl"))
    check("replacement waiting while the old one stops (SIGTERM)", "old exits 143; replacement resumes, exits 0; "
          "no duplicate ledger entry, 30 complete epochs",
          f"old {code_a}, replacement {code_c}, duplicates {duplicates}, epochs {epochs}",
          code_a == 143 and code_c == 0 and duplicates == 0 and len(epochs) == 30 and len(set(epochs.values())) == 1)


def preemption_one_host():
    run = new_run("preempt-one")
    a = Service(run, resume=False)
    a.wait("step 20", lambda s: step(s) >= 20)
    a.signal(signal.SIGTERM)
    code = a.exit()
    b = Service(run, ["optim.epochs=3"], name="resumed")
    resumed = b.exit()
    check("SIGTERM, one host", "143, then the resumed run completes with 0", f"{code}, then {resumed}",
          code == 143 and resumed == 0)


def preemption_three_hosts():
    def hosts(run, port):
        procs = []
        for rank in range(3):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank), "NNODES": "3"}
            # One checkpoint.dir for all, as on a shared disk: each host locks its own file in it.
            procs.append(Service(run, env=env, name=f"host{rank}"))
        return procs

    run = new_run("preempt-hosts", drafters=1, extra="[cluster]\nround_timeout_s = 20")
    hs = hosts(run, free_port())
    hs[0].wait("step 20", lambda s: step(s) >= 20)
    hs[1].signal(signal.SIGTERM)
    follower = hs[1].exit()
    hs[0].wait("steps after the follower left", lambda s: step(s) >= 40)
    hs[0].signal(signal.SIGTERM)
    codes = [hs[0].exit(), hs[2].exit()]
    check("SIGTERM, three hosts", "the follower 143 (the run goes on); rank 0 143 and its other follower 143",
          f"follower {follower}; rank 0 {codes[0]}, other follower {codes[1]}", follower == 143 and codes == [143, 143])


def second_signal():
    codes = []
    for i in range(4):
        run = new_run(f"second-signal-{i}")
        a = Service(run, resume=False)
        a.wait("step 10", lambda s: step(s) >= 10)
        a.fault("checkpoint_stall")
        a.signal(signal.SIGTERM)
        a.wait("the stalled checkpoint", lambda s: s.logged("stalled on purpose"))
        a.signal(signal.SIGINT)
        codes.append(a.exit())
    check("second signal (SIGTERM, then SIGINT while the checkpoint stalls), 4 tries", "130 each, no 139",
          f"{codes}", codes == [130] * 4)


def ledger_on_a_full_disk():
    run = new_run("full-disk")
    disk = os.path.join(run, "disk")
    os.makedirs(disk)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", disk],
                                                   capture_output=True).returncode == 0
    ledger = os.path.join(disk, "ledger.jsonl") if mounted else "/dev/full"
    try:
        ledger_on(run, disk, ledger, mounted)
    finally:
        stop_all()
        if mounted:
            subprocess.run(["umount", disk])


def stop_all():
    for s in STARTED:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def ledger_on(run, disk, ledger, mounted):
    if True:
        a = Service(run, [f"data.ledger={ledger}", "data.ledger_max_failures=1000000", "optim.epochs=3"], resume=False)
        a.wait("step 5", lambda s: step(s) >= 5)
        if mounted:
            fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)  # the disk fills up mid-run
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
        a.wait("a ledger failure", lambda s: s.status()["ledger"]["failures"] >= 1)
        ready, body = a.http("GET", "/readyz")
        failures, failing = a.metric("dflash_ledger_write_failures_total"), a.metric("dflash_ledger_failing")
        a.signal(signal.SIGTERM)
        stopped = a.exit()
        check(f"ledger on a full {'tmpfs' if mounted else '/dev/full'}: visible", "/readyz 503 naming data.ledger; "
              "failures counted; SIGTERM 143", f"/readyz {ready} {body[:80]}; failures {failures}, failing {failing}; "
              f"{stopped}", ready == 503 and "data.ledger" in body and failures >= 1 and failing == 1 and stopped == 143)
        b = Service(run, [f"data.ledger={ledger}", "optim.epochs=3"], name="b")
        code = b.exit()
        check("ledger still full on resume", "checkpoint, then exit 75 after 5 failures in a row",
              f"{code}, logged: {b.logged('data.ledger failed 5 times in a row')}",
              code == 75 and b.logged("data.ledger failed 5 times in a row"))
        if mounted:
            os.remove(os.path.join(disk, "filler"))
        done = Service(run, [f"data.ledger={ledger}" if mounted else f"data.ledger={run}/ledger.jsonl",
                             "optim.epochs=3"], name="c").exit()
        duplicates, epochs = ledger_verdict(ledger if mounted else os.path.join(run, "ledger.jsonl"))
        check("room again, resumed", "exit 0; the ledger without duplicates" + (", all 3 epochs whole" if mounted else ""),
              f"{done}; duplicates {duplicates}, epochs {epochs}",
              done == 0 and duplicates == 0 and (not mounted or (len(epochs) == 3 and len(set(epochs.values())) == 1)))


def stalled_checkpoint_writer():
    run = new_run("stall")
    a = Service(run, ["checkpoint.every_steps=10"], resume=False)
    a.wait("a checkpoint", lambda s: (s.status()["last_checkpoint"] or {}).get("step", 0) >= 10)
    a.fault("checkpoint_stall")
    a.wait("the stall reported", lambda s: s.status()["checkpoint_writer"]["stalled"])
    a.wait("a skipped checkpoint", lambda s: s.status()["checkpoint_writer"]["skipped"] >= 1)
    ready = a.http("GET", "/readyz")[0]
    stalled, skipped = a.metric("dflash_checkpoint_writer_stalled"), a.metric("dflash_checkpoints_skipped_total")
    t = time.time()
    a.signal(signal.SIGTERM)
    code, waited = a.exit(), time.time() - t
    check("stalled checkpoint writer", "/readyz 503, stalled 1, skipped counted; SIGTERM exits 75 within "
          "shutdown_timeout_s (4 s) + 1 s", f"/readyz {ready}, stalled {stalled}, skipped {skipped}; exit {code} "
          f"after {waited:.1f} s", ready == 503 and stalled == 1 and skipped >= 1 and code == 75 and waited < 5)


def control_token():
    run = new_run("token")
    a = Service(run, ["control.listen=0.0.0.0:0"], resume=False)
    no_token = a.http("POST", "/checkpoint")[0]
    a.signal(signal.SIGTERM)
    a.exit()
    b = Service(run, ["control.listen=0.0.0.0:0"], env={"DFLASH_CONTROL_TOKEN": "s3cret"}, name="b")
    b.wait("running", lambda s: s.status()["phase"] == "running")
    wrong = b.http("POST", "/checkpoint", {"Authorization": "Bearer nope"})[0]
    right = b.http("POST", "/checkpoint", {"Authorization": "Bearer s3cret"})[0]
    b.signal(signal.SIGTERM)
    b.exit()
    check("POST /checkpoint on 0.0.0.0", "401 without a token set; with one: 401 wrong, 202 right",
          f"{no_token}; {wrong}, {right}", (no_token, wrong, right) == (401, 401, 202))


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="target/release/dflash")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "dflash-chaos"))
    p.add_argument("--device", default="cpu", help="the target's and every drafter's device")
    p.add_argument("cases", nargs="*", help="run only these (function names)")
    ARGS = p.parse_args()
    ARGS.bin = os.path.abspath(ARGS.bin)
    os.makedirs(ARGS.work, exist_ok=True)
    prepare_data()
    run_cases([two_services_on_one_folder, preemption_one_host, preemption_three_hosts, second_signal,
               ledger_on_a_full_disk, stalled_checkpoint_writer, control_token], ARGS.cases)


def run_cases(cases, only):
    """Runs `cases` (those named in `only`, when it names any) and exits with the number of checks that failed."""
    for case in cases:
        if only and case.__name__ not in only:
            continue
        try:
            case()
        except Exception as e:  # a case that breaks is a failed case, and the others still run
            check(case.__name__, "to run", f"{type(e).__name__}: {e}", False)
        stop_all()
    failed = sum(1 for r in RESULTS if not r[3])
    print(f"{len(RESULTS) - failed} of {len(RESULTS)} checks passed")
    sys.exit(failed)


if __name__ == "__main__":
    main()
