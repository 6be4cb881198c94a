"""Small-model-guided pruning (SGL) on two-hop questions: does a guide trained on them guide?

organism-deep reads the object a two-hop question is about in layers 2-4, so pruning at K = 2
or 4 must keep it. ``guided`` ranks the deep model's visual tokens by a small guide's attention
(summed over its layers, from the instruction rows). Two guides are compared: organism-guide,
never trained on two-hop questions, and organism-twohop-guide, trained on the deep model's task
family. fastv (the deep model's own attention at layer K) and random are the references.

Cost (SGL's argument): the guide's prefill as a share of the prefill time pruning saves, from
interleaved timings of one batch: unpruned prefill, prefill pruned by ``random`` (pruning with
no scoring cost), prefill pruned by ``guided`` (guide included), and the guide alone.

    python benchmarks/guided_quality.py --questions 300 --threads 1

Writes ``guided_quality.{md,json,png}`` under ``--out``. Goal: guided (two-hop guide) within 2
points of fastv's retention at keep 0.11.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from pruner_quality import load, machine, mean_accuracy, question_set, run_setting

import vlm_focus as vf
from organism import deep_model_path, guide_model_path, twohop_guide_model_path
from vlm_focus import FocusConfig
from vlm_focus.loading import build_inputs
from vlm_focus.pruners.guided import guide_attention

GOAL_POINTS = 0.02


def quality(model, processor, qset, guides: dict, args) -> dict:
    """Accuracy and retention per K and pruner at keep ``args.keep``."""
    base, _, _ = run_setting(model, processor, qset, None, args.batch, "unpruned")
    out = {"unpruned": mean_accuracy(base), "layers": {}}
    for layer in args.layers:
        rows = {}
        runs = [("fastv", "fastv", None), ("random", "random", None)]
        runs += [(f"guided ({name})", "guided", name) for name in guides]
        for label, pruner, guide in runs:
            focus = FocusConfig(pruner=pruner, keep=args.keep, layer=layer)
            metrics, _, seconds = run_setting(
                model,
                processor,
                qset,
                focus,
                args.batch,
                f"K={layer} {label}",
                guides[guide] if guide else (None, None),
            )
            accuracy = mean_accuracy(metrics)
            rows[label] = {"accuracy": accuracy, "retention": accuracy / out["unpruned"]}
            print(f"K={layer} {label:34s} retention {100 * rows[label]['retention']:.2f}%")
        out["layers"][str(layer)] = rows
    return out


@torch.no_grad()
def cost(model, processor, qset, guide, guide_processor, args) -> dict:
    """Median seconds of each prefill over ``args.repeats`` interleaved rounds on one batch."""
    keys = qset.keys[: args.batch]
    pictures = [qset.pictures[image_id] for image_id, _ in keys]
    questions = [q for _, q in keys]
    inputs = build_inputs(processor, pictures, questions)
    guide_inputs = build_inputs(guide_processor, pictures, questions)
    layer = args.layers[0]

    def unpruned():
        model(**inputs)

    def pruned_random():
        with vf.wrap(model, pruner="random", keep=args.keep, layer=layer):
            model(**inputs)

    def pruned_guided():
        with vf.wrap(
            model,
            pruner="guided",
            keep=args.keep,
            layer=layer,
            guide=guide,
            guide_inputs=guide_inputs,
        ):
            model(**inputs)

    def guide_only():
        guide_attention(guide, guide_inputs)

    runs = {"unpruned": unpruned, "random": pruned_random, "guided": pruned_guided}
    runs["guide"] = guide_only
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    saved = median["unpruned"] - median["random"]
    return {
        "layer": layer,
        "batch": len(keys),
        "repeats": args.repeats,
        "median_seconds": median,
        "guide_share_of_saved": median["guide"] / saved if saved > 0 else float("inf"),
        "guided_vs_unpruned": median["guided"] / median["unpruned"],
        "random_vs_unpruned": median["random"] / median["unpruned"],
    }


def markdown(result: dict, args, minutes: float) -> str:
    lines = [
        "# Small-model-guided pruning on two-hop questions (organism-deep)",
        "",
        f"Command: `python benchmarks/guided_quality.py --questions {args.questions} --threads "
        f"{args.threads}` ({machine()}; {minutes:.1f} minutes).",
        "",
        f"{result['questions']} held-out two-hop questions, keep {args.keep:g}, retention = "
        f"pruned / unpruned accuracy (unpruned {100 * result['unpruned']:.2f}%).",
        "",
        "| pruner | " + " | ".join(f"K = {k}" for k in args.layers) + " |",
        "|---|" + "---:|" * len(args.layers),
    ]
    labels = list(result["layers"][str(args.layers[0])])
    for label in labels:
        cells = [
            f"{100 * result['layers'][str(k)][label]['retention']:.1f}% "
            f"({100 * result['layers'][str(k)][label]['accuracy']:.1f})"
            for k in args.layers
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: retention (pruned accuracy, %).", "", "Goal: guided (two-hop guide) "
              "within 2 points of fastv:", ""]  # fmt: skip
    for k in args.layers:
        rows = result["layers"][str(k)]
        gap = rows["fastv"]["retention"] - rows["guided (organism-twohop-guide)"]["retention"]
        verdict = "met" if gap <= GOAL_POINTS else "NOT met"
        lines.append(f"- K = {k}: {100 * gap:.1f} points behind fastv: {verdict}")
    c = result["cost"]
    s = c["median_seconds"]
    lines += [
        "",
        f"## Cost (one batch of {c['batch']} prompts, K = {c['layer']}, keep {args.keep:g}, "
        f"median of {c['repeats']} interleaved rounds)",
        "",
        "| prefill | seconds | vs unpruned |",
        "|---|---:|---:|",
    ]
    for name in ("unpruned", "random", "guided", "guide"):
        lines.append(f"| {name} | {s[name]:.3f} | {s[name] / s['unpruned']:.2f}x |")
    lines += [
        "",
        f"The two-hop guide's prefill is {100 * c['guide_share_of_saved']:.0f}% of the prefill "
        "time pruning saves (unpruned - random). CPU times: ratios only.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, layers: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["layers"][str(layers[0])])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ys = [100 * result["layers"][str(k)][label]["retention"] for k in layers]
        xs = [j + i * width for j in range(len(layers))]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], [f"K = {k}" for k in layers])
    ax.set_ylabel("two-hop accuracy retention (%)")
    ax.set_ylim(40, 102)
    ax.axhline(100, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_title("organism-deep, keep 0.11")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--keep", type=float, default=0.11)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="guided_quality")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, processor = load(deep_model_path())
    guides = {
        "organism-guide": load(guide_model_path()),
        "organism-twohop-guide": load(twohop_guide_model_path()),
    }
    qset = question_set("twohop", args.questions)
    result = quality(model, processor, qset, guides, args)
    result["questions"] = len(qset.keys)
    result["cost"] = cost(model, processor, qset, *guides["organism-twohop-guide"], args)
    minutes = (time.perf_counter() - start) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": vars(args) | {"out": str(args.out)}, "minutes": minutes, **result}
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(result, args, minutes))
    plot(result, args.layers, args.out / f"{args.name}.png")
    print(args.out / f"{args.name}.md")


if __name__ == "__main__":
    main()
