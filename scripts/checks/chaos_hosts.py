#!/usr/bin/env python3
"""The reliability cases of several hosts (issue 37), re-run against a built dflash: three serve-train processes on
loopback, CPU, one checkpoint folder (as on a shared disk). Rank 0 stopped (SIGSTOP) for 35 s, under
cluster.leader_timeout_s, and for longer than it; a follower stopped past its beat's silence; a follower pointed at
a port that is not the store; a follower with another drafter. Each case prints what it expected and what it saw;
the exit status is the number of checks that failed. Standard library only; the service helpers are
scripts/checks/chaos_one_host.py's.

    scripts/checks/chaos_hosts.py [--bin target/release/dflash] [--work /tmp/dflash-chaos-hosts] [CASE ...]
"""
import argparse
import glob
import os
import signal
import socket
import tempfile
import threading
import time

import chaos_one_host as base
from chaos_one_host import Service, check, free_port, ledger_verdict, new_run, step

EPOCHS = 6


def training(name, sets=()):
    """A new run on three hosts (one drafter each), rank 0 first, past step 20."""
    run, port = new_run(name, drafters=1), free_port()
    hs = []
    for rank in range(3):
        cluster = ["cluster.hosts=3", f"cluster.rank={rank}", "cluster.master_addr=127.0.0.1",
                   f"cluster.master_port={port}", f"optim.epochs={EPOCHS}", *sets]
        hs.append(Service(run, cluster, resume=False, name=f"host{rank}"))
    hs[0].wait("step 20", lambda s: step(s) >= 20)
    return run, hs


def failures(services):
    """Drafter failures each host logged."""
    return [sum(1 for v in s.lines() if v.get("fields", {}).get("message", "").startswith("drafter failed"))
            for s in services]


def whole(run):
    """(duplicates in the ledger, complete epochs): every sample once per epoch, every epoch of the run."""
    duplicates, epochs = ledger_verdict(os.path.join(run, "ledger.jsonl"))
    return duplicates, epochs, duplicates == 0 and len(epochs) == EPOCHS and len(set(epochs.values())) == 1


def rank0_stopped_under_the_leader_timeout():
    run, hs = training("rank0-stopped-35s")
    hs[0].signal(signal.SIGSTOP)
    time.sleep(35)
    hs[0].signal(signal.SIGCONT)
    codes = [h.exit() for h in hs]
    failed = failures(hs)
    duplicates, epochs, ok = whole(run)
    check("rank 0 stopped 35 s (leader_timeout_s 60, hang floor 30 s)",
          "every host exits 0, no drafter failed, every sample once per epoch",
          f"exits {codes}, drafter failures {failed}, duplicates {duplicates}, epochs {epochs}",
          codes == [0, 0, 0] and failed == [0, 0, 0] and ok)


def rank0_stopped_past_the_leader_timeout():
    run, hs = training("rank0-stopped-past", ["cluster.leader_timeout_s=15"])
    hs[0].signal(signal.SIGSTOP)
    stopped = time.time()
    followers = [h.exit() for h in hs[1:]]
    took = time.time() - stopped
    hs[0].signal(signal.SIGCONT)
    survivors = sorted(glob.glob(os.path.join(run, "ckpt", "survivors", "host-*", "ckpt-*")))
    failed = failures(hs[1:])
    check("rank 0 stopped past leader_timeout_s (15 s)",
          "each follower checkpoints its replica under survivors/ and exits 75 within ~20 s, no drafter failed",
          f"exits {followers} after {took:.0f} s, survivor checkpoints {[os.path.relpath(p, run) for p in survivors]}, "
          f"drafter failures {failed}",
          followers == [75, 75] and took < 30 and len(survivors) == 2 and failed == [0, 0])
    code = hs[0].exit()
    duplicates, epochs, ok = whole(run)
    check("rank 0 continued alone", "exits 0, every sample once per epoch",
          f"exit {code}, duplicates {duplicates}, epochs {epochs}", code == 0 and ok)


