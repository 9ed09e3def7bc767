#!/usr/bin/env bash
# Runs every command block of README.md and docs/*.md marked as runnable on a CPU, as written, the way a newcomer
# would paste them: in a fresh folder standing in for the clone's root (`config/` linked in, the binary at
# target/release/dflash), README first, then docs/ in name order (data.md writes the held-out rows evaluation.md
# scores). Then everything again, since a pasted block must also survive being pasted twice. The markers:
#   <!-- check: cpu -->                          the next fenced block runs as a bash script (set -euo pipefail)
#   <!-- check: cpu, while serve-train runs -->  the same, while a `serve-train` of its own trains in the background
#                                                (control plane on 127.0.0.1:9410); it must then stop with 143
# Usage: scripts/check-readme.sh [--bin PATH/TO/dflash] [--work DIR] [--once]
# Prints each block's page, line, seconds and result; exits 1 if any failed. Takes about 10 minutes on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="$root/target/release/dflash"
work=""
rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$(realpath "$2"); shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --once) rounds=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "no dflash binary at $bin: run make build first, or pass --bin" >&2; exit 2; }
[ -n "$work" ] || work=$(mktemp -d /tmp/dflash-readme.XXXXXX)
mkdir -p "$work/target/release" "$work/.blocks"
ln -sfn "$root/config" "$work/config"
ln -sfn "$bin" "$work/target/release/dflash"
echo "[check-readme] binary $bin; working in $work"

# Each marked block as its own file: .blocks/NN.sh, with its page, line and kind in .blocks/index.
python3 - "$root" "$work/.blocks" <<'EOF'
import pathlib, re, sys
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
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
if n == 0:
    sys.exit("no check markers found")
EOF

failed=0
report=()
run_block() { # $1: block file, $2: its log
  (cd "$work" && PATH="$work/target/release:$PATH" bash -euo pipefail -x "$1") >"$2" 2>&1
}
for round in $(seq 1 "$rounds"); do
  while read -r n kind where; do
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
