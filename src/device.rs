//! Compute devices as users write them (`cpu`, `cuda:N`, `auto`), and the device services tch lacks: binding the
//! calling thread to a device and reading the caching allocator's memory statistics (through `csrc/accel.cpp`).
//!
//! Every compute thread binds its device before it creates a tensor, so that libtorch's current device, streams and
//! kernels land on the GPU the thread owns rather than on GPU 0.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tch::{Device, Kind};

pub use crate::ffi::device_name;

/// The device services of the C++ boundary, by the names a compute thread calls them.
pub use crate::ffi::accel::{
    MemoryStats, Priority, TimingEvent, bind_thread, current_stream_handle, deterministic_gpus, memory_stats,
    reset_peak_memory, synchronize, synchronize_stream, to_pinned_host, use_own_stream,
};

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
    #[error(transparent)]
    Runtime(#[from] crate::ffi::DeviceFailure),
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

/// The first GPU, bound to the calling thread, for tests that need one: they are `#[ignore = "needs a GPU"]`, and
/// `--include-ignored` runs them where there is one (scripts/gpu/bench.sh). Panics where there is none, so that a GPU
/// test asked for fails rather than passes without running.
pub fn gpu_for_tests() -> Device {
    assert!(tch::Cuda::is_available(), "this test needs a GPU, and none is visible here");
    let device = Device::Cuda(0);
    bind_thread(device).expect("binding cuda:0 to the test thread");
    device
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
}
