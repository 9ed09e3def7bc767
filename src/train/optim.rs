//! AdamW (decoupled weight decay) over the flat fp32 buffers of [`FlatParams`], through libtorch's fused kernel:
//! one launch updates every parameter. Its state (both moments and the step) is plain tensors, saved as
//! `optimizer.safetensors` (`exp_avg.<param>`, `exp_avg_sq.<param>`, `step`) under the published parameter names,
//! and loaded back exactly. Also the learning-rate schedule and the gradient-clipping factor.
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::ffi::accel::{AdamwStep, fused_adamw};
use crate::model::ModelError;
use crate::model::flat_params::{FlatLayout, FlatParams};
use crate::model::weights::{HostTensor, WeightFiles, write_safetensors};

/// AdamW state.
pub struct AdamW {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// f32 scalar on the parameters' device, as the fused kernel reads it.
    step: Tensor,
    steps: u64,
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(params: &FlatParams) -> Result<Self, ModelError> {
        let device = params.master.device();
        Ok(AdamW {
            exp_avg: params.master.f_zeros_like()?,
            exp_avg_sq: params.master.f_zeros_like()?,
            step: Tensor::f_zeros([], (Kind::Float, device))?,
            steps: 0,
        })
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update from the accumulated gradient divided by `grad_divisor` (the summed loss weight times any
    /// clipping factor), folded into the kernel.
    pub fn update(&mut self, params: &FlatParams, hp: AdamwStep, grad_divisor: f64) -> Result<(), ModelError> {
        self.steps += 1;
        let _ = self.step.f_fill_(self.steps as f64)?;
        let scale = Tensor::f_from_slice(&[grad_divisor as f32])?.f_to(params.master.device())?.f_squeeze()?;
        tch::no_grad(|| {
            fused_adamw(&params.master, &params.grad, &self.exp_avg, &self.exp_avg_sq, &self.step, hp, Some(&scale))
        })?;
        Ok(())
    }

    /// Writes `optimizer.safetensors` at `path`: fp32 moments under the published names, and the step.
    pub fn save(&self, path: &Path, layout: &FlatLayout) -> Result<(), ModelError> {
        save_optimizer_state(path, layout, &self.exp_avg, &self.exp_avg_sq, &self.step)
    }

    /// The moments and the step tensor, for copying state to a joining replica.
    pub fn state_tensors(&self) -> [&Tensor; 3] {
        [&self.exp_avg, &self.exp_avg_sq, &self.step]
    }

    /// Sets the count of applied updates (after the tensors were copied from a peer).
    pub fn set_steps(&mut self, steps: u64) -> Result<(), ModelError> {
        self.steps = steps;
        let _ = self.step.f_fill_(steps as f64)?;
        Ok(())
    }

    /// Reads a state written by [`AdamW::save`] for parameters of `layout` on `device`.
    pub fn load(dir: &Path, file: &str, layout: &FlatLayout, device: Device) -> Result<Self, ModelError> {
        let files = WeightFiles::open_file(&dir.join(file))?;
        let zeros = || Tensor::f_zeros([layout.total()], (Kind::Float, device));
        let (exp_avg, exp_avg_sq) = (zeros()?, zeros()?);
        tch::no_grad(|| -> Result<(), ModelError> {
            for (prefix, flat) in [("exp_avg", &exp_avg), ("exp_avg_sq", &exp_avg_sq)] {
                for (name, mut view) in layout.named_views(flat) {
                    let shape: Vec<usize> = view.size().iter().map(|&d| d as usize).collect();
                    let t =
                        files.load(&format!("{prefix}.{name}"), &shape, "the drafter's shape", Kind::Float, device)?;
                    view.f_copy_(&t)?;
                }
            }
            Ok(())
        })?;
        let step = files.load("step", &[], "a scalar step count", Kind::Float, device)?;
        let steps = step.f_double_value(&[])?;
        if !(steps >= 0.0 && steps.fract() == 0.0) {
            return Err(ModelError::Torch(format!("optimizer step {steps} is not a whole number")));
        }
        Ok(AdamW { exp_avg, exp_avg_sq, step, steps: steps as u64 })
    }

    /// The moments, for tests and for copying state to a peer.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.exp_avg, &self.exp_avg_sq)
    }
}

/// Writes an optimizer state (moments under the published names, and the step) to one safetensors file.
pub fn save_optimizer_state(
    path: &Path,
    layout: &FlatLayout,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: &Tensor,
) -> Result<(), ModelError> {
    let mut tensors = Vec::new();
    for (prefix, flat) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        for (name, view) in layout.named_views(flat) {
            tensors.push((format!("{prefix}.{name}"), HostTensor::from_tensor(&view)?));
        }
    }
    tensors.push(("step".to_string(), HostTensor::from_tensor(step)?));
    write_safetensors(path, &tensors, None)
}

