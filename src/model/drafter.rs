//! The DFlash drafter (DFLASH.md): a Qwen3-style stack whose queries come from the block being drafted and whose
//! keys and values come from the target's context features AND the block, through the same projections.
//!
//! Context features: the tapped target states `[B, S, n*H]` -> `fc` -> `hidden_norm`, computed once and shared by
//! every layer. Positions are absolute (context token p at p, block slot k of anchor a at a + k).
//!
//! Attention during training follows DFLASH.md's mask: a query of block j sees context keys p < a_j and the keys of
//! its own block, nothing else. [`BlockAttention`] runs it in groups of consecutive blocks: since anchors are sorted,
//! a group only needs the context prefix up to its largest anchor and its own block keys, so the dense attention of
//! each group is several times smaller than one dense `[N*bs, S + N*bs]` attention, with identical results (masked
//! keys weigh exactly zero). Context lengths are rounded up to multiples of
//! [`CONTEXT_BUCKET`](super::attention::CONTEXT_BUCKET) (the context is zero-padded to match) so that the few
//! distinct attention shapes recur from step to step: cuDNN builds an execution plan per shape, and a new shape every
//! call costs more than the attention itself.
use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::ModelError;
use super::attention::{CONTEXT_BUCKET, LayerAttention, context_bucket, grouped_bias, masked_attention, repeat_kv};
use super::choice::greedy_tokens;
use super::drafter_config::DrafterConfig;
use super::flat_params::{FlatLayout, FlatParams, GroupInit, ParamGroup};
use super::init::{Init, InitStream};
use super::kv_cache::KvCache;
use super::layers::{Rope, apply_rope, norm_rope, rms_norm, swiglu};
use super::staircase::decode_attention;
use super::variant::dflash2::candidate_selector::{SelectorTensors, SelectorWeights, greedy_path};
use super::variant::dflash2::dynamic_conv::{SublayerConv, finish, prepare};
use super::weights::{HostTensor, WeightFiles, write_safetensors};
use crate::device::kind_name;
use crate::ffi::autograd;
use crate::profile::span;

/// Group indices of one layer in the flat layout.
#[derive(Debug, Clone, Copy)]
struct LayerParams {
    input_layernorm: usize,
    qkv_proj: usize,
    o_proj: usize,
    q_norm: usize,
    k_norm: usize,
    post_attention_layernorm: usize,
    gate_up_proj: usize,
    down_proj: usize,
    /// DFlash 2's convolutions around the attention and the MLP.
    conv: Option<[ConvParams; 2]>,
}

/// Group indices of one DFlash 2 convolution: `base_kernel [2, K, H]` and `kernel_projection [2 * K * H / G, H]`.
#[derive(Debug, Clone, Copy)]
struct ConvParams {
    base_kernel: usize,
    kernel_projection: usize,
}

/// Group indices of DFlash 2's candidate selector.
#[derive(Debug, Clone, Copy)]
struct SelectorParams {
    predecessor_codebook: usize,
    successor_codebook: usize,
    hidden_projection: usize,
}

/// The drafter: configuration, flat fp32 master weights (see [`FlatParams`]) and the compute dtype.
pub struct Drafter {
    cfg: DrafterConfig,
    params: FlatParams,
    fc: usize,
    hidden_norm: usize,
    layers: Vec<LayerParams>,
    norm: usize,
    selector: Option<SelectorParams>,
    rope: Rope,
    kind: Kind,
    device: Device,
}

/// Which group of the flat layout is which.
struct Groups {
    fc: usize,
    hidden_norm: usize,
    layers: Vec<LayerParams>,
    norm: usize,
    selector: Option<SelectorParams>,
}

