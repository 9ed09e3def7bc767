#!/usr/bin/env python3
"""Writes the fixtures of DFlash 2's exactness tests (issue 49; CI runs no Python: they are committed):
- tests/fixtures/dflash2-conv-speculators-0.9.0.json: speculators 0.9.0's two-tap dynamic convolution
  (`speculators/models/dflash2/model_definitions.py: grouped_dynamic_conv`, adapted from z-lab's dflash 07ebd93) on
  two rows of two blocks, its output and the gradients of a random upstream gradient with respect to its input, its
  token-conditioned kernel and its base kernel, for src/model/dynamic_conv.rs.

Usage: in a Python environment with speculators 0.9.0 installed (the one `make check-exports` makes):
    ~/.cache/dflash/check-exports-speculators-0.9.0/bin/python scripts/make_dflash2_fixtures.py
"""
import json
from pathlib import Path

import torch
from speculators.models.dflash2.model_definitions import grouped_dynamic_conv


def conv_case():
    torch.manual_seed(0)
    rows, block_size, blocks, hidden, group, taps = 2, 4, 2, 32, 8, 2
    x = torch.randn(rows, blocks * block_size, hidden, dtype=torch.float64, requires_grad=True)
    delta = torch.randn(rows, blocks * block_size, taps, hidden // group, dtype=torch.float64, requires_grad=True)
    base = torch.randn(taps, hidden, dtype=torch.float64, requires_grad=True)
    # speculators flattens every leading dimension into one run of tokens and takes each token's place in its block
    # from its index there: rows of whole blocks keep every block's place.
    out = grouped_dynamic_conv(x, delta, base, block_size=block_size, group_size=group)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    flat = lambda t: t.detach().flatten().tolist()  # noqa: E731
    return {
        "shape": {"rows": rows, "tokens": blocks * block_size, "hidden": hidden, "group": group, "taps": taps,
                  "block_size": block_size},
        "x": flat(x), "delta": flat(delta), "base": flat(base), "out": flat(out), "upstream": flat(upstream),
        "grad_x": flat(x.grad), "grad_delta": flat(delta.grad), "grad_base": flat(base.grad),
    }


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "tests/fixtures/dflash2-conv-speculators-0.9.0.json"
    path.write_text(json.dumps({"speculators": "0.9.0", "conv": conv_case()}) + "\n")
    print(f"wrote {path}")
