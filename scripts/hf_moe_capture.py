"""HF transformers beside `dflash bench --what target --preset qwen3-30b-a3b`: Qwen3MoeForCausalLM with
Qwen3-30B-A3B's shapes (random bf16 weights, SDPA), layers above the last tapped one removed, the 5 tapped states
concatenated, timed with the experts run by HF's eager loop over experts or by its grouped_mm path. One JSON line per
implementation; FLOPs count active parameters as dflash does (attention projections, router, the 8 chosen experts;
causal attention half the square).

  python3 scripts/hf_moe_capture.py --batch 16 --seq 2048 --experts eager,grouped_mm
"""
import argparse, json, time, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=16); ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--steps", type=int, default=5); ap.add_argument("--experts", default="eager,grouped_mm")
a = ap.parse_args()
taps = [1, 12, 23, 34, 45]
c = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=taps[-1] + 1,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                   num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6,
                   max_position_embeddings=40960)
c._attn_implementation = "sdpa"
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    m = Qwen3MoeForCausalLM(c).eval()
body = m.model
ids = torch.randint(0, 151000, (a.batch, a.seq), device="cuda")
tok = a.batch * a.seq
h, q, kv = 2048, 32 * 128, 4 * 128
active = h * q + 2 * h * kv + q * h + h * 128 + 8 * 3 * h * 768
fl = 2 * active * len(body.layers) * tok + 2 * len(body.layers) * q * a.seq * tok
for impl in a.experts.split(","):
    try:
        m.set_experts_implementation(impl)
    except Exception as e:  # older transformers: the config attribute
        c._experts_implementation = impl
    def step():
        with torch.no_grad():
            out = body(input_ids=ids, output_hidden_states=True)
            return torch.cat([out.hidden_states[t + 1] for t in taps], dim=-1)
    try:
        for _ in range(2): step()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); ts = []
        for _ in range(a.steps):
            t = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    except Exception as e:
        print(json.dumps({"impl": f"hf-transformers-moe-{impl}", "error": str(e)[:300]}), flush=True)
        continue
    ts.sort(); med = ts[len(ts) // 2]
    print(json.dumps({"impl": f"hf-transformers-moe-{impl}", "batch": a.batch, "seq": a.seq, "tokens_per_s": tok / med,
                      "tflops": fl / med / 1e12, "mfu": fl / med / 1e12 / 797, "step_ms_p50": med * 1e3,
                      "peak_mem_bytes": torch.cuda.max_memory_allocated()}), flush=True)
