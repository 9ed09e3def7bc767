#!/usr/bin/env bash
# Runs every command block of README.md and docs/*.md marked as runnable on a CPU, as written, the way a newcomer
# would paste them: in a fresh folder standing in for the clone's root (`config/` linked in, the binary at
# target/release/dflash), README first, then docs/ in name order (data.md writes the held-out rows evaluation.md
# scores). Then everything again, since a pasted block must also survive being pasted twice. The markers:
#   <!-- check: cpu -->                          the next fenced block runs as a bash script (set -euo pipefail)
#   <!-- check: cpu, while serve-train runs -->  the same, while a `serve-train` of its own trains in the background
#                                                (control plane on 127.0.0.1:9410); it must then stop with 143
# And README's "Train a drafter for your model" block with its one-GPU run.toml, scaled down to the tests' real model
# on the CPU (scripts/setup.sh --test provides it and llama.cpp's server, which stands in for vLLM): every command as
# written, with only the substitutions listed in scaled_down() below, each of which must match (a README that changed
# under it fails here rather than going unchecked); and README's worked example (SmolLM2-135M from the model folder
# alone) the same way, scaled down by worked_example().
# Usage: scripts/checks/check_readme.sh [--bin PATH/TO/dflash] [--work DIR] [--once] [--only TEXT]
#   --only TEXT: run only the blocks whose "page:line (note)" contains TEXT (e.g. --only "real model").
# Prints each block's page, line, seconds and result; exits 1 if any failed. Takes about 15 minutes on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin="$root/target/release/dflash"
work=""
rounds=2
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$(realpath "$2"); shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --once) rounds=1; shift ;;
    --only) only="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "no dflash binary at $bin: run make build first, or pass --bin" >&2; exit 2; }
[ -n "$work" ] || work=$(mktemp -d /tmp/dflash-readme.XXXXXX)
mkdir -p "$work/target/release" "$work/.blocks"
ln -sfn "$root/config" "$work/config"
ln -sfn "$bin" "$work/target/release/dflash"
echo "[check-readme] binary $bin; working in $work"

for need in .real-model .real-model.f32.gguf .llama-server/bin/python; do
  [ -e "$root/$need" ] || { echo "$root/$need is missing: run scripts/setup.sh --test first" >&2; exit 2; }
done

# Each marked block as its own file: .blocks/NN.sh, with its page, line and kind in .blocks/index; then README's
# "Train a drafter for your model", scaled down.
python3 - "$root" "$work/.blocks" <<'EOF'
import pathlib, re, sys
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def replace_once(text, old, new, where):
    """`old` replaced by `new`, which must occur exactly once in `text`."""
    if text.count(old) != 1:
        sys.exit(f"{where}: expected {old!r} once, found it {text.count(old)} times: README changed, update "
                 "scaled_down() in scripts/checks/check_readme.sh")
    return text.replace(old, new)


def fenced(lines, start, lang):
    """The first ```lang block at or after line `start` (0-based): (its body's first line, 1-based; its text)."""
    begin = next(i for i in range(start, len(lines)) if lines[i].strip() == f"```{lang}")
    end = next(j for j in range(begin + 1, len(lines)) if lines[j].startswith("```"))
    return begin + 2, "\n".join(lines[begin + 1:end]) + "\n"


def scaled_down(readme):
    """README's "Train a drafter for your model" block and its one-GPU run.toml, scaled to the tests' real model
    (SmolLM2-135M-Instruct standing in for Qwen3-8B under the same folder name) on the CPU, llama.cpp's server in
    vLLM's place: (line, script)."""
    lines = readme.split("\n")
    section = lines.index("## Train a drafter for your model")
    line, block = fenced(lines, section, "bash")
    toml_line = next(i for i, l in enumerate(lines) if l == "# run.toml, one GPU")
    toml = "\n".join(lines[toml_line:next(j for j in range(toml_line, len(lines)) if lines[j].startswith("```"))])
    where = "README.md"
    for old, new in [
        ('device = "cuda:0"', 'device = "cpu"'),
        ('devices = ["cuda:0"]', 'devices = ["cpu"]'),
        ("num_hidden_layers = 5", "num_hidden_layers = 1"),
        ("batch_size = 4", "batch_size = 2"),
        ('loss = "kl"', 'loss = "kl"\nnum_anchors = 16'),
        ("epochs = 6", "epochs = 100\nmax_steps = 12"),
        ("every_steps = 1000", "every_steps = 6"),
        ("every_steps = 2000", "every_steps = 6\nnum_prompts = 2\nmax_new_tokens = 16"),
    ]:
        toml = replace_once(toml, old, new, where + " run.toml")
    for old, new in [
        ("hf download Qwen/Qwen3-8B --local-dir models/Qwen3-8B",
         'mkdir -p models && ln -sfn "$DFLASH_ROOT/.real-model" models/Qwen3-8B\n'
         "dflash sample-data --count 16 --seed 3 --out chats.jsonl"),
        ("vllm serve models/Qwen3-8B --port 8000 &",
         '"$DFLASH_ROOT/.llama-server/bin/python" -m llama_cpp.server --host 127.0.0.1 --port 8000 --n_ctx 1024 '
         '--n_threads 2 --seed 0 --model_alias models/Qwen3-8B --model "$DFLASH_ROOT/.real-model.f32.gguf" '
         ">llama-server.log 2>&1 &\nserver=$!; trap 'kill $server 2>/dev/null || true' EXIT\n"
         "for _ in $(seq 1 120); do curl -sf localhost:8000/v1/models >/dev/null && break; sleep 1; done"),
        ("--out regen.jsonl --template-kwargs", "--out regen.jsonl --max-tokens 48 --template-kwargs"),
        ("--holdout 0.01", "--holdout 0.25"),
        ("--max-new-tokens 256", "--max-new-tokens 16"),
        ("vllm serve models/Qwen3-8B --speculative-config \\\n", "true vllm: not on this machine || \\\n"),
    ]:
        block = replace_once(block, old, new, where)
    script = (
        "mkdir -p your-model && cd your-model\n"
        "cat >run.toml <<'TOML'\n" + toml + "\nTOML\n" + block
    )
    return line, script
