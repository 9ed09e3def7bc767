//! `csrc/autograd.cpp`: autograd functions that save less for the backward pass, or accumulate gradients in fewer
//! passes, than the plain expressions: RoPE, the SwiGLU activation and MLP tail, the master weights' cast.
use super::DeviceFailure;
use std::ffi::{c_char, c_int};

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::accel::tensor_on_device;
use super::raw;

unsafe extern "C" {
    fn dflash_rope(
        x: *mut C_tensor,
        cos: *mut C_tensor,
        ssin: *mut C_tensor,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
    fn dflash_swiglu_activation(gate_up: *mut C_tensor, err: *mut c_char, len: usize) -> *mut C_tensor;
    fn dflash_swiglu_down(gate_up: *mut C_tensor, down: *mut C_tensor, err: *mut c_char, len: usize) -> *mut C_tensor;
    fn dflash_weight_cast(leaf: *mut C_tensor, kind: c_int, err: *mut c_char, len: usize) -> *mut C_tensor;
}

/// `x * cos + swap_halves(x) * ssin` (HF's rotate-half RoPE with `ssin = [-sin, sin]`) as one autograd node that
/// saves only the factors: the backward is the inverse rotation of the incoming gradient.
pub fn rope(x: &Tensor, cos: &Tensor, ssin: &Tensor) -> Result<Tensor, DeviceFailure> {
    // SAFETY: live tensor handles; the shim returns a new tensor or null.
    tensor_on_device(x.device(), |e, n| unsafe { dflash_rope(raw(x), raw(cos), raw(ssin), e, n) })
}

/// `silu(gate) * up` of a stacked projection `[..., 2I]` (gate first) as one autograd node that saves only the
/// projection and recomputes `silu(gate)` in the backward.
pub fn swiglu_activation(gate_up: &Tensor) -> Result<Tensor, DeviceFailure> {
    // SAFETY: a live tensor handle; the shim returns a new tensor or null.
    tensor_on_device(gate_up.device(), |e, n| unsafe { dflash_swiglu_activation(raw(gate_up), e, n) })
}

/// `down(silu(gate) * up)` for a stacked projection `[..., 2I]` and `down` `[H, I]`, as one autograd node that
/// saves only the projection (the activation is recomputed for the down weight's gradient).
pub fn swiglu_down(gate_up: &Tensor, down: &Tensor) -> Result<Tensor, DeviceFailure> {
    // SAFETY: live tensor handles; the shim returns a new tensor or null.
    tensor_on_device(gate_up.device(), |e, n| unsafe { dflash_swiglu_down(raw(gate_up), raw(down), e, n) })
}

/// `leaf` cast to `kind`, for a leaf whose `.grad` is preset ([`set_grad`]): the backward adds the gradient into
/// `.grad` in one kernel instead of casting it to the leaf's dtype first.
pub fn weight_cast(leaf: &Tensor, kind: Kind) -> Result<Tensor, DeviceFailure> {
    // c10::ScalarType codes of the floating kinds a model computes in.
    let code = match kind {
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::Double => 7,
        Kind::BFloat16 => 15,
        other => {
            return Err(DeviceFailure {
                device: leaf.device(),
                message: format!("weights cannot be cast to {other:?}"),
            });
        }
    };
    // SAFETY: a live tensor handle; the shim returns a new tensor or null.
    tensor_on_device(leaf.device(), |e, n| unsafe { dflash_weight_cast(raw(leaf), code, e, n) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::accel::set_grad;
    use tch::Device;

    fn randn(shape: &[i64], kind: Kind) -> Tensor {
        Tensor::randn(shape, (Kind::Double, Device::Cpu)).to_kind(kind)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
    }

    #[test]
    fn swiglu_down_matches_the_plain_expression_forward_and_backward() {
        for (kind, tol) in [(Kind::Double, 1e-12), (Kind::BFloat16, 0.1)] {
            let gu0 = (randn(&[2, 5, 16], kind) * 3.0).set_requires_grad(true);
            let down0 = randn(&[6, 8], kind).set_requires_grad(true);
            let r = randn(&[2, 5, 6], kind);
            let (gu1, down1) = (gu0.detach().set_requires_grad(true), down0.detach().set_requires_grad(true));
            let plain = (gu0.narrow(-1, 0, 8).silu() * gu0.narrow(-1, 8, 8)).linear(&down0, None::<Tensor>);
            let node = swiglu_down(&gu1, &down1).unwrap();
            (&plain * &r).sum(kind).backward();
            (&node * &r).sum(kind).backward();
            assert!(max_diff(&plain, &node) <= tol, "{kind:?} forward");
            assert!(max_diff(&gu0.grad(), &gu1.grad()) <= tol, "{kind:?} projection gradient");
            assert!(max_diff(&down0.grad(), &down1.grad()) <= tol, "{kind:?} down gradient");
        }
    }

    #[test]
    fn weight_cast_accumulates_into_the_preset_gradient() {
        let flat_grad = Tensor::zeros([2, 3, 4], (Kind::Float, Device::Cpu));
        let leaf = randn(&[3, 4], Kind::Float).set_requires_grad(true);
        set_grad(&leaf, &flat_grad.get(1)).unwrap();
        let x = randn(&[5, 4], Kind::BFloat16);
        let r = randn(&[5, 3], Kind::BFloat16);
        for _ in 0..2 {
            let w = weight_cast(&leaf, Kind::BFloat16).unwrap();
            assert_eq!(w.kind(), Kind::BFloat16);
            (x.linear(&w, None::<Tensor>) * &r).sum(Kind::Float).backward();
        }
        // The plain cast, differentiated by libtorch, twice.
        let plain = leaf.detach().set_requires_grad(true);
        for _ in 0..2 {
            (x.linear(&plain.to_kind(Kind::BFloat16), None::<Tensor>) * &r).sum(Kind::Float).backward();
        }
        assert!(flat_grad.get(1).equal(&plain.grad()), "accumulated gradients differ");
        assert_eq!(flat_grad.get(0).abs().sum(Kind::Float).double_value(&[]), 0.0, "wrote outside its slice");
        assert!(leaf.grad().data_ptr() == flat_grad.get(1).data_ptr(), "the preset gradient was replaced");
        // A leaf without a preset gradient gets an ordinary one.
        let free = leaf.detach().set_requires_grad(true);
        (x.linear(&weight_cast(&free, Kind::BFloat16).unwrap(), None::<Tensor>) * &r).sum(Kind::Float).backward();
        let once = leaf.detach().set_requires_grad(true);
        (x.linear(&once.to_kind(Kind::BFloat16), None::<Tensor>) * &r).sum(Kind::Float).backward();
        assert!(free.grad().equal(&once.grad()));
        assert!(weight_cast(&free, Kind::Int).is_err());
    }
}