/// The parameter groups of `cfg` in flat order, and which group is which. DFlash 2's groups come after each layer's
/// own and the selector's last, so a DFlash drafter's layout (and its initial weights) are those of before.
fn layout(cfg: &DrafterConfig) -> (FlatLayout, Groups) {
    let c = &cfg.decoder;
    let (h, i, d) = (c.hidden_size as i64, c.intermediate_size as i64, c.head_dim as i64);
    let (q, kv) = (c.num_attention_heads as i64 * d, c.num_key_value_heads as i64 * d);
    let std = 0.02;
    let mut groups: Vec<ParamGroup> = Vec::new();
    let mut push = |group: ParamGroup| {
        groups.push(group);
        groups.len() - 1
    };
    let one = |name: &str, rows: i64| vec![(name.to_string(), rows)];
    let (convs, selector) = (cfg.variant.sublayer_convs(), cfg.variant.selector());
    let fc = push(ParamGroup::new(one("fc.weight", h), Some(cfg.context_width() as i64), std));
    let hidden_norm = push(ParamGroup::new(one("hidden_norm.weight", h), None, 0.0));
    let mut layers = Vec::new();
    for l in 0..c.num_hidden_layers {
        let p = |s: &str| format!("layers.{l}.{s}");
        let norm = |s: &str| ParamGroup::new(one(&p(s), h), None, 0.0);
        let qkv = vec![
            (p("self_attn.q_proj.weight"), q),
            (p("self_attn.k_proj.weight"), kv),
            (p("self_attn.v_proj.weight"), kv),
        ];
        let mut layer = LayerParams {
            input_layernorm: push(norm("input_layernorm.weight")),
            qkv_proj: push(ParamGroup::new(qkv, Some(h), std)),
            o_proj: push(ParamGroup::new(one(&p("self_attn.o_proj.weight"), h), Some(q), std)),
            q_norm: push(ParamGroup::new(one(&p("self_attn.q_norm.weight"), d), None, 0.0)),
            k_norm: push(ParamGroup::new(one(&p("self_attn.k_norm.weight"), d), None, 0.0)),
            post_attention_layernorm: push(norm("post_attention_layernorm.weight")),
            gate_up_proj: push(ParamGroup::new(
                vec![(p("mlp.gate_proj.weight"), i), (p("mlp.up_proj.weight"), i)],
                Some(h),
                std,
            )),
            down_proj: push(ParamGroup::new(one(&p("mlp.down_proj.weight"), h), Some(i), std)),
            conv: None,
        };
        // Identity convolutions (speculators' `reset_parameters`), so a fresh one starts as DFlash does.
        if let Some(shape) = convs {
            let taps = shape.taps as i64;
            let deltas = 2 * taps * h / shape.group as i64;
            let mut conv = |which: &str| ConvParams {
                base_kernel: push(ParamGroup::tensor(
                    p(&format!("{which}.base_kernel")),
                    &[2, taps, h],
                    GroupInit::FirstTap { taps },
                )),
                kernel_projection: push(ParamGroup::tensor(
                    p(&format!("{which}.kernel_projection.weight")),
                    &[deltas, h],
                    GroupInit::Zeros,
                )),
            };
            layer.conv = Some([conv("attention_conv"), conv("mlp_conv")]);
        }
        layers.push(layer);
    }
    let norm = push(ParamGroup::new(one("norm.weight", h), None, 0.0));
    let selector = selector.map(|shape| {
        let (v, r) = (c.vocab_size as i64, shape.rank as i64);
        let name = |s: &str| format!("candidate_selector.{s}");
        SelectorParams {
            predecessor_codebook: push(ParamGroup::new(one(&name("predecessor_codebook"), v), Some(r), std)),
            successor_codebook: push(ParamGroup::new(one(&name("successor_codebook"), v), Some(r), std)),
            hidden_projection: push(ParamGroup::new(one(&name("hidden_projection.weight"), r), Some(h), std)),
        }
    });
    (FlatLayout::new(groups), Groups { fc, hidden_norm, layers, norm, selector })
}

impl Drafter {
    fn empty(cfg: DrafterConfig, device: Device, kind: Kind) -> Result<Self, ModelError> {
        cfg.validate().map_err(ModelError::Taps)?;
        let (layout, Groups { fc, hidden_norm, layers, norm, selector }) = layout(&cfg);
        let params = FlatParams::zeros(layout, device)?;
        let c = &cfg.decoder;
        let rope = Rope::new(c.rope_theta, c.head_dim, c.rope_scaling, device);
        Ok(Drafter { cfg, params, fc, hidden_norm, layers, norm, selector, rope, kind, device })
    }

    /// A drafter with all-zero weights (to be filled by a copy from a peer).
    pub fn zeroed(cfg: DrafterConfig, device: Device, kind: Kind) -> Result<Self, ModelError> {
        Self::empty(cfg, device, kind)
    }

    /// Published tensor names and shapes of a drafter of `cfg`, in file order (no weights are allocated).
    pub fn tensor_shapes(cfg: &DrafterConfig) -> Vec<(String, Vec<i64>)> {
        layout(cfg).0.named_shapes()
    }

    /// A freshly initialised drafter (norms 1, matrices N(0, 0.02), DFlash 2's convolutions the identity),
    /// computing in `kind`.
    pub fn new(cfg: DrafterConfig, device: Device, kind: Kind, init: Init) -> Result<Self, ModelError> {
        let drafter = Self::empty(cfg, device, kind)?;
        let layout = drafter.params.layout().clone();
        let mut stream = InitStream::new(init, device);
        tch::no_grad(|| -> Result<(), ModelError> {
            for (i, g) in layout.groups().iter().enumerate() {
                let mut view = layout.group_view(&drafter.params.master, i);
                match g.init {
                    GroupInit::Normal(std) => view.f_copy_(&stream.next(&g.shape, std, Kind::Float)?)?,
                    GroupInit::Ones => drop(view.f_fill_(1.0)?),
                    GroupInit::Zeros => drop(view.f_zero_()?),
                    // Rows of `taps` kernels: the first of each one, the rest zero.
                    GroupInit::FirstTap { taps } => {
                        let _ = view.f_zero_()?;
                        drop(view.f_view([-1, taps, g.shape[1]])?.f_select(1, 0)?.f_fill_(1.0)?)
                    }
                };
            }
            Ok(())
        })?;
        Ok(drafter)
    }

