//! `csrc/attention.cpp`: libtorch's flash-attention kernel where its Python-facing functions do not reach it: with
//! GPT-OSS's sinks and sliding windows, and over packed rows' variable-length sequences.
use super::DeviceFailure;
use std::ffi::c_char;

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
