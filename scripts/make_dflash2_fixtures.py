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
  projection, for src/model/candidate_selector.rs;
- with `--model WORK`, tests/fixtures/dflash2-speculators/: a trained DFlash 2 drafter that dflash exported twice
  (WORK/zlab, z-lab's layout, copied as `drafter/`; WORK/speculators, speculators' layout with the tiny-tasks target
  WORK/target as its verifier, both in f32), loaded by speculators' own `DFlash2DraftModel.from_pretrained`, and
  `step.safetensors`: the inputs of one training step (random tapped states, the verifier's last states after its
  norm, tokens and a loss mask) with every valid anchor, and what `DFlash2DraftModel.forward` computed from them
  (loss "ce" against the target's argmax, D-PACE weights with alpha 0.5, selector_loss_alpha 0.7): the loss and the
  gradient of every drafter tensor, for tests/exports.rs. The CPU has no flex-attention backward: attention runs on
  the dense mask of the same mask function (`create_mask`), by SDPA. `saved-by-speculators/` is the drafter as
  speculators' `save_pretrained` writes it (bf16), for draft_model.init.

Usage: in a Python environment with speculators 0.9.0 installed (the one `make check-exports` makes):
    ~/.cache/dflash/check-exports-speculators-0.9.0/bin/python scripts/make_dflash2_fixtures.py [--model WORK [--out DIR]]
(`make check-exports` runs the second form on a drafter it trains, into a scratch folder, and the tests on that.)
"""
import json
import shutil
import sys
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


def model_case(work, out):
    """One training step of speculators' DFlash 2 on the drafter in `work`, written to `out`."""
    import safetensors.torch
    import speculators.models.attention as attention
    import speculators.models.dflash.core as dflash_core
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash2 import DFlash2DraftModel

    def dense_flex_attention(query, key, value, score_mod=None, block_mask=None, enable_gqa=False, scale=None):
        mask = attention._create_mask(block_mask.mask_mod, None, None, query.shape[2], key.shape[2], query.device)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )

    attention.flex_attention = dense_flex_attention
    model = DFlash2DraftModel.from_pretrained(str(work / "speculators")).float()
    torch.manual_seed(3)
    seq, hidden, taps = 32, model.config.transformer_layer_config.hidden_size, 3
    # Two supervised runs, none in the last block: every anchor's block fits the row, as speculators wants.
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, 3:13] = 1
    loss_mask[0, 15:23] = 1
    valid = [a for a in range(seq - 1) if loss_mask[0, a] and loss_mask[0, a + 1]]
    anchors = torch.tensor(valid)
    dflash_core.select_anchors = lambda mask, n, bs: (anchors, torch.ones(len(valid), dtype=torch.bool))
    target_hidden = torch.randn(1, seq, taps * hidden)
    last = torch.randn(1, seq, hidden) * 2
    input_ids = torch.randint(0, 300, (1, seq))
    _, loss, _ = model(
        target_hidden, input_ids, loss_mask, last, torch.zeros(1, seq, dtype=torch.long),
        loss_config=resolve_loss_config("ce", "eager"), per_position_loss_weight="dpace", dpace_alpha=0.5,
        selector_loss_alpha=0.7, max_anchors=len(valid), tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
    )
    loss.backward()
    tensors = {
        "target_hidden": target_hidden, "target_last": model.verifier_norm(last).detach(),
        "input_ids": input_ids, "loss_mask": loss_mask, "anchors": anchors, "loss": loss.detach().reshape(1),
    }
    for name, p in model.named_parameters():
        if p.grad is not None and not name.startswith(("embed_tokens", "lm_head", "verifier_")):
            tensors[f"grad.{name}"] = p.grad.detach().contiguous()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(work / "zlab", out / "drafter")
    safetensors.torch.save_file(tensors, str(out / "step.safetensors"))
    # The same drafter as speculators itself writes it (in bf16), for draft_model.init.
    model.to(torch.bfloat16).save_pretrained(str(out / "saved-by-speculators"))
    # Its copy of speculators' config class, for trust_remote_code loading: no reader of ours needs it.
    (out / "saved-by-speculators" / "config.py").unlink()
    return loss.item()


if __name__ == "__main__":
    if "--model" in sys.argv:
        work = Path(sys.argv[sys.argv.index("--model") + 1])
        out = Path(__file__).resolve().parent.parent / "tests/fixtures/dflash2-speculators"
        if "--out" in sys.argv:
            out = Path(sys.argv[sys.argv.index("--out") + 1])
        print(f"loss {model_case(work, out)}: wrote {out}")
        sys.exit(0)
    path = Path(__file__).resolve().parent.parent / "tests/fixtures/dflash2-conv-speculators-0.9.0.json"
    path.write_text(json.dumps({"speculators": "0.9.0", "conv": conv_case()}) + "\n")
    print(f"wrote {path}")
    path = path.with_name("dflash2-selector-speculators-0.9.0.json")
    path.write_text(json.dumps({"speculators": "0.9.0", "selector": selector_case()}) + "\n")
    print(f"wrote {path}")
