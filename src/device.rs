//! Compute devices as users write them (`cpu`, `cuda:N`, `auto`), and the device services tch lacks: binding the
//! calling thread to a device and reading the caching allocator's memory statistics (through `csrc/accel.cpp`).
//!
//! Every compute thread binds its device before it creates a tensor, so that libtorch's current device, streams and
//! kernels land on the GPU the thread owns rather than on GPU 0.
use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch::{Device, Kind, Tensor};

/// Errors about devices and numeric types, each naming what was asked for and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("invalid device {0:?}: write `cpu`, `cuda:N` (N = 0, 1, ...) or `auto`")]
    Parse(String),
    #[error("device {0} was requested but CUDA is not available here (no GPU, or no driver); use `cpu` or `auto`")]
    NoCuda(DeviceSpec),
    #[error("device {spec} was requested but only {count} CUDA device(s) are visible (cuda:0..cuda:{last})", last = count.saturating_sub(1))]
    NoSuchGpu { spec: DeviceSpec, count: usize },
    #[error("invalid dtype {0:?}: write `auto`, `bf16` or `f32`")]
    ParseDtype(String),
    #[error("libtorch on {device:?}: {message}")]
    Runtime { device: Device, message: String },
}

/// A device as written in configs and on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// The first GPU if CUDA is available, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceSpec {
    /// The concrete device, checking that it exists on this machine.
    pub fn resolve(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Auto if tch::Cuda::is_available() => Ok(Device::Cuda(0)),
            DeviceSpec::Auto | DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(index) => {
                if !tch::Cuda::is_available() {
                    return Err(DeviceError::NoCuda(self));
                }
                let count = tch::Cuda::device_count() as usize;
                if index >= count {
                    return Err(DeviceError::NoSuchGpu { spec: self, count });
                }
                Ok(Device::Cuda(index))
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => f.write_str("auto"),
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| DeviceError::Parse(s.to_string())),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The numeric type of model weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DtypeSpec {
    /// bf16 on a GPU, f32 on the CPU.
    #[default]
    Auto,
    Bf16,
    F32,
}

impl DtypeSpec {
    pub fn resolve(self, device: Device) -> Kind {
        match (self, device) {
            (DtypeSpec::Auto, Device::Cpu) | (DtypeSpec::F32, _) => Kind::Float,
            (DtypeSpec::Auto, _) | (DtypeSpec::Bf16, _) => Kind::BFloat16,
        }
    }
}

impl fmt::Display for DtypeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DtypeSpec::Auto => "auto",
            DtypeSpec::Bf16 => "bf16",
            DtypeSpec::F32 => "f32",
        })
    }
}

impl FromStr for DtypeSpec {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(DtypeSpec::Auto),
            "bf16" | "bfloat16" => Ok(DtypeSpec::Bf16),
            "f32" | "float32" => Ok(DtypeSpec::F32),
            _ => Err(DeviceError::ParseDtype(s.to_string())),
        }
    }
}