    /// Loads a drafter folder in the published format (`config.json` + safetensors in any float dtype); the
    /// weights are copied into fp32 master weights.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self, ModelError> {
        Self::with_weights(DrafterConfig::from_dir(dir)?, dir, device, kind)
    }

    /// A drafter of `cfg` with the weights of the drafter folder `dir` (whose tensors must have `cfg`'s shapes).
    pub fn with_weights(cfg: DrafterConfig, dir: &Path, device: Device, kind: Kind) -> Result<Self, ModelError> {
        let files = WeightFiles::open(dir)?;
        let drafter = Self::empty(cfg, device, kind)?;
        let why = "config.json (the drafter's shape)";
        tch::no_grad(|| -> Result<(), ModelError> {
            for (name, mut view) in drafter.params.layout().named_views(&drafter.params.master) {
                let shape: Vec<usize> = view.size().iter().map(|&d| d as usize).collect();
                let t = files.load(&name, &shape, why, Kind::Float, device)?;
                view.f_copy_(&t)?;
            }
            Ok(())
        })?;
        Ok(drafter)
    }

    /// Writes the drafter in the published format: `config.json` and `model.safetensors` with the published names,
    /// in `dtype` (bf16 to publish, f32 for checkpoints that must resume exactly).
    pub fn save(&self, dir: &Path, dtype: Kind) -> Result<(), ModelError> {
        save_drafter_folder(dir, &self.cfg, self.params.layout(), &self.params.master, dtype)
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }
    pub fn params(&self) -> &FlatParams {
        &self.params
    }
    pub fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }
    pub fn kind(&self) -> Kind {
        self.kind
    }
    pub fn device(&self) -> Device {
        self.device
    }

    /// DFlash 2's selector weights in the compute dtype, recording their gradients into the flat gradient buffer (in
    /// grad mode); an error for a drafter without a selector.
    pub fn selector_weights(&self) -> Result<SelectorTensors, ModelError> {
        let s = self.selector.ok_or_else(|| ModelError::Batch("a DFlash drafter has no candidate selector".into()))?;
        Ok(SelectorTensors {
            predecessor_codebook: self.weight(s.predecessor_codebook),
            successor_codebook: self.weight(s.successor_codebook),
            hidden_projection: self.weight(s.hidden_projection),
        })
    }

    /// Parameter group `group` in the compute dtype, recording its gradient into the flat gradient buffer.
    fn weight(&self, group: usize) -> Tensor {
        let leaf = self.params.leaf(group);
        if leaf.kind() == self.kind {
            return leaf.shallow_clone();
        }
        autograd::weight_cast(leaf, self.kind).unwrap_or_else(|e| panic!("casting drafter weights: {e}"))
    }

    /// Runs the drafter: `target_hidden [B, S, n*H]` (the tapped states), `block_embeddings [B, Q, H]` (the
    /// target's embedding of the block inputs), `positions [B, Q]` (absolute positions of the block slots).
    /// Returns the final-normed hidden states `[B, Q, H]`, recording autograd through the drafter's parameters.
    pub fn forward(
        &self,
        target_hidden: &Tensor,
        block_embeddings: &Tensor,
        positions: &Tensor,
        attention: &BlockAttention,
    ) -> Tensor {
        let c = &self.cfg.decoder;
        let eps = c.rms_norm_eps;
        let (b, s) = (target_hidden.size()[0], target_hidden.size()[1]);
        let q_len = block_embeddings.size()[1];
        let (heads, kv_heads, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let ctx = {
            let _p = span("drafter.fc");
            let fc = target_hidden.linear(&self.weight(self.fc), None::<Tensor>);
            let ctx = rms_norm(&fc, &self.weight(self.hidden_norm), eps);
            // Zero rows up to the bucketed length: their keys and values are zero and always masked.
            let padded = context_bucket(s);
            if padded > s { ctx.constant_pad_nd([0, 0, 0, padded - s]) } else { ctx }
        };
        let s = ctx.size()[1];
        let (cos_c, sin_c, cos_b, sin_b) = {
            let _p = span("drafter.rope");
            let (cc, sc) = self.rope.cos_sin(&Tensor::arange(s, (Kind::Int64, self.device)), self.kind);
            let (cb, sb) = self.rope.cos_sin(positions, self.kind);
            (cc.unsqueeze(0).unsqueeze(2), sc.unsqueeze(0).unsqueeze(2), cb.unsqueeze(2), sb.unsqueeze(2))
        };
        // One pattern per kind of layer that restricts the rule (a window, a causal block); the others use `attention`.
        let restricted: Vec<(LayerAttention, BlockAttention)> = {
            let _p = span("drafter.attention");
            let built = self.cfg.restricting_kinds().into_iter().map(|kind| Ok((kind, attention.restricted(&kind)?)));
            built.collect::<Result<_, ModelError>>().unwrap_or_else(|e| panic!("drafter attention pattern: {e}"))
        };
        let mut x = block_embeddings.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let kind = self.cfg.layer_attention[i];
            let attention = restricted.iter().find(|(k, _)| *k == kind).map_or(attention, |(_, p)| p);
            let qkv_w = self.weight(layer.qkv_proj);
            let (q_norm, k_norm) = (self.weight(layer.q_norm), self.weight(layer.k_norm));
            let [attention_conv, mlp_conv] = self.layer_convs(layer, &|g| self.weight(g));
            let (qkv, kv_ctx, attention_kernel) = {
                let _p = span("drafter.qkv_proj");
                let xn = rms_norm(&x, &self.weight(layer.input_layernorm), eps);
                let (xn, kernel) = prepare(attention_conv.as_ref(), xn).unwrap_or_else(conv_failed);
                let qkv = xn.linear(&qkv_w, None::<Tensor>);
                let kv_ctx = ctx.linear(&qkv_w.narrow(0, heads * d, 2 * kv_heads * d), None::<Tensor>);
                (qkv, kv_ctx, kernel)
            };
            let q = qkv.narrow(-1, 0, heads * d).view([b, q_len, heads, d]);
            let k_blk = qkv.narrow(-1, heads * d, kv_heads * d).view([b, q_len, kv_heads, d]);
            let v_blk = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d).view([b, q_len, kv_heads, d]);
            let k_ctx = kv_ctx.narrow(-1, 0, kv_heads * d).view([b, s, kv_heads, d]);
            let v_ctx = kv_ctx.narrow(-1, kv_heads * d, kv_heads * d).view([b, s, kv_heads, d]);
            let (q, k_blk, k_ctx) = {
                let _p = span("drafter.rope");
                (
                    apply_rope(&rms_norm(&q, &q_norm, eps), &cos_b, &sin_b),
                    apply_rope(&rms_norm(&k_blk, &k_norm, eps), &cos_b, &sin_b),
                    apply_rope(&rms_norm(&k_ctx, &k_norm, eps), &cos_c, &sin_c),
                )
            };
            let attn = {
                let _p = span("drafter.attention");
                let t = |x: &Tensor| x.transpose(1, 2);
                attention.run(&t(&q), &t(&k_ctx), &t(&v_ctx), &t(&k_blk), &t(&v_blk))
            };
            x = {
                let _p = span("drafter.o_proj");
                let o = attn.transpose(1, 2).reshape([b, q_len, heads * d]);
                let o = o.linear(&self.weight(layer.o_proj), None::<Tensor>);
                x + finish(attention_conv.as_ref(), o, attention_kernel).unwrap_or_else(conv_failed)
            };
            x = {
                let _p = span("drafter.mlp");
                let h = rms_norm(&x, &self.weight(layer.post_attention_layernorm), eps);
                let (h, kernel) = prepare(mlp_conv.as_ref(), h).unwrap_or_else(conv_failed);
                let gu = h.linear(&self.weight(layer.gate_up_proj), None::<Tensor>);
                let out = autograd::swiglu_down(&gu, &self.weight(layer.down_proj))
                    .unwrap_or_else(|e| panic!("drafter MLP: {e}"));
                &x + finish(mlp_conv.as_ref(), out, kernel).unwrap_or_else(conv_failed)
            };
        }
        rms_norm(&x, &self.weight(self.norm), eps)
    }
}

