#!/usr/bin/env python3
"""Polls a serve-train's /status every 50 ms after an event (a fault sent), recording each change of what --key
selects, until --until holds or --limit seconds have passed. Writes {"transitions": [[seconds, key, step], ...],
"samples": [[seconds, step, samples_committed, key], ...]} to --out and prints the transitions. --key and --until
are Python expressions over `s` (the status), and for --until also `t` (seconds since the event) and `changes`
(transitions so far). scripts/gpu/service.sh times its recoveries with it."""
import argparse
import json
import time
import urllib.request

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--since", required=True, help="a file holding the event's time (date +%%s.%%N)")
parser.add_argument("--out", required=True, help="where the timeline goes (JSON)")
parser.add_argument("--key", required=True, help="what to watch, e.g. [d['state'] for d in s['drafters']]")
parser.add_argument("--until", required=True, help="when to stop, e.g. changes > 1 and t > 1")
parser.add_argument("--limit", type=float, default=300, help="seconds to give up after (default 300)")
parser.add_argument("--status", default="http://127.0.0.1:9410/status", help="the status URL")
args = parser.parse_args()

t0 = float(open(args.since).read())
transitions, samples = [], []
while True:
    s = json.loads(urllib.request.urlopen(args.status).read())
    t = time.time() - t0
    key = eval(args.key, {"s": s})
    samples.append([round(t, 3), s["step"], s["samples_committed"], key])
    if not transitions or transitions[-1][1] != key:
        transitions.append([round(t, 3), key, s["step"]])
    if eval(args.until, {"s": s, "t": t, "changes": len(transitions)}) or t > args.limit:
        break
    time.sleep(0.05)
with open(args.out, "w") as f:
    json.dump({"transitions": transitions, "samples": samples}, f)
print(transitions)
