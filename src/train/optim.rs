//! The optimizer over the flat fp32 buffers of [`FlatParams`]: AdamW (decoupled weight decay) through libtorch's fused
//! kernel, one launch for every parameter; or, with `optim.optimizer = "muon"`, Muon for the 2-D weight matrices and
//! AdamW for the rest (speculators' split, [`muon_names`]). Its state is plain tensors of the flat layout (both
//! moments and the step; a Muon matrix keeps its momentum buffer where its first moment would be), saved as
//! `optimizer.safetensors` under the published parameter names (`exp_avg.<param>`, `exp_avg_sq.<param>`,
//! `momentum_buffer.<param>` for Muon's, `step`) and loaded back exactly; a replica copies it as it copies AdamW's.
//! Also the learning-rate schedule and the gradient-clipping factor.
use std::collections::BTreeSet;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::ffi::accel::{AdamwStep, AdamwTensors, MuonStep, fused_adamw, muon_step};
use crate::model::ModelError;
use crate::model::flat_params::{FlatLayout, FlatParams};
use crate::model::weights::{HostTensor, WeightFiles, write_safetensors};

/// Which optimizer updates the weight matrices (`optim.optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// AdamW for every parameter.
    #[default]
    AdamW,
    /// Muon for the 2-D weight matrices ([`muon_names`]), AdamW for the rest.
    Muon,
}

/// Published names of parameters that stay on AdamW even as matrices (speculators' rule: embeddings, codebooks,
/// output heads).
const ADAMW_NAME_HINTS: [&str; 5] = ["embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2"];

/// The parameters Muon updates: every 2-D published tensor with both dimensions above 1 that is not an embedding,
/// codebook or output head (speculators 0.9.0, `train/optimizers.py: split_named_params_for_muon`). Each is
/// orthogonalised on its own, also where the flat layout stacks several (q, k and v are three matrices).
pub fn muon_names(layout: &FlatLayout) -> BTreeSet<String> {
    layout
        .named_shapes()
        .into_iter()
        .filter(|(name, shape)| {
            shape.len() == 2 && shape.iter().all(|&d| d > 1) && !ADAMW_NAME_HINTS.iter().any(|h| name.contains(h))
        })
        .map(|(name, _)| name)
        .collect()
}

/// Muon's step scaled to match AdamW's update RMS (torch.optim.Muon's `match_rms_adamw`, speculators' choice):
/// `lr * 0.2 * sqrt(max(rows, cols))`.
pub fn muon_adjusted_lr(lr: f64, shape: &[i64]) -> f64 {
    let largest = shape.iter().copied().max().unwrap_or(1) as f64;
    lr * 0.2 * largest.sqrt()
}

/// The optimizer's state.
pub struct Optimizer {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// f32 scalar on the parameters' device, as the fused kernel reads it.
    step: Tensor,
    steps: u64,
    /// With Muon: the published names it updates (their momentum buffers sit in `exp_avg`).
    muon: Option<BTreeSet<String>>,
}

impl Optimizer {
    /// A fresh state (zero moments) for `params`.
    pub fn new(params: &FlatParams, kind: OptimizerKind) -> Result<Self, ModelError> {
        let device = params.master.device();
        Ok(Optimizer {
            exp_avg: params.master.f_zeros_like()?,
            exp_avg_sq: params.master.f_zeros_like()?,
            step: Tensor::f_zeros([], (Kind::Float, device))?,
            steps: 0,
            muon: Self::split(params.layout(), kind),
        })
    }

