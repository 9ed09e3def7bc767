"""The same conversations through the field's trainer: speculators 0.9.0's DFlash drafter, trained offline on the
target's hidden states, for the side-by-side with dflash (issue 64, item 5; BENCHMARKS.md). No vLLM is needed: the
hidden states speculators would fetch from a vLLM server are written here with transformers, in the layout its
`--hidden-states-backend file` reads.

  data ROWS MODEL OUT --taps T.. [--device D]
      ROWS: token rows as `dflash inspect DATA --json` writes them ({"id", "input_ids", "loss_mask"}), the rows
      dflash trained on. Writes OUT as speculators' prepared dataset (a `datasets` folder with input_ids, loss_mask
      and seq_len, as its prepare-data writes for speculator-format rows) and OUT/hidden_states/hs_<i>.safetensors:
      {"hidden_states": [seq, len(T) + 1, hidden] bf16, "token_ids": [seq]}, the outputs of the decoder layers T
      (dflash's taps: layer i's output, HuggingFace's hidden_states[i + 1]) and the last layer's output before the
      final norm (speculators applies the verifier's norm itself), as vLLM's extraction gives them.
  train DATA MODEL SAVE --taps T.. [speculators train flags..]
      Runs `speculators train --speculator-type dflash` on DATA with its defaults (5 layers, block 16, sliding
      windows of 2048, D-PACE cross-entropy, Muon at 1e-3, max_anchors 512 over packed rows of 8,192 tokens),
      --target-layer-ids as speculators counts them (dflash's taps + 1; a tap on the last layer is its verifier
      state, not an aux layer), --on-missing raise, 99% of the rows for training (it needs a validation split); extra flags go through (e.g. --max-steps,
      --seed, --num-layers).
"""

import json
import subprocess
import sys
from pathlib import Path


def data(rows_path, model_dir, out, taps, device="cuda"):
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

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
    with torch.no_grad():
        for n, row in enumerate(rows):
            ids = torch.tensor([row["input_ids"]], device=device)
            captured.clear()
            model.model(input_ids=ids)
            states = [captured[i][0] for i in taps] + [captured[len(layers) - 1][0]]
            save_file(
                {
                    "hidden_states": torch.stack(states, dim=1).to(torch.bfloat16).cpu().contiguous(),
                    "token_ids": torch.tensor(row["input_ids"], dtype=torch.long),
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
    ).save_to_disk(str(out))
    print(json.dumps({"rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows), "out": str(out)}))


def train(data_dir, model_dir, save, taps, extra):
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    aux = [t + 1 for t in taps if t + 1 != layers]
    command = [
        sys.executable, "-m", "speculators", "train", "--speculator-type", "dflash",
        "--verifier-name-or-path", str(model_dir), "--data-path", str(data_dir), "--save-path", str(save),
        "--target-layer-ids", *map(str, aux), "--on-missing", "raise", "--train-data-ratio", "0.99",
        "--num-workers", "2", *extra,
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
        device = "cuda"
        if "--device" in rest:
            at = rest.index("--device")
            device = rest[at + 1]
            del rest[at:at + 2]
        data(*rest[:3], taps=taps, device=device)
    else:
        train(rest[0], rest[1], rest[2], taps, rest[3:])


if __name__ == "__main__":
    main()
