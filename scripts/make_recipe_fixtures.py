#!/usr/bin/env python3
"""Writes the fixtures of the recipe's exactness tests (CI runs no Python: they are committed):
- tests/fixtures/dpace-speculators-0.9.0.json: D-PACE slot weights, loss and gradient as speculators 0.9.0 computes
  them (`speculators/losses/utils.py`: `dpace_loss_decay` through `loss_function`, with `losses/eager.py`'s
  `ce_loss`), for src/train/objective.rs;
- tests/fixtures/teacher-speculators-0.9.0.json: the loss and gradient against the target's predictions, its argmax
  (`losses/eager.py: ce_loss`) and its distribution (`kl_div_loss`), with D-PACE and with the decay
  (`dflash_loss_decay`), for src/train/objective.rs;
- tests/fixtures/muon-torch-2.11.json: three steps of torch.optim.Muon (match_rms_adamw, as speculators builds it)
  over three matrices and of torch.optim.AdamW over a vector, for src/train/optim.rs.

Usage (torch from the environment scripts/setup.sh made; speculators' wheel is read, not installed, since importing
the package pulls in transformers and more):
    pip download --no-deps speculators==0.9.0 -d /tmp/speculators
    .venv/bin/python scripts/make_recipe_fixtures.py /tmp/speculators/speculators-0.9.0-py3-none-any.whl
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


def aligned_mask(block_size):
    """The aligned mask of six blocks as speculators builds it: slot 0 (the anchor) never counts; a gap inside block 1,
    the end of the row inside block 3, block 5 a padding block."""
    mask = torch.ones(6 * block_size)
    mask[::block_size] = 0
    mask[block_size + 2] = 0
    mask[3 * block_size + 3] = 0
    mask[5 * block_size :] = 0
    return mask


def dpace_fixture(wheel):
    eager, utils = load_losses(wheel)
    torch.manual_seed(0)
    block_size, blocks, vocab = 4, 6, 13
    rows = block_size * blocks
    labels = torch.randint(vocab, (rows,))
    mask = aligned_mask(block_size)
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
        f"torch {torch.__version__}; scripts/make_recipe_fixtures.py",
        "block_size": block_size,
        "vocab": vocab,
        "labels": labels.tolist(),
        "mask": mask.tolist(),
        "logits": logits.reshape(-1).tolist(),
        "cases": cases,
    }
    write("dpace-speculators-0.9.0.json", out)


def teacher_fixture(wheel):
    """Draft and target logits of the same rows; the target's argmax mostly differs from any data label."""
    eager, utils = load_losses(wheel)
    torch.manual_seed(2)
    block_size, blocks, vocab = 4, 6, 13
    rows = block_size * blocks
    mask = aligned_mask(block_size)
    logits = torch.randn(rows, vocab) * 2.0
    targets = torch.randn(rows, vocab) * 3.0
    # A slot sure of the target's choice, one sure of another token, and a target sure of its choice.
    logits[1, targets[1].argmax()] += 9.0
    logits[6, (targets[6].argmax() + 1) % vocab] += 9.0
    targets[9, 4] += 12.0
    pos_idx = (torch.arange(rows) % block_size).unsqueeze(0)
    cases = []
    for loss_name, loss_fn in (("ce", eager.ce_loss), ("kl", eager.kl_div_loss)):
        for weights, decay in (
            ("dpace", partial(utils.dpace_loss_decay, loss_mask=mask.unsqueeze(0), block_size=block_size, dpace_alpha=0.5)),
            ("decay", partial(utils.dflash_loss_decay, gamma=2.0)),
        ):
            x = logits.clone().unsqueeze(0).requires_grad_(True)
            loss = utils.loss_function(x, targets.unsqueeze(0), mask.unsqueeze(0), pos_idx, loss_fn, decay)
            loss.backward()
            cases.append({"loss_fn": loss_name, "weights": weights, "loss": loss.item(), "grad": x.grad.reshape(-1).tolist()})
    out = {
        "source": "speculators 0.9.0 losses/utils.py loss_function with dpace_loss_decay (alpha 0.5) or "
        f"dflash_loss_decay (gamma 2), losses/eager.py ce_loss and kl_div_loss; torch {torch.__version__}; "
        "scripts/make_recipe_fixtures.py",
        "block_size": block_size,
        "vocab": vocab,
        "mask": mask.tolist(),
        "logits": logits.reshape(-1).tolist(),
        "targets": targets.reshape(-1).tolist(),
        "cases": cases,
    }
    write("teacher-speculators-0.9.0.json", out)


def muon_fixture():
    """Parameters by published name: a tall, a wide and a square matrix (Muon; the wide one is stacked with the square
    one in dflash's flat layout) and a norm vector (AdamW), with three gradients each."""
    torch.manual_seed(1)
    shapes = {
        "layers.0.mlp.down_proj.weight": (6, 4),
        "layers.0.self_attn.q_proj.weight": (3, 5),
        "layers.0.self_attn.k_proj.weight": (5, 5),
        "norm.weight": (4,),
    }
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    initial = {n: p.detach().clone() for n, p in params.items()}
    muon_hp = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5}
    adamw_hp = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    muon = torch.optim.Muon(
        [p for n, p in params.items() if p.ndim == 2], adjust_lr_fn="match_rms_adamw", **muon_hp
    )
    adamw = torch.optim.AdamW([p for p in params.values() if p.ndim == 1], **adamw_hp)
    grads, after = [], []
    for _ in range(3):
        step = {n: torch.randn(s) for n, s in shapes.items()}
        for n, p in params.items():
            p.grad = step[n].clone()
        muon.step()
        adamw.step()
        grads.append({n: g.reshape(-1).tolist() for n, g in step.items()})
        after.append({n: p.detach().reshape(-1).tolist() for n, p in params.items()})
    out = {
        "source": f"torch.optim.Muon and AdamW, torch {torch.__version__}; scripts/make_recipe_fixtures.py",
        "shapes": {n: list(s) for n, s in shapes.items()},
        "muon": muon_hp,
        "adamw": {**adamw_hp, "betas": list(adamw_hp["betas"])},
        "initial": {n: p.reshape(-1).tolist() for n, p in initial.items()},
        "grads": grads,
        "after": after,
    }
    write("muon-torch-2.11.json", out)


def write(name, out):
    path = Path(__file__).resolve().parent.parent / "tests/fixtures" / name
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    dpace_fixture(sys.argv[1])
    teacher_fixture(sys.argv[1])
    muon_fixture()