impl Drafter {
    /// A layer's convolutions around its attention and its MLP (DFlash 2; `None` for DFlash), with their weights as
    /// `weight` gives them (the training cast, or decoding's).
    fn layer_convs(&self, layer: &LayerParams, weight: &dyn Fn(usize) -> Tensor) -> [Option<SublayerConv>; 2] {
        match layer.conv {
            Some([attention, mlp]) => {
                [Some(self.sublayer_conv(attention, weight)), Some(self.sublayer_conv(mlp, weight))]
            }
            None => [None, None],
        }
    }

    /// One of DFlash 2's convolutions with its weights as `weight` gives them.
    fn sublayer_conv(&self, conv: ConvParams, weight: &dyn Fn(usize) -> Tensor) -> SublayerConv {
        let shape = self.cfg.variant.sublayer_convs().expect("a layer with convolutions has their shape");
        SublayerConv::new(weight(conv.base_kernel), weight(conv.kernel_projection), shape, self.cfg.block_size)
    }
}

/// The forward pass's answer to a convolution that cannot run (shapes the configuration already validated).
fn conv_failed<T>(e: ModelError) -> T {
    panic!("drafter convolution: {e}")
}

/// The drafter's weights cast once to the compute dtype, for decoding (training casts the fp32 masters every step,
/// which decoding at batch 1 cannot afford).
pub struct DraftWeights(Vec<Tensor>);

impl DraftWeights {
    /// Copies `other`'s values into these tensors in place (what a captured pass reads stays where it is).
    pub fn copy_from(&mut self, other: &DraftWeights) -> Result<(), ModelError> {
        tch::no_grad(|| {
            for (mine, theirs) in self.0.iter_mut().zip(&other.0) {
                mine.f_copy_(theirs)?;
            }
            Ok(())
        })
    }
}

impl Drafter {
    pub fn decode_weights(&self) -> Result<DraftWeights, ModelError> {
        let groups = self.params.layout().groups().len();
        Ok(DraftWeights((0..groups).map(|g| self.params.leaf(g).f_to_kind(self.kind)).collect::<Result<_, _>>()?))
    }

    /// The tokens a drafting pass proposes for its slots after the anchor, from their final hidden states `hidden
    /// [1, n, H]` and their logits `[1, n, V]`, as `[1, n]` int64 on the device without waiting for it: the argmax at
    /// each slot (DFlash), or DFlash 2's selector walked from `anchor [1]` (the last accepted token) as vLLM walks
    /// it at temperature 0 ([`greedy_path`]).
    pub fn drafted_tokens(
        &self,
        w: &DraftWeights,
        hidden: &Tensor,
        logits: &Tensor,
        anchor: &Tensor,
    ) -> Result<Tensor, ModelError> {
        match (self.cfg.variant.selector(), self.selector) {
            (Some(shape), Some(s)) => {
                let weights = SelectorWeights {
                    predecessor_codebook: &w.0[s.predecessor_codebook],
                    successor_codebook: &w.0[s.successor_codebook],
                    hidden_projection: &w.0[s.hidden_projection],
                };
                let top_k = shape.top_k as i64;
                Ok(greedy_path(&logits.f_select(0, 0)?, &hidden.f_select(0, 0)?, anchor, top_k, &weights)?
                    .f_unsqueeze(0)?)
            }
            _ => greedy_tokens(logits),
        }
    }

    /// A cache of projected context keys and values for up to `capacity` positions of one sequence (rounded up
    /// to a multiple of [`CONTEXT_BUCKET`](super::attention::CONTEXT_BUCKET): attention reads the context in whole
    /// buckets, see [`Drafter::draft`]).
    pub fn new_cache(&self, capacity: i64) -> Result<KvCache, ModelError> {
        let c = &self.cfg.decoder;
        let (kv_heads, d) = (c.num_key_value_heads as i64, c.head_dim as i64);
        KvCache::new(self.layers.len(), 1, kv_heads, d, context_bucket(capacity), self.kind, self.device)
    }

