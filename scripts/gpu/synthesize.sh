#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "A drafter from the model folder alone"): the real model of the tests
# (SmolLM2-135M-Instruct) writes its own conversations (`dflash synthesize`), and README's recipe
# (config/smollm2-135m.toml) trains on them. The model and the template-prompt data come from scripts/gpu/recipe.sh
# (`part`, then `data`: /tmp/dflash-recipe/model, its 2,160 template prompts answered and prepared, the 64
# unseen-topic prompts in heldout.jsonl); this script works in the same folder.
#   synth COUNT [ARGS..]       synthesize COUNT conversations (+ 256 kept apart for evaluation) into synth.jsonl with
#                              --max-tokens 256 and ARGS; its summary and time to $OUT/synth.txt. With
#                              SYNTH_LIMIT=S it stops after S seconds (a later call continues the same file); the
#                              evaluation conversations are cut only from a finished file. A larger COUNT later
#                              continues the same file (the same seed gives the same first conversations)
#                              A synth.jsonl brought back by `keep` and carried in .gpu/synth/ (or SYNTH_FROM) is
#                              restored first. SYNTH=NAME writes NAME.jsonl instead (another file beside it, e.g.
#                              sampled answers: SYNTH=sampled synth 50000 --answer-temperature 0.8); `keep`, `train`
#                              and `peer` read the file SYNTH names. Every run is decoded on one set of held-out
#                              requests, the largest synthesis's (cut at min(COUNT, 50,000)): requests are drawn by
#                              each attempt's seed alone, so files of one seed and other answer options share them.
#   keep                       synth.jsonl xz-compressed into $OUT in parts of 15 MB (synth.jsonl.xz.part-NN), and
#                              its rejected attempts (synth.rejected.jsonl.xz), to be carried in .gpu/synth/ by a
#                              later lease instead of synthesizing again
#   train NAME DATA STEPS SEED [--set ..]
#                              DATA: template (the 2,160 answered prompts) or synth:N (the first N synthesized
#                              conversations); prepared once (--max-len 512), trained STEPS steps with
#                              objective.seed SEED, alone on the GPU, then its final drafter decoded (bf16, 256 new
#                              tokens, graphs) on the 64 unseen-topic prompts and on 64 synthesized conversations
#                              no run trains on; the times and results to $OUT/study.jsonl. With TRAIN_LIMIT=S the
#                              training is stopped (SIGTERM: it checkpoints) after S seconds, evaluating nothing; a
#                              later call with CONTINUE=1 and the same arguments resumes it (train_s is that call's).
#                              The control plane listens on 127.0.0.1:9410: the live page's /status and /history
#                              as last served, the page and the TensorBoard files go to $OUT/live-NAME. The GPU's
#                              peak used memory goes into each line (peak_mib)
#   peer NAME DATA SEED [ARGS..]
#                              the same DATA through speculators 0.9.0's trainer (`speculators train`, its defaults
#                              and ARGS; scripts/peers/speculators_peer.py), decoded as train's; carry .whl/speculators
# Results go to $OUT (or ./gpu-out).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-recipe
# BINARY=dflash-base runs another binary the calls carried in .gpu-bin (a before/after in one lease).
d=$work/bin/${BINARY:-dflash}
[ -x "$d" ] && [ -d "$work/model" ] || { echo "run scripts/gpu/recipe.sh part and data first" >&2; exit 2; }
# The file synthesized into and trained from (SYNTH, above).
synth=${SYNTH:-synth}
# The evaluation conversations: the 256 synthesized after the first min(COUNT, 50,000), cut before their first
# answer (the first 64 decoded), the same 256 however many are synthesized past 50,000; no run trains on them.
held=$work/synth-heldout.jsonl
# Where the file's evaluation conversations start (they are never trained on), and where the shared set's do.
held_at() { local c; c=$(cat "$work/$synth.held-at" 2>/dev/null) || { echo "run synth first" >&2; exit 2; }; echo "$c"; }
shared_held_at() { cat "$work/held-at" 2>/dev/null || echo 0; }
# The prepared folder of DATA (template, or synth:N prepared once from the first N synthesized conversations).
prepared_for() {
  case "$1" in
  template) echo "$work/data" ;;
  synth:*)
    local n=${1#synth:} p
    p=$work/data-$synth-$n
    if [ ! -d "$p" ]; then
      awk -v h="$(held_at)" 'NR <= h || NR > h + 256' "$work/$synth.jsonl" | head -n "$n" >"$work/$synth-$n.jsonl"
      local start=$SECONDS
      "$d" prepare --model "$work/model" --input "$work/$synth-$n.jsonl" --out "$p" --max-len 512 \
        --holdout 0 2>&1 | tail -2 >>"$out/prepare.txt"
      echo "prepare $synth:$n in $((SECONDS - start)) s" >>"$out/prepare.txt"
    fi
    echo "$p"
    ;;
  *) echo "DATA: template or synth:N, not $1" >&2; exit 2 ;;
  esac
}
# The GPU's used memory sampled every second into FILE while the command after it runs: peak_mib FILE.. prints the
# largest sample (the process's allocations and its caching allocator's reserve, as nvidia-smi sees them).
watch_memory() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 >"$1" 2>/dev/null & }
peak_mib() { cat "$@" 2>/dev/null | sort -n | tail -1; }
# A drafter decoded (bf16, 256 new tokens, graphs) on the 64 unseen-topic prompts and on 64 synthesized
# conversations no run trains on; one line each to $OUT/study.jsonl with the fields given after the drafter.
decode_both() {
  local drafter=$1 prompts file start result
  shift
  for prompts in heldout synth; do
    file=$work/heldout.jsonl
    [ "$prompts" = synth ] && { head -n 64 "$held" >"$work/synth-heldout-64.jsonl"; file=$work/synth-heldout-64.jsonl; }
    start=$SECONDS
    result=$("$d" eval --decode --target "$work/model" --drafter "$drafter" --prompts "$file" --max-new-tokens 256 \
      --json 2>>"$out/eval.stderr" | tail -1)
    python3 -c 'import json, sys; r = dict(zip(sys.argv[1::2], sys.argv[2::2])); r["eval"] = json.loads(r["eval"] or "null"); print(json.dumps(r))' \
      "$@" prompts "$prompts" eval_s "$((SECONDS - start))" eval "$result" | tee -a "$out/study.jsonl"
  done
}
# A run stopped by TRAIN_LIMIT (SIGTERM, exit 143) says so and ends the call.
stopped_by_limit() {
  if [ "$2" = 143 ]; then
    echo "$1 stopped by TRAIN_LIMIT after $3 s: CONTINUE=1 and the same arguments go on" | tee -a "$out/train-$1.txt"
    exit 0
  fi
}
case "${1:-}" in
synth)
  count=$2
  shift 2
  from=${SYNTH_FROM:-.gpu/synth}
  if [ -e "$from/$synth.jsonl.xz.part-00" ] && [ ! -e "$work/$synth.jsonl" ]; then
    cat "$from/$synth".jsonl.xz.part-* | xz -d >"$work/$synth.jsonl" || exit 1
    echo "restored $(wc -l <"$work/$synth.jsonl") conversations from $from" | tee -a "$out/synth.txt"
    # Without its rejected attempts a continued run tries them all again (the fourth lease did: 10,091 of them).
    if [ -e "$from/$synth.rejected.jsonl.xz" ]; then
      xz -dc "$from/$synth.rejected.jsonl.xz" >"$work/$synth.rejected.jsonl" || exit 1
      echo "restored $(wc -l <"$work/$synth.rejected.jsonl") rejected attempts" | tee -a "$out/synth.txt"
    fi
  fi
  start=$SECONDS
  timeout "${SYNTH_LIMIT:-0}" "$d" synthesize --model "$work/model" --count $((count + 256)) \
    --out "$work/$synth.jsonl" --max-tokens 256 "$@" >>"$out/synth.txt" 2>"$work/$synth.log"
  code=$?
  echo "exit $code after $((SECONDS - start)) s" >>"$out/synth.txt"
  tail -3 "$work/$synth.log" >>"$out/synth.txt"
  sha256sum "$work/$synth.jsonl" >>"$out/synth.txt"
  [ $code = 0 ] || { cat "$out/synth.txt"; exit $code; }
  h=$((count < 50000 ? count : 50000))
  echo "$h" >"$work/$synth.held-at"
  # A smaller synthesis keeps the larger one's evaluation set (the runs of one lease are decoded on the same requests).
  [ "$h" -ge "$(shared_held_at)" ] || { cat "$out/synth.txt"; exit 0; }
  echo "$h" >"$work/held-at"
  python3 - "$work/$synth.jsonl" "$held" "$h" <<'PY'
