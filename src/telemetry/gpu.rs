//! Which physical GPU a CUDA device is, in the terms NVIDIA's DCGM exporter labels its metrics with: the NVML index
//! (`gpu`) and the UUID (`UUID`, `GPU-...`). CUDA ordinals are renumbered by `CUDA_VISIBLE_DEVICES`; the PCI bus id
//! is not, so the CUDA runtime's bus id is looked up in NVML. Nothing here is needed to train: when the CUDA runtime
//! or NVML cannot answer, the labels fall back to the CUDA ordinal and an empty UUID.
use std::ffi::{CStr, c_char, c_int};

use tch::Device;

/// The labels of one device's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuIdentity {
    /// `cpu`, `cuda:N` (as the configuration names it).
    pub device: String,
    /// NVML's index of the physical GPU (empty on the CPU).
    pub gpu: String,
    /// NVML's UUID, `GPU-xxxxxxxx-...` (empty on the CPU or when NVML is missing).
    pub uuid: String,
}

impl GpuIdentity {
    /// Looks `device` up (once per call: callers cache it).
    pub fn of(device: Device) -> Self {
        let name = crate::device::device_name(device);
        let Device::Cuda(ordinal) = device else {
            return GpuIdentity { device: name, gpu: String::new(), uuid: String::new() };
        };
        match physical(ordinal) {
            Ok((index, uuid)) => GpuIdentity { device: name, gpu: index.to_string(), uuid },
            Err(why) => {
                tracing::warn!(device = %name, "GPU identity unknown ({why}): labelled gpu=\"{ordinal}\" without a UUID");
                GpuIdentity { device: name, gpu: ordinal.to_string(), uuid: String::new() }
            }
        }
    }
}

type PciBusIdFn = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;

/// The CUDA runtime's PCI bus id of CUDA device `ordinal` (libtorch loads the runtime; it is looked up, not linked).
fn pci_bus_id(ordinal: usize) -> Result<String, String> {
    // SAFETY: dlsym on the global scope with a NUL-terminated name; the symbol, when found, has this signature
    // (cudaError_t cudaDeviceGetPCIBusId(char*, int, int)).
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cudaDeviceGetPCIBusId".as_ptr()) };
    if f.is_null() {
        return Err("the CUDA runtime is not loaded".into());
    }
    // SAFETY: a non-null address of that function (above): a pointer-sized value reinterpreted as its type.
    let f: PciBusIdFn = unsafe { std::mem::transmute::<*mut libc::c_void, PciBusIdFn>(f) };
    let mut buf = [0 as c_char; 64];
    // SAFETY: the buffer is as long as the length passed.
    let rc = unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, ordinal as c_int) };
    if rc != 0 {
        return Err(format!("cudaDeviceGetPCIBusId({ordinal}) returned {rc}"));
    }
    // SAFETY: the runtime writes a NUL-terminated string into the buffer.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

fn physical(ordinal: usize) -> Result<(u32, String), String> {
    let bus = pci_bus_id(ordinal)?;
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML: {e}"))?;
    let dev = nvml.device_by_pci_bus_id(bus.clone()).map_err(|e| format!("NVML has no GPU at {bus}: {e}"))?;
    let index = dev.index().map_err(|e| format!("NVML index: {e}"))?;
    let uuid = dev.uuid().map_err(|e| format!("NVML UUID: {e}"))?;
    Ok((index, uuid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_gpu_labels() {
        let id = GpuIdentity::of(Device::Cpu);
        assert_eq!(id, GpuIdentity { device: "cpu".into(), gpu: String::new(), uuid: String::new() });
    }
}
