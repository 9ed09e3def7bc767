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

use crate::ffi::accel::{AdamwStep, AdamwTensors, MuonIteration, MuonStep, fused_adamw};
use crate::model::ModelError;
use crate::model::flat_params::{FlatLayout, FlatParams};
use crate::model::weights::{HostTensor, WeightFiles, write_safetensors};
use crate::train::muon::MuonViews;
pub use crate::train::muon::{MuonPlan, MuonShards, muon_adjusted_lr, muon_names};

/// Which optimizer updates the weight matrices (`optim.optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerKind {
    /// AdamW for every parameter.
    #[default]
    AdamW,
    /// Muon for the 2-D weight matrices ([`muon_names`]), AdamW for the rest.
    Muon,
}

/// The optimizer's state.
pub struct Optimizer {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// f32 scalar on the parameters' device, as the fused kernel reads it.
    step: Tensor,
    steps: u64,
    /// With Muon: the matrices it updates (their momentum buffers sit in `exp_avg`).
    muon: Option<MuonPlan>,
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

    fn split(layout: &FlatLayout, kind: OptimizerKind) -> Option<MuonPlan> {
        (kind == OptimizerKind::Muon).then(|| MuonPlan::new(layout))
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
        self.count_step()?;
        let Some(plan) = &self.muon else {
            let t = AdamwTensors {
                params: std::slice::from_ref(&params.master),
                grads: std::slice::from_ref(&params.grad),
                exp_avgs: std::slice::from_ref(&self.exp_avg),
                exp_avg_sqs: std::slice::from_ref(&self.exp_avg_sq),
            };
            let scale = self.divisor_tensor(grad_divisor, params)?;
            tch::no_grad(|| fused_adamw(t, &self.step, settings.adamw, Some(&scale)))?;
            return Ok(());
        };
        let hp = muon_settings(settings)?;
        let views = self.views(params);
        plan.step(&views.muon(), grad_divisor, hp)?;
        self.adamw_rest(plan, &views, settings, grad_divisor, params)
    }

    /// A data-parallel member's part of a Muon update (every member has the same summed gradient): the momentum of
    /// every matrix, and the orthogonalised updates of `member`'s share of them written into its segment of
    /// `gathered` (bf16, [`MuonShards::gather_len`] elements). Once every member's segment is in `gathered`,
    /// [`Optimizer::apply_gathered`] completes the update; the two give [`Optimizer::update`]'s result bit for bit.
    pub fn orthogonalize_share(
        &mut self,
        params: &FlatParams,
        settings: &UpdateSettings,
        grad_divisor: f64,
        shards: &MuonShards,
        member: usize,
        gathered: &Tensor,
    ) -> Result<(), ModelError> {
        let plan = self.muon_plan()?;
        let views = self.views(params);
        plan.orthogonalize_share(&views.muon(), grad_divisor, muon_settings(settings)?, shards, member, gathered)
    }

    /// The rest of a sharded Muon update: every matrix stepped by its update in `gathered`, AdamW for the others.
    pub fn apply_gathered(
        &mut self,
        params: &FlatParams,
        settings: &UpdateSettings,
        grad_divisor: f64,
        shards: &MuonShards,
        gathered: &Tensor,
    ) -> Result<(), ModelError> {
        self.count_step()?;
        let plan = self.muon_plan()?;
        let views = self.views(params);
        plan.apply_gathered(&views.muon(), muon_settings(settings)?, shards, gathered)?;
        self.adamw_rest(plan, &views, settings, grad_divisor, params)
    }

    fn count_step(&mut self) -> Result<(), ModelError> {
        self.steps += 1;
        let _ = self.step.f_fill_(self.steps as f64)?;
        Ok(())
    }

    fn muon_plan(&self) -> Result<&MuonPlan, ModelError> {
        self.muon.as_ref().ok_or_else(|| ModelError::Torch("a sharded Muon update of an AdamW optimizer".into()))
    }

    /// The divisor as the fused AdamW kernel reads it: a scalar tensor on the parameters' device.
    fn divisor_tensor(&self, grad_divisor: f64, params: &FlatParams) -> Result<Tensor, ModelError> {
        Ok(Tensor::f_from_slice(&[grad_divisor as f32])?.f_to(params.master.device())?.f_squeeze()?)
    }

    fn views(&self, params: &FlatParams) -> LayoutViews {
        let layout = params.layout();
        let [params, grads, exp_avg, exp_avg_sq] = [&params.master, &params.grad, &self.exp_avg, &self.exp_avg_sq]
            .map(|t| layout.named_views(t).into_iter().map(|(_, v)| v).collect::<Vec<_>>());
        LayoutViews { params, grads, exp_avg, exp_avg_sq }
    }

