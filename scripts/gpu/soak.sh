#!/usr/bin/env bash
# Runs on the GPU machine (issue 66, items 1 and 5; BENCHMARKS.md, "Three real-model runs sharing one GPU"):
# real-model serve-trains sharing the one GPU, the condition every unexplained launch failure came from, each for the
# same wall time, with a drafter panic injected into the first. The model and its 2,160 answered template prompts
# come from scripts/gpu/recipe.sh (`part`, then `data`), in the same folder.
#   start MINUTES CASE..  each CASE its own serve-train in a new process session (it outlives the call; the machine
#                         stays up while calls follow back to back), stopped by SIGTERM after MINUTES (it
#                         checkpoints and exits; the step bound is out of reach, its warmup 100 steps, so the
#                         learning rate is the recipe's from then on); a drafter panic is asked of the first CASE's
#                         control plane at a third of MINUTES. Env: anything exported reaches the runs
#                         (CUDA_LAUNCH_BLOCKING=1, or DFLASH_STAIRCASE_ATTENTION=0 and the like to bisect; SOAK_SET:
#                         more --set for every run)
#   wait                  waits up to SOAK_WAIT_S seconds (default 540) for the runs of `start`, then reports each:
#                         exit code (143: stopped by the SIGTERM; pending while it runs), steps, restarts, CUDA
#                         errors, ledger duplicates
# CASE: readme (config/smollm2-135m.toml as README gives it: D-PACE, Muon, KL), dpace-adamw (D-PACE with AdamW, the
# run beside which README's recipe faulted at step 783), swa-eval (README's recipe with sliding windows and a decoded
# evaluation every 100 steps: a fault came inside an evaluation, another in a sliding-window run).
# Results go to $OUT (or ./gpu-out): soak.txt, and each run's log lines that matter in soak-CASE.log.
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-recipe
d=$work/bin/dflash
runs=$work/soak
[ -x "$d" ] && [ -d "$work/data" ] || { echo "run scripts/gpu/recipe.sh part and data first" >&2; exit 2; }

case_settings() {
  case "$1" in
  readme) echo "" ;;
  dpace-adamw) echo "--set optim.optimizer=adamw" ;;
  swa-eval) echo "--set draft_model.layer_types=sliding_attention --set eval.every_steps=100" ;;
  *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

# Duplicate (epoch, row) entries of a ledger after its rewinds (the chaos checks' verdict), and its batches.
ledger_verdict() {
  python3 -c 'import sys; sys.path.insert(0, "scripts/checks"); from chaos_one_host import ledger_verdict
duplicates, epochs = ledger_verdict(sys.argv[1])
print(f"ledger: {sum(epochs.values())} rows in {len(epochs)} epochs, {duplicates} rows twice")' "$1"
}

case "${1:-}" in
start)
  minutes=$2
  shift 2
  gpu_name
  rm -rf "$runs" && mkdir -p "$runs"
  port=9420
  for c in "$@"; do
    r=$runs/$c
    mkdir -p "$r"
    echo "$port" >"$r/port"
    # shellcheck disable=SC2046
    printf '%q ' timeout --preserve-status -s TERM -k 120 "$((minutes * 60))" \
      "$d" serve-train --config config/smollm2-135m.toml \
      --set "target.model=$work/model" --set "data.path=$work/data" --set "data.ledger=$r/ledger.jsonl" \
      --set "checkpoint.dir=$r" --set "control.listen=127.0.0.1:$port" --set control.fault_injection=true \
      --set "eval.prompts=$work/heldout.jsonl" --set optim.max_steps=1000000 --set optim.warmup_ratio=0.0001 \
      --set checkpoint.every_steps=200 \
      $(case_settings "$c") ${SOAK_SET:-} >"$r/command"
    setsid bash -c "$(cat "$r/command") >$r/train.log 2>&1; echo \$? >$r/exit" </dev/null >/dev/null 2>&1 &
    port=$((port + 1))
  done
  first=$runs/$1
  setsid bash -c "sleep $((minutes * 20)); curl -s -X POST -H 'content-type: application/json' \
    -d '{\"kind\": \"panic\"}' 127.0.0.1:$(cat "$first/port")/drafters/0/fault >$first/fault.txt 2>&1" \
    </dev/null >/dev/null 2>&1 &
  date -u +%s >"$runs/started"
  echo "started $* for $minutes min at $(date -u +%T)" | tee -a "$out/soak.txt"
  ;;
wait)
  limit=$((SECONDS + ${SOAK_WAIT_S:-540}))
  while [ $SECONDS -lt $limit ] && pgrep -f "$d serve-train" >/dev/null; do sleep 5; done
  echo "after $(($(date -u +%s) - $(cat "$runs/started"))) s:" | tee -a "$out/soak.txt"
  for r in "$runs"/*/; do
    c=$(basename "$r")
    log=$r/train.log
    code="exit $(cat "$r/exit" 2>/dev/null || echo pending)"
    last=$(grep -oE 'step=[0-9]+' "$log" | tail -1)
    echo "$c: $code; last $last; $(grep -oE 'run summary: [^;]*' "$log" | tail -1);" \
      "drafter failures $(grep -c 'drafter failed' "$log"), restarts $(grep -c 'restarting' "$log");" \
      "CUDA errors $(grep -c 'CUDA error' "$log");" \
      "fault asked: $(cat "$r/fault.txt" 2>/dev/null | head -c 200); $(ledger_verdict "$r/ledger.jsonl")" |
      tee -a "$out/soak.txt"
    grep -E "evaluation|run summary|stopped|restart|failed|panic|ERROR|WARN|CUDA error" "$log" | cut -c1-300 \
      | head -200 >"$out/soak-$c.log"
  done
  ;;
*) echo "usage: $0 start MINUTES CASE.. | wait" >&2; exit 2 ;;
esac