def follower_stopped_past_its_beat():
    run, hs = training("follower-stopped-13s")
    hs[1].signal(signal.SIGSTOP)
    time.sleep(13)
    hs[1].signal(signal.SIGCONT)
    seen = {}

    def out_of_the_run(s):
        st = s.status()
        seen.update(ready=st["ready"], problems=st["problems"])
        return not st["ready"]

    hs[1].wait("not ready", out_of_the_run, timeout=30)
    said = seen["problems"]
    hs[1].wait("ready again", lambda s: s.status()["ready"], timeout=60)
    codes = [h.exit() for h in hs]
    rejoined = any(v.get("fields", {}).get("message") == "host joined the run"
                   and v["fields"].get("host") == 1 and v["fields"].get("generation") == 2 for v in hs[0].lines())
    duplicates, epochs, ok = whole(run)
    check("a follower stopped 13 s (its beat silent past 10 s)",
          "not ready while out of the run, saying why; back as generation 2; every host exits 0; every sample once",
          f"said {said}; rejoined as generation 2: {rejoined}; exits {codes}; duplicates {duplicates}, epochs {epochs}",
          any("dropped this host" in p for p in said) and rejoined and codes == [0, 0, 0] and ok)


def follower_on_a_wrong_port():
    run = new_run("wrong-port", drafters=1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(silent.accept()) for _ in range(64)], daemon=True).start()
    port = silent.getsockname()[1]
    sets = ["cluster.hosts=2", "cluster.rank=1", "cluster.master_addr=127.0.0.1", f"cluster.master_port={port}",
            "cluster.rendezvous_timeout_s=10"]
    started = time.time()
    f = Service(run, sets, resume=False, name="follower")
    phase = f.status()["phase"]
    code = f.exit(timeout=120)
    took = time.time() - started
    named = f.logged(f"127.0.0.1:{port}") and f.logged("c10d store")
    check("a follower pointed at a port that is not the store (rendezvous_timeout_s 10)",
          "/status phase rendezvous while it waits; exits 1 within ~15 s naming the address as not a c10d store",
          f"phase {phase!r}; exit {code} after {took:.0f} s; named: {named}",
          phase == "rendezvous" and code == 1 and took < 25 and named)


def follower_with_another_drafter():
    run = new_run("other-drafter", drafters=1)
    port = free_port()
    sets = ["cluster.hosts=2", "cluster.master_addr=127.0.0.1", f"cluster.master_port={port}"]
    rank0 = Service(run, [*sets, "cluster.rank=0"], resume=False, name="host0")
    other = Service(run, [*sets, "cluster.rank=1", "draft_model.num_hidden_layers=2"], resume=False, name="host1")
    code = other.exit(timeout=120)
    named = other.logged("draft_model.num_hidden_layers = 2 here, 1 on rank 0")
    restarted = other.logged("restarting")
    check("a follower with another drafter (2 layers against rank 0's 1)",
          "refused at join naming the key with both values (exit 1), never restarted",
          f"exit {code}; named: {named}; restarted: {restarted}", code == 1 and named and not restarted)
    rank0.signal(signal.SIGTERM)
    rank0.exit()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="target/release/dflash")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "dflash-chaos-hosts"))
    p.add_argument("cases", nargs="*", help="run only these (function names)")
    args = p.parse_args()
    args.bin = os.path.abspath(args.bin)
    args.device = "cpu"
    base.ARGS = args
    os.makedirs(args.work, exist_ok=True)
    base.prepare_data()
    cases = [rank0_stopped_under_the_leader_timeout, rank0_stopped_past_the_leader_timeout,
             follower_stopped_past_its_beat, follower_on_a_wrong_port, follower_with_another_drafter]
    base.run_cases(cases, args.cases)


if __name__ == "__main__":
    main()
