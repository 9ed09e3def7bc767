#!/usr/bin/env bash
# The live page in a real browser (`make check-ui`): a short CPU run of `make run`'s configuration with the control
# plane on a free port and fault injection on, the page loaded in headless Chromium (Debian's `chromium` package:
# apt-get install chromium), then:
#   1. the five charts draw with data (their series hold points) and both drafters show as live;
#   2. a drafter fault injected through the control API (POST /drafters/1/fault) appears on the page: the drafter's
#      restart count goes to 1 and the failure and restart are among the recent events;
#   3. the TensorBoard event files hold the run's scalars (read back with TensorBoard's own reader when a venv with
#      it is given: --tensorboard-python PATH);
#   4. screenshots, wide and narrow (500 px, the narrowest headless Chromium lays out), go to docs/live-page.png
#      and docs/live-page-narrow.png.
# Usage: scripts/checks/check_ui.sh [--bin PATH/TO/dflash] [--tensorboard-python PATH] [--no-screenshots]
# Prints each check's result; exits 1 if any failed. Takes about 2 minutes on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin="$root/target/release/dflash"
tb_python=""
screenshots=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$(realpath "$2"); shift 2 ;;
    --tensorboard-python) tb_python="$2"; shift 2 ;;
    --no-screenshots) screenshots=0; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "no dflash binary at $bin: run make build first, or pass --bin" >&2; exit 2; }
command -v chromium >/dev/null || { echo "no chromium: apt-get install chromium (Debian's package)" >&2; exit 2; }

work=$(mktemp -d /tmp/dflash-ui.XXXXXX)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
"$bin" serve-train --config "$root/config/make-run.toml" --set "checkpoint.dir=$work/run" \
  --set "data.ledger=$work/run/ledger.jsonl" --set "control.listen=127.0.0.1:$port" \
  --set control.fault_injection=true --set eval.every_steps=60 --set optim.max_steps=400 \
  >"$work/serve.log" 2>&1 &
service=$!
trap 'kill $service 2>/dev/null; wait $service 2>/dev/null; rm -rf "$work"' EXIT

failed=0
check() { # NAME CONDITION-RESULT(0/1) DETAIL
  if [ "$2" = 0 ]; then echo "[check-ui] ok: $1"; else echo "[check-ui] FAILED: $1 ($3)"; failed=1; fi
}
# Waits until the Python expression over /status (s) and /history (h) holds, at most $2 seconds.
wait_for() {
  local expr=$1 limit=$2 start=$SECONDS
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    if python3 - "$url" "$expr" <<'PY' 2>/dev/null; then return 0; fi
import json, sys, urllib.request
url, expr = sys.argv[1], sys.argv[2]
s = json.load(urllib.request.urlopen(url + "/status", timeout=5))
h = json.load(urllib.request.urlopen(url + "/history", timeout=5))
sys.exit(0 if eval(expr) else 1)
PY
    kill -0 $service 2>/dev/null || { echo "[check-ui] the service ended:"; tail -20 "$work/serve.log"; exit 1; }
    sleep 2
  done
  return 1
}
chrome=(chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
  --disable-component-update --disable-sync --user-data-dir="$work/chrome" --virtual-time-budget=8000)
dom() { "${chrome[@]}" --dump-dom "$url/" 2>/dev/null; }

wait_for 'len(h["points"]) >= 3 and len(h["evaluations"]) >= 1 and s["ready"]' 240 ||
  { echo "[check-ui] no progress points and evaluation within 240 s"; tail -20 "$work/serve.log"; exit 1; }

page=$(dom)
values=$(grep -o 'id="chart-[a-z]*" data-values="[0-9,]*"' <<<"$page" || true)
check "five charts, each with data" "$([ "$(grep -c 'data-values="[1-9]' <<<"$values")" = 5 ] && echo 0 || echo 1)" "$values"
check "uPlot drew them" "$([ "$(grep -o 'class="uplot' <<<"$page" | wc -l)" -ge 5 ] && echo 0 || echo 1)" \
  "$(grep -o 'class="uplot' <<<"$page" | wc -l) plots"
check "the held-out evaluations are charted" \
  "$(grep -q 'id="chart-acceptance" data-values="[1-9][0-9]*,[1-9][0-9]*,[1-9]' <<<"$page" && echo 0 || echo 1)" "$values"
check "both drafters live" "$([ "$(grep -o 'data-state="live"' <<<"$page" | wc -l)" = 2 ] && echo 0 || echo 1)" \
  "$(grep -o 'data-state="[a-z]*"' <<<"$page" | tr '\n' ' ')"

curl -sf -X POST "$url/drafters/1/fault" -H 'content-type: application/json' -d '{"kind": "panic"}' >/dev/null
wait_for 's["drafters"][1]["restarts"] >= 1 and s["drafters"][1]["state"] == "live"' 120 ||
  check "the drafter came back" 1 "not live again within 120 s"
page=$(dom)
check "the restart shows" "$(grep -q 'data-restarts="1"' <<<"$page" && echo 0 || echo 1)" "no restart count of 1"
check "the failure is among the events" "$(grep -q 'drafter failed: injected panic' <<<"$page" && echo 0 || echo 1)" \
  "no 'drafter failed' event"
check "the restart is among the events" "$(grep -q 'restarting drafter=1' <<<"$page" && echo 0 || echo 1)" \
  "no 'restarting' event"

events=$(ls "$work/run/tensorboard"/events.out.tfevents.* 2>/dev/null | wc -l)
check "a TensorBoard event file" "$([ "$events" = 1 ] && echo 0 || echo 1)" "$events files"
if [ -n "$tb_python" ]; then
  read_back=$("$tb_python" - "$work/run/tensorboard" <<'PY' 2>/dev/null
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1]); ea.Reload()
tags = ea.Tags()["scalars"]
ok = {"train/loss", "train/lr", "eval/decoded_acceptance_length"} <= set(tags) and len(ea.Scalars("train/loss")) >= 3
print("ok" if ok else f"tags {tags}")
PY
)
  check "TensorBoard's reader reads it" "$([ "$read_back" = ok ] && echo 0 || echo 1)" "$read_back"
fi

if [ "$screenshots" = 1 ]; then
  "${chrome[@]}" --window-size=1280,1500 --screenshot="$root/docs/live-page.png" "$url/" 2>/dev/null
  # Headless Chromium lays pages out at least 500 px wide: the narrowest it shows.
  "${chrome[@]}" --window-size=500,2600 --screenshot="$root/docs/live-page-narrow.png" "$url/" 2>/dev/null
  echo "[check-ui] screenshots: docs/live-page.png, docs/live-page-narrow.png"
fi
[ "$failed" = 0 ] && echo "[check-ui] all passed" || echo "[check-ui] some checks failed"
exit "$failed"
