//! DFlash's training attention on kernels of its own (`staircase.cu`), forward and backward, where libtorch has no
//! kernel that takes the pattern: a block's queries see a range of their row's context (a prefix that grows with
//! the anchor: a staircase once blocks are in anchor order) and their own block. libtorch's flash attention takes no
//! mask, and its memory-efficient kernel takes it only as a dense bias over each group's concatenated keys, which
//! the backward keeps; these kernels stream the ranges through shared memory and keep one log-sum-exp per query
//! row, so memory is O(tokens).
//!
//! `csrc/staircase.cpp` makes them one autograd node and calls back into [`launch`] (passed to it as a C function)
//! with their argument block; this module compiles them with NVRTC per device and head dimension, and launches
//! them on libtorch's current stream. [`applies`] says where they run: bf16 on a CUDA GPU of compute capability 8.0
//! or newer (they use `cp.async`, `ldmatrix` and bf16 `mma`), head dimensions 64 and 128, blocks of 16, every layer
//! kind (a causal block, a sliding window), unless `DFLASH_FUSED_KERNELS=0` (every kernel of ours off) or
//! `DFLASH_STAIRCASE_ATTENTION=0` (these alone, for comparisons); elsewhere the drafter keeps the grouped attention,
//! the CPU's reference.
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, result, sys};
use cudarc::nvrtc::CompileOptions;
use tch::{Device, Kind, Tensor};

use super::ModelError;
use crate::ffi::attention::{StaircaseLaunch, StaircaseRanges, staircase_attention};

const SOURCE: &str = include_str!("staircase.cu");
/// Queries a block: the kernels give each block a warp of 16 rows (DFlash's blocks of 16; DFlash 2's of 8 keep the
/// grouped attention).
pub const BLOCK: usize = 16;
/// Keys a tile, warps a thread block, queries a step of the key-major kernel (`KEYS`, `WARPS`, `QROWS` there).
const KEYS: u32 = 64;
const WARPS: u32 = 4;
const QROWS: u32 = 32;

/// The kernels' argument block, filled by `csrc/staircase.cpp` (its layout is the `Args` of both C++ files).
#[repr(C)]
pub struct Args {
    q: *const c_void,
    q_strides: [i64; 3],
    k_ctx: *const c_void,
    v_ctx: *const c_void,
    k_ctx_strides: [i64; 3],
    v_ctx_strides: [i64; 3],
    k_blk: *const c_void,
    v_blk: *const c_void,
    k_blk_strides: [i64; 3],
    v_blk_strides: [i64; 3],
    lo: *const c_void,
    hi: *const c_void,
    heads: i32,
    kv_heads: i32,
    blocks: i32,
    context: i32,
    causal_block: i32,
    window: i32,
    scale: f32,
}
const _: () = assert!(std::mem::size_of::<Args>() == 208);

/// The three kernels of one head dimension on one device.
struct Kernels {
    context: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    /// Forward, dQ, dK and dV, each with its dynamic shared memory in bytes.
    functions: [(CudaFunction, u32); 3],
}

// SAFETY: plain driver handles, valid in any thread bound to the context (each launch binds it).
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    fn compile(ordinal: usize, head_dim: i64) -> Result<Self, String> {
        super::fused::libraries_present()?;
        let context = CudaContext::new(ordinal).map_err(|e| format!("cannot open cuda:{ordinal}: {e}"))?;
        let capability = |a| context.attribute(a).map_err(|e| format!("cuda:{ordinal}: {e}"));
        let major = capability(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = capability(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let arch = match (major, minor) {
            (8, 0) => "compute_80",
            (8, 6) => "compute_86",
            (8, 7) => "compute_87",
            (8, 9) => "compute_89",
            (9, _) => "compute_90",
            (10.., _) => "compute_100",
            _ => return Err(format!("cuda:{ordinal} is of compute capability {major}.{minor}; the kernels need 8.0")),
        };
        let options = CompileOptions {
            name: Some("dflash_staircase.cu".into()),
            arch: Some(arch),
            options: vec![format!("-DHEAD_DIM={head_dim}"), "-std=c++17".into()],
            ..Default::default()
        };
        let ptx = super::fused::nvrtc(SOURCE, options)?;
        let module = context.load_module(ptx).map_err(|e| format!("loading the staircase kernels: {e}"))?;
        let row = 2 * (head_dim as u32 + 8);
        let forward = 4 * KEYS * row;
        let sizes = [
            ("staircase_fwd", forward),
            ("staircase_dq", forward + 2 * WARPS * 16 * row),
            ("staircase_dkv", (2 * KEYS + 4 * QROWS) * row + 16 * QROWS),
        ];
        let mut functions = Vec::new();
        for (name, bytes) in sizes {
            let f = module.load_function(name).map_err(|e| format!("kernel {name}: {e}"))?;
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| format!("kernel {name}: {bytes} bytes of shared memory: {e}"))?;
            functions.push((f, bytes));
        }
        let functions = functions.try_into().map_err(|_| "three kernels".to_string())?;
        Ok(Kernels { context, _module: module, functions })
    }
}