    /// AdamW's update of everything Muon does not update.
    fn adamw_rest(
        &self,
        plan: &MuonPlan,
        views: &LayoutViews,
        settings: &UpdateSettings,
        grad_divisor: f64,
        params: &FlatParams,
    ) -> Result<(), ModelError> {
        let rest = |list: &[Tensor]| -> Vec<Tensor> {
            list.iter().enumerate().filter(|(i, _)| !plan.is_muon_view(*i)).map(|(_, t)| t.shallow_clone()).collect()
        };
        let [p, g, m, v] = [&views.params, &views.grads, &views.exp_avg, &views.exp_avg_sq].map(|l| rest(l));
        let t = AdamwTensors { params: &p, grads: &g, exp_avgs: &m, exp_avg_sqs: &v };
        let scale = self.divisor_tensor(grad_divisor, params)?;
        tch::no_grad(|| fused_adamw(t, &self.step, settings.adamw, Some(&scale)))?;
        Ok(())
    }

    /// Writes `optimizer.safetensors` at `path`: fp32 moments (and Muon's momentum buffers) under the published
    /// names, and the step.
    pub fn save(&self, path: &Path, layout: &FlatLayout) -> Result<(), ModelError> {
        let muon = self.muon.as_ref().map(MuonPlan::names);
        save_optimizer_state(path, layout, &self.exp_avg, &self.exp_avg_sq, &self.step, muon)
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
                    let Some(key) = state_key(prefix, &name, muon.as_ref().map(MuonPlan::names)) else { continue };
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
        self.muon.as_ref().map(MuonPlan::names)
    }

    /// The moments, for tests and for copying state to a peer.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.exp_avg, &self.exp_avg_sq)
    }
}

/// The flat buffers' views, each in [`FlatLayout::named_views`]'s order.
struct LayoutViews {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
}

impl LayoutViews {
    /// What Muon works on (its momentum buffers are the first-moment slots).
    fn muon(&self) -> MuonViews<'_> {
        MuonViews { params: &self.params, grads: &self.grads, momentum: &self.exp_avg }
    }
}

fn muon_settings(settings: &UpdateSettings) -> Result<MuonStep, ModelError> {
    settings.muon.ok_or_else(|| ModelError::Torch("the optimizer is Muon's but the step has no Muon settings".into()))
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

/// Muon's hyperparameters (`optim.muon_lr`, `muon_momentum`, `muon_weight_decay`, `muon_ns_steps`,
/// `muon_iteration`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonHyper {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub ns_steps: u32,
    pub iteration: MuonIteration,
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
                iteration: m.iteration,
            }),
            grad_clip: self.grad_clip,
        }
    }
}