impl<'de> Deserialize<'de> for DtypeSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A device as users write it: `cpu`, `cuda:N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".to_string(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// A short name for a tensor kind, as used in reports and published configs.
pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Float => "float32",
        Kind::Double => "float64",
        _ => "other",
    }
}

unsafe extern "C" {
    fn dflash_set_device(index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_synchronize(index: c_int, err: *mut c_char, len: usize) -> c_int;
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
    fn dflash_empty_pinned_like(like: *const c_void, err: *mut c_char, len: usize) -> *mut c_void;
}

/// A copy of GPU tensor `t` in page-locked host memory (a CPU tensor is copied as it is). Device-to-host copies into
/// pinned memory run at bus speed; a pageable destination is staged through small buffers, about 10x slower.
pub fn to_pinned_host(t: &Tensor) -> Result<Tensor, DeviceError> {
    if t.device() == Device::Cpu {
        return Ok(t.copy());
    }
    // SAFETY: `t` is a live tensor (tch hands out at::Tensor*); the shim returns a new tensor or null.
    let mut host = shim_tensor(t.device(), |e, n| unsafe {
        dflash_empty_pinned_like(t.as_ptr() as *const c_void, e, n) as *mut torch_sys::C_tensor
    })?;
    host.f_copy_(t).map_err(|e| DeviceError::Runtime { device: t.device(), message: e.to_string() })?;
    Ok(host)
}

/// Wraps the `at::Tensor*` a shim function allocated with `new` (null means it failed, with the message in the
/// buffer); the returned Tensor owns it.
pub(crate) fn shim_tensor(
    device: Device,
    f: impl FnOnce(*mut c_char, usize) -> *mut torch_sys::C_tensor,
) -> Result<Tensor, DeviceError> {
    let mut out = std::ptr::null_mut();
    call_shim(device, |e, n| {
        out = f(e, n);
        c_int::from(out.is_null())
    })?;
    // SAFETY: a live at::Tensor* the shim allocated with `new`, owned by the returned Tensor from here on.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Calls a shim function with an error buffer and turns a failure into a [`DeviceError::Runtime`].
pub(crate) fn call_shim(device: Device, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), DeviceError> {
    let mut buf = [0 as c_char; 512];
    if f(buf.as_mut_ptr(), buf.len()) == 0 {
        return Ok(());
    }
    // SAFETY: the shim always NUL-terminates the buffer it was given.
    let message = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    Err(DeviceError::Runtime { device, message })
}

fn cuda_index(device: Device) -> Option<c_int> {
    match device {
        Device::Cuda(i) => Some(i as c_int),
        _ => None,
    }
}

/// Makes `device` the calling thread's current device (a no-op for the CPU), then checks libtorch agrees. Call it
/// first in a compute thread.
pub fn bind_thread(device: Device) -> Result<(), DeviceError> {
    let Some(i) = cuda_index(device) else {
        return Ok(());
    };
    // SAFETY: plain C calls with valid buffers.
    call_shim(device, |e, n| unsafe { dflash_set_device(i, e, n) })?;
    let mut current = -1;
    call_shim(device, |e, n| {
        current = unsafe { dflash_current_device(e, n) };
        c_int::from(current < 0)
    })?;
    if current != i {
        return Err(DeviceError::Runtime {
            device,
            message: format!("the thread was bound to cuda:{i} but its current device is cuda:{current}"),
        });
    }
    Ok(())
}

/// The native handle (a `cudaStream_t`) of the calling thread's current stream on CUDA `device`, for kernels
/// launched outside libtorch that must stay ordered with its work; None for other devices.
pub fn current_stream_handle(device: Device) -> Result<Option<*mut c_void>, DeviceError> {
    let Some(i) = cuda_index(device) else {
        return Ok(None);
    };
    let mut handle = std::ptr::null_mut();
    // SAFETY: plain C call with valid out-pointer and buffer.
    call_shim(device, |e, n| unsafe { dflash_current_stream(i, &mut handle, e, n) })?;
    Ok(Some(handle))
}

/// Moves the calling thread's launches on `device` from the default stream (shared by every thread) onto a stream of
/// its own from libtorch's pool (a no-op for the CPU). Work on other streams is not ordered with it: only for
/// threads that share no tensors, as the launch benchmark's. `Priority::High`: the GPU dispatches its blocks before
/// pending ones of normal streams (latency-bound work beside a saturating one).
pub fn use_own_stream(device: Device, priority: Priority) -> Result<(), DeviceError> {
    let high = c_int::from(priority == Priority::High);
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => call_shim(device, |e, n| unsafe { dflash_use_pool_stream(i, high, e, n) }),
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
pub fn synchronize(device: Device) -> Result<(), DeviceError> {
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => call_shim(device, |e, n| unsafe { dflash_synchronize(i, e, n) }),
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

/// Memory statistics of `device`; all zero on the CPU, where libtorch keeps none.
pub fn memory_stats(device: Device) -> Result<MemoryStats, DeviceError> {
    let Some(i) = cuda_index(device) else {
        return Ok(MemoryStats::default());
    };
    let mut out = [0i64; 5];
    // SAFETY: `out` has the five slots the shim writes.
    call_shim(device, |e, n| unsafe { dflash_memory_stats(i, out.as_mut_ptr(), e, n) })?;
    Ok(MemoryStats {
        allocated: out[0],
        peak_allocated: out[1],
        reserved: out[2],
        device_free: out[3],
        device_total: out[4],
    })
}

/// Starts a new peak-memory window on `device`.
pub fn reset_peak_memory(device: Device) -> Result<(), DeviceError> {
    match cuda_index(device) {
        // SAFETY: plain C call with a valid buffer.
        Some(i) => call_shim(device, |e, n| unsafe { dflash_reset_peak_memory(i, e, n) }),
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
    pub fn new(device: Device) -> Result<Option<Self>, DeviceError> {
        let Some(index) = cuda_index(device) else {
            return Ok(None);
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: plain C call with a valid buffer; a null result comes with a message.
        call_shim(device, |e, n| {
            raw = unsafe { dflash_event_new(index, e, n) };
            c_int::from(raw.is_null())
        })?;
        Ok(Some(TimingEvent { raw, device, index }))
    }

    /// Records the event at the current point of the calling thread's current stream.
    pub fn record(&self) -> Result<(), DeviceError> {
        // SAFETY: `raw` is a live event created for this device.
        call_shim(self.device, |e, n| unsafe { dflash_event_record(self.raw, self.index, e, n) })
    }

    /// Whether the work before the event's record point has completed (never blocks).
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        let mut done: c_int = 0;
        // SAFETY: `raw` is a live event.
        call_shim(self.device, |e, n| unsafe { dflash_event_query(self.raw, &mut done, e, n) })?;
        Ok(done != 0)
    }

    /// Milliseconds between `self` and a later `end`; both must have completed.
    pub fn elapsed_ms(&self, end: &TimingEvent) -> Result<f64, DeviceError> {
        let mut ms = 0.0;
        // SAFETY: both events are live.
        call_shim(self.device, |e, n| unsafe { dflash_event_elapsed_ms(self.raw, end.raw, &mut ms, e, n) })?;
        Ok(ms)
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        // SAFETY: `raw` came from dflash_event_new and is freed once.
        unsafe { dflash_event_free(self.raw) }
    }
}

/// What `dflash --version` says beyond the version: the commit (the binary's, where known), the libtorch this build
/// links, whether CUDA and NVRTC (the fused kernels' compiler) are found here.
pub fn build_and_machine(commit: Option<&str>) -> String {
    let cuda = match tch::Cuda::is_available() {
        true => format!("{} device(s)", tch::Cuda::device_count()),
        false => "not available (CPU only)".to_string(),
    };
    // SAFETY: only asks the dynamic loader whether the library can be opened.
    let nvrtc = match unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        true => "found",
        false => "not found (the fused GPU kernels fall back to plain libtorch)",
    };
    let commit = commit.unwrap_or("unknown (built without make, which passes it in as DFLASH_COMMIT)");
    format!(
        "{}\ncommit {commit}\nlibtorch {} (the one this build links)\nCUDA: {cuda}\nNVRTC: {nvrtc}",
        env!("CARGO_PKG_VERSION"),
        env!("DFLASH_LIBTORCH_VERSION")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_devices() {
        for text in ["cpu", "auto", "cuda:0", "cuda:7"] {
            let spec: DeviceSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        for bad in ["gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CUDA:0"] {
            let err = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains("cuda:N"), "{err}");
        }
    }

    #[test]
    fn cpu_resolves_and_missing_gpus_are_named() {
        assert_eq!(DeviceSpec::Cpu.resolve().unwrap(), Device::Cpu);
        if !tch::Cuda::is_available() {
            let err = DeviceSpec::Cuda(0).resolve().unwrap_err().to_string();
            assert!(err.contains("cuda:0") && err.contains("not available"), "{err}");
            assert_eq!(DeviceSpec::Auto.resolve().unwrap(), Device::Cpu);
        } else {
            let err = DeviceSpec::Cuda(99).resolve().unwrap_err().to_string();
            assert!(err.contains("cuda:99") && err.contains("visible"), "{err}");
        }
    }

    #[test]
    fn dtype_auto_is_f32_on_cpu() {
        assert_eq!(DtypeSpec::Auto.resolve(Device::Cpu), Kind::Float);
        assert_eq!(DtypeSpec::Auto.resolve(Device::Cuda(0)), Kind::BFloat16);
        assert_eq!(DtypeSpec::Bf16.resolve(Device::Cpu), Kind::BFloat16);
        assert!("fp8".parse::<DtypeSpec>().is_err());
    }

    #[test]
    fn cpu_memory_services_are_no_ops() {
        bind_thread(Device::Cpu).unwrap();
        synchronize(Device::Cpu).unwrap();
        assert_eq!(memory_stats(Device::Cpu).unwrap(), MemoryStats::default());
    }
}
