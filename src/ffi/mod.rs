//! The C++ boundary: every call into the shim in `csrc/` (C++ against the libtorch headers, compiled by `build.rs`)
//! for what tch does not bind, one file here for each file there. Nothing outside this module declares a C function
//! of the shim or dereferences what one returns.
//!
//! Every shim function takes an error buffer and runs its body through `guard` (`csrc/shim_error.h`): a C++
//! exception comes back as a non-zero status (or a null pointer) and the first line of its message in the buffer.
//! [`call`] is the one place such a buffer is made and read; each file turns a [`Failed`] call into its own error.
pub mod accel;
pub mod attention;
pub mod autograd;
pub mod graph;
pub mod nccl;
pub mod store;

use std::ffi::{CStr, c_char, c_int};
use std::time::Instant;

use tch::Tensor;
use torch_sys::C_tensor;

/// The status a shim function with a deadline returns when it passed (`csrc/nccl.cpp`, `csrc/store.cpp`).
const TIMED_OUT: c_int = 2;

/// The size of the error buffer: longer messages are cut (the shim always ends them with a NUL).
const ERROR_BUFFER: usize = 512;

/// A shim call that failed: what it wrote, and for a function with a deadline that passed ([`TIMED_OUT`]), the
/// seconds the call waited.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failed {
    pub message: String,
    pub deadline_passed_after: Option<f64>,
}

/// A call across the boundary that failed on a device: what libtorch (or the CUDA runtime) said there. The device
/// layer above wraps it in its own error ([`crate::device::DeviceError`]).
#[derive(Debug, thiserror::Error)]
#[error("libtorch on {}: {message}", device_name(*device))]
pub struct DeviceFailure {
    pub device: tch::Device,
    pub message: String,
}

/// A device as users write it: `cpu`, `cuda:N` (here, beneath the device layer, so that libtorch's errors name
/// devices the same way; [`crate::device`] re-exports it).
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        tch::Device::Cpu => "cpu".to_string(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Calls a shim function with an error buffer: done when it returns 0, else [`Failed`] with the message it wrote.
pub(crate) fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), Failed> {
    let mut buffer = [0u8; ERROR_BUFFER];
    let started = Instant::now();
    let status = f(buffer.as_mut_ptr().cast(), buffer.len());
    match status {
        0 => Ok(()),
        status => Err(Failed {
            message: message(&buffer),
            deadline_passed_after: (status == TIMED_OUT).then(|| started.elapsed().as_secs_f64()),
        }),
    }
}

/// Calls a shim function that returns a new `at::Tensor*`, null when it failed; the returned Tensor owns it.
pub(crate) fn call_for_tensor(f: impl FnOnce(*mut c_char, usize) -> *mut C_tensor) -> Result<Tensor, Failed> {
    let mut out = std::ptr::null_mut();
    call(|e, n| {
        out = f(e, n);
        c_int::from(out.is_null())
    })?;
    // SAFETY: a non-null at::Tensor* the shim allocated with `new` and handed over: the Tensor owns it from here.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// A tch tensor's `at::Tensor*`, as shim functions take it: borrowed for the call, never kept or freed.
pub(crate) fn raw(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// The message in an error buffer: up to its first NUL (a buffer without one is read whole).
fn message(buffer: &[u8]) -> String {
    match CStr::from_bytes_until_nul(buffer) {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(buffer).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &[u8]) -> impl FnOnce(*mut c_char, usize) -> c_int {
        move |buffer, len| {
            // SAFETY: `buffer` has `len` writable bytes (call's own array); at most `len` are written.
            let out = unsafe { std::slice::from_raw_parts_mut(buffer.cast::<u8>(), len) };
            let n = text.len().min(len);
            out[..n].copy_from_slice(&text[..n]);
            1
        }
    }

    #[test]
    fn a_failed_call_carries_its_status_and_the_message_up_to_its_nul() {
        assert_eq!(call(|_, _| 0), Ok(()));
        let failed = call(write(b"CUDA error: out of memory\0junk")).unwrap_err();
        assert_eq!(failed, Failed { message: "CUDA error: out of memory".into(), deadline_passed_after: None });
        let late = call(|_, _| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            TIMED_OUT
        });
        assert!(late.unwrap_err().deadline_passed_after.is_some_and(|s| s >= 0.02), "the seconds it waited");
        // A message that filled the buffer without its NUL is still read, cut at the buffer's end.
        let long = vec![b'x'; ERROR_BUFFER + 10];
        assert_eq!(call(write(&long)).unwrap_err().message.len(), ERROR_BUFFER);
    }
}
