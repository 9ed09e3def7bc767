//! libtorch operations tch does not bind, called through `csrc/accel.cpp`: presetting a tensor's `.grad` and the
//! fused AdamW kernel.
use std::ffi::{c_char, c_int};

use tch::Tensor;
use torch_sys::C_tensor;

use crate::device::{DeviceError, call_shim};

unsafe extern "C" {
    fn dflash_set_grad(param: *mut C_tensor, grad: *mut C_tensor, err: *mut c_char, len: usize) -> c_int;
    fn dflash_fused_adamw(
        param: *mut C_tensor,
        grad: *mut C_tensor,
        exp_avg: *mut C_tensor,
        exp_avg_sq: *mut C_tensor,
        step: *mut C_tensor,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_scale: *mut C_tensor,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
}

fn raw(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// Makes `grad` the `.grad` of `param`: backward passes then accumulate into `grad` in place.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<(), DeviceError> {
    // SAFETY: both pointers are live at::Tensor handles owned by tch.
    call_shim(param.device(), |e, n| unsafe { dflash_set_grad(raw(param), raw(grad), e, n) })
}

/// AdamW hyperparameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One fused AdamW update of the flat buffers (`_fused_adamw_`). `step` (float32, one element, on the
/// parameters' device) must already count this step; gradients are divided by `grad_scale` inside the kernel.
pub fn fused_adamw(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: &Tensor,
    hp: AdamwStep,
    grad_scale: Option<&Tensor>,
) -> Result<(), DeviceError> {
    let scale = grad_scale.map_or(std::ptr::null_mut(), raw);
    // SAFETY: live tensor handles; a null grad_scale means none.
    call_shim(param.device(), |e, n| unsafe {
        dflash_fused_adamw(
            raw(param),
            raw(grad),
            raw(exp_avg),
            raw(exp_avg_sq),
            raw(step),
            hp.lr,
            hp.beta1,
            hp.beta2,
            hp.weight_decay,
            hp.eps,
            scale,
            e,
            n,
        )
    })
}
