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
``--out``; ``--name`` defaults to ``pruner_quality``. ``--query`` and ``--reduce`` default to
``FocusConfig``'s; given several values, every pruner runs at every combination.

``--defaults`` measures the choice of those two defaults: fastv, text and debiased at every
``query_rows`` x ``reduce`` combination, random as the floor, keeps 0.25 and 0.11, at layer 0 on
organism-default (POPE, ``--images`` scenes) and at layer 2 on organism-deep (two-hop,
``--questions``). The combination with the highest accuracy averaged over those pruners, keeps
and the two depths is written as ``best`` to ``pruning_defaults.json``, which
``FocusConfig``'s defaults must equal (``tests/test_pruning_defaults.py``).

    python benchmarks/pruner_quality.py --defaults --images 60 --questions 300 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

import vlm_focus as vf
from organism import deep_model_path, default_model_path, guide_model_path
from organism.answering import answer
from organism.pope import SPLITS, pope_eligible, pope_questions
from vlm_focus import FocusConfig
from vlm_focus.config import QUERY_ROWS, REDUCTIONS
from vlm_focus.eval.pope import evaluate
from vlm_focus.loading import build_inputs, load_model
from vlm_focus.pruners import get_pruner
from vlm_focus.setting import RunSetting

PROMPT = "USER: <image>\\n{question} ASSISTANT: (chat template, no suffix; greedy, 1 new token)"
NEW_TOKENS = 1
TWO_HOP = "twohop"


def load(path: Path):
    return load_model(str(path), dtype=torch.float32)


@dataclass
class QuestionSet:
    """Held-out questions of one task: ``rows`` per split, answered once per distinct
    ``(image_id, question)`` key (``keys`` sorted)."""

    task: str
    scenes: list
    rows: dict[str, list[dict]]
    keys: list[tuple[int, str]]
    pictures: dict[int, Image.Image]

    @property
    def splits(self) -> list[str]:
        return list(self.rows)

    def image(self, row: dict) -> Image.Image:
        return self.pictures[row["image_id"]]


def question_set(task: str, n: int) -> QuestionSet:
    """POPE's three splits on the first ``n`` eligible held-out scenes, or the first ``n``
    held-out two-hop questions."""
    if task == TWO_HOP:
        from organism.evaluate_twohop import two_hop_set

        scenes, qas = two_hop_set(n)
        rows = {TWO_HOP: [
            {"image_id": sc.seed, "text": q.question, "label": q.answer}
            for sc, q in zip(scenes, qas, strict=True)
        ]}  # fmt: skip
    else:
        scenes = pope_eligible(n)
        rows = {split: pope_questions(scenes, split) for split in SPLITS}
    keys = sorted({(r["image_id"], r["text"]) for split in rows for r in rows[split]})
    pictures = {s.seed: Image.fromarray(s.image()) for s in scenes}
    return QuestionSet(task, scenes, rows, keys, pictures)


def mean_accuracy(metrics: dict[str, dict]) -> float:
    return sum(m["accuracy"] for m in metrics.values()) / len(metrics)


