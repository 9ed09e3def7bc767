//! Tensor handles several threads read and none writes: a round's summed gradient, the target's frozen embedding
//! and LM head lent to the drafters.
use tch::Tensor;

pub struct SharedTensor(Tensor);

// SAFETY: a SharedTensor is created by one thread and only read afterwards; libtorch tensor handles are
// reference-counted atomically and concurrent reads of one storage are safe.
unsafe impl Sync for SharedTensor {}

impl SharedTensor {
    pub fn new(t: Tensor) -> Self {
        SharedTensor(t)
    }
}

impl std::ops::Deref for SharedTensor {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.0
    }
}
