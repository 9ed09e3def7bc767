//! The pieces the target and the drafter share, with HuggingFace's numerics: RMSNorm (normalise in f32, cast back,
//! then scale), rotary embeddings (frequencies and angles in f32, rotate-half convention) and the SwiGLU MLP.
use tch::{Device, Kind, Tensor};

use super::config::RopeScaling;
use super::fused;
use crate::ffi::autograd;

/// RMSNorm over the last dimension: `weight * (x / sqrt(mean(x^2) + eps))`, accumulated in f32.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let dim = *x.size().last().expect("rms_norm input has a last dimension");
    x.rms_norm([dim], Some(weight), eps)
}

/// `down(silu(gate(x)) * up(x))` with the gate and up projections stacked in one weight `[2 * I, H]`.
pub fn swiglu(x: &Tensor, gate_up: &Tensor, down: &Tensor) -> Tensor {
    let gu = x.linear(gate_up, None::<Tensor>);
    swiglu_activation(&gu).linear(down, None::<Tensor>)
}

/// `silu(gate) * up` of a stacked projection `[..., 2I]` (gate first): one fused kernel for inference on CUDA,
/// otherwise one autograd node that saves only the projection ([`autograd::swiglu_activation`]).
pub fn swiglu_activation(gate_up: &Tensor) -> Tensor {
    fused::silu_mul(gate_up)
        .unwrap_or_else(|| autograd::swiglu_activation(gate_up).unwrap_or_else(|e| panic!("swiglu activation: {e}")))
}

/// Per-head RMSNorm (where the model has one) then RoPE of `x` `[B, S, heads, d]`, with the factors of
/// [`Rope::cos_sin`] for the S positions: one fused kernel for inference on CUDA, otherwise libtorch's RMSNorm and
/// [`apply_rope`].
pub fn norm_rope(x: &Tensor, weight: Option<&Tensor>, eps: f64, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    fused::norm_rope(x, weight, eps, cos, signed_sin).unwrap_or_else(|| {
        let normed = weight.map(|w| rms_norm(x, w, eps));
        apply_rope(normed.as_ref().unwrap_or(x), cos, signed_sin)
    })
}

/// Rotary position embedding frequencies for one head size.
#[derive(Debug)]
pub struct Rope {
    /// `[head_dim / 2]`, f32
    inv_freq: Tensor,
    /// YaRN's factor on cos and sin (1 otherwise).
    attention_scaling: f64,
}

impl Rope {
    /// Frequencies `theta^(-2i/d)` computed as transformers does (f32 tensor arithmetic), then Llama-3 scaling.
    pub fn new(theta: f64, head_dim: usize, scaling: RopeScaling, device: Device) -> Self {
        let d = head_dim as f64;
        let exponent =
            Tensor::arange_start_step(0, head_dim as i64, 2, (Kind::Int64, Device::Cpu)).to_kind(Kind::Float) / d;
        let pos_freqs = Tensor::pow_scalar(theta, &exponent);
        let inv_freq = pos_freqs.reciprocal();
        let mut attention_scaling = 1.0;
        let inv_freq = match scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: old_len,
                truncate,
                attention_factor,
            } => {
                attention_scaling = attention_factor;
                // transformers' `_compute_yarn_parameters`: the dimensions whose rotation count over the original
                // context lies between beta_fast and beta_slow are ramped from extrapolated to interpolated.
                let correction_dim =
                    |rotations: f64| d * (old_len / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                let ramp = ((Tensor::arange(head_dim as i64 / 2, (Kind::Float, Device::Cpu)) - low) / (high - low))
                    .clamp(0.0, 1.0);
                let extrapolation = ramp.ones_like() - ramp;
                let interpolation = (&pos_freqs * factor).reciprocal();
                &interpolation * (extrapolation.ones_like() - &extrapolation) + &inv_freq * &extrapolation
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_len,
            } => {
                let low_freq_wavelen = old_len / low_freq_factor;
                let high_freq_wavelen = old_len / high_freq_factor;
                let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
                let long = wavelen.gt(low_freq_wavelen);
                let scaled = inv_freq.where_self(&long.logical_not(), &(&inv_freq / factor));
                let smooth =
                    ((wavelen.reciprocal() * old_len) - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed = (smooth.ones_like() - &smooth) * &scaled / factor + &smooth * &scaled;
                let medium = wavelen.lt(high_freq_wavelen).logical_not() * long.logical_not();
                smoothed.where_self(&medium, &scaled)
            }
        };
        Rope { inv_freq: inv_freq.to_device(device), attention_scaling }
    }

