//! The attention functions the target and the drafter share (and what comes next: packing, DFlash 2, a flash-class
//! kernel): batch-1 attention with grouped query heads over an additive mask, its mask, a draft layer's sliding
//! window and causality, GPT-OSS's attention with sinks, the key/value head expansion, and the bucketing of context
//! lengths.
use tch::{Device, Kind, Tensor};

use super::ModelError;

/// Context lengths seen by attention are multiples of this, so that attention shapes recur (cuDNN plans per shape;
/// see [`super::drafter`]'s module docs).
pub const CONTEXT_BUCKET: i64 = 128;

/// `n` rounded up to a multiple of [`CONTEXT_BUCKET`].
pub fn context_bucket(n: i64) -> i64 {
    (n + CONTEXT_BUCKET - 1) / CONTEXT_BUCKET * CONTEXT_BUCKET
}

/// `[B, kv_heads, L, d]` -> `[B, kv_heads * rep, L, d]`, each key/value head serving `rep` query heads (the
/// memory-efficient attention kernel, which takes a mask, wants them expanded).
pub(crate) fn repeat_kv(t: &Tensor, rep: i64) -> Tensor {
    if rep == 1 {
        return t.shallow_clone();
    }
    let s = t.size();
    t.unsqueeze(2).expand([s[0], s[1], rep, s[2], s[3]], false).reshape([s[0], s[1] * rep, s[2], s[3]])
}

/// Whether [`crate::ffi::attention::sink_flash_attention`] takes `q`: on CUDA in bf16 or f16, unless the fused paths are
/// switched off ([`super::fused::switched_off`]) for comparisons, leaving the masked one below.
pub(super) fn flash_applies(q: &Tensor) -> bool {
    flash_runs_on(q.device(), q.kind())
}

/// [`flash_applies`] for tensors on `device` in `kind`.
pub(super) fn flash_runs_on(device: Device, kind: Kind) -> bool {
    device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half) && !super::fused::switched_off()
}

/// The additive mask of `t` queries laid out for [`masked_attention`] over a target or drafter with `group` query
/// heads per key/value head: `-inf` where `hidden` (`[t, K]`, or `[K]` for every query) is true, 0 elsewhere, in
/// `kind`, as `[1, 1, group * t, K]`, the rows repeated once per query head of a group. Built once per step and
/// shared by its layers.
pub(crate) fn grouped_bias(hidden: &Tensor, t: i64, group: i64, kind: Kind) -> Result<Tensor, ModelError> {
    let keys = hidden.size().last().copied().unwrap_or(0);
    let bias = Tensor::f_zeros([t, keys], (kind, hidden.device()))?.f_masked_fill(hidden, f64::NEG_INFINITY)?;
    Ok(bias.f_repeat([group, 1])?.f_view([1, 1, group * t, keys])?)
}

/// Batch-1 attention of `q [1, H, T, d]` over `k`, `v` `[1, KV, K, d]` with an additive mask from
/// [`grouped_bias`]. The `H / KV` query heads that share a key/value head attend as `H / KV * T` rows of that head,
/// so the keys and values are read as they are, never expanded to every query head (the memory-efficient kernel,
/// the one that takes a mask, has no GQA). On a GPU in bf16 it runs as two batched products around one fused
/// softmax ([`split_attention`]); elsewhere as one masked attention call.
pub(crate) fn masked_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<Tensor, ModelError> {
    let [b, heads, t, d] = q.size()[..] else {
        return Err(ModelError::Batch(format!("attention queries must be [batch, heads, T, d], got {:?}", q.size())));
    };
    let kv_heads = k.size()[1];
    let folded = q.f_reshape([b, kv_heads, heads / kv_heads * t, d])?;
    let rows = match split_attention(&folded, k, v, bias) {
        Some(rows) => rows,
        None => Tensor::f_scaled_dot_product_attention(&folded, k, v, Some(bias), 0.0, false, None, false)?,
    };
    Ok(rows.f_reshape([b, heads, t, d])?)
}

/// `softmax(q kᵀ / √d + bias) v` for one sequence in three kernels: the scores in f32 from one batched product,
/// the fused masked softmax ([`super::fused::masked_softmax`]; probabilities rounded to bf16, as the fused attention
/// kernels round them before the product with v), and the product with v. At batch 1 the memory-efficient kernel
/// runs one block per key/value head and query tile, 8 blocks on a GPU of 132 units: 18 µs a layer at 640 keys and
/// 48 µs at 2,176 (H200), where this takes about 12 and 13. `None` where it does not apply (not one sequence, not
/// CUDA bf16, fused kernels off), for the caller's masked attention call.
fn split_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Option<Tensor> {
    if q.size()[0] != 1 || q.kind() != Kind::BFloat16 || !flash_applies(q) {
        return None;
    }
    let d = *q.size().last()?;
    let scores =
        q.f_select(0, 0).ok()?.f_bmm_dtype(&k.f_select(0, 0).ok()?.f_transpose(1, 2).ok()?, Kind::Float).ok()?;
    let probs = super::fused::masked_softmax(&scores, bias, 1.0 / (d as f64).sqrt())?;
    probs.f_bmm(&v.f_select(0, 0).ok()?).ok()?.f_unsqueeze(0).ok()
}

