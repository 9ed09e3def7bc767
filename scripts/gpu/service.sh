#!/usr/bin/env bash
# Runs on the GPU machine (see BENCHMARKS.md): serve-train against `bench --what pipeline` at qwen3-8b shapes, a
# drafter failure with two drafters sharing the GPU, the kernel-launch rate with 1-8 threads, and metrics, a SIGHUP
# reload and decoding evaluations beside training, in one lease.
# Expects the stripped binary in .bin/dflash. Results go to $OUT (or ./gpu-out).
set -uo pipefail
source scripts/gpu/prologue.sh
gpu_name
# STAGES picks the parts to run (default: "1 2 3 4 5"; 6 and 8 need several GPUs; 7 is the correlated failure; 9 a
# target spread over the GPUs; 10 two serve-train processes as two hosts on this machine, with a kill -9 and rejoin;
# 11 the same over NCCL with one GPU per process, against one process with both GPUs (or both on one GPU); 12
# serve-train at the published recipe's shapes, full-length rows and chat lengths; 13 rank 0 killed -9 under NCCL:
# host 1 checkpoints its replica, and both resume from it; 14 the decoding evaluation's cost to training, with and
# without CUDA graphs); 15 rank 0 stopped (SIGSTOP) under NCCL, several times: the other host waits, nothing fails).
stages=" ${STAGES:-1 2 3 4 5} "
has() { [[ $stages == *" $1 "* ]]; }
# MODEL, DEVICE, SEQ and ANCHORS change the shapes (a dry run on a laptop: MODEL=tiny DEVICE=cpu SEQ=64 ANCHORS=8).
model=${MODEL:-qwen3-8b} dev=${DEVICE:-cuda:0} seq=${SEQ:-768} anchors=${ANCHORS:-256}
shapes=(--set target.model=$model --set target.device=$dev --set data.path=synthetic --set data.max_len=$seq
  --set data.batch_size=4 --set data.builtin_conversations=4096 --set objective.num_anchors=$anchors
  --set checkpoint.every_steps=0 --set log.every_steps=5 --set log.format=json --set supervision.check_replicas_every=0)

# GET/POST on the control plane: get PATH | post PATH JSON
get() { python3 -c "import sys,urllib.request;print(urllib.request.urlopen('http://127.0.0.1:9410'+sys.argv[1]).read().decode())" "$1" 2>/dev/null; }
post() { python3 -c "import sys,urllib.request;r=urllib.request.Request('http://127.0.0.1:9410'+sys.argv[1],data=sys.argv[2].encode(),headers={'content-type':'application/json'});print(urllib.request.urlopen(r).read().decode())" "$1" "$2"; }
step() { get /status | python3 -c "import sys,json;print(json.load(sys.stdin)['step'])" 2>/dev/null || echo -1; }
wait_step() {  # gives up after 5 minutes
  local deadline=$((SECONDS + ${WAIT_S:-300}))
  until [ "$(step)" -ge "$1" ] || [ $SECONDS -ge $deadline ]; do sleep 0.2; done
}
evaluated() { get /status | python3 -c "import sys,json;print(json.load(sys.stdin)['last_evaluation'] is not None)" 2>/dev/null; }
wait_eval() {  # until an evaluation has finished; gives up after 3 minutes
  local deadline=$((SECONDS + 180))
  until [ "$(evaluated)" = True ] || [ $SECONDS -ge $deadline ]; do sleep 0.5; done
}

# GPU 0's utilisation (where stages 2 and 3 run) sampled every 200 ms into FILE until the returned pid is killed
smi() { nvidia-smi -i 0 --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 >"$1" 2>/dev/null & }

# samples/s and tokens/s of the run between steps $1 and $2, read from (rank 0's) status and metrics on port 9410
rate() {
  python3 - "$1" "$2" <<'PY'
import json, sys, time, urllib.request
a, b = int(sys.argv[1]), int(sys.argv[2])
deadline = time.time() + 150
def read(path):
    while True:  # the service may still be starting
        try:
            return urllib.request.urlopen("http://127.0.0.1:9410" + path).read().decode()
        except OSError:
            if time.time() > deadline: raise
            time.sleep(0.2)
def st():
    return json.loads(read("/status"))
def tokens():
    return sum(float(l.split()[-1]) for l in read("/metrics").splitlines()
               if l.startswith("dflash_committed_tokens_total"))
while st()["step"] < a and time.time() < deadline: time.sleep(0.05)
s0, k0, t0 = st(), tokens(), time.time()
while st()["step"] < b and time.time() < deadline: time.sleep(0.05)
s1, k1, t1 = st(), tokens(), time.time()
print(json.dumps({"steps": s1["step"] - s0["step"], "seconds": round(t1 - t0, 3),
                  "samples_per_s": round((s1["samples_committed"] - s0["samples_committed"]) / (t1 - t0), 2),
                  "tokens_per_s": round((k1 - k0) / (t1 - t0), 1)}))
PY
}

