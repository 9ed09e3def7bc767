"""HF transformers beside `dflash bench --what target --preset qwen3-30b-a3b|gpt-oss-20b`: the preset's shapes in
Qwen3MoeForCausalLM or GptOssForCausalLM (random bf16 weights, experts in bf16 as dflash holds them), layers above
the last tapped one removed, the 5 tapped states concatenated, timed with the experts run by HF's eager loop over
experts or by its grouped_mm path. Attention: SDPA for Qwen3-MoE; eager for GPT-OSS (its sinks: HF's SDPA path does
not take them). One JSON line per implementation; FLOPs count active parameters as dflash does (attention
projections, router, the chosen experts; causal attention half the square, a sliding window its exact keys).

  python3 scripts/peers/hf_moe_capture.py --preset qwen3-30b-a3b --batch 16 --seq 2048 --experts grouped_mm,eager
"""
import argparse, json, time, torch

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "gpt-oss-20b"])
ap.add_argument("--batch", type=int, default=16); ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--steps", type=int, default=5); ap.add_argument("--experts", default="eager,grouped_mm")
a = ap.parse_args()
if a.preset == "qwen3-30b-a3b":
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    taps = [1, 12, 23, 34, 45]
    c = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=taps[-1] + 1,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6,
                       max_position_embeddings=40960)
    c._attn_implementation = "sdpa"
    cls, h, q, kv, experts, k, width, window = Qwen3MoeForCausalLM, 2048, 32 * 128, 4 * 128, 128, 8, 768, None
else:
    from transformers import GptOssConfig, GptOssForCausalLM
    taps = [1, 6, 11, 16, 21]
    c = GptOssConfig(num_hidden_layers=taps[-1] + 1, num_local_experts=32, num_experts_per_tok=4,
                     layer_types=["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(taps[-1] + 1)])
    c._attn_implementation = "eager"
    cls, h, q, kv, experts, k, width, window = GptOssForCausalLM, 2880, 64 * 64, 8 * 64, 32, 4, 2880, 128
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    m = cls(c).eval()
body = m.model
ids = torch.randint(0, 150000, (a.batch, a.seq), device="cuda")
tok = a.batch * a.seq
active = h * q + 2 * h * kv + q * h + h * experts + k * 3 * h * width
def keys(layer):
    sliding = window is not None and layer % 2 == 0 and window < a.seq
    return window * (window + 1) / 2 + (a.seq - window) * window if sliding else a.seq * a.seq / 2
n = len(body.layers)
fl = 2 * active * n * tok + 4 * q * sum(keys(l) for l in range(n)) * a.batch
for impl in a.experts.split(","):
    m.set_experts_implementation(impl)
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
        print(json.dumps({"impl": f"hf-{a.preset}-{impl}", "error": str(e)[:300]}), flush=True)
        torch.cuda.empty_cache()
        continue
    ts.sort(); med = ts[len(ts) // 2]
    print(json.dumps({"impl": f"hf-{a.preset}-{impl}", "batch": a.batch, "seq": a.seq, "tokens_per_s": tok / med,
                      "tflops": fl / med / 1e12, "mfu": fl / med / 1e12 / 797, "step_ms_p50": med * 1e3,
                      "peak_mem_bytes": torch.cuda.max_memory_allocated()}), flush=True)
