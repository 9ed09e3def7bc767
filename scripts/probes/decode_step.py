# Where a batch-1 Qwen3-8B decoding step's time goes (BENCHMARKS.md, batch-1 decoding): the GEMVs alone in a CUDA graph,
# weights laid out as dflash holds them, each GEMV shape alone, attention, and the small per-layer kernels. Run on the
# GPU machine: `python3 scripts/probes/decode_step.py`.
import torch, json
torch.manual_seed(0)
dev = "cuda"
H, NH, KV, D, I, L, V = 4096, 32, 8, 128, 12288, 36, 151936
bf = torch.bfloat16
def w(*s): return (torch.randn(*s, device=dev, dtype=bf) * 0.02)
layers = [dict(qkv=w((NH + 2 * KV) * D, H), o=w(H, NH * D), gu=w(2 * I, H), down=w(H, I)) for _ in range(L)]
head = w(V, H)
x = torch.randn(1, H, device=dev, dtype=bf)
byts = sum(t.numel() * 2 for l in layers for t in l.values()) + head.numel() * 2
def gemvs(x):
    for l in layers:
        qkv = torch.nn.functional.linear(x, l["qkv"])
        x = torch.addmm(x, qkv[:, : NH * D], l["o"].t())
        gu = torch.nn.functional.linear(x, l["gu"])
        x = torch.addmm(x, gu[:, :I], l["down"].t())
    return torch.nn.functional.linear(x, head)
def timed(f, n=50):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g): f()
    g.replay(); torch.cuda.synchronize()
    t = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
    t.sort(); return t[len(t) // 2]
r = {"weights_GB": byts / 1e9}
r["gemvs_graph_ms"] = timed(lambda: gemvs(x))
r["gemvs_TBps"] = byts / r["gemvs_graph_ms"] / 1e9
# The same weights read by a copy-free reduction (the bandwidth a perfect GEMV would reach)
flat = [t for l in layers for t in l.values()] + [head]
r["read_all_weights_ms"] = timed(lambda: torch._foreach_norm(flat))
r["read_TBps"] = byts / r["read_all_weights_ms"] / 1e9
# Per GEMV shape: one layer's four, 200 reps each inside a graph
for name, W in [("qkv", layers[0]["qkv"]), ("o", layers[0]["o"]), ("gate_up", layers[0]["gu"]), ("down", layers[0]["down"]), ("lm_head", head)]:
    xin = torch.randn(1, W.shape[1], device=dev, dtype=bf)
    ms = timed(lambda: [torch.nn.functional.linear(xin, W) for _ in range(20)]) / 20
    r[f"{name}_us"] = round(ms * 1e3, 1); r[f"{name}_TBps"] = round(W.numel() * 2 / ms / 1e9, 2)
# Attention at a 512-token context (capacity 640) and 2048 (2176), 4 query rows per KV head, bf16 mask
for C in (640, 2176):
    q = torch.randn(1, KV, 4, D, device=dev, dtype=bf); k = torch.randn(1, KV, C, D, device=dev, dtype=bf); v = torch.randn_like(k)
    m = torch.zeros(1, 1, 4, C, device=dev, dtype=bf)
    ms = timed(lambda: [torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m) for _ in range(36)]) / 36
    r[f"sdpa_C{C}_us"] = round(ms * 1e3, 1)
# Small kernels: rms_norm of [1, H], and an index_copy into a cache
xn = torch.randn(1, 1, H, device=dev, dtype=bf); nw = torch.ones(H, device=dev, dtype=bf)
r["rms_norm_us"] = round(timed(lambda: [torch.nn.functional.rms_norm(xn, (H,), nw, 1e-6) for _ in range(100)]) / 100 * 1e3, 2)
cache = torch.zeros(1, KV, 640, D, device=dev, dtype=bf); pos = torch.tensor([512], device=dev); kk = torch.randn(1, KV, 1, D, device=dev, dtype=bf)
r["index_copy_us"] = round(timed(lambda: [cache.index_copy_(2, pos, kk) for _ in range(100)]) / 100 * 1e3, 2)
e = torch.randn(1, H, device=dev, dtype=bf)
r["tiny_add_us"] = round(timed(lambda: [e.add_(1.0) for _ in range(100)]) / 100 * 1e3, 2)
print(json.dumps(r, indent=0))
