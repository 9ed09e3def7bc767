//! One decoder layer of the target (attention and its MLP, dense or sparse) and how its attention finds its keys:
//! the whole sequence, a KV cache, or packed rows kept to their own conversations.

use tch::{Device, Kind, Tensor};

use crate::model::ModelError;
use crate::model::attention::{
    LayerAttention, context_bucket, flash_applies, masked_attention, repeat_kv, sink_attention,
};
use crate::model::config::TargetConfig;
use crate::model::kv_cache::KvCache;
use crate::model::layers::swiglu_activation;
use crate::model::moe::SparseMlp;
use crate::model::staircase::decode_attention;

/// One pre-norm decoder layer; q/k/v and gate/up are stacked so each is one matrix product.
pub(super) struct DecoderLayer {
    pub(super) input_layernorm: Tensor,
    pub(super) post_attention_layernorm: Tensor,
    /// `[(heads + 2 * kv_heads) * head_dim, hidden]`
    pub(super) qkv_proj: Tensor,
    pub(super) o_proj: Tensor,
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    /// GPT-OSS: `[(heads + 2 * kv_heads) * head_dim]` and `[hidden]`.
    pub(super) qkv_bias: Option<Tensor>,
    pub(super) o_bias: Option<Tensor>,
    /// GPT-OSS: one attention-sink logit per head, `[heads]`, and the sliding window of this layer.
    pub(super) sinks: Option<Tensor>,
    pub(super) window: Option<i64>,
    pub(super) mlp: Mlp,
    /// Where this layer's weights live (the first device unless the target is spread), and which of the devices
    /// given (its part of the split: CPU stand-ins for several devices are one `Device` but distinct parts).
    pub(super) device: Device,
    pub(super) part: usize,
}

pub(super) enum Mlp {
    Dense {
        /// `[2 * intermediate, hidden]`
        gate_up_proj: Tensor,
        down_proj: Tensor,
    },
    Sparse(SparseMlp),
}