import json, sys
at = int(sys.argv[3])
lines = open(sys.argv[1]).read().splitlines()[at:at + 256]
with open(sys.argv[2], "w") as f:
    for l in lines:
        m = json.loads(l)["messages"]
        first = next(i for i, x in enumerate(m) if x["role"] == "assistant")
        f.write(json.dumps({"messages": m[:first]}) + "\n")
PY
  sha256sum "$held" >>"$out/synth.txt"
  cat "$out/synth.txt"
  ;;
keep)
  xz -T0 -6 -c "$work/$synth.jsonl" | split -b 15000000 -d - "$out/$synth.jsonl.xz.part-"
  xz -T0 -6 -c "$work/$synth.rejected.jsonl" >"$out/$synth.rejected.jsonl.xz"
  ls -la "$out"
  ;;
train)
  name=$2 data=$3 steps=$4 seed=$5
  shift 5
  prepared=$(prepared_for "$data") || exit 2
  r=$work/runs/$name
  resume=()
  if [ -n "${CONTINUE:-}" ] && [ -d "$r" ]; then resume=(--resume auto); else rm -rf "$r" && mkdir -p "$r"; fi
  start=$SECONDS
  watch_memory "$r/memory.$start"
  watcher=$!
  timeout --preserve-status --signal=TERM --kill-after=120 "${TRAIN_LIMIT:-0}" \
    "$d" serve-train --config config/smollm2-135m.toml --set "target.model=$work/model" --set "data.path=$prepared" \
    --set "data.ledger=$r/ledger.jsonl" --set "checkpoint.dir=$r" --set control.listen=127.0.0.1:9410 \
    --set "objective.seed=$seed" --set "optim.max_steps=$steps" --set "eval.prompts=$held" \
    --set checkpoint.every_steps=0 --set eval.every_steps=0 "${resume[@]}" "$@" >>"$r/train.log" 2>&1 &
  service=$!
  # The live page's data on the GPU (issue 71): /status, /history and the page as the run last served them, and
  # its TensorBoard event files, into $OUT/live-NAME.
  mkdir -p "$out/live-$name"
  while kill -0 $service 2>/dev/null; do
    for p in status history; do curl -sf "127.0.0.1:9410/$p" -o "$r/$p.json.part" && mv "$r/$p.json.part" "$r/$p.json"; done
    [ -s "$out/live-$name/page.html" ] || curl -sf 127.0.0.1:9410/ -o "$out/live-$name/page.html"
    sleep 3
  done
  wait $service
  code=$?
  train_s=$((SECONDS - start))
  kill $watcher 2>/dev/null
  cp "$r"/status.json "$r"/history.json "$out/live-$name/" 2>/dev/null
  cp -r "$r/tensorboard" "$out/live-$name/" 2>/dev/null
  echo "$name: serve-train ${resume[*]} exit $code after $train_s s, peak $(peak_mib "$r/memory.$start") MiB" >>"$out/train-$name.txt"
  grep -E "evaluation|run complete|resuming|stopped|ERROR|CUDA error" "$r/train.log" | cut -c1-300 >>"$out/train-$name.txt"
  stopped_by_limit "$name" "$code" "$train_s"
  peak=$(peak_mib "$r"/memory.*)
  decode_both "$r/final" trainer dflash run "$name" data "$data" steps "$steps" seed "$seed" set "$*" exit "$code" \
    train_s "$train_s" peak_mib "$peak"
  ;;