def run_setting(model, processor, qset, focus, batch, desc, guide=(None, None)):
    """(metrics per split, correct per question (every split's rows in turn), seconds) of one
    pruning setting (``focus``: a FocusConfig, ``None`` unpruned). POPE questions go through
    ``vlm_focus.eval.pope.evaluate`` (the POPE/LLaVA rule and metrics); two-hop answers are
    right when their first word is the answer."""
    setting = RunSetting(focus=focus, max_new_tokens=NEW_TOKENS)
    t0 = time.perf_counter()
    if qset.task == TWO_HOP:
        by_seed = {s.seed: s for s in qset.scenes}
        scenes, questions = [by_seed[i] for i, _ in qset.keys], [q for _, q in qset.keys]
        answers = answer(
            model,
            processor,
            scenes,
            questions,
            batch=batch,
            setting=setting,
            guide=guide[0],
            guide_processor=guide[1],
        )
        by_key = dict(zip(qset.keys, answers, strict=True))
        rows = qset.rows[TWO_HOP]
        hits = [(by_key[(r["image_id"], r["text"])].split() or [""])[0] == r["label"] for r in rows]
        metrics = {TWO_HOP: {"accuracy": sum(hits) / len(hits), "n": len(hits)}}
    else:
        rows = [{**r, "split": split} for split in qset.splits for r in qset.rows[split]]
        # asked in key order, as every setting is: the random pruner's draws follow the batches
        asked = sorted(rows, key=lambda r: (r["image_id"], r["text"]))
        result = evaluate(
            model,
            processor,
            asked,
            setting,
            images=qset.image,
            suffix="",
            batch_size=batch,
            guide=guide[0],
            guide_processor=guide[1],
            progress=desc,
        )
        metrics = {split: result.scores(split) for split in qset.splits}
        pred = {(r["split"], r["question_id"]): r["pred"] for r in result.records}
        hits = [pred[(r["split"], r["question_id"])] == r["label"] for r in rows]
    return metrics, hits, time.perf_counter() - t0


@torch.no_grad()
def score_rows(model, processor, qset, focus: FocusConfig, batch: int) -> list[float]:
    """The first stage's score per image row, top to bottom, each image's row means normalised
    to mean 1, averaged over the distinct questions (a recency diagnostic): one prefill of
    each batch under ``focus``."""
    profile = []
    with vf.wrap(model, config=focus) as handle:
        for i in range(0, len(qset.keys), batch):
            keys = qset.keys[i : i + batch]
            pictures = [qset.pictures[image_id] for image_id, _ in keys]
            model(**build_inputs(processor, pictures, [q for _, q in keys]))
            for scores in handle.last_trace.scores:
                side = math.isqrt(scores.numel())
                if side * side == scores.numel():
                    rows = scores.view(side, side).mean(1)
                    profile.append(rows / rows.mean().clamp(min=1e-12))
    return torch.stack(profile).mean(0).tolist() if profile else []


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