    /// One drafting pass at inference: appends the target states of newly accepted tokens `new_context [1, n,
    /// taps * hidden]` (positions `cache.len()..`) to the context cache, then runs the block `block_embeddings
    /// [1, bs, hidden]` (the target's embedding of `[last accepted token, MASK...]`) at the positions right after
    /// the context. Block queries see every context key and every key of the block, as in training (context
    /// `p < anchor`, bidirectional block, each layer's window and causality: [`LayerAttention`]); the block's own
    /// keys are not kept. Returns the final-normed hidden states `[1, bs, hidden]`. The context is attended in whole
    /// buckets ([`CONTEXT_BUCKET`](super::attention::CONTEXT_BUCKET)), the rows past it masked, so the attention
    /// shape recurs from step to step (cuDNN plans an attention per shape, which costs far more than the attention
    /// itself at batch 1).
    pub fn draft(
        &self,
        w: &DraftWeights,
        new_context: &Tensor,
        block_embeddings: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        cache.reserve(new_context.size()[1])?;
        self.draft_with(w, new_context, block_embeddings, cache, None)
    }

    /// [`Drafter::draft`] with nothing depending on the host, so that a CUDA graph can capture it: the pass starts
    /// at `start` (an int64 scalar on the drafter's device: the cache's length) and the first `count` (another) of
    /// the `N` rows of `context [1, N, taps * hidden]` are the new context; the rest are ignored. Every row's keys
    /// and values are written at `start..start + N`, then the block's over them at `start + count..`, and attention
    /// reads the cache's whole capacity, masked past the block. The same result as `draft`, up to the order of the
    /// softmax's sum. The cache's length is the caller's to advance (by `count`); its capacity must hold `start +
    /// N + bs` positions (checked here against the current length, which the caller keeps at `start`).
    pub fn draft_at(
        &self,
        w: &DraftWeights,
        context: &Tensor,
        start: &Tensor,
        count: &Tensor,
        block_embeddings: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let needed = context.size()[1] + block_embeddings.size()[1];
        if cache.len() + needed > cache.capacity() {
            return Err(ModelError::Batch(format!(
                "a drafting pass at a device position needs {needed} free positions; the cache holds {} of {}",
                cache.len(),
                cache.capacity()
            )));
        }
        self.draft_with(w, context, block_embeddings, cache, Some((start, count)))
    }

