"""POPE-style (or two-hop) accuracy retention of every pruner on an embedded organism model.

For each registered pruner and keep ratio, the organism answers the held-out POPE questions
(random, popular and adversarial splits; greedy, the model's chat template, no suffix; answers
parsed by the POPE/LLaVA rule) while pruned by ``vlm_focus.wrap``; retention = pruned accuracy /
unpruned accuracy on the same questions, measured in the same run. ``guided`` uses the
embedded guide organism (6 x 6 visual tokens) on the same images and prompts.

    python benchmarks/pruner_quality.py                       # 60 images, keeps 0.5 0.25 0.11
    python benchmarks/pruner_quality.py --images 500 --layer 2 --out benchmarks/results

With ``--task twohop`` the questions are the held-out two-hop family ("What colour is the shape
left of the red_circle?", "What is right of the green_cross?", "Is the object below the
blue_square a triangle?"), scored by the first generated word, on a model trained for it
(``--model vlm_focus/assets/organism-deep``). ``--multi-stage pyramid debiased`` adds rows that
reach the same final keep in three stages, at layers K, K+2 and K+4 (those below the model's
depth), keeping keep^(1/3), keep^(2/3) and keep of the visual tokens.

    python benchmarks/pruner_quality.py --model vlm_focus/assets/organism-deep --task twohop \
        --images 300 --layer 2 --multi-stage pyramid debiased --name pruner_quality_deep_layer2

Writes ``<name>.csv`` (one row per pruner, keep and split), ``<name>.md`` (the retention table),
``<name>.json`` (settings and summary) and ``<name>.png`` (retention against keep) under
``--out``; ``--name`` defaults to ``pruner_quality``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import time
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

import vlm_focus as vf
from vlm_focus.organism import default_model_path, guide_model_path
from vlm_focus.organism.pope import (
    SPLITS,
    parse_yes_no,
    pope_eligible,
    pope_metrics,
    pope_questions,
)
from vlm_focus.pruners import guided_generate

PROMPT = "USER: <image>\\n{question} ASSISTANT: (chat template, no suffix; greedy, 1 new token)"
NEW_TOKENS = 1
TWO_HOP = "twohop"


def load(path: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(path)


def build_inputs(processor, images: list[Image.Image], questions: list[str]) -> dict:
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
        )
        for q in questions
    ]
    return processor(images=images, text=prompts, padding=True, return_tensors="pt")


def make_batches(processor, images, questions, batch: int, guide_processor=None) -> list:
    """Processor outputs per batch, built once and reused by every configuration."""
    out = []
    for i in range(0, len(questions), batch):
        chunk = slice(i, i + batch)
        inputs = build_inputs(processor, images[chunk], questions[chunk])
        guide_inputs = None
        if guide_processor is not None:
            guide_inputs = build_inputs(guide_processor, images[chunk], questions[chunk])
        out.append((inputs, guide_inputs))
    return out


@torch.no_grad()
def answer_all(
    model, processor, batches, desc, handle=None, guided=False, profile=None
) -> list[str]:
    """Greedy one-token answers (the POPE rule reads the first word); with ``guided``, through
    guided_generate on the same images and prompts. ``profile`` (a list) collects the first
    stage's scores per image row, each image normalised to mean 1 (a recency diagnostic)."""
    answers: list[str] = []
    for inputs, guide_inputs in tqdm(batches, desc=desc, leave=False):
        if guided:
            out = guided_generate(
                handle, inputs, guide_inputs, max_new_tokens=NEW_TOKENS, do_sample=False
            ).sequences
        else:
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        if profile is not None and handle.last_trace is not None:
            for scores in handle.last_trace.scores:
                side = math.isqrt(scores.numel())
                if side * side == scores.numel():
                    rows = scores.view(side, side).mean(1)
                    profile.append(rows / rows.mean().clamp(min=1e-12))
        new = out[:, inputs["input_ids"].shape[1] :]
        answers += [a.strip() for a in processor.batch_decode(new, skip_special_tokens=True)]
    return answers