/// The kernels for `device` and `head_dim`, compiled on first use; the reason they cannot be had, once per pair.
fn kernels(device: Device, head_dim: i64) -> Result<Arc<Kernels>, String> {
    type Cache = Mutex<HashMap<(usize, i64), Result<Arc<Kernels>, String>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let Device::Cuda(ordinal) = device else { return Err("not a CUDA device".into()) };
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry((ordinal, head_dim))
        .or_insert_with(|| {
            let compiled = Kernels::compile(ordinal, head_dim).map(Arc::new);
            if let Err(e) = &compiled {
                tracing::warn!(
                    "the staircase attention kernels are unavailable on cuda:{ordinal}, using grouped attention: {e}"
                );
            }
            compiled
        })
        .clone()
}

/// Whether `DFLASH_STAIRCASE_ATTENTION=0` asks for the grouped attention (read once per process).
fn switched_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| {
        super::fused::switched_off() || std::env::var("DFLASH_STAIRCASE_ATTENTION").is_ok_and(|v| v == "0")
    })
}

/// Whether the kernels take `q` and the keys and values: bf16 on a GPU they compile for, head dimension 64 or 128,
/// every last dimension contiguous, every other stride and every start a whole 16 bytes.
pub fn applies(q: &Tensor, kv: &[&Tensor]) -> bool {
    let head_dim = q.size().last().copied().unwrap_or(0);
    let aligned = |t: &Tensor| {
        let strides = t.stride();
        t.kind() == Kind::BFloat16
            && t.device() == q.device()
            && t.dim() == 4
            && strides[3] == 1
            && strides[..3].iter().all(|s| s % 8 == 0)
            && (t.data_ptr() as usize).is_multiple_of(16)
    };
    matches!(q.device(), Device::Cuda(_))
        && matches!(head_dim, 64 | 128)
        && !switched_off()
        && aligned(q)
        && kv.iter().all(|t| aligned(t) && t.size()[3] == head_dim)
        && kernels(q.device(), head_dim).is_ok()
}

/// Block queries `q [B, H, 16 N, D]` over context keys and values `[B, KV, S, D]` and block keys and values
/// `[B, KV, 16 N, D]`, as `ranges` says, scaled by `1 / sqrt(D)`: one autograd node (see the module documentation).
/// Only where [`applies`].
pub fn attention(
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    k_blk: &Tensor,
    v_blk: &Tensor,
    ranges: &StaircaseRanges,
) -> Result<Tensor, ModelError> {
    let scale = 1.0 / (q.size()[3] as f64).sqrt();
    let launcher: StaircaseLaunch = launch;
    staircase_attention(q, k_ctx, v_ctx, k_blk, v_blk, ranges, scale, launcher)
        .map_err(|e| ModelError::Torch(e.to_string()))
}