    fn draft_with(
        &self,
        w: &DraftWeights,
        new_context: &Tensor,
        block_embeddings: &Tensor,
        cache: &mut KvCache,
        at: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor, ModelError> {
        let c = &self.cfg.decoder;
        let eps = c.rms_norm_eps;
        let (heads, kv_heads, d) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim as i64);
        let (n, bs) = (new_context.size()[1], block_embeddings.size()[1]);
        let start = cache.len();
        let w = |group: usize| &w.0[group];
        let on = (Kind::Int64, self.device);
        tch::no_grad(|| {
            let ctx = {
                let _p = span("drafter.fc");
                rms_norm(&new_context.f_linear(w(self.fc), None::<Tensor>)?, w(self.hidden_norm), eps)
            };
            let rope = |positions: &Tensor| -> (Tensor, Tensor) {
                let (cos, sin) = self.rope.cos_sin(positions, self.kind);
                (cos.unsqueeze(0).unsqueeze(2), sin.unsqueeze(0).unsqueeze(2))
            };
            // At a device position, where the block's keys start (past the new context).
            let block_start = at.map(|(start, count)| start.f_add(count)).transpose()?;
            // The context's and the block's positions, and which keys the block may not see: on the host, the rows
            // of the bucketed context past it; at a device position, every key past the block.
            let (context_at, block_at, hidden, padded, keys_at) = match at {
                None => {
                    let padded = context_bucket(start + n);
                    let rows = Tensor::f_arange(padded + bs, on)?;
                    let hidden = rows.f_ge(start + n)?.f_logical_and(&rows.f_lt(padded)?)?;
                    let context_at = Tensor::f_arange_start(start, start + n, on)?;
                    let block_at = Tensor::f_arange_start(start + n, start + n + bs, on)?;
                    let keys_at = Tensor::f_cat(&[Tensor::f_arange(padded, on)?, block_at.shallow_clone()], 0)?;
                    (context_at, block_at, hidden, padded, keys_at)
                }
                Some((start, _)) => {
                    let block_start = block_start.as_ref().expect("set at a device position");
                    let keys_at = Tensor::f_arange(cache.capacity(), on)?;
                    let hidden = keys_at.f_ge_tensor(&block_start.f_add_scalar(bs)?)?;
                    let context_at = Tensor::f_arange(n, on)?.f_add(start)?;
                    (context_at, Tensor::f_arange(bs, on)?.f_add(block_start)?, hidden, cache.capacity(), keys_at)
                }
            };
            let (cos_c, sin_c) = rope(&context_at);
            let (cos_b, sin_b) = rope(&block_at);
            let group = heads / kv_heads;
            let bias = grouped_bias(&hidden, bs, group, self.kind)?;
            // Layers with a sliding window or a causal block hide more, per query.
            let mut restricted: Vec<(LayerAttention, Tensor)> = Vec::new();
            for kind in self.cfg.restricting_kinds() {
                let hidden = match kind.hides(&block_at.f_unsqueeze(1)?, &keys_at.f_unsqueeze(0)?)? {
                    Some(more) => more.f_logical_or(&hidden.f_unsqueeze(0)?)?,
                    None => hidden.shallow_clone(),
                };
                restricted.push((kind, grouped_bias(&hidden, bs, group, self.kind)?));
            }
            let mut x = block_embeddings.shallow_clone();
            for (i, layer) in self.layers.iter().enumerate() {
                let bias = match restricted.iter().find(|(k, _)| *k == self.cfg.layer_attention[i]) {
                    Some((_, b)) => b,
                    None => &bias,
                };
                let qkv_w = w(layer.qkv_proj);
                let (q_norm, k_norm) = (w(layer.q_norm), w(layer.k_norm));
                let [attention_conv, mlp_conv] = self.layer_convs(layer, &|g| w(g).shallow_clone());
                let p = span("drafter.qkv_proj");
                let xn = rms_norm(&x, w(layer.input_layernorm), eps);
                let (xn, attention_kernel) = prepare(attention_conv.as_ref(), xn)?;
                let qkv = xn.f_linear(qkv_w, None::<Tensor>)?;
                let q = qkv.narrow(-1, 0, heads * d).view([1, bs, heads, d]);
                let k_blk = qkv.narrow(-1, heads * d, kv_heads * d).view([1, bs, kv_heads, d]);
                let v_blk = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d).view([1, bs, kv_heads, d]);
                let q = norm_rope(&q, Some(q_norm), eps, &cos_b, &sin_b).transpose(1, 2);
                let k_blk = norm_rope(&k_blk, Some(k_norm), eps, &cos_b, &sin_b).transpose(1, 2);
                let v_blk = v_blk.transpose(1, 2);
                let context_kv = match n {
                    0 => None,
                    _ => {
                        let kv = ctx.f_linear(&qkv_w.narrow(0, heads * d, 2 * kv_heads * d), None::<Tensor>)?;
                        let k = kv.narrow(-1, 0, kv_heads * d).view([1, n, kv_heads, d]);
                        let v = kv.narrow(-1, kv_heads * d, kv_heads * d).view([1, n, kv_heads, d]);
                        Some((norm_rope(&k, Some(k_norm), eps, &cos_c, &sin_c).transpose(1, 2), v.transpose(1, 2)))
                    }
                };
                drop(p);
                let p = span("drafter.attention");
                // The decoding kernels may take the layer, on a GPU they run on, with the block's keys right after the
                // context in the cache (they read the block's first position from `block_at`, on the device).
                let layer_attention = self.cfg.layer_attention[i];
                let kernels =
                    (at.is_some() || start + n + bs <= cache.capacity()) && super::staircase::applies(&q, &[]);
                let attn = match at {
                    None => {
                        if let Some((k, v)) = &context_kv {
                            let _ = cache.write(i, k, v)?;
                        }
                        let taken = match kernels {
                            // The block over the rows past the context, which the next pass overwrites.
                            true => {
                                let (k, v) = cache.write_at(i, &block_at, &k_blk, &v_blk)?;
                                decode_attention(&q, &k, &v, &block_at, layer_attention)?
                            }
                            false => None,
                        };
                        match taken {
                            Some(attn) => attn,
                            // The bucketed context and the block, masked.
                            None => {
                                let (k_ctx, v_ctx) = cache.prefix(i, padded)?;
                                let (k, v) =
                                    (Tensor::f_cat(&[&k_ctx, &k_blk], 2)?, Tensor::f_cat(&[&v_ctx, &v_blk], 2)?);
                                masked_attention(&q, &k, &v, bias)?
                            }
                        }
                    }
                    // The block's keys go over the rows past the new context, which the next pass overwrites.
                    Some(_) => {
                        if let Some((k, v)) = &context_kv {
                            let _ = cache.write_at(i, &context_at, k, v)?;
                        }
                        let (k, v) = cache.write_at(i, &block_at, &k_blk, &v_blk)?;
                        let taken = match kernels {
                            true => decode_attention(&q, &k, &v, &block_at, layer_attention)?,
                            false => None,
                        };
                        match taken {
                            Some(attn) => attn,
                            None => masked_attention(&q, &k, &v, bias)?,
                        }
                    }
                };
                drop(p);
                let p = span("drafter.mlp");
                let o = attn.transpose(1, 2).reshape([1, bs, heads * d]).f_linear(w(layer.o_proj), None::<Tensor>)?;
                x = &x + finish(attention_conv.as_ref(), o, attention_kernel)?;
                let (h, kernel) = prepare(mlp_conv.as_ref(), rms_norm(&x, w(layer.post_attention_layernorm), eps))?;
                x = &x + finish(mlp_conv.as_ref(), swiglu(&h, w(layer.gate_up_proj), w(layer.down_proj)), kernel)?;
                drop(p);
            }
            if at.is_none() {
                cache.advance(n);
            }
            Ok(rms_norm(&x, w(self.norm), eps))
        })
    }
}

/// Writes a drafter folder in the published format from its configuration and flat master weights (on any
/// device): `config.json` and `model.safetensors` under the published names, in `dtype`.
pub fn save_drafter_folder(
    dir: &Path,
    cfg: &DrafterConfig,
    layout: &FlatLayout,
    master: &Tensor,
    dtype: Kind,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|err| ModelError::Io { path: dir.to_path_buf(), err })?;
    let tensors = layout
        .named_views(master)
        .into_iter()
        .map(|(name, view)| Ok((name, HostTensor::from_tensor(&view.f_to_kind(dtype)?)?)))
        .collect::<Result<Vec<_>, ModelError>>()?;
    write_safetensors(&dir.join("model.safetensors"), &tensors, None)?;
    let json = serde_json::to_string_pretty(&cfg.to_json(kind_name(dtype))).expect("json");
    let path = dir.join("config.json");
    std::fs::write(&path, &json).map_err(|err| ModelError::Io { path: path.clone(), err })?;
    std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|err| ModelError::Io { path, err })
}

