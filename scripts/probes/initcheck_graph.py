"""Is initcheck's open report (docs/development.md, "The kernels under compute-sanitizer") dflash's or libtorch's and
the tool's? In `model::batched`'s GPU test, run after the graph tests in one process, a memcpy node of a CUDA graph's
replay reads 2,048 bytes (512 for one row) the tool counts as never written: the size of the row step's attention
mask, [rows 4, 1, 2 query heads a KV head, 64 keys] in f32. This builds that step's mask as the target's pipeline
does (zeros, masked_fill, view, expand, contiguous) and attends with it, eagerly to warm up, then captured in a graph
and replayed, in plain PyTorch; with `--after-a-graph` another graph is captured and dropped first, as the test
before it does. The same report under initcheck here says it is not dflash's code.

    compute-sanitizer --tool initcheck python3 scripts/probes/initcheck_graph.py [--after-a-graph]
"""
import sys

import torch
import torch.nn.functional as F

device = "cuda"
rows, kv_heads, group, keys, d = 4, 2, 2, 64, 16


def step(q, k, v, positions):
    hidden = torch.arange(keys, device=device).unsqueeze(0) > positions.unsqueeze(1)
    bias = (
        torch.zeros(rows, keys, device=device)
        .masked_fill(hidden, float("-inf"))
        .view(rows, 1, 1, keys)
        .expand(rows, 1, group, keys)
        .contiguous()
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


if "--after-a-graph" in sys.argv:
    x = torch.zeros(4, device=device)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (x * 2 + 1).exp2()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        y = (x * 2 + 1).exp2()
    g.replay()
    torch.cuda.synchronize()
    del g, y

q = torch.randn(rows, kv_heads, group, d, device=device)
k = torch.randn(rows, kv_heads, keys, d, device=device)
v = torch.randn(rows, kv_heads, keys, d, device=device)
positions = torch.tensor([3, 10, 40, 63], device=device)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        eager = step(q, k, v, positions)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = step(q, k, v, positions)
for _ in range(3):
    positions.copy_(torch.tensor([5, 12, 41, 63], device=device))
    graph.replay()
torch.cuda.synchronize()
print("replayed; largest difference from eager:", (out - step(q, k, v, positions)).abs().max().item())