peer)
  # The same conversations through speculators 0.9.0's DFlash trainer (issue 64, item 5): its offline dataset
  # (the rows dflash trains on, `dflash inspect --json`; the target's hidden states written by
  # scripts/peers/speculators_peer.py with transformers) made once per DATA, then `speculators train` with its defaults
  # and ARGS, seed SEED, alone on the GPU; its last epoch's drafter decoded as `train` decodes, and scored
  # teacher-forced on its own validation rows (dflash eval --data) beside the validation acceptance it logged.
  # Needs .whl/speculators carried (by this call or an earlier one). TRAIN_LIMIT/CONTINUE as for train (speculators resumes
  # from its last epoch's checkpoint; the epoch in progress is lost).
  name=$2 data=$3 seed=$4
  shift 4
  speculators_wheels || exit 2
  prepared=$(prepared_for "$data") || exit 2
  taps=$(python3 -c 'import tomllib; print(*tomllib.load(open("config/smollm2-135m.toml", "rb"))["draft_model"]["target_layer_ids"])')
  peer_data=$work/peer-data-${data#*:}
  if [ ! -e "$peer_data/state.json" ]; then
    rm -rf "$peer_data"
    "$d" inspect "$prepared" --json >"$work/peer-rows-${data#*:}.jsonl" || exit 1
    start=$SECONDS
    "${PEER_PYTHON:-python3}" scripts/peers/speculators_peer.py data "$work/peer-rows-${data#*:}.jsonl" "$work/model" "$peer_data" --taps $taps \
      2>"$work/peer-data.log" | tee -a "$out/peer-data.txt" || { tail -20 "$work/peer-data.log"; exit 1; }
    echo "hidden states of $data in $((SECONDS - start)) s, $(du -sh "$peer_data" | cut -f1)" | tee -a "$out/peer-data.txt"
  fi
  r=$work/peer/$name
  [ -n "${CONTINUE:-}" ] || rm -rf "$r"
  mkdir -p "$r"
  start=$SECONDS
  watch_memory "$r/memory.$start"
  watcher=$!
  timeout --preserve-status --signal=TERM --kill-after=120 "${TRAIN_LIMIT:-0}" \
    "${PEER_PYTHON:-python3}" scripts/peers/speculators_peer.py train "$peer_data" "$work/model" "$r/save" --taps $taps --seed "$seed" "$@" \
    >>"$r/train.log" 2>&1
  code=$?
  train_s=$((SECONDS - start))
  kill $watcher 2>/dev/null
  echo "$name: speculators train exit $code after $train_s s, peak $(peak_mib "$r/memory.$start") MiB" >>"$out/train-$name.txt"
  grep -v "^│" "$r/train.log" | grep -E "Error|error|Training epoch|val/eal_epoch|it/s" | tail -12 | cut -c1-300 >>"$out/train-$name.txt"
  cp "$r/train.log" "$out/train-$name.log"
  stopped_by_limit "$name" "$code" "$train_s"
  [ "$code" = 0 ] || { tail -40 "$r/train.log"; exit "$code"; }
  last=$(ls "$r/save" | grep -E '^[0-9]+$' | sort -n | tail -1)
  # Its validation rows (the last 1%, as --train-data-ratio 0.99 splits them), scored teacher-forced by dflash:
  # the imported drafter should reach the acceptance speculators logged for them.
  rows=$(wc -l <"$work/peer-rows-${data#*:}.jsonl")
  tail -n +$((rows * 99 / 100 + 1)) "$work/peer-rows-${data#*:}.jsonl" >"$r/val.jsonl"
  "$d" eval --target "$work/model" --drafter "$r/save/$last" --data "$r/val.jsonl" --json 2>>"$out/eval.stderr" | tail -1 \
    | tee "$out/peer-$name-teacher-forced.json"
  grep -o "val/eal_epoch=[0-9.e+-]*" "$r/train.log" | tail -1 | tee -a "$out/peer-$name-teacher-forced.json"
  peak=$(peak_mib "$r"/memory.*)
  decode_both "$r/save/$last" trainer speculators run "$name" data "$data" seed "$seed" set "$*" exit "$code" \
    train_s "$train_s" peak_mib "$peak" epoch_dir "$last"
  ;;
*) echo "usage: $0 synth COUNT [ARGS..] | keep | train NAME DATA STEPS SEED [--set ..] | peer NAME DATA SEED [ARGS..]" >&2; exit 2 ;;
esac
