//! `csrc/graph.cpp`: CUDA graphs: a step's kernels captured once and replayed with one launch. Batch-1 decoding
//! launches some 600 small kernels a step, and launching them from the host costs more than the GPU takes to run
//! them; a replay costs one launch. What is captured must not depend on the host between replays: its inputs are
//! tensors written in place before each replay, and its outputs the tensors the captured run returned, which every
//! replay overwrites.
use super::DeviceFailure;
use std::ffi::{c_char, c_int, c_void};

use tch::Device;

use super::accel::{on_device, synchronize_stream};

// In a build whose libtorch has no CUDA, the shim's functions fail, saying so ([`CudaGraph::available`] is false).
unsafe extern "C" {
    fn dflash_graph_available() -> c_int;
    fn dflash_graph_new(device: c_int, out: *mut *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_enter(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_leave(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_capture_begin(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_capture_end(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_replay(graph: *mut c_void, err: *mut c_char, len: usize) -> c_int;
    fn dflash_graph_free(graph: *mut c_void);
}

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("CUDA graphs need a CUDA device and a libtorch built with CUDA (device {0:?})")]
    Unavailable(Device),
    #[error(transparent)]
    Device(#[from] DeviceFailure),
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
        // SAFETY: takes nothing, only answers whether the shim was built with CUDA graphs.
        device.is_cuda() && unsafe { dflash_graph_available() } == 1
    }

    /// Runs `step` `warmup` times (lazy initialisation, workspaces and kernel compilation happen outside the
    /// capture), then captures one more run, on a stream of the graph's own after the work the calling thread queued
    /// (other threads' streams, such as training's beside an evaluation, are not waited for). Returns
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
        on_device(device, |e, n| unsafe { dflash_graph_new(index as c_int, &mut raw, e, n) })?;
        let graph = CudaGraph { raw, device };
        synchronize_stream(device)?;
        graph.call(dflash_graph_enter)?;
        // From here the thread launches on the graph's stream until `entered` is dropped, whatever `step` does
        // (an error, or a panic unwinding through here): a capture begun is ended, the thread's stream restored.
        let mut entered = Entered { graph: &graph, capturing: false };
        for _ in 0..warmup {
            step().map_err(|e| GraphError::Step(e.to_string()))?;
        }
        synchronize_stream(device)?;
        graph.call(dflash_graph_capture_begin)?;
        entered.capturing = true;
        let out = step();
        entered.capturing = false;
        let ended = graph.call(dflash_graph_capture_end);
        drop(entered);
        let out = out.map_err(|e| GraphError::Step(e.to_string()))?;
        ended?;
        synchronize_stream(device)?;
        Ok((graph, out))
    }

    /// Launches the captured kernels on the calling thread's current stream.
    pub fn replay(&self) -> Result<(), GraphError> {
        self.call(dflash_graph_replay)
    }

    /// Calls one of the shim's functions of a graph (`dflash_graph_enter`, `_replay`, ...) on this one.
    fn call(&self, f: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> c_int) -> Result<(), GraphError> {
        // SAFETY: `raw` is a live graph from dflash_graph_new (freed only when `self` drops), and each of these
        // functions takes a graph and an error buffer of the given length.
        Ok(on_device(self.device, |e, n| unsafe { f(self.raw, e, n) })?)
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
            let _ = self.graph.call(dflash_graph_capture_end);
        }
        if let Err(e) = self.graph.call(dflash_graph_leave) {
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

/// For GPU tests of graphed steps ([`crate::device::gpu_for_tests`]): the first GPU, bound to the calling thread;
/// panics where this build cannot capture graphs.
#[cfg(test)]
pub(crate) fn graph_gpu_for_tests() -> Device {
    let device = crate::device::gpu_for_tests();
    assert!(CudaGraph::available(device), "this build cannot capture CUDA graphs (its libtorch has no CUDA)");
    device
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
    #[ignore = "needs a GPU"]
    fn a_replay_recomputes_from_inputs_written_in_place() {
        let device = graph_gpu_for_tests();
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