if has 1; then
echo "== 1. bench --what pipeline"
./.bin/dflash bench --what pipeline --preset $model --device $dev --batch 4 --seq $seq --anchors $anchors \
  --steps 20 --warmup 3 --json --profile | tee "$out/pipeline.json"
fi

if has 2; then
echo "== 2. serve-train, one drafter, same shapes"
rm -rf runs/one
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=[\"$dev\"]" --set checkpoint.dir=runs/one \
  2>"$out/serve-one.log" &
pid=$!
wait_step 20
smi /tmp/smi-one.csv; smi_pid=$!
wait_step 70
kill $smi_pid
# Utilisation over steps 20-70 (steady state): samples, mean, minimum, and how many read below 90%.
awk -F', ' '{n++; s+=$1; if (min=="" || $1<min) min=$1; if ($1<90) low++} END {printf "{\"samples\": %d, \"mean_util\": %.1f, \"min_util\": %d, \"below_90\": %d}\n", n, s/n, min, low}' \
  /tmp/smi-one.csv | tee "$out/util-one.json"
kill -9 $pid; wait 2>/dev/null
fi

if has 3; then
echo "== 3. two drafters sharing the GPU, drafter 1 panics at step 25"
rm -rf runs/two
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=[\"$dev\", \"$dev\"]" \
  --set checkpoint.dir=runs/two --set control.fault_injection=true 2>"$out/serve-two.log" &
pid=$!
wait_step 25
date +%s.%N >"$out/fault-sent"
post /drafters/1/fault '{"kind": "panic"}'
scripts/probes/status_timeline.py --since "$out/fault-sent" --out "$out/fault-timeline.json" \
  --key "[d['state'] for d in s['drafters']]" --until "changes > 1 and all(d['state'] == 'live' for d in s['drafters']) and t > 1"
wait_step $(($(step) + 15))
kill -9 $pid; wait 2>/dev/null
fi

if has 4; then
echo "== 4. kernel-launch rate, 1/2/4/8 threads, on the default stream, on a stream each, and on the CPU"
for flags in "--device $dev" "--device $dev --own-streams" "--device cpu"; do
  ./.bin/dflash bench --what launch $flags --threads 1,2,4,8 --launches 100000 --json
done | tee "$out/launch.jsonl"
# The tiny drafter's step is launch-bound on a GPU: its time bounds the kernels a step launches.
./.bin/dflash bench --what drafter --preset tiny --device $dev --batch 4 --seq 64 --anchors 8 --steps 20 --json \
  | tee "$out/tiny-drafter.json"
fi

if has 5; then
echo "== 5. metrics, a SIGHUP reload at step 30 and a decoding evaluation every 60 steps, one drafter"
rm -rf runs/obs
python3 -c '
import json, random
random.seed(0)
with open("/tmp/prompts.jsonl", "w") as f:
    for i in range(4):
        f.write(json.dumps({"input_ids": [random.randrange(10, 300) for _ in range(128)]}) + "\n")
'
printf '[optim]\nlr = 6e-4\nschedule = "constant"\nwarmup_ratio = 0.0\n' >/tmp/obs.toml
./.bin/dflash --config /tmp/obs.toml serve-train "${shapes[@]}" --set "drafters.devices=[\"$dev\"]" \
  --set checkpoint.dir=runs/obs --set eval.every_steps=60 --set eval.prompts=/tmp/prompts.jsonl \
  --set eval.num_prompts=4 --set eval.max_new_tokens=64 --set checkpoint.every_steps=40 --set log.every_steps=1 \
  2>"$out/serve-obs.log" &
pid=$!
wait_step 30
printf '[optim]\nlr = 3e-4\nschedule = "constant"\nwarmup_ratio = 0.0\n' >/tmp/obs.toml
kill -HUP $pid; kill -HUP $pid
wait_step 300
# Checkpoints take tens of seconds to write and an evaluation decodes the newest one: wait for one to finish.
wait_eval
get /metrics >"$out/metrics-gpu.txt"
get /status >"$out/status-obs.json"
nvidia-smi --query-gpu=index,uuid --format=csv,noheader >>"$out/gpu.txt"
kill -9 $pid; wait 2>/dev/null
grep -E "evaluation|configuration|checkpoint written" "$out/serve-obs.log" | tail -20
grep -E "^dflash_(learning_rate|mfu_ratio|drafter_info|device_memory_allocated_bytes|decode_acceptance_length|eval_duration_seconds_(sum|count))" "$out/metrics-gpu.txt"
fi

if has 6; then
# CAPTURE: target.capture_devices ('[]': one target on cuda:0 feeding all; "colocated": one on each GPU).
capture=${CAPTURE:-colocated}
# COLLECTIVE: drafters.collective (in_process or nccl).
collective=${COLLECTIVE:-in_process}
echo "== 6. one drafter per GPU on $(nvidia-smi -L | wc -l) GPUs (capture_devices=$capture, $collective collective); drafter 1 panics at step 40"
n=$(nvidia-smi -L | wc -l)
devices=$(python3 -c "import json;print(json.dumps(['cuda:%d' % i for i in range($n)]))")
rm -rf runs/multi
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=$devices" --set checkpoint.dir=runs/multi \
  --set control.fault_injection=true --set supervision.check_replicas_every=10 \
  --set "target.capture_devices=$capture" --set "drafters.collective=$collective" 2>"$out/serve-multi.log" &
pid=$!
wait_step 40
post /drafters/1/fault '{"kind": "panic"}'
wait_step 90
get /status >"$out/status-multi.json"
get /metrics | grep -E "^dflash_(collective_duration_seconds_(sum|count)|step_duration_seconds_(sum|count)|drafter_info)" \
  >"$out/metrics-multi.txt"
kill -9 $pid; wait 2>/dev/null
fi

if has 7; then
echo "== 7. two drafters sharing the GPU, both panic at once at step 25: one founds again, the other joins it"
rm -rf runs/both
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=[\"$dev\", \"$dev\"]" \
  --set checkpoint.dir=runs/both --set control.fault_injection=true 2>"$out/serve-both.log" &
pid=$!
wait_step 25
date +%s.%N >"$out/both-sent"
post /drafters/0/fault '{"kind": "panic"}'
post /drafters/1/fault '{"kind": "panic"}'
scripts/probes/status_timeline.py --since "$out/both-sent" --out "$out/both-timeline.json" \
  --key "[[d['state'] for d in s['drafters']], s['phase']]" --until "changes > 1 and all(d['state'] == 'live' for d in s['drafters']) and s['step'] > 5"
wait_step $(($(step) + 10))
kill -9 $pid; wait 2>/dev/null
grep -E "rewind|continues from|drafter live" "$out/serve-both.log" | tail -8
fi

if has 8; then
# A hang over NCCL, with the default hang budget (hang_factor x p99 round time, floor 30 s, step_timeout_s 600 s):
# drafter 1 hangs inside its step at step 40; its peer waits in the all-reduce. The watchdog finds the hung one.
echo "== 8. one drafter per GPU over NCCL; drafter 1 hangs at step 40 (default hang budget)"
n=$(nvidia-smi -L | wc -l)
devices=$(python3 -c "import json;print(json.dumps(['cuda:%d' % i for i in range($n)]))")
rm -rf runs/hang
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=$devices" --set checkpoint.dir=runs/hang \
  --set control.fault_injection=true --set target.capture_devices=colocated --set drafters.collective=nccl \
  2>"$out/serve-hang.log" &
pid=$!
wait_step 40
date +%s.%N >"$out/hang-sent"
post /drafters/1/fault '{"kind": "hang"}'
scripts/probes/status_timeline.py --since "$out/hang-sent" --out "$out/hang-timeline.json" --limit 400 \
  --key "[[d['state'], d['restarts']] for d in s['drafters']]" \
  --until "s['drafters'][1]['restarts'] >= 1 and all(d['state'] == 'live' for d in s['drafters'])"
wait_step $(($(step) + 10))
kill -9 $pid; wait 2>/dev/null
grep -E "drafter failed|hang budget|drafter live" "$out/serve-hang.log" | tail -6
fi

if has 9; then
# One target copy spread over every GPU (over cuda:0 twice where there is one: the same code path, no speed-up),
# drafters one per GPU; part 1 of the target panics at step 40 and the copy restarts whole.
n=$(nvidia-smi -L | wc -l)
if [ "$n" -gt 1 ]; then
  spread=$(python3 -c "import json;print(json.dumps(['cuda:%d' % i for i in range(1, $n)]))")
  devices=$(python3 -c "import json;print(json.dumps(['cuda:%d' % i for i in range($n)]))")
else
  spread='["cuda:0"]' devices='["cuda:0"]'
fi
echo "== 9. one target spread over $spread beside $dev, drafters on $devices; part 1 panics at step 40"
rm -rf runs/spread
./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=$devices" --set checkpoint.dir=runs/spread \
  --set control.fault_injection=true --set "target.spread_to=$spread" 2>"$out/serve-spread.log" &
pid=$!
wait_step 40
date +%s.%N >"$out/spread-fault-sent"
post /targets/0/fault '{"part": 1}'
wait_step 110
get /status >"$out/status-spread.json"
kill -9 $pid; wait 2>/dev/null
grep -E "target loaded|target failed|target restarted|set aside" "$out/serve-spread.log" | tail -6
fi

if has 10; then
WAIT_S=90
# Several hosts on one machine: two serve-train processes as two hosts (rank 0 serves the c10d store on loopback;
# each host's summed gradient crosses through it), each with one drafter on $dev beside its own target, against
# one process alone; rank 1 is killed -9 at step 40 and started again. HOST_MODELS picks the targets; the drafter
# has one layer (its fp32 gradient: ~0.5 GB at qwen3-4b).
for m in ${HOST_MODELS:-qwen3-4b}; do
  # The tiny presets take rows of at most 128 tokens.
  case $m in tiny*) ms=64 ma=8 ;; *) ms=$seq ma=$anchors ;; esac
  hs=(--set target.model=$m --set target.device=$dev --set data.path=synthetic --set data.max_len=$ms
    --set data.batch_size=4 --set data.builtin_conversations=4096 --set objective.num_anchors=$ma
    --set checkpoint.every_steps=0 --set log.every_steps=5 --set log.format=json --set "drafters.devices=[\"$dev\"]"
    --set draft_model.num_hidden_layers=1 --set supervision.check_replicas_every=10)
  echo "== 10. $m: one process"
  rm -rf runs/h1
  ./.bin/dflash serve-train "${hs[@]}" --set checkpoint.dir=runs/h1 2>"$out/hosts-$m-one.log" &
  pid=$!
  rate 10 40 | tee "$out/hosts-$m-one.json"
  get /metrics | grep -E "^dflash_(collective_duration|step_duration)_seconds_(sum|count)" >"$out/hosts-$m-one-metrics.txt"
  kill -9 $pid; wait 2>/dev/null
  echo "== 10. $m: two processes as two hosts"
  rm -rf runs/h2 runs/h2-1
  cl=(--set cluster.hosts=2 --set cluster.master_addr=127.0.0.1 --set cluster.master_port=29512
    --set cluster.round_timeout_s=60)
  ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" --set cluster.rank=0 --set checkpoint.dir=runs/h2 \
    2>"$out/hosts-$m-rank0.log" &
  p0=$!
  ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" --set cluster.rank=1 --set checkpoint.dir=runs/h2-1 \
    --set control.listen=127.0.0.1:9411 2>"$out/hosts-$m-rank1.log" &
  p1=$!
  rate 10 40 | tee "$out/hosts-$m-two.json"
  get /metrics | grep -E "^dflash_(collective_duration|step_duration)_seconds_(sum|count)" >"$out/hosts-$m-two-metrics.txt"
  kill -9 $p1
  date +%s.%N >"$out/hosts-$m-killed"
  ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" --set cluster.rank=1 --set checkpoint.dir=runs/h2-1 \
    --set control.listen=127.0.0.1:9411 2>"$out/hosts-$m-rank1-again.log" &
  p1=$!
  deadline=$((SECONDS + 120))
  until grep -q '"generation":2' <(grep "host joined the run" "$out/hosts-$m-rank0.log") || [ $SECONDS -ge $deadline ]; do
    sleep 0.1
  done
  date +%s.%N >"$out/hosts-$m-rejoined"
  wait_step $(($(step) + 20))
  get /status >"$out/hosts-$m-status.json"
  kill -9 $p0 $p1; wait 2>/dev/null
  grep -E "host (joined|left)|hosts changed|replicas" "$out/hosts-$m-rank0.log" | tail -8
done
# One file back instead of many.
tar -C "$out" -czf "$out/hosts.tgz" $(cd "$out" && ls hosts-* 2>/dev/null) && (cd "$out" && rm -f hosts-*)
fi

if has 11; then
WAIT_S=90
# Two hosts over NCCL on a two-GPU machine: two serve-train processes of one GPU each (NCCL forced onto its network
# transport, as between hosts: no P2P, no shared memory, sockets on loopback), against one process with both GPUs;
# then rank 1 is killed -9 and started again. The shapes of stage 10 (HOST_MODEL, one-layer drafter), so the store's
# numbers there compare.
m=${HOST_MODEL:-qwen3-4b}
hs=(--set target.model=$m --set data.path=synthetic --set data.max_len=$seq --set data.batch_size=4
  --set data.builtin_conversations=4096 --set objective.num_anchors=$anchors --set checkpoint.every_steps=0
  --set log.every_steps=5 --set log.format=json --set draft_model.num_hidden_layers=1
  --set supervision.check_replicas_every=10 --set drafters.collective=nccl --set drafters.collective_timeout_s=30)
n=$(nvidia-smi -L | wc -l)
# With one GPU both processes use it, each told it is on a host of its own (NCCL_HOSTID): NCCL then refuses no
# "duplicate GPU" and connects them over its network transport, as between hosts; the one-process comparison is
# stage 10's.
if [ "$n" -ge 2 ]; then g1=cuda:1; else g1=cuda:0; fi
if [ "$n" -ge 2 ]; then
  echo "== 11. $m: one process, two GPUs over NCCL"
  rm -rf runs/n1
  ./.bin/dflash serve-train "${hs[@]}" --set target.device=cuda:0 --set target.capture_devices=colocated \
    --set 'drafters.devices=["cuda:0", "cuda:1"]' --set checkpoint.dir=runs/n1 2>"$out/nccl-one.log" &
  pid=$!
  rate 10 40 | tee "$out/nccl-one.json"
  get /metrics | grep -E "^dflash_(collective_duration|step_duration)_seconds_(sum|count)" >"$out/nccl-one-metrics.txt"
  kill -9 $pid; wait 2>/dev/null
fi
echo "== 11. $m: two processes as two hosts, NCCL over sockets"
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=${NCCL_DEBUG:-WARN}
rm -rf runs/n2 runs/n2-1
cl=(--set cluster.hosts=2 --set cluster.master_addr=127.0.0.1 --set cluster.master_port=29513
  --set cluster.round_timeout_s=60)
r0=(--set cluster.rank=0 --set target.device=cuda:0 --set 'drafters.devices=["cuda:0"]' --set checkpoint.dir=runs/n2)
r1=(--set cluster.rank=1 --set target.device=$g1 --set "drafters.devices=[\"$g1\"]" --set checkpoint.dir=runs/n2-1
  --set control.listen=127.0.0.1:9411 --set control.fault_injection=true)
NCCL_HOSTID=host0 ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" "${r0[@]}" 2>"$out/nccl-rank0.log" &
p0=$!
NCCL_HOSTID=host1 ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" "${r1[@]}" 2>"$out/nccl-rank1.log" &
p1=$!
rate 10 40 | tee "$out/nccl-two.json"
get /metrics | grep -E "^dflash_(collective_duration|step_duration)_seconds_(sum|count)" >"$out/nccl-two-metrics.txt"
# until rank 0 logs generation $1 of host 1 joined (or rank 0 is gone, or 100 s pass)
joined() {
  local deadline=$((SECONDS + 100))
  until grep -q "\"generation\":$1" <(grep "host joined the run" "$out/nccl-rank0.log") || [ $SECONDS -ge $deadline ] \
    || ! kill -0 $p0 2>/dev/null; do
    sleep 0.1
  done
  date +%s.%N
}
# Host 1's only drafter fails before it contributes (a panic): the host leaves, enters again as generation 2 and
# rejoins from rank 0 (the ring rebuilt twice), in the same process.
date +%s.%N >"$out/nccl-fault-sent"
python3 -c "import urllib.request as u;u.urlopen(u.Request('http://127.0.0.1:9411/drafters/0/fault',data=b'{\"kind\": \"panic\"}',headers={'content-type':'application/json'}))"
joined 2 >"$out/nccl-fault-rejoined"
kill -0 $p0 2>/dev/null && wait_step $(($(step) + 10))
# Then the process killed -9 at a random point of its step, and started again.
kill -9 $p1
date +%s.%N >"$out/nccl-killed"
NCCL_HOSTID=host1 ./.bin/dflash serve-train "${hs[@]}" "${cl[@]}" "${r1[@]}" 2>"$out/nccl-rank1-again.log" &
p1=$!
joined 3 >"$out/nccl-rejoined"
kill -0 $p0 2>/dev/null && wait_step $(($(step) + 20))
get /status >"$out/nccl-status.json"
kill -0 $p0 2>/dev/null || { wait $p0; echo "rank 0 exited with $?" | tee "$out/nccl-rank0-exit"; }
kill -9 $p0 $p1; wait 2>/dev/null
grep -E "host (joined|left)|hosts changed|replicas|NCCL|failed" "$out/nccl-rank0.log" | tail -12
grep -h "took the donor's state" "$out"/nccl-rank1*.log | tail -4
grep -hc "skipped" "$out"/nccl-rank*.log
tar -C "$out" -czf "$out/nccl.tgz" $(cd "$out" && ls nccl-* 2>/dev/null) && (cd "$out" && rm -f nccl-*)
fi

if has 12; then
# The published recipe's shapes end to end (the second Performance issue): 4 x 3072 tokens, 512 anchors, one drafter
# beside its target, with every row 3,072 tokens long and with chat lengths (data.path = "synthetic-chat");
# RECIPE_DATA picks them (or names a prepared folder), RECIPE_BATCH sets data.batch_size (4), and RECIPE_PACK lists
# the batching of each run: "off" (length-bucketed batches, the default) or N (data.pack: one packed row of up to N
# tokens a step).
for data in ${RECIPE_DATA:-synthetic synthetic-chat}; do
  for pack in ${RECIPE_PACK:-off}; do
    batching=(--set data.batch_size=${RECIPE_BATCH:-4})
    [ "$pack" != off ] && batching=(--set data.pack=true --set data.pack_len=$pack --set data.batch_size=1)
    name=$(basename "$data")-$pack
    echo "== 12. serve-train, rows of up to 3072, 512 anchors, data.path=$data, ${batching[*]}"
    rm -rf runs/recipe
    ./.bin/dflash serve-train "${shapes[@]}" --set data.max_len=3072 --set objective.num_anchors=512 \
      --set data.path=$data "${batching[@]}" --set "drafters.devices=[\"$dev\"]" --set checkpoint.dir=runs/recipe \
      2>"$out/recipe-$name.log" &
    pid=$!
    rate 10 40 | tee "$out/recipe-$name.json"
    kill -9 $pid; wait 2>/dev/null
  done
done
fi

if has 13; then
# Rank 0 lost over NCCL: two processes as two hosts on one GPU (as stage 11) sharing checkpoint.dir, rank 0
# checkpointing every 30 steps; rank 0 is killed -9 between checkpoints, host 1 checkpoints its replica into
# checkpoint.dir/survivors/host-1 and exits 75, then both are started again with --resume auto and rank 0 resumes
# from host 1's checkpoint.
m=${HOST_MODEL:-qwen3-4b}
echo "== 13. $m: rank 0 killed -9 under NCCL, host 1 checkpoints, both resume"
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=${NCCL_DEBUG:-WARN}
hs=(--set target.model=$m --set data.path=synthetic --set data.max_len=$seq --set data.batch_size=4
  --set data.builtin_conversations=4096 --set objective.num_anchors=$anchors --set checkpoint.every_steps=30
  --set log.every_steps=5 --set log.format=json --set draft_model.num_hidden_layers=1
  --set drafters.collective=nccl --set drafters.collective_timeout_s=30 --set checkpoint.dir=runs/n3
  --set cluster.hosts=2 --set cluster.master_addr=127.0.0.1 --set cluster.master_port=29523
  --set cluster.round_timeout_s=60 --set target.device=cuda:0 --set 'drafters.devices=["cuda:0"]')
rm -rf runs/n3
for run in first resumed; do
  resume=(); [ $run = resumed ] && resume=(--resume auto)
  NCCL_HOSTID=host0 ./.bin/dflash serve-train "${hs[@]}" --set cluster.rank=0 "${resume[@]}" \
    2>"$out/lost-$run-rank0.log" &
  p0=$!
  NCCL_HOSTID=host1 ./.bin/dflash serve-train "${hs[@]}" --set cluster.rank=1 --set control.listen=127.0.0.1:9411 \
    "${resume[@]}" 2>"$out/lost-$run-rank1.log" &
  p1=$!
  if [ $run = first ]; then
    wait_step 40
    kill -9 $p0
    date +%s.%N >"$out/lost-killed"
    deadline=$((SECONDS + 120))
    while kill -0 $p1 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
    date +%s.%N >"$out/lost-rank1-exited"
    kill -0 $p1 2>/dev/null && { echo "host 1 still running after 120 s"; kill -9 $p1; }
    wait $p1; echo "host 1 exited with $?" | tee "$out/lost-rank1-exit"
    ls runs/n3 runs/n3/survivors/host-1 | tee "$out/lost-folders.txt"
  else
    wait_step 1  # the control plane answers (with the resumed step)
    get /status >"$out/lost-resumed-start.json"
    wait_step $(($(step) + 10))
    get /status >"$out/lost-resumed-status.json"
    kill -9 $p0 $p1; wait 2>/dev/null
  fi
done
grep -h "checkpoint written\|checkpointed this host\|rendezvous host is gone\|resuming" "$out"/lost-*.log | cut -c1-400
tar -C "$out" -czf "$out/lost.tgz" $(cd "$out" && ls lost-* 2>/dev/null) && (cd "$out" && rm -f lost-*)
fi

if has 14; then
# The in-training evaluation's cost to training, with the target's decoding steps replayed from CUDA graphs and
# without (eval.cuda_graphs), in one lease: serve-train at stage 5's shapes with a one-layer drafter (its checkpoints
# write in seconds), an evaluation of 4 prompts x 64 tokens every EVAL_EVERY (60) steps, far enough apart for steps
# between them; per run, each evaluation's seconds and the mean step time while it ran against the mean step time
# outside.
python3 -c '
import json, random
random.seed(0)
with open("/tmp/prompts.jsonl", "w") as f:
    for i in range(4):
        f.write(json.dumps({"input_ids": [random.randrange(10, 300) for _ in range(128)]}) + "\n")
'
# RUNS14 lists the runs as graphs:stream (the evaluator's stream priority, DFLASH_EVAL_STREAM).
for run in ${RUNS14:-true:high false:high}; do
  graphs=${run%%:*} priority=${run##*:}
  echo "== 14. evaluation beside training, eval.cuda_graphs = $graphs, evaluator stream $priority"
  rm -rf runs/evalcost
  DFLASH_EVAL_STREAM=$priority ./.bin/dflash serve-train "${shapes[@]}" --set "drafters.devices=[\"$dev\"]" \
    --set draft_model.num_hidden_layers=1 --set checkpoint.dir=runs/evalcost --set eval.every_steps=${EVAL_EVERY:-60} \
    --set eval.prompts=/tmp/prompts.jsonl --set eval.num_prompts=4 --set eval.max_new_tokens=64 \
    --set eval.cuda_graphs=$graphs --set log.every_steps=1 2>"$out/evalcost-$graphs-$priority.log" &
  pid=$!
  deadline=$((SECONDS + ${EVAL_WAIT_S:-240}))
  until [ "$(grep -c 'evaluation: decoded' "$out/evalcost-$graphs-$priority.log")" -ge 3 ] || [ $SECONDS -ge $deadline ] \
    || ! kill -0 $pid 2>/dev/null; do sleep 1; done
  kill -9 $pid; wait 2>/dev/null
  python3 - "$out/evalcost-$graphs-$priority.log" <<'PY' | tee "$out/evalcost-$graphs-$priority.json"
import datetime, json, re, sys
def when(v):
    return datetime.datetime.fromisoformat(v["timestamp"].replace("Z", "+00:00")).timestamp()
steps, evals = [], []
for line in open(sys.argv[1]):
    try:
        v = json.loads(line)
    except ValueError:
        continue
    m = v.get("fields", {}).get("message", "")
    if re.match(r"step \d+ ", m):
        steps.append(when(v))
    elif m.startswith("evaluation: decoded"):
        seconds = float(re.search(r"· ([0-9.]+) s ·", m).group(1))
        evals.append((when(v) - seconds, when(v)))
gaps = [(b, b - a) for a, b in zip(steps, steps[1:])]
inside = [d for t, d in gaps if any(s <= t <= e for s, e in evals)]
outside = [d for t, d in gaps if not any(s - 1 <= t <= e + 1 for s, e in evals)]
mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None
print(json.dumps({"evaluations_s": [round(e - s, 2) for s, e in evals], "step_s_during": mean(inside),
                  "step_s_outside": mean(outside), "steps_during": len(inside), "steps_outside": len(outside)}))
PY
done
fi

if has 15; then
# Rank 0 stopped (SIGSTOP) for STOP_S (40) s, STOPS (3) times, over NCCL: two processes as two hosts on one GPU (as
# stage 13), the defaults otherwise (hang floor 30 s, cluster.leader_timeout_s 60, drafters.collective_timeout_s
# 120). Over sockets the all-reduce is most of a step, so a stop lands inside it most times: host 1's drafter then
# waits in the all-reduce for rank 0, and must not be failed as hung. STOP_BINS: the builds to compare.
m=${HOST_MODEL:-qwen3-4b}
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=${NCCL_DEBUG:-WARN}
hs=(--set target.model=$m --set data.path=synthetic --set data.max_len=$seq --set data.batch_size=4
  --set data.builtin_conversations=4096 --set objective.num_anchors=$anchors --set checkpoint.every_steps=0
  --set log.every_steps=5 --set log.format=json --set draft_model.num_hidden_layers=1
  --set drafters.collective=nccl --set cluster.hosts=2 --set cluster.master_addr=127.0.0.1
  --set cluster.master_port=29533 --set target.device=cuda:0 --set 'drafters.devices=["cuda:0"]')
for bin in ${STOP_BINS:-./.bin/dflash}; do
  tag=$(basename "$bin")
  echo "== 15. $m: rank 0 stopped ${STOP_S:-40} s ${STOPS:-3} times under NCCL ($tag)"
  rm -rf runs/s0 runs/s1
  NCCL_HOSTID=host0 "$bin" serve-train "${hs[@]}" --set cluster.rank=0 --set checkpoint.dir=runs/s0 \
    2>"$out/stopped-$tag-rank0.log" &
  p0=$!
  NCCL_HOSTID=host1 "$bin" serve-train "${hs[@]}" --set cluster.rank=1 --set checkpoint.dir=runs/s1 \
    --set control.listen=127.0.0.1:9411 2>"$out/stopped-$tag-rank1.log" &
  p1=$!
  wait_step 30
  for n in $(seq "${STOPS:-3}"); do
    at=$(step)
    kill -STOP $p0
    sleep 2
    # Where host 1's drafter waits: inside the all-reduce its thread polls NCCL (CPU time, a sleeping wchan);
    # waiting for rank 0 through the store it blocks on a socket (next to no CPU time).
    python3 - $p1 <<'PY'
import glob, sys, time
def ticks():
    out = {}
    for t in glob.glob(f"/proc/{sys.argv[1]}/task/*"):
        try:
            name = open(f"{t}/comm").read().strip()
            fields = open(f"{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (name, int(fields[11]) + int(fields[12]), open(f"{t}/wchan").read().strip())
        except OSError:
            pass
    return out
a = ticks(); time.sleep(1); b = ticks()
for t, (name, cpu, wchan) in b.items():
    if name.startswith("drafter") and t in a:
        print(f"  host 1's {name} while rank 0 is stopped: {cpu - a[t][1]} CPU ticks in 1 s, wchan {wchan}")
PY
    sleep $((${STOP_S:-40} - 3))
    kill -CONT $p0
    wait_step $((at + 15))
    echo "stop $n at step $at: rank 0 at step $(step) after it"
  done
  for r in 0 1; do
    python3 -c "import sys,urllib.request;print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "http://127.0.0.1:941$r/status" >"$out/stopped-$tag-rank$r-status.json" 2>/dev/null
  done
  kill -9 $p0 $p1; wait 2>/dev/null
  for r in 0 1; do
    python3 -c "import json,sys;s=json.load(open(sys.argv[1]));print('rank', sys.argv[2], 'step', s['step'],
      'skipped_steps', s.get('skipped_steps'), 'restarts', [d['restarts'] for d in s['drafters']])" \
      "$out/stopped-$tag-rank$r-status.json" $r || echo "rank $r: no status"
    echo "rank $r: drafter failures logged: $(grep -c 'drafter failed' "$out/stopped-$tag-rank$r.log")"
    grep -h 'drafter failed\|host left\|dropped\|stopped beating\|did not run' "$out/stopped-$tag-rank$r.log" \
      | cut -c1-300 | head -6
  done
done
tar -C "$out" -czf "$out/stopped.tgz" $(cd "$out" && ls stopped-* 2>/dev/null) && (cd "$out" && rm -f stopped-*)
fi
