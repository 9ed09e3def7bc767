"""Does compute-sanitizer's racecheck run cuBLAS's small bf16 GEMMs on this GPU? (scripts/gpu/sanitize.sh skips the
target capture's test under racecheck because of the answer.) Plain PyTorch, no dflash: on an H100 with CUDA 13.0
and compute-sanitizer 2025.3.1, F.linear of [2, 122, 64] by [64, 64] in bf16 makes the tool report "The Sanitizer
failed to handle a hardware exception" and the GEMM fail with an illegal address, with no kernel instrumented
(`--kernel-name kns=nomatch`); memcheck runs the same script clean.

    compute-sanitizer --tool racecheck --kernel-name kns=nomatch python3 scripts/probes/racecheck_cublas.py
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.randn(2, 122, 64, device="cuda", dtype=torch.bfloat16)
for out in (64, 32, 192, 16, 300, 512):
    y = F.linear(x, torch.randn(out, 64, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    print("linear", out, y.float().abs().mean().item(), flush=True)
