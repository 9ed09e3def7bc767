#!/usr/bin/env python3
"""Writes tests/fixtures/dpace-speculators-0.9.0.json: D-PACE slot weights, loss and gradient as speculators 0.9.0
computes them (`speculators/losses/utils.py`: `dpace_loss_decay` through `loss_function`, with `losses/eager.py`'s
`ce_loss`), for the exactness test in src/train/objective.rs (CI runs no Python: the fixture is committed).

Usage (torch from the environment scripts/setup.sh made; speculators' wheel is read, not installed, since importing
the package pulls in transformers and more):
    pip download --no-deps speculators==0.9.0 -d /tmp/speculators
    .venv/bin/python scripts/make_objective_fixtures.py /tmp/speculators/speculators-0.9.0-py3-none-any.whl
"""
import importlib.util
import json
import sys
import types
import zipfile
from functools import partial
from pathlib import Path

import torch

WHEEL_MODULES = ("speculators/losses/eager.py", "speculators/losses/utils.py")


def load_losses(wheel):
    """speculators.losses.eager and .utils from the wheel, under stub parent packages."""
    with zipfile.ZipFile(wheel) as z:
        sources = {name: z.read(name).decode() for name in WHEEL_MODULES}
    for package in ("speculators", "speculators.losses"):
        sys.modules[package] = types.ModuleType(package)
        sys.modules[package].__path__ = []
    modules = {}
    for name in WHEEL_MODULES:
        dotted = name[: -len(".py")].replace("/", ".")
        spec = importlib.util.spec_from_loader(dotted, loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[dotted] = module
        exec(compile(sources[name], name, "exec"), module.__dict__)
        setattr(sys.modules["speculators.losses"], dotted.rsplit(".", 1)[1], module)
        modules[dotted.rsplit(".", 1)[1]] = module
    return modules["eager"], modules["utils"]


def main(wheel):
    eager, utils = load_losses(wheel)
    torch.manual_seed(0)
    block_size, blocks, vocab = 4, 6, 13
    rows = block_size * blocks
    labels = torch.randint(vocab, (rows,))
    # The aligned mask as speculators builds it: slot 0 (the anchor) never counts; a gap inside block 1, the end of
    # the row inside block 3, block 5 a padding block.
    mask = torch.ones(rows)
    mask[::block_size] = 0
    mask[block_size + 2] = 0
    mask[3 * block_size + 3] = 0
    mask[5 * block_size :] = 0
    # Draft logits of every confidence: some slots sure of their label, some sure of another token, most spread out.
    logits = torch.randn(rows, vocab) * 2.0
    logits[1, labels[1]] += 9.0
    logits[6, (labels[6] + 1) % vocab] += 9.0
    logits[9, labels[9]] += 4.0
    # Target logits whose argmax is the label (ce_loss trains against the target's argmax).
    targets = torch.nn.functional.one_hot(labels, vocab).float() * 10.0
    pos_idx = (torch.arange(rows) % block_size).unsqueeze(0)
    cases = []
    for alpha in (0.5, 0.2, 1.0):
        x = logits.clone().unsqueeze(0).requires_grad_(True)
        decay = partial(utils.dpace_loss_decay, loss_mask=mask.unsqueeze(0), block_size=block_size, dpace_alpha=alpha)
        loss = utils.loss_function(x, targets.unsqueeze(0), mask.unsqueeze(0), pos_idx, eager.ce_loss, decay)
        loss.backward()
        with torch.no_grad():
            ce = eager.ce_loss(logits.unsqueeze(0), targets.unsqueeze(0)) * mask.unsqueeze(0)
            weights = utils.dpace_loss_decay(pos_idx, mask.unsqueeze(0), block_size, alpha, ce)
        cases.append(
            {
                "alpha": alpha,
                "weights": weights.reshape(-1).tolist(),
                "loss": loss.item(),
                "grad": x.grad.reshape(-1).tolist(),
            }
        )
    out = {
        "source": "speculators 0.9.0 losses/utils.py dpace_loss_decay + loss_function, losses/eager.py ce_loss; "
        f"torch {torch.__version__}; scripts/make_objective_fixtures.py",
        "block_size": block_size,
        "vocab": vocab,
        "labels": labels.tolist(),
        "mask": mask.tolist(),
        "logits": logits.reshape(-1).tolist(),
        "cases": cases,
    }
    path = Path(__file__).resolve().parent.parent / "tests/fixtures/dpace-speculators-0.9.0.json"
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
