"""The same conversations through the field's trainer: speculators 0.9.0's DFlash drafter, trained offline on the
target's hidden states, for the side-by-side with dflash (issue 64, item 5; BENCHMARKS.md). No vLLM is needed: the
hidden states speculators would fetch from a vLLM server are written here with transformers, in the layout its
`--hidden-states-backend file` reads.

  data ROWS MODEL OUT --taps T.. [--device D (default: cuda where there is one)]
      ROWS: token rows as `dflash inspect DATA --json` writes them ({"id", "input_ids", "loss_mask"}), the rows
      dflash trained on. Writes OUT as speculators' prepared dataset (a `datasets` folder with input_ids, loss_mask
      and seq_len, as its prepare-data writes for speculator-format rows) and OUT/hidden_states/hs_<i>.safetensors:
      {"hidden_states": [seq, len(T) + 1, hidden] bf16, "token_ids": [seq]}, the outputs of the decoder layers T
      (dflash's taps: layer i's output, HuggingFace's hidden_states[i + 1]) and the last layer's output before the
      final norm (speculators applies the verifier's norm itself), as vLLM's extraction gives them.
  train DATA MODEL SAVE --taps T.. [speculators train flags..]
      Runs `speculators train --speculator-type dflash` on DATA with its defaults (5 layers, block 16, sliding
      windows of 2048, D-PACE cross-entropy, Muon at 1e-3, max_anchors 512 over packed rows of 8,192 tokens),
      --target-layer-ids as speculators counts them (dflash's taps + 1; a tap on the last layer is id
      num_layers, which speculators accepts as vLLM's --include-last-layer writes it), --on-missing raise, 99% of the rows for training (it needs a validation split); extra flags go through (e.g. --max-steps,
      --seed, --num-layers).
"""

import json
import subprocess
import sys
from pathlib import Path


def data(rows_path, model_dir, out, taps, device=None, batch=32):
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in open(rows_path) if line.strip()]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    layers = model.model.layers
    wanted = sorted(set(taps) | {len(layers) - 1})
    captured = {}
    hooks = [
        layers[i].register_forward_hook(lambda _m, _a, o, i=i: captured.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i in wanted
    ]
    # Rows of similar length in batches, padded on the right: a causal model's states at the real positions do not
    # see the padding after them.
    order = sorted(range(len(rows)), key=lambda n: len(rows[n]["input_ids"]))
    with torch.no_grad():
        for at in range(0, len(order), batch):
            group = order[at:at + batch]
            width = max(len(rows[n]["input_ids"]) for n in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for b, n in enumerate(group):
                ids[b, : len(rows[n]["input_ids"])] = torch.tensor(rows[n]["input_ids"])
                mask[b, : len(rows[n]["input_ids"])] = 1
            captured.clear()
            model.model(input_ids=ids.to(device), attention_mask=mask.to(device))
            stacked = torch.stack([captured[i] for i in taps] + [captured[len(layers) - 1]], dim=2)
            stacked = stacked.to(torch.bfloat16).cpu()
            for b, n in enumerate(group):
                length = len(rows[n]["input_ids"])
                save_file(
                    {
                        "hidden_states": stacked[b, :length].contiguous(),
                        "token_ids": torch.tensor(rows[n]["input_ids"], dtype=torch.long),
                    },
                    str(out / "hidden_states" / f"hs_{n}.safetensors"),
                )
    for h in hooks:
        h.remove()
    Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "loss_mask": [r["loss_mask"] for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    ).with_format("torch").save_to_disk(str(out))  # as its prepare-data leaves it: rows read back as tensors
    print(json.dumps({"rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows), "out": str(out)}))


def train(data_dir, model_dir, save, taps, extra):
    aux = [t + 1 for t in taps]
    command = [
        sys.executable, "-m", "speculators", "train", "--speculator-type", "dflash",
        "--verifier-name-or-path", str(model_dir), "--data-path", str(data_dir), "--save-path", str(save),
        "--target-layer-ids", *map(str, aux), "--on-missing", "raise", "--train-data-ratio", "0.99",
        *extra,
    ]
    print(" ".join(command), flush=True)
    sys.exit(subprocess.call(command))


def main():
    args = sys.argv[1:]
    if not args or args[0] not in ("data", "train"):
        sys.exit(__doc__)
    taps, rest = [], []
    i = 1
    while i < len(args):
        if args[i] == "--taps":
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                taps.append(int(args[i]))
                i += 1
        else:
            rest.append(args[i])
            i += 1
    if not taps:
        sys.exit("--taps T.. is required (dflash's draft_model.target_layer_ids)")
    if args[0] == "data":
        device = None
        if "--device" in rest:
            at = rest.index("--device")
            device = rest[at + 1]
            del rest[at:at + 2]
        data(*rest[:3], taps=taps, device=device)
    else:
        train(rest[0], rest[1], rest[2], taps, rest[3:])


if __name__ == "__main__":
    main()