/// GPT-OSS's attention: causal (within `window` positions, the query's own included, where the layer has one), with
/// one sink logit per head that takes part in the softmax and contributes no value. `q [B, H, T, d]` holds positions
/// `query_positions` (`[B, T]`, or `[1, T]` for every row); `k`, `v` `[B, KV, K, d]` positions `0..K` (the whole
/// sequence, or the cache's bucketed prefix, whose unwritten tail the causal mask hides). The sink is an extra key of zeros (score 0) whose mask entry is
/// the sink, with a zero value; the memory-efficient kernel takes the mask and wants the key/value heads expanded.
pub(super) fn sink_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    window: Option<i64>,
    query_positions: &Tensor,
) -> Result<Tensor, ModelError> {
    let (heads, t, keys) = (q.size()[1], q.size()[2], k.size()[2]);
    let rows = query_positions.size()[0];
    let group = heads / k.size()[1];
    let extend = |x: &Tensor| -> Result<Tensor, ModelError> {
        let x = repeat_kv(x, group);
        let zero = x.f_narrow(2, 0, 1)?.f_zeros_like()?;
        Ok(Tensor::f_cat(&[&x, &zero], 2)?)
    };
    let (k, v) = (extend(k)?, extend(v)?);
    let device = q.device();
    let query_positions = query_positions.f_unsqueeze(2)?;
    let key_positions = Tensor::f_arange(keys, (Kind::Int64, device))?.view([1, 1, keys]);
    let mut visible = key_positions.f_le_tensor(&query_positions)?;
    if let Some(w) = window {
        visible = visible.f_logical_and(&(&query_positions - &key_positions).f_lt(w)?)?;
    }
    let mask = Tensor::f_zeros([rows, t, keys], (q.kind(), device))?
        .f_masked_fill(&visible.logical_not(), f64::NEG_INFINITY)?;
    let sink = sinks.to_kind(q.kind()).view([1, heads, 1, 1]).expand([rows, heads, t, 1], false);
    let mask = Tensor::f_cat(&[&mask.view([rows, 1, t, keys]).expand([rows, heads, t, keys], false), &sink], 3)?;
    Ok(Tensor::f_scaled_dot_product_attention(q, &k, &v, Some(&mask), 0.0, false, None, false)?)
}

/// How one draft layer restricts DFlash's rule (a block's queries see the context before its anchor and their own
/// block), as vLLM and SGLang run draft layers: a sliding window of `window` positions counted back from each query,
/// the query's own position included (flash attention's left window `window - 1`; non-causal layers look as far
/// ahead), and causality inside the block. The default, full attention and a bidirectional block, is the paper's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerAttention {
    pub window: Option<i64>,
    pub causal: bool,
}

impl std::fmt::Display for LayerAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.window {
            Some(w) => write!(f, "a window of {w}")?,
            None => write!(f, "full attention")?,
        }
        write!(f, ", {}", if self.causal { "causal" } else { "bidirectional block" })
    }
}

impl LayerAttention {
    /// Whether this layer restricts the rule at all.
    pub fn restricts(&self) -> bool {
        self.window.is_some() || self.causal
    }

