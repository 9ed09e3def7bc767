//! Test helpers: random HuggingFace-named weights for small decoders, writing them as a model folder, and a naive
//! reference decoder (f64, one sequence at a time, explicit loops over heads and an explicit causal mask) that
//! shares no code with the library's model.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use dflash::model::config::{GptOssConfig, MoeConfig, RopeScaling};
use dflash::model::weights::{HostTensor, write_sharded};
use dflash::model::{Architecture, DrafterConfig, TargetConfig};
use tch::{Device, Kind, Tensor};

pub type Weights = BTreeMap<String, Tensor>;

/// A small decoder whose attention width (heads * head_dim = 64) differs from its hidden size (48), so a mix-up
/// of the two cannot pass.
pub fn small_config(architecture: Architecture, tie: bool, scaling: RopeScaling) -> TargetConfig {
    TargetConfig {
        architecture,
        vocab_size: 97,
        hidden_size: 48,
        intermediate_size: 80,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: scaling,
        max_position_embeddings: 256,
        tie_word_embeddings: tie,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: Some(0),
        moe: None,
        gpt_oss: None,
    }
}

/// [`small_config`] as a Qwen3-MoE: 6 experts of width 24, two per token, renormalised; layer 1 keeps a dense MLP
/// (`mlp_only_layers`), so both kinds of layer are tapped.
pub fn small_moe_config() -> TargetConfig {
    TargetConfig {
        moe: Some(MoeConfig {
            num_experts: 6,
            num_experts_per_tok: 2,
            moe_intermediate_size: 24,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![1],
        }),
        ..small_config(Architecture::Qwen3Moe, false, RopeScaling::None)
    }
}

/// [`small_config`] as a GPT-OSS: 6 experts of width 24, two per token, a window of 3 positions on layers 0 and 2,
/// YaRN, and a SwiGLU limit low enough (1.5) that the clamps act on random weights.
pub fn small_gpt_oss_config() -> TargetConfig {
    TargetConfig {
        intermediate_size: 24,
        rope_scaling: RopeScaling::Yarn {
            factor: 4.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 16.0,
            truncate: false,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
        },
        moe: Some(MoeConfig {
            num_experts: 6,
            num_experts_per_tok: 2,
            moe_intermediate_size: 24,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
        }),
        gpt_oss: Some(GptOssConfig {
            sliding_window: 3,
            sliding_layers: vec![true, false, true, false],
            swiglu_alpha: 1.702,
            swiglu_limit: 1.5,
        }),
        ..small_config(Architecture::GptOss, false, RopeScaling::None)
    }
}

pub fn llama3_scaling() -> RopeScaling {
    RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32.0,
    }
}

/// Runs `draw` with libtorch's global generator seeded with `seed`, while no other caller of this function draws.
/// A test binary's tests run on parallel threads and share that generator: unguarded, their draws interleave and a
/// seed gives different weights from run to run (a routing margin chosen for a seed then fails now and then).
pub fn seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _only_this_test = GENERATOR.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(seed);
    draw()
}

