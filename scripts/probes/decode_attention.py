# Batch-1 decoding attention over a KV cache [1, KV, C, d] (BENCHMARKS.md, batch-1 decoding): SDPA with the query
# heads folded onto the K/V heads and a mask, flash varlen with seqused_k (a device length, so graphable), and plain
# batched products around a softmax; time per call in a CUDA graph and error against f32 attention with expanded heads.
# Run on the GPU machine: `python3 scripts/probes/decode_attention.py [C ...]` (cache capacities; default 640 2176).
import torch, json, sys
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
NH, KV, D = 32, 8, 128
g = NH // KV
def timed(f, n=30, reps=36):
    gr = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(gr):
        for _ in range(reps): f()
    gr.replay(); torch.cuda.synchronize()
    t = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); gr.replay(); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
    t.sort(); return round(t[len(t) // 2] / reps * 1e3, 2)
out = {}
for C in [int(c) for c in sys.argv[1:]] or (640, 2176):
    for T in (1, 16):
        L = C - 100
        K = torch.randn(1, KV, C, D, device=dev, dtype=bf); V = torch.randn_like(K)
        q = torch.randn(1, T, NH, D, device=dev, dtype=bf)  # as the projection lays it out
        qpos = torch.arange(L - T, L, device=dev)
        keys = torch.arange(C, device=dev)
        visible = keys[None, :] <= qpos[:, None]  # [T, C]
        # reference in f32, K/V expanded
        Ke = K.float().repeat_interleave(g, 1); Ve = V.float().repeat_interleave(g, 1)
        qh = q.float().transpose(1, 2)
        sc = qh @ Ke.transpose(-1, -2) / D ** 0.5
        sc = sc.masked_fill(~visible, float("-inf"))
        ref = (sc.softmax(-1) @ Ve)  # [1, NH, T, D]
        bias = torch.zeros(T, C, device=dev, dtype=bf).masked_fill(~visible, float("-inf"))
        gb = bias.repeat(g, 1).view(1, 1, g * T, C)
        def sdpa():
            qf = q.transpose(1, 2).reshape(1, KV, g * T, D)
            return torch.nn.functional.scaled_dot_product_attention(qf, K, V, attn_mask=gb).reshape(1, NH, T, D)
        cu_q = torch.tensor([0, T], device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0, C], device=dev, dtype=torch.int32)
        used = torch.tensor([L], device=dev, dtype=torch.int32)
        def flash():
            o = torch.ops.aten._flash_attention_forward(q[0], K[0].transpose(0, 1), V[0].transpose(0, 1), cu_q, cu_k, T, C, 0.0, True, False, seqused_k=used)[0]
            return o.view(1, T, NH, D).transpose(1, 2)
        def bmm():
            qf = q.transpose(1, 2).reshape(KV, g * T, D)
            s = torch.baddbmm(gb[0].expand(KV, -1, -1), qf, K[0].transpose(1, 2), alpha=D ** -0.5)
            return (s.softmax(-1) @ V[0]).reshape(1, NH, T, D)
        def bmm_splitk(chunk=128):
            # The product with V split over the keys: KV x (C / chunk) small products (capacities are multiples of
            # 128), each rounded to bf16, summed in f32.
            qf = q.transpose(1, 2).reshape(KV, g * T, D)
            p = torch.baddbmm(gb[0].expand(KV, -1, -1), qf, K[0].transpose(1, 2), alpha=D ** -0.5).softmax(-1)
            n = C // chunk
            p = p.view(KV, g * T, n, chunk).transpose(1, 2).reshape(KV * n, g * T, chunk)
            part = torch.bmm(p, V[0].reshape(KV * n, chunk, D))
            return part.view(KV, n, g * T, D).float().sum(1).to(bf).reshape(1, NH, T, D)
        for name, f in [("sdpa_folded", sdpa), ("flash_varlen", flash), ("bmm", bmm), ("bmm_splitk", bmm_splitk)]:
            key = f"C{C}_T{T}_{name}"
            try:
                err = (f().float() - ref).abs().max().item()
                out[key] = {"us": timed(f), "max_err": round(err, 4)}
            except Exception as e:
                out[key] = {"error": str(e)[:300]}
print(json.dumps(out, indent=0))
