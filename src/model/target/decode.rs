//! The decode session: a KV cache of one sequence or of many rows, steps that continue it, and a step with nothing
//! read back to the host, so that a CUDA graph can capture it.

use tch::{Kind, Tensor};

use super::layers::{Mlp, Placement};
use super::{Decoded, Target};
use crate::model::ModelError;
use crate::model::attention::context_bucket;
use crate::model::kv_cache::KvCache;
use crate::model::layers::rms_norm;

impl Target {
    /// A cache for [`Target::decode`] holding up to `capacity` positions of one sequence (rounded up to a
    /// multiple of [`CONTEXT_BUCKET`](crate::model::attention::CONTEXT_BUCKET), as attention reads it in buckets).
    pub fn new_cache(&self, capacity: i64) -> Result<KvCache, ModelError> {
        self.new_rows_cache(1, context_bucket(capacity))
    }

    /// Continues the cached sequence with `input_ids [1, T]` (the prefill when the cache is empty, one token, or a
    /// block to verify): returns the logits `[1, T, vocab]` and the tapped states `[1, T, taps * hidden]` of the
    /// new positions, and holds their keys and values in `cache`. Needs [`Depth::Full`](super::Depth::Full).
    pub fn decode(&self, input_ids: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        self.decode_appended(input_ids, cache, false)
    }

    /// [`Target::decode`] keeping the logits of the last new position only (`[1, 1, vocab]`): what a prefill needs
    /// of them, where all of a 32K-token prompt's would take 10 GB.
    pub fn decode_last(&self, input_ids: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        self.decode_appended(input_ids, cache, true)
    }

    /// [`Target::decode`]'s checks and step; `last_only`: [`Target::decode_last`].
    pub(super) fn decode_appended(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<Decoded, ModelError> {
        if self.norm.is_none() {
            return Err(ModelError::NotFull);
        }
        let t = input_ids.size()[1];
        self.check_batch(input_ids, &[t])?;
        cache.reserve(t)?;
        if (cache.len() + t) as usize > self.cfg.positions() {
            return Err(ModelError::Batch(format!("decoding past the target's {} positions", self.cfg.positions())));
        }
        self.decode_with(input_ids, cache, None, last_only)
    }

    /// [`Target::decode`] with nothing depending on the host between steps, so that a CUDA graph can capture it:
    /// the new positions start at `start` (an int64 scalar on the target's device, the cache's length before the
    /// step, written by the caller), the keys and values are written by index, and attention reads the cache's whole
    /// capacity with a mask. The cache's length is the caller's to advance (by `T`, once per step run). Dense targets
    /// on one device only ([`Target::graphable`]); the caller checks the step fits the cache and the model.
    pub fn decode_at(&self, input_ids: &Tensor, start: &Tensor, cache: &mut KvCache) -> Result<Decoded, ModelError> {
        if !self.graphable() {
            return Err(ModelError::Batch(
                "a decoding step at a device position needs a dense target on one device (no experts, no sinks)".into(),
            ));
        }
        let t = input_ids.size()[1];
        self.check_batch(input_ids, &[t])?;
        self.decode_with(input_ids, cache, Some(start), false)
    }

    /// A cache for batched generation: `rows` sequences of up to `capacity` positions each, every row its own
    /// length ([`Target::prefill_rows`], [`Target::step_rows`]; the caller keeps the lengths).
    pub fn new_rows_cache(&self, rows: i64, capacity: i64) -> Result<KvCache, ModelError> {
        let c = &self.cfg;
        let (kv_heads, d) = (c.num_key_value_heads as i64, c.head_dim as i64);
        KvCache::on_devices(&self.layer_devices(), rows, kv_heads, d, capacity, self.kind)
    }

    /// Batched generation's prefill: runs the right-padded prompts `input_ids [N, P]` (`lengths` tokens each) as new
    /// sequences, writes their keys and values to the cache rows `rows` (`[N]`, int64, on the target's device) from
    /// position 0, and returns the logits of each prompt's last token, `[N, vocab]`. Needs [`Depth::Full`](super::Depth::Full).
    pub fn prefill_rows(
        &self,
        input_ids: &Tensor,
        lengths: &[i64],
        rows: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        let (n, _) = self.check_batch(input_ids, lengths)?;
        // Copied before the layers are queued: a copy from the host waits for the work queued before it.
        let last = Tensor::f_from_slice(lengths)?.f_to(self.device)?.f_sub_scalar(1)?;
        tch::no_grad(|| {
            let count = self.layers.len();
            let x = self.run_layers_at(input_ids, count, Some(cache), Placement::Fill(rows), None, |_, _| {})?;
            let x = x.f_to_device(self.device)?;
            let x = x.f_index(&[Some(Tensor::f_arange(n, (Kind::Int64, self.device))?), Some(last)])?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?)
        })
    }

    /// Batched generation's step: one token for each row of `cache` (`input_ids [B, 1]`), at the row's own position
    /// (`positions [B]`, int64, on the target's device; past what [`Target::prefill_rows`] and earlier steps wrote
    /// there). Attention reads each row's first `len` positions (more than any row's position), masked per row.
    /// Returns the logits `[B, vocab]`. Nothing depends on the host: on one device a CUDA graph may capture it.
    pub fn step_rows(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        len: i64,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        let b = input_ids.size()[0];
        self.check_batch(input_ids, &vec![1; b as usize])?;
        tch::no_grad(|| {
            let count = self.layers.len();
            let placement = Placement::Rows { positions, len };
            let x = self.run_layers_at(input_ids, count, Some(cache), placement, None, |_, _| {})?;
            let x = x.f_to_device(self.device)?.f_squeeze_dim(1)?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?)
        })
    }

    /// Whether [`Target::decode_at`] applies: a dense target (no experts: their routing sizes its kernels; no
    /// attention sinks) held whole on one device.
    pub fn graphable(&self) -> bool {
        self.norm.is_some()
            && self
                .layers
                .iter()
                .all(|l| l.sinks.is_none() && matches!(l.mlp, Mlp::Dense { .. }) && l.device == self.device)
    }

    /// The decoding step; `last_only`: the LM head on the last new position only.
    pub(super) fn decode_with(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        at: Option<&Tensor>,
        last_only: bool,
    ) -> Result<Decoded, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        tch::no_grad(|| {
            let mut taps = Vec::with_capacity(self.taps.len());
            let placement = at.map_or(Placement::Append, Placement::At);
            let x = self.run_layers_at(input_ids, self.layers.len(), Some(cache), placement, None, |layer, x| {
                if self.taps.contains(&layer) {
                    // A copy (the next layer updates x in place), on the first device.
                    taps.push(if x.device() == self.device { x.copy() } else { x.to_device(self.device) });
                }
            })?;
            let mut x = x.f_to_device(self.device)?;
            if last_only {
                x = x.f_narrow(1, x.size()[1] - 1, 1)?;
            }
            let logits = rms_norm(&x, norm, self.cfg.rms_norm_eps).f_linear(self.lm_head(), None::<Tensor>)?;
            Ok(Decoded { logits, taps: Tensor::f_cat(&taps, 2)? })
        })
    }

    /// Query heads per key/value head.
    pub(super) fn query_group(&self) -> i64 {
        (self.cfg.num_attention_heads / self.cfg.num_key_value_heads) as i64
    }
}
