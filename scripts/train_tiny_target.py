#!/usr/bin/env python3
"""Trains `tiny-tasks`, the built-in target of the default run: a Qwen3-architecture model of the `tiny` shape
(64 wide, 8 layers, byte-level vocabulary of 320) taught the built-in tasks (counting, sums, repeating, reversing,
spelling), so that its greedy answers follow from the question and a drafter has something to learn.

Plain PyTorch (no transformers): the model below is HuggingFace's Qwen3 (RMSNorm, q/k norms, RoPE, grouped-query
attention, SwiGLU), with its parameter names, so the saved folder loads in dflash and in transformers alike
(`--check-hf` compares the logits with transformers' Qwen3ForCausalLM when it is installed).

Input: token rows as `dflash inspect --json` prints them ({"id", "input_ids", "loss_mask"}); the loss is on the
supervised (assistant) tokens. Output: an HF-style folder (config.json, model.safetensors). The whole recipe:

    dflash sample-data --count 40000 --seed 11 --out conv.jsonl
    dflash prepare --model tiny --input conv.jsonl --out prep --max-len 320 --block-size 4 --holdout 0.02
    dflash inspect prep --json --limit 100000 > rows.jsonl
    dflash inspect prep --split holdout --json --limit 100000 > holdout.jsonl
    python3 scripts/train_tiny_target.py --rows rows.jsonl --holdout holdout.jsonl --out tiny-tasks

The built-in model was made with these defaults (12 epochs, lr 3e-3, 16384 tokens a batch): 4836 steps, 330 s on
one H200, held-out token accuracy 0.9999; on 2 CPU cores a step takes about 2 s (about 2.7 hours). Rerunning it
gives a model of the same quality; the exact bytes depend on the machine (CPU or GPU kernels).
"""
import argparse
import gzip
import json
import struct
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "pad_token_id": 256,
    "torch_dtype": "float32",
}
PAD = 256


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        w = c["hidden_size"]
        self.q_proj = nn.Linear(w, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(w, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(w, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, w, bias=False)
        self.q_norm = RMSNorm(self.d, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.d, c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.h, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.d))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        w, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(w, i, bias=False)
        self.up_proj = nn.Linear(w, i, bias=False)
        self.down_proj = nn.Linear(i, w, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = Mlp(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        d = c["head_dim"]
        self.register_buffer(
            "inv_freq", 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), persistent=False
        )

    def forward(self, ids, pad_mask):
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & pad_mask[:, None, None, :]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x))


def read_rows(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def batches(rows, tokens_per_batch, rng):
    """Length-bucketed batches of about `tokens_per_batch` padded tokens, in random order."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["input_ids"]), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(rows[i]["input_ids"])
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def tensors(rows, idx, device):
    t = max(len(rows[i]["input_ids"]) for i in idx)
    ids = torch.full((len(idx), t), PAD, dtype=torch.long)
    sup = torch.zeros((len(idx), t), dtype=torch.bool)
    pad = torch.zeros((len(idx), t), dtype=torch.bool)
    for r, i in enumerate(idx):
        x = rows[i]["input_ids"]
        ids[r, : len(x)] = torch.tensor(x)
        sup[r, : len(x)] = torch.tensor(rows[i]["loss_mask"], dtype=torch.bool)
        pad[r, : len(x)] = True
    return ids.to(device), sup.to(device), pad.to(device)


def loss_and_accuracy(model, ids, sup, pad):
    logits = model(ids, pad)[:, :-1]
    labels = ids[:, 1:]
    weight = sup[:, 1:]
    loss = F.cross_entropy(logits[weight], labels[weight])
    accuracy = (logits[weight].argmax(-1) == labels[weight]).float().mean()
    return loss, accuracy


@torch.no_grad()
def evaluate(model, rows, device, limit=400):
    model.eval()
    total, correct, losses = 0, 0, []
    idx = list(range(min(limit, len(rows))))
    for start in range(0, len(idx), 32):
        ids, sup, pad = tensors(rows, idx[start : start + 32], device)
        logits = model(ids, pad)[:, :-1]
        w = sup[:, 1:]
        losses.append(F.cross_entropy(logits[w], ids[:, 1:][w], reduction="sum").item())
        correct += (logits[w].argmax(-1) == ids[:, 1:][w]).sum().item()
        total += w.sum().item()
    model.train()
    return sum(losses) / max(total, 1), correct / max(total, 1)


def save_safetensors(state, path):
    """The safetensors format (an 8-byte header length, a JSON header, the raw little-endian data), written without
    the safetensors package; names in sorted order, f32."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(state):
        values = state[name].detach().float().cpu().flatten().tolist()
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": list(state[name].shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def save(model, out):
    os.makedirs(out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)


def check_hf(model, rows, device):
    """The same weights in transformers' Qwen3ForCausalLM give the same logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}))
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.to(device).eval()
    ids, _, pad = tensors(rows, [0], device)
    with torch.no_grad():
        ours = model(ids, pad)
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"transformers' Qwen3 logits differ by at most {diff:.2e}")
    assert diff < 1e-3, diff


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="training rows (dflash inspect --json)")
    p.add_argument("--holdout", help="held-out rows, scored as training goes")
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--epochs", type=float, default=12.0)
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check-hf", action="store_true", help="compare with transformers' Qwen3 (needs transformers)")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    rows = read_rows(a.rows)
    holdout = read_rows(a.holdout) if a.holdout else []
    model = Qwen3(CONFIG)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            nn.init.normal_(param, std=0.02)
    model.to(a.device)
    if a.check_hf:
        check_hf(model, rows, a.device)
    plan = batches(rows, a.tokens_per_batch, rng)
    total = int(a.epochs * len(plan))
    warmup = max(1, total // 50)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    )
    print(f"{sum(p.numel() for p in model.parameters())} parameters, {len(rows)} rows, {total} steps on {a.device}")
    started = time.time()
    for step in range(total):
        if step and step % len(plan) == 0:
            plan = batches(rows, a.tokens_per_batch, rng)
        ids, sup, pad = tensors(rows, plan[step % len(plan)], a.device)
        loss, accuracy = loss_and_accuracy(model, ids, sup, pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == total - 1:
            line = f"step {step}/{total} loss {loss.item():.4f} accuracy {accuracy.item():.3f}"
            if holdout:
                hl, ha = evaluate(model, holdout, a.device)
                line += f" · held out: loss {hl:.4f} accuracy {ha:.3f}"
            print(f"{line} · {time.time() - started:.0f} s", flush=True)
    save(model, a.out)
    print(f"wrote {a.out} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
