"""Writes the HuggingFace-made target fixtures that tests/hf_targets.rs checks dflash against, so CI needs no Python:
a tiny model made, saved and run by transformers itself (eager attention, HF's eager loop over experts).

    python scripts/make_hf_target_fixture.py qwen3-moe tests/fixtures/hf-qwen3-moe   # transformers 5.x, torch
    python scripts/make_hf_target_fixture.py gpt-oss tests/fixtures/hf-gpt-oss

Each folder holds the model as `save_pretrained` writes it (config.json + model.safetensors; every weight is drawn,
then rounded to bfloat16, run in float32 and saved in bfloat16, so the file is small and loses nothing) and
`expected.safetensors`: for each prompt `p`, `p{p}.input_ids`, `p{p}.hidden_states` ([layers + 1, len, hidden]:
HF's `hidden_states`, the embedding first, the last after the final norm), `p{p}.logits` and, for each sparse layer
`l`, `p{p}.experts.{l}` (the top-k expert ids HF's router picks, best first, from `output_router_logits`). Weights
are drawn large (std 0.2) so attention and routing are far from uniform, and the seed is the first whose routing keeps
the k-th and (k+1)-th expert scores at least MARGIN apart for every token of every sparse layer, so a different
summation order cannot flip a choice. GPT-OSS: the experts are drawn as MXFP4 codes and scales (random bytes,
exponents 2^-5..2^-3) dequantised by transformers' own `convert_moe_packed_tensors`, and `mxfp4/` holds the same
model as the published folders store it (experts as `*_blocks`/`*_scales`, `quantization_config` in config.json).
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MARGIN = 2e-3
PROMPTS = [[5, 17, 3, 88, 42, 42, 7, 60, 91, 12, 33, 2, 70], [1, 64, 9, 9, 9, 30, 77]]


def qwen3_moe(seed):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = randomised(Qwen3MoeForCausalLM, cfg, seed)
    sparse = [l for l in range(cfg.num_hidden_layers) if l not in cfg.mlp_only_layers]
    return cfg, model, sparse, lambda logits: logits.float().softmax(-1), None


def gpt_oss(seed):
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    cfg = GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=1.5,
        rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )
    model = randomised(GptOssForCausalLM, cfg, seed)
    packed = {}
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            for name in ["gate_up_proj", "down_proj"]:
                param = getattr(layer.mlp.experts, name)  # [experts, in, out]
                e, inputs, outputs = param.shape
                blocks = torch.randint(0, 256, (e, outputs, inputs // 32, 16), dtype=torch.uint8)
                scales = torch.randint(122, 125, (e, outputs, inputs // 32), dtype=torch.uint8)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{l}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{l}.mlp.experts.{name}_scales"] = scales
    sparse = list(range(cfg.num_hidden_layers))
    return cfg, model, sparse, lambda logits: logits.float(), packed


def randomised(cls, cfg, seed):
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
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
            p.copy_(p.to(torch.bfloat16).float())
    return model


def run(cfg, model, sparse, scores):
    out, margin = {}, float("inf")
    for p, ids in enumerate(PROMPTS):
        x = torch.tensor([ids])
        with torch.no_grad():
            r = model(input_ids=x, output_hidden_states=True, output_router_logits=True)
        out[f"p{p}.input_ids"] = x[0]
        out[f"p{p}.hidden_states"] = torch.stack([h[0] for h in r.hidden_states])
        out[f"p{p}.logits"] = r.logits[0]
        assert len(r.router_logits) == len(sparse), (len(r.router_logits), sparse)
        for layer, logits in zip(sparse, r.router_logits):
            s = scores(logits)
            ranked = s.sort(-1, descending=True).values
            k = cfg.num_experts_per_tok
            margin = min(margin, (ranked[:, k - 1] - ranked[:, k]).min().item())
            out[f"p{p}.experts.{layer}"] = s.topk(k, -1).indices
    return out, margin


def main():
    family, dest = sys.argv[1], Path(sys.argv[2])
    make = {"qwen3-moe": qwen3_moe, "gpt-oss": gpt_oss}[family]
    for seed in range(100):
        cfg, model, sparse, scores, packed = make(seed)
        out, margin = run(cfg, model, sparse, scores)
        if margin >= MARGIN:
            break
    else:
        sys.exit("no seed below 100 gives clear routing margins")
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest)
    (dest / "generation_config.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, dest / "expected.safetensors")
    with safe_open(dest / "model.safetensors", "pt") as f:
        names = sorted(k for k in f.keys() if "layers.0.mlp" in k)[:4]
    print(f"seed {seed}, routing margin {margin:.4f}; tensor names like {names}")
    if packed:
        quantized = dest / "mxfp4"
        quantized.mkdir(exist_ok=True)
        tensors = {k: v for k, v in load_file(dest / "model.safetensors").items()
                   if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        save_file({**tensors, **packed}, quantized / "model.safetensors")
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (quantized / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main()