def worked_example(readme):
    """README's worked example (SmolLM2-135M from the model folder alone), scaled down to the tests' real model (the
    same model, quantised) on the CPU: (line, script)."""
    lines = readme.split("\n")
    section = next(i for i, l in enumerate(lines) if l.startswith("## A worked example: SmolLM2-135M"))
    line, block = fenced(lines, section, "bash")
    settings = " ".join(f"--set {s}" for s in [
        "target.device=cpu", "'drafters.devices=[\"cpu\"]'", "draft_model.num_hidden_layers=1",
        "data.batch_size=2", "objective.num_anchors=8", "optim.max_steps=6", "checkpoint.every_steps=3",
        "eval.every_steps=3", "eval.num_prompts=2", "eval.max_new_tokens=16"])
    for old, new in [
        ("hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2-135M-Instruct",
         'mkdir -p models && ln -sfn "$DFLASH_ROOT/.real-model" models/SmolLM2-135M-Instruct'),
        ("--count 50000 --out synth.jsonl --max-tokens 256", "--count 12 --out synth.jsonl --max-tokens 40"),
        ("--holdout 0.01", "--holdout 0.25"),
        ("--config config/smollm2-135m.toml --resume auto", f"--config config/smollm2-135m.toml --resume auto {settings}"),
        ("--max-new-tokens 256 --limit 64", "--max-new-tokens 16 --limit 2"),
    ]:
        block = replace_once(block, old, new, "README.md (worked example)")
    return line, "mkdir -p worked-example && cd worked-example && ln -sfn ../config config\n" + block


pages = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
n = 0
with open(out / "index", "w") as index:
    for page in pages:
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            m = re.fullmatch(r"<!-- check: (cpu(?:, while serve-train runs)?) -->", line.strip())
            if not m:
                continue
            if not lines[i + 1].startswith("```"):
                sys.exit(f"{page}:{i + 1}: a check marker must be followed by a fenced block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            n += 1
            (out / f"{n:02}.sh").write_text("\n".join(lines[i + 2:end]) + "\n")
            kind = "while" if "while" in m.group(1) else "plain"
            index.write(f"{n:02} {kind} {page.relative_to(root)}:{i + 3}\n")
    line, script = scaled_down((root / "README.md").read_text())
    n += 1
    (out / f"{n:02}.sh").write_text(script)
    index.write(f"{n:02} plain README.md:{line} (scaled down to the tests' real model)\n")
    line, script = worked_example((root / "README.md").read_text())
    n += 1
    (out / f"{n:02}.sh").write_text(script)
    index.write(f"{n:02} plain README.md:{line} (the worked example, scaled down to the tests' real model)\n")
if n == 2:
    sys.exit("no check markers found")
EOF

failed=0
report=()
run_block() { # $1: block file, $2: its log
  (cd "$work" && DFLASH_ROOT="$root" PATH="$work/target/release:$PATH" bash -euo pipefail -x "$1") >"$2" 2>&1
}
for round in $(seq 1 "$rounds"); do
  while read -r n kind where; do
    [[ "$where" == *"$only"* ]] || continue
    file="$work/.blocks/$n.sh"
    log="$work/.blocks/$n.round$round.log"
    start=$(date +%s)
    result=ok
    if [ "$kind" = while ]; then
      # A run of its own to watch: long enough to outlast the block, in a folder of its own.
      (cd "$work" && exec target/release/dflash serve-train --config config/make-run.toml \
        --set checkpoint.dir=runs/watched --set optim.epochs=100 --set eval.every_steps=0 --resume auto) \
        >"$log.service" 2>&1 &
      service=$!
      ready=""
      for _ in $(seq 1 600); do
        if curl -sf localhost:9410/readyz >/dev/null 2>&1; then ready=yes; break; fi
        kill -0 "$service" 2>/dev/null || break
        sleep 1
      done
      if [ -z "$ready" ]; then
        result="FAILED (the service never became ready; $log.service)"
      elif ! run_block "$file" "$log"; then
        result="FAILED ($log)"
      fi
      kill -TERM "$service" 2>/dev/null || true
      status=0
      wait "$service" || status=$?
      if [ "$result" = ok ] && [ "$status" != 143 ]; then
        result="FAILED (the watched service exited $status, not 143; $log.service)"
      fi
    elif ! run_block "$file" "$log"; then
      result="FAILED ($log)"
    fi
    seconds=$(( $(date +%s) - start ))
    [ "$result" = ok ] || failed=1
    line="round $round  $where  ${seconds}s  $result"
    echo "[check-readme] $line"
    report+=("$line")
    if [ "$result" != ok ]; then tail -n 20 "$log" "$log.service" 2>/dev/null | sed 's/^/    /'; fi
  done <"$work/.blocks/index"
done

echo "[check-readme] summary ($(date -u +%FT%TZ), $(git -C "$root" describe --always --dirty 2>/dev/null || echo '?')):"
printf '  %s\n' "${report[@]}"
exit $failed
