//! `csrc/nccl.cpp`: NCCL communicators, the engine for a collective across GPUs and hosts (through the NCCL that
//! libtorch_cuda loads). Communicators are non-blocking: joining and every all-reduce wait with a deadline, so a peer
//! that never arrives, or dies mid-collective, surfaces as [`NcclError::Timeout`] instead of a hung thread, and the
//! communicator is aborted when dropped. A survivor then builds a new communicator for the new membership (a new
//! [`NcclId`] shared by its members). Collectives run on the communicator's own stream, ordered after the caller's
//! current stream and before the caller's later work.
use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use tch::{Device, Tensor};
use thiserror::Error;
use torch_sys::C_tensor;

use super::{Failed, call, raw};

unsafe extern "C" {
    fn dflash_nccl_version(out: *mut c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_nccl_unique_id(out: *mut c_char, err: *mut c_char, len: usize) -> c_int;
    fn dflash_nccl_init(
        id: *const c_char,
        rank: c_int,
        nranks: c_int,
        device: c_int,
        timeout_s: f64,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_nccl_all_reduce_sum(
        comm: *mut c_void,
        send: *const C_tensor,
        recv: *mut C_tensor,
        timeout_s: f64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_nccl_broadcast(
        comm: *mut c_void,
        tensor: *mut C_tensor,
        root: c_int,
        timeout_s: f64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_nccl_finalize(comm: *mut c_void, timeout_s: f64, err: *mut c_char, len: usize) -> c_int;
    fn dflash_nccl_abort(comm: *mut c_void);
}

#[derive(Debug, Error)]
pub enum NcclError {
    #[error("NCCL needs CUDA devices; {} is not one", crate::device::device_name(*.0))]
    NotCuda(Device),
    #[error("rank {rank} of {nranks} does not exist")]
    BadRank { rank: usize, nranks: usize },
    #[error("NCCL {what} timed out after {waited:.1} s (limit {limit:.1} s): {message}")]
    Timeout { what: &'static str, waited: f64, limit: f64, message: String },
    #[error("NCCL: {0}")]
    Failed(String),
}

impl From<Failed> for NcclError {
    fn from(failed: Failed) -> Self {
        NcclError::Failed(failed.message)
    }
}

/// The NCCL version loaded in this process, as NCCL codes it (2.28.9 is 22809).
pub fn version() -> Result<i32, NcclError> {
    let mut v = 0;
    // SAFETY: plain C call with valid out-pointer and buffer.
    call(|e, n| unsafe { dflash_nccl_version(&mut v, e, n) })?;
    Ok(v)
}

/// The identity of one communicator: made by one member, handed to every other before they join.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x}{:02x}{:02x}{:02x}..)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

impl NcclId {
    /// The identity's bytes, to hand to members in other processes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// An identity read back from [`NcclId::bytes`]; `None` unless exactly 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(NcclId)
    }

    pub fn new() -> Result<Self, NcclError> {
        let mut id = [0u8; 128];
        // SAFETY: the shim writes exactly 128 bytes.
        call(|e, n| unsafe { dflash_nccl_unique_id(id.as_mut_ptr() as *mut c_char, e, n) })?;
        Ok(NcclId(id))
    }
}

/// One rank's membership of a communicator; aborted when dropped.
#[derive(Debug)]
pub struct NcclComm {
    raw: *mut c_void,
    device: Device,
}

// SAFETY: NCCL communicators may be used from any thread, one call at a time (`&mut self` for collectives).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `nranks` on `device`, waiting at most `timeout` for every rank. NCCL
    /// takes the calling thread's current device, so `device` becomes it (call this from the thread bound to it).
    pub fn join(id: &NcclId, rank: usize, nranks: usize, device: Device, timeout: Duration) -> Result<Self, NcclError> {
        let Device::Cuda(index) = device else {
            return Err(NcclError::NotCuda(device));
        };
        if rank >= nranks {
            return Err(NcclError::BadRank { rank, nranks });
        }
        let mut raw = std::ptr::null_mut();
        let joined = shim_status("join", timeout, |e, n| unsafe {
            // SAFETY: a 128-byte id, valid out-pointer and buffer.
            dflash_nccl_init(
                id.0.as_ptr() as *const c_char,
                rank as c_int,
                nranks as c_int,
                index as c_int,
                timeout.as_secs_f64(),
                &mut raw,
                e,
                n,
            )
        });
        joined?;
        Ok(NcclComm { raw, device })
    }

    /// Sums `send` over the ranks into `recv` (pass the same tensor twice to sum in place), waiting at most `timeout`.
    /// After a timeout the communicator is unusable: drop it (that aborts it) and build a new one.
    pub fn all_reduce_sum(&mut self, send: &Tensor, recv: &Tensor, timeout: Duration) -> Result<(), NcclError> {
        self.check_device(&[send, recv])?;
        shim_status("all-reduce", timeout, |e, n| unsafe {
            // SAFETY: live communicator and tensor handles; the shim validates shapes and devices.
            dflash_nccl_all_reduce_sum(self.raw, send.as_ptr(), raw(recv), timeout.as_secs_f64(), e, n)
        })
    }

    /// Copies rank `root`'s `tensor` into every other rank's `tensor`, waiting at most `timeout` (as
    /// [`NcclComm::all_reduce_sum`]).
    pub fn broadcast(&mut self, tensor: &Tensor, root: usize, timeout: Duration) -> Result<(), NcclError> {
        self.check_device(&[tensor])?;
        shim_status("broadcast", timeout, |e, n| unsafe {
            // SAFETY: live communicator and tensor handle; the shim validates the layout and device.
            dflash_nccl_broadcast(self.raw, raw(tensor), root as c_int, timeout.as_secs_f64(), e, n)
        })
    }

    /// Closes the communicator after what it has in flight, waiting at most `timeout` (then aborting it). Needed
    /// where the other ranks still receive: over the network transport a rank's collective completes while its
    /// proxy may still be sending, and an abort (what dropping does) would cut their receive off.
    pub fn finish(self, timeout: Duration) -> Result<(), NcclError> {
        let comm = std::mem::ManuallyDrop::new(self);
        shim_status("finalize", timeout, |e, n| unsafe {
            // SAFETY: a live communicator, released here exactly once (finalized and destroyed, or aborted).
            dflash_nccl_finalize(comm.raw, timeout.as_secs_f64(), e, n)
        })
    }

    fn check_device(&self, tensors: &[&Tensor]) -> Result<(), NcclError> {
        match tensors.iter().find(|t| t.device() != self.device) {
            Some(t) => Err(NcclError::Failed(format!(
                "a tensor on {:?} given to the communicator of {:?}",
                t.device(),
                self.device
            ))),
            None => Ok(()),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from dflash_nccl_init and is released exactly once.
        unsafe { dflash_nccl_abort(self.raw) };
    }
}

/// Runs a shim call that returns 0 (done), 1 (failed) or 2 (the deadline `timeout` of `what` passed), with an
/// error buffer.
fn shim_status(
    what: &'static str,
    timeout: Duration,
    f: impl FnOnce(*mut c_char, usize) -> c_int,
) -> Result<(), NcclError> {
    call(f).map_err(|failed| match failed.deadline_passed_after {
        Some(waited) => NcclError::Timeout { what, waited, limit: timeout.as_secs_f64(), message: failed.message },
        None => failed.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tch::Kind;

    /// libtorch_cuda loads NCCL wherever the CUDA wheel is installed, GPU or not: the symbols resolve and identities
    /// are made without a GPU (a host's part of the rendezvous).
    #[test]
    fn nccl_is_found_and_makes_distinct_ids_without_a_gpu() {
        let v = version().unwrap();
        assert!(v >= 21800, "NCCL {v} is too old for non-blocking communicators");
        let (a, b) = (NcclId::new().unwrap(), NcclId::new().unwrap());
        assert_ne!(a, b);
        assert_eq!(NcclId::from_bytes(a.bytes()), Some(a));
        assert_eq!(NcclId::from_bytes(&a.bytes()[1..]), None);
    }

    #[test]
    fn cpu_devices_and_bad_ranks_are_refused_before_nccl_is_touched() {
        let id = NcclId([0; 128]);
        let err = NcclComm::join(&id, 0, 1, Device::Cpu, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, NcclError::NotCuda(Device::Cpu)), "{err}");
        let err = NcclComm::join(&id, 2, 2, Device::Cuda(0), Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, NcclError::BadRank { rank: 2, nranks: 2 }), "{err}");
    }

    /// On a GPU: a one-rank communicator sums (an identity) on its own stream, in place and out of place; a
    /// communicator whose other rank never arrives times out and is aborted promptly; a new one works afterwards.
    #[test]
    #[ignore = "needs a GPU"]
    fn on_a_gpu_a_missing_rank_times_out_and_a_rebuilt_communicator_works() {
        let dev = crate::device::gpu_for_tests();
        let mut one = NcclComm::join(&NcclId::new().unwrap(), 0, 1, dev, Duration::from_secs(30)).unwrap();
        let x = Tensor::arange(1000, (Kind::Float, dev)) * 0.5;
        let sum = Tensor::zeros([1000], (Kind::Float, dev));
        one.all_reduce_sum(&x, &sum, Duration::from_secs(30)).unwrap();
        assert!(sum.equal(&x));
        let y = Tensor::randn([4096], (Kind::BFloat16, dev));
        let before = y.copy();
        one.all_reduce_sum(&y, &y, Duration::from_secs(30)).unwrap();
        assert!(y.equal(&before));
        one.broadcast(&y, 0, Duration::from_secs(30)).unwrap();
        assert!(y.equal(&before));
        one.finish(Duration::from_secs(30)).unwrap();

        let started = Instant::now();
        let err = NcclComm::join(&NcclId::new().unwrap(), 0, 2, dev, Duration::from_secs(3)).unwrap_err();
        assert!(matches!(err, NcclError::Timeout { what: "join", .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "the abort took {:?}", started.elapsed());

        let mut rebuilt = NcclComm::join(&NcclId::new().unwrap(), 0, 1, dev, Duration::from_secs(30)).unwrap();
        rebuilt.all_reduce_sum(&x, &sum, Duration::from_secs(30)).unwrap();
        assert!(sum.equal(&x));
    }

    /// On two GPUs, one thread per rank: ranks sum (and the time of a 4.2 GB fp32 gradient's all-reduce is printed);
    /// when rank 1 abandons the communicator mid-run, rank 0's next all-reduce ends in a timeout rather than a hang,
    /// its abort returns promptly, and a communicator rebuilt by both works.
    #[test]
    #[ignore = "needs two GPUs"]
    fn on_two_gpus_a_vanished_peer_times_out_and_the_survivors_rebuild() {
        assert!(tch::Cuda::device_count() >= 2, "this test needs two GPUs");
        use std::sync::{Arc, Barrier};
        let long = Duration::from_secs(60);
        let ids = [NcclId::new().unwrap(), NcclId::new().unwrap()];
        let barrier = Arc::new(Barrier::new(2));
        let ranks: Vec<_> = (0..2usize)
            .map(|rank| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let dev = Device::Cuda(rank);
                    crate::device::bind_thread(dev).unwrap();
                    let mut comm = NcclComm::join(&ids[0], rank, 2, dev, long).unwrap();
                    let x = Tensor::full([1 << 20], rank as f64 + 1.0, (Kind::Float, dev));
                    comm.all_reduce_sum(&x, &x, long).unwrap();
                    assert_eq!(x.min().double_value(&[]), 3.0);
                    assert_eq!(x.max().double_value(&[]), 3.0);
                    let grad = Tensor::ones([1_048_626_432], (Kind::Float, dev));
                    comm.all_reduce_sum(&grad, &grad, long).unwrap();
                    crate::device::synchronize(dev).unwrap();
                    let started = Instant::now();
                    comm.all_reduce_sum(&grad, &grad, long).unwrap();
                    crate::device::synchronize(dev).unwrap();
                    eprintln!("rank {rank}: all-reduce of 4.19 GB fp32 in {:?}", started.elapsed());
                    drop(grad);
                    barrier.wait();
                    if rank == 1 {
                        drop(comm); // vanishes: aborts without taking part in rank 0's next all-reduce
                    } else {
                        let started = Instant::now();
                        let err = comm.all_reduce_sum(&x, &x, Duration::from_secs(5)).unwrap_err();
                        assert!(matches!(err, NcclError::Timeout { .. } | NcclError::Failed(_)), "{err}");
                        let waited = started.elapsed();
                        let started = Instant::now();
                        drop(comm);
                        eprintln!("rank 0: peer gone: {err} after {waited:?}; abort took {:?}", started.elapsed());
                        assert!(waited < Duration::from_secs(15) && started.elapsed() < Duration::from_secs(15));
                    }
                    barrier.wait();
                    let mut rebuilt = NcclComm::join(&ids[1], rank, 2, dev, long).unwrap();
                    let y = Tensor::full([1000], 2.0, (Kind::Float, dev));
                    rebuilt.all_reduce_sum(&y, &y, long).unwrap();
                    assert_eq!(y.min().double_value(&[]), 4.0);
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    }
}
