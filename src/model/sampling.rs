//! How a generated token is chosen, the same way for one sequence at a time and for a batch: greedy
//! ([`greedy_tokens`]), or drawn from `softmax(logits / temperature)`, optionally cut to its nucleus (the smallest set
//! of most likely tokens whose probability reaches `top_p`), by the Gumbel-max rule, with noise that is a pure
//! function of the sequence's seed, the step and the token id (splitmix64, a counter-based hash, computed on the
//! logits' device). A sampled answer therefore depends on its seed alone, never on what else shares its batch, and
//! no probabilities cross to the host. Each row of a batch draws its own way ([`RowDraws`]): a batch may mix greedy
//! answers with sampled questions. On a GPU one fused kernel can make the whole draw (`fused::sample_rows`: no sort,
//! one block a row; `DFLASH_FUSED_SAMPLER=1` until a GPU has run its test); libtorch's operations here are the CPU's
//! path and its reference.
use tch::{Kind, Tensor};

use super::ModelError;
use super::choice::greedy_tokens;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    Greedy,
    /// Softmax at `temperature` (> 0) over the nucleus of probability `top_p` (in (0, 1]; 1: every token).
    Sample {
        temperature: f64,
        top_p: f64,
    },
}

impl Sampling {
    /// Greedy at temperature 0, else sampling at `temperature` over the nucleus `top_p`; an error names a value out of
    /// range.
    pub fn new(temperature: f64, top_p: f64) -> Result<Sampling, String> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(format!("temperature {temperature}: expected a number >= 0 (0: greedy)"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top-p {top_p}: expected a number in (0, 1] (1: every token)"));
        }
        Ok(if temperature == 0.0 { Sampling::Greedy } else { Sampling::Sample { temperature, top_p } })
    }

    /// Softmax at `temperature` over every token (greedy at 0).
    pub fn temperature(temperature: f64) -> Sampling {
        if temperature == 0.0 { Sampling::Greedy } else { Sampling::Sample { temperature, top_p: 1.0 } }
    }

    /// The temperature a row is given (0: greedy) and its nucleus.
    fn row(self) -> (f32, f32) {
        match self {
            Sampling::Greedy => (0.0, 1.0),
            Sampling::Sample { temperature, top_p } => (temperature as f32, top_p as f32),
        }
    }
}

/// What a batch's draws need computed: the least work that serves every row (a step shape's CUDA graph is captured
/// per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DrawKind {
    /// Every row greedy.
    Greedy,
    /// Some rows sampled, none cut to a nucleus.
    Sampled,
    /// Some rows cut to a nucleus.
    Nucleus,
}

impl DrawKind {
    /// What `rows` need.
    pub fn of(rows: &[Sampling]) -> DrawKind {
        rows.iter()
            .map(|s| match s {
                Sampling::Greedy => DrawKind::Greedy,
                Sampling::Sample { top_p, .. } if *top_p >= 1.0 => DrawKind::Sampled,
                Sampling::Sample { .. } => DrawKind::Nucleus,
            })
            .max()
            .unwrap_or(DrawKind::Greedy)
    }
}

/// How each row of a batch draws, as tensors on the logits' device (a CUDA graph reads them): the seed, the step (the
/// tokens generated so far), the temperature (0: greedy) and the nucleus, `[B]` each.
pub struct RowDraws {
    pub kind: DrawKind,
    pub seeds: Tensor,
    pub steps: Tensor,
    pub temperatures: Tensor,
    pub top_ps: Tensor,
}

