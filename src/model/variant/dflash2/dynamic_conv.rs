//! DFlash 2's two-tap dynamic convolution (issue 49), the layer z-lab's DFlash 2 drafters put around both sublayers
//! of every draft layer: each token mixes itself and the `K - 1` tokens before it in its own block, channel by
//! channel, with coefficients that are a learned base plus a per-token, per-channel-group delta the token's own
//! state predicts. A block's first token has nothing before it in the block, so a tap never crosses a block boundary.
//! As speculators 0.9.0 (`models/dflash2/model_definitions.py: grouped_dynamic_conv`) and vLLM
//! (`qwen3_dflash2.py: _grouped_conv`) compute it; tch operations only, so autograd differentiates it.
use tch::{Kind, Tensor};

use crate::model::ModelError;

/// The convolutions' sizes: `taps` (the token and the `taps - 1` before it in its block) and `group` (channels
/// sharing one dynamic coefficient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    pub taps: usize,
    pub group: usize,
}

/// DFlash 2's convolution around one sublayer (speculators' `GroupedDynamicCausalConv`): `prepare` convolves the
/// sublayer's normed input and predicts, from the same input, the kernel `finish` applies to its output.
pub struct SublayerConv {
    /// `[2 * K, H]`: the input side's base kernel, then the output side's.
    base: Tensor,
    /// `[2 * K * H / G, H]`
    projection: Tensor,
    taps: i64,
    group: i64,
    block_size: i64,
}

impl SublayerConv {
    /// A convolution of `shape` over blocks of `block_size` with its weights `base_kernel [2, K, H]` (or `[2 * K,
    /// H]`) and `kernel_projection [2 * K * H / G, H]`.
    pub fn new(base_kernel: Tensor, kernel_projection: Tensor, shape: ConvShape, block_size: usize) -> Self {
        SublayerConv {
            base: base_kernel,
            projection: kernel_projection,
            taps: shape.taps as i64,
            group: shape.group as i64,
            block_size: block_size as i64,
        }
    }

    /// The convolved input `[B, Q, H]` and the output side's delta kernel `[B, Q, K, H / G]`.
    fn prepare(&self, x: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let size = x.size();
        let kernels = x.f_linear(&self.projection, None::<Tensor>)?.f_view([
            size[0],
            size[1],
            2,
            self.taps,
            size[2] / self.group,
        ])?;
        let base = self.base.f_narrow(0, 0, self.taps)?;
        let prepared = grouped_dynamic_conv(x, &kernels.f_select(2, 0)?, &base, self.block_size, self.group)?;
        Ok((prepared, kernels.f_select(2, 1)?))
    }

    /// The sublayer's output `y [B, Q, H]` convolved with the kernel `prepare` predicted.
    fn finish(&self, y: &Tensor, kernel: &Tensor) -> Result<Tensor, ModelError> {
        let base = self.base.f_narrow(0, self.taps, self.taps)?;
        grouped_dynamic_conv(y, kernel, &base, self.block_size, self.group)
    }
}

/// A sublayer's normed input through its convolution's `prepare` (with the kernel `finish` then applies), or as it
/// is without one.
pub fn prepare(conv: Option<&SublayerConv>, x: Tensor) -> Result<(Tensor, Option<Tensor>), ModelError> {
    match conv {
        Some(conv) => conv.prepare(&x).map(|(prepared, kernel)| (prepared, Some(kernel))),
        None => Ok((x, None)),
    }
}

/// A sublayer's output through its convolution's `finish` with the kernel `prepare` gave, or as it is without one.
pub fn finish(conv: Option<&SublayerConv>, y: Tensor, kernel: Option<Tensor>) -> Result<Tensor, ModelError> {
    match (conv, kernel) {
        (Some(conv), Some(kernel)) => conv.finish(&y, &kernel),
        _ => Ok(y),
    }
}

