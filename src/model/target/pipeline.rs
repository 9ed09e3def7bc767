//! The pass through the stack: embedding, then the layers in order, each on its part's device, micro-batches in
//! flight across the parts of a spread target, with fault injection where the hidden state enters a part.

use tch::{Kind, Tensor};

use super::Target;
use super::layers::{DecoderLayer, Keys, Placement, attention};
use crate::model::ModelError;
use crate::model::attention::{context_bucket, grouped_bias};
use crate::model::kv_cache::KvCache;
use crate::model::layers::{norm_rope, rms_norm};
use crate::profile::span;

impl Target {
    /// Embeds and runs layers `0..count`, calling `observe(layer, output)` after each; returns the last output, on
    /// the last layer's device. The next layer updates `output` in place: copy what you keep.
    /// With a cache, the tokens continue the cached sequence (positions from its length on) and every layer's new
    /// keys and values are written to it. With `routes`, each sparse layer appends its chosen experts.
    pub(super) fn run_layers(
        &self,
        input_ids: &Tensor,
        count: usize,
        cache: Option<&mut KvCache>,
        routes: Option<&mut Vec<Tensor>>,
        observe: impl FnMut(usize, &Tensor),
    ) -> Result<Tensor, ModelError> {
        self.run_layers_at(input_ids, count, cache, Placement::Append, routes, observe)
    }

    /// [`Target::run_layers`] with the tokens placed as `placement` says (with a cache; `Append` without one is the
    /// whole-sequence pass). Only `Append` moves the cache's length on: the other placements leave it to the caller.
    pub(super) fn run_layers_at(
        &self,
        input_ids: &Tensor,
        count: usize,
        mut cache: Option<&mut KvCache>,
        placement: Placement<'_>,
        mut routes: Option<&mut Vec<Tensor>>,
        mut observe: impl FnMut(usize, &Tensor),
    ) -> Result<Tensor, ModelError> {
        let s = input_ids.size()[1];
        let start = match (&cache, &placement) {
            (Some(c), Placement::Append) => c.len(),
            _ => 0,
        };
        let device = self.device;
        // The new positions (`[S]`, or `[B, 1]` for one token per row at its own position), and the mask of the
        // steps that read cached keys.
        let (positions, mut bias) = match (&cache, &placement) {
            (Some(c), Placement::At(at)) => {
                let positions = Tensor::f_arange(s, (Kind::Int64, device))?.f_add(at)?;
                let keys = Tensor::f_arange(c.capacity(), (Kind::Int64, device))?.unsqueeze(0);
                let hidden = keys.f_gt_tensor(&positions.unsqueeze(1))?;
                let bias = grouped_bias(&hidden, s, self.query_group(), self.kind)?;
                (positions, Some(bias))
            }
            (Some(_), Placement::Rows { positions, len }) => {
                let positions = positions.f_unsqueeze(1)?;
                let hidden = Tensor::f_arange(*len, (Kind::Int64, device))?.unsqueeze(0).f_gt_tensor(&positions)?;
                let rows = hidden.size()[0];
                let bias = Tensor::f_zeros([rows, *len], (self.kind, device))?
                    .f_masked_fill(&hidden, f64::NEG_INFINITY)?
                    .f_view([rows, 1, 1, *len])?
                    .f_expand([rows, 1, self.query_group(), *len], false)?
                    .f_contiguous()?;
                (positions, Some(bias))
            }
            // A verify step (several new tokens after cached ones) needs an explicit causal mask over [cache ; new].
            // After a prefill, attention reads the cache in whole buckets with a causal mask over them, so its shape
            // recurs from step to step (cuDNN plans an attention per shape, which costs far more than the attention
            // itself at batch 1).
            (Some(_), Placement::Append) if start > 0 => {
                let positions = Tensor::f_arange_start(start, start + s, (Kind::Int64, device))?;
                let keys = Tensor::f_arange(context_bucket(start + s), (Kind::Int64, device))?.unsqueeze(0);
                let hidden = keys.f_gt_tensor(&positions.unsqueeze(1))?;
                let bias = grouped_bias(&hidden, s, self.query_group(), self.kind)?;
                (positions, Some(bias))
            }
            (None, Placement::Packed { positions, .. }) => (positions.shallow_clone(), None),
            _ => (Tensor::f_arange_start(start, start + s, (Kind::Int64, device))?, None),
        };
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        // -> [1 or B, S, 1, d]: broadcast over batch and heads in the [B, S, heads, d] layout.
        let unsqueeze = |t: Tensor| if t.dim() == 2 { t.unsqueeze(0).unsqueeze(2) } else { t.unsqueeze(2) };
        let (mut cos, mut sin) = (unsqueeze(cos), unsqueeze(sin));
        // Where rows are written: the rows of new sequences, or the positions of each row's token.
        let mut row_index = match &placement {
            Placement::Fill(rows) => Some(rows.shallow_clone()),
            Placement::Rows { positions, .. } => Some(positions.shallow_clone()),
            _ => None,
        };
        // Packed rows' mask, following the layers from device to device.
        let mut packed_mask = match &placement {
            Placement::Packed { mask, .. } => Some(mask.to_device(device)?),
            _ => None,
        };
        let mut x = {
            let _p = span("target.embed");
            self.embed(input_ids)
        };
        // On a spread target the hidden state and the per-step factors follow the layers from device to device.
        let mut part = None;
        for (i, layer) in self.layers[..count].iter().enumerate() {
            if part != Some(layer.part) {
                part = Some(layer.part);
                if self.fault.as_ref().is_some_and(|f| f.fire(layer.part)) {
                    let device = crate::device::device_name(layer.device);
                    panic!("injected panic (fault injection) in part {} ({device}) of the target", layer.part);
                }
            }
            if x.device() != layer.device {
                let _p = span("target.device_hop");
                let to = |t: &Tensor| t.f_to_device(layer.device);
                (x, cos, sin) = (to(&x)?, to(&cos)?, to(&sin)?);
                bias = bias.as_ref().map(to).transpose()?;
                packed_mask = packed_mask.map(|m| m.to_device(layer.device)).transpose()?;
                row_index = row_index.as_ref().map(to).transpose()?;
            }
            let attend = match (cache.as_deref_mut(), &placement) {
                (None, Placement::Packed { .. }) => Keys::Packed { mask: packed_mask.as_ref().expect("a packed mask") },
                (None, _) => Keys::Causal,
                (Some(c), Placement::Append) => {
                    Keys::Cached { cache: c, layer: i, positions: &positions, bias: bias.as_ref() }
                }
                (Some(c), Placement::At(_)) => {
                    let bias = bias.as_ref().expect("a mask for indexed steps");
                    Keys::Indexed { cache: c, layer: i, positions: &positions, bias }
                }
                (Some(c), Placement::Fill(_)) => {
                    Keys::Fill { cache: c, layer: i, rows: row_index.as_ref().expect("rows to fill") }
                }
                (Some(_), Placement::Packed { .. }) => {
                    return Err(ModelError::Batch("packed rows are a whole-sequence pass, without a cache".into()));
                }
                (Some(c), Placement::Rows { len, .. }) => Keys::Rows {
                    cache: c,
                    layer: i,
                    positions: row_index.as_ref().expect("row positions"),
                    len: *len,
                    bias: bias.as_ref().expect("a mask for row steps"),
                },
            };
            x = self.layer_forward(layer, &x, &cos, &sin, attend, routes.as_deref_mut())?;
            observe(i, &x);
        }
        if let (Some(c), Placement::Append) = (cache, &placement) {
            c.advance(s);
        }
        Ok(x)
    }

