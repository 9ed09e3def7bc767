//! Random initial weights, the same way for the target presets and the drafter: either a portable ChaCha8 stream on
//! the CPU (the same weights on every machine: tests and the tiny default), or the device's own generator seeded
//! once (fast for billions of weights, reproducible on one kind of device).
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use tch::{Device, Kind, Tensor};

use super::ModelError;

/// Where initial weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// A ChaCha8 stream on the CPU seeded with this value.
    Portable(u64),
    /// The device's generator seeded with this value.
    Device(u64),
}

/// A stream of initial weights on one device.
pub struct InitStream {
    rng: Option<ChaCha8Rng>,
    device: Device,
}

impl InitStream {
    pub fn new(init: Init, device: Device) -> Self {
        let rng = match init {
            Init::Portable(seed) => Some(ChaCha8Rng::seed_from_u64(seed)),
            Init::Device(seed) => {
                tch::manual_seed(seed as i64);
                None
            }
        };
        InitStream { rng, device }
    }

    /// The next tensor of `shape` drawn from N(0, std^2), or all ones when `std` is 0 (norm weights), in `kind`.
    pub fn next(&mut self, shape: &[i64], std: f64, kind: Kind) -> Result<Tensor, ModelError> {
        if std == 0.0 {
            return Ok(Tensor::f_ones(shape, (kind, self.device))?);
        }
        let values = match self.rng.as_mut() {
            Some(rng) => {
                let normal = Normal::new(0.0f32, std as f32).expect("finite std");
                let numel: i64 = shape.iter().product();
                let v: Vec<f32> = (0..numel).map(|_| normal.sample(rng)).collect();
                Tensor::f_from_slice(&v)?.f_view(shape)?.f_to(self.device)?
            }
            None => Tensor::f_randn(shape, (Kind::Float, self.device))? * std,
        };
        Ok(values.f_to_kind(kind)?)
    }
}