/// One group of consecutive blocks attended together.
struct AttentionGroup {
    /// First query row and number of query rows (`blocks * block_size`).
    query_start: i64,
    query_len: i64,
    /// Context keys `[context_from, context_len)` this group may need: from the first of its blocks' conversations
    /// (packed rows; else 0) rounded down, to its largest anchor rounded up, both to [`CONTEXT_BUCKET`] so that the
    /// shapes recur.
    context_from: i64,
    context_len: i64,
    /// `[B, 1, query_len, context_len - context_from + query_len]`: 0 where visible, -inf elsewhere.
    bias: Tensor,
    /// `[B, query_len]`: each query's absolute position (its anchor plus its slot).
    query_at: Tensor,
}

/// The DFlash training attention pattern for one batch of blocks, ready to run: on a GPU the staircase kernels take
/// it as each block's context range and the layer's restriction ([`super::staircase`]); elsewhere (the CPU's
/// reference, shapes the kernels do not take) groups of blocks attend densely, the mask a bias, built on first use
/// (the kernels need none: at long contexts the biases would take gigabytes).
pub struct BlockAttention {
    plan: GroupPlan,
    /// The layer's restriction of the rule (a sliding window, a causal block).
    layer: LayerAttention,
    groups: std::cell::OnceCell<Vec<AttentionGroup>>,
    /// Each block's context range `[lo, hi)`, `[B, N]` int32 on the device (ascending along each row): where the
    /// kernels may run.
    ranges: Option<(Tensor, Tensor)>,
}

/// What the dense groups are built from ([`BlockAttention::new`]'s arguments).
#[derive(Clone)]
struct GroupPlan {
    anchors: Vec<i64>,
    context_starts: Option<Vec<i64>>,
    batch: usize,
    block_size: usize,
    seq_len: i64,
    group_blocks: usize,
    kind: Kind,
    device: Device,
}

impl BlockAttention {
    /// The pattern for `anchors` (`[B * N]`, row-major, ascending in each row; padding blocks carry anchor 0 and see
    /// only themselves), in groups of at most `group_blocks` blocks, over a context of `seq_len` tokens. With
    /// `context_starts` (`[B * N]`, packed rows), a block sees the context from its conversation's first token to
    /// its anchor; without, from the row's start.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        anchors: &[i64],
        context_starts: Option<&[i64]>,
        batch: usize,
        block_size: usize,
        seq_len: i64,
        group_blocks: usize,
        kind: Kind,
        device: Device,
    ) -> Result<Self, ModelError> {
        let n = anchors.len() / batch.max(1);
        let ranges = match device {
            Device::Cuda(_) => super::staircase::block_ranges(anchors, context_starts, batch, block_size, seq_len)
                .map(|(lo, hi)| -> Result<_, ModelError> {
                    let to = |v: Vec<i32>| Tensor::f_from_slice(&v)?.f_view([batch as i64, n as i64])?.f_to(device);
                    Ok((to(lo)?, to(hi)?))
                })
                .transpose()?,
            _ => None,
        };
        let plan = GroupPlan {
            anchors: anchors.to_vec(),
            context_starts: context_starts.map(<[i64]>::to_vec),
            batch,
            block_size,
            seq_len,
            group_blocks: group_blocks.max(1),
            kind,
            device,
        };
        Ok(BlockAttention { plan, layer: LayerAttention::default(), groups: Default::default(), ranges })
    }

    /// The pattern of a draft layer that restricts the rule further ([`LayerAttention`]: a sliding window, a causal
    /// block), from this one.
    pub fn restricted(&self, layer: &LayerAttention) -> Result<BlockAttention, ModelError> {
        let ranges = self.ranges.as_ref().map(|(lo, hi)| (lo.shallow_clone(), hi.shallow_clone()));
        Ok(BlockAttention { plan: self.plan.clone(), layer: *layer, groups: Default::default(), ranges })
    }

    /// The dense groups, built on first use.
    fn groups(&self) -> Result<&[AttentionGroup], ModelError> {
        if let Some(groups) = self.groups.get() {
            return Ok(groups);
        }
        let mut groups = self.plan.groups()?;
        if self.layer.restricts() {
            groups = restrict(&groups, &self.layer)?;
        }
        Ok(self.groups.get_or_init(|| groups))
    }

    /// Attention of block queries `q [B, h, Q, d]` over context keys/values `[B, kv, S, d]` and block keys/values
    /// `[B, kv, Q, d]` (`kv` dividing `h`: grouped-query heads); returns `[B, h, Q, d]`.
    pub fn run(&self, q: &Tensor, k_ctx: &Tensor, v_ctx: &Tensor, k_blk: &Tensor, v_blk: &Tensor) -> Tensor {
        if let Some((lo, hi)) = &self.ranges
            && super::staircase::applies(q, &[k_ctx, v_ctx, k_blk, v_blk])
        {
            let window = self.layer.window.map_or(0, |w| w.clamp(1, i32::MAX as i64));
            let ranges = crate::ffi::attention::StaircaseRanges { lo, hi, causal: self.layer.causal, window };
            match super::staircase::attention(q, k_ctx, v_ctx, k_blk, v_blk, &ranges) {
                Ok(out) => return out,
                Err(e) => panic!("staircase attention: {e}"),
            }
        }
        let rep = q.size()[1] / k_ctx.size()[1];
        let (k_ctx, v_ctx) = (repeat_kv(k_ctx, rep), repeat_kv(v_ctx, rep));
        let (k_blk, v_blk) = (repeat_kv(k_blk, rep), repeat_kv(v_blk, rep));
        let (k_ctx, v_ctx, k_blk, v_blk) = (&k_ctx, &v_ctx, &k_blk, &v_blk);
        let groups = self.groups().unwrap_or_else(|e| panic!("drafter attention pattern: {e}"));
        let outs: Vec<Tensor> = groups
            .iter()
            .map(|g| {
                let keys = |ctx: &Tensor, blk: &Tensor| {
                    let context = ctx.narrow(2, g.context_from, g.context_len - g.context_from);
                    Tensor::cat(&[context, blk.narrow(2, g.query_start, g.query_len)], 2)
                };
                Tensor::scaled_dot_product_attention(
                    &q.narrow(2, g.query_start, g.query_len),
                    &keys(k_ctx, k_blk),
                    &keys(v_ctx, v_blk),
                    Some(&g.bias),
                    0.0,
                    false,
                    None,
                    false,
                )
            })
            .collect();
        if outs.len() == 1 {
            return outs.into_iter().next().expect("one group");
        }
        Tensor::cat(&outs, 2)
    }
}

