//! `csrc/attention.cpp`: libtorch's flash-attention kernel where its Python-facing functions do not reach it: with
//! GPT-OSS's sinks and sliding windows, and over packed rows' variable-length sequences; `csrc/staircase.cpp`:
//! DFlash's training attention on kernels of its own, as one autograd node.
use super::DeviceFailure;
use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;
use torch_sys::C_tensor;

use super::accel::tensor_on_device;
use super::raw;

unsafe extern "C" {
    fn dflash_sink_flash_attention(
        q: *mut C_tensor,
        k: *mut C_tensor,
        v: *mut C_tensor,
        sinks: *mut C_tensor,
        window: i64,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
    #[allow(clippy::too_many_arguments)]
    fn dflash_staircase_attention(
        q: *mut C_tensor,
        k_ctx: *mut C_tensor,
        v_ctx: *mut C_tensor,
        k_blk: *mut C_tensor,
        v_blk: *mut C_tensor,
        lo: *mut C_tensor,
        hi: *mut C_tensor,
        causal: c_int,
        window: i64,
        scale: f64,
        launcher: StaircaseLaunch,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
    fn dflash_varlen_flash_attention(
        q: *mut C_tensor,
        k: *mut C_tensor,
        v: *mut C_tensor,
        cu_seqlens: *mut C_tensor,
        longest: i64,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
}

/// GPT-OSS's causal attention with one sink logit per head (`sinks [H]`) through libtorch's flash-attention kernel
/// (CUDA, bf16/f16): `q [B, T, H, d]`, `k` and `v` `[B, T, KV, d]` (last dimension contiguous); with `window`, each
/// query sees itself and the `window - 1` positions before it. Returns `[B, T, H, d]`.
pub fn sink_flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    window: Option<i64>,
) -> Result<Tensor, DeviceFailure> {
    let window = window.unwrap_or(0);
    // SAFETY: live tensor handles; the shim returns a new tensor or null.
    tensor_on_device(q.device(), |e, n| unsafe {
        dflash_sink_flash_attention(raw(q), raw(k), raw(v), raw(sinks), window, e, n)
    })
}

/// Causal attention within each of the sequences laid one after the other in `q [N, H, d]`, `k` and `v`
/// `[N, KV, d]` (CUDA, bf16/f16; grouped-query heads as they are): sequence `i` holds positions `cu_seqlens[i]` up to
/// `cu_seqlens[i + 1]` (int32 on `q`'s device, from 0 to N), the longest `longest` tokens; no position sees another
/// sequence's. Returns `[N, H, d]`.
pub fn varlen_flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    longest: i64,
) -> Result<Tensor, DeviceFailure> {
    // SAFETY: live tensor handles; the shim returns a new tensor or null.
    tensor_on_device(q.device(), |e, n| unsafe {
        dflash_varlen_flash_attention(raw(q), raw(k), raw(v), raw(cu_seqlens), longest, e, n)
    })
}

/// What launches the staircase kernels for `csrc/staircase.cpp`: (kernel, device, head dim, batch, stream, argument
/// block, output pointers, error buffer and its length) -> 0, or 1 with the message written.
pub type StaircaseLaunch = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    *mut c_void,
    *const c_void,
    *const *mut c_void,
    *mut c_char,
    usize,
) -> c_int;

/// What [`staircase_attention`] attends to: block `n` of a row sees context keys `[lo, hi)` of that row (`[B, N]`
/// int32 on the queries' device, each ascending along a row; `hi` is the anchor), and its own block's keys, all or
/// (`causal`) those at or before each query's slot; with a `window` (`0`: none), only keys fewer than that many
/// positions from the query.
pub struct StaircaseRanges<'a> {
    pub lo: &'a Tensor,
    pub hi: &'a Tensor,
    pub causal: bool,
    pub window: i64,
}

/// DFlash's training attention as one autograd node (`csrc/staircase.cpp`): queries `q [B, H, bs N, D]` (blocks of
/// bs = 16, or 8 with N even) over context keys and values `[B, KV, S, D]` and block keys and values
/// `[B, KV, bs N, D]` (bf16, one GPU, last dimensions contiguous), scaled by `scale`. `launcher` launches the kernels
/// (`model::staircase`'s, passed as a C function so that this layer names nothing above it). Returns
/// `[B, H, bs N, D]`.
#[allow(clippy::too_many_arguments)]
pub fn staircase_attention(
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    k_blk: &Tensor,
    v_blk: &Tensor,
    ranges: &StaircaseRanges,
    scale: f64,
    launcher: StaircaseLaunch,
) -> Result<Tensor, DeviceFailure> {
    let causal = c_int::from(ranges.causal);
    // SAFETY: live tensor handles and the launcher the shim calls back with its own argument block; the shim
    // returns a new tensor or null.
    tensor_on_device(q.device(), |e, n| unsafe {
        let (lo, hi) = (raw(ranges.lo), raw(ranges.hi));
        dflash_staircase_attention(
            raw(q),
            raw(k_ctx),
            raw(v_ctx),
            raw(k_blk),
            raw(v_blk),
            lo,
            hi,
            causal,
            ranges.window,
            scale,
            launcher,
            e,
            n,
        )
    })
}