impl RowDraws {
    /// The draws of rows with `samplings`, `seeds` and `steps`, on the host.
    pub fn new(samplings: &[Sampling], seeds: &[u64], steps: &[i64]) -> Result<RowDraws, ModelError> {
        let (temperatures, top_ps): (Vec<f32>, Vec<f32>) = samplings.iter().map(|s| s.row()).unzip();
        // Seeds as int64 bit patterns (the device hash wraps as `u64` does).
        let seeds: Vec<i64> = seeds.iter().map(|&s| s as i64).collect();
        Ok(RowDraws {
            kind: DrawKind::of(samplings),
            seeds: Tensor::f_from_slice(&seeds)?,
            steps: Tensor::f_from_slice(steps)?,
            temperatures: Tensor::f_from_slice(&temperatures)?,
            top_ps: Tensor::f_from_slice(&top_ps)?,
        })
    }

    pub fn to(&self, device: tch::Device) -> Result<RowDraws, ModelError> {
        Ok(RowDraws {
            kind: self.kind,
            seeds: self.seeds.f_to(device)?,
            steps: self.steps.f_to(device)?,
            temperatures: self.temperatures.f_to(device)?,
            top_ps: self.top_ps.f_to(device)?,
        })
    }

    /// Writes `host`'s values into these tensors (a captured graph's inputs); the kinds must agree.
    pub fn copy_from(&self, host: &RowDraws) -> Result<(), ModelError> {
        for (to, from) in [
            (&self.seeds, &host.seeds),
            (&self.steps, &host.steps),
            (&self.temperatures, &host.temperatures),
            (&self.top_ps, &host.top_ps),
        ] {
            to.shallow_clone().f_copy_(from)?;
        }
        Ok(())
    }
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

/// The bits of the hash `u` is made of: with 23, `(top + 0.5) / 2^23` is exact in f32 and never 0 or 1. (With 24,
/// the largest rounded to 1: a noise of +inf that won every draw, and NaN where the nucleus had cut the token.)
const UNIFORM_BITS: i64 = 23;

/// The Gumbel noise of rows `[B]` with `seeds` at `steps` (int64 `[B]` each) over `vocab` tokens, `[B, vocab]` f32:
/// `-ln(-ln(u))`, `u` the top [`UNIFORM_BITS`] bits of `splitmix64(splitmix64(seed + splitmix64(step)) + token *
/// GOLDEN)` centred in their interval (never 0 or 1: the noise lies in [-2.81, 16.64]).
fn gumbel_noise(seeds: &Tensor, steps: &Tensor, vocab: i64) -> Result<Tensor, ModelError> {
    let (seeds, steps) = (seeds.f_to_kind(Kind::Int64)?, steps.f_to_kind(Kind::Int64)?);
    let row = mix(&seeds.f_add(&mix(&steps)?)?)?;
    let tokens = Tensor::f_arange(vocab, (Kind::Int64, seeds.device()))?.f_mul_scalar(GOLDEN as i64)?;
    let bits = mix(&row.f_unsqueeze(1)?.f_add(&tokens.f_unsqueeze(0)?)?)?;
    let top = bits.f_bitwise_right_shift_tensor_scalar(64 - UNIFORM_BITS)?.f_bitwise_and((1i64 << UNIFORM_BITS) - 1)?;
    let u = top.f_to_kind(Kind::Float)?.f_add_scalar(0.5)?.f_mul_scalar(1.0 / (1u64 << UNIFORM_BITS) as f64)?;
    Ok(u.f_log()?.f_neg()?.f_log()?.f_neg()?)
}

/// The token of each row of `logits [B, vocab]` as `draws` say: greedy rows take [`greedy_tokens`] of their logits;
/// sampled rows the Gumbel-max draw over `logits / temperature`, cut to the nucleus where `top_p < 1`. `[B]` int64, on
/// the logits' device (a CUDA graph may capture it).
pub fn pick_tokens(logits: &Tensor, draws: &RowDraws) -> Result<Tensor, ModelError> {
    if draws.kind == DrawKind::Greedy {
        return greedy_tokens(logits);
    }
    // On a GPU, one kernel for the whole draw (bf16 logits), where asked for.
    let d = draws;
    if fused_sampler_asked()
        && let Some(tokens) = super::fused::sample_rows(logits, &d.temperatures, &d.top_ps, &d.seeds, &d.steps)
    {
        return Ok(tokens);
    }
    pick_tokens_plain(logits, draws)
}

/// Whether `DFLASH_FUSED_SAMPLER=1` asks for the fused draw (read once per process). Off by default until its GPU
/// test (`on_a_gpu_the_fused_sampler_draws_as_libtorch`) has run on a GPU: a wrong draw would not fail anything, it
/// would write wrong conversations.
fn fused_sampler_asked() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| std::env::var("DFLASH_FUSED_SAMPLER").is_ok_and(|v| v == "1"))
}

