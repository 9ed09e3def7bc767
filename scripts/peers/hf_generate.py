"""HuggingFace's batched `generate` at a preset's shapes with random weights, beside `dflash bench --what generate`
(BENCHMARKS.md, "Batched generation"): the same prompts (random ids of --seq tokens), every answer exactly --max-new
tokens (min_new_tokens = max_new_tokens, as dflash's generation without a stop token), greedy, bf16, sdpa, batches of
--batch. Weights are drawn on the GPU with transformers' own initialisation (normal, std 0.02). Prints one JSON line.

  python3 scripts/peers/hf_generate.py --preset qwen3-8b --batch 512 --prompts 512 --seq 64 --max-new 256
"""

import argparse
import json
import time

import torch

# The shapes of dflash's presets (src/model/presets.rs).
PRESETS = {
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=256)
    args = parser.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**PRESETS[args.preset], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.seq), generator=generator)

    def run(ids):
        ids = ids.cuda()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new,
                min_new_tokens=args.max_new,
                do_sample=False,
                pad_token_id=0,
            )
        return out.shape[1] - ids.shape[1]

    run(prompts[: min(args.batch, 8)])  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    new_tokens = 0
    for first in range(0, args.prompts, args.batch):
        chunk = prompts[first : first + args.batch]
        new_tokens += run(chunk) * chunk.shape[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "what": "hf_generate",
                "preset": args.preset,
                "batch": args.batch,
                "prompts": args.prompts,
                "prompt_len": args.seq,
                "max_new": args.max_new,
                "new_tokens": new_tokens,
                "seconds": round(seconds, 2),
                "tokens_per_s": round(new_tokens / seconds),
                "peak_mem_bytes": torch.cuda.max_memory_allocated(),
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
