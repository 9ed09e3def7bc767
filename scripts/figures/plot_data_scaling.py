"""Draws docs/data-scaling.png from docs/data-scaling.csv: decoded acceptance (tokens per target step) of drafters for
the real model (SmolLM2-135M-Instruct) against the conversations they were trained on, and against the GPU-minutes
from the model folder to the drafter (making the data, then training). Each point is one trained drafter; its shape
(anchors x rows a step) and steps are in the legend; a line joins one recipe's sizes.

  python3 scripts/figures/plot_data_scaling.py [CSV] [PNG]      (needs matplotlib)
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def main(src="docs/data-scaling.csv", out="docs/data-scaling.png"):
    data = rows(src)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), sharey=True)
    recipes = sorted({(r["data"], int(r["anchors"]), int(r["rows"]), int(r["steps"])) for r in data},
                     key=lambda k: (k[0] != "template", k[3], -k[1]))
    markers = "osD^vP*Xph<>d"
    for i, recipe in enumerate(recipes):
        kind, anchors, per_step, steps = recipe
        points = [r for r in data if (r["data"], int(r["anchors"]), int(r["rows"]), int(r["steps"])) == recipe]
        points.sort(key=lambda r: int(r["conversations"]))
        label = f"{kind}, {anchors} anchors x {per_step} rows, {steps} steps"
        for prompts, colour in (("heldout", "tab:blue"), ("unseen", "tab:orange")):
            xs = [int(r["conversations"]) for r in points]
            minutes = [(float(r["train_s"]) + float(r["synth_s"])) / 60 for r in points]
            ys = [float(r[prompts]) for r in points]
            style = dict(marker=markers[i % len(markers)], color=colour, linestyle="-" if len(set(xs)) > 1 else "")
            axes[0].plot(xs, ys, **style, label=label if prompts == "heldout" else None)
            axes[1].plot(minutes, ys, **style)
    axes[0].set_xscale("log")
    ticks = [2000, 5000, 10000, 20000, 50000, 100000]
    axes[0].set_xticks(ticks, [f"{t:,}" for t in ticks])
    axes[0].minorticks_off()
    axes[0].set_xlabel("conversations trained on")
    axes[1].set_xlabel("GPU-minutes, model folder to drafter (data + training; H100 or H200)")
    axes[0].set_ylabel("decoded tokens per target step")
    for ax in axes:
        ax.axhline(3.0, color="tab:blue", linestyle=":", linewidth=1)
        ax.axhline(2.5, color="tab:orange", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].plot([], [], color="tab:blue", label="held-out synthesized requests (target 3.0, dotted)")
    axes[0].plot([], [], color="tab:orange", label="unseen-topic template prompts (target 2.5, dotted)")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.suptitle("A drafter for SmolLM2-135M-Instruct from the model folder alone (each point a drafter; a recipe's seeds share its marker)")
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(out, dpi=110)
    print(f"wrote {out} from {len(data)} drafters")


if __name__ == "__main__":
    main(*sys.argv[1:])