/// How a layer's attention finds its keys.
pub(super) enum Keys<'a> {
    /// The input is the whole sequence: causal attention over it.
    Causal,
    /// The input continues a cached sequence: keys are the cache plus the new ones (written to `layer`'s slot) at
    /// `positions` (`[T]`, on the device); `bias` is the causal mask over the bucketed cache after a prefill
    /// ([`grouped_bias`]), `None` for the prefill itself.
    Cached { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, bias: Option<&'a Tensor> },
    /// As `Cached`, with the new positions a device tensor: written by index, attention over the cache's whole
    /// capacity with `bias` ([`grouped_bias`]) masking what is not held (a CUDA graph's step).
    Indexed { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, bias: &'a Tensor },
    /// New sequences (right-padded rows), attended as `Causal`; their keys and values are also written to the cache
    /// rows `rows` from position 0 (batched generation's prefill, [`Target::prefill_rows`]).
    Fill { cache: &'a mut KvCache, layer: usize, rows: &'a Tensor },
    /// One new token per cache row at that row's own position (`positions [B]`), written there; attention over each
    /// row's first `len` positions, `bias` hiding those the row does not hold (batched generation's step,
    /// [`Target::step_rows`]).
    Rows { cache: &'a mut KvCache, layer: usize, positions: &'a Tensor, len: i64, bias: &'a Tensor },
    /// The input is whole rows of several conversations each (packed): attention causal within each conversation
    /// and nothing across, as `mask` says ([`Target::capture_packed`]).
    Packed { mask: &'a PackedMask },
}

/// How the tokens of packed rows are kept to their own conversation ([`Keys::Packed`]).
pub(super) enum PackedMask {
    /// An additive bias `[B, 1, S, S]`: 0 where a token sees a key, -inf elsewhere (any device and dtype; every key
    /// of the row computed, then masked).
    Bias(Tensor),
    /// The rows' conversations (and each row's padding) as the variable-length sequences of libtorch's flash
    /// attention (CUDA, bf16/f16), which computes no key outside a query's own sequence: their cumulative lengths over
    /// the rows laid end to end, `[n + 1]` int32, and the longest.
    Segments { cu_seqlens: Tensor, longest: i64 },
}

impl PackedMask {
    pub(super) fn to_device(&self, device: Device) -> Result<PackedMask, ModelError> {
        Ok(match self {
            PackedMask::Bias(bias) => PackedMask::Bias(bias.f_to_device(device)?),
            PackedMask::Segments { cu_seqlens, longest } => {
                PackedMask::Segments { cu_seqlens: cu_seqlens.f_to_device(device)?, longest: *longest }
            }
        })
    }
}

/// Where the tokens of a pass go, beside the whole-sequence pass that has no cache.
pub(super) enum Placement<'a> {
    /// After the cached sequence (from the cache's length).
    Append,
    /// From a device scalar ([`Keys::Indexed`]).
    At(&'a Tensor),
    /// New sequences into these cache rows ([`Keys::Fill`]).
    Fill(&'a Tensor),
    /// One token per cache row at these positions, attention over `len` positions ([`Keys::Rows`]).
    Rows { positions: &'a Tensor, len: i64 },
    /// Packed rows without a cache: each token at `positions [B, S]` (its place in its conversation), attention as
    /// `mask` says ([`Keys::Packed`]).
    Packed { positions: &'a Tensor, mask: &'a PackedMask },
}

/// A source of named HF tensors (`model.layers.3.self_attn.q_proj.weight`, ...), each on the device it is asked for.
pub(super) type Fetch<'a> = dyn FnMut(&str) -> Result<Tensor, ModelError> + 'a;

impl DecoderLayer {
    /// Layer `l` of `cfg` from the tensors `get` returns, on `device` (part `part` of a spread target).
    pub(super) fn build(
        cfg: &TargetConfig,
        l: usize,
        device: Device,
        part: usize,
        get: &mut Fetch,
    ) -> Result<Self, ModelError> {
        let mut get = |suffix: &str| get(&format!("model.layers.{l}.{suffix}"));
        let qkv_proj = Tensor::f_cat(
            &[get("self_attn.q_proj.weight")?, get("self_attn.k_proj.weight")?, get("self_attn.v_proj.weight")?],
            0,
        )?;
        let mlp = Mlp::build(cfg, l, &mut get)?;
        let (q_norm, k_norm) = match cfg.architecture.has_qk_norm() {
            true => (Some(get("self_attn.q_norm.weight")?), Some(get("self_attn.k_norm.weight")?)),
            false => (None, None),
        };
        let (qkv_bias, o_bias, sinks, window) = match &cfg.gpt_oss {
            Some(oss) => (
                Some(Tensor::f_cat(
                    &[get("self_attn.q_proj.bias")?, get("self_attn.k_proj.bias")?, get("self_attn.v_proj.bias")?],
                    0,
                )?),
                Some(get("self_attn.o_proj.bias")?),
                Some(get("self_attn.sinks")?),
                oss.sliding_layers[l].then_some(oss.sliding_window as i64),
            ),
            None => (None, None, None, None),
        };
        Ok(DecoderLayer {
            input_layernorm: get("input_layernorm.weight")?,
            post_attention_layernorm: get("post_attention_layernorm.weight")?,
            qkv_proj,
            o_proj: get("self_attn.o_proj.weight")?,
            q_norm,
            k_norm,
            qkv_bias,
            o_bias,
            sinks,
            window,
            mlp,
            device,
            part,
        })
    }
}

impl Mlp {
    /// Layer `l`'s MLP: dense, Qwen3-MoE's experts or GPT-OSS's; `get` takes names within the layer.
    pub(super) fn build(cfg: &TargetConfig, l: usize, get: &mut Fetch) -> Result<Self, ModelError> {
        let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_sparse(l)) else {
            return Ok(Mlp::Dense {
                gate_up_proj: Tensor::f_cat(&[get("mlp.gate_proj.weight")?, get("mlp.up_proj.weight")?], 0)?,
                down_proj: get("mlp.down_proj.weight")?,
            });
        };
        if let Some(oss) = &cfg.gpt_oss {
            let mut pair =
                |name: &str, bias: &str| -> Result<(Tensor, Tensor), ModelError> { Ok((get(name)?, get(bias)?)) };
            return Ok(Mlp::Sparse(SparseMlp::gpt_oss(
                pair("mlp.router.weight", "mlp.router.bias")?,
                pair("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias")?,
                pair("mlp.experts.down_proj", "mlp.experts.down_proj_bias")?,
                moe.num_experts_per_tok,
                oss.swiglu_alpha,
                oss.swiglu_limit,
            )));
        }
        let mut gate_up = Vec::with_capacity(moe.num_experts);
        let mut down = Vec::with_capacity(moe.num_experts);
        for e in 0..moe.num_experts {
            let mut expert = |suffix: &str| get(&format!("mlp.experts.{e}.{suffix}"));
            gate_up.push(Tensor::f_cat(&[expert("gate_proj.weight")?, expert("up_proj.weight")?], 0)?);
            down.push(expert("down_proj.weight")?);
        }
        Ok(Mlp::Sparse(SparseMlp::qwen3(
            get("mlp.gate.weight")?,
            Tensor::f_stack(&gate_up, 0)?,
            Tensor::f_stack(&down, 0)?,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
        )))
    }

    /// Adds this MLP's output for the normed rows `h` (`[N, H]`) to the residual rows `x` in place; a sparse MLP
    /// appends its chosen experts to `routes`.
    pub(super) fn add_to(&self, x: &Tensor, h: &Tensor, routes: Option<&mut Vec<Tensor>>) -> Result<(), ModelError> {
        match self {
            Mlp::Dense { gate_up_proj, down_proj } => {
                let act = swiglu_activation(&h.linear(gate_up_proj, None::<Tensor>));
                let _ = x.shallow_clone().f_addmm_(&act, &down_proj.tr())?;
            }
            Mlp::Sparse(sparse) => {
                if let Some(routes) = routes {
                    routes.push(sparse.route(h)?.0);
                }
                sparse.add_to(x, h)?;
            }
        }
        Ok(())
    }
}

/// The positions `[B, S]` and the mask of packed rows ([`Target::capture_packed`]): each conversation's positions
/// from 0, each token seeing its own conversation's tokens up to itself; the padding after a row's conversations is
/// one more (ignored) conversation, so that no query sees nothing. With `segments`, the mask is the sequences of
/// flash attention over the rows laid end to end; else a bias over each row.
pub(super) fn packed_attention(
    rows: &[Vec<i64>],
    s: i64,
    segments: bool,
    kind: Kind,
    device: Device,
) -> Result<(Tensor, PackedMask), ModelError> {
    let (mut positions, mut segment_of, mut cumulative) =
        (Vec::with_capacity(rows.len() * s as usize), vec![], vec![0]);
    for row in rows {
        let start = positions.len();
        for (segment, &len) in row.iter().enumerate() {
            positions.extend(0..len);
            segment_of.extend(std::iter::repeat_n(segment as i64, len as usize));
            cumulative.push(positions.len() as i32);
        }
        let used = (positions.len() - start) as i64;
        positions.extend(0..s - used);
        segment_of.extend(std::iter::repeat_n(row.len() as i64, (s - used) as usize));
        if used < s {
            cumulative.push(positions.len() as i32);
        }
    }
    let b = rows.len() as i64;
    let positions = Tensor::f_from_slice(&positions)?.f_view([b, s])?.f_to(device)?;
    if segments {
        let longest = cumulative.windows(2).map(|w| (w[1] - w[0]) as i64).max().unwrap_or(0);
        let cu_seqlens = Tensor::f_from_slice(&cumulative)?.f_to(device)?;
        return Ok((positions, PackedMask::Segments { cu_seqlens, longest }));
    }
    let segments = Tensor::f_from_slice(&segment_of)?.f_view([b, s])?.f_to(device)?;
    let same = segments.f_unsqueeze(2)?.f_eq_tensor(&segments.f_unsqueeze(1)?)?;
    let index = Tensor::f_arange(s, (Kind::Int64, device))?;
    let causal = index.f_unsqueeze(0)?.f_le_tensor(&index.f_unsqueeze(1)?)?;
    let visible = same.f_logical_and(&causal.f_unsqueeze(0)?)?;
    let bias =
        Tensor::f_zeros([b, s, s], (kind, device))?.f_masked_fill(&visible.f_logical_not()?, f64::NEG_INFINITY)?;
    Ok((positions, PackedMask::Bias(bias.f_unsqueeze(1)?)))
}

/// The target's attention as the decoding kernels take it: causal, no window.
pub(super) const CAUSAL: LayerAttention = LayerAttention { window: None, causal: true };

/// One layer's attention of the queries `q` (`[B, heads, S, d]`) over the new keys and values `k`, `v` and, as
/// `keys` says, the cached ones (which get the new ones written): `[B, heads, S, d]`.
pub(super) fn attention(
    layer: &DecoderLayer,
    q: &Tensor,
    k: Tensor,
    v: Tensor,
    keys: Keys<'_>,
) -> Result<Tensor, ModelError> {
    let s = q.size()[2];
    let gqa = k.size()[1] != q.size()[1];
    Ok(match (keys, &layer.sinks) {
        // The whole sequence on a GPU in bf16: flash attention with the window, the sink folded in after.
        (Keys::Causal, Some(sinks)) if flash_applies(q) => crate::ffi::attention::sink_flash_attention(
            &q.transpose(1, 2),
            &k.transpose(1, 2),
            &v.transpose(1, 2),
            sinks,
            layer.window,
        )?
        .transpose(1, 2),
        (keys, Some(sinks)) => {
            let positions = |start: i64| -> Result<Tensor, ModelError> {
                Ok(Tensor::f_arange_start(start, start + s, (Kind::Int64, q.device()))?.f_unsqueeze(0)?)
            };
            let (k, v, positions) = match keys {
                Keys::Causal => (k, v, positions(0)?),
                Keys::Cached { cache, layer: index, .. } => {
                    let start = cache.len();
                    let _written = cache.write(index, &k, &v)?;
                    let (k, v) = cache.prefix(index, context_bucket(start + s))?;
                    (k, v, positions(start)?)
                }
                Keys::Rows { cache, layer: index, positions, len, .. } => {
                    let (k, v) = cache.write_rows(index, positions, &k, &v, len)?;
                    (k, v, positions.f_unsqueeze(1)?)
                }
                Keys::Indexed { .. } | Keys::Fill { .. } => {
                    return Err(ModelError::Batch("attention sinks at a device position".into()));
                }
                Keys::Packed { .. } => {
                    return Err(ModelError::Batch("packed rows need a target without attention sinks".into()));
                }
            };
            sink_attention(q, &k, &v, sinks, layer.window, &positions)?
        }
        // (A prefill into rows was written above and attends as the whole sequence.)
        (Keys::Causal | Keys::Fill { .. }, None) => {
            Tensor::f_scaled_dot_product_attention(q, &k, &v, None::<Tensor>, 0.0, true, None, gqa)?
        }
        (Keys::Packed { mask: PackedMask::Bias(bias) }, None) => {
            // Every query head's keys written out: the masked kernels take no grouped heads.
            let rep = q.size()[1] / k.size()[1];
            let (k, v) = (repeat_kv(&k, rep), repeat_kv(&v, rep));
            Tensor::f_scaled_dot_product_attention(q, &k, &v, Some(bias), 0.0, false, None, false)?
        }
        (Keys::Packed { mask: PackedMask::Segments { cu_seqlens, longest } }, None) => {
            // [B, heads, S, d] -> the rows end to end, [B * S, heads, d], and back.
            let (b, heads, d) = (q.size()[0], q.size()[1], q.size()[3]);
            let flat = |t: &Tensor| -> Result<Tensor, ModelError> {
                Ok(t.f_transpose(1, 2)?.f_reshape([b * s, t.size()[1], d])?)
            };
            let out =
                crate::ffi::attention::varlen_flash_attention(&flat(q)?, &flat(&k)?, &flat(&v)?, cu_seqlens, *longest)?;
            out.f_view([b, s, heads, d])?.f_transpose(1, 2)?
        }
        (Keys::Indexed { cache, layer: index, positions, bias }, None) => {
            let (k, v) = cache.write_at(index, positions, &k, &v)?;
            match decode_attention(q, &k, &v, positions, CAUSAL)? {
                Some(out) => out,
                None => masked_attention(q, &k, &v, bias)?,
            }
        }
        (Keys::Rows { cache, layer: index, positions, len, bias }, None) => {
            let (k, v) = cache.write_rows(index, positions, &k, &v, len)?;
            masked_attention(q, &k, &v, bias)?
        }
        (Keys::Cached { cache, layer: index, positions, bias }, None) => {
            let (held_k, held_v) = cache.write(index, &k, &v)?;
            match bias {
                // After the prefill: the decoding kernels over what is held, else the bucketed cache, masked.
                Some(bias) => match decode_attention(q, &held_k, &held_v, positions, CAUSAL)? {
                    Some(out) => out,
                    None => {
                        let (k, v) = cache.prefix(index, bias.size()[3])?;
                        masked_attention(q, &k, &v, bias)?
                    }
                },
                // The prefill: causal over the prompt.
                None => Tensor::f_scaled_dot_product_attention(q, &k, &v, None::<Tensor>, 0.0, true, None, gqa)?,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed rows for flash attention: each conversation a sequence, and each row's padding one more, over the rows
    /// laid end to end; every position at its place in its own conversation.
    #[test]
    pub(super) fn packed_rows_for_flash_attention_are_their_conversations_and_padding() {
        let (positions, mask) =
            packed_attention(&[vec![9, 1, 14], vec![6]], 24, true, Kind::Float, Device::Cpu).unwrap();
        let PackedMask::Segments { cu_seqlens, longest } = mask else { panic!("segments asked for") };
        assert_eq!(Vec::<i32>::try_from(&cu_seqlens).unwrap(), [0, 9, 10, 24, 30, 48]);
        assert_eq!(longest, 18);
        let row = |r: i64| Vec::<i64>::try_from(&positions.get(r)).unwrap();
        assert_eq!(row(0), [(0..9).collect::<Vec<i64>>(), vec![0], (0..14).collect()].concat());
        assert_eq!(row(1), [(0..6).collect::<Vec<i64>>(), (0..18).collect()].concat());
        // A full row adds no padding sequence.
        let (_, mask) = packed_attention(&[vec![10, 14]], 24, true, Kind::Float, Device::Cpu).unwrap();
        let PackedMask::Segments { cu_seqlens, longest } = mask else { panic!("segments asked for") };
        assert_eq!((Vec::<i32>::try_from(&cu_seqlens).unwrap(), longest), (vec![0, 10, 24], 14));
    }
}