    fn split(layout: &FlatLayout, kind: OptimizerKind) -> Option<BTreeSet<String>> {
        (kind == OptimizerKind::Muon).then(|| muon_names(layout))
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update from the accumulated gradient divided by `grad_divisor` (the summed loss weight times any
    /// clipping factor): AdamW with `settings.adamw` (the divisor folded into the kernel), and with Muon each of its
    /// matrices with `settings.muon`.
    pub fn update(
        &mut self,
        params: &FlatParams,
        settings: &UpdateSettings,
        grad_divisor: f64,
    ) -> Result<(), ModelError> {
        self.steps += 1;
        let _ = self.step.f_fill_(self.steps as f64)?;
        let scale = Tensor::f_from_slice(&[grad_divisor as f32])?.f_to(params.master.device())?.f_squeeze()?;
        let Some(muon) = &self.muon else {
            let t = AdamwTensors {
                params: std::slice::from_ref(&params.master),
                grads: std::slice::from_ref(&params.grad),
                exp_avgs: std::slice::from_ref(&self.exp_avg),
                exp_avg_sqs: std::slice::from_ref(&self.exp_avg_sq),
            };
            tch::no_grad(|| fused_adamw(t, &self.step, settings.adamw, Some(&scale)))?;
            return Ok(());
        };
        let Some(hp) = settings.muon else {
            return Err(ModelError::Torch("the optimizer is Muon's but the step has no Muon settings".into()));
        };
        let layout = params.layout();
        let views = [&params.master, &params.grad, &self.exp_avg, &self.exp_avg_sq].map(|t| layout.named_views(t));
        let mut adamw: [Vec<Tensor>; 4] = Default::default();
        for (i, (name, p)) in views[0].iter().enumerate() {
            let (g, m, v) = (&views[1][i].1, &views[2][i].1, &views[3][i].1);
            if muon.contains(name) {
                let lr = muon_adjusted_lr(hp.lr, &p.size());
                tch::no_grad(|| muon_step(p, g, m, grad_divisor, hp, lr))?;
            } else {
                for (list, t) in adamw.iter_mut().zip([p, g, m, v]) {
                    list.push(t.shallow_clone());
                }
            }
        }
        let [p, g, m, v] = &adamw;
        let t = AdamwTensors { params: p, grads: g, exp_avgs: m, exp_avg_sqs: v };
        tch::no_grad(|| fused_adamw(t, &self.step, settings.adamw, Some(&scale)))?;
        Ok(())
    }

    /// Writes `optimizer.safetensors` at `path`: fp32 moments (and Muon's momentum buffers) under the published
    /// names, and the step.
    pub fn save(&self, path: &Path, layout: &FlatLayout) -> Result<(), ModelError> {
        save_optimizer_state(path, layout, &self.exp_avg, &self.exp_avg_sq, &self.step, self.muon.as_ref())
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

    /// Reads a state written by [`Optimizer::save`] for parameters of `layout` on `device`, of the optimizer `kind`:
    /// a state another optimizer wrote is refused, naming the tensor it lacks.
    pub fn load(
        dir: &Path,
        file: &str,
        layout: &FlatLayout,
        device: Device,
        kind: OptimizerKind,
    ) -> Result<Self, ModelError> {
        let files = WeightFiles::open_file(&dir.join(file))?;
        let muon = Self::split(layout, kind);
        let zeros = || Tensor::f_zeros([layout.total()], (Kind::Float, device));
        let (exp_avg, exp_avg_sq) = (zeros()?, zeros()?);
        tch::no_grad(|| -> Result<(), ModelError> {
            for (prefix, flat) in [("exp_avg", &exp_avg), ("exp_avg_sq", &exp_avg_sq)] {
                for (name, mut view) in layout.named_views(flat) {
                    let Some(key) = state_key(prefix, &name, muon.as_ref()) else { continue };
                    let shape: Vec<usize> = view.size().iter().map(|&d| d as usize).collect();
                    let what = match kind {
                        OptimizerKind::AdamW => "AdamW's state of the drafter's shape (optim.optimizer = \"adamw\")",
                        OptimizerKind::Muon => {
                            "Muon's and AdamW's state of the drafter's shape (optim.optimizer = \"muon\")"
                        }
                    };
                    let t = files.load(&key, &shape, what, Kind::Float, device)?;
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
        Ok(Optimizer { exp_avg, exp_avg_sq, step, steps: steps as u64, muon })
    }

    /// With Muon, the parameters it updates (their first-moment slots hold its momentum buffers).
    pub fn muon_names(&self) -> Option<&BTreeSet<String>> {
        self.muon.as_ref()
    }

    /// The moments, for tests and for copying state to a peer.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.exp_avg, &self.exp_avg_sq)
    }
}

/// The name in `optimizer.safetensors` of the `prefix` moment of parameter `name`: Muon's matrices keep one buffer,
/// `momentum_buffer.<name>` (where AdamW's first moment would be), and no second moment.
fn state_key(prefix: &str, name: &str, muon: Option<&BTreeSet<String>>) -> Option<String> {
    match (muon.is_some_and(|m| m.contains(name)), prefix) {
        (false, _) => Some(format!("{prefix}.{name}")),
        (true, "exp_avg") => Some(format!("momentum_buffer.{name}")),
        (true, _) => None,
    }
}

/// Writes an optimizer state (moments under the published names, Muon's momentum buffers where `muon` names them,
/// and the step) to one safetensors file.
pub fn save_optimizer_state(
    path: &Path,
    layout: &FlatLayout,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: &Tensor,
    muon: Option<&BTreeSet<String>>,
) -> Result<(), ModelError> {
    let mut tensors = Vec::new();
    for (prefix, flat) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        for (name, view) in layout.named_views(flat) {
            if let Some(key) = state_key(prefix, &name, muon) {
                tensors.push((key, HostTensor::from_tensor(&view)?));
            }
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
    /// Muon's step for its matrices (`optim.optimizer = "muon"`); `None`: AdamW for everything.
    #[serde(default)]
    pub muon: Option<MuonStep>,
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
    /// Muon's part (`optim.optimizer = "muon"`): its learning rate follows the same schedule from its own base.
    pub muon: Option<MuonHyper>,
}

/// Muon's hyperparameters (`optim.muon_lr`, `muon_momentum`, `muon_weight_decay`, `muon_ns_steps`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonHyper {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub ns_steps: u32,
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
        let progress = match self.progress {
            Progress::Samples => samples_committed,
            Progress::Steps => step,
        };
        UpdateSettings {
            adamw: AdamwStep {
                lr: self.lr_at(step, samples_committed),
                beta1: self.beta1,
                beta2: self.beta2,
                weight_decay: self.weight_decay,
                eps: self.eps,
            },
            // The schedule from Muon's base rate, as speculators runs one scheduler per optimizer.
            muon: self.muon.map(|m| MuonStep {
                lr: LrSchedule { lr: m.lr, ..self.schedule }.lr_at(progress),
                momentum: m.momentum,
                weight_decay: m.weight_decay,
                ns_steps: m.ns_steps,
            }),
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
        let mut opt = Optimizer::new(&params, OptimizerKind::AdamW).unwrap();
        let hp = AdamwStep { lr: 0.01, beta1: 0.9, beta2: 0.999, weight_decay: 0.1, eps: 1e-8 };
        let (mut p, mut m, mut v) = (
            init.to_kind(Kind::Double),
            init.zeros_like().to_kind(Kind::Double),
            init.zeros_like().to_kind(Kind::Double),
        );
        for step in 1..=3 {
            let g = Tensor::randn([layout.total()], (Kind::Float, Device::Cpu));
            tch::no_grad(|| params.grad.copy_(&(&g * 2.0)));
            opt.update(&params, &UpdateSettings { adamw: hp, muon: None, grad_clip: None }, 2.0).unwrap();
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

    /// Three steps of Muon (three matrices, two of them stacked in one flat group, each orthogonalised on its own) and
    /// AdamW (a norm vector) against torch.optim.Muon and AdamW 2.11 (`scripts/fixtures/make_recipe_fixtures.py`), from
    /// gradients summed over a loss weight of 2 (the divisor the trainer passes).
    #[test]
    fn muon_and_adamw_match_torch() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/muon-torch-2.11.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let floats = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
        };
        let (down, q, k, norm) = (
            "layers.0.mlp.down_proj.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "norm.weight",
        );
        let layout = FlatLayout::new(vec![
            ParamGroup::new(vec![(down.into(), 6)], Some(4), 0.02),
            ParamGroup::new(vec![(q.into(), 3)], Some(5), 0.02),
            ParamGroup::new(vec![(k.into(), 5)], Some(5), 0.02),
            ParamGroup::new(vec![(norm.into(), 4)], None, 0.0),
        ]);
        let stacked = FlatLayout::new(vec![
            ParamGroup::new(vec![(down.into(), 6)], Some(4), 0.02),
            ParamGroup::new(vec![(q.into(), 3), (k.into(), 5)], Some(5), 0.02),
            ParamGroup::new(vec![(norm.into(), 4)], None, 0.0),
        ]);
        for layout in [layout, stacked] {
            assert_eq!(muon_names(&layout), [down, q, k].map(String::from).into_iter().collect());
            let mut params = FlatParams::zeros(layout.clone(), Device::Cpu).unwrap();
            let set = |flat: &Tensor, values: &serde_json::Value| {
                for (name, mut view) in layout.named_views(flat) {
                    let v = Tensor::from_slice(&floats(&values[&name])).view(view.size().as_slice());
                    tch::no_grad(|| view.copy_(&v));
                }
            };
            set(&params.master, &f["initial"]);
            let mut opt = Optimizer::new(&params, OptimizerKind::Muon).unwrap();
            let (m, a) = (&f["muon"], &f["adamw"]);
            let settings = UpdateSettings {
                adamw: AdamwStep {
                    lr: a["lr"].as_f64().unwrap(),
                    beta1: a["betas"][0].as_f64().unwrap(),
                    beta2: a["betas"][1].as_f64().unwrap(),
                    weight_decay: a["weight_decay"].as_f64().unwrap(),
                    eps: a["eps"].as_f64().unwrap(),
                },
                muon: Some(MuonStep {
                    lr: m["lr"].as_f64().unwrap(),
                    momentum: m["momentum"].as_f64().unwrap(),
                    weight_decay: m["weight_decay"].as_f64().unwrap(),
                    ns_steps: m["ns_steps"].as_u64().unwrap() as u32,
                }),
                grad_clip: None,
            };
            for (grads, after) in f["grads"].as_array().unwrap().iter().zip(f["after"].as_array().unwrap()) {
                set(&params.grad, grads);
                let _ = tch::no_grad(|| params.grad.f_mul_scalar_(2.0)).unwrap();
                opt.update(&params, &settings, 2.0).unwrap();
                for (name, view) in layout.named_views(&params.master) {
                    let got = Vec::<f32>::try_from(view.reshape([-1])).unwrap();
                    for (g, e) in got.iter().zip(floats(&after[&name])) {
                        assert!((g - e).abs() <= 2e-6 * e.abs().max(1.0), "{name}: {g} against torch's {e}");
                    }
                }
            }
            // The state saves under Muon's names and loads back exactly; AdamW's loader refuses it.
            let dir = tempfile::tempdir().unwrap();
            opt.save(&dir.path().join("opt.safetensors"), &layout).unwrap();
            let back =
                Optimizer::load(dir.path(), "opt.safetensors", &layout, Device::Cpu, OptimizerKind::Muon).unwrap();
            assert!(back.moments().0.equal(opt.moments().0) && back.steps() == 3);
            let adamw = Optimizer::load(dir.path(), "opt.safetensors", &layout, Device::Cpu, OptimizerKind::AdamW);
            let err = adamw.err().expect("AdamW cannot take Muon's state").to_string();
            assert!(err.contains("exp_avg.layers.0.mlp.down_proj.weight"), "{err}");
        }
    }
}