#[cfg(test)]
impl Hyper {
    /// The unit tests' hyperparameters: AdamW at a constant `lr` (betas 0.9 and 0.999, eps 1e-8, no weight decay,
    /// clipping or Muon), progress counted in samples.
    pub(crate) fn constant_for_tests(lr: f64) -> Self {
        Hyper {
            schedule: LrSchedule {
                kind: ScheduleKind::Constant,
                lr,
                warmup_steps: 0,
                total_steps: 100,
                min_lr_ratio: 0.0,
            },
            progress: Progress::Samples,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: None,
            muon: None,
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

    /// Three steps of Muon (seven matrices of three shapes, some stacked in one flat group, each orthogonalised on
    /// its own, each shape's as one batch) and AdamW (a norm vector) against torch.optim.Muon and AdamW 2.11
    /// (`scripts/fixtures/make_recipe_fixtures.py`), from gradients summed over a loss weight of 2 (the divisor the
    /// trainer passes); the same with one matrix a batch, and shared by 2 and 3 data-parallel members whose updates
    /// are gathered: all bit for bit the same.
    #[test]
    fn muon_and_adamw_match_torch() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/muon-torch-2.11.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let floats = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
        };
        let name = |l: u32, p: &str| format!("layers.{l}.{p}.weight");
        let (q, k, v, down) = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj");
        let one = |n: String, rows: i64, cols: i64| ParamGroup::new(vec![(n, rows)], Some(cols), 0.02);
        let norm = || ParamGroup::new(vec![("norm.weight".into(), 4)], None, 0.0);
        let apart = FlatLayout::new(vec![
            one(name(0, down), 6, 4),
            one(name(0, q), 3, 5),
            one(name(0, k), 5, 5),
            one(name(0, v), 3, 5),
            one(name(1, down), 6, 4),
            one(name(1, q), 3, 5),
            one(name(1, k), 5, 5),
            norm(),
        ]);
        let stacked = FlatLayout::new(vec![
            one(name(0, down), 6, 4),
            ParamGroup::new(vec![(name(0, q), 3), (name(0, k), 5), (name(0, v), 3)], Some(5), 0.02),
            norm(),
            one(name(1, down), 6, 4),
            ParamGroup::new(vec![(name(1, q), 3), (name(1, k), 5)], Some(5), 0.02),
        ]);
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
                iteration: MuonIteration::NewtonSchulz,
            }),
            grad_clip: None,
        };
        for layout in [apart, stacked] {
            let expected: BTreeSet<String> =
                [0, 1].iter().flat_map(|&l| [name(l, down), name(l, q), name(l, k)]).chain([name(0, v)]).collect();
            assert_eq!(muon_names(&layout), expected);
            let set = |flat: &Tensor, values: &serde_json::Value| {
                for (name, mut view) in layout.named_views(flat) {
                    let v = Tensor::from_slice(&floats(&values[&name])).view(view.size().as_slice());
                    tch::no_grad(|| view.copy_(&v));
                }
            };
            let replica = || {
                let params = FlatParams::zeros(layout.clone(), Device::Cpu).unwrap();
                set(&params.master, &f["initial"]);
                let opt = Optimizer::new(&params, OptimizerKind::Muon).unwrap();
                (params, opt)
            };
            // One drafter with the default batches, one with a matrix a batch, and 2 and 3 members sharing the work.
            let (params, mut opt) = replica();
            let (single_params, mut single) = replica();
            single.muon = Some(MuonPlan::with_batch_elements(&layout, 1));
            let mut groups: Vec<(MuonShards, Vec<(FlatParams, Optimizer)>)> = [2, 3]
                .into_iter()
                .map(|n| (MuonPlan::new(&layout).shards(n), (0..n).map(|_| replica()).collect()))
                .collect();
            for (grads, after) in f["grads"].as_array().unwrap().iter().zip(f["after"].as_array().unwrap()) {
                let all = std::iter::once(&params)
                    .chain([&single_params])
                    .chain(groups.iter().flat_map(|(_, members)| members.iter().map(|(p, _)| p)));
                for p in all {
                    set(&p.grad, grads);
                    let _ = tch::no_grad(|| p.grad.shallow_clone().f_mul_scalar_(2.0)).unwrap();
                }
                opt.update(&params, &settings, 2.0).unwrap();
                single.update(&single_params, &settings, 2.0).unwrap();
                for (shards, members) in &mut groups {
                    let buffers: Vec<Tensor> = (0..members.len())
                        .map(|_| Tensor::zeros([shards.gather_len()], (Kind::BFloat16, Device::Cpu)))
                        .collect();
                    for (member, (p, o)) in members.iter_mut().enumerate() {
                        o.orthogonalize_share(p, &settings, 2.0, shards, member, &buffers[member]).unwrap();
                    }
                    // The all-gather: each member's segment from the member that computed it.
                    let gathered = Tensor::zeros([shards.gather_len()], (Kind::BFloat16, Device::Cpu));
                    for (member, buffer) in buffers.iter().enumerate() {
                        let s = shards.segment(member);
                        gathered.narrow(0, s.start, s.end - s.start).copy_(&buffer.narrow(0, s.start, s.end - s.start));
                    }
                    for (p, o) in members.iter_mut() {
                        o.apply_gathered(p, &settings, 2.0, shards, &gathered).unwrap();
                    }
                }
                for (name, view) in layout.named_views(&params.master) {
                    let got = Vec::<f32>::try_from(view.reshape([-1])).unwrap();
                    for (g, e) in got.iter().zip(floats(&after[&name])) {
                        assert!((g - e).abs() <= 2e-6 * e.abs().max(1.0), "{name}: {g} against torch's {e}");
                    }
                }
                assert!(single_params.master.equal(&params.master), "a matrix a batch changes nothing");
                for (shards, members) in &groups {
                    for (member, (p, o)) in members.iter().enumerate() {
                        let n = members.len();
                        assert!(p.master.equal(&params.master), "member {member} of {n}: parameters");
                        assert!(o.moments().0.equal(opt.moments().0), "member {member} of {n}: momentum");
                        assert!(!shards.share(member).is_empty() && o.steps() == opt.steps());
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