/// Random weights under HuggingFace names. Matrices are large enough (std 0.15) that attention is far from
/// uniform, and norm weights are not all ones, so skipping any piece changes the output.
pub fn random_weights(cfg: &TargetConfig, seed: i64) -> Weights {
    seeded(seed, || {
        let (h, i, d) = (cfg.hidden_size as i64, cfg.intermediate_size as i64, cfg.head_dim as i64);
        let (q, kv) = (cfg.num_attention_heads as i64 * d, cfg.num_key_value_heads as i64 * d);
        let v = cfg.vocab_size as i64;
        let mat = |r: i64, c: i64| Tensor::randn([r, c], (Kind::Float, Device::Cpu)) * 0.15;
        let norm = |n: i64| Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.1 + 1.0;
        let mut w = Weights::new();
        w.insert("model.embed_tokens.weight".into(), Tensor::randn([v, h], (Kind::Float, Device::Cpu)));
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            w.insert(format!("{p}.input_layernorm.weight"), norm(h));
            w.insert(format!("{p}.post_attention_layernorm.weight"), norm(h));
            w.insert(format!("{p}.self_attn.q_proj.weight"), mat(q, h));
            w.insert(format!("{p}.self_attn.k_proj.weight"), mat(kv, h));
            w.insert(format!("{p}.self_attn.v_proj.weight"), mat(kv, h));
            w.insert(format!("{p}.self_attn.o_proj.weight"), mat(h, q));
            if cfg.gpt_oss.is_some() {
                let vec = |n: i64| Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.3;
                w.insert(format!("{p}.self_attn.q_proj.bias"), vec(q));
                w.insert(format!("{p}.self_attn.k_proj.bias"), vec(kv));
                w.insert(format!("{p}.self_attn.v_proj.bias"), vec(kv));
                w.insert(format!("{p}.self_attn.o_proj.bias"), vec(h));
                w.insert(format!("{p}.self_attn.sinks"), vec(cfg.num_attention_heads as i64) * 3.0);
                let m = cfg.moe.as_ref().unwrap();
                let (e, iw) = (m.num_experts as i64, m.moe_intermediate_size as i64);
                let stack = |r: i64, c: i64| Tensor::stack(&(0..e).map(|_| mat(r, c)).collect::<Vec<_>>(), 0);
                w.insert(format!("{p}.mlp.router.weight"), mat(e, h));
                w.insert(format!("{p}.mlp.router.bias"), vec(e));
                w.insert(format!("{p}.mlp.experts.gate_up_proj"), stack(h, 2 * iw));
                w.insert(format!("{p}.mlp.experts.gate_up_proj_bias"), vec(e * 2 * iw).view([e, 2 * iw]));
                w.insert(format!("{p}.mlp.experts.down_proj"), stack(iw, h));
                w.insert(format!("{p}.mlp.experts.down_proj_bias"), vec(e * h).view([e, h]));
            }
            if cfg.architecture.has_qk_norm() {
                w.insert(format!("{p}.self_attn.q_norm.weight"), norm(d));
                w.insert(format!("{p}.self_attn.k_norm.weight"), norm(d));
            }
            match cfg.moe.as_ref().filter(|m| m.is_sparse(l)) {
                Some(_) if cfg.gpt_oss.is_some() => {}
                Some(m) => {
                    let mi = m.moe_intermediate_size as i64;
                    w.insert(format!("{p}.mlp.gate.weight"), mat(m.num_experts as i64, h));
                    for e in 0..m.num_experts {
                        w.insert(format!("{p}.mlp.experts.{e}.gate_proj.weight"), mat(mi, h));
                        w.insert(format!("{p}.mlp.experts.{e}.up_proj.weight"), mat(mi, h));
                        w.insert(format!("{p}.mlp.experts.{e}.down_proj.weight"), mat(h, mi));
                    }
                }
                None => {
                    w.insert(format!("{p}.mlp.gate_proj.weight"), mat(i, h));
                    w.insert(format!("{p}.mlp.up_proj.weight"), mat(i, h));
                    w.insert(format!("{p}.mlp.down_proj.weight"), mat(h, i));
                }
            }
        }
        w.insert("model.norm.weight".into(), norm(h));
        if !cfg.tie_word_embeddings {
            w.insert("lm_head.weight".into(), mat(v, h));
        }
        w
    })
}

/// Writes `weights` and `cfg` as a HuggingFace folder; shards when they exceed `max_shard_bytes`.
pub fn write_folder(dir: &Path, cfg: &TargetConfig, weights: &Weights, max_shard_bytes: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let host = weights.iter().map(|(n, t)| (n.clone(), HostTensor::from_tensor(t).unwrap())).collect();
    write_sharded(dir, host, max_shard_bytes).unwrap();
    let json = serde_json::to_string_pretty(&cfg.to_hf_json("float32")).unwrap();
    std::fs::write(dir.join("config.json"), json).unwrap();
}

fn f64w(w: &Weights, name: &str) -> Tensor {
    w[name].to_kind(Kind::Double)
}

pub fn rms(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Double);
    x / (var + eps).sqrt() * weight
}

