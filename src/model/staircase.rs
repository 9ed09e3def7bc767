//! DFlash's training attention on kernels of its own (`staircase.cu`), forward and backward, where libtorch has no
//! kernel that takes the pattern: a block's queries see a range of their row's context (a prefix that grows with
//! the anchor: a staircase once blocks are in anchor order) and their own block. libtorch's flash attention takes no
//! mask, and its memory-efficient kernel takes it only as a dense bias over each group's concatenated keys, which
//! the backward keeps; these kernels stream the ranges through shared memory and keep one log-sum-exp per query
//! row, so memory is O(tokens).
//!
//! `csrc/staircase.cpp` makes them one autograd node and calls back into [`launch`] (passed to it as a C function)
//! with their argument block; this module compiles them with NVRTC per device, head dimension and unit, and launches
//! them on libtorch's current stream. [`applies`] says where they run: bf16 on a CUDA GPU of compute capability 8.0
//! or newer (they use `cp.async`, `ldmatrix` and bf16 `mma`), head dimensions 64 and 128, blocks of 16 or an even
//! number of DFlash 2's blocks of 8 a row ([`block_ranges`]: a warp owns 16 query rows), every layer kind (a causal
//! block, a sliding window), unless `DFLASH_FUSED_KERNELS=0` (every kernel of ours off) or
//! `DFLASH_STAIRCASE_ATTENTION=0` (these alone, for comparisons); elsewhere the drafter keeps the grouped attention,
//! the CPU's reference. On Hopper, `DFLASH_WGMMA=1` builds the forward, dQ and dK/dV on the warpgroup's `wgmma`
//! instead of each warp's `mma.sync` (`compute_90a`; the same masks and softmax, the tiles in wgmma's shared layout),
//! each warp-specialized (`staircase_fwd_ws`, `staircase_dq_ws`, `staircase_dkv_ws`: a producer warpgroup copying
//! into a ring of stages that mbarriers guard, two consumer warpgroups of 64 query rows or keys overlapping each
//! tile's last products with the next tile's first ones): off by default until a Hopper GPU has run its tests and
//! it beats `mma.sync` (issue 65; `scripts/gpu/staircase.sh wgmma`, `WGMMA=1 scripts/probes/staircase_kernel.py`).
//!
//! The same source holds batch-1 decoding's attention over a KV cache ([`decode_attention`]), which shares the
//! tiles, the fragments and the online softmax of the training forward: the target's verify and one-token steps at
//! long contexts, where libtorch's products over one query's keys run on a few multiprocessors.
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, result, sys};
use cudarc::nvrtc::{CompileOptions, Ptx};
use tch::{Device, Kind, Tensor};

use super::ModelError;
use super::attention::LayerAttention;
use crate::ffi::attention::{StaircaseLaunch, StaircaseRanges, staircase_attention};

mod kernel_args;
use kernel_args::{DecodeArgs, SOURCE, StaircaseArgs};

/// Query rows a warp: one block of DFlash's 16, or two of DFlash 2's 8.
const UNIT: usize = 16;
/// Keys a tile, warps a thread block, queries a step of the key-major kernel (`KEYS`, `WARPS`, `QROWS` there).
const KEYS: u32 = 64;
const WARPS: u32 = 4;
const QROWS: u32 = 32;

/// The kernels of one head dimension and unit (blocks a warp: 1, or 2 of DFlash 2's 8) on one device.
struct Kernels {
    context: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    /// Forward, dQ, dK and dV, then decoding's attention and merge, each with its dynamic shared memory in bytes.
    functions: [(CudaFunction, u32); 5],
    /// The device's multiprocessors (how many thread blocks keep it busy).
    multiprocessors: u32,
    /// Under `wgmma`, the warp-specialized forward, dQ and dK/dV (`staircase_fwd_ws`, `staircase_dq_ws`,
    /// `staircase_dkv_ws`) that replace functions 0, 1 and 2, each with its shared memory.
    warp_specialized: Option<[(CudaFunction, u32); 3]>,
}

