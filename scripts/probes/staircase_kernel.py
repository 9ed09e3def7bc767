# The staircase attention kernels (src/model/staircase.cu) on the GPU, the way the Rust side runs them (NVRTC to a
# cubin, the driver API, one struct of arguments), before it does: the forward's output and log-sum-exp and the
# backward's five gradients against f32 attention with expanded heads and autograd (random ranges, partial tiles,
# empty contexts, causal blocks, head dims 64 and 128, blocks of 16 and of 8), then each kernel timed at the Qwen3-8B
# drafter's shapes.
# Run on the GPU machine from the repository root: `python3 scripts/probes/staircase_kernel.py`.
import ctypes, glob, json, math, os, sys
import torch

dev, bf = "cuda", torch.bfloat16
UNIT, KEYS, WARPS, QROWS = 16, 64, 4, 32  # a warp's query rows: a block of 16 or two of 8
# WGMMA=1: the Hopper build (compute_90a, -DWGMMA): the training kernels on wgmma, warp-specialized.
WGMMA = os.environ.get("WGMMA") == "1"
WS_UNITS, WS_THREADS = 8, 384
torch.zeros(1, device=dev)  # the primary context, current on this thread

libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu13", "lib", "libnvrtc.so.13"))
nvrtc = ctypes.CDLL(libs[0] if libs else "libnvrtc.so.13")
cuda = ctypes.CDLL("libcuda.so.1")
SRC = open(os.environ.get("STAIRCASE_SRC", "src/model/staircase.cu")).read().encode()  # another version: STAIRCASE_SRC
if b"struct StaircaseArgs {" not in SRC and b"struct Args {" not in SRC:
    SRC = open("csrc/kernel_args.h").read().encode() + SRC  # the argument blocks, as src/model/staircase.rs compiles it
EIGHTS = b"int per;" in SRC  # blocks of 8 (a source from before them, to time beside, takes only 16)


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: error {rc}")


def compile_module(d, per):
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SRC, b"staircase.cu", 0, None, None), "create")
    opts = [b"--gpu-architecture=sm_90a" if WGMMA else b"--gpu-architecture=sm_90", b"-std=c++17",
            f"-DHEAD_DIM={d}".encode(), f"-DUNIT_BLOCKS={per}".encode()] + ([b"-DWGMMA=1"] if WGMMA else [])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(log.value.decode())
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    mod = ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "load")
    funcs = {}
    kernels = [("staircase_fwd", fwd_smem(d)), ("staircase_dq", dq_smem(d)), ("staircase_dkv", dkv_smem(d))]
    if WGMMA:
        kernels += [("staircase_fwd_ws", ws_smem(d)), ("staircase_dq_ws", ws_smem(d) + 2 * 64 * d * 2),
                    ("staircase_dkv_ws", (4 * 64 * d + 3 * (2 * QROWS * d + 2 * QROWS * 2)) * 2 + 7 * 8)]
    for name, smem in kernels:
        f = ctypes.c_void_p()
        check(cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        check(cuda.cuFuncSetAttribute(f, 8, smem), "smem")  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        regs, local = ctypes.c_int(), ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(regs), 4, f)
        cuda.cuFuncGetAttribute(ctypes.byref(local), 3, f)
        print(json.dumps({"kernel": name, "head_dim": d, "per": per, "regs": regs.value, "local_bytes": local.value}),
              flush=True)
        funcs[name] = (f, smem)
    return funcs


def fwd_smem(d):
    return 2 * 2 * KEYS * (d + 8) * 2


def ws_smem(d):  # the warp-specialized forward (WGMMA): a ring of 2 K/V stages, 128 queries, their own K/V, 5 barriers
    return 2 * (2 * 2 * KEYS * d + 2 * 64 * d + 2 * 2 * 64 * d) + 5 * 8


def dq_smem(d):
    return fwd_smem(d) + 2 * WARPS * 16 * (d + 8) * 2


def dkv_smem(d):
    return (2 * KEYS + 4 * QROWS) * (d + 8) * 2 + 4 * QROWS * 4


class Args(ctypes.Structure):  # csrc/kernel_args.h's StaircaseArgs
    _fields_ = [("q", ctypes.c_void_p), ("q_b", ctypes.c_int64), ("q_h", ctypes.c_int64), ("q_t", ctypes.c_int64),
                ("k_ctx", ctypes.c_void_p), ("v_ctx", ctypes.c_void_p), ("c_b", ctypes.c_int64),
                ("c_h", ctypes.c_int64), ("c_t", ctypes.c_int64), ("cv_b", ctypes.c_int64), ("cv_h", ctypes.c_int64),
                ("cv_t", ctypes.c_int64), ("k_blk", ctypes.c_void_p), ("v_blk", ctypes.c_void_p),
                ("k_b", ctypes.c_int64), ("k_h", ctypes.c_int64), ("k_t", ctypes.c_int64), ("bv_b", ctypes.c_int64),
                ("bv_h", ctypes.c_int64), ("bv_t", ctypes.c_int64),
                ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p), ("heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("units", ctypes.c_int32), ("context", ctypes.c_int32),
                ("causal_block", ctypes.c_int32), ("window", ctypes.c_int32), ("per", ctypes.c_int32),
                ("scale", ctypes.c_float)]
    if not EIGHTS:  # no `per` in the argument block
        _fields_ = [f for f in _fields_ if f[0] != "per"]