def split_metrics(rows, answers_by_key) -> dict[str, dict]:
    out = {}
    if TWO_HOP in rows:  # open answers: the first generated word must equal the answer
        hits = [
            (answers_by_key[(r["image_id"], r["text"])].split() or [""])[0] == r["label"]
            for r in rows[TWO_HOP]
        ]
        return {TWO_HOP: {"accuracy": sum(hits) / len(hits), "n": len(hits)}}
    for split in SPLITS:
        parsed = [parse_yes_no(answers_by_key[(r["image_id"], r["text"])]) for r in rows[split]]
        metrics = pope_metrics([r["label"] for r in rows[split]], [p for p, _ in parsed])
        metrics["unparseable"] = sum(not ok for _, ok in parsed)
        out[split] = metrics
    return out


def plot(
    results: list[dict], keeps: list[float], path: Path, title: str = "", ylabel: str = ""
) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = sorted({r["pruner"] for r in results if r["pruner"] != "none"})
    colours = plt.get_cmap("tab20").colors  # one colour per line: up to 20 pruners
    for i, name in enumerate(names):
        ys = [
            100 * next(r["retention"] for r in results if r["pruner"] == name and r["keep"] == k)
            for k in keeps
        ]
        # dashed: the attention-free baselines; dotted: multi-stage schedules ("pyramid x3")
        baseline = name in ("random", "pool", "temporal")
        style = "--" if baseline else (":" if " x" in name else "-")
        ax.plot(keeps, ys, style, marker="o", label=name, color=colours[(2 * i) % 20 + i // 10])
    ax.axhline(100, color="grey", lw=0.8)
    ax.axhline(99, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xticks(keeps, [f"{k:g}" for k in keeps])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("keep (share of visual tokens)")
    ax.set_ylabel(ylabel or "POPE accuracy retention (%)")
    ax.set_title(title or "Pruned / unpruned POPE accuracy (organism, mean of 3 splits)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--guide", type=Path, default=guide_model_path())
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25, 0.11])
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--query", default="text", choices=["last", "text"])
    parser.add_argument("--pruners", nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="pruner_quality", help="stem of the output files")
    parser.add_argument("--task", default="pope", choices=["pope", TWO_HOP])
    parser.add_argument(
        "--multi-stage", nargs="*", default=[], help="pruners also run as 3-stage schedules"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.pruners or vf.pruners()
    if "guided" in names and not (args.guide / "config.json").exists():
        print(f"no guide model at {args.guide}: skipping guided")
        names = [n for n in names if n != "guided"]

    model, processor = load(args.model)
    guide = load(args.guide) if "guided" in names else None
    if args.task == TWO_HOP:
        from vlm_focus.organism.evaluate import two_hop_set

        scenes, qas = two_hop_set(args.images)
        rows = {TWO_HOP: [
            {"image_id": sc.seed, "text": q.question, "label": q.answer}
            for sc, q in zip(scenes, qas, strict=True)
        ]}  # fmt: skip
        splits = [TWO_HOP]
    else:
        scenes = pope_eligible(args.images)
        rows = {split: pope_questions(scenes, split) for split in SPLITS}
        splits = list(SPLITS)
    by_id = {s.seed: s for s in scenes}
    keys = sorted({(r["image_id"], r["text"]) for split in splits for r in rows[split]})
    n_layers = model.config.text_config.num_hidden_layers
    pictures = {seed: Image.fromarray(s.image()) for seed, s in by_id.items()}
    images = [pictures[k[0]] for k in keys]
    questions = [k[1] for k in keys]
    print(
        f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; model {args.model.name}; {len(scenes)} images, "
        f"{len(keys)} distinct questions; layer {args.layer}, query {args.query}"
    )

    results: list[dict] = []
    row_profile: list[float] = []
    start = time.perf_counter()
    batches = make_batches(
        processor, images, questions, args.batch, guide[1] if guide is not None else None
    )
    full = dict(zip(keys, answer_all(model, processor, batches, "none"), strict=True))
    base = split_metrics(rows, full)
    base_seconds = time.perf_counter() - start
    for split in splits:
        results.append(dict(pruner="none", keep=1.0, split=split, **base[split]))
    summary = [dict(pruner="none", keep=1.0, retention=1.0, seconds=base_seconds,
                    accuracy=sum(base[s]["accuracy"] for s in splits) / len(splits))]  # fmt: skip
    stage_layers = tuple(k for k in (args.layer, args.layer + 2, args.layer + 4) if k < n_layers)
    runs = [(name, name) for name in names]
    runs += [(f"{name} x{len(stage_layers)}", name) for name in args.multi_stage]
    for label, name in runs:
        for keep in args.keeps:
            options = dict(pruner=name, keep=keep, layer=args.layer, query_rows=args.query)
            if label != name:  # the same final keep in stages: keep^(1/n), keep^(2/n), ... keep
                n = len(stage_layers)
                options["layer"] = stage_layers
                options["keep"] = tuple(keep ** ((i + 1) / n) for i in range(n))
            if name == "guided":
                options["guide"] = guide[0]
            t0 = time.perf_counter()
            profile = [] if name == "fastv" and keep == args.keeps[0] else None
            with vf.wrap(model, **options) as handle:
                answers = answer_all(
                    model, processor, batches, f"{label} {keep}", handle, name == "guided", profile
                )
            if profile:
                row_profile = torch.stack(profile).mean(0).tolist()
            seconds = time.perf_counter() - t0
            metrics = split_metrics(rows, dict(zip(keys, answers, strict=True)))
            for split in splits:
                retention = metrics[split]["accuracy"] / max(base[split]["accuracy"], 1e-9)
                results.append(
                    dict(
                        pruner=label, keep=keep, split=split, retention=retention, **metrics[split]
                    )  # fmt: skip
                )
            accuracy = sum(metrics[s]["accuracy"] for s in splits) / len(splits)
            summary.append(
                dict(
                    pruner=label,
                    keep=keep,
                    accuracy=accuracy,
                    seconds=seconds,
                    retention=accuracy / max(summary[0]["accuracy"], 1e-9),
                )  # fmt: skip
            )
            print(f"{label:12s} keep {keep:<5g} accuracy {accuracy:.4f} "
                  f"retention {100 * summary[-1]['retention']:.2f}%  ({seconds:.0f}s)")  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["pruner", "keep", "split", "accuracy", "precision", "recall", "f1", "yes_ratio",
              "unparseable", "n", "retention"]  # fmt: skip
    with open(args.out / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in results:
            writer.writerow({k: row.get(k, 1.0 if k == "retention" else "") for k in fields})
    if args.task == TWO_HOP:
        head = (
            f"Two-hop accuracy retention on the organism ({args.model.name}), {len(keys)} "
            f"held-out two-hop questions (colour / category / yes-no shape forms in turn, "
            f"scored by the first generated word); pruning at layer {args.layer}"
            + (f" (multi-stage rows: layers {stage_layers})" if args.multi_stage else "")
            + f", query '{args.query}'. Unpruned accuracy {100 * summary[0]['accuracy']:.2f}%."
        )
    else:
        head = (
            f"POPE-style accuracy retention on the organism ({args.model.name}), {len(scenes)} "
            f"held-out images, {len(keys)} distinct questions, 3 splits; pruning at layer "
            f"{args.layer}, query '{args.query}'. Unpruned accuracy "
            f"{100 * summary[0]['accuracy']:.2f}% (mean of splits)."
        )
    lines = [
        f"{head} Prompt: {PROMPT}.",
        "",
        "| pruner | " + " | ".join(f"keep {k:g}" for k in args.keeps) + " |",
        "|---|" + "---:|" * len(args.keeps),
    ]
    for label, _ in runs:
        cells = []
        for keep in args.keeps:
            s = next(r for r in summary if r["pruner"] == label and r["keep"] == keep)
            cells.append(f"{100 * s['retention']:.2f}% ({100 * s['accuracy']:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    over = "" if args.task == TWO_HOP else ", mean over the three splits"
    lines += ["", f"Cells: retention (pruned accuracy, %){over}."]
    if row_profile:
        lines += [
            "",
            f"fastv score per image row at layer {args.layer}, top to bottom (each image's "
            "row means normalised to mean 1): " + ", ".join(f"{v:.2f}" for v in row_profile),
        ]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    meta = dict(
        machine=f"{platform.machine()} {platform.processor()}".strip(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        model=str(args.model.name),
        images=len(scenes),
        questions=len(keys),
        layer=args.layer,
        stage_layers=list(stage_layers) if args.multi_stage else None,
        task=args.task,
        query=args.query,
        prompt=PROMPT,
        summary=summary,
        fastv_row_profile=row_profile,
    )
    (args.out / f"{args.name}.json").write_text(json.dumps(meta, indent=1))
    if args.task == TWO_HOP:
        title = f"Pruned / unpruned two-hop accuracy ({args.model.name}, layer {args.layer})"
        plot(summary, args.keeps, args.out / f"{args.name}.png", title, "two-hop retention (%)")
    else:
        plot(summary, args.keeps, args.out / f"{args.name}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
