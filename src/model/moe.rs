//! The sparse MLP of Qwen3-MoE and GPT-OSS for inference (capture and decoding). Every token is routed first; then all experts run at
//! once as two grouped matrix products over the token rows sorted by expert (libtorch's `_grouped_mm`: one kernel
//! per projection on Hopper, a loop over the groups inside libtorch elsewhere), instead of HF's loop over experts with
//! a gather, two products and a scatter each. No step waits for the host: the group sizes stay on the device.
//!
//! Numerics follow HF's `Qwen3MoeSparseMoeBlock`: router logits in the model's dtype, softmax in f32, top-k,
//! renormalised over the chosen experts when `norm_topk_prob`, cast back; SwiGLU experts. Each expert's activation
//! is scaled by its routing weight before the down projection (HF scales the output: the same sum, rounded
//! elsewhere), and a token's experts and the residual are summed in f32 and rounded once (HF sums rounded outputs in
//! the model's dtype, expert by expert), so in bf16 the two agree to bf16 rounding, not bit for bit.
//!
//! GPT-OSS (HF's `GptOssMLP`) differs in routing (router with a bias; top-k of the logits, then a softmax over those
//! k) and in its experts (biases on both projections; gate and up interleaved in the stacked projection; the clamped
//! SwiGLU of [`GptOssConfig`](super::config::GptOssConfig)). A bias after the down projection is weighted with it.
use tch::{Kind, TchError, Tensor};

use super::layers::swiglu_activation;
use crate::profile::span;

/// How a layer routes and what its experts compute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertKind {
    /// Qwen3-MoE: softmax over all experts, top-k (renormalised if asked); `silu(gate) * up`, gate rows first.
    Qwen3 { norm_topk_prob: bool },
    /// GPT-OSS: top-k of the logits, softmax over them; gate and up interleaved, clamped at `limit`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    GptOss { alpha: f64, limit: f64 },
}

/// One layer's router and experts.
pub struct SparseMlp {
    /// `[experts, hidden]`
    router: Tensor,
    router_bias: Option<Tensor>,
    /// `[experts, hidden, 2 * width]`: each expert's stacked gate and up projection as the right operand of the
    /// product (a transposed view of HF's per-expert weights for Qwen3-MoE; GPT-OSS's own layout).
    gate_up: Tensor,
    /// `[experts, 2 * width]`
    gate_up_bias: Option<Tensor>,
    /// `[experts, width, hidden]`
    down: Tensor,
    /// `[experts, hidden]`
    down_bias: Option<Tensor>,
    top_k: i64,
    kind: ExpertKind,
}

impl SparseMlp {
    /// Qwen3-MoE's experts from HF's per-expert weights stacked: `gate_up [experts, 2 * width, hidden]` (gate rows
    /// first), `down [experts, hidden, width]`.
    pub fn qwen3(router: Tensor, gate_up: Tensor, down: Tensor, top_k: usize, norm_topk_prob: bool) -> Self {
        SparseMlp {
            router,
            router_bias: None,
            gate_up: gate_up.transpose(1, 2),
            gate_up_bias: None,
            down: down.transpose(1, 2),
            down_bias: None,
            top_k: top_k as i64,
            kind: ExpertKind::Qwen3 { norm_topk_prob },
        }
    }

    /// GPT-OSS's experts in its own layout: `gate_up [experts, hidden, 2 * width]` (gate and up interleaved),
    /// `down [experts, width, hidden]`, with their biases and the router's.
    #[allow(clippy::too_many_arguments)]
    pub fn gpt_oss(
        (router, router_bias): (Tensor, Tensor),
        (gate_up, gate_up_bias): (Tensor, Tensor),
        (down, down_bias): (Tensor, Tensor),
        top_k: usize,
        alpha: f64,
        limit: f64,
    ) -> Self {
        SparseMlp {
            router,
            router_bias: Some(router_bias),
            gate_up,
            gate_up_bias: Some(gate_up_bias),
            down,
            down_bias: Some(down_bias),
            top_k: top_k as i64,
            kind: ExpertKind::GptOss { alpha, limit },
        }
    }