modules = {}


def launch(name, d, grid, args, *ptrs):
    per = args.per if EIGHTS else 1
    if (d, per) not in modules:
        modules[d, per] = compile_module(d, per)
    f, smem = modules[d, per][name]
    vals = [args] + [ctypes.c_void_p(p) for p in ptrs]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    threads = WS_THREADS if name.endswith("_ws") else WARPS * 32
    check(cuda.cuLaunchKernel(f, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, params, None), name)


def make_args(q, kc, vc, kb, vb, lo, hi, causal, scale):
    B, H, Q, d = q.shape
    return Args(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3],
                *vc.stride()[:3], kb.data_ptr(), vb.data_ptr(), *kb.stride()[:3], *vb.stride()[:3], lo.data_ptr(),
                hi.data_ptr(), H, kc.shape[1], Q // UNIT, kc.shape[2], 1 if causal else 0, 0,
                *([lo.shape[1] * UNIT // Q] if EIGHTS else []), scale)


def forward(q, kc, vc, kb, vb, lo, hi, causal, scale):
    B, H, Q, d = q.shape
    o = torch.empty(B, H, Q, d, device=dev, dtype=bf)
    lse = torch.empty(B, H, Q, device=dev, dtype=torch.float32)
    a = make_args(q, kc, vc, kb, vb, lo, hi, causal, scale)
    if WGMMA:  # the warp-specialized forward: 8 units a thread block
        launch("staircase_fwd_ws", d, ((Q // UNIT + WS_UNITS - 1) // WS_UNITS, H, B), a, o.data_ptr(), lse.data_ptr())
    else:
        launch("staircase_fwd", d, ((Q // UNIT + WARPS - 1) // WARPS, H, B), a, o.data_ptr(), lse.data_ptr())
    return o, lse


def backward(q, kc, vc, kb, vb, lo, hi, causal, scale, o, lse, dout, which=("dq", "dkv")):
    B, H, Q, d = q.shape
    KV, S = kc.shape[1], kc.shape[2]
    dout = dout.contiguous()
    drow = (dout.float() * o.float()).sum(-1)
    a = make_args(q, kc, vc, kb, vb, lo, hi, causal, scale)
    dq = torch.empty_like(o)
    dkc, dvc = torch.empty(B, KV, S, d, device=dev, dtype=bf), torch.empty(B, KV, S, d, device=dev, dtype=bf)
    dkb, dvb = torch.empty(B, KV, Q, d, device=dev, dtype=bf), torch.empty(B, KV, Q, d, device=dev, dtype=bf)
    if "dq" in which and WGMMA:  # warp-specialized: 8 units a thread block
        launch("staircase_dq_ws", d, ((Q // UNIT + WS_UNITS - 1) // WS_UNITS, H, B), a, dout.data_ptr(),
               lse.data_ptr(), drow.data_ptr(), dq.data_ptr())
    elif "dq" in which:
        launch("staircase_dq", d, ((Q // UNIT + WARPS - 1) // WARPS, H, B), a, dout.data_ptr(), lse.data_ptr(),
               drow.data_ptr(), dq.data_ptr())
    if "dkv" in which:
        keys = 128 if WGMMA else KEYS  # warp-specialized: 128 keys a thread block
        tiles = (S + keys - 1) // keys + (Q + keys - 1) // keys
        launch("staircase_dkv_ws" if WGMMA else "staircase_dkv", d, (tiles, KV, B), a, dout.data_ptr(),
               lse.data_ptr(), drow.data_ptr(), dkc.data_ptr(), dvc.data_ptr(), dkb.data_ptr(), dvb.data_ptr())
    return dq, dkc, dvc, dkb, dvb


def reference(q, kc, vc, kb, vb, lo, hi, causal, scale):
    B, H, Q, d = q.shape
    KV, S = kc.shape[1], kc.shape[2]
    g, BS = H // KV, Q // lo.shape[1]
    Ke = torch.cat([kc, kb], 2).repeat_interleave(g, 1)
    Ve = torch.cat([vc, vb], 2).repeat_interleave(g, 1)
    lo_q, hi_q = lo.long().repeat_interleave(BS, 1), hi.long().repeat_interleave(BS, 1)
    keys = torch.arange(S, device=dev)[None, None, :]
    ctx_ok = (keys >= lo_q[:, :, None]) & (keys < hi_q[:, :, None])
    qi = torch.arange(Q, device=dev)
    same = (qi[:, None] // BS) == (qi[None, :] // BS)
    if causal:
        same &= (qi[None, :] % BS) <= (qi[:, None] % BS)
    vis = torch.cat([ctx_ok, same.expand(B, -1, -1)], 2).unsqueeze(1)
    sc = (q @ Ke.transpose(-1, -2)) * scale
    sc = sc.masked_fill(~vis, float("-inf"))
    return sc.softmax(-1) @ Ve, torch.logsumexp(sc, -1)


def inputs(B, H, KV, S, N, d, packed, seed, BS=16):
    gen = torch.Generator(device=dev).manual_seed(seed)
    hi = torch.sort(torch.randint(0, S + 1, (B, N), device=dev, generator=gen), dim=1).values
    if packed:  # each block from a conversation's start (or a window's) at or below its anchor, ascending
        lo = torch.minimum(hi, torch.sort(torch.randint(0, S, (B, N), device=dev, generator=gen), 1).values)
    else:
        lo = torch.zeros_like(hi)
    t = lambda *shape: torch.randn(*shape, device=dev, dtype=bf, generator=gen)
    return (t(B, H, N * BS, d), t(B, KV, S, d), t(B, KV, S, d), t(B, KV, N * BS, d), t(B, KV, N * BS, d),
            lo.int().contiguous(), hi.int().contiguous())


def rel(a, b):
    return float((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6))


def correctness():
    worst = 0.0
    for (B, H, KV, S, N, d, packed, causal, bs) in [(2, 4, 2, 300, 37, 128, False, False, 16),
                                                    (2, 4, 2, 300, 37, 128, True, True, 16),
                                                    (1, 8, 8, 1000, 61, 64, True, False, 16),
                                                    (3, 32, 8, 130, 9, 128, False, True, 16),
                                                    (1, 2, 1, 64, 4, 128, False, False, 16),
                                                    (2, 4, 2, 300, 38, 128, True, False, 8),
                                                    (2, 4, 2, 300, 38, 128, False, True, 8),
                                                    (1, 8, 8, 1000, 62, 64, True, True, 8)]:
        if bs != 16 and not EIGHTS:
            continue
        args = inputs(B, H, KV, S, N, d, packed, seed=B * 1000 + S, BS=bs)
        scale = 1 / math.sqrt(d)
        o, lse = forward(*args, causal, scale)
        leaves = [t.float().requires_grad_() for t in args[:5]]
        ro, rl = reference(*leaves, args[5], args[6], causal, scale)
        dout = torch.randn(ro.shape, device=dev, dtype=torch.float32).to(bf)
        grads = torch.autograd.grad(ro, leaves, dout.float())
        mine = backward(*args, causal, scale, o, lse, dout)
        errs = {"out": rel(o, ro.detach()), "lse": float((lse - rl.detach()).abs().max())}
        for name, a, r in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), mine, grads):
            errs[name] = rel(a, r)
        worst = max(worst, max(v for k, v in errs.items() if k != "lse"))
        print(json.dumps({"check": [B, H, KV, S, N, d, packed, causal, bs], **{k: round(v, 5) for k, v in errs.items()}}),
              flush=True)
    return worst


def median_ms(f, n=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
    t.sort()
    return round(t[len(t) // 2], 3)


def timing(B, S, N, BS=16):
    H, KV, d = 32, 8, 128
    args = inputs(B, H, KV, S, N, d, False, seed=7, BS=BS)
    scale = 1 / math.sqrt(d)
    o, lse = forward(*args, False, scale)
    dout = torch.randn_like(o)
    seen = float(((args[6].float() - args[5].float()).clamp(min=0) + BS).sum()) * BS
    flops = 4 * seen * H * d  # QK and PV over the keys each query sees
    res = {"time": [B, S, N, BS]}
    res["fwd_ms"] = median_ms(lambda: forward(*args, False, scale))
    res["dq_ms"] = median_ms(lambda: backward(*args, False, scale, o, lse, dout, ("dq",)))
    res["dkv_ms"] = median_ms(lambda: backward(*args, False, scale, o, lse, dout, ("dkv",)))
    res["fwd_tflops"] = round(flops / res["fwd_ms"] / 1e9, 1)
    # the backward's useful work: 2.5 times the forward's (dV, dP, dQ, dK and S again), as flash attention counts it
    res["bwd_tflops"] = round(2.5 * flops / (res["dq_ms"] + res["dkv_ms"]) / 1e9, 1)
    print(json.dumps(res), flush=True)


worst = correctness()
if worst > 0.05:
    print(f"errors too large ({worst}): not timing", flush=True)
    sys.exit(1)
for shape in [(4, 768, 256), (4, 3072, 512), (1, 8192, 512), (1, 32768, 2048), (4, 3072, 1024, 8), (1, 32768, 4096, 8)]:
    if len(shape) == 3 or EIGHTS:
        timing(*shape)
