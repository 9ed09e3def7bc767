"""Where a batched prefill's fixed cost goes (BENCHMARKS.md, synthesis's `generation:` line: ~34 ms a prefill on an
H100 whether it holds 25 prompts or 35). Batched generation prefills right-padded prompts with libtorch's
scaled_dot_product_attention (causal, grouped heads), and nearly every prefill has a shape of its own (rows x the
longest prompt). This times that attention at the real model's shapes (9 query heads, 3 key/value heads, head dim
64, bf16) on new shapes and on shapes seen before, by each backend alone and by libtorch's own choice, to say
whether a per-shape plan (cuDNN's) is what a prefill pays; then the layer's four matrix products at new shapes
(cuBLAS's choice of kernel per shape).

Usage (on the GPU machine): python3 scripts/probes/prefill_attention.py [--shapes 40]
One JSON line per backend: ms of a shape's first call and of its repeats (median), and whether it ran.
"""
import argparse
import json
import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=40)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    torch.manual_seed(0)
    for name, backend in backends.items():
        rng = random.Random(0)
        # The same rows for every backend, widths offset per backend: no shape is met twice in this process.
        offset = list(backends).index(name)
        shapes = [(rng.randint(20, 40), rng.randint(20, 290) * 5 + offset) for _ in range(args.shapes)]
        first, again, error = [], [], None
        for n, w in shapes:
            q = torch.randn(n, args.heads, w, args.head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(n, args.kv_heads, w, args.head_dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)

            def run():
                if backend is None:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            try:
                first.append(timed(run))
                again.extend(timed(run) for _ in range(3))
            except RuntimeError as e:
                error = str(e).splitlines()[0][:200]
                break
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
        print(json.dumps({"backend": name, "shapes": len(first), "first_ms_median": med(first),
                          "first_ms_max": max(first) if first else None, "again_ms_median": med(again),
                          "error": error}), flush=True)
    # The prefill's matrix products at the same new shapes (M = rows x width; the real model's hidden 576, fused
    # q/k/v 960, MLP 2 x 1536): cuBLAS's choice of kernel per new shape.
    rng = random.Random(1)
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for o, i in [(960, 576), (576, 576),
                                                                                 (3072, 576), (576, 1536)]]
    first, again = [], []
    for _ in range(args.shapes):
        m = rng.randint(20, 40) * (rng.randint(20, 290) * 5 + 7)
        xs = [torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights]

        def products():
            for x, w in zip(xs, weights):
                F.linear(x, w)

        first.append(timed(products))
        again.extend(timed(products) for _ in range(3))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(json.dumps({"what": "4 linear products a layer, new M", "shapes": len(first), "first_ms_median": med(first),
                      "first_ms_max": max(first), "again_ms_median": med(again)}), flush=True)
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
                      "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled()}))


if __name__ == "__main__":
    main()