/// `out[b, i, c] = sum_{t < K, t <= i mod block_size} (base[t, c] + delta[b, i, t, c / group]) * x[b, i - t, c]`
/// for `x [B, Q, H]` (rows of whole blocks: `Q` a multiple of `block_size`), `delta [B, Q, K, H / group]` and
/// `base [K, H]`. Returns `[B, Q, H]` in `x`'s dtype.
pub fn grouped_dynamic_conv(
    x: &Tensor,
    delta: &Tensor,
    base: &Tensor,
    block_size: i64,
    group: i64,
) -> Result<Tensor, ModelError> {
    let (size, taps) = (x.size(), base.size()[0]);
    let [rows, tokens, hidden] = size[..] else {
        return Err(ModelError::Batch(format!("the convolution's input is {size:?}; expected [rows, tokens, hidden]")));
    };
    let groups = hidden / group.max(1);
    if group < 1 || hidden % group != 0 || tokens % block_size.max(1) != 0 || taps > block_size {
        return Err(ModelError::Batch(format!(
            "a dynamic convolution of {taps} taps, channel groups of {group} and blocks of {block_size} over \
             {size:?}: the groups must divide the hidden size, the rows hold whole blocks, and a block at least the \
             taps"
        )));
    }
    let expected = [rows, tokens, taps, groups];
    if delta.size() != expected || base.size() != [taps, hidden] {
        return Err(ModelError::Batch(format!(
            "the convolution's kernels are {:?} and {:?}; expected {expected:?} and [{taps}, {hidden}]",
            delta.size(),
            base.size()
        )));
    }
    let x = x.f_view([rows, tokens, groups, group])?;
    let slot = Tensor::f_arange(tokens, (Kind::Int64, x.device()))?.f_remainder(block_size)?;
    let mut out = x.f_zeros_like()?;
    for tap in 0..taps {
        let shifted = match tap {
            0 => x.shallow_clone(),
            _ => x.f_narrow(1, 0, tokens - tap)?.f_constant_pad_nd([0, 0, 0, 0, tap, 0])?,
        };
        // [B, Q, groups, group]: the base per channel plus the token's delta per channel group.
        let coefficient = base.f_get(tap)?.f_to_kind(x.kind())?.f_view([1, 1, groups, group])?
            + delta.f_select(2, tap)?.f_unsqueeze(-1)?;
        let valid = slot.f_ge(tap)?.f_view([1, tokens, 1, 1])?.f_to_kind(x.kind())?;
        out += shifted * coefficient * valid;
    }
    Ok(out.f_view([rows, tokens, hidden])?)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;
    use crate::model::reference_fixture;

    /// The output and the gradients of speculators 0.9.0's convolution (`scripts/fixtures/make_dflash2_fixtures.py`), in f64:
    /// two rows of two blocks of 4 tokens, 32 channels in groups of 8, two taps.
    #[test]
    fn conv_matches_speculators() {
        let fixture = reference_fixture::read("dflash2-conv-speculators-0.9.0.json");
        let case = &fixture["conv"];
        let dim = |k: &str| case["shape"][k].as_i64().unwrap();
        let (rows, tokens, hidden, group, taps) =
            (dim("rows"), dim("tokens"), dim("hidden"), dim("group"), dim("taps"));
        let tensor = |k: &str, shape: &[i64]| reference_fixture::floats(case, k, shape);
        let x = tensor("x", &[rows, tokens, hidden]).set_requires_grad(true);
        let delta = tensor("delta", &[rows, tokens, taps, hidden / group]).set_requires_grad(true);
        let base = tensor("base", &[taps, hidden]).set_requires_grad(true);
        let out = grouped_dynamic_conv(&x, &delta, &base, dim("block_size"), group).unwrap();
        let close = |a: &Tensor, b: &Tensor, what: &str| reference_fixture::assert_close(a, b, 1e-12, what);
        close(&out, &tensor("out", &[rows, tokens, hidden]), "output");
        (out * tensor("upstream", &[rows, tokens, hidden])).sum(Kind::Double).backward();
        close(&x.grad(), &tensor("grad_x", &[rows, tokens, hidden]), "the input's gradient");
        close(&delta.grad(), &tensor("grad_delta", &[rows, tokens, taps, hidden / group]), "the delta's gradient");
        close(&base.grad(), &tensor("grad_base", &[taps, hidden]), "the base's gradient");
    }

    /// The identity initialisation (base tap 0 one, the rest and the deltas zero) changes nothing; shapes that do
    /// not fit are refused, naming them.
    #[test]
    fn identity_kernels_pass_the_input_through_and_bad_shapes_are_refused() {
        let x = Tensor::randn([2, 8, 32], (Kind::Float, Device::Cpu));
        let base = Tensor::cat(
            &[Tensor::ones([1, 32], (Kind::Float, Device::Cpu)), Tensor::zeros([1, 32], (Kind::Float, Device::Cpu))],
            0,
        );
        let delta = Tensor::zeros([2, 8, 2, 2], (Kind::Float, Device::Cpu));
        let out = grouped_dynamic_conv(&x, &delta, &base, 4, 16).unwrap();
        assert_eq!((&out - &x).abs().max().double_value(&[]), 0.0);
        let err = grouped_dynamic_conv(&x, &delta, &base, 3, 16).unwrap_err().to_string();
        assert!(err.contains("whole blocks"), "{err}");
        let err = grouped_dynamic_conv(&x, &delta, &base, 4, 8).unwrap_err().to_string();
        assert!(err.contains("expected [2, 8, 2, 4]"), "{err}");
    }
}
