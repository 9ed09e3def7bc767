//! What training asks of the target: the tapped layers' hidden states of a batch (plain or packed rows, with the
//! last layer's states for the target's own predictions), and the logits and expert choices the tests and tools read.

use tch::{Kind, Tensor};

use super::Target;
use super::layers::{Placement, packed_attention};
use crate::model::ModelError;
use crate::model::attention::flash_runs_on;
use crate::model::layers::rms_norm;
use crate::profile::span;

impl Target {
    /// Runs the decoder on right-padded `input_ids [B, S]` (int64, on the model's device) whose rows hold
    /// `lengths` real tokens, and returns the tapped states concatenated in tap order, `[B, S, taps * hidden]`,
    /// zero at padded positions. No gradients are recorded.
    ///
    /// A spread target runs the batch as micro-batches of rows ([`Target::set_micro_batches`]), all launched before
    /// any is waited for, so while a later part works on one micro-batch an earlier part works on the next. Taps of
    /// layers on other devices collect there and move to the first device once at the end: copying each as it comes
    /// would make the first device wait for the later parts (a cross-device copy orders both devices' streams) and
    /// the micro-batches would take turns.
    pub fn capture(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Tensor, ModelError> {
        Ok(self.capture_states(input_ids, lengths, None, false)?.0)
    }

    /// [`Target::capture`] (and, `with_last`, [`Target::capture_with_last`]'s last states) of packed rows: row `r`
    /// of `input_ids [B, S]` holds conversations of the lengths `conversations[r]`, one after the other, then padding.
    /// Each conversation's positions start at 0 and its tokens attend to its own earlier tokens only, so its states
    /// are those it would have alone in a row. Dense targets (no attention sinks or windows).
    pub fn capture_packed(
        &self,
        input_ids: &Tensor,
        conversations: &[Vec<i64>],
        with_last: bool,
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        let lengths: Vec<i64> = conversations.iter().map(|c| c.iter().sum()).collect();
        if conversations.iter().flatten().any(|&l| l < 1) {
            return Err(ModelError::Batch(format!("packed conversations {conversations:?} must each hold a token")));
        }
        self.capture_states(input_ids, &lengths, Some(conversations), with_last)
    }

    /// [`Target::capture`], and also the last layer's output after the final norm, `[B, S, hidden]` on the first
    /// device (zero at padded positions): what the LM head turns into the target's next-token logits, for an objective
    /// that learns from the target's predictions. Needs [`Depth::Full`](super::Depth::Full).
    pub fn capture_with_last(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(Tensor, Tensor), ModelError> {
        let (taps, last) = self.capture_states(input_ids, lengths, None, true)?;
        Ok((taps, last.ok_or(ModelError::NotFull)?))
    }

    pub(super) fn capture_states(
        &self,
        input_ids: &Tensor,
        lengths: &[i64],
        packed: Option<&[Vec<i64>]>,
        with_last: bool,
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        let (b, s) = self.check_batch(input_ids, lengths)?;
        // Flash attention over each conversation where it runs (packed rows' only attention that skips the keys of
        // other conversations), else the whole row masked.
        let segments = flash_runs_on(self.device, self.kind) && self.cfg.head_dim <= 256;
        let h = self.cfg.hidden_size as i64;
        // With the last states: the final norm, and where its output goes.
        let last = match (with_last, &self.norm) {
            (false, _) => None,
            (true, Some(norm)) => Some((norm, Tensor::f_empty([b, s, h], (self.kind, self.device))?)),
            (true, None) => return Err(ModelError::NotFull),
        };
        let out = Tensor::f_empty([b, s, self.taps.len() as i64 * h], (self.kind, self.device))?;
        let last_tap = self.taps[self.taps.len() - 1];
        let layers_run = if with_last { self.layers.len() } else { last_tap + 1 };
        // The slot of each tap: in `out`, or a [B, S, hidden] buffer on its layer's device.
        let staged = (self.taps.iter())
            .map(|&layer| match self.layers[layer].device {
                device if device == self.device => Ok(None),
                device => Ok(Some(Tensor::f_empty([b, s, h], (self.kind, device))?)),
            })
            .collect::<Result<Vec<Option<Tensor>>, ModelError>>()?;
        let micro_batches = self.micro_batches_for(b) as i64;
        let rows = (b + micro_batches - 1) / micro_batches;
        tch::no_grad(|| -> Result<(), ModelError> {
            for first in (0..b).step_by(rows as usize) {
                let count = rows.min(b - first);
                let ids = input_ids.f_narrow(0, first, count)?;
                let mut next_tap = 0;
                let packed = match packed {
                    Some(rows) => {
                        let rows = &rows[first as usize..(first + count) as usize];
                        Some(packed_attention(rows, s, segments, self.kind, self.device)?)
                    }
                    None => None,
                };
                let placement = match &packed {
                    Some((positions, mask)) => Placement::Packed { positions, mask },
                    None => Placement::Append,
                };
                let output = self.run_layers_at(&ids, layers_run, None, placement, None, |layer, x| {
                    if self.taps.get(next_tap) == Some(&layer) {
                        let _p = span("target.copy_taps");
                        let slot = match &staged[next_tap] {
                            Some(buffer) => buffer.narrow(0, first, count),
                            None => out.narrow(2, next_tap as i64 * h, h).narrow(0, first, count),
                        };
                        slot.shallow_clone().copy_(x);
                        next_tap += 1;
                    }
                })?;
                if let Some((norm, last)) = &last {
                    let normed = rms_norm(&output.f_to_device(self.device)?, norm, self.cfg.rms_norm_eps);
                    last.f_narrow(0, first, count)?.f_copy_(&normed)?;
                }
            }
            for (t, buffer) in staged.iter().enumerate() {
                if let Some(buffer) = buffer {
                    out.f_narrow(2, t as i64 * h, h)?.f_copy_(buffer)?;
                }
            }
            Ok(())
        })?;
        self.zero_padding(&out, lengths)?;
        let last = last.map(|(_, last)| last);
        if let Some(last) = &last {
            self.zero_padding(last, lengths)?;
        }
        Ok((out, last))
    }

    /// Runs the whole stack and the LM head: logits `[B, S, vocab]` (padded positions zeroed). Needs
    /// [`Depth::Full`](super::Depth::Full).
    pub fn logits(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Tensor, ModelError> {
        let Some(norm) = &self.norm else {
            return Err(ModelError::NotFull);
        };
        self.check_batch(input_ids, lengths)?;
        let logits = tch::no_grad(|| -> Result<Tensor, ModelError> {
            let x = self.run_layers(input_ids, self.layers.len(), None, None, |_, _| {})?.f_to_device(self.device)?;
            Ok(rms_norm(&x, norm, self.cfg.rms_norm_eps).linear(self.lm_head(), None::<Tensor>))
        })?;
        self.zero_padding(&logits, lengths)?;
        Ok(logits)
    }

    /// The experts each sparse layer (in layer order, up to the last tap or all) chooses for every position of
    /// `input_ids [B, S]`: `[B * S, experts per token]` each, most probable first. For checking routing against a
    /// reference implementation; empty for a dense target.
    pub fn expert_choices(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Vec<Tensor>, ModelError> {
        self.check_batch(input_ids, lengths)?;
        let mut routes = vec![];
        let _last = tch::no_grad(|| self.run_layers(input_ids, self.layers.len(), None, Some(&mut routes), |_, _| {}))?;
        Ok(routes)
    }

    pub(super) fn check_batch(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(i64, i64), ModelError> {
        let size = input_ids.size();
        let bad = |reason: String| Err(ModelError::Batch(reason));
        let [b, s] = size[..] else {
            return bad(format!("input_ids must be [batch, seq], got {size:?}"));
        };
        if input_ids.kind() != Kind::Int64 || input_ids.device() != self.device {
            return bad(format!(
                "input_ids must be int64 on {:?}, got {:?} on {:?}",
                self.device,
                input_ids.kind(),
                input_ids.device()
            ));
        }
        if lengths.len() as i64 != b || lengths.iter().any(|&l| l < 1 || l > s) {
            return bad(format!("lengths {lengths:?} must give 1..={s} tokens for each of {b} rows"));
        }
        if s as usize > self.cfg.positions() {
            return bad(format!("sequence length {s} exceeds the target's {} positions", self.cfg.positions()));
        }
        Ok((b, s))
    }

    pub(super) fn zero_padding(&self, t: &Tensor, lengths: &[i64]) -> Result<(), ModelError> {
        let s = t.size()[1];
        if lengths.iter().all(|&l| l == s) {
            return Ok(());
        }
        let lengths = Tensor::f_from_slice(lengths)?.f_to(self.device)?;
        let pad = Tensor::f_arange(s, (Kind::Int64, self.device))?.unsqueeze(0).f_ge_tensor(&lengths.unsqueeze(1))?;
        let _ = t.shallow_clone().f_masked_fill_(&pad.unsqueeze(-1), 0.0)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::target::Depth;

    /// On a GPU in bf16 packed rows take flash attention over each conversation, and each conversation's taps and last
    /// states are those it has alone in a row (the CPU's f32 test of the masked path is tests/target_model.rs').
    #[test]
    #[ignore = "needs a GPU"]
    pub(super) fn on_a_gpu_packed_rows_capture_what_each_captures_alone() {
        let device = crate::device::gpu_for_tests();
        let target = crate::model::Preset::Tiny.spec().build_target(Depth::Full, device, Kind::BFloat16).unwrap();
        let lengths = [[37i64, 5, 80], [64, 0, 0]];
        let s = 122;
        let rows: Vec<Vec<i64>> = lengths.iter().map(|r| r.iter().copied().filter(|&l| l > 0).collect()).collect();
        let vocab = target.config().vocab_size as i64;
        let ids = Tensor::randint(vocab, [2, s], (Kind::Int64, device));
        let (taps, last) = target.capture_packed(&ids, &rows, true).unwrap();
        let last = last.unwrap();
        let rel = |a: &Tensor, b: &Tensor| {
            let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
            (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-12)
        };
        for (r, row) in rows.iter().enumerate() {
            let mut start = 0;
            for &len in row {
                let alone_ids = ids.get(r as i64).narrow(0, start, len).unsqueeze(0);
                let (alone, alone_last) = target.capture_with_last(&alone_ids, &[len]).unwrap();
                let err = rel(&taps.get(r as i64).narrow(0, start, len), &alone.get(0));
                assert!(err < 1e-2, "taps of row {r} at {start}: relative error {err}");
                let err = rel(&last.get(r as i64).narrow(0, start, len), &alone_last.get(0));
                assert!(err < 1e-2, "last states of row {r} at {start}: relative error {err}");
                start += len;
            }
        }
        assert_eq!(taps.get(1).narrow(0, 64, s - 64).abs().max().double_value(&[]), 0.0, "padding is zero");
    }
}
