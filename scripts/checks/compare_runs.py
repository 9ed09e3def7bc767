#!/usr/bin/env python3
"""Where two serve-train runs first differ: their built-in answers, every step's exact numbers, the final weights.

Each run folder holds what scripts/gpu/determinism.sh gives it: data/<target>/regenerated.jsonl, ckpt/final/, and the
run's JSON log beside the folder (<folder>.log) with log.level = "info,dflash::steps=debug".
Usage: scripts/checks/compare_runs.py RUN_A RUN_B   (prints one JSON line)
"""
import glob
import hashlib
import json
import os
import sys


def steps(log):
    out = []
    with open(log) as f:
        for line in f:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if v.get("target") == "dflash::steps":
                f_ = v["fields"]
                out.append((f_["step"], f_["loss"], f_["accuracy"], f_["acceptance"], f_["lr"], f_["samples"]))
    return out


def digest(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def end_line(log):
    with open(log) as f:
        for line in f:
            if "decoded acceptance 1.00 ->" in line:
                return json.loads(line)["fields"]["message"].split(":")[0]
    return None


def main(a, b):
    answers = [sorted(glob.glob(f"{r}/data/*/regenerated.jsonl")) for r in (a, b)]
    sa, sb = steps(f"{a}.log"), steps(f"{b}.log")
    first = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None)
    report = {
        "runs": [os.path.basename(a), os.path.basename(b)],
        "answers_identical": [digest(p) for p in answers[0]] == [digest(p) for p in answers[1]],
        "steps": [len(sa), len(sb)],
        "steps_identical": sa == sb,
        "first_different_step": None if first is None else [sa[first], sb[first]],
        "final_weights_identical": digest(f"{a}/ckpt/final/model.safetensors") == digest(f"{b}/ckpt/final/model.safetensors"),
        "end_lines": [end_line(f"{a}.log"), end_line(f"{b}.log")],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
