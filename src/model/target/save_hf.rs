//! The target as a HuggingFace folder: `config.json` and sharded safetensors (the tests' reference models, the
//! export of a built-in target).
use std::path::Path;

use tch::Tensor;

use super::layers::Mlp;
use super::{Depth, Target};
use crate::device::kind_name;
use crate::model::ModelError;
use crate::model::weights::{HostTensor, write_sharded};

impl Target {
    /// Writes this model as a HuggingFace folder (`config.json` + safetensors, sharded past `max_shard_bytes`).
    /// Needs [`Depth::Full`], so the folder holds the whole model.
    pub fn save_hf(&self, dir: &Path, max_shard_bytes: usize) -> Result<(), ModelError> {
        if self.depth != Depth::Full {
            return Err(ModelError::NotFull);
        }
        std::fs::create_dir_all(dir).map_err(|err| ModelError::Io { path: dir.to_path_buf(), err })?;
        let c = &self.cfg;
        let (q, kv) = ((c.num_attention_heads * c.head_dim) as i64, (c.num_key_value_heads * c.head_dim) as i64);
        let rows = |t: &Tensor, start: i64, len: i64| t.narrow(0, start, len);
        let mut tensors: Vec<(String, Tensor)> =
            vec![("model.embed_tokens.weight".into(), self.embed_tokens.shallow_clone())];
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let mut put = |suffix: String, t: Tensor| tensors.push((format!("{p}.{suffix}"), t));
            put("input_layernorm.weight".into(), layer.input_layernorm.shallow_clone());
            put("post_attention_layernorm.weight".into(), layer.post_attention_layernorm.shallow_clone());
            put("self_attn.q_proj.weight".into(), rows(&layer.qkv_proj, 0, q));
            put("self_attn.k_proj.weight".into(), rows(&layer.qkv_proj, q, kv));
            put("self_attn.v_proj.weight".into(), rows(&layer.qkv_proj, q + kv, kv));
            put("self_attn.o_proj.weight".into(), layer.o_proj.shallow_clone());
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                put("self_attn.q_norm.weight".into(), qn.shallow_clone());
                put("self_attn.k_norm.weight".into(), kn.shallow_clone());
            }
            match &layer.mlp {
                Mlp::Dense { gate_up_proj, down_proj } => {
                    let i = gate_up_proj.size()[0] / 2;
                    put("mlp.gate_proj.weight".into(), rows(gate_up_proj, 0, i));
                    put("mlp.up_proj.weight".into(), rows(gate_up_proj, i, i));
                    put("mlp.down_proj.weight".into(), down_proj.shallow_clone());
                }
                Mlp::Sparse(sparse) if sparse.router_bias().is_some() => {
                    let bias = |t: Option<&Tensor>| t.expect("GPT-OSS experts have biases").shallow_clone();
                    put("mlp.router.weight".into(), sparse.router().shallow_clone());
                    put("mlp.router.bias".into(), bias(sparse.router_bias()));
                    put("mlp.experts.gate_up_proj".into(), sparse.gate_up().shallow_clone());
                    put("mlp.experts.gate_up_proj_bias".into(), bias(sparse.gate_up_bias()));
                    put("mlp.experts.down_proj".into(), sparse.down().shallow_clone());
                    put("mlp.experts.down_proj_bias".into(), bias(sparse.down_bias()));
                }
                Mlp::Sparse(sparse) => {
                    put("mlp.gate.weight".into(), sparse.router().shallow_clone());
                    let i = sparse.gate_up().size()[2] / 2;
                    for e in 0..sparse.gate_up().size()[0] {
                        let gate_up = sparse.gate_up().get(e).tr();
                        put(format!("mlp.experts.{e}.gate_proj.weight"), rows(&gate_up, 0, i));
                        put(format!("mlp.experts.{e}.up_proj.weight"), rows(&gate_up, i, i));
                        put(format!("mlp.experts.{e}.down_proj.weight"), sparse.down().get(e).tr());
                    }
                }
            }
            if let (Some(bias), Some(o_bias), Some(sinks)) = (&layer.qkv_bias, &layer.o_bias, &layer.sinks) {
                put("self_attn.q_proj.bias".into(), bias.narrow(0, 0, q));
                put("self_attn.k_proj.bias".into(), bias.narrow(0, q, kv));
                put("self_attn.v_proj.bias".into(), bias.narrow(0, q + kv, kv));
                put("self_attn.o_proj.bias".into(), o_bias.shallow_clone());
                put("self_attn.sinks".into(), sinks.shallow_clone());
            }
        }
        if let Some(norm) = &self.norm {
            tensors.push(("model.norm.weight".into(), norm.shallow_clone()));
        }
        if let Some(head) = &self.lm_head {
            tensors.push(("lm_head.weight".into(), head.shallow_clone()));
        }
        let host = tensors
            .into_iter()
            .map(|(name, t)| Ok((name, HostTensor::from_tensor(&t)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        write_sharded(dir, host, max_shard_bytes)?;
        self.save_hf_config(dir)
    }

    /// The HuggingFace `config.json` of this model, into the existing folder `dir`.
    pub fn save_hf_config(&self, dir: &Path) -> Result<(), ModelError> {
        let config = serde_json::to_string_pretty(&self.cfg.to_hf_json(kind_name(self.kind))).expect("json");
        let path = dir.join("config.json");
        std::fs::write(&path, config).map_err(|err| ModelError::Io { path, err })
    }
}