impl GroupPlan {
    /// The dense groups: each attends to its blocks' context prefix and their own keys, the mask a bias.
    fn groups(&self) -> Result<Vec<AttentionGroup>, ModelError> {
        let (anchors, context_starts) = (self.anchors.as_slice(), self.context_starts.as_deref());
        let (batch, seq_len, group_blocks, kind, device) =
            (self.batch, self.seq_len, self.group_blocks, self.kind, self.device);
        let n = anchors.len() / batch.max(1);
        let bs = self.block_size as i64;
        let anchors_dev = Tensor::f_from_slice(anchors)?.f_view([batch as i64, n as i64])?.f_to(device)?;
        let starts_dev = context_starts
            .map(|starts| Tensor::f_from_slice(starts)?.f_view([batch as i64, n as i64])?.f_to(device))
            .transpose()?;
        let mut groups = Vec::new();
        for j0 in (0..n).step_by(group_blocks) {
            let nb = group_blocks.min(n - j0);
            let largest =
                (0..batch).flat_map(|b| anchors[b * n + j0..b * n + j0 + nb].iter().copied()).max().unwrap_or(0);
            let context_len = context_bucket(largest).min(context_bucket(seq_len));
            // Packed rows: the first context key any block of the group sees (a block at its conversation's start
            // sees none, and a padding block none at all).
            let first = context_starts.map_or(0, |starts| {
                (0..batch)
                    .flat_map(|b| (b * n + j0..b * n + j0 + nb).map(move |i| (starts[i], anchors[i])))
                    .filter(|&(start, anchor)| anchor > start)
                    .map(|(start, _)| start)
                    .min()
                    .unwrap_or(context_len)
            });
            let context_from = (first / CONTEXT_BUCKET * CONTEXT_BUCKET).min(context_len);
            let q_len = nb as i64 * bs;
            let anchor_q =
                anchors_dev.narrow(1, j0 as i64, nb as i64).f_repeat_interleave_self_int(bs, Some(1), None)?;
            let context = Tensor::f_arange_start(context_from, context_len, (Kind::Int64, device))?.view([
                1,
                1,
                context_len - context_from,
            ]);
            let mut ctx_ok = context.f_lt_tensor(&anchor_q.unsqueeze(-1))?;
            if let Some(starts) = &starts_dev {
                let start_q = starts.narrow(1, j0 as i64, nb as i64).f_repeat_interleave_self_int(bs, Some(1), None)?;
                ctx_ok = ctx_ok.f_logical_and(&context.f_ge_tensor(&start_q.unsqueeze(-1))?)?;
            }
            let block_of = Tensor::f_arange(q_len, (Kind::Int64, device))?.f_floor_divide_scalar(bs)?;
            let same_block = block_of
                .unsqueeze(1)
                .f_eq_tensor(&block_of.unsqueeze(0))?
                .unsqueeze(0)
                .expand([batch as i64, q_len, q_len], false);
            let visible = Tensor::f_cat(&[ctx_ok, same_block], 2)?;
            let bias = Tensor::f_zeros(visible.size(), (kind, device))?
                .f_masked_fill(&visible.logical_not(), f64::NEG_INFINITY)?
                .unsqueeze(1);
            let slot = Tensor::f_arange(q_len, (Kind::Int64, device))?.f_remainder(bs)?;
            let query_at = anchor_q.f_add(&slot)?;
            groups.push(AttentionGroup {
                query_start: j0 as i64 * bs,
                query_len: q_len,
                context_from,
                context_len,
                bias,
                query_at,
            });
        }
        Ok(groups)
    }
}

/// `groups` restricted further by a draft layer ([`LayerAttention`]: a sliding window, a causal block).
fn restrict(groups: &[AttentionGroup], layer: &LayerAttention) -> Result<Vec<AttentionGroup>, ModelError> {
    groups
        .iter()
        .map(|g| {
            // Keys in the order the bias has them: the context prefix, then the group's block keys.
            let rows = g.query_at.size()[0];
            let context = Tensor::f_arange_start(g.context_from, g.context_len, (Kind::Int64, g.query_at.device()))?
                .f_expand([rows, 1, g.context_len - g.context_from], false)?;
            let keys_at = Tensor::f_cat(&[context, g.query_at.f_unsqueeze(1)?], 2)?;
            let bias = match layer.hides(&g.query_at.f_unsqueeze(2)?, &keys_at)? {
                Some(hidden) => g.bias.f_masked_fill(&hidden.f_unsqueeze(1)?, f64::NEG_INFINITY)?,
                None => g.bias.shallow_clone(),
            };
            Ok(AttentionGroup {
                query_start: g.query_start,
                query_len: g.query_len,
                context_from: g.context_from,
                context_len: g.context_len,
                bias,
                query_at: g.query_at.shallow_clone(),
            })
        })
        .collect()
}
