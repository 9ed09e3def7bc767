//! Trained parameters kept in one flat fp32 buffer, with their gradients in a second flat buffer of the same layout.
//!
//! Why flat: AdamW over the whole model is then one fused kernel over four buffers, clipping is one norm, the
//! gradient all-reduce of data parallelism is one buffer, and a replica copies another's state in one copy. Each
//! parameter group is an autograd leaf whose storage is a slice of the master buffer and whose `.grad` is preset to
//! the matching slice of the gradient buffer, so backward accumulates straight into the flat gradient.
//!
//! A group may hold several published tensors stacked along rows (q/k/v, gate/up), so the forward pass runs one
//! matrix product where the published format has several; names and shapes at the file boundary stay the
//! published ones.
use tch::{Device, Kind, Tensor};

use super::ModelError;
use crate::ffi::accel::set_grad;

/// Offsets are rounded up to this many elements (512 bytes in fp32), so every view is well aligned.
const ALIGN: i64 = 128;

/// One autograd leaf: a 1-D or 2-D block of the flat buffer, made of one or more published tensors stacked by rows
/// (or one published tensor of more dimensions, kept as a matrix of its first dimensions by its last).
#[derive(Debug, Clone)]
pub struct ParamGroup {
    /// Published tensor names and their row counts, in stacking order.
    pub parts: Vec<(String, i64)>,
    /// `[rows]` for vectors, `[rows, cols]` for matrices.
    pub shape: Vec<i64>,
    /// How a fresh drafter fills it.
    pub init: GroupInit,
    /// The published shape of a group of one tensor of more than two dimensions.
    published: Option<Vec<i64>>,
    offset: i64,
}

/// How a fresh parameter group is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GroupInit {
    /// Normal weights of this standard deviation.
    Normal(f64),
    /// Ones (norm weights).
    Ones,
    /// Zeros.
    Zeros,
    /// Identity convolution kernels `[.., taps, cols]` (rows of `taps` kernels): tap 0 one, the others zero.
    FirstTap { taps: i64 },
}

impl ParamGroup {
    /// A group of `parts` stacked by rows, `cols` wide (or vectors), initialised from N(0, init_std^2), or ones
    /// where `init_std` is 0.
    pub fn new(parts: Vec<(String, i64)>, cols: Option<i64>, init_std: f64) -> Self {
        let rows: i64 = parts.iter().map(|(_, r)| r).sum();
        let shape = match cols {
            Some(c) => vec![rows, c],
            None => vec![rows],
        };
        let init = if init_std == 0.0 { GroupInit::Ones } else { GroupInit::Normal(init_std) };
        ParamGroup { parts, shape, init, published: None, offset: 0 }
    }

    /// One published tensor `name` of `shape` (any number of dimensions, at least two), filled by `init`; the group
    /// is its matrix of the first dimensions by the last.
    pub fn tensor(name: String, shape: &[i64], init: GroupInit) -> Self {
        let (cols, rows) = (shape.last().copied().unwrap_or(1), shape.iter().rev().skip(1).product());
        let published = (shape.len() > 2).then(|| shape.to_vec());
        ParamGroup { parts: vec![(name, rows)], shape: vec![rows, cols], init, published, offset: 0 }
    }
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
    fn cols(&self) -> i64 {
        self.shape.get(1).copied().unwrap_or(1)
    }
}

/// The layout of a flat buffer: groups at aligned offsets.
#[derive(Debug, Clone)]
pub struct FlatLayout {
    groups: Vec<ParamGroup>,
    total: i64,
}

impl FlatLayout {
    pub fn new(mut groups: Vec<ParamGroup>) -> Self {
        let mut offset = 0;
        for g in &mut groups {
            g.offset = offset;
            offset += (g.numel() + ALIGN - 1) / ALIGN * ALIGN;
        }
        FlatLayout { groups, total: offset }
    }
    /// Elements in the buffer, alignment padding included.
    pub fn total(&self) -> i64 {
        self.total
    }
    /// Trained parameters, padding excluded.
    pub fn num_params(&self) -> i64 {
        self.groups.iter().map(ParamGroup::numel).sum()
    }
    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The view of group `i` in `flat`.
    pub fn group_view(&self, flat: &Tensor, i: usize) -> Tensor {
        let g = &self.groups[i];
        flat.narrow(0, g.offset, g.numel()).view(g.shape.as_slice())
    }

    /// Every published tensor as a view of `flat` (any buffer of this layout), in layout order.
    pub fn named_views(&self, flat: &Tensor) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for g in &self.groups {
            let cols = g.cols();
            let mut row = 0;
            for (name, rows) in &g.parts {
                let view = flat.narrow(0, g.offset + row * cols, rows * cols);
                let view = match &g.published {
                    Some(shape) => view.view(shape.as_slice()),
                    None if g.shape.len() == 2 => view.view([*rows, cols]),
                    None => view,
                };
                out.push((name.clone(), view));
                row += rows;
            }
        }
        out
    }

    /// Shapes of the published tensors, by name.
    pub fn named_shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.groups
            .iter()
            .flat_map(|g| {
                g.parts.iter().map(move |(n, rows)| {
                    let shape = match &g.published {
                        Some(shape) => shape.clone(),
                        None if g.shape.len() == 2 => vec![*rows, g.cols()],
                        None => vec![*rows],
                    };
                    (n.clone(), shape)
                })
            })
            .collect()
    }
}

/// Master weights, gradients and the autograd leaves over them.
pub struct FlatParams {
    layout: FlatLayout,
    /// `[total]` fp32 master weights.
    pub master: Tensor,
    /// `[total]` fp32 gradients, accumulated by backward.
    pub grad: Tensor,
    leaves: Vec<Tensor>,
}

impl FlatParams {
    /// Zeroed buffers on `device`; fill `master` (under no_grad) before use.
    pub fn zeros(layout: FlatLayout, device: Device) -> Result<Self, ModelError> {
        let master = Tensor::f_zeros([layout.total()], (Kind::Float, device))?;
        let grad = Tensor::f_zeros([layout.total()], (Kind::Float, device))?;
        let mut leaves = Vec::with_capacity(layout.groups().len());
        for i in 0..layout.groups().len() {
            let leaf = layout.group_view(&master, i).detach().set_requires_grad(true);
            set_grad(&leaf, &layout.group_view(&grad, i))?;
            leaves.push(leaf);
        }
        Ok(FlatParams { layout, master, grad, leaves })
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The autograd leaf of group `i` (fp32; cast it to the compute dtype in the forward pass).
    pub fn leaf(&self, i: usize) -> &Tensor {
        &self.leaves[i]
    }

    /// Sets gradients to zero for the next accumulation.
    pub fn zero_grad(&mut self) {
        let _ = self.grad.zero_();
    }
}