/// Launches kernel `kernel` (0 the forward, 1 dQ, 2 dK and dV) of `head_dim` on cuda:`device`'s `stream`, with the
/// argument block `args` and the output pointers `outputs` in the kernel's order (2, 4 or 7 of them). 0 on success,
/// else 1 with the message in `err` (`len` bytes).
///
/// # Safety
/// `args` points at a filled argument block whose tensors stay alive until the stream has run the kernel, `outputs`
/// at as many pointers as the kernel takes, `err` at `len` writable bytes; called by `csrc/staircase.cpp` only.
unsafe extern "C" fn launch(
    kernel: c_int,
    device: c_int,
    head_dim: c_int,
    batch: c_int,
    stream: *mut c_void,
    args: *const c_void,
    outputs: *const *mut c_void,
    err: *mut c_char,
    len: usize,
) -> c_int {
    let launched = std::panic::catch_unwind(|| -> Result<(), String> {
        let k = kernels(Device::Cuda(device as usize), head_dim as i64)?;
        // SAFETY: the caller's contract.
        let a = unsafe { &*(args as *const Args) };
        let (f, bytes) = k.functions.get(kernel as usize).ok_or(format!("no kernel {kernel}"))?;
        let (blocks, tiles) = (a.blocks as u32, (a.blocks as u32).div_ceil(WARPS));
        let grid = match kernel {
            2 => ((a.context as u32).div_ceil(KEYS) + (blocks * 16).div_ceil(KEYS), a.kv_heads as u32, batch as u32),
            _ => (tiles, a.heads as u32, batch as u32),
        };
        let count = [2, 4, 7][kernel as usize];
        // SAFETY: the caller passes as many output pointers as the kernel takes.
        let mut values: Vec<*mut c_void> = unsafe { std::slice::from_raw_parts(outputs, count) }.to_vec();
        let mut params: Vec<*mut c_void> = vec![args as *mut c_void];
        params.extend(values.iter_mut().map(|v| v as *mut *mut c_void as *mut c_void));
        k.context.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the function belongs to the context's live module; the parameters point at the argument block and
        // at the output pointers, live for the call (which copies them); the tensors stay alive until the stream has
        // run the kernel (libtorch's caching allocator orders reuse of their memory after work on this stream).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                grid,
                (WARPS * 32, 1, 1),
                *bytes,
                stream as sys::CUstream,
                &mut params,
            )
        }
        .map_err(|e| e.to_string())
    });
    let message = match launched {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e,
        Err(_) => "a panic while launching".to_string(),
    };
    if !err.is_null() && len > 0 {
        let bytes = message.as_bytes();
        let n = bytes.len().min(len - 1);
        // SAFETY: `err` has `len` writable bytes; n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), err as *mut u8, n);
            *err.add(n) = 0;
        }
    }
    1
}