    /// The factors [`apply_rope`] takes for `positions` (any integer shape `P`), each `[..P, head_dim]` in `kind`:
    /// `cos` of the angles (repeated over both halves), and their `sin` with the sign of `rotate_half` folded in,
    /// `[-sin, sin]`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        let (cos, sin) = (emb.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling);
        (cos.to_kind(kind), Tensor::cat(&[-&sin, sin], -1).to_kind(kind))
    }
}

/// HF's `x * cos + rotate_half(x) * sin` (`rotate_half([a, b]) = [-b, a]` over the last dimension), with `cos` and
/// the signed `sin` of [`Rope::cos_sin`] (broadcast to `x`'s shape): the halves swapped (one copy), then one
/// multiply and one fused multiply-add, where the plain form takes five kernels. One autograd node keeping only the
/// factors for the backward ([`autograd::rope`]).
pub fn apply_rope(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    autograd::rope(x, cos, signed_sin).unwrap_or_else(|e| panic!("rope: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_is_hf_rotate_half_written_out() {
        let rope = Rope::new(10000.0, 8, RopeScaling::None, Device::Cpu);
        let positions = Tensor::from_slice(&[0i64, 3, 17, 250]);
        let x = Tensor::randn([2, 4, 8], (Kind::Double, Device::Cpu));
        let (cos, signed_sin) = rope.cos_sin(&positions, Kind::Double);
        let angles = positions.to_kind(Kind::Double).unsqueeze(-1) * rope.inv_freq.to_kind(Kind::Double);
        let emb = Tensor::cat(&[&angles, &angles], -1);
        let rotate_half = Tensor::cat(&[-x.narrow(-1, 4, 4), x.narrow(-1, 0, 4)], -1);
        let reference = &x * emb.cos() + rotate_half * emb.sin();
        let got = apply_rope(&x, &cos, &signed_sin);
        let err = (&got - &reference).abs().max().double_value(&[]);
        assert!(err < 1e-6, "max difference {err}");
        // A non-contiguous input (heads sliced out of a stacked projection) gives the same.
        let stacked = Tensor::cat(&[&x, &x], -1);
        let sliced = apply_rope(&stacked.narrow(-1, 8, 8), &cos, &signed_sin);
        assert!((sliced - got).abs().max().double_value(&[]) == 0.0);
    }

    /// The gradient of `sum(f(x) * r)` with respect to `x`, and `f(x)`.
    fn value_and_grad(x: &Tensor, r: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
        let x = x.detach().set_requires_grad(true);
        let y = f(&x);
        (&y * r).sum(y.kind()).backward();
        (y.detach(), x.grad())
    }

    #[test]
    fn rope_node_matches_the_plain_expression_forward_and_backward() {
        let rope = Rope::new(10000.0, 8, RopeScaling::None, Device::Cpu);
        let positions = Tensor::from_slice(&[0i64, 3, 17, 250, 9]).view([1, 5, 1]);
        for kind in [Kind::Double, Kind::BFloat16] {
            let (cos, ssin) = rope.cos_sin(&positions, kind);
            let x = Tensor::randn([2, 5, 3, 8], (Kind::Double, Device::Cpu)).to_kind(kind);
            let r = Tensor::randn([2, 5, 3, 8], (Kind::Double, Device::Cpu)).to_kind(kind);
            let plain = |x: &Tensor| {
                let swapped = x.unflatten(-1, [2, 4]).flip([-2]).flatten(-2, -1);
                x * &cos + swapped * &ssin
            };
            let (y0, g0) = value_and_grad(&x, &r, plain);
            let (y1, g1) = value_and_grad(&x, &r, |x| apply_rope(x, &cos, &ssin));
            // bf16: a rounding apart, relative to the largest value (the inputs are unseeded: one bf16 step at
            // a gradient of 4 is 0.03125).
            let tol = |a: &Tensor| match kind {
                Kind::Double => 1e-12,
                _ => 1e-2 * a.abs().max().to_kind(Kind::Double).double_value(&[]).max(1.0),
            };
            let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().to_kind(Kind::Double).double_value(&[]);
            assert!(diff(&y0, &y1) <= tol(&y0), "{kind:?} forward differs by {}", diff(&y0, &y1));
            assert!(diff(&g0, &g1) <= tol(&g0), "{kind:?} gradient differs by {}", diff(&g0, &g1));
        }
        // Factors that would broadcast x up to a larger shape are refused (the backward could not reduce them).
        let (cos, ssin) = rope.cos_sin(&Tensor::from_slice(&[1i64, 2]).view([2, 1]), Kind::Float);
        let small = Tensor::ones([1, 8], (Kind::Float, Device::Cpu));
        let err = crate::ffi::autograd::rope(&small, &cos, &ssin).unwrap_err().to_string();
        assert!(err.contains("do not broadcast"), "{err}");
    }

    #[test]
    fn swiglu_node_matches_the_plain_expression_bit_for_bit() {
        for kind in [Kind::Double, Kind::BFloat16] {
            let gu = (Tensor::randn([3, 4, 12], (Kind::Double, Device::Cpu)) * 3.0).to_kind(kind);
            let r = Tensor::randn([3, 4, 6], (Kind::Double, Device::Cpu)).to_kind(kind);
            let plain = |gu: &Tensor| gu.narrow(-1, 0, 6).silu() * gu.narrow(-1, 6, 6);
            let (y0, g0) = value_and_grad(&gu, &r, plain);
            let (y1, g1) = value_and_grad(&gu, &r, |gu| crate::ffi::autograd::swiglu_activation(gu).unwrap());
            assert!(y0.equal(&y1), "{kind:?} forward differs");
            assert!(g0.equal(&g1), "{kind:?} gradient differs: {}", (&g0 - &g1).abs().max());
        }
    }

    #[test]
    fn rope_preserves_norm_and_rotates_relative_positions() {
        let rope = Rope::new(10000.0, 8, RopeScaling::None, Device::Cpu);
        let x = Tensor::randn([8], (Kind::Double, Device::Cpu)).to_kind(Kind::Float);
        let y = Tensor::randn([8], (Kind::Double, Device::Cpu)).to_kind(Kind::Float);
        let at = |p: i64, t: &Tensor| {
            let (c, s) = rope.cos_sin(&Tensor::from_slice(&[p]), Kind::Float);
            apply_rope(&t.unsqueeze(0), &c, &s).squeeze_dim(0)
        };
        let norm = |t: &Tensor| t.norm().double_value(&[]);
        assert!((norm(&at(37, &x)) - norm(&x)).abs() < 1e-4);
        // Dot products depend only on the distance between positions.
        let d1 = at(5, &x).dot(&at(3, &y)).double_value(&[]);
        let d2 = at(105, &x).dot(&at(103, &y)).double_value(&[]);
        assert!((d1 - d2).abs() < 1e-3, "{d1} vs {d2}");
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = Rope::new(500000.0, 128, RopeScaling::None, Device::Cpu);
        let scaled = Rope::new(
            500000.0,
            128,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
            Device::Cpu,
        );
        let p: Vec<f32> = Vec::try_from(&plain.inv_freq).unwrap();
        let s: Vec<f32> = Vec::try_from(&scaled.inv_freq).unwrap();
        assert_eq!(p[0], s[0]); // wavelength 2*pi: untouched
        assert!((s[63] - p[63] / 8.0).abs() < 1e-12); // longest wavelength: divided by the factor
        assert!(s.iter().zip(&p).all(|(s, p)| s <= p && *s >= p / 8.0 - 1e-12));
    }
}
