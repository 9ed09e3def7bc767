//! Tensor handles several threads read and none writes: a round's summed gradient, the target's frozen embedding
//! and LM head lent to the drafters. Safe code gets no handle on the shared storage (a `&Tensor` would do: any
//! handle can be shallow-cloned and written): only copies out of it, and an `unsafe` alias whose caller promises to
//! read only.
use tch::{TchError, Tensor};

pub struct SharedTensor(Tensor);

// SAFETY: a SharedTensor is created by one thread and only read afterwards (no method writes it, and the only
// handle on its storage comes from `alias`, whose callers promise to read only); libtorch tensor handles are
// reference-counted atomically and concurrent reads of one storage are safe.
unsafe impl Sync for SharedTensor {}

impl SharedTensor {
    pub fn new(t: Tensor) -> Self {
        SharedTensor(t)
    }

    /// Copies the shared values into `dst` (nothing to do when `dst` is this very storage: a round with one
    /// contributor shares that contributor's own gradient).
    pub fn copy_into(&self, dst: &mut Tensor) -> Result<(), TchError> {
        if dst.data_ptr() != self.0.data_ptr() {
            dst.f_copy_(&self.0)?;
        }
        Ok(())
    }

    /// A new tensor holding a copy of the values, on the same device.
    pub fn to_copy(&self) -> Result<Tensor, TchError> {
        self.0.f_detach_copy()
    }

    /// A handle on the shared storage itself (no copy).
    ///
    /// # Safety
    /// Other threads read the storage concurrently: the caller, and everything it hands the handle to, must only
    /// read it (no in-place operation, no `copy_`, no optimizer step).
    pub unsafe fn alias(&self) -> Tensor {
        self.0.shallow_clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_come_out_and_a_copy_into_itself_is_nothing() {
        let t = Tensor::from_slice(&[1.0f32, 2.0]);
        let shared = SharedTensor::new(t.shallow_clone());
        let mut other = Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
        shared.copy_into(&mut other).unwrap();
        assert!(other.equal(&t));
        let mut copy = shared.to_copy().unwrap();
        let _ = copy.fill_(5.0);
        assert!(!copy.equal(&t), "a copy does not write the shared storage");
        let mut same = t.shallow_clone();
        shared.copy_into(&mut same).unwrap();
        assert!(same.equal(&t));
    }
}