/// [`pick_tokens`] of a sampled batch by libtorch's operations (the CPU's path, and the fused kernel's reference).
fn pick_tokens_plain(logits: &Tensor, draws: &RowDraws) -> Result<Tensor, ModelError> {
    let vocab = logits.size().last().copied().unwrap_or(0);
    let plain = logits.f_to_kind(Kind::Float)?;
    let sampled = draws.temperatures.f_gt(0.0)?;
    // Greedy rows are divided by 1: their draw is computed, then not taken.
    let temperature = draws.temperatures.f_where_scalarother(&sampled, 1.0)?.f_unsqueeze(1)?;
    let mut scaled = plain.f_div(&temperature)?;
    if draws.kind == DrawKind::Nucleus {
        scaled = nucleus(&scaled, &draws.top_ps)?;
    }
    let drawn = scaled.f_add(&gumbel_noise(&draws.seeds, &draws.steps, vocab)?)?;
    greedy_tokens(&drawn.f_where_self(&sampled.f_unsqueeze(1)?, &plain)?)
}

/// `scaled [B, vocab]` (logits over the temperature) with every token outside its row's nucleus at -inf: a token is
/// kept while the probability of the tokens ranked above it is below the row's `top_ps` (so the most likely is
/// always kept, and the token that reaches `top_p` too). Rows with `top_p >= 1` keep every token. Ties in probability
/// rank by token id (a stable sort), so the cut depends on the logits alone.
fn nucleus(scaled: &Tensor, top_ps: &Tensor) -> Result<Tensor, ModelError> {
    let probs = scaled.f_softmax(-1, Kind::Float)?;
    let (sorted, order) = probs.f_sort_stable(true, -1, true)?;
    let above = sorted.f_cumsum(-1, Kind::Float)?.f_sub(&sorted)?;
    let top_p = top_ps.f_unsqueeze(1)?;
    let cut_sorted = above.f_ge_tensor(&top_p)?.f_logical_and(&top_p.f_lt(1.0)?)?;
    let cut = cut_sorted.f_zeros_like()?.f_scatter(-1, &order, &cut_sorted)?;
    Ok(scaled.f_masked_fill(&cut, f64::NEG_INFINITY)?)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn draws(samplings: &[Sampling], seeds: &[u64], steps: &[i64]) -> RowDraws {
        RowDraws::new(samplings, seeds, steps).unwrap()
    }

    /// Token 20,188 of seed 7,919 at step 0 hashes to the largest 24-bit value, which f32 rounded to u = 1: its noise
    /// was +inf, so it won every draw it was in, and where the nucleus had cut it, -inf + inf = NaN won argmax. The
    /// noise is finite for every token, and a nucleus of one token draws that token.
    #[test]
    fn no_token_draws_infinite_noise_nor_escapes_its_nucleus() {
        let (seed, step, token) = (7_919u64, 0i64, 20_188i64);
        let row = splitmix64(seed.wrapping_add(splitmix64(step as u64)));
        let bits = splitmix64(row.wrapping_add((token as u64).wrapping_mul(GOLDEN)));
        assert_eq!(bits >> 40, (1 << 24) - 1, "the case this test is about");
        let one = |t: i64| Tensor::from_slice(&[t]);
        let noise = gumbel_noise(&one(seed as i64), &one(step), 20_200).unwrap();
        let noise: Vec<f32> = Vec::try_from(noise.view([-1])).unwrap();
        assert!(noise.iter().all(|n| n.is_finite() && (-2.82..16.65).contains(n)), "noise out of its range");
        let mut logits = vec![-10.0f32; 20_200];
        logits[0] = 10.0;
        let logits = Tensor::from_slice(&logits).view([1, -1]);
        for sampling in [Sampling::new(1.0, 0.9).unwrap(), Sampling::temperature(0.05)] {
            let drawn = pick_tokens(&logits, &draws(&[sampling], &[seed], &[step])).unwrap().int64_value(&[0]);
            assert_eq!(drawn, 0, "{sampling:?}");
        }
    }

    /// On a GPU: the fused kernel draws what libtorch's operations draw, token for token, from bf16 rows of
    /// vocabularies of 1,000, 49,152 (the real model's) and 151,936 (Qwen3's), flat to peaked (exact ties in plenty),
    /// with greedy rows, sampled ones and nuclei from 0.05 to 0.999 at several temperatures, seeds and steps.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_the_fused_sampler_draws_as_libtorch() {
        let dev = crate::device::gpu_for_tests();
        let kinds =
            [(0.0, 1.0), (0.8, 0.95), (1.0, 1.0), (0.7, 0.5), (1.3, 0.9), (0.6, 0.05), (1.0, 0.999), (2.0, 0.95)];
        let samplings: Vec<Sampling> =
            (0..32).map(|i| kinds[i % kinds.len()]).map(|(t, p)| Sampling::new(t, p).unwrap()).collect();
        let (mut differ, mut total) = (Vec::new(), 0);
        for vocab in [1_000i64, 49_152, 151_936] {
            for (trial, scale) in [1.0, 4.0, 12.0].into_iter().enumerate() {
                let logits = (Tensor::randn([32, vocab], (Kind::Float, dev)) * scale).to_kind(Kind::BFloat16);
                for step in 0..3i64 {
                    let seeds: Vec<u64> = (0..32).map(|i| i * 7_919 + trial as u64 * 1_000_003).collect();
                    let d = draws(&samplings, &seeds, &[step; 32]).to(dev).unwrap();
                    let fused =
                        crate::model::fused::sample_rows(&logits, &d.temperatures, &d.top_ps, &d.seeds, &d.steps)
                            .expect("the fused sampler ran");
                    let (fused, plain): (Vec<i64>, Vec<i64>) = (
                        Vec::try_from(fused).unwrap(),
                        Vec::try_from(pick_tokens_plain(&logits, &d).unwrap()).unwrap(),
                    );
                    total += fused.len();
                    differ.extend(
                        (0..32).filter(|&r| fused[r] != plain[r]).map(|r| (vocab, scale, step, r, fused[r], plain[r])),
                    );
                }
            }
        }
        assert!(
            differ.is_empty(),
            "{} of {total} draws differ (vocab, scale, step, row, fused, libtorch): {differ:?}",
            differ.len()
        );
    }

    /// Draws follow softmax(logits / T): over 4,000 seeds, each token's share is within 0.03 of its probability; the
    /// draw of a seed is the same alone and in a batch, beside greedy rows or not, and the step changes it.
    #[test]
    fn sampled_tokens_follow_the_softmax_and_depend_on_the_seed_alone() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let t = 0.7;
        let row: Vec<f32> = probs.iter().map(|p| (p.ln() * t) as f32).collect();
        let n = 4000usize;
        let logits = Tensor::from_slice(&row).view([1, 4]).expand([n as i64, 4], false);
        let seeds: Vec<u64> = (0..n as u64).collect();
        let sample = Sampling::temperature(t);
        let drawn: Vec<i64> =
            Vec::try_from(pick_tokens(&logits, &draws(&vec![sample; n], &seeds, &vec![0; n])).unwrap()).unwrap();
        for (token, p) in probs.iter().enumerate() {
            let share = drawn.iter().filter(|&&d| d == token as i64).count() as f64 / n as f64;
            assert!((share - p).abs() < 0.03, "token {token}: drawn {share:.3}, probability {p}");
        }
        let one = |seed: u64, step: i64| {
            let pick = pick_tokens(&Tensor::from_slice(&row).view([1, 4]), &draws(&[sample], &[seed], &[step]));
            pick.unwrap().int64_value(&[0])
        };
        assert!((0..50).all(|s| one(s, 0) == drawn[s as usize]), "alone as in the batch");
        assert!((0..50).any(|s| one(s, 1) != drawn[s as usize]), "another step, another draw");
        // Every other row greedy: the sampled rows draw what they drew, the greedy ones take the largest logit.
        let mixed: Vec<Sampling> = (0..n).map(|i| if i % 2 == 0 { sample } else { Sampling::Greedy }).collect();
        let got: Vec<i64> = Vec::try_from(pick_tokens(&logits, &draws(&mixed, &seeds, &vec![0; n])).unwrap()).unwrap();
        assert!((0..n).all(|i| got[i] == if i % 2 == 0 { drawn[i] } else { 3 }));
        let greedy = pick_tokens(&logits, &draws(&vec![Sampling::Greedy; n], &seeds, &vec![0; n])).unwrap();
        assert_eq!(greedy.int64_value(&[7]), 3);
    }

    /// A nucleus of 0.5 over probabilities 0.4, 0.3, 0.2, 0.1 keeps the two most likely tokens (0.4 is below 0.5, so
    /// the second is kept too) in the proportion 4:3; a row beside it with `top_p = 1` draws from all four, exactly as
    /// a batch without a nucleus draws it; a tiny nucleus is greedy.
    #[test]
    fn a_nucleus_draws_from_the_most_likely_tokens_only() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let row: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let n = 4000usize;
        let logits = Tensor::from_slice(&row).view([1, 4]).expand([n as i64, 4], false);
        let seeds: Vec<u64> = (0..n as u64).collect();
        let half = Sampling::new(1.0, 0.5).unwrap();
        let all = Sampling::temperature(1.0);
        let rows: Vec<Sampling> = (0..n).map(|i| if i % 2 == 0 { half } else { all }).collect();
        let drawn: Vec<i64> = Vec::try_from(pick_tokens(&logits, &draws(&rows, &seeds, &vec![0; n])).unwrap()).unwrap();
        let cut: Vec<i64> = drawn.iter().step_by(2).copied().collect();
        assert!(cut.iter().all(|&t| t == 2 || t == 3), "only the nucleus");
        let share3 = cut.iter().filter(|&&t| t == 3).count() as f64 / cut.len() as f64;
        assert!((share3 - 4.0 / 7.0).abs() < 0.04, "renormalised within the nucleus: {share3:.3}");
        let plain: Vec<i64> =
            Vec::try_from(pick_tokens(&logits, &draws(&vec![all; n], &seeds, &vec![0; n])).unwrap()).unwrap();
        assert!((1..n).step_by(2).all(|i| drawn[i] == plain[i]), "top_p 1 draws as without a nucleus");
        assert!((1..n).step_by(2).any(|i| drawn[i] < 2), "and reaches the tail");
        let tiny = vec![Sampling::new(1.0, 0.01).unwrap(); n];
        let greedy: Vec<i64> =
            Vec::try_from(pick_tokens(&logits, &draws(&tiny, &seeds, &vec![0; n])).unwrap()).unwrap();
        assert!(greedy.iter().all(|&t| t == 3));
        assert_eq!(DrawKind::of(&rows), DrawKind::Nucleus);
        assert_eq!(DrawKind::of(&[all, Sampling::Greedy]), DrawKind::Sampled);
        assert!(Sampling::new(1.0, 0.0).is_err() && Sampling::new(-1.0, 1.0).is_err());
        assert_eq!(Sampling::new(0.0, 0.9).unwrap(), Sampling::Greedy);
    }
}
