#!/usr/bin/env python3
"""Writes the fixtures of DFlash 2's exactness tests (issue 49; CI runs no Python: they are committed):
- tests/fixtures/dflash2-conv-speculators-0.9.0.json: speculators 0.9.0's two-tap dynamic convolution
  (`speculators/models/dflash2/model_definitions.py: grouped_dynamic_conv`, adapted from z-lab's dflash 07ebd93) on
  two rows of two blocks, its output and the gradients of a random upstream gradient with respect to its input, its
  token-conditioned kernel and its base kernel, for src/model/dynamic_conv.rs;
- tests/fixtures/dflash2-selector-speculators-0.9.0.json: its top-K candidate selector on two blocks
  (`selector_training_candidates`: the target injected at rank K where the unary top-K misses it;
  `CandidateSelector.score_candidates` on the teacher-forced previous tokens), the K-way cross-entropy summed over
  the slots, and its gradients with respect to the unary logits, the hidden states, both codebooks and the hidden
  projection, for src/model/candidate_selector.rs.

Usage: in a Python environment with speculators 0.9.0 installed (the one `make check-exports` makes):
    ~/.cache/dflash/check-exports-speculators-0.9.0/bin/python scripts/make_dflash2_fixtures.py
"""
import json
from pathlib import Path

import torch
from speculators.models.dflash2.metrics import selector_training_candidates
from speculators.models.dflash2.model_definitions import CandidateSelector, grouped_dynamic_conv


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


def selector_case():
    torch.manual_seed(1)
    blocks, block_size, vocab, hidden, rank, top_k = 2, 4, 50, 16, 8, 4
    slots = blocks * block_size
    selector = CandidateSelector(vocab_size=vocab, hidden_size=hidden, rank=rank, top_k=top_k).double()
    unary = torch.randn(1, slots, vocab, dtype=torch.float64, requires_grad=True)
    states = torch.randn(1, slots, hidden, dtype=torch.float64, requires_grad=True)
    block_tokens = torch.randint(0, vocab, (blocks, block_size))
    # The teacher-forced previous token of each slot (slot 0's is the anchor itself), as DFlash2DraftModel takes it.
    predecessors = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1).reshape(1, -1)
    candidates = unary.topk(top_k, dim=-1).indices
    # Half the targets among the unary top-K (at varying ranks), half outside it.
    outside = unary.detach().argsort(dim=-1)[..., 0]
    inside = candidates[..., 0:top_k].gather(-1, (torch.arange(slots) % top_k).view(1, -1, 1)).squeeze(-1)
    targets = torch.where(torch.arange(slots).view(1, -1) % 2 == 0, inside, outside)
    ids, positions, contains = selector_training_candidates(candidates, targets)
    scores = selector.score_candidates(unary, states, predecessors, ids)
    loss = torch.nn.functional.cross_entropy(scores.flatten(0, 1), positions.flatten(), reduction="sum")
    loss.backward()
    flat = lambda t: t.detach().flatten().tolist()  # noqa: E731
    return {
        "shape": {"slots": slots, "vocab": vocab, "hidden": hidden, "rank": rank, "top_k": top_k},
        "unary": flat(unary), "states": flat(states), "predecessors": flat(predecessors), "targets": flat(targets),
        "predecessor_codebook": flat(selector.predecessor_codebook),
        "successor_codebook": flat(selector.successor_codebook),
        "hidden_projection": flat(selector.hidden_projection.weight),
        "candidates": flat(ids), "positions": flat(positions), "contains": flat(contains),
        "scores": flat(scores), "loss": loss.item(),
        "grad_unary": flat(unary.grad), "grad_states": flat(states.grad),
        "grad_predecessor_codebook": flat(selector.predecessor_codebook.grad),
        "grad_successor_codebook": flat(selector.successor_codebook.grad),
        "grad_hidden_projection": flat(selector.hidden_projection.weight.grad),
    }


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "tests/fixtures/dflash2-conv-speculators-0.9.0.json"
    path.write_text(json.dumps({"speculators": "0.9.0", "conv": conv_case()}) + "\n")
    print(f"wrote {path}")
    path = path.with_name("dflash2-selector-speculators-0.9.0.json")
    path.write_text(json.dumps({"speculators": "0.9.0", "selector": selector_case()}) + "\n")
    print(f"wrote {path}")