/// The warp-specialized kernels' thread block: a producer warpgroup and two consumers, of four units each (the
/// forward and dQ) or of 64 keys each (dK and dV).
const WS_THREADS: u32 = 3 * 128;
const WS_UNITS: u32 = 8;
const WS_DKV_KEYS: u32 = 128;
/// Their shared memory for head dimension `d` (`WS_*` in `staircase.cu`), kernel 0, 1 or 2: for the forward and dQ,
/// two stages of a key and a value tile, the queries, the units' own keys and values, for dQ the output gradients,
/// five barriers; for dK and dV, the keys and values, three stages of a step's queries, output gradients and their
/// 2 x 32 floats, seven barriers.
fn warp_specialized_bytes(d: u32, kernel: usize) -> u32 {
    let elements = match kernel {
        0 => 2 * 2 * KEYS * d + 2 * 64 * d + 2 * 2 * 64 * d,
        1 => 2 * 2 * KEYS * d + 2 * 64 * d + 2 * 2 * 64 * d + 2 * 64 * d,
        _ => 2 * 2 * 64 * d + 3 * (2 * QROWS * d + 2 * QROWS * 2),
    };
    let barriers = if kernel == 2 { 7 } else { 5 };
    2 * elements + barriers * 8
}

// SAFETY: plain driver handles, valid in any thread bound to the context (each launch binds it).
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

/// The kernels' PTX for a virtual architecture, head dimension and unit (NVRTC needs no GPU); with `wgmma` the
/// training kernels on Hopper's warpgroup products (`compute_90a` only).
fn ptx(arch: &'static str, head_dim: i64, per: i32, wgmma: bool) -> Result<Ptx, String> {
    let mut options = vec![format!("-DHEAD_DIM={head_dim}"), format!("-DUNIT_BLOCKS={per}"), "-std=c++17".into()];
    if wgmma {
        options.push("-DWGMMA=1".into());
    }
    let options =
        CompileOptions { name: Some("dflash_staircase.cu".into()), arch: Some(arch), options, ..Default::default() };
    super::fused::nvrtc(SOURCE, options)
}

/// Whether `DFLASH_WGMMA=1` asks for the training kernels on Hopper's `wgmma` (read once per process). Off by default until
/// the GPU tests and the probe (scripts/probes/wgmma_tile.cu) have run it on a Hopper GPU (issue 65).
fn wgmma_asked() -> bool {
    static ASKED: OnceLock<bool> = OnceLock::new();
    *ASKED.get_or_init(|| std::env::var("DFLASH_WGMMA").is_ok_and(|v| v == "1"))
}