def machine() -> str:
    return (
        f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def single(args) -> None:
    """Every pruner (or ``--pruners``) at every keep, at one layer, on one model and task."""
    names = args.pruners or vf.pruners()
    guided = [n for n in names if get_pruner(n).needs_guide]
    if guided and not (args.guide / "config.json").exists():
        print(f"no guide model at {args.guide}: skipping {', '.join(guided)}")
        names = [n for n in names if n not in guided]
        guided = []

    model, processor = load(args.model)
    guide = load(args.guide) if guided else (None, None)
    qset = question_set(args.task, args.images)
    splits = qset.splits
    n_layers = model.config.text_config.num_hidden_layers
    combos = [(q, r) for q in args.query for r in args.reduce]
    setting = ", ".join(f"query '{q}', reduce '{r}'" for q, r in combos)
    print(
        f"{machine()}; model {args.model.name}; {len(qset.scenes)} images, "
        f"{len(qset.keys)} distinct questions; layer {args.layer}, {setting}"
    )

    results: list[dict] = []
    row_profile: list[float] = []
    base, _, base_seconds = run_setting(model, processor, qset, None, args.batch, "none")
    for split in splits:
        results.append(dict(pruner="none", keep=1.0, split=split, **base[split]))
    summary = [dict(pruner="none", keep=1.0, retention=1.0, seconds=base_seconds,
                    accuracy=mean_accuracy(base))]  # fmt: skip
    stage_layers = tuple(k for k in (args.layer, args.layer + 2, args.layer + 4) if k < n_layers)
    runs = [(name, name, q, r, False) for name in names for q, r in combos]
    runs += [
        (f"{name} x{len(stage_layers)}", name, q, r, True)
        for name in args.multi_stage
        for q, r in combos
    ]
    if len(combos) > 1:  # label each row with its query rows and reduction
        runs = [(f"{label} {q}/{r}", name, q, r, staged) for label, name, q, r, staged in runs]
    for label, name, query, reduce, staged in runs:
        for keep in args.keeps:
            schedule = dict(keep=keep, layer=args.layer)
            if staged:  # the same final keep in stages: keep^(1/n), keep^(2/n), ... keep
                n = len(stage_layers)
                stages = tuple(keep ** ((i + 1) / n) for i in range(n))
                schedule = dict(keep=stages, layer=stage_layers)
            focus = FocusConfig(pruner=name, query_rows=query, reduce=reduce, **schedule)
            metrics, _, seconds = run_setting(
                model, processor, qset, focus, args.batch, f"{label} {keep}", guide
            )
            first = name == "fastv" and keep == args.keeps[0] and (query, reduce) == combos[0]
            if first and not staged:
                row_profile = score_rows(model, processor, qset, focus, args.batch)
            for split in splits:
                retention = metrics[split]["accuracy"] / max(base[split]["accuracy"], 1e-9)
                results.append(
                    dict(
                        pruner=label, keep=keep, split=split, retention=retention, **metrics[split]
                    )  # fmt: skip
                )
            accuracy = mean_accuracy(metrics)
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
            f"Two-hop accuracy retention on the organism ({args.model.name}), {len(qset.keys)} "
            f"held-out two-hop questions (colour / category / yes-no shape forms in turn, "
            f"scored by the first generated word); pruning at layer {args.layer}"
            + (f" (multi-stage rows: layers {stage_layers})" if args.multi_stage else "")
            + f", {setting}. Unpruned accuracy {100 * summary[0]['accuracy']:.2f}%."
        )
    else:
        head = (
            f"POPE-style accuracy retention on the organism ({args.model.name}), "
            f"{len(qset.scenes)} held-out images, {len(qset.keys)} distinct questions, 3 splits; "
            f"pruning at layer {args.layer}, {setting}. Unpruned accuracy "
            f"{100 * summary[0]['accuracy']:.2f}% (mean of splits)."
        )
    lines = [
        f"{head} Prompt: {PROMPT}.",
        "",
        "| pruner | " + " | ".join(f"keep {k:g}" for k in args.keeps) + " |",
        "|---|" + "---:|" * len(args.keeps),
    ]
    for label, *_ in runs:
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
        machine=machine(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        model=str(args.model.name),
        images=len(qset.scenes),
        questions=len(qset.keys),
        layer=args.layer,
        stage_layers=list(stage_layers) if args.multi_stage else None,
        task=args.task,
        query_rows=args.query,
        reduce=args.reduce,
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


# --defaults: the two depths where the choice of query rows and reduction can matter
DEFAULT_GRID = ("fastv", "text", "debiased")  # the attention pruners, over the whole grid
DEFAULT_FLOOR = "random"  # reads no attention: one run per keep


def default_depths(args) -> list[dict]:
    return [
        dict(name="layer 0", model=args.model or default_model_path(), task="pope", layer=0,
             n=args.images, about="POPE presence questions, random / popular / adversarial "
             "splits, mean of splits"),
        dict(name="layer 2", model=args.deep or deep_model_path(), task=TWO_HOP, layer=2,
             n=args.questions, about="two-hop questions (colour / category / yes-no shape)"),
    ]  # fmt: skip


def defaults(args) -> None:
    """Each attention pruner over query_rows x reduce at each keep, at layer 0 on the default
    organism (POPE) and at layer 2 on the deep one (two-hop), with random as the floor; the
    best combination (highest accuracy averaged over pruners, keeps and the two depths) is
    written to ``<name>.json`` as ``best``."""
    combos = [(q, r) for q in args.query for r in args.reduce]
    started = time.perf_counter()
    args.load = [os.getloadavg()[0]]  # other jobs on the machine slow the run, never the answers
    depths = default_depths(args)
    for depth in depths:
        model, processor = load(depth["model"])
        qset = question_set(depth["task"], depth["n"])
        print(f"{machine()}; {depth['name']}: {depth['model'].name}, {len(qset.keys)} questions")
        t0 = time.perf_counter()
        base, _, _ = run_setting(model, processor, qset, None, args.batch, "none")
        depth.update(
            images=len(qset.scenes),
            questions=len(qset.keys),
            rows=sum(len(r) for r in qset.rows.values()),
            unpruned=dict(accuracy=mean_accuracy(base), splits=base),
            settings=[],
        )
        hits = {}
        runs = [(name, q, r) for name in DEFAULT_GRID for q, r in combos]
        runs += [(DEFAULT_FLOOR, None, None)]
        for name, query, reduce in runs:
            for keep in args.keeps:
                rows = {} if query is None else dict(query_rows=query, reduce=reduce)
                focus = FocusConfig(pruner=name, keep=keep, layer=depth["layer"], **rows)
                desc = f"{depth['name']} {name} {query}/{reduce} {keep}"
                metrics, right, seconds = run_setting(
                    model, processor, qset, focus, args.batch, desc
                )
                accuracy = mean_accuracy(metrics)
                depth["settings"].append(
                    dict(pruner=name, query_rows=query, reduce=reduce, keep=keep,
                         accuracy=accuracy, retention=accuracy / depth["unpruned"]["accuracy"],
                         seconds=seconds, splits=metrics)
                )  # fmt: skip
                if query is not None:
                    hits.setdefault((query, reduce), []).extend(right)
                print(f"{desc}: accuracy {accuracy:.4f} ({seconds:.0f}s)")
        depth["seconds"] = time.perf_counter() - t0
        depth["hits"] = hits
    minutes = (time.perf_counter() - started) / 60
    args.load.append(os.getloadavg()[0])
    write_defaults(args, depths, combos, minutes)


def write_defaults(args, depths: list[dict], combos: list[tuple[str, str]], minutes: float):
    def grid_mean(depth, combo):
        cells = [s for s in depth["settings"] if (s["query_rows"], s["reduce"]) == combo]
        return sum(s["accuracy"] for s in cells) / len(cells)

    ranking = []
    for combo in combos:
        per_depth = {d["name"]: grid_mean(d, combo) for d in depths}
        ranking.append(dict(query_rows=combo[0], reduce=combo[1], **per_depth,
                            overall=sum(per_depth.values()) / len(per_depth)))  # fmt: skip
    best = max(ranking, key=lambda r: r["overall"])
    best_combo = (best["query_rows"], best["reduce"])
    by_depth = {}
    for d in depths:
        top = max(ranking, key=lambda r: r[d["name"]])
        by_depth[d["name"]] = dict(query_rows=top["query_rows"], reduce=top["reduce"])
    for r in ranking:  # paired against the best: questions only one of the two answers right
        for d in depths:
            mine, theirs = d["hits"][(r["query_rows"], r["reduce"])], d["hits"][best_combo]
            r[f"{d['name']} better"] = sum(a and not b for a, b in zip(mine, theirs, strict=True))
            r[f"{d['name']} worse"] = sum(b and not a for a, b in zip(mine, theirs, strict=True))

    command = "python benchmarks/pruner_quality.py --defaults " + " ".join(
        [f"--images {args.images}", f"--questions {args.questions}",
         "--keeps " + " ".join(f"{k:g}" for k in args.keeps), f"--threads {args.threads}"]
        if args.threads else
        [f"--images {args.images}", f"--questions {args.questions}",
         "--keeps " + " ".join(f"{k:g}" for k in args.keeps)]
    )  # fmt: skip
    columns = [(d, k) for d in depths for k in args.keeps]
    lines = [
        f"Which `query_rows` and `reduce` the attention pruners should default to, measured on "
        f"the embedded organisms. Greedy, one new token, prompt {PROMPT}.",
        "",
    ]
    for d in depths:
        lines.append(
            f"- **{d['name']}**: {d['model'].name}, {d['about']}; {d['images']} held-out images, "
            f"{d['questions']} distinct questions ({d['rows']} question rows); unpruned "
            f"accuracy {100 * d['unpruned']['accuracy']:.2f}%."
        )
    lines += [
        "",
        f"Command: `{command}` ({machine()}; {minutes:.1f} minutes, 1-minute load average "
        f"{args.load[0]:.1f} at the start and {args.load[1]:.1f} at the end).",
        "",
        "| pruner | query_rows | reduce | "
        + " | ".join(f"{d['name']}, keep {k:g}" for d, k in columns)
        + " |",
        "|---|---|---|" + "---:|" * len(columns),
    ]
    for name in (*DEFAULT_GRID, DEFAULT_FLOOR):
        for combo in combos if name != DEFAULT_FLOOR else [(None, None)]:
            cells = []
            for d, k in columns:
                s = next(
                    s for s in d["settings"]
                    if s["pruner"] == name and (s["query_rows"], s["reduce"]) == combo
                    and s["keep"] == k
                )  # fmt: skip
                cells.append(f"{100 * s['retention']:.2f}% ({100 * s['accuracy']:.2f})")
            q, r = combo if combo[0] else ("-", "-")
            lines.append(f"| {name} | {q} | {r} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cells: retention (pruned accuracy, %); layer 0 is the mean over the three POPE splits.",
        "",
        "| query_rows | reduce | "
        + " | ".join(f"{d['name']} mean" for d in depths)
        + " | overall | "
        + " | ".join(f"{d['name']}: right only here / only with the best" for d in depths)
        + " |",
        "|---|---|" + "---:|" * (2 * len(depths) + 1),
    ]
    for r in sorted(ranking, key=lambda r: -r["overall"]):
        mark = " **(best)**" if (r["query_rows"], r["reduce"]) == best_combo else ""
        lines.append(
            f"| {r['query_rows']} | {r['reduce']}{mark} | "
            + " | ".join(f"{100 * r[d['name']]:.2f}" for d in depths)
            + f" | {100 * r['overall']:.2f} | "
            + " | ".join(f"{r[d['name'] + ' better']} / {r[d['name'] + ' worse']}" for d in depths)
            + " |"
        )
    lines += [
        "",
        f"Means: accuracy (%) over {', '.join(DEFAULT_GRID)} and keeps "
        f"{', '.join(f'{k:g}' for k in args.keeps)}; overall = the mean of the depths. The last "
        "columns count the questions (pooled over pruners and keeps) that this combination "
        "answers right and the best does not, and the reverse.",
        "",
        f"Best overall: query_rows='{best['query_rows']}', reduce='{best['reduce']}'. Best per "
        "depth: "
        + "; ".join(f"{n}: {b['query_rows']}/{b['reduce']}" for n, b in by_depth.items())
        + ".",
    ]
    lines += [
        "",
        "Per pruner, accuracy (%) averaged over the keeps and the two depths:",
        "",
        "| pruner | " + " | ".join(f"{q} / {r}" for q, r in combos) + " |",
        "|---|" + "---:|" * len(combos),
    ]
    for name in DEFAULT_GRID:
        cells = []
        for combo in combos:
            means = [
                sum(s["accuracy"] for s in d["settings"]
                    if s["pruner"] == name and (s["query_rows"], s["reduce"]) == combo)
                / len(args.keeps)
                for d in depths
            ]  # fmt: skip
            cells.append(f"{100 * sum(means) / len(means):.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = depths[0]
    if "adversarial" in first["unpruned"]["splits"]:
        adversarial = [
            f"{q}/{r} {100 * s['splits']['adversarial']['accuracy']:.2f}"
            for q, r in combos
            for s in first["settings"]
            if (s["pruner"], s["keep"], s["query_rows"], s["reduce"]) == ("fastv", 0.25, q, r)
        ]
        lines += [
            "",
            f"The adversarial split alone at {first['name']}, fastv keep 0.25 (accuracy, %, "
            f"{first['unpruned']['splits']['adversarial']['n']} questions): "
            + ", ".join(adversarial)
            + "; unpruned "
            f"{100 * first['unpruned']['splits']['adversarial']['accuracy']:.2f}.",
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    meta = dict(
        command=command,
        machine=machine(),
        minutes=minutes,
        load_average=args.load,
        prompt=PROMPT,
        keeps=args.keeps,
        pruners=[*DEFAULT_GRID, DEFAULT_FLOOR],
        best=dict(query_rows=best["query_rows"], reduce=best["reduce"]),
        best_by_depth=by_depth,
        ranking=ranking,
        depths=[
            {**{k: v for k, v in d.items() if k != "hits"}, "model": d["model"].name}
            for d in depths
        ],
    )
    (args.out / f"{args.name}.json").write_text(json.dumps(meta, indent=1))
    plot_defaults(depths, combos, args.keeps, args.out / f"{args.name}.png")
    print("\n".join(lines))


def plot_defaults(depths, combos, keeps, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4.5), sharey=True)
    width = 0.8 / len(combos)
    for ax, d in zip(axes, depths, strict=True):
        groups = [(name, k) for name in DEFAULT_GRID for k in keeps]
        for i, combo in enumerate(combos):
            ys = [
                100 * next(
                    s["accuracy"] for s in d["settings"]
                    if s["pruner"] == name and s["keep"] == k
                    and (s["query_rows"], s["reduce"]) == combo
                )
                for name, k in groups
            ]  # fmt: skip
            xs = [g + (i - (len(combos) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, ys, width, label=f"{combo[0]} / {combo[1]}")
        floor = [s for s in d["settings"] if s["pruner"] == DEFAULT_FLOOR]
        for s, style in zip(floor, ("--", ":"), strict=False):
            ax.axhline(100 * s["accuracy"], color="grey", ls=style, lw=1,
                       label=f"random, keep {s['keep']:g}")  # fmt: skip
        ax.axhline(100 * d["unpruned"]["accuracy"], color="black", lw=1, label="unpruned")
        ax.set_xticks(range(len(groups)), [f"{n}\nkeep {k:g}" for n, k in groups], fontsize=8)
        ax.set_title(f"{d['name']} ({d['model'].name}, {d['questions']} questions)")
        ax.set_ylim(50, 100)
    axes[0].set_ylabel("accuracy (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.suptitle("Pruned accuracy by query_rows / reduce (bars) against random and unpruned")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: organism-default")
    parser.add_argument("--deep", type=Path, default=None, help="--defaults' layer-2 model")
    parser.add_argument("--guide", type=Path, default=guide_model_path())
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--questions", type=int, default=600, help="--defaults' two-hop questions")
    parser.add_argument("--keeps", type=float, nargs="+", default=None)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument(
        "--query", nargs="+", default=None, choices=QUERY_ROWS,
        help="query rows (several: every combination with --reduce); default FocusConfig's, "
        "both with --defaults",
    )  # fmt: skip
    parser.add_argument(
        "--reduce", nargs="+", default=None, choices=REDUCTIONS,
        help="head reduction; default FocusConfig's, both with --defaults",
    )  # fmt: skip
    parser.add_argument("--pruners", nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default=None, help="stem of the output files")
    parser.add_argument("--task", default="pope", choices=["pope", TWO_HOP])
    parser.add_argument(
        "--multi-stage", nargs="*", default=[], help="pruners also run as 3-stage schedules"
    )
    parser.add_argument(
        "--defaults", action="store_true",
        help="measure query_rows x reduce for the attention pruners at layer 0 (POPE, "
        "organism-default) and layer 2 (two-hop, organism-deep)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.defaults:
        args.query = args.query or list(QUERY_ROWS)
        args.reduce = args.reduce or list(REDUCTIONS)
        args.keeps = args.keeps or [0.25, 0.11]
        args.name = args.name or "pruning_defaults"
        defaults(args)
        return
    args.model = args.model or default_model_path()
    args.query = args.query or [FocusConfig.query_rows]
    args.reduce = args.reduce or [FocusConfig.reduce]
    args.keeps = args.keeps or [0.5, 0.25, 0.11]
    args.name = args.name or "pruner_quality"
    single(args)


if __name__ == "__main__":
    main()