    pub fn kind(&self) -> ExpertKind {
        self.kind
    }
    pub fn router(&self) -> &Tensor {
        &self.router
    }
    pub fn router_bias(&self) -> Option<&Tensor> {
        self.router_bias.as_ref()
    }
    /// `[experts, hidden, 2 * width]` (see the field).
    pub fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }
    pub fn gate_up_bias(&self) -> Option<&Tensor> {
        self.gate_up_bias.as_ref()
    }
    /// `[experts, width, hidden]`
    pub fn down(&self) -> &Tensor {
        &self.down
    }
    pub fn down_bias(&self) -> Option<&Tensor> {
        self.down_bias.as_ref()
    }

    /// The experts chosen for each row of `h [T, hidden]`, `[T, top_k]` (int64, most probable first), and their
    /// weights `[T, top_k]` in `h`'s dtype.
    pub fn route(&self, h: &Tensor) -> Result<(Tensor, Tensor), TchError> {
        let logits = h.f_linear(&self.router, self.router_bias.as_ref())?;
        match self.kind {
            ExpertKind::Qwen3 { norm_topk_prob } => {
                let probs = logits.f_softmax(-1, Kind::Float)?;
                let (mut weights, experts) = probs.f_topk(self.top_k, -1, true, true)?;
                if norm_topk_prob {
                    weights = weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?)?;
                }
                Ok((experts, weights.f_to_kind(h.kind())?))
            }
            ExpertKind::GptOss { .. } => {
                let (top, experts) = logits.f_topk(self.top_k, -1, true, true)?;
                Ok((experts, top.f_softmax(-1, Kind::Float)?.f_to_kind(h.kind())?))
            }
        }
    }

    /// The experts' activation of their stacked projections `[rows, 2 * width]`.
    fn activation(&self, gate_up: &Tensor) -> Result<Tensor, TchError> {
        match self.kind {
            ExpertKind::Qwen3 { .. } => Ok(swiglu_activation(gate_up)),
            ExpertKind::GptOss { alpha, limit } => {
                let gate = gate_up.f_slice(1, 0, None, 2)?.f_clamp_max(limit)?;
                let up = gate_up.f_slice(1, 1, None, 2)?.f_clamp(-limit, limit)?;
                let glu = gate.f_mul(&gate.f_mul_scalar(alpha)?.f_sigmoid()?)?;
                up.f_add_scalar(1.0)?.f_mul(&glu)
            }
        }
    }

    /// Adds the layer's output for `h [T, hidden]` to the residual stream `x [T, hidden]` in place.
    pub fn add_to(&self, x: &Tensor, h: &Tensor) -> Result<(), TchError> {
        let (tokens, hidden) = (h.size()[0], h.size()[1]);
        let route = span("target.moe.route");
        let (experts, weights) = self.route(h)?;
        let flat = experts.f_view([-1])?;
        // Row r of the sorted order is copy `order[r] % top_k` of token `order[r] / top_k`; rows of one expert are
        // contiguous and expert e's end at `offsets[e]`.
        let order = flat.f_argsort_stable(true, 0, false)?;
        let token = order.f_floor_divide_scalar(self.top_k)?;
        let counts = Tensor::f_zeros([self.router.size()[0]], (Kind::Int64, h.device()))?.f_scatter_add(
            0,
            &flat,
            &flat.f_ones_like()?,
        )?;
        let offsets = counts.f_cumsum(0, Kind::Int)?;
        let row_weights = weights.f_view([-1])?.f_index_select(0, &order)?.f_unsqueeze(1)?;
        let row_expert = flat.f_index_select(0, &order)?;
        // Where each (token, k) pair sits in the sorted order: gathering by it restores token order.
        let rows_n = order.size()[0];
        let back =
            order.f_empty_like()?.f_index_copy(0, &order, &Tensor::f_arange(rows_n, (Kind::Int64, h.device()))?)?;
        drop(route);
        let rows = {
            let _p = span("target.moe.gather");
            h.f_index_select(0, &token)?
        };
        let out = {
            let _p = span("target.moe.experts");
            let mut gate_up = rows.f_internal_grouped_mm(&self.gate_up, Some(&offsets), None, None)?;
            if let Some(bias) = &self.gate_up_bias {
                gate_up = gate_up.f_add_(&bias.f_index_select(0, &row_expert)?)?;
            }
            // Each row is weighted before the down projection (linear, so the same sum; one pass over the narrower
            // activation instead of the output).
            let act = self.activation(&gate_up)?.f_mul_(&row_weights)?;
            let mut out = act.f_internal_grouped_mm(&self.down, Some(&offsets), None, None)?;
            if let Some(bias) = &self.down_bias {
                out = out.f_add_(&bias.f_index_select(0, &row_expert)?.f_mul(&row_weights)?)?;
            }
            out
        };
        // Back in token order, `[T, top_k, hidden]`; the k outputs and the residual summed in f32, rounded once.
        let _p = span("target.moe.combine");
        let summed = out.f_index_select(0, &back)?.f_view([tokens, self.top_k, hidden])?.f_sum_dim_intlist(
            1,
            false,
            Kind::Float,
        )?;
        let _ = x.shallow_clone().f_add_(&summed)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The HF expert loop written out per token in f64: softmax, top-k, renormalise, sum of weighted SwiGLU experts.
    fn per_token(mlp: &SparseMlp, h: &Tensor) -> (Vec<Vec<i64>>, Tensor) {
        let f = |t: &Tensor| t.to_kind(Kind::Double);
        let ExpertKind::Qwen3 { norm_topk_prob } = mlp.kind else { panic!("Qwen3 experts") };
        let (gate_up_w, down_w) = (mlp.gate_up.transpose(1, 2), mlp.down.transpose(1, 2));
        let inter = down_w.size()[2];
        let mut chosen = vec![];
        let mut rows = vec![];
        for t in 0..h.size()[0] {
            let x = f(&h.get(t));
            let probs = f(&mlp.router).mv(&x).softmax(-1, Kind::Double);
            let mut ranked: Vec<(f64, i64)> =
                Vec::<f64>::try_from(&probs).unwrap().into_iter().zip(0..).collect::<Vec<_>>();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
            let top = &ranked[..mlp.top_k as usize];
            let total: f64 = if norm_topk_prob { top.iter().map(|p| p.0).sum() } else { 1.0 };
            let mut y = Tensor::zeros_like(&x);
            for &(p, e) in top {
                let gu = f(&gate_up_w.get(e)).mv(&x);
                let (gate, up) = (gu.narrow(0, 0, inter), gu.narrow(0, inter, inter));
                y += f(&down_w.get(e)).mv(&(&gate * gate.sigmoid() * up)) * (p / total);
            }
            chosen.push(top.iter().map(|p| p.1).collect());
            rows.push(y);
        }
        (chosen, Tensor::stack(&rows, 0))
    }

    fn random_mlp(experts: i64, top_k: usize, norm: bool) -> SparseMlp {
        let (h, i) = (24, 16);
        let w = |shape: &[i64], std: f64| Tensor::randn(shape, (Kind::Float, Device::Cpu)) * std;
        SparseMlp::qwen3(w(&[experts, h], 1.0), w(&[experts, 2 * i, h], 0.2), w(&[experts, h, i], 0.2), top_k, norm)
    }

    #[test]
    fn grouped_experts_equal_the_per_token_loop() {
        tch::manual_seed(7);
        for (experts, top_k, norm) in [(8, 2, true), (6, 3, false), (4, 4, true), (5, 1, false)] {
            let mlp = random_mlp(experts, top_k, norm);
            // 37 tokens: some experts get many rows, and with 8 experts and top-2 likely one gets none.
            let h = Tensor::randn([37, 24], (Kind::Float, Device::Cpu));
            let (want_experts, want) = per_token(&mlp, &h);
            let (got_experts, _) = mlp.route(&h).unwrap();
            let got_experts: Vec<Vec<i64>> = (0..37).map(|t| Vec::try_from(&got_experts.get(t)).unwrap()).collect();
            assert_eq!(got_experts, want_experts, "{experts} experts, top {top_k}");
            let residual = Tensor::randn([37, 24], (Kind::Float, Device::Cpu));
            let x = residual.copy();
            mlp.add_to(&x, &h).unwrap();
            let err = (x.to_kind(Kind::Double) - residual.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
            let scale = want.abs().max().double_value(&[]);
            assert!(err < 1e-5 * scale.max(1.0), "{experts} experts, top {top_k}: max error {err} (scale {scale})");
        }
    }

    #[test]
    fn one_token_and_an_expert_nobody_chose_are_fine() {
        tch::manual_seed(3);
        let mlp = random_mlp(8, 2, true);
        let h = Tensor::randn([1, 24], (Kind::Float, Device::Cpu));
        let (_, want) = per_token(&mlp, &h);
        let x = Tensor::zeros([1, 24], (Kind::Float, Device::Cpu));
        mlp.add_to(&x, &h).unwrap();
        assert!((x.to_kind(Kind::Double) - want).abs().max().double_value(&[]) < 1e-5);
    }
}
