"""Which pruning setting keeps a video's temporal questions: the measurement behind the video
default.

On a Qwen organism (organism-qwen by default; ``--model`` takes another Qwen-family organism
directory), held-out clips ask three kinds of question that need time: which object appears
first, whether an object is there at the start, and at the end. Each candidate setting prunes
at layers ``--layers`` (the library's default K = 2, and 0) with keeps 0.5 / 0.25 / 0.11 under
both budgets, and is scored per question kind. The candidates are the attention pruners
(``fastv``, ``text``, ``debiased``), ``random``, and ``diverse`` with ``pool`` 1 (pure max-min
diversity) up to 4: max-min diversity picks ``pool x keep`` candidates spread over the frames,
then the instruction's attention keeps the ``keep`` most relevant of them (a
diversity-then-instruction selection).

The score of a setting is its accuracy averaged over the question kinds (each kind counts the
same, so "which first" is not outvoted) and over the three keeps, at one layer and budget. The
same settings also answer held-out image questions, so a video default's cost on images shows.

    python benchmarks/video_default.py --clips 150 --images 50 --threads 2

Writes ``video_default.{json,md,png}`` under ``--out`` (``--name`` renames them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from qwen_organism import (
    KEEPS,
    VIDEO_KINDS,
    accuracy,
    generate,
    image_questions,
    kind_accuracy,
    scored,
    video_questions,
)
from tqdm import tqdm

from organism import qwen_model_path
from vlm_focus import FocusConfig
from vlm_focus.loading import load_model

BUDGETS = ("span", "frame")
#: (label, pruner, options) of every candidate.
CANDIDATES = (
    ("fastv", "fastv", {}),
    ("text", "text", {}),
    ("debiased", "debiased", {}),
    ("random", "random", {}),
    ("diverse pool 1", "diverse", {"pool": 1.0}),
    ("diverse pool 1.5", "diverse", {"pool": 1.5}),
    ("diverse pool 2", "diverse", {"pool": 2.0}),
    ("diverse pool 3", "diverse", {"pool": 3.0}),
    ("diverse pool 4", "diverse", {"pool": 4.0}),
)


def setting_score(kinds_by_keep: list[dict[str, float]], kinds=VIDEO_KINDS) -> float:
    """Accuracy averaged over question kinds, then over keeps: each kind counts the same."""
    return float(np.mean([np.mean([k[kind] for kind in kinds]) for k in kinds_by_keep]))


def video_rows(model, processor, rows, layers) -> list[dict]:
    out = []
    settings = [(c, b, layer) for layer in layers for b in BUDGETS for c in CANDIDATES]
    for (label, pruner, options), budget, layer in tqdm(settings, desc="video settings"):
        per_keep = []
        for keep in KEEPS:
            focus = FocusConfig(  # the named pruner on the clips (no video default)
                pruner=pruner,
                keep=keep,
                layer=layer,
                budget=budget,
                video_pruner=None,
                options=dict(options),
            )
            per_keep.append(scored(model, processor, rows, focus, kind_accuracy))
        refused = next((k for k in per_keep if isinstance(k, str)), None)
        out.append(
            {
                "setting": label,
                "pruner": pruner,
                "options": options,
                "budget": budget,
                "layer": layer,
                "kinds": per_keep,
                "score": None if refused else setting_score(per_keep),
                "refused": refused,
            }
        )
    return out


def image_rows(model, processor, rows, layers, chosen: list[tuple]) -> list[dict]:
    """Image accuracy of the ``chosen`` (label, pruner, options, budget) settings."""
    out = []
    for (label, pruner, options, budget), layer in tqdm(
        [(c, layer) for layer in layers for c in chosen], desc="image settings"
    ):
        accs = []
        for keep in KEEPS:
            focus = FocusConfig(
                pruner=pruner, keep=keep, layer=layer, budget=budget, options=dict(options)
            )
            accs.append(scored(model, processor, rows, focus, accuracy))
        out.append({"setting": label, "budget": budget, "layer": layer, "accuracy": accs})
    return out


def best(rows: list[dict], layer: int) -> dict:
    scored_rows = [r for r in rows if r["layer"] == layer and r["score"] is not None]
    return max(scored_rows, key=lambda r: r["score"])


def _pct(x) -> str:
    return x if isinstance(x, str) else f"{100 * x:.1f}"


def markdown(results: dict) -> str:
    kinds = results["kinds"]
    base = results["unpruned_kinds"]
    lines = [
        f"# The video default: {Path(results['model']).name}",
        "",
        f"Command: `{results['command']}`; {results['seconds'] / 60:.1f} minutes on "
        f"{results['threads']} CPU threads.",
        "",
        f"{results['questions']} held-out clip questions ({', '.join(kinds)}, equal shares); "
        "unpruned accuracy "
        + ", ".join(f"{kind} {_pct(base[kind])}%" for kind in kinds)
        + ". Score = accuracy averaged over the kinds and over keeps "
        + " / ".join(map(str, KEEPS))
        + ". Each cell: accuracy % per kind ("
        + " / ".join(kinds)
        + ") at each keep.",
        "",
    ]
    for layer in results["layers"]:
        lines += [
            f"## Layer K = {layer}",
            "",
            "| setting | budget | score | " + " | ".join(f"keep {k}" for k in KEEPS) + " |",
            "|---|---|---:|" + "---|" * len(KEEPS),
        ]
        rows = sorted(
            (r for r in results["video"] if r["layer"] == layer),
            key=lambda r: -(r["score"] or -1),
        )
        for r in rows:
            if r["refused"]:
                cells = ["refused"] * len(KEEPS)
            else:
                cells = [" / ".join(f"{100 * k[kind]:.0f}" for kind in kinds) for k in r["kinds"]]
            score = "—" if r["score"] is None else f"{100 * r['score']:.1f}"
            lines.append(
                f"| {r['setting']} | {r['budget']} | {score} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if results.get("images"):
        lines += [
            f"## The same settings on {results['image_questions']} held-out image questions",
            "",
            f"Unpruned {_pct(results['image_unpruned'])}%.",
            "",
            "| setting | budget | layer | " + " | ".join(f"keep {k}" for k in KEEPS) + " |",
            "|---|---|---|" + "---|" * len(KEEPS),
        ]
        for r in results["images"]:
            cells = [_pct(a) for a in r["accuracy"]]
            lines.append(
                f"| {r['setting']} | {r['budget']} | {r['layer']} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    chosen = results["chosen"]
    lines += [
        f"Best at K = {chosen['layer']}: **{chosen['setting']}**, budget `{chosen['budget']}` "
        f"(score {100 * chosen['score']:.1f}).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = results["kinds"]
    layers = results["layers"]
    fig, axes = plt.subplots(
        len(layers), len(kinds), figsize=(4 * len(kinds), 3.2 * len(layers)), squeeze=False
    )
    shown = ("fastv", "text", "random", "diverse pool 1", "diverse pool 2", "diverse pool 3")
    for i, layer in enumerate(layers):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for r in results["video"]:
                if r["layer"] != layer or r["budget"] != "span" or r["refused"]:
                    continue
                if r["setting"] not in shown:
                    continue
                ax.plot(KEEPS, [100 * k[kind] for k in r["kinds"]], marker="o", label=r["setting"])
            ax.axhline(100 * results["unpruned_kinds"][kind], color="k", ls=":", lw=1)
            ax.set_title(f"{kind}, K = {layer}, budget span")
            ax.set_xscale("log")
            ax.set_xticks(KEEPS, [str(k) for k in KEEPS])
            ax.set_ylim(0, 105)
            ax.set_xlabel("keep")
            ax.set_ylabel("accuracy %")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=qwen_model_path())
    parser.add_argument("--clips", type=int, default=150, help="held-out clips (one question each)")
    parser.add_argument("--images", type=int, default=50, help="held-out images (0: skip)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="video_default")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = load_model(str(args.model), dtype=torch.float32)
    start = time.time()
    rows = video_questions(args.clips)
    unpruned = kind_accuracy(generate(model, processor, rows, None), rows)
    video = video_rows(model, processor, rows, args.layers)
    chosen = best(video, args.layers[0])
    results: dict = {
        "model": str(args.model),
        "threads": args.threads,
        "layers": args.layers,
        "kinds": list(VIDEO_KINDS),
        "questions": len(rows),
        "unpruned_kinds": unpruned,
        "video": video,
        "chosen": {k: chosen[k] for k in ("setting", "pruner", "options", "budget", "layer")}
        | {"score": chosen["score"]},
    }
    if args.images:
        image_qs = image_questions(args.images)
        results["image_questions"] = len(image_qs)
        results["image_unpruned"] = accuracy(generate(model, processor, image_qs, None), image_qs)
        compared = {("fastv", "fastv", (), "span")}
        compared.add(
            (
                chosen["setting"],
                chosen["pruner"],
                tuple(chosen["options"].items()),
                chosen["budget"],
            )
        )
        results["images"] = image_rows(
            model,
            processor,
            image_qs,
            args.layers,
            [(label, p, dict(o), b) for label, p, o, b in sorted(compared)],
        )
    results["seconds"] = round(time.time() - start, 1)
    results["command"] = (
        f"python benchmarks/video_default.py --clips {args.clips} --images {args.images} "
        f"--layers {' '.join(map(str, args.layers))} --threads {args.threads}"
        + (f" --model {args.model}" if args.model != qwen_model_path() else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(results))
    plot(results, args.out / f"{args.name}.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
