//! How a generated token is chosen, the same way for one sequence at a time and for a batch: greedy
//! ([`greedy_tokens`]), or drawn from `softmax(logits / temperature)` by the Gumbel-max rule, with noise that is a pure
//! function of the sequence's seed, the step and the token id (splitmix64, a counter-based hash, computed on the
//! logits' device). A sampled answer therefore depends on its seed alone, never on what else shares its batch, and
//! no probabilities cross to the host.
use tch::{Kind, Tensor};

use super::ModelError;
use super::choice::greedy_tokens;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    Greedy,
    /// Softmax at this temperature (> 0).
    Temperature(f64),
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// splitmix64's output function of `x + GOLDEN`, on the host: what [`mix`] computes on a device.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(MIX1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX2);
    z ^ (z >> 31)
}

/// [`splitmix64`] of every element of an int64 tensor (libtorch's int64 arithmetic wraps as `u64`'s does; its right
/// shift is arithmetic, so the shifted-in sign bits are masked off).
fn mix(x: &Tensor) -> Result<Tensor, ModelError> {
    let shift = |z: &Tensor, by: i64| -> Result<Tensor, ModelError> {
        Ok(z.f_bitwise_right_shift_tensor_scalar(by)?.f_bitwise_and((1i64 << (64 - by)) - 1)?)
    };
    let z = x.f_add_scalar(GOLDEN as i64)?;
    let z = z.f_bitwise_xor_tensor(&shift(&z, 30)?)?.f_mul_scalar(MIX1 as i64)?;
    let z = z.f_bitwise_xor_tensor(&shift(&z, 27)?)?.f_mul_scalar(MIX2 as i64)?;
    Ok(z.f_bitwise_xor_tensor(&shift(&z, 31)?)?)
}

/// The Gumbel noise of rows `[B]` with `seeds` at `steps` (int64 `[B]` each) over `vocab` tokens, `[B, vocab]` f32:
/// `-ln(-ln(u))`, `u` the top 24 bits of `splitmix64(splitmix64(seed + splitmix64(step)) + token * GOLDEN)` centred
/// in their interval (never 0 or 1).
fn gumbel_noise(seeds: &Tensor, steps: &Tensor, vocab: i64) -> Result<Tensor, ModelError> {
    let (seeds, steps) = (seeds.f_to_kind(Kind::Int64)?, steps.f_to_kind(Kind::Int64)?);
    let row = mix(&seeds.f_add(&mix(&steps)?)?)?;
    let tokens = Tensor::f_arange(vocab, (Kind::Int64, seeds.device()))?.f_mul_scalar(GOLDEN as i64)?;
    let bits = mix(&row.f_unsqueeze(1)?.f_add(&tokens.f_unsqueeze(0)?)?)?;
    let top = bits.f_bitwise_right_shift_tensor_scalar(40)?.f_bitwise_and((1i64 << 24) - 1)?;
    let u = top.f_to_kind(Kind::Float)?.f_add_scalar(0.5)?.f_mul_scalar(1.0 / (1u64 << 24) as f64)?;
    Ok(u.f_log()?.f_neg()?.f_log()?.f_neg()?)
}

/// The token of each row of `logits [B, vocab]` under `sampling`; a sampled row draws with its seed at its step
/// (`seeds`, `steps`: int64 `[B]` on the logits' device). `[B]` int64, on the logits' device (a CUDA graph may
/// capture it).
pub fn pick_tokens(logits: &Tensor, sampling: Sampling, seeds: &Tensor, steps: &Tensor) -> Result<Tensor, ModelError> {
    match sampling {
        Sampling::Greedy => greedy_tokens(logits),
        Sampling::Temperature(t) => {
            let vocab = logits.size().last().copied().unwrap_or(0);
            let scaled = logits.f_to_kind(Kind::Float)?.f_div_scalar(t)?;
            greedy_tokens(&scaled.f_add(&gumbel_noise(seeds, steps, vocab)?)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The device hash is splitmix64 bit for bit, sign bits and wrapping included.
    #[test]
    fn the_device_hash_is_splitmix64() {
        let inputs = [0u64, 1, 2, 41, u64::MAX, 1 << 63, 0xDEAD_BEEF_1234_5678, GOLDEN.wrapping_neg()];
        let x = Tensor::from_slice(&inputs.map(|v| v as i64));
        let got: Vec<i64> = Vec::try_from(mix(&x).unwrap()).unwrap();
        let want: Vec<i64> = inputs.iter().map(|&v| splitmix64(v) as i64).collect();
        assert_eq!(got, want);
        // The reference values of splitmix64 seeded with 0 (its first output).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    /// Draws follow softmax(logits / T): over 4,000 seeds, each token's share is within 0.03 of its probability; the
    /// draw of a seed is the same alone and in a batch, and the step changes it.
    #[test]
    fn sampled_tokens_follow_the_softmax_and_depend_on_the_seed_alone() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let t = 0.7;
        let row: Vec<f32> = probs.iter().map(|p| (p.ln() * t) as f32).collect();
        let n = 4000i64;
        let logits = Tensor::from_slice(&row).view([1, 4]).expand([n, 4], false);
        let seeds = Tensor::arange(n, (Kind::Int64, Device::Cpu));
        let steps = Tensor::zeros([n], (Kind::Int64, Device::Cpu));
        let drawn: Vec<i64> =
            Vec::try_from(pick_tokens(&logits, Sampling::Temperature(t), &seeds, &steps).unwrap()).unwrap();
        for (token, p) in probs.iter().enumerate() {
            let share = drawn.iter().filter(|&&d| d == token as i64).count() as f64 / n as f64;
            assert!((share - p).abs() < 0.03, "token {token}: drawn {share:.3}, probability {p}");
        }
        let one = |seed: i64, step: i64| {
            let pick = pick_tokens(
                &Tensor::from_slice(&row).view([1, 4]),
                Sampling::Temperature(t),
                &Tensor::from_slice(&[seed]),
                &Tensor::from_slice(&[step]),
            );
            pick.unwrap().int64_value(&[0])
        };
        assert!((0..50).all(|s| one(s, 0) == drawn[s as usize]), "alone as in the batch");
        assert!((0..50).any(|s| one(s, 1) != drawn[s as usize]), "another step, another draw");
        let greedy = pick_tokens(&logits, Sampling::Greedy, &seeds, &steps).unwrap();
        assert_eq!(greedy.int64_value(&[7]), 3);
    }
}
