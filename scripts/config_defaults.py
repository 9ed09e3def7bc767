"""What transformers makes of the config.json keys dflash reads, for each target family, keys absent or null included.

  python config_defaults.py OUT

writes OUT/<transformers version>/<family>-<variant>/config.json and expected.json, for four families (llama, qwen3,
qwen3_moe, gpt_oss) and three variants:
  saved   the family's config class with small sizes, as this release's save_pretrained writes it;
  sparse  only the sizes and the family: every other key absent (an old or hand-written config.json);
  nulls   the sparse one with the optional keys written as null (rope_scaling among them, no rope_parameters),
          as some exporters write them; a key this release refuses as null (its field is typed) is left out.
expected.json is the config as transformers loads it (AutoConfig.from_pretrained) and as its modeling files then read
it (head_dim falling back to hidden_size / num_attention_heads where the attribute is missing, the GPT-OSS SwiGLU limit
to 7.0): the values dflash must read from config.json. tests/hf_configs.rs compares dflash against these folders,
made with two releases (run this script once in a venv of each) and committed under tests/fixtures/hf-configs.
"""

import json
import os
import sys
import tempfile

import transformers
from transformers import AutoConfig, GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

SIZES = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 4, "num_attention_heads": 32}
FAMILIES = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    "gpt_oss": (GptOssConfig, "GptOssForCausalLM"),
}
NULLS = [
    "rope_scaling",
    "head_dim",
    "num_key_value_heads",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "layer_types",
]
RESOLVED = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_bias",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "sliding_window",
    "layer_types",
]


def resolved(config):
    out = {key: getattr(config, key, None) for key in RESOLVED}
    head_dim = getattr(config, "head_dim", None)
    out["head_dim"] = head_dim if head_dim is not None else config.hidden_size // config.num_attention_heads
    out["num_experts"] = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    out["swiglu_limit"] = getattr(config, "swiglu_limit", 7.0) if config.model_type == "gpt_oss" else None
    out["rope_parameters"] = dict(config.rope_parameters) if config.rope_parameters else None
    return out


def write(folder, config_json, config):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(resolved(config), f, indent=1, sort_keys=True)
        f.write("\n")


def main(out):
    root = os.path.join(out, transformers.__version__)
    for family, (cls, architecture) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            cls(**SIZES).save_pretrained(tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                saved = json.load(f)
            write(os.path.join(root, f"{family}-saved"), saved, AutoConfig.from_pretrained(tmp))
        sparse = dict(SIZES, architectures=[architecture], model_type=family)
        write(os.path.join(root, f"{family}-sparse"), sparse, load(sparse))
        nulls = dict(sparse, **{key: None for key in NULLS})
        while True:
            try:
                loaded = load(nulls)
                break
            except Exception as e:
                refused = getattr(e, "field", None) or next((k for k in nulls if f"'{k}'" in str(e)), None)
                if refused not in nulls or nulls[refused] is not None:
                    raise
                del nulls[refused]
        write(os.path.join(root, f"{family}-nulls"), nulls, loaded)


def load(config_json):
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_json, f)
        return AutoConfig.from_pretrained(tmp)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