/// Each block's context range for the staircase kernels, `(lo, hi)` row-major `[B * N]`: from its conversation's first
/// token (packed rows; else the row's) to its anchor. A block that sees no context (a padding block, anchor 0, or one
/// at its conversation's start) gets the empty range at the row's last end, so that both ends ascend along the row
/// as the kernels need (blocks come in anchor order, and a later conversation starts later). `None` where they do
/// not, where a position does not fit an int32, or for blocks of other than [`BLOCK`] positions.
pub fn block_ranges(
    anchors: &[i64],
    context_starts: Option<&[i64]>,
    batch: usize,
    block_size: usize,
    seq_len: i64,
) -> Option<(Vec<i32>, Vec<i32>)> {
    if block_size != BLOCK {
        return None;
    }
    let n = (anchors.len() / batch.max(1)).max(1);
    let mut lo: Vec<i32> = Vec::with_capacity(anchors.len());
    let mut hi: Vec<i32> = Vec::with_capacity(anchors.len());
    for (i, &anchor) in anchors.iter().enumerate() {
        let (last_lo, last_hi) = if i % n == 0 { (0, 0) } else { (*lo.last()?, *hi.last()?) };
        let end = i32::try_from(anchor.min(seq_len)).ok()?;
        let start = i32::try_from(context_starts.map_or(0, |s| s[i])).ok()?;
        let (l, h) = if end > start { (start, end) } else { (last_hi, last_hi) };
        if l < last_lo || h < last_hi {
            return None;
        }
        lo.push(l);
        hi.push(h);
    }
    Some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention::LayerAttention;
    use crate::model::drafter::BlockAttention;

    /// Ranges run from each block's conversation start to its anchor; blocks that see no context take the empty
    /// range at the row's last end (so both ends still ascend); rows whose ranges would not ascend, and blocks of
    /// other than 16 positions, are refused.
    #[test]
    fn block_ranges_ascend_with_empty_ones_at_the_last_end() {
        // Row 0: two blocks, then two padding blocks (anchor 0); row 1: packed, the second conversation from 40.
        let anchors = [5, 30, 0, 0, 12, 40, 47, 60];
        let starts = [0, 0, 0, 0, 0, 40, 40, 40];
        let (lo, hi) = block_ranges(&anchors, Some(&starts), 2, 16, 64).unwrap();
        assert_eq!(lo, [0, 0, 30, 30, 0, 12, 40, 40]);
        assert_eq!(hi, [5, 30, 30, 30, 12, 12, 47, 60]);
        assert_eq!(block_ranges(&[5, 70], None, 1, 16, 64).unwrap().1, [5, 64], "clamped to the context");
        assert_eq!(block_ranges(&[30, 5], None, 1, 16, 64), None, "anchors out of order");
        assert_eq!(block_ranges(&[10, 20], Some(&[8, 0]), 1, 16, 64), None, "a later block from an earlier start");
        assert_eq!(block_ranges(&[5, 30], None, 1, 8, 64), None, "blocks of 8 (DFlash 2) keep the grouped attention");
    }

    /// The kernels (bf16) against the grouped attention in f32, the CPU's reference run on the GPU: output and the
    /// five gradients, packed rows, padding blocks, grouped-query heads, a causal block, sliding windows (one shorter
    /// than a block), head dims 64 and 128.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_staircase_kernels_match_the_grouped_attention_and_its_gradients() {
        let device = crate::device::gpu_for_tests();
        tch::manual_seed(11);
        let (batch, seq, n, bs) = (2usize, 300i64, 9usize, 16i64);
        // The drafter zero-pads the context to whole buckets, as the grouped attention reads it.
        let padded = crate::model::attention::context_bucket(seq);
        // Row 0 plain with two padding blocks; row 1 packed, a second conversation from 150.
        let anchors: Vec<i64> = vec![3, 40, 41, 90, 150, 200, 290, 0, 0, 10, 60, 149, 150, 151, 170, 220, 260, 299];
        let starts: Vec<i64> = vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 150, 150, 150, 150, 150, 150];
        let cases = [
            (4, 2, 128, false, None),
            (4, 2, 128, true, None),
            (2, 2, 64, false, None),
            (4, 2, 128, true, Some(40)),
            (4, 2, 128, false, Some(70)),
            (2, 1, 64, false, Some(9)),
        ];
        for (heads, kv_heads, d, causal, window) in cases {
            let layer = LayerAttention { window, causal };
            let pattern = |kind| {
                let a = BlockAttention::new(&anchors, Some(&starts), batch, bs as usize, seq, 4, kind, device).unwrap();
                a.restricted(&layer).unwrap()
            };
            let (b, q_len) = (batch as i64, n as i64 * bs);
            let leaves = [
                [b, heads, q_len, d],
                [b, kv_heads, padded, d],
                [b, kv_heads, padded, d],
                [b, kv_heads, q_len, d],
                [b, kv_heads, q_len, d],
            ]
            .map(|shape| Tensor::randn(shape, (Kind::Float, device)));
            let dout = Tensor::randn([b, heads, q_len, d], (Kind::Float, device));
            let run = |kind: Kind| {
                let inputs: Vec<Tensor> =
                    leaves.iter().map(|t| t.to_kind(kind).detach().set_requires_grad(true)).collect();
                let kernels = kind == Kind::BFloat16;
                if kernels {
                    assert!(applies(&inputs[0], &[&inputs[1], &inputs[2], &inputs[3], &inputs[4]]));
                }
                let out = pattern(kind).run(&inputs[0], &inputs[1], &inputs[2], &inputs[3], &inputs[4]);
                (out.to_kind(Kind::Float) * &dout).sum(Kind::Float).backward();
                let grads: Vec<Tensor> = inputs.iter().map(|t| t.grad().to_kind(Kind::Float)).collect();
                (out.to_kind(Kind::Float).detach(), grads)
            };
            let (reference, reference_grads) = run(Kind::Float);
            let (out, grads) = run(Kind::BFloat16);
            let relative = |a: &Tensor, r: &Tensor| {
                (a - r).abs().max().double_value(&[]) / r.abs().max().double_value(&[]).max(1e-6)
            };
            let case = format!("heads {heads}/{kv_heads}, d {d}, causal {causal}, window {window:?}");
            assert!(relative(&out, &reference) < 1e-2, "{case}: output {}", relative(&out, &reference));
            for (name, (g, r)) in
                ["q", "k_ctx", "v_ctx", "k_blk", "v_blk"].iter().zip(grads.iter().zip(&reference_grads))
            {
                assert!(relative(g, r) < 2e-2, "{case}: d{name} {}", relative(g, r));
            }
        }
    }
}
