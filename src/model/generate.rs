//! Plain autoregressive generation with the target, greedy or sampled: what `regenerate --local` uses to write the
//! target's own responses (and the built-in data's answers). The prompt is prefilled once; each new token is one
//! cached step.
use tch::{Kind, Tensor};

pub use super::sampling::Sampling;
use super::sampling::{RowDraws, pick_tokens};
use super::{Decoder, ModelError, Target};

/// Generates up to `max_new` tokens after `prompt`, stopping after any token of `stop` (which is returned with the
/// rest). Sampled tokens are drawn with `seed` ([`pick_tokens`]): the batched generator draws the same.
pub fn generate(
    target: &Target,
    prompt: &[i64],
    max_new: usize,
    stop: &[i64],
    sampling: Sampling,
    seed: u64,
) -> Result<Vec<i64>, ModelError> {
    // Past the model's positions a generation ends where it is, as a length limit does.
    let max_new = max_new.min(target.config().positions().saturating_sub(prompt.len()));
    if prompt.is_empty() || max_new == 0 {
        return Ok(Vec::new());
    }
    let mut decoder = Decoder::new(target, (prompt.len() + max_new) as i64, &[])?;
    let device = target.device();
    let mut step = 0i64;
    cached_generation(&mut decoder, prompt, max_new, stop, |last| {
        let draws = RowDraws::new(&[sampling], &[seed], &[step])?.to(device)?;
        step += 1;
        Ok(pick_tokens(&last.f_unsqueeze(0)?, &draws)?.f_int64_value(&[0])?)
    })
}

/// The loop every plain generation runs: prefills `prompt` (non-empty; with `max_new` new tokens it must fit the
/// model's positions and `decoder`'s cache) once, then feeds back the token `pick` chooses from the last position's
/// logits (`[vocab]`, f32), one cached step each, until `max_new` tokens or a token of `stop` (returned with the
/// rest).
pub(crate) fn cached_generation(
    decoder: &mut Decoder,
    prompt: &[i64],
    max_new: usize,
    stop: &[i64],
    mut pick: impl FnMut(&Tensor) -> Result<i64, ModelError>,
) -> Result<Vec<i64>, ModelError> {
    let mut out = Vec::new();
    if max_new == 0 {
        return Ok(out);
    }
    begin_generation(decoder, prompt, max_new)?;
    let target = decoder.target();
    let mut logits = decoder.decode(&ids_tensor(target, prompt)?)?.logits;
    loop {
        let next = pick(&logits.get(0).get(-1).f_to_kind(Kind::Float)?)?;
        out.push(next);
        if out.len() == max_new || stop.contains(&next) {
            return Ok(out);
        }
        logits = decoder.decode(&ids_tensor(target, &[next])?)?.logits;
    }
}

pub(crate) fn ids_tensor(target: &Target, ids: &[i64]) -> Result<Tensor, ModelError> {
    Ok(Tensor::f_from_slice(ids)?.f_view([1, ids.len() as i64])?.f_to(target.device())?)
}

/// Checks a generation of `max_new` tokens after `prompt` fits the model and `decoder`'s cache, and empties the
/// cache for it.
pub(crate) fn begin_generation(decoder: &mut Decoder, prompt: &[i64], max_new: usize) -> Result<(), ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Batch("a prompt needs at least one token".into()));
    }
    let limit = decoder.target().config().positions() as i64;
    let needed = prompt.len() as i64 + max_new as i64;
    if needed > limit {
        return Err(ModelError::Batch(format!(
            "a prompt of {} tokens plus {max_new} new ones exceeds the target's {limit} positions",
            prompt.len()
        )));
    }
    if needed > decoder.capacity() {
        return Err(ModelError::Batch(format!(
            "a prompt of {} tokens plus {max_new} new ones exceeds the decoder's {} positions",
            prompt.len(),
            decoder.capacity()
        )));
    }
    decoder.crop(0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Depth, Preset};
    use tch::Device;

    #[test]
    fn greedy_is_deterministic_and_matches_the_logits() {
        let t = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let a = generate(&t, &[257, 117, 10], 6, &[], Sampling::Greedy, 0).unwrap();
        let b = generate(&t, &[257, 117, 10], 6, &[], Sampling::Greedy, 0).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 6);
        // The first token is the argmax of the prompt's last logits.
        let ids = Tensor::from_slice(&[257i64, 117, 10]).view([1, 3]);
        let first = t.logits(&ids, &[3]).unwrap().get(0).get(2).argmax(0, false).int64_value(&[]);
        assert_eq!(a[0], first);
        // Every cached step picks what a whole pass over the sequence so far picks.
        let mut seq = vec![257i64, 117, 10];
        for &token in &a {
            let ids = Tensor::from_slice(&seq).view([1, seq.len() as i64]);
            let logits = t.logits(&ids, &[seq.len() as i64]).unwrap();
            assert_eq!(logits.get(0).get(seq.len() as i64 - 1).argmax(0, false).int64_value(&[]), token);
            seq.push(token);
        }
        // At the model's positions a generation ends where it is.
        let limit = t.config().positions();
        let long: Vec<i64> = (0..limit as i64 - 2).map(|i| 10 + i % 50).collect();
        assert_eq!(generate(&t, &long, 6, &[], Sampling::Greedy, 0).unwrap().len(), 2);
        // Stopping: with the first token as a stop token, generation ends there.
        let stopped = generate(&t, &[257, 117, 10], 6, &[first], Sampling::Greedy, 0).unwrap();
        assert_eq!(stopped, vec![first]);
        let sampled = generate(&t, &[257, 117, 10], 6, &[], Sampling::temperature(1.0), 1).unwrap();
        assert_eq!(sampled, generate(&t, &[257, 117, 10], 6, &[], Sampling::temperature(1.0), 1).unwrap());
    }
}
