//! `dflash bench`: measures the real hot loops at real shapes and reports throughput, achieved TFLOP/s, MFU against
//! a stated peak, peak device memory and step-time percentiles, optionally with a phase breakdown from device
//! events. The numbers in BENCHMARKS.md come from here.
pub mod decode;
pub mod drafter;
pub mod generate;
pub mod launch;
pub mod target;

pub use decode::{DecodeBenchOptions, DecodeBenchReport, bench_decode};
pub use drafter::{DrafterBenchOptions, DrafterBenchReport, bench_drafter};
pub use generate::{GenerateBenchOptions, GenerateBenchReport, bench_generate};
pub use launch::{LaunchBenchOptions, LaunchBenchReport, bench_launch};
pub use target::{TargetBenchOptions, TargetBenchReport, bench_target, target_flops};

use tch::Device;

use crate::device::{self, DeviceError};
use crate::model::ModelError;
use crate::train::step::TrainError;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Failure(#[from] crate::ffi::DeviceFailure),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("invalid benchmark settings: {0}")]
    Settings(String),
}

impl From<tch::TchError> for BenchError {
    fn from(e: tch::TchError) -> Self {
        BenchError::Model(e.into())
    }
}

/// The preset's drafter at `block_size`, with the configuration's layer attention (when any layer restricts it) and
/// variant.
fn preset_drafter(
    preset: crate::model::Preset,
    block_size: usize,
    layer_attention: &[crate::model::LayerAttention],
    variant: crate::model::Variant,
) -> Result<crate::model::DrafterConfig, BenchError> {
    let mut cfg = crate::model::DrafterConfig::for_preset(preset, block_size);
    if layer_attention.iter().any(|l| l.restricts()) {
        // One attention for every layer of the configuration is one for every layer of the preset's drafter (the
        // tiny presets' have 2 where the configuration counts 5).
        let layers = cfg.decoder.num_hidden_layers;
        let attention = match layer_attention {
            [first, rest @ ..] if rest.iter().all(|l| l == first) => vec![*first; layers],
            each => each.to_vec(),
        };
        cfg = cfg
            .with_layer_attention(attention)
            .map_err(|e| BenchError::Settings(format!("[draft_model] layer_types for the preset's drafter: {e}")))?;
    }
    cfg.with_variant(variant)
        .map_err(|e| BenchError::Settings(format!("[draft_model] variant for the preset's drafter: {e}")))
}

fn check_counts(batch: i64, seq: i64, steps: usize) -> Result<(), BenchError> {
    if batch < 1 || seq < 1 || steps < 1 {
        return Err(BenchError::Settings(format!(
            "batch ({batch}), seq ({seq}) and steps ({steps}) must be at least 1"
        )));
    }
    Ok(())
}

/// Wall-clock milliseconds of timed steps, each ended by a device synchronisation: sorted, and in the order run.
pub struct StepTimes(Vec<f64>, Vec<f64>);

impl StepTimes {
    /// Runs `step` `steps` times on `device`, timing each to completion.
    pub fn measure<E: From<crate::ffi::DeviceFailure>>(
        device: Device,
        steps: usize,
        mut step: impl FnMut() -> Result<(), E>,
    ) -> Result<Self, E> {
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let start = std::time::Instant::now();
            step()?;
            device::synchronize(device)?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let in_order = times.clone();
        times.sort_by(f64::total_cmp);
        Ok(StepTimes(times, in_order))
    }

    /// The times in the order the steps ran (whether slow steps come at a period, or in a run).
    pub fn in_order(&self) -> &[f64] {
        &self.1
    }

    /// The nearest-rank percentile (p in 0..=100).
    pub fn percentile(&self, p: f64) -> f64 {
        let rank = ((p / 100.0) * self.0.len() as f64).ceil() as usize;
        self.0[rank.clamp(1, self.0.len()) - 1]
    }
    pub fn min(&self) -> f64 {
        self.0[0]
    }
    pub fn max(&self) -> f64 {
        self.0[self.0.len() - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One attention set for the configuration's 5 layers fits a preset drafter of any depth; layers that differ
    /// must match its depth.
    #[test]
    fn one_attention_for_every_layer_fits_the_presets_drafter() {
        use crate::model::{LayerAttention, Preset, Variant};
        let sliding = LayerAttention { window: Some(2048), causal: true };
        let cfg = preset_drafter(Preset::Tiny, 16, &[sliding; 5], Variant::DFlash).unwrap();
        assert_eq!(cfg.layer_attention, vec![sliding; 2]);
        let mixed = [sliding, LayerAttention::default(), sliding, sliding, sliding];
        let err = preset_drafter(Preset::Tiny, 16, &mixed, Variant::DFlash).unwrap_err().to_string();
        assert!(err.contains("5 layers given for 2"), "{err}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let t = StepTimes((1..=10).map(f64::from).collect(), vec![]);
        assert_eq!(t.percentile(50.0), 5.0);
        assert_eq!(t.percentile(90.0), 9.0);
        assert_eq!(t.percentile(100.0), 10.0);
        assert_eq!((t.min(), t.max()), (1.0, 10.0));
    }
}
