//! `csrc/accel.cpp`: what a compute thread needs of its device that tch does not bind: binding the thread to it,
//! streams, synchronizing, the caching allocator's statistics, timing events, pinned host memory, presetting a
//! tensor's `.grad`, the fused AdamW kernel and Muon's step. [`crate::device`] offers the device services under their own names.
use std::ffi::{c_char, c_int, c_void};

use serde::Serialize;
use tch::{Device, Tensor};
use torch_sys::C_tensor;

use super::{DeviceFailure, call, call_for_tensor, raw};

/// [`call`] on `device`: a failure is a [`DeviceFailure`] there.
pub(crate) fn on_device(device: Device, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), DeviceFailure> {
    call(f).map_err(|failed| DeviceFailure { device, message: failed.message })
}

/// [`call_for_tensor`] on `device`.
pub(crate) fn tensor_on_device(
    device: Device,
    f: impl FnOnce(*mut c_char, usize) -> *mut C_tensor,
) -> Result<Tensor, DeviceFailure> {
    call_for_tensor(f).map_err(|failed| DeviceFailure { device, message: failed.message })
}

unsafe extern "C" {
    fn dflash_set_deterministic(on: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_set_device(index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_synchronize(index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_synchronize_stream(index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_current_device(err: *mut c_char, len: usize) -> c_int;
    fn dflash_current_stream(index: c_int, out: *mut *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_use_pool_stream(index: c_int, high_priority: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_memory_stats(index: c_int, out: *mut i64, err: *mut c_char, len: usize) -> c_int;
    fn dflash_reset_peak_memory(index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_event_new(index: c_int, err: *mut c_char, len: usize) -> *mut c_void;
    fn dflash_event_record(event: *mut c_void, index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_event_query(event: *mut c_void, done: *mut c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_event_elapsed_ms(
        start: *mut c_void,
        end: *mut c_void,
        ms: *mut f64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_event_free(event: *mut c_void);
    fn dflash_set_grad(param: *mut C_tensor, grad: *mut C_tensor, err: *mut c_char, len: usize) -> c_int;
    fn dflash_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        count: usize,
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
    fn dflash_empty_pinned_like(like: *const C_tensor, err: *mut c_char, len: usize) -> *mut C_tensor;
    fn dflash_muon_orthogonalize(
        grads: *const *mut C_tensor,
        bufs: *const *mut C_tensor,
        count: usize,
        grad_divisor: f64,
        momentum: f64,
        a: f64,
        b: f64,
        c: f64,
        ns_steps: c_int,
        eps: f64,
        gram: c_int,
        out: *mut *mut C_tensor,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_muon_apply(
        params: *const *mut C_tensor,
        updates: *const *mut C_tensor,
        count: usize,
        lr: f64,
        weight_decay: f64,
        adjusted_lr: f64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
}

/// A copy of GPU tensor `t` in page-locked host memory (a CPU tensor is copied as it is). Device-to-host copies into
/// pinned memory run at bus speed; a pageable destination is staged through small buffers, about 10x slower.
pub fn to_pinned_host(t: &Tensor) -> Result<Tensor, DeviceFailure> {
    if t.device() == Device::Cpu {
        return Ok(t.copy());
    }
    // SAFETY: `t` is a live tensor (tch hands out at::Tensor*); the shim returns a new tensor or null.
    let mut host = tensor_on_device(t.device(), |e, n| unsafe { dflash_empty_pinned_like(raw(t), e, n) })?;
    host.f_copy_(t).map_err(|e| DeviceFailure { device: t.device(), message: e.to_string() })?;
    Ok(host)
}

/// Makes the GPUs' training deterministic (`drafters.deterministic`): libtorch's deterministic algorithms, for the
/// whole process, and cuBLAS with a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, which cuBLAS reads when its first
/// handle is made, unless already set). Call it before any other thread runs and before any GPU work.
pub fn deterministic_gpus() -> Result<(), String> {
    if std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none() {
        // SAFETY: called at start, while the process has one thread (nothing reads the environment concurrently).
        unsafe { std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8") };
    }
    // SAFETY: the shim takes a plain value and reports failures into `e`.
    call(|e, n| unsafe { dflash_set_deterministic(1, e, n) }).map_err(|failed| failed.message)
}

fn cuda_index(device: Device) -> Option<c_int> {
    match device {
        Device::Cuda(i) => Some(i as c_int),
        _ => None,
    }
}

/// Makes `device` the calling thread's current device (a no-op for the CPU), then checks libtorch agrees. Call it
/// first in a compute thread.
pub fn bind_thread(device: Device) -> Result<(), DeviceFailure> {
    let Some(i) = cuda_index(device) else {
        return Ok(());
    };
    // SAFETY: plain C calls with valid buffers.
    on_device(device, |e, n| unsafe { dflash_set_device(i, e, n) })?;
    let mut current = -1;
    on_device(device, |e, n| {
        // SAFETY: a plain C call with a valid buffer; it answers the index, or -1 with a message.
        current = unsafe { dflash_current_device(e, n) };
        c_int::from(current < 0)
    })?;
    if current != i {
        return Err(DeviceFailure {
            device,
            message: format!("the thread was bound to cuda:{i} but its current device is cuda:{current}"),
        });
    }
    Ok(())
}

/// The native handle (a `cudaStream_t`) of the calling thread's current stream on CUDA `device`, for kernels
/// launched outside libtorch that must stay ordered with its work; None for other devices.
pub fn current_stream_handle(device: Device) -> Result<Option<*mut c_void>, DeviceFailure> {
    let Some(i) = cuda_index(device) else {
        return Ok(None);
    };
    let mut handle = std::ptr::null_mut();
    // SAFETY: plain C call with valid out-pointer and buffer.
    on_device(device, |e, n| unsafe { dflash_current_stream(i, &mut handle, e, n) })?;
    Ok(Some(handle))
}

/// Moves the calling thread's launches on `device` from the default stream (shared by every thread) onto a stream of
/// its own from libtorch's pool (a no-op for the CPU). Work on other streams is not ordered with it: only for
/// threads that share no tensors, as the launch benchmark's. `Priority::High`: the GPU dispatches its blocks before
/// pending ones of normal streams (latency-bound work beside a saturating one).
pub fn use_own_stream(device: Device, priority: Priority) -> Result<(), DeviceFailure> {
    let high = c_int::from(priority == Priority::High);
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => on_device(device, |e, n| unsafe { dflash_use_pool_stream(i, high, e, n) }),
        None => Ok(()),
    }
}

/// A stream's scheduling priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    Normal,
    High,
}

/// Waits for all work queued on `device` (a no-op for the CPU).
pub fn synchronize(device: Device) -> Result<(), DeviceFailure> {
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => on_device(device, |e, n| unsafe { dflash_synchronize(i, e, n) }),
        None => Ok(()),
    }
}

/// Waits for the work the calling thread queued on its current stream of `device` (a no-op for the CPU): other
/// threads' streams (training, beside an evaluation) are not waited for.
pub fn synchronize_stream(device: Device) -> Result<(), DeviceFailure> {
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => on_device(device, |e, n| unsafe { dflash_synchronize_stream(i, e, n) }),
        None => Ok(()),
    }
}

/// The caching allocator's view of one GPU's memory, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    pub allocated: i64,
    pub peak_allocated: i64,
    pub reserved: i64,
    pub device_free: i64,
    pub device_total: i64,
}

impl MemoryStats {
    /// What this process can still allocate: the device's free bytes and what its own allocator holds unused (a
    /// restarted target's predecessor, freed, is free to it too).
    pub fn free_to_this_process(&self) -> u64 {
        (self.device_free.max(0) + (self.reserved - self.allocated).max(0)) as u64
    }
}

/// Memory statistics of `device`; all zero on the CPU, where libtorch keeps none.
pub fn memory_stats(device: Device) -> Result<MemoryStats, DeviceFailure> {
    let Some(i) = cuda_index(device) else {
        return Ok(MemoryStats::default());
    };
    let mut out = [0i64; 5];
    // SAFETY: `out` has the five slots the shim writes.
    on_device(device, |e, n| unsafe { dflash_memory_stats(i, out.as_mut_ptr(), e, n) })?;
    Ok(MemoryStats {
        allocated: out[0],
        peak_allocated: out[1],
        reserved: out[2],
        device_free: out[3],
        device_total: out[4],
    })
}

/// Starts a new peak-memory window on `device`.
pub fn reset_peak_memory(device: Device) -> Result<(), DeviceFailure> {
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => on_device(device, |e, n| unsafe { dflash_reset_peak_memory(i, e, n) }),
        None => Ok(()),
    }
}

/// A timing event recorded on a GPU's current stream (CUDA's `cudaEvent_t` with timing enabled).
pub struct TimingEvent {
    raw: *mut c_void,
    device: Device,
    index: c_int,
}

// SAFETY: a c10::Event may be used from any thread; we never share one between threads at the same time.
unsafe impl Send for TimingEvent {}

impl TimingEvent {
    /// A new event for GPU `device`; `None` for the CPU, which has no device events.
    pub fn new(device: Device) -> Result<Option<Self>, DeviceFailure> {
        let Some(index) = cuda_index(device) else {
            return Ok(None);
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: plain C call with a valid buffer; a null result comes with a message.
        on_device(device, |e, n| {
            raw = unsafe { dflash_event_new(index, e, n) };
            c_int::from(raw.is_null())
        })?;
        Ok(Some(TimingEvent { raw, device, index }))
    }

    /// Records the event at the current point of the calling thread's current stream.
    pub fn record(&self) -> Result<(), DeviceFailure> {
        // SAFETY: `raw` is a live event created for this device.
        on_device(self.device, |e, n| unsafe { dflash_event_record(self.raw, self.index, e, n) })
    }

    /// Whether the work before the event's record point has completed (never blocks).
    pub fn is_done(&self) -> Result<bool, DeviceFailure> {
        let mut done: c_int = 0;
        // SAFETY: `raw` is a live event.
        on_device(self.device, |e, n| unsafe { dflash_event_query(self.raw, &mut done, e, n) })?;
        Ok(done != 0)
    }

    /// Milliseconds between `self` and a later `end`; both must have completed.
    pub fn elapsed_ms(&self, end: &TimingEvent) -> Result<f64, DeviceFailure> {
        let mut ms = 0.0;
        // SAFETY: both events are live.
        on_device(self.device, |e, n| unsafe { dflash_event_elapsed_ms(self.raw, end.raw, &mut ms, e, n) })?;
        Ok(ms)
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: `raw` came from dflash_event_new and is freed once.
        unsafe { dflash_event_free(self.raw) }
    }
}

/// Makes `grad` the `.grad` of `param`: backward passes then accumulate into `grad` in place.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<(), DeviceFailure> {
    // SAFETY: both pointers are live at::Tensor handles owned by tch.
    on_device(param.device(), |e, n| unsafe { dflash_set_grad(raw(param), raw(grad), e, n) })
}

/// AdamW hyperparameters of one step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamwStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// The tensors one AdamW update applies to: parameters, their gradients and both moments, one entry each (the flat
/// buffers, or views of them).
pub struct AdamwTensors<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub exp_avgs: &'a [Tensor],
    pub exp_avg_sqs: &'a [Tensor],
}

/// One fused AdamW update (`_fused_adamw_`) of `t`. `step` (float32, one element, on the parameters' device) must
/// already count this step; gradients are divided by `grad_scale` inside the kernel.
pub fn fused_adamw(
    t: AdamwTensors,
    step: &Tensor,
    hp: AdamwStep,
    grad_scale: Option<&Tensor>,
) -> Result<(), DeviceFailure> {
    let count = t.params.len();
    let lists = [t.params, t.grads, t.exp_avgs, t.exp_avg_sqs];
    if count == 0 {
        return Ok(());
    }
    if lists.iter().any(|l| l.len() != count) {
        let lengths: Vec<usize> = lists.iter().map(|l| l.len()).collect();
        return Err(DeviceFailure { device: step.device(), message: format!("AdamW lists of lengths {lengths:?}") });
    }
    let [p, g, m, v] = lists.map(|l| l.iter().map(raw).collect::<Vec<_>>());
    let scale = grad_scale.map_or(std::ptr::null_mut(), raw);
    // SAFETY: four arrays of `count` live tensor handles, kept alive by `t` for the call; a null grad_scale means none.
    on_device(step.device(), |e, n| unsafe {
        dflash_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            count,
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

/// Muon's hyperparameters of one step (torch.optim.Muon's names).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MuonStep {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub ns_steps: u32,
    #[serde(default)]
    pub iteration: MuonIteration,
}

/// How Muon orthogonalises its updates (`optim.muon_iteration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum MuonIteration {
    /// torch.optim.Muon's Newton-Schulz in bf16, op for op.
    #[default]
    NewtonSchulz,
    /// The same polynomial iterated on each non-square matrix's Gram matrix in fp16, restarted once (Gram
    /// Newton-Schulz, DeepSpeed's `ns_method = "gram"`): equal in exact arithmetic, fewer FLOPs for wide matrices.
    Gram,
}

/// Newton-Schulz coefficients and the normalisation's floor, torch.optim.Muon's defaults.
pub const MUON_NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.775, 2.0315);
pub const MUON_EPS: f64 = 1e-7;

/// Muon's momentum for the 2-D parameters of one shape whose gradients are `grads / grad_divisor` and momentum
/// buffers `bufs` (updated in place), as torch.optim.Muon 2.11 computes it (Nesterov). With `orthogonalize`, also
/// their updates orthogonalised by `hp.iteration` (each matrix normalised on its own, the iterations one batch of
/// matrix products for all): `[count, rows, cols]` in bf16 in the parameters' orientation.
pub fn muon_orthogonalize(
    grads: &[Tensor],
    bufs: &[Tensor],
    grad_divisor: f64,
    hp: MuonStep,
    orthogonalize: bool,
) -> Result<Option<Tensor>, DeviceFailure> {
    let Some(first) = grads.first() else { return Ok(None) };
    let device = first.device();
    if bufs.len() != grads.len() {
        let message = format!("Muon: {} gradients but {} momentum buffers", grads.len(), bufs.len());
        return Err(DeviceFailure { device, message });
    }
    let (a, b, c) = MUON_NS_COEFFICIENTS;
    let [g, m] = [grads, bufs].map(|l| l.iter().map(raw).collect::<Vec<_>>());
    let mut out = std::ptr::null_mut();
    let out_ptr: *mut *mut C_tensor = if orthogonalize { &mut out } else { std::ptr::null_mut() };
    // SAFETY: two arrays of `count` live tensor handles, kept alive by the slices for the call; `out_ptr` is null or
    // receives a tensor the shim allocated with `new`.
    on_device(device, |e, n| unsafe {
        dflash_muon_orthogonalize(
            g.as_ptr(),
            m.as_ptr(),
            grads.len(),
            grad_divisor,
            hp.momentum,
            a,
            b,
            c,
            hp.ns_steps as c_int,
            MUON_EPS,
            c_int::from(hp.iteration == MuonIteration::Gram),
            out_ptr,
            e,
            n,
        )
    })?;
    // SAFETY: on success with `orthogonalize` the shim handed over a non-null tensor: the Tensor owns it from here.
    Ok((orthogonalize && !out.is_null()).then(|| unsafe { Tensor::from_ptr(out) }))
}

/// Muon's step of 2-D parameters of one shape from their orthogonalised updates (bf16, one each): decoupled weight
/// decay at `hp.lr`, then a step of `adjusted_lr` (the rate scaled for their shape).
pub fn muon_apply(params: &[Tensor], updates: &[Tensor], hp: MuonStep, adjusted_lr: f64) -> Result<(), DeviceFailure> {
    let Some(first) = params.first() else { return Ok(()) };
    let device = first.device();
    if updates.len() != params.len() {
        let message = format!("Muon: {} parameters but {} updates", params.len(), updates.len());
        return Err(DeviceFailure { device, message });
    }
    let [p, u] = [params, updates].map(|l| l.iter().map(raw).collect::<Vec<_>>());
    // SAFETY: two arrays of `count` live tensor handles, kept alive by the slices for the call.
    on_device(device, |e, n| unsafe {
        dflash_muon_apply(p.as_ptr(), u.as_ptr(), params.len(), hp.lr, hp.weight_decay, adjusted_lr, e, n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// Gram Newton-Schulz is Newton-Schulz rearranged: for wide and tall matrices its updates agree with Muon's
    /// within half precision at every step count (the restart at iteration 2 included), and a square batch is
    /// Muon's own, to the bit.
    #[test]
    fn gram_newton_schulz_agrees_with_muons_iteration() {
        let orthogonalized = |shape: [i64; 2], steps: u32, iteration: MuonIteration| {
            let grads: Vec<Tensor> = (0..3).map(|_| Tensor::randn(shape, (Kind::Float, Device::Cpu))).collect();
            let bufs: Vec<Tensor> = grads.iter().map(|g| g.zeros_like()).collect();
            let hp = MuonStep { lr: 1e-3, momentum: 0.95, weight_decay: 0.0, ns_steps: steps, iteration };
            muon_orthogonalize(&grads, &bufs, 1.0, hp, true).unwrap().unwrap().to_kind(Kind::Float)
        };
        for shape in [[24, 72], [72, 24], [32, 32]] {
            for steps in [1, 2, 3, 5] {
                let seed = 100 + steps as i64 + shape[0];
                tch::manual_seed(seed);
                let muon = orthogonalized(shape, steps, MuonIteration::NewtonSchulz);
                tch::manual_seed(seed);
                let gram = orthogonalized(shape, steps, MuonIteration::Gram);
                assert_eq!(gram.size(), [3, shape[0], shape[1]]);
                let difference = (&gram - &muon).norm().double_value(&[]) / muon.norm().double_value(&[]);
                if shape[0] == shape[1] {
                    assert_eq!(difference, 0.0, "a square batch stays on Muon's iteration");
                } else {
                    assert!(difference < 0.03, "{shape:?}, {steps} steps: relative difference {difference}");
                }
            }
        }
    }

    #[test]
    fn cpu_memory_services_are_no_ops() {
        bind_thread(Device::Cpu).unwrap();
        synchronize(Device::Cpu).unwrap();
        assert_eq!(memory_stats(Device::Cpu).unwrap(), MemoryStats::default());
    }
}