    pub(super) fn layer_forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        keys: Keys<'_>,
        routes: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        let (b, s) = (x.size()[0], x.size()[1]);
        let (heads, kv_heads, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let qkv = {
            let _p = span("target.norms");
            rms_norm(x, &layer.input_layernorm, c.rms_norm_eps)
        };
        let qkv = {
            let _p = span("target.qkv_proj");
            qkv.linear(&layer.qkv_proj, layer.qkv_bias.as_ref())
        };
        let q = qkv.narrow(-1, 0, heads * d).view([b, s, heads, d]);
        let k = qkv.narrow(-1, heads * d, kv_heads * d).view([b, s, kv_heads, d]);
        let v = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d).view([b, s, kv_heads, d]);
        let (q, k) = {
            let _p = span("target.qk_norm_rope");
            let eps = c.rms_norm_eps;
            (
                norm_rope(&q, layer.q_norm.as_ref(), eps, cos, sin).transpose(1, 2),
                norm_rope(&k, layer.k_norm.as_ref(), eps, cos, sin).transpose(1, 2),
            )
        };
        let v = v.transpose(1, 2);
        // A prefill into cache rows attends as the whole-sequence pass does.
        let keys = match keys {
            Keys::Fill { cache, layer: index, rows } => {
                cache.fill_rows(index, rows, &k, &v)?;
                Keys::Causal
            }
            keys => keys,
        };
        let attn = {
            let _p = span("target.attention");
            attention(layer, &q, k, v, keys)?
        };
        // The residual stream is updated in place (no autograd here): the GEMMs add their product to it (beta = 1),
        // where `x + product` would read both and write a third tensor.
        let hidden = c.hidden_size as i64;
        {
            let _p = span("target.o_proj");
            let attn = attn.transpose(1, 2).reshape([b * s, heads * d]);
            let _ = x.view([b * s, hidden]).f_addmm_(&attn, &layer.o_proj.tr())?;
            if let Some(bias) = &layer.o_bias {
                let _ = x.shallow_clone().f_add_(bias)?;
            }
        }
        let h = {
            let _p = span("target.norms");
            rms_norm(x, &layer.post_attention_layernorm, c.rms_norm_eps)
        };
        let _p = span("target.mlp");
        layer.mlp.add_to(&x.view([b * s, hidden]), &h.view([b * s, hidden]), routes)?;
        Ok(x.shallow_clone())
    }
}
