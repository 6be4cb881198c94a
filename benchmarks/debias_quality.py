"""Debiased pruning where its premise holds: retention under a planted positional bias and sinks.

The organisms' attention has no recency bias (fastv's row means fall from top to bottom), so
debiased pruning and fastv agree on them. Here :class:`vlm_focus.eval.planted_bias.PlantedBias`
plants the bias the debiasing paper describes inside each model's own attention, at strength
``s`` (logits): later visual tokens gain up to ``s`` (a linear ramp over the row's visual
tokens, so the lower image rows are favoured) and the ``--sinks-per-image`` emptiest visual
tokens (closest to the image's median token) gain ``s``. Both the model's answers and every
pruner's scores see it. At each strength the planted model's unpruned accuracy is the
reference its retentions divide by (strength 0 is the plant with no bias: the RoPE pair it
uses is already given over).

POPE questions come from one split (``--split``, default adversarial). Pruners: fastv,
text, debiased on fastv with the positional fix only, the sink fix only (sinks found by
attention mass: the plant makes no massive activations), both fixes, and the library's
debiased defaults, and random. Depths: layer 0 on organism-default (POPE) and K = 2 on
organism-deep (two-hop accuracy).

    python benchmarks/debias_quality.py --images 60 --questions 300 --threads 1

Writes ``debias_quality.{md,json,png}`` under ``--out``. Goal: where the bias costs fastv at
least 10 points of retention (against fastv at strength 0), debiased (both fixes) recovers at
least half of them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from pruner_quality import load, machine, mean_accuracy, question_set, run_setting, score_rows

from organism import deep_model_path, default_model_path
from vlm_focus import FocusConfig
from vlm_focus.eval.planted_bias import PlantedBias

FIX = {"base": "fastv", "padding": False, "sink_by": "attention"}
METHODS = {  # label -> (pruner, options)
    "fastv": ("fastv", {}),
    "text": ("text", {}),
    "debiased: positional fix": ("debiased", {**FIX, "positional": True, "sinks": False}),
    "debiased: sink fix": ("debiased", {**FIX, "positional": False, "sinks": True}),
    "debiased: both fixes": ("debiased", {**FIX, "positional": True, "sinks": True}),
    "debiased (library defaults)": ("debiased", {}),
    "random": ("random", {}),
}
GOAL_COST, GOAL_SHARE = 0.10, 0.5


def depths(args) -> list[dict]:
    default = dict(name="organism-default", path=default_model_path(), layer=0, task="pope")
    deep = dict(name="organism-deep", path=deep_model_path(), layer=2, task="twohop")
    return [{**default, "n": args.images}, {**deep, "n": args.questions}]


def sweep(depth: dict, args) -> dict:
    """Every strength x method x keep at one depth: accuracies, retentions, row profiles."""
    model, processor = load(depth["path"])
    qset = question_set(depth["task"], depth["n"])
    if depth["task"] == "pope":  # one split: the sweep is long, and the splits agree
        qset.rows = {args.split: qset.rows[args.split]}
        qset.keys = sorted({(r["image_id"], r["text"]) for r in qset.rows[args.split]})
    original, _, _ = run_setting(model, processor, qset, None, args.batch, "no plant")
    out = {**{k: str(v) for k, v in depth.items()}, "original": mean_accuracy(original)}
    out["questions"] = len(qset.keys)
    out["strengths"] = []
    for strength in args.strengths:
        plant = PlantedBias(
            model, positional=strength, sinks=strength, n_sinks=args.sinks_per_image
        )
        with plant:
            base, _, _ = run_setting(model, processor, qset, None, args.batch, f"s={strength}")
            row = {"strength": strength, "unpruned": mean_accuracy(base), "retention": {}}
            probe = FocusConfig(pruner="fastv", keep=0.25, layer=depth["layer"])
            row["fastv_rows"] = score_rows(model, processor, qset, probe, args.batch)
            for label, (pruner, options) in METHODS.items():
                for keep in args.keeps:
                    focus = FocusConfig(
                        pruner=pruner, keep=keep, layer=depth["layer"], options=options
                    )
                    metrics, _, _ = run_setting(
                        model, processor, qset, focus, args.batch, f"s={strength} {label} {keep}"
                    )
                    retention = mean_accuracy(metrics) / max(row["unpruned"], 1e-9)
                    row["retention"].setdefault(label, {})[str(keep)] = retention
                    print(
                        f"{depth['name']} s={strength:g} {label:28s} keep {keep:<5g} "
                        f"retention {100 * retention:.2f}%",
                        flush=True,
                    )
        out["strengths"].append(row)
    return out


def verdicts(result: dict, keeps: list[float]) -> list[dict]:
    """Per strength and keep where the bias costs fastv >= 10 points: the share debiased (both
    fixes) wins back."""
    rows = result["strengths"]
    zero = next((r for r in rows if r["strength"] == 0), None)
    out = []
    if zero is None:
        return out
    for r in rows:
        for keep in keeps:
            k = str(keep)
            clean = zero["retention"]["fastv"][k]
            fastv = r["retention"]["fastv"][k]
            cost = clean - fastv
            if cost < GOAL_COST:
                continue
            both = r["retention"]["debiased: both fixes"][k]
            share = (both - fastv) / cost
            out.append(dict(strength=r["strength"], keep=keep, cost=cost, recovered=share,
                            met=share >= GOAL_SHARE))  # fmt: skip
    return out


def markdown(results: list[dict], args, minutes: float) -> str:
    lines = [
        "# Debiased pruning under a planted positional bias and sinks",
        "",
        f"Command: `python benchmarks/debias_quality.py --images {args.images} --questions "
        f"{args.questions} --threads {args.threads}` ({machine()}; {minutes:.1f} minutes). "
        f"organism-default answers POPE's {args.split} split; organism-deep two-hop questions.",
        "",
        "The bias is planted in each model's own attention (`vlm_focus.eval.planted_bias`): at "
        "strength s, the i-th of a row's N visual keys gains s * i / (N - 1) logits (the lower "
        f"image rows are favoured) and the {args.sinks_per_image} emptiest visual tokens (closest "
        "to the image's median token) gain s. Cells: retention = pruned / unpruned accuracy of "
        "the planted model at that strength. Debiased rows debias fastv; their sink fix finds "
        "sinks by attention mass (the plant makes no massive activations); `library defaults` "
        'is `pruner="debiased"` as shipped.',
    ]
    for result in results:
        strengths = [r["strength"] for r in result["strengths"]]
        lines += [
            "",
            f"## {result['name']}, layer {result['layer']} ({result['task']}, "
            f"{result['questions']} distinct questions)",
            "",
            f"Unpruned accuracy without the plant: {100 * result['original']:.2f}%; with it, by "
            "strength: "
            + ", ".join(
                f"s={r['strength']:g}: {100 * r['unpruned']:.2f}%" for r in result["strengths"]
            )
            + ".",
        ]
        for keep in args.keeps:
            lines += [
                "",
                f"keep {keep:g}:",
                "",
                "| pruner | " + " | ".join(f"s={s:g}" for s in strengths) + " |",
                "|---|" + "---:|" * len(strengths),
            ]
            for label in METHODS:
                cells = [
                    f"{100 * r['retention'][label][str(keep)]:.1f}%" for r in result["strengths"]
                ]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", "fastv's score per image row (top to bottom, mean 1), keep 0.25:", ""]
        for r in result["strengths"]:
            rows = ", ".join(f"{v:.2f}" for v in r["fastv_rows"])
            lines.append(f"- s={r['strength']:g}: {rows}")
        found = verdicts(result, args.keeps)
        lines += ["", "Goal (bias costs fastv >= 10 points -> debiased recovers >= half):", ""]
        if not found:
            lines.append("- no strength here costs fastv 10 points: the goal is not tested.")
        for v in found:
            lines.append(
                f"- s={v['strength']:g}, keep {v['keep']:g}: fastv loses "
                f"{100 * v['cost']:.1f} points, debiased (both fixes) wins back "
                f"{100 * v['recovered']:.0f}% of them: {'met' if v['met'] else 'NOT met'}"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], keeps: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(results), len(keeps), figsize=(5 * len(keeps), 3.8 * len(results)), squeeze=False
    )
    for i, result in enumerate(results):
        strengths = [r["strength"] for r in result["strengths"]]
        for j, keep in enumerate(keeps):
            ax = axes[i][j]
            for label in METHODS:
                ys = [100 * r["retention"][label][str(keep)] for r in result["strengths"]]
                style = "--" if label == "random" else ("-" if "debiased" not in label else "-.")
                ax.plot(strengths, ys, style, marker="o", label=label)
            ax.set_title(f"{result['name']}, layer {result['layer']}, keep {keep:g}", fontsize=10)
            ax.set_xlabel("planted bias strength s (logits)")
            ax.set_ylabel("retention (%)")
            ax.axhline(100, color="grey", lw=0.8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100, help="POPE scenes (organism-default)")
    parser.add_argument("--questions", type=int, default=300, help="two-hop questions (deep)")
    parser.add_argument("--strengths", type=float, nargs="+", default=[0.0, 2.0, 4.0, 6.0, 8.0])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.11])
    parser.add_argument("--sinks-per-image", type=int, default=4)
    parser.add_argument("--split", default="adversarial", help="the POPE split (organism-default)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="debias_quality")
    parser.add_argument("--only", choices=["organism-default", "organism-deep"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = [sweep(d, args) for d in depths(args) if args.only in (None, d["name"])]
    minutes = (time.perf_counter() - start) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": vars(args) | {"out": str(args.out)},
        "minutes": minutes,
        "results": results,
        "goal": {r["name"]: verdicts(r, args.keeps) for r in results},
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(results, args, minutes))
    plot(results, args.keeps, args.out / f"{args.name}.png")
    print(args.out / f"{args.name}.md")


if __name__ == "__main__":
    main()