/// Inverse frequencies in plain f64 arithmetic, with Llama-3 and YaRN scaling written from their published
/// definitions (YaRN: the paper's ramp between the dimensions that rotate `beta_fast` and `beta_slow` times over the
/// original context).
pub fn inv_freqs(cfg: &TargetConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64);
            match cfg.rope_scaling {
                RopeScaling::None => f,
                RopeScaling::Yarn {
                    factor,
                    beta_fast,
                    beta_slow,
                    original_max_position_embeddings: old,
                    truncate,
                    ..
                } => {
                    let dim_of = |rotations: f64| {
                        d as f64 * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * cfg.rope_theta.ln())
                    };
                    let (mut low, mut high) = (dim_of(beta_fast), dim_of(beta_slow));
                    if truncate {
                        (low, high) = (low.floor(), high.ceil());
                    }
                    let (low, mut high) = (low.max(0.0), high.min(d as f64 - 1.0));
                    if low == high {
                        high += 0.001;
                    }
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: lo,
                    high_freq_factor: hi,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / hi {
                        f
                    } else if wavelen > old / lo {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// Rotates each adjacent-half pair (j, j + d/2) of every row `p` of `x [len, d]` by angle `p * inv_freq[j]`.
pub fn rope(x: &Tensor, inv: &[f64]) -> Tensor {
    let len = x.size()[0];
    let positions: Vec<i64> = (0..len).collect();
    rope_at(x, inv, &positions)
}

/// Like [`rope`], with row r at position `positions[r]`.
pub fn rope_at(x: &Tensor, inv: &[f64], positions: &[i64]) -> Tensor {
    let (len, d) = (x.size()[0], x.size()[1]);
    let half = d / 2;
    let mut cos = vec![0f64; (len * d) as usize];
    let mut sin = vec![0f64; (len * d) as usize];
    for p in 0..len {
        for j in 0..half {
            let a = positions[p as usize] as f64 * inv[j as usize];
            for col in [j, j + half] {
                cos[(p * d + col) as usize] = a.cos();
                sin[(p * d + col) as usize] = a.sin();
            }
        }
    }
    let cos = Tensor::from_slice(&cos).view([len, d]);
    let sin = Tensor::from_slice(&sin).view([len, d]);
    let x1 = x.narrow(1, 0, half);
    let x2 = x.narrow(1, half, half);
    let rotated = Tensor::cat(&[-x2, x1], 1);
    x * cos + rotated * sin
}

/// One sequence through the decoder: the output of every layer (`[len, hidden]` each) and the logits; for a
/// mixture of experts, each sparse layer's chosen experts per token (most probable first) and the smallest gap
/// between the last chosen and the first unchosen expert's probability anywhere (how far routing is from a tie).
pub struct NaiveRun {
    pub layer_outputs: Vec<Tensor>,
    pub logits: Tensor,
    pub experts: Vec<Vec<Vec<i64>>>,
    pub routing_margin: f64,
}

/// `down(silu(gate(h)) * up(h))` with the three weights named by `prefix`.
fn naive_swiglu(w: &Weights, prefix: &str, h: &Tensor) -> Tensor {
    let gate = h.matmul(&f64w(w, &format!("{prefix}.gate_proj.weight")).tr());
    let up = h.matmul(&f64w(w, &format!("{prefix}.up_proj.weight")).tr());
    (&gate * gate.sigmoid() * up).matmul(&f64w(w, &format!("{prefix}.down_proj.weight")).tr())
}

/// A token's experts ranked by `scores` (best first): the top `k` as (score, expert), and the gap between the k-th
/// and the (k+1)-th score (how far the choice is from a tie; infinite when every expert is chosen).
fn top_k(scores: &Tensor, k: usize) -> (Vec<(f64, i64)>, f64) {
    let mut ranked: Vec<(f64, i64)> = Vec::<f64>::try_from(scores).unwrap().into_iter().zip(0..).collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let margin = if k < ranked.len() { ranked[k - 1].0 - ranked[k].0 } else { f64::INFINITY };
    ranked.truncate(k);
    (ranked, margin)
}

/// HF's Qwen3-MoE block, one token at a time: softmax over the router's logits, the top k, renormalised if asked,
/// the weighted sum of those experts. Returns the output, each token's experts and the routing margin.
fn naive_moe(m: &MoeConfig, w: &Weights, p: &str, h: &Tensor) -> (Tensor, Vec<Vec<i64>>, f64) {
    let probs = h.matmul(&f64w(w, &format!("{p}.mlp.gate.weight")).tr()).softmax(-1, Kind::Double);
    let (mut rows, mut chosen, mut margin) = (vec![], vec![], f64::INFINITY);
    for t in 0..h.size()[0] {
        let (top, gap) = top_k(&probs.get(t), m.num_experts_per_tok);
        margin = margin.min(gap);
        let total: f64 = if m.norm_topk_prob { top.iter().map(|r| r.0).sum() } else { 1.0 };
        let x = h.narrow(0, t, 1);
        let mut y = Tensor::zeros_like(&x);
        for &(prob, e) in &top {
            y += naive_swiglu(w, &format!("{p}.mlp.experts.{e}"), &x) * (prob / total);
        }
        rows.push(y);
        chosen.push(top.iter().map(|r| r.1).collect());
    }
    (Tensor::cat(&rows, 0), chosen, margin)
}

/// HF's GPT-OSS block, one token at a time: router logits (with bias), the top k, softmax over those k; each
/// expert `x @ W_gate_up + b` (gate and up interleaved), clamped SwiGLU, `@ W_down + b`, weighted and summed.
fn naive_gpt_oss_moe(
    m: &MoeConfig,
    oss: &GptOssConfig,
    w: &Weights,
    p: &str,
    h: &Tensor,
) -> (Tensor, Vec<Vec<i64>>, f64) {
    let logits = h.matmul(&f64w(w, &format!("{p}.mlp.router.weight")).tr()) + f64w(w, &format!("{p}.mlp.router.bias"));
    let x_of = |name: &str| f64w(w, &format!("{p}.mlp.experts.{name}"));
    let (gate_up, gate_up_bias, down, down_bias) =
        (x_of("gate_up_proj"), x_of("gate_up_proj_bias"), x_of("down_proj"), x_of("down_proj_bias"));
    let (alpha, limit) = (oss.swiglu_alpha, oss.swiglu_limit);
    let (mut rows, mut chosen, mut margin) = (vec![], vec![], f64::INFINITY);
    for t in 0..h.size()[0] {
        let (top, gap) = top_k(&logits.get(t), m.num_experts_per_tok);
        margin = margin.min(gap);
        let total: f64 = top.iter().map(|r| (r.0 - top[0].0).exp()).sum();
        let x = h.get(t);
        let mut y = Tensor::zeros_like(&x);
        for &(logit, e) in &top {
            let gu: Vec<f64> = Vec::try_from(&(x.matmul(&gate_up.get(e)) + gate_up_bias.get(e))).unwrap();
            let act: Vec<f64> = gu
                .chunks(2)
                .map(|pair| {
                    let (g, u) = (pair[0].min(limit), pair[1].clamp(-limit, limit));
                    (u + 1.0) * g / (1.0 + (-alpha * g).exp())
                })
                .collect();
            let out = Tensor::from_slice(&act).matmul(&down.get(e)) + down_bias.get(e);
            y += out * ((logit - top[0].0).exp() / total);
        }
        rows.push(y.unsqueeze(0));
        chosen.push(top.iter().map(|r| r.1).collect());
    }
    (Tensor::cat(&rows, 0), chosen, margin)
}

pub fn naive_forward(cfg: &TargetConfig, w: &Weights, ids: &[i64]) -> NaiveRun {
    let len = ids.len() as i64;
    let d = cfg.head_dim as i64;
    let eps = cfg.rms_norm_eps;
    let inv = inv_freqs(cfg);
    let group = (cfg.num_attention_heads / cfg.num_key_value_heads) as i64;
    let causal = Tensor::ones([len, len], (Kind::Double, Device::Cpu)).triu(1).to_kind(Kind::Bool);
    let mut x = f64w(w, "model.embed_tokens.weight").index_select(0, &Tensor::from_slice(ids));
    let (mut outputs, mut experts, mut routing_margin) = (vec![], vec![], f64::INFINITY);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let h = rms(&x, &f64w(w, &format!("{p}.input_layernorm.weight")), eps);
        let proj = |name: &str| {
            let y = h.matmul(&f64w(w, &format!("{p}.self_attn.{name}.weight")).tr());
            match w.get(&format!("{p}.self_attn.{name}.bias")) {
                Some(b) => y + b.to_kind(Kind::Double),
                None => y,
            }
        };
        let (q, k, v) = (proj("q_proj"), proj("k_proj"), proj("v_proj"));
        // GPT-OSS: keys more than `window - 1` positions back are hidden too; YaRN scales cos and sin.
        let window = cfg.gpt_oss.as_ref().filter(|o| o.sliding_layers[l]).map(|o| o.sliding_window as i64);
        let hidden_keys = match window {
            Some(wnd) => {
                causal.logical_or(&Tensor::ones([len, len], (Kind::Double, Device::Cpu)).tril(-wnd).to_kind(Kind::Bool))
            }
            None => causal.shallow_clone(),
        };
        let scale = match cfg.rope_scaling {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        };
        let mut heads = vec![];
        for head in 0..cfg.num_attention_heads as i64 {
            let kv_head = head / group;
            let mut qh = q.narrow(1, head * d, d);
            let mut kh = k.narrow(1, kv_head * d, d);
            let vh = v.narrow(1, kv_head * d, d);
            if cfg.architecture.has_qk_norm() {
                qh = rms(&qh, &f64w(w, &format!("{p}.self_attn.q_norm.weight")), eps);
                kh = rms(&kh, &f64w(w, &format!("{p}.self_attn.k_norm.weight")), eps);
            }
            let (qh, kh) = (rope(&qh, &inv) * scale, rope(&kh, &inv) * scale);
            let scores = (qh.matmul(&kh.tr()) / (d as f64).sqrt()).masked_fill(&hidden_keys, f64::NEG_INFINITY);
            let probs = match w.get(&format!("{p}.self_attn.sinks")) {
                // The sink: one more logit per head in the softmax, dropped afterwards.
                Some(sinks) => {
                    let sink = Tensor::full([len, 1], sinks.double_value(&[head]), (Kind::Double, Device::Cpu));
                    Tensor::cat(&[scores, sink], 1).softmax(-1, Kind::Double).narrow(1, 0, len)
                }
                None => scores.softmax(-1, Kind::Double),
            };
            heads.push(probs.matmul(&vh));
        }
        let attn = Tensor::cat(&heads, 1);
        x = &x + attn.matmul(&f64w(w, &format!("{p}.self_attn.o_proj.weight")).tr());
        if let Some(b) = w.get(&format!("{p}.self_attn.o_proj.bias")) {
            x = &x + b.to_kind(Kind::Double);
        }
        let h = rms(&x, &f64w(w, &format!("{p}.post_attention_layernorm.weight")), eps);
        match cfg.moe.as_ref().filter(|m| m.is_sparse(l)) {
            Some(m) if cfg.gpt_oss.is_some() => {
                let (y, chosen, margin) = naive_gpt_oss_moe(m, cfg.gpt_oss.as_ref().unwrap(), w, &p, &h);
                x = &x + y;
                experts.push(chosen);
                routing_margin = routing_margin.min(margin);
            }
            Some(m) => {
                let (y, chosen, margin) = naive_moe(m, w, &p, &h);
                x = &x + y;
                experts.push(chosen);
                routing_margin = routing_margin.min(margin);
            }
            None => x = &x + naive_swiglu(w, &format!("{p}.mlp"), &h),
        }
        outputs.push(x.shallow_clone());
    }
    let head = if cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let logits = rms(&x, &f64w(w, "model.norm.weight"), eps).matmul(&f64w(w, head).tr());
    NaiveRun { layer_outputs: outputs, logits, experts, routing_margin }
}

/// Max |a - b| over max |b|: the relative error of `a` against reference `b`.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_kind(Kind::Double);
    let diff = (&a - b).abs().max().double_value(&[]);
    diff / b.abs().max().double_value(&[]).max(1e-12)
}

