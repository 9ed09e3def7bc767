"""The distinct errors of a compute-sanitizer report (scripts/gpu/sanitize.sh): each error with its frames, the
addresses and sizes that differ between occurrences blanked out, once, after how many times it came, most frequent
first. The frames of a stripped binary name only addresses: `addr2line -f -C -i -e target/release/deps/dflash-HASH
ADDR` turns them into source lines against the unstripped build of the same commit.

    python3 scripts/gpu/distinct_errors.py REPORT [MOST]
"""
import collections
import re
import sys


def distinct(path):
    blocks, block = collections.Counter(), []
    for line in open(path, errors="replace"):
        if not line.startswith("=========") or not line[9:].strip():
            continue
        text = re.sub(r"0x7f[0-9a-f]+|of size [0-9,]+ bytes", "_", line.rstrip())
        # An error's first line is flush after the marker; its details and frames are indented.
        if not line.startswith("=========  ") and block:
            blocks["\n".join(block)] += 1
            block = []
        block.append(text)
    if block:
        blocks["\n".join(block)] += 1
    return blocks


if __name__ == "__main__":
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    for text, n in distinct(sys.argv[1]).most_common(most):
        print(f"--- {n} times\n{text}")