impl Kernels {
    fn compile(ordinal: usize, head_dim: i64, per: i32) -> Result<Self, String> {
        super::fused::libraries_present()?;
        let context = CudaContext::new(ordinal).map_err(|e| format!("cannot open cuda:{ordinal}: {e}"))?;
        let capability = |a| context.attribute(a).map_err(|e| format!("cuda:{ordinal}: {e}"));
        let major = capability(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = capability(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let wgmma = major == 9 && wgmma_asked();
        let arch = match (major, minor) {
            (8, 0) => "compute_80",
            (8, 6) => "compute_86",
            (8, 7) => "compute_87",
            (8, 9) => "compute_89",
            (9, _) if wgmma => "compute_90a",
            (9, _) => "compute_90",
            (10.., _) => "compute_100",
            _ => return Err(format!("cuda:{ordinal} is of compute capability {major}.{minor}; the kernels need 8.0")),
        };
        let ptx = ptx(arch, head_dim, per, wgmma)?;
        let module = context.load_module(ptx).map_err(|e| format!("loading the staircase kernels: {e}"))?;
        let row = 2 * (head_dim as u32 + 8);
        let forward = 4 * KEYS * row;
        let sizes = [
            ("staircase_fwd", forward),
            ("staircase_dq", forward + 2 * WARPS * 16 * row),
            ("staircase_dkv", (2 * KEYS + 4 * QROWS) * row + 16 * QROWS),
            ("decode_attention", forward),
            ("decode_merge", 0),
        ];
        let load = |name: &str, bytes: u32| -> Result<(CudaFunction, u32), String> {
            let f = module.load_function(name).map_err(|e| format!("kernel {name}: {e}"))?;
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| format!("kernel {name}: {bytes} bytes of shared memory: {e}"))?;
            Ok((f, bytes))
        };
        let mut functions = Vec::new();
        for (name, bytes) in sizes {
            functions.push(load(name, bytes)?);
        }
        let functions = functions.try_into().map_err(|_| "five kernels".to_string())?;
        let multiprocessors = capability(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let warp_specialized = match wgmma {
            true => Some([
                load("staircase_fwd_ws", warp_specialized_bytes(head_dim as u32, 0))?,
                load("staircase_dq_ws", warp_specialized_bytes(head_dim as u32, 1))?,
                load("staircase_dkv_ws", warp_specialized_bytes(head_dim as u32, 2))?,
            ]),
            false => None,
        };
        Ok(Kernels { context, _module: module, functions, multiprocessors, warp_specialized })
    }
}

impl Kernels {
    /// Launches function `index` (of [`Kernels::functions`]) on `stream`, this context bound to the thread, with
    /// `block` threads a thread block and the function's shared memory.
    ///
    /// # Safety
    /// `params` point at live values of the C types the kernel takes, in order, and the memory those address stays
    /// alive until the stream has run the kernel.
    unsafe fn launch(
        &self,
        index: usize,
        grid: (u32, u32, u32),
        block: u32,
        stream: *mut c_void,
        params: &mut [*mut c_void],
    ) -> Result<(), String> {
        let (f, bytes) = self.functions.get(index).ok_or(format!("no kernel {index}"))?;
        // SAFETY: the caller's contract.
        unsafe { self.launch_function(f, *bytes, grid, block, stream, params) }
    }

    /// [`Kernels::launch`] of a function of this module with `bytes` of shared memory.
    ///
    /// # Safety
    /// As [`Kernels::launch`].
    unsafe fn launch_function(
        &self,
        f: &CudaFunction,
        bytes: u32,
        grid: (u32, u32, u32),
        block: u32,
        stream: *mut c_void,
        params: &mut [*mut c_void],
    ) -> Result<(), String> {
        self.context.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the function belongs to this context's live module; the parameters are the caller's contract.
        unsafe { result::launch_kernel(f.cu_function(), grid, (block, 1, 1), bytes, stream as sys::CUstream, params) }
            .map_err(|e| e.to_string())
    }
}

/// The kernels for `device`, `head_dim` and `per` blocks a warp (1 for blocks of 16, 2 for blocks of 8), compiled on
/// first use; the reason they cannot be had, once each.
fn kernels(device: Device, head_dim: i64, per: i32) -> Result<Arc<Kernels>, String> {
    type Cache = Mutex<HashMap<(usize, i64, i32), Result<Arc<Kernels>, String>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let Device::Cuda(ordinal) = device else { return Err("not a CUDA device".into()) };
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry((ordinal, head_dim, per))
        .or_insert_with(|| {
            let compiled = Kernels::compile(ordinal, head_dim, per).map(Arc::new);
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
    kernels_taking(q, kv).is_some()
}

/// The kernels (blocks of 16) that take `q` and the keys and values, where [`applies`].
fn kernels_taking(q: &Tensor, kv: &[&Tensor]) -> Option<Arc<Kernels>> {
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
    let takes = matches!(q.device(), Device::Cuda(_))
        && matches!(head_dim, 64 | 128)
        && !switched_off()
        && aligned(q)
        && kv.iter().all(|t| aligned(t) && t.size()[3] == head_dim);
    takes.then(|| kernels(q.device(), head_dim, 1).ok()).flatten()
}

/// Block queries `q [B, H, bs N, D]` (blocks of bs = 16, or 8 with N even) over context keys and values
/// `[B, KV, S, D]` and block keys and values `[B, KV, bs N, D]`, as `ranges` says, scaled by `1 / sqrt(D)`: one
/// autograd node (see the module documentation). Only where [`applies`].
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

/// Batch-1 decoding attention on the kernels ("flash decoding", `decode_attention` in `staircase.cu`): the queries
/// `q [1, H, T, D]` of the T newest positions over the first `start + T` positions of the cache buffers `k`, `v`
/// `[1, KV, C, D]` (the new keys and values written there), query t seeing the positions up to `start + t` where
/// `causal` (else all of them: a drafter's block sees its own keys both ways), with a `window` only those fewer than
/// `window` positions from its own (both sides where not causal, as [`LayerAttention::hides`] says), scaled by
/// `1 / sqrt(D)`. `start` is an int64 on the device (its first element is read), so a CUDA graph may capture the
/// call. The keys are split over enough thread blocks to fill the GPU, so a long context streams at memory speed
/// where one query head's product would run on a few multiprocessors. `None` where the kernels do not apply (no
/// GPU they compile for, not bf16, head dimension other than 64 or 128, more than 64 query rows a K/V head): the
/// caller's attention runs instead.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: &Tensor,
    layer: LayerAttention,
) -> Result<Option<Tensor>, ModelError> {
    let [batch, heads, t, d] = q.size()[..] else { return Ok(None) };
    let [_, kv_heads, capacity, _] = k.size()[..] else { return Ok(None) };
    let rows = if kv_heads > 0 && heads % kv_heads == 0 { heads / kv_heads * t } else { i64::MAX };
    let device = q.device();
    let window = i32::try_from(layer.window.unwrap_or(0)).unwrap_or(0);
    if batch != 1 || rows > (WARPS * 16) as i64 || start.kind() != Kind::Int64 || start.device() != device || window < 0
    {
        return Ok(None);
    }
    if v.size() != k.size() {
        return Ok(None);
    }
    let Some(kernels) = kernels_taking(q, &[k, v]) else { return Ok(None) };
    // Enough splits for two thread blocks a multiprocessor, each a whole number of tiles, over the keys a query can
    // see: the cache, or with a window the window and the new positions (the kernel starts where the window does).
    let span = match window {
        0 => capacity,
        w => capacity.min(i64::from(w) + t),
    };
    let (kv, span) = (kv_heads as u64, span.max(1) as u64);
    let wanted = (2 * kernels.multiprocessors as u64).div_ceil(kv).max(1);
    let chunk = span.div_ceil(wanted).div_ceil(KEYS as u64) * KEYS as u64;
    let splits = span.div_ceil(chunk) as i64;
    let chunk = chunk as i64;
    let part = Tensor::f_empty([kv_heads, splits, rows, d], (Kind::Float, device))?;
    let part_lse = Tensor::f_empty([kv_heads, splits, rows], (Kind::Float, device))?;
    let o = Tensor::f_empty([1, heads, t, d], (Kind::BFloat16, device))?;
    let (qs, ks, vs) = (q.stride(), k.stride(), v.stride());
    let mut args = DecodeArgs {
        q: q.data_ptr(),
        q_h: qs[1],
        q_t: qs[2],
        k: k.data_ptr(),
        v: v.data_ptr(),
        k_h: ks[1],
        k_t: ks[2],
        v_h: vs[1],
        v_t: vs[2],
        start: start.data_ptr(),
        part: part.data_ptr(),
        part_lse: part_lse.data_ptr(),
        o: o.data_ptr(),
        heads: heads as i32,
        kv_heads: kv_heads as i32,
        t: t as i32,
        chunk: chunk as i32,
        splits: splits as i32,
        causal: i32::from(layer.causal),
        window,
        scale: (1.0 / (d as f64).sqrt()) as f32,
    };
    let stream = crate::device::current_stream_handle(device)
        .map_err(|e| ModelError::Torch(e.to_string()))?
        .ok_or_else(|| ModelError::Torch("not a CUDA device".into()))?;
    let kv = kv as u32;
    for (index, grid, block) in [(3, (kv, splits as u32, 1), WARPS * 32), (4, (kv, rows as u32, 1), d as u32)] {
        let mut params: Vec<*mut c_void> = vec![&mut args as *mut DecodeArgs as *mut c_void];
        // SAFETY: both kernels take one `DecodeArgs` by value, which `params` points at for the call (which copies
        // it); the tensors it addresses stay alive until the stream has run the kernel (libtorch's caching allocator
        // orders reuse of their memory after work on this stream).
        unsafe { kernels.launch(index, grid, block, stream, &mut params) }
            .map_err(|e| ModelError::Torch(format!("the decoding attention kernel: {e}")))?;
    }
    Ok(Some(o))
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
        // SAFETY: the caller's contract.
        let a = unsafe { &*(args as *const StaircaseArgs) };
        let k = kernels(Device::Cuda(device as usize), head_dim as i64, a.per)?;
        let count = *[2, 4, 7].get(kernel as usize).ok_or(format!("no training kernel {kernel}"))?;
        let (units, tiles) = (a.units as u32, (a.units as u32).div_ceil(WARPS));
        let grid = match kernel {
            2 => ((a.context as u32).div_ceil(KEYS) + (units * 16).div_ceil(KEYS), a.kv_heads as u32, batch as u32),
            _ => (tiles, a.heads as u32, batch as u32),
        };
        // SAFETY: the caller passes as many output pointers as the kernel takes.
        let mut values: Vec<*mut c_void> = unsafe { std::slice::from_raw_parts(outputs, count) }.to_vec();
        let mut params: Vec<*mut c_void> = vec![args as *mut c_void];
        params.extend(values.iter_mut().map(|v| v as *mut *mut c_void as *mut c_void));
        // The warp-specialized kernels, where built, take the same parameters: eight units, or 128 keys, a thread
        // block.
        let specialized = k.warp_specialized.as_ref().and_then(|w| w.get(kernel as usize));
        let (function, grid, threads) = match specialized {
            Some(function) => {
                let keys = |n: u32| n.div_ceil(WS_DKV_KEYS);
                let x = if kernel == 2 { keys(a.context as u32) + keys(units * 16) } else { units.div_ceil(WS_UNITS) };
                (function, (x, grid.1, grid.2), WS_THREADS)
            }
            None => (k.functions.get(kernel as usize).ok_or(format!("no kernel {kernel}"))?, grid, WARPS * 32),
        };
        // SAFETY: the parameters point at the argument block and at the output pointers, live for the call (which
        // copies them); the tensors stay alive until the stream has run the kernel (the caller's contract).
        unsafe { k.launch_function(&function.0, function.1, grid, threads, stream, &mut params) }
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
/// not, where a position does not fit an int32, or where a row's blocks do not fill whole warps of 16 query rows
/// (blocks of 16, or an even number of blocks of 8).
pub fn block_ranges(
    anchors: &[i64],
    context_starts: Option<&[i64]>,
    batch: usize,
    block_size: usize,
    seq_len: i64,
) -> Option<(Vec<i32>, Vec<i32>)> {
    let n = (anchors.len() / batch.max(1)).max(1);
    if !matches!(block_size, 8 | UNIT) || !(n * block_size).is_multiple_of(UNIT) {
        return None;
    }
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
    /// range at the row's last end (so both ends still ascend); rows whose ranges would not ascend, and blocks that
    /// do not fill warps of 16 query rows, are refused.
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
        assert_eq!(block_ranges(&[5, 30], None, 1, 8, 64).unwrap().1, [5, 30], "two blocks of 8 fill a warp");
        assert_eq!(block_ranges(&[5, 30, 40], None, 1, 8, 64), None, "three blocks of 8 do not");
        assert_eq!(block_ranges(&[5, 30], None, 1, 4, 64), None, "blocks of 4");
    }

    /// NVRTC ships with the torch wheel and compiles without a GPU, so a CPU machine checks the kernels' source with
    /// the argument blocks' header in front, for both head dimensions and both units.
    #[test]
    fn the_kernels_compile() {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        for (head_dim, per) in [(128, 1), (64, 2)] {
            let ptx = ptx("compute_90", head_dim, per, false).unwrap().to_src();
            for entry in ["staircase_fwd", "staircase_dq", "staircase_dkv", "decode_attention", "decode_merge"] {
                assert!(ptx.contains(&format!(".entry {entry}(")), "{entry} missing from the PTX");
            }
            assert!(!ptx.contains("wgmma"), "only DFLASH_WGMMA's build holds Hopper's products");
        }
    }

    /// The training kernels on Hopper's `wgmma`: NVRTC passes inline assembly through unread, so the PTX is assembled
    /// for sm_90a by the `ptxas` the torch wheel ships (`.libtorch/bin`), which checks every instruction's operands
    /// and says where the products would have to wait.
    #[test]
    fn the_wgmma_kernels_assemble_for_hopper() {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let ptxas = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".libtorch/bin/ptxas");
        for (head_dim, per) in [(128, 1), (64, 1), (64, 2)] {
            let ptx = ptx("compute_90a", head_dim, per, true).unwrap().to_src();
            assert!(ptx.contains("wgmma.mma_async"), "d {head_dim}: no warpgroup products in the PTX");
            for entry in ["staircase_fwd_ws", "staircase_dq_ws", "staircase_dkv_ws"] {
                assert!(ptx.contains(&format!(".entry {entry}(")), "d {head_dim}: {entry} missing from the PTX");
            }
            if !ptxas.is_file() {
                eprintln!("{}: not found; the PTX is not assembled", ptxas.display());
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let (source, cubin) = (dir.path().join("staircase.ptx"), dir.path().join("staircase.cubin"));
            std::fs::write(&source, &ptx).unwrap();
            let out = std::process::Command::new(&ptxas)
                .args(["-arch=sm_90a", "-o"])
                .arg(&cubin)
                .arg(&source)
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "d {head_dim}, {per} blocks a unit: ptxas failed: {said}");
            assert!(!said.contains("warning"), "d {head_dim}, {per} blocks a unit: {said}");
            // C7517/C7519: ptxas had to add waits around the products, where registers they read or write are
            // touched by other code while they run: correct, but serialized.
            assert!(!said.contains("(C75"), "d {head_dim}, {per} blocks a unit: the products wait: {said}");
        }
    }

    /// Decoding's kernels (bf16) against attention in f32 with every query head's keys written out: T = 1, 3, 5 and
    /// 16 new queries at the start of a cache, mid-tile and near its end, causal and seeing each other both ways,
    /// sliding windows (masked as `LayerAttention::hides` masks training), capacities of one split and of many, head
    /// dims 64 and 128, groups of 4 and 2 query heads; the start read from the device; and more than 64 folded query
    /// rows of a K/V head are not taken.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_decoding_kernels_match_attention_over_the_cache() {
        let device = crate::device::gpu_for_tests();
        tch::manual_seed(12);
        let cases = [
            (32, 8, 128, 1, 700, 0, true, None),
            (32, 8, 128, 1, 700, 637, true, None),
            (32, 8, 128, 16, 700, 100, true, None),
            (32, 8, 128, 16, 700, 5, true, None),
            (32, 8, 128, 16, 700, 5, false, None),
            (32, 8, 128, 5, 33_000, 32_995, true, None),
            (32, 8, 128, 16, 33_000, 20_001, true, None),
            (32, 8, 128, 16, 33_000, 20_001, false, None),
            (16, 8, 64, 16, 2_000, 1_000, true, None),
            (16, 8, 64, 3, 2_000, 63, true, None),
            // Sliding windows: one inside the block, one of 40 both ways, the recipe's 2048 at 33K.
            (32, 8, 128, 16, 700, 100, false, Some(40)),
            (32, 8, 128, 16, 700, 100, true, Some(9)),
            (32, 8, 128, 16, 33_000, 20_001, true, Some(2048)),
            (16, 8, 64, 3, 2_000, 63, false, Some(70)),
            // The odd sizes the sanitizer asks for (scripts/gpu/sanitize.sh): one head, a window of 1, a cache one
            // past a split and a block one past a tile.
            (1, 1, 64, 1, 65, 64, true, Some(1)),
            (1, 1, 128, 17, 513, 496, false, Some(1)),
        ];
        for (heads, kv_heads, d, t, capacity, start, causal, window) in cases {
            let layer = LayerAttention { window, causal };
            let bf = (Kind::BFloat16, device);
            let q = Tensor::randn([1, t, heads, d], bf).transpose(1, 2); // [1, H, T, D], as the projection lays it out
            let (k, v) = (Tensor::randn([1, kv_heads, capacity, d], bf), Tensor::randn([1, kv_heads, capacity, d], bf));
            let at = Tensor::from_slice(&[start]).to_device(device);
            let out = decode_attention(&q, &k, &v, &at, layer).unwrap().expect("the kernels take it");
            let len = start + t;
            let group = heads / kv_heads;
            let expand =
                |x: &Tensor| x.narrow(2, 0, len).to_kind(Kind::Float).repeat_interleave_self_int(group, 1, None);
            let scores = q.to_kind(Kind::Float).matmul(&expand(&k).transpose(2, 3)) / (d as f64).sqrt();
            let keys = Tensor::arange(len, (Kind::Int64, device)).view([1, len]);
            let queries = Tensor::arange_start(start, len, (Kind::Int64, device)).view([t, 1]);
            // What the layer hides, as training's reference says it.
            let hidden = layer.hides(&queries, &keys).unwrap().unwrap_or_else(|| keys.zeros_like().to_kind(Kind::Bool));
            let scores = scores.masked_fill(&hidden, f64::NEG_INFINITY);
            let expected = scores.softmax(-1, Kind::Float).matmul(&expand(&v));
            let error = (out.to_kind(Kind::Float) - &expected).abs().max().double_value(&[]);
            let largest = expected.abs().max().double_value(&[]);
            assert!(
                error <= 0.008 * largest,
                "H {heads} KV {kv_heads} d {d} T {t} at {start} of {capacity}, causal {causal}: {error}"
            );
        }
        let (q, k) = (
            Tensor::randn([1, 32, 16, 128], (Kind::BFloat16, device)),
            Tensor::randn([1, 2, 64, 128], (Kind::BFloat16, device)),
        );
        let at = Tensor::from_slice(&[10i64]).to_device(device);
        let causal = LayerAttention { window: None, causal: true };
        assert!(decode_attention(&q, &k, &k, &at, causal).unwrap().is_none(), "256 folded rows a K/V head");
    }

    /// The kernels (bf16) against the grouped attention in f32, the CPU's reference run on the GPU: output and the
    /// five gradients, packed rows, padding blocks, grouped-query heads, a causal block, sliding windows (one shorter
    /// than a block), head dims 64 and 128, blocks of 16 and DFlash 2's of 8 (two a warp, one of them a padding
    /// block beside a real one).
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_staircase_kernels_match_the_grouped_attention_and_its_gradients() {
        let device = crate::device::gpu_for_tests();
        tch::manual_seed(11);
        let (batch, seq, n) = (2usize, 300i64, 10usize);
        // The drafter zero-pads the context to whole buckets, as the grouped attention reads it.
        let padded = crate::model::attention::context_bucket(seq);
        // Row 0 plain with three padding blocks; row 1 packed, a second conversation from 150.
        let anchors: Vec<i64> =
            vec![3, 40, 41, 90, 150, 200, 290, 0, 0, 0, 10, 60, 149, 150, 151, 170, 220, 260, 280, 299];
        let starts: Vec<i64> = vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 150, 150, 150, 150, 150, 150, 150];
        let cases = [
            (16, 4, 2, 128, false, None),
            (16, 4, 2, 128, true, None),
            (16, 2, 2, 64, false, None),
            (16, 4, 2, 128, true, Some(40)),
            (16, 4, 2, 128, false, Some(70)),
            (16, 2, 1, 64, false, Some(9)),
            (8, 4, 2, 128, false, None),
            (8, 4, 2, 128, true, None),
            (8, 2, 2, 64, true, Some(5)),
            (8, 4, 2, 128, false, Some(70)),
            // The odd sizes the sanitizer asks for: one head and a window of 1.
            (16, 1, 1, 64, false, Some(1)),
            (8, 1, 1, 128, true, Some(1)),
        ];
        for (bs, heads, kv_heads, d, causal, window) in cases {
            assert!(block_ranges(&anchors, Some(&starts), batch, bs as usize, seq).is_some(), "blocks of {bs}");
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
            // Relative to the reference's largest element, or to 1 (the inputs' scale: randn) where a gradient is
            // zero by construction: a window of 1 leaves each query its own key alone, whose softmax weight is 1
            // whatever q and k hold, so dq and dk are 0 and what both sides have there is their rounding.
            let relative = |a: &Tensor, r: &Tensor| {
                (a - r).abs().max().double_value(&[]) / r.abs().max().double_value(&[]).max(1.0)
            };
            let case = format!("blocks of {bs}, heads {heads}/{kv_heads}, d {d}, causal {causal}, window {window:?}");
            assert!(relative(&out, &reference) < 1e-2, "{case}: output {}", relative(&out, &reference));
            for (name, (g, r)) in
                ["q", "k_ctx", "v_ctx", "k_blk", "v_blk"].iter().zip(grads.iter().zip(&reference_grads))
            {
                assert!(relative(g, r) < 2e-2, "{case}: d{name} {}", relative(g, r));
            }
        }
    }
}