    /// Where this layer hides a key at absolute position `key_at` from a query at `query_at` (tensors of int64
    /// positions that broadcast to the result's shape); `None` when it hides nothing.
    pub fn hides(&self, query_at: &Tensor, key_at: &Tensor) -> Result<Option<Tensor>, ModelError> {
        let ahead = key_at.f_sub(query_at)?;
        let mut hidden: Option<Tensor> = None;
        let mut add = |h: Tensor| -> Result<(), ModelError> {
            hidden = Some(match hidden.take() {
                Some(prev) => prev.f_logical_or(&h)?,
                None => h,
            });
            Ok(())
        };
        if self.causal {
            add(ahead.f_gt(0)?)?;
        }
        if let Some(w) = self.window {
            add(ahead.f_le(-w)?)?;
            if !self.causal {
                add(ahead.f_ge(w)?)?;
            }
        }
        Ok(hidden)
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// A draft layer hides what vLLM's flash attention hides (`flash_attn.py`: a sliding window `w` is the window
    /// `(w - 1, 0)`, made `(w - 1, w - 1)` for a non-causal layer by `_maybe_symmetrize_window`) and SGLang's
    /// (`window_left = sliding_window - 1`, causal in sliding layers): a query at position q sees a key at k iff
    /// `q - k <= w - 1`, and `k <= q` (causal) or `k - q <= w - 1` (not); a full layer, every key (causal: `k <= q`).
    #[test]
    fn a_layer_hides_what_the_engines_windows_hide() {
        let positions = Tensor::arange(12, (Kind::Int64, Device::Cpu));
        let (queries, keys) = (positions.view([12, 1]), positions.view([1, 12]));
        for window in [None, Some(1), Some(3), Some(16)] {
            for causal in [false, true] {
                let layer = LayerAttention { window, causal };
                let hidden = layer.hides(&queries, &keys).unwrap();
                assert_eq!(hidden.is_none(), !layer.restricts(), "{layer:?}");
                for (q, k) in (0..12i64).flat_map(|q| (0..12i64).map(move |k| (q, k))) {
                    let (left, right) = match (window, causal) {
                        (Some(w), true) => (w - 1, 0),
                        (Some(w), false) => (w - 1, w - 1),
                        (None, true) => (i64::MAX, 0),
                        (None, false) => (i64::MAX, i64::MAX),
                    };
                    let engines_hide = q - k > left || k - q > right;
                    let ours = hidden.as_ref().is_some_and(|h| h.int64_value(&[q, k]) != 0);
                    assert_eq!(ours, engines_hide, "{layer:?}: query at {q}, key at {k}");
                }
            }
        }
    }

    /// Batch-1 attention with the query heads folded onto their key/value head equals attention with the keys and
    /// values expanded to every query head, written out in f64: on the CPU (the masked attention call) and on a GPU
    /// in bf16 (the split products around the fused softmax, within the bf16 rounding of q, k, v and the output),
    /// for one query and for a block, over keys partly masked.
    #[test]
    fn folded_batch_one_attention_equals_expanded_attention() {
        let mut devices = vec![(Device::Cpu, Kind::Float, 1e-5)];
        if tch::Cuda::is_available() {
            crate::device::bind_thread(Device::Cuda(0)).unwrap();
            devices.push((Device::Cuda(0), Kind::BFloat16, 5e-2));
        }
        let (heads, kv_heads, d, keys) = (8, 2, 64, 384);
        for (device, kind, tolerance) in devices {
            for t in [1i64, 16] {
                tch::manual_seed(t);
                let q = Tensor::randn([1, heads, t, d], (Kind::Double, device)) * 2.0;
                let k = Tensor::randn([1, kv_heads, keys, d], (Kind::Double, device));
                let v = Tensor::randn([1, kv_heads, keys, d], (Kind::Double, device));
                // Query i sees keys up to 300 + i: the rows past them hold garbage that must weigh nothing.
                let visible = Tensor::arange(keys, (Kind::Int64, device))
                    .unsqueeze(0)
                    .le_tensor(&Tensor::arange_start(300, 300 + t, (Kind::Int64, device)).unsqueeze(1));
                let k = k.masked_fill(&visible.logical_not().all_dim(0, false).view([1, 1, keys, 1]), 1e4);
                let bias = Tensor::zeros([t, keys], (Kind::Double, device))
                    .masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
                let scores = q.matmul(&repeat_kv(&k, heads / kv_heads).transpose(-1, -2)) / (d as f64).sqrt() + &bias;
                let expected = scores.softmax(-1, Kind::Double).matmul(&repeat_kv(&v, heads / kv_heads));
                let [q, k, v] = [&q, &k, &v].map(|x| x.to_kind(kind));
                let mask = grouped_bias(&visible.logical_not(), t, heads / kv_heads, kind).unwrap();
                let got = masked_attention(&q, &k, &v, &mask).unwrap();
                let err = (got.to_kind(Kind::Double) - &expected).abs().max().double_value(&[]);
                assert!(err < tolerance, "{device:?} {kind:?}, {t} queries: off by {err}");
            }
        }
    }

    /// The flash path (bf16, window and sink folded in through the log-sum-exp) against the masked path in f32, on
    /// random inputs with grouped-query heads: the same attention within bf16 rounding.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_sink_flash_attention_matches_the_masked_path() {
        let dev = crate::device::gpu_for_tests();
        tch::manual_seed(5);
        let (b, t, heads, kv, d) = (2, 300, 8, 2, 64);
        let q = Tensor::randn([b, heads, t, d], (Kind::Float, dev));
        let k = Tensor::randn([b, kv, t, d], (Kind::Float, dev));
        let v = Tensor::randn([b, kv, t, d], (Kind::Float, dev));
        let sinks = Tensor::randn([heads], (Kind::Float, dev)) * 2.0;
        for window in [None, Some(128), Some(3)] {
            let positions = Tensor::arange(t, (Kind::Int64, dev)).unsqueeze(0);
            let want = sink_attention(&q, &k, &v, &sinks, window, &positions).unwrap();
            let bf = |x: &Tensor| x.to_kind(Kind::BFloat16).transpose(1, 2);
            let got = crate::ffi::attention::sink_flash_attention(&bf(&q), &bf(&k), &bf(&v), &sinks, window).unwrap();
            let got = got.transpose(1, 2).to_kind(Kind::Float);
            let err = (&got - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(err < 2e-2, "window {window:?}: relative error {err}");
        }
    }
}
