"""Checks dflash's drafter exports against the reference Python packages (run by scripts/checks/check_exports.sh).

  python scripts/checks/exports_reference.py WORK [--write-fixture DIR]

WORK holds `target/` (the tiny-tasks target, `dflash export --preset tiny-tasks`), `zlab/` and `speculators/`
(one drafter exported by `dflash export --format zlab` and `--format speculators --verifier WORK/target`), and
`zlab-sliding/` (a drafter whose first layer slides, window 8, causal; its second attends fully).

1. speculators 0.9.0: its own DFlashConverter turns `zlab/` into `converted/`; dflash's `speculators/` must equal it
   (config.json but `auto_map`, `transformers_version` and the blocks' causality, which dflash says outright; every
   tensor's name, dtype and value) and load with speculators' DFlashDraftModel.from_pretrained.
2. z-lab's model definition (the `dflash` 0.1.0 package on PyPI, z-lab's own, MIT): `zlab/` loads into its
   DFlashDraftModel; its forward on the tiny target's tapped states (HF transformers, z-lab's
   extract_context_feature) is written to WORK/zlab-forward/ with the drafter, for tests/exports.rs to compare
   dflash's forward against (--write-fixture DIR also copies them there, the committed fixture); the same for
   `zlab-sliding/` into WORK/zlab-forward-sliding/, z-lab's model reading the window and causality from config.json.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

work = Path(sys.argv[1])
fixture = Path(sys.argv[sys.argv.index("--write-fixture") + 1]) if "--write-fixture" in sys.argv else None
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


# 1. speculators
from speculators.convert.dflash.converter import DFlashConverter
from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash

converted = work / "converted"
DFlashConverter().convert(str(work / "zlab"), str(converted), base_model=str(work / "target"), validate=True)
ours_cfg = json.loads((work / "speculators" / "config.json").read_text())
ref_cfg = json.loads((converted / "config.json").read_text())
for key in ("auto_map", "transformers_version"):
    ref_cfg.pop(key, None)
# Where dflash differs on purpose (src/model/speculators.rs): the converter's sliding_window_non_causal = false has
# vLLM (speculators/algos.py: dflash_config.causal = not sliding_window_non_causal) run these bidirectional blocks
# causally; dflash says they are not, in both places vLLM reads.
ref_cfg["sliding_window_non_causal"] = True
ref_cfg["transformer_layer_config"]["is_causal"] = False
check(ours_cfg == ref_cfg, "speculators config.json equals the converter's (but auto_map, transformers_version, "
      "and the blocks' causality said outright)")
for key in sorted(set(ours_cfg) | set(ref_cfg)):
    if ours_cfg.get(key) != ref_cfg.get(key):
        print(f"       {key}: dflash {ours_cfg.get(key)!r} | converter {ref_cfg.get(key)!r}")
ours = safe_open(str(work / "speculators" / "model.safetensors"), "pt")
ref = safe_open(str(converted / "model.safetensors"), "pt")
check(sorted(ours.keys()) == sorted(ref.keys()), f"the same {len(list(ref.keys()))} tensor names")
same = all(
    ours.get_tensor(k).dtype == ref.get_tensor(k).dtype and torch.equal(ours.get_tensor(k), ref.get_tensor(k))
    for k in ref.keys()
    if k in ours.keys()
)
check(same, "every tensor equal (dtype and value)")
model = SpeculatorsDFlash.from_pretrained(str(work / "speculators"))
check(not torch.isnan(model.fc.weight).any().item(), "loads with speculators' DFlashDraftModel.from_pretrained")
check(model.config.aux_hidden_state_layer_ids == ours_cfg["aux_hidden_state_layer_ids"], "its tap ids as written")

# 2. z-lab
from dflash.model import DFlashDraftModel as ZlabDFlash, extract_context_feature
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained(str(work / "target"), dtype=torch.float32).eval()
for name, what in (("zlab", "the paper's layers"), ("zlab-sliding", "a sliding-window layer")):
    torch.manual_seed(0)
    drafter = ZlabDFlash.from_pretrained(str(work / name), dtype=torch.float32).eval()
    context = 24
    ids = torch.randint(0, 256, (1, context + 1))
    with torch.no_grad():
        states = target(ids[:, :context], output_hidden_states=True).hidden_states
        target_hidden = extract_context_feature(states, drafter.target_layer_ids)
        block = torch.full((1, drafter.block_size), drafter.mask_token_id)
        block[0, 0] = ids[0, context]
        noise = target.get_input_embeddings()(block)
        positions = torch.arange(context + drafter.block_size).unsqueeze(0)
        out = drafter(position_ids=positions, noise_embedding=noise, target_hidden=target_hidden)
    check(out.shape == noise.shape and torch.isfinite(out).all().item(), f"{name}/ loads into z-lab's DFlashDraftModel")
    if name == "zlab-sliding":
        windows = [layer.self_attn.sliding_window for layer in drafter.layers]
        causal = [layer.self_attn.is_causal for layer in drafter.layers]
        check(windows == [8, None] and causal == [True, False], f"z-lab's model reads {what}: {windows}, {causal}")
    forward = work / name.replace("zlab", "zlab-forward")
    shutil.rmtree(forward, ignore_errors=True)
    shutil.copytree(work / name, forward / "drafter")
    save_file(
        {"target_hidden": target_hidden.contiguous(), "noise_embedding": noise.contiguous(), "output": out.contiguous()},
        str(forward / "forward.safetensors"),
    )
    if fixture is not None:
        shutil.rmtree(fixture / forward.name, ignore_errors=True)
        shutil.copytree(forward, fixture / forward.name)
        print(f"wrote the fixture to {fixture / forward.name}")
sys.exit(1 if failures else 0)