/// Right-padded `[B, S]` ids (pad id 0) from rows of different lengths, and the lengths.
pub fn pad_batch(rows: &[Vec<i64>]) -> (Tensor, Vec<i64>) {
    let s = rows.iter().map(Vec::len).max().unwrap();
    let mut flat = vec![];
    for r in rows {
        flat.extend_from_slice(r);
        flat.extend(std::iter::repeat_n(0, s - r.len()));
    }
    let ids = Tensor::from_slice(&flat).view([rows.len() as i64, s as i64]);
    (ids, rows.iter().map(|r| r.len() as i64).collect())
}

/// Deterministic pseudo-random token rows of the given lengths.
pub fn token_rows(vocab: i64, lengths: &[usize], seed: u64) -> Vec<Vec<i64>> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    lengths
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 33) % vocab as u64) as i64
                })
                .collect()
        })
        .collect()
}

/// One row of drafter inputs: the target's tapped features `[1, seq, taps * hidden]` and an embedding table (both
/// random), token ids and a loss mask of ones.
pub struct DrafterCase {
    pub features: Tensor,
    pub embed: Tensor,
    pub ids: Vec<i64>,
    pub mask: Vec<u8>,
}

/// A [`DrafterCase`] of `seq` tokens for a drafter of `cfg`, drawn from `seed`.
pub fn drafter_case(cfg: &DrafterConfig, seq: usize, seed: i64) -> DrafterCase {
    let (features, embed) = seeded(seed, || {
        let features = Tensor::randn([1, seq as i64, cfg.context_width() as i64], (Kind::Float, Device::Cpu));
        let shape = [cfg.decoder.vocab_size as i64, cfg.decoder.hidden_size as i64];
        (features, Tensor::randn(shape, (Kind::Float, Device::Cpu)))
    });
    let ids = token_rows(cfg.decoder.vocab_size as i64 - 1, &[seq], seed as u64).remove(0);
    DrafterCase { features, embed, ids, mask: vec![1; seq] }
}
