"""Writes tests/fixtures/hf-qwen3-moe/: a tiny Qwen3-MoE made and run by HuggingFace transformers itself, the
definition dflash's Qwen3-MoE capture is checked against (eager attention, the eager loop over experts) (tests/hf_targets.rs), so CI needs no Python.

    python scripts/make_hf_target_fixture.py OUT_DIR      # transformers 5.x, torch, safetensors

The folder holds the model as `save_pretrained` writes it (config.json + model.safetensors, float32) and
`expected.safetensors`: for each prompt `p`, `p{p}.input_ids`, `p{p}.hidden_states` ([layers + 1, len, hidden]:
HF's `hidden_states`, the embedding first), `p{p}.logits` and, for each sparse layer `l`, `p{p}.experts.{l}`
(the top-k expert ids HF's router picks, most probable first, from `output_router_logits`). Weights are drawn large
(std 0.2) so attention and routing are far from uniform, and the seed is the first whose routing keeps the k-th and
(k+1)-th expert probabilities at least MARGIN apart for every token of every sparse layer, so a different summation
order cannot flip a choice.
"""
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

MARGIN = 2e-3
PROMPTS = [[5, 17, 3, 88, 42, 42, 7, 60, 91, 12, 33, 2, 70], [1, 64, 9, 9, 9, 30, 77]]


def build(seed):
    cfg = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    # HF's reference loop over experts (transformers 5 defaults to its grouped_mm path, dflash's own approach).
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return cfg, model


def run(cfg, model):
    out, margin = {}, float("inf")
    sparse = [l for l in range(cfg.num_hidden_layers) if l not in cfg.mlp_only_layers]
    for p, ids in enumerate(PROMPTS):
        x = torch.tensor([ids])
        with torch.no_grad():
            r = model(input_ids=x, output_hidden_states=True, output_router_logits=True)
        out[f"p{p}.input_ids"] = x[0]
        out[f"p{p}.hidden_states"] = torch.stack([h[0] for h in r.hidden_states])
        out[f"p{p}.logits"] = r.logits[0]
        assert len(r.router_logits) == len(sparse), (len(r.router_logits), sparse)
        for layer, logits in zip(sparse, r.router_logits):
            probs = logits.float().softmax(-1)
            ranked = probs.sort(-1, descending=True).values
            k = cfg.num_experts_per_tok
            margin = min(margin, (ranked[:, k - 1] - ranked[:, k]).min().item())
            out[f"p{p}.experts.{layer}"] = probs.topk(k, -1).indices
    return out, margin


def main():
    dest = Path(sys.argv[1])
    for seed in range(100):
        cfg, model = build(seed)
        out, margin = run(cfg, model)
        if margin >= MARGIN:
            break
    else:
        sys.exit("no seed below 100 gives clear routing margins")
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_file({k: v.contiguous() for k, v in out.items()}, dest / "expected.safetensors")
    with safe_open(dest / "model.safetensors", "pt") as f:
        names = sorted(k for k in f.keys() if "layers.0.mlp" in k)[:4]
    print(f"seed {seed}, routing margin {margin:.4f}; tensor names like {names}")


if __name__ == "__main__":
    main()
