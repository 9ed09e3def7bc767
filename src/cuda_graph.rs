//! CUDA graphs (`csrc/graph.cpp`): a step's kernels captured once and replayed with one launch. Batch-1 decoding
//! launches some 600 small kernels a step, and launching them from the host costs more than the GPU takes to run
//! them; a replay costs one launch. What is captured must not depend on the host between replays: its inputs are
//! tensors written in place before each replay, and its outputs the tensors the captured run returned, which every
//! replay overwrites.
use std::ffi::{c_char, c_int, c_void};

use tch::Device;

use crate::device::{DeviceError, call_shim, synchronize};

unsafe extern "C" {
    fn dflash_graph_available() -> c_int;
}

#[cfg(dflash_cuda_graphs)]
unsafe extern "C" {
    fn dflash_graph_new(device: c_int, out: *mut *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_enter(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_leave(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_capture_begin(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_capture_end(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_replay(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_free(graph: *mut c_void);
}

/// Stand-ins where libtorch has no CUDA: [`CudaGraph::capture`] refuses before calling any of them.
#[cfg(not(dflash_cuda_graphs))]
mod absent {
    use super::*;
    pub unsafe fn dflash_graph_new(_: c_int, _: *mut *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_enter(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_leave(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_capture_begin(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_capture_end(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_replay(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn dflash_graph_free(_: *mut c_void) {}
}
#[cfg(not(dflash_cuda_graphs))]
use absent::*;

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("CUDA graphs need a CUDA device and a libtorch built with CUDA (device {0:?})")]
    Unavailable(Device),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("the step being captured failed: {0}")]
    Step(String),
}

/// A captured step; see the module documentation.
pub struct CudaGraph {
    raw: *mut c_void,
    device: Device,
}

// SAFETY: the graph is replayed by one thread at a time (`&self` methods only launch; the owner decides the thread).
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Whether this build can capture graphs on `device`.
    pub fn available(device: Device) -> bool {
        // SAFETY: plain C call.
        device.is_cuda() && unsafe { dflash_graph_available() } == 1
    }

    /// Runs `step` `warmup` times (lazy initialisation, workspaces and kernel compilation happen outside the
    /// capture), then captures one more run, on a stream of the graph's own after the device's queued work. Returns
    /// the graph and what the captured run returned: its tensors are where every [`CudaGraph::replay`] writes. The
    /// captured run computes nothing: replay once for its result.
    pub fn capture<T, E: std::fmt::Display>(
        device: Device,
        warmup: usize,
        mut step: impl FnMut() -> Result<T, E>,
    ) -> Result<(CudaGraph, T), GraphError> {
        let Device::Cuda(index) = device else {
            return Err(GraphError::Unavailable(device));
        };
        if !Self::available(device) {
            return Err(GraphError::Unavailable(device));
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: plain C call with a valid out-pointer and buffer.
        call_shim(device, |e, n| unsafe { dflash_graph_new(index as c_int, &mut raw, e, n) })?;
        let graph = CudaGraph { raw, device };
        synchronize(device)?;
        graph.call(|g, e, n| unsafe { dflash_graph_enter(g, e, n) })?;
        // From here the thread launches on the graph's stream until `entered` is dropped, whatever `step` does
        // (an error, or a panic unwinding through here): a capture begun is ended, the thread's stream restored.
        let mut entered = Entered { graph: &graph, capturing: false };
        for _ in 0..warmup {
            step().map_err(|e| GraphError::Step(e.to_string()))?;
        }
        synchronize(device)?;
        graph.call(|g, e, n| unsafe { dflash_graph_capture_begin(g, e, n) })?;
        entered.capturing = true;
        let out = step();
        entered.capturing = false;
        let ended = graph.call(|g, e, n| unsafe { dflash_graph_capture_end(g, e, n) });
        drop(entered);
        let out = out.map_err(|e| GraphError::Step(e.to_string()))?;
        ended?;
        synchronize(device)?;
        Ok((graph, out))
    }

    /// Launches the captured kernels on the calling thread's current stream.
    pub fn replay(&self) -> Result<(), GraphError> {
        self.call(|g, e, n| unsafe { dflash_graph_replay(g, e, n) })
    }

    fn call(&self, f: impl FnOnce(*mut c_void, *mut c_char, usize) -> c_int) -> Result<(), GraphError> {
        Ok(call_shim(self.device, |e, n| f(self.raw, e, n))?)
    }
}

/// The calling thread on a graph's stream (and maybe capturing): see [`CudaGraph::capture`].
struct Entered<'a> {
    graph: &'a CudaGraph,
    capturing: bool,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if self.capturing {
            let _ = self.graph.call(|g, e, n| unsafe { dflash_graph_capture_end(g, e, n) });
        }
        if let Err(e) = self.graph.call(|g, e, n| unsafe { dflash_graph_leave(g, e, n) }) {
            tracing::error!("leaving a CUDA graph's stream: {e}");
        }
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `raw` came from dflash_graph_new and is freed once.
        unsafe { dflash_graph_free(self.raw) }
    }
}

/// For GPU tests of graphed steps: the first GPU, bound to the calling thread, where this build can capture graphs
/// there; `None` elsewhere (the test then passes without running).
#[cfg(test)]
pub(crate) fn graph_test_device() -> Option<Device> {
    let device = Device::Cuda(0);
    if !tch::Cuda::is_available() || !CudaGraph::available(device) {
        return None;
    }
    crate::device::bind_thread(device).expect("binding cuda:0 to the test thread");
    Some(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn a_cpu_device_is_refused_before_anything_runs() {
        let mut ran = false;
        let result = CudaGraph::capture(Device::Cpu, 1, || {
            ran = true;
            Ok::<_, String>(())
        });
        assert!(matches!(result, Err(GraphError::Unavailable(Device::Cpu))));
        assert!(!ran);
    }

    /// On a GPU: a replay recomputes the captured step from the inputs written in place since.
    #[test]
    fn a_replay_recomputes_from_inputs_written_in_place() {
        let Some(device) = graph_test_device() else {
            return;
        };
        let x = Tensor::zeros([4], (Kind::Float, device));
        let (graph, y) = CudaGraph::capture(device, 2, || Ok::<_, String>((&x * 2.0 + 1.0).exp2())).unwrap();
        for v in [1.0, 3.0] {
            let _ = x.shallow_clone().fill_(v);
            graph.replay().unwrap();
            let got: Vec<f32> = Vec::try_from(y.to_device(Device::Cpu)).unwrap();
            assert_eq!(got, vec![(2.0 * v as f32 + 1.0).exp2(); 4]);
        }
    }
}
