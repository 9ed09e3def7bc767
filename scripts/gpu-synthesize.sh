#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "A drafter from the model folder alone"): the real model of the tests
# (SmolLM2-135M-Instruct) writes its own conversations (`dflash synthesize`), and README's recipe
# (config/smollm2-135m.toml) trains on them. The model and the template-prompt data come from scripts/gpu-recipe.sh
# (`part`, then `data`: /tmp/dflash-recipe/model, its 2,160 template prompts answered and prepared, the 64
# unseen-topic prompts in heldout.jsonl); this script works in the same folder.
#   synth COUNT [ARGS..]       synthesize COUNT conversations (+ 256 kept apart for evaluation) into synth.jsonl with
#                              --max-tokens 256 and ARGS; its summary and time to $OUT/synth.txt. With
#                              SYNTH_LIMIT=S it stops after S seconds (a later call continues the same file); the
#                              evaluation conversations are cut only from a finished file. A larger COUNT later
#                              continues the same file (the same seed gives the same first conversations)
#                              A synth.jsonl brought back by `keep` and carried in .gpu/synth/ is restored first.
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
#                              as last served, the page and the TensorBoard files go to $OUT/live-NAME
# Results go to $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}
work=/tmp/dflash-recipe
d=$work/bin/dflash
mkdir -p "$out"
torch_lib=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$torch_lib:$torch_lib/../../nvidia/cu13/lib
[ -x "$d" ] && [ -d "$work/model" ] || { echo "run scripts/gpu-recipe.sh part and data first" >&2; exit 2; }
# The evaluation conversations: the 256 synthesized after the first min(COUNT, 50,000), cut before their first
# answer (the first 64 decoded), the same 256 however many are synthesized past 50,000; no run trains on them.
held=$work/synth-heldout.jsonl
held_at() { local c; c=$(cat "$work/held-at" 2>/dev/null) || { echo "run synth first" >&2; exit 2; }; echo "$c"; }
case "${1:-}" in
synth)
  count=$2
  shift 2
  if [ -e .gpu/synth/synth.jsonl.xz.part-00 ] && [ ! -e "$work/synth.jsonl" ]; then
    cat .gpu/synth/synth.jsonl.xz.part-* | xz -d >"$work/synth.jsonl" || exit 1
    echo "restored $(wc -l <"$work/synth.jsonl") conversations from .gpu/synth" | tee -a "$out/synth.txt"
    # Without its rejected attempts a continued run tries them all again (the fourth lease did: 10,091 of them).
    if [ -e .gpu/synth/synth.rejected.jsonl.xz ]; then
      xz -dc .gpu/synth/synth.rejected.jsonl.xz >"$work/synth.rejected.jsonl" || exit 1
      echo "restored $(wc -l <"$work/synth.rejected.jsonl") rejected attempts" | tee -a "$out/synth.txt"
    fi
  fi
  start=$SECONDS
  timeout "${SYNTH_LIMIT:-0}" "$d" synthesize --model "$work/model" --count $((count + 256)) \
    --out "$work/synth.jsonl" --max-tokens 256 "$@" >>"$out/synth.txt" 2>"$work/synth.log"
  code=$?
  echo "exit $code after $((SECONDS - start)) s" >>"$out/synth.txt"
  tail -3 "$work/synth.log" >>"$out/synth.txt"
  sha256sum "$work/synth.jsonl" >>"$out/synth.txt"
  [ $code = 0 ] || { cat "$out/synth.txt"; exit $code; }
  h=$((count < 50000 ? count : 50000))
  echo "$h" >"$work/held-at"
  python3 - "$work/synth.jsonl" "$held" "$h" <<'PY'
import json, sys
at = int(sys.argv[3])
lines = open(sys.argv[1]).read().splitlines()[at:at + 256]
with open(sys.argv[2], "w") as f:
    for l in lines:
        m = json.loads(l)["messages"]
        first = next(i for i, x in enumerate(m) if x["role"] == "assistant")
        f.write(json.dumps({"messages": m[:first]}) + "\n")
PY
  cat "$out/synth.txt"
  ;;
keep)
  xz -T0 -6 -c "$work/synth.jsonl" | split -b 15000000 -d - "$out/synth.jsonl.xz.part-"
  xz -T0 -6 -c "$work/synth.rejected.jsonl" >"$out/synth.rejected.jsonl.xz"
  ls -la "$out"
  ;;
train)
  name=$2 data=$3 steps=$4 seed=$5
  shift 5
  case "$data" in
  template) prepared=$work/data ;;
  synth:*)
    n=${data#synth:}
    prepared=$work/data-synth-$n
    if [ ! -d "$prepared" ]; then
      awk -v h="$(held_at)" 'NR <= h || NR > h + 256' "$work/synth.jsonl" | head -n "$n" >"$work/synth-$n.jsonl"
      start=$SECONDS
      "$d" prepare --model "$work/model" --input "$work/synth-$n.jsonl" --out "$prepared" --max-len 512 \
        --holdout 0 2>&1 | tail -2 >>"$out/prepare.txt"
      echo "prepare synth:$n in $((SECONDS - start)) s" >>"$out/prepare.txt"
    fi
    ;;
  *) echo "DATA: template or synth:N, not $data" >&2; exit 2 ;;
  esac
  r=$work/runs/$name
  resume=()
  if [ -n "${CONTINUE:-}" ] && [ -d "$r" ]; then resume=(--resume auto); else rm -rf "$r" && mkdir -p "$r"; fi
  start=$SECONDS
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
  cp "$r"/status.json "$r"/history.json "$out/live-$name/" 2>/dev/null
  cp -r "$r/tensorboard" "$out/live-$name/" 2>/dev/null
  echo "$name: serve-train ${resume[*]} exit $code after $train_s s" >>"$out/train-$name.txt"
  grep -E "evaluation|run complete|resuming|stopped|ERROR|CUDA error" "$r/train.log" | cut -c1-300 >>"$out/train-$name.txt"
  if [ "$code" = 143 ]; then
    echo "$name stopped by TRAIN_LIMIT after $train_s s: CONTINUE=1 and the same arguments go on" | tee -a "$out/train-$name.txt"
    exit 0
  fi
  for prompts in heldout synth; do
    file=$work/heldout.jsonl
    [ "$prompts" = synth ] && { head -n 64 "$held" >"$work/synth-heldout-64.jsonl"; file=$work/synth-heldout-64.jsonl; }
    start=$SECONDS
    result=$("$d" eval --decode --target "$work/model" --drafter "$r/final" --prompts "$file" --max-new-tokens 256 \
      --json 2>>"$out/eval.stderr" | tail -1)
    python3 -c 'import json, sys; r = dict(zip(sys.argv[1::2], sys.argv[2::2])); r["eval"] = json.loads(r["eval"] or "null"); print(json.dumps(r))' \
      run "$name" data "$data" steps "$steps" seed "$seed" set "$*" exit "$code" train_s "$train_s" prompts "$prompts" \
      eval_s "$((SECONDS - start))" eval "$result" | tee -a "$out/study.jsonl"
  done
  ;;
*) echo "usage: $0 synth COUNT [ARGS..] | keep | train NAME DATA STEPS SEED [--set ..]" >&2; exit 2 ;;
esac
