//! Plain autoregressive generation with the target, greedy or sampled: what `regenerate --local` uses to write the
//! target's own responses. Each step reruns the whole sequence (no KV cache), which suits the small and offline
//! setups `--local` is for.
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use super::{ModelError, Target};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    Greedy,
    /// Softmax at this temperature (> 0).
    Temperature(f64),
}

/// Generates up to `max_new` tokens after `prompt`, stopping after any token of `stop` (which is returned with the
/// rest). `rng` draws sampled tokens.
pub fn generate(
    target: &Target,
    prompt: &[i64],
    max_new: usize,
    stop: &[i64],
    sampling: Sampling,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<i64>, ModelError> {
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    let limit = target.config().max_position_embeddings;
    while out.len() < max_new && ids.len() < limit {
        let input = Tensor::f_from_slice(&ids)?.f_view([1, ids.len() as i64])?.f_to(target.device())?;
        let logits = target.logits(&input, &[ids.len() as i64])?;
        let last = logits.get(0).get(ids.len() as i64 - 1).f_to_kind(Kind::Float)?;
        let next = match sampling {
            Sampling::Greedy => last.f_argmax(0, false)?.f_int64_value(&[])?,
            Sampling::Temperature(t) => {
                let probs: Vec<f32> =
                    Vec::try_from(last.f_div_scalar(t)?.f_softmax(0, Kind::Float)?.f_to(tch::Device::Cpu)?)?;
                let mut draw: f32 = rng.random();
                let mut pick = probs.len() - 1;
                for (i, p) in probs.iter().enumerate() {
                    if draw < *p {
                        pick = i;
                        break;
                    }
                    draw -= p;
                }
                pick as i64
            }
        };
        ids.push(next);
        out.push(next);
        if stop.contains(&next) {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Depth, Preset};
    use rand::SeedableRng;
    use tch::Device;

    #[test]
    fn greedy_is_deterministic_and_matches_the_logits() {
        let t = Preset::Tiny.spec().build_target(Depth::Full, Device::Cpu, Kind::Float).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let a = generate(&t, &[257, 117, 10], 6, &[], Sampling::Greedy, &mut rng).unwrap();
        let b = generate(&t, &[257, 117, 10], 6, &[], Sampling::Greedy, &mut rng).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 6);
        // The first token is the argmax of the prompt's last logits.
        let ids = Tensor::from_slice(&[257i64, 117, 10]).view([1, 3]);
        let first = t.logits(&ids, &[3]).unwrap().get(0).get(2).argmax(0, false).int64_value(&[]);
        assert_eq!(a[0], first);
        // Stopping: with the first token as a stop token, generation ends there.
        let stopped = generate(&t, &[257, 117, 10], 6, &[first], Sampling::Greedy, &mut rng).unwrap();
        assert_eq!(stopped, vec![first]);
        let sampled =
            generate(&t, &[257, 117, 10], 6, &[], Sampling::Temperature(1.0), &mut ChaCha8Rng::seed_from_u64(1))
                .unwrap();
        assert_eq!(
            sampled,
            generate(&t, &[257, 117, 10], 6, &[], Sampling::Temperature(1.0), &mut ChaCha8Rng::seed_from_u64(1))
                .unwrap()
        );
    }
}