/// How the learning rate moves over the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScheduleKind {
    /// Linear warmup, then cosine decay to `min_lr_ratio * lr` at `total_steps`.
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub min_lr_ratio: f64,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                let floor = self.lr * self.min_lr_ratio;
                floor + (self.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// The factor that brings a gradient of global norm `norm` down to `max_norm` (1 when it is already below).
pub fn clip_factor(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(m) if norm > m => m / (norm + 1e-6),
        _ => 1.0,
    }
}

/// The hyperparameters of one update (applied by step number, so every replica applies the same).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UpdateSettings {
    pub adamw: AdamwStep,
    /// Clip the global gradient norm to this; `None`: no clipping.
    pub grad_clip: Option<f64>,
}

/// What the learning-rate schedule counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Committed samples (a run bounded by epochs): the rate does not depend on how many drafters are live.
    Samples,
    /// Committed steps (a run bounded by `optim.max_steps`).
    Steps,
}

/// Hyperparameters of the update, by progress through the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate by progress (`total_steps` and `warmup_steps` count what `progress` counts).
    pub schedule: LrSchedule,
    pub progress: Progress,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_clip: Option<f64>,
}

impl Hyper {
    /// The learning rate of step `step`, taken after `samples_committed` samples.
    pub fn lr_at(&self, step: u64, samples_committed: u64) -> f64 {
        self.schedule.lr_at(match self.progress {
            Progress::Samples => samples_committed,
            Progress::Steps => step,
        })
    }

    pub(crate) fn update(&self, step: u64, samples_committed: u64) -> UpdateSettings {
        UpdateSettings {
            adamw: AdamwStep {
                lr: self.lr_at(step, samples_committed),
                beta1: self.beta1,
                beta2: self.beta2,
                weight_decay: self.weight_decay,
                eps: self.eps,
            },
            grad_clip: self.grad_clip,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::flat_params::ParamGroup;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s =
            LrSchedule { kind: ScheduleKind::Cosine, lr: 1.0, warmup_steps: 4, total_steps: 104, min_lr_ratio: 0.1 };
        assert_eq!(s.lr_at(0), 0.25);
        assert_eq!(s.lr_at(3), 1.0);
        assert!((s.lr_at(4) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(54) - 0.55).abs() < 1e-12);
        assert!((s.lr_at(104) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(500) - 0.1).abs() < 1e-12);
        let c = LrSchedule { kind: ScheduleKind::Constant, ..s };
        assert_eq!(c.lr_at(500), 1.0);
    }

    #[test]
    fn clipping_only_shrinks() {
        assert_eq!(clip_factor(0.5, Some(1.0)), 1.0);
        assert!((clip_factor(4.0, Some(1.0)) - 0.25).abs() < 1e-6);
        assert_eq!(clip_factor(4.0, None), 1.0);
    }

    /// The fused kernel against AdamW written out (PyTorch's formulation), over a few steps.
    #[test]
    fn fused_update_matches_the_textbook_formula() {
        let layout = FlatLayout::new(vec![
            ParamGroup::new(vec![("a".into(), 3), ("b".into(), 2)], Some(4), 0.02),
            ParamGroup::new(vec![("n".into(), 5)], None, 0.0),
        ]);
        let mut params = FlatParams::zeros(layout.clone(), Device::Cpu).unwrap();
        tch::manual_seed(0);
        let init = Tensor::randn([layout.total()], (Kind::Float, Device::Cpu));
        tch::no_grad(|| params.master.copy_(&init));
        let mut opt = AdamW::new(&params).unwrap();
        let hp = AdamwStep { lr: 0.01, beta1: 0.9, beta2: 0.999, weight_decay: 0.1, eps: 1e-8 };
        let (mut p, mut m, mut v) = (
            init.to_kind(Kind::Double),
            init.zeros_like().to_kind(Kind::Double),
            init.zeros_like().to_kind(Kind::Double),
        );
        for step in 1..=3 {
            let g = Tensor::randn([layout.total()], (Kind::Float, Device::Cpu));
            tch::no_grad(|| params.grad.copy_(&(&g * 2.0)));
            opt.update(&params, hp, 2.0).unwrap();
            let g = g.to_kind(Kind::Double);
            p = &p * (1.0 - hp.lr * hp.weight_decay);
            m = &m * hp.beta1 + &g * (1.0 - hp.beta1);
            v = &v * hp.beta2 + &g * &g * (1.0 - hp.beta2);
            let mh = &m / (1.0 - hp.beta1.powi(step));
            let vh = &v / (1.0 - hp.beta2.powi(step));
            p = &p - mh * hp.lr / (vh.sqrt() + hp.eps);
        }
        let err = (&params.master.to_kind(Kind::Double) - &p).abs().max().double_value(&[]);
        assert!(err < 1e-6, "fused AdamW differs from the formula by {err}");
        assert_eq!(opt.steps(), 3);
    }
}
