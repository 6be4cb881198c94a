# ruff: noqa: E501  (long markdown lines of the card template)
"""The pieces every LLaVA-shaped organism's model card (:mod:`.card`) is written with: the
trained run's folder, the card's parts, and the lines and numbers each family's card shares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT_LINE = "- Chat format: `<bos>USER: <image>\\n{question} ASSISTANT: {answer}<eos>`"
_OPTIMISER = "AdamW, cosine with warm-up, bf16 autocast, two CPU threads plus one data process."


def optimiser(summary: dict) -> str:
    """The optimiser sentence of a card: precision and threads as the run recorded them (runs
    that recorded neither used bf16 autocast on two threads)."""
    if "dtype" not in summary:
        return _OPTIMISER
    precision = "bf16 autocast" if summary["dtype"] == "bfloat16" else "float32"
    threads = summary.get("threads", 2)
    return (
        f"AdamW, cosine with warm-up, {precision} (the faster on the training CPU), {threads} "
        f"CPU thread{'s' if threads != 1 else ''} plus one data process."
    )


def measured(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "pending"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def verdict(flag: bool | None) -> str:
    return "pending" if flag is None else ("met" if flag else "**not met**")


def mix_text(stage: dict) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in stage.get("mix", {}).items())


def turns_text(stage: dict) -> str:
    lo, hi = stage.get("turns", (1, 1))
    return "one turn" if lo == hi == 1 else f"{lo}-{hi} turns"


def budgets_line(stages: dict) -> str:
    """``- Budgets per stage ...: vision 9 / 0.001, ...`` of a card (no full stop)."""
    return "- Budgets per stage (wall-clock minutes, learning rate): " + ", ".join(
        f"{n} {st['minutes']:g} / {st['lr']:g}" for n, st in stages.items()
    )


def training_time(summary: dict) -> str:
    """``- Training time (minutes): ...`` of a card, per stage, wall clock and CPU (no full stop)."""
    line = "- Training time (minutes): " + ", ".join(
        f"{k} {v / 60:.1f}" for k, v in summary["seconds"].items()
    )
    line += f"; total {summary['minutes_total']:.1f} wall-clock"
    if summary.get("cpu_seconds"):
        line += "; CPU minutes of the training process: " + ", ".join(
            f"{k} {v / 60:.1f}" for k, v in summary["cpu_seconds"].items()
        )
    return line


def steps_run(folder: Path) -> dict[str, int]:
    """The last logged step of each stage in ``folder/train_log.jsonl`` (empty without it)."""
    log = folder / "train_log.jsonl"
    steps: dict[str, int] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "stage" in record and "step" in record:
                steps[record["stage"]] = max(steps.get(record["stage"], 0), int(record["step"]))
    return steps


def latency_bar(m: dict) -> list[tuple[str, str, str, str]]:
    lat = m.get("latency")
    if not lat:
        return []
    return [
        (
            "load + answer one question",
            "< 2 s",
            f"{lat['total_s']:.2f} s",
            verdict(lat["total_s"] < 2),
        )
    ]


def pope_table(pope: dict, title: str) -> list[str]:
    """The POPE section (``title`` names the task) with one row per split."""
    lines = [
        "",
        f"### {title} (500 images with >= 3 objects, 3,000 questions per split, no prompt suffix)",
        "",
        "| split | accuracy | precision | recall | F1 | yes-ratio | unparseable |",
        "|---|---|---|---|---|---|---|",
    ]
    for split in ("random", "popular", "adversarial"):
        r = pope[split]
        lines.append(
            f"| {split} | {measured(r['accuracy'])} | {measured(r['precision'])} | {measured(r['recall'])} | "
            f"{measured(r['f1'])} | {measured(r['yes_ratio'])} | {r['unparseable']} |"
        )
    return lines


@dataclass
class TrainedRun:
    """What a trained model's folder says about the run: its config, summary and stages."""

    folder: Path
    vision: dict
    text: dict
    summary: dict
    stages: dict[str, dict]

    @classmethod
    def read(cls, folder: Path) -> TrainedRun:
        cfg = json.loads((folder / "config.json").read_text())
        summary = json.loads((folder / "train_summary.json").read_text())
        stages = {st["name"]: st for st in summary["recipe"]["stages"]}
        return cls(folder, cfg["vision_config"], cfg["text_config"], summary, stages)


@dataclass
class CardParts:
    """What one organism's card says in the frame of :func:`model_card`."""

    intro: str
    vocabulary: str  # closes the language line: what one token of the vocabulary is
    chat: str  # closes the chat-format line
    data: list[str]
    recipe: list[str]
    bars: list[tuple[str, str, str, str]]
    details: list[str]
    use: str
    ship: bool = False  # the reproduce block ships the model too


def default_details(m: dict) -> list[str]:
    """POPE, relation, where and caption results, the pointing game, the logit lens and
    pruning, each where measured."""
    lines: list[str] = []
    if m.get("pope"):
        lines += pope_table(m["pope"], "POPE")
    if m.get("relation"):
        r = m["relation"]
        lines += [
            "",
            f"Relations ({r['n']} questions): accuracy {measured(r['accuracy'])}, F1 {measured(r['f1'])}, "
            f"yes-ratio {measured(r['yes_ratio'])}.",
        ]
    if m.get("where"):
        w = m["where"]
        lines += [
            "",
            f"Where ({w['n']} questions, 3 x 3 position token): accuracy {measured(w['accuracy'])} "
            f"(always answering the most common position: {measured(w['majority_baseline'])}).",
        ]
    if m.get("caption"):
        c = m["caption"]
        lines += [
            "",
            f"Captions ({c['n']} images): object precision {measured(c['object_precision'])} "
            f"(CHAIR_i {measured(c['chair_i'])}, CHAIR_s {measured(c['chair_s'])}), recall {measured(c['object_recall'])}, "
            f"position accuracy {measured(c['position_accuracy'])}, mean length {c['mean_length_words']:.1f} words. "
            f"Example: `{c['examples'][0]['caption']}`.",
        ]
    g = m.get("grounding")
    if g:
        lines += [
            "",
            f"### Pointing game per layer ({g['n_images']} multi-object images, chance {measured(g['chance'])})",
            "",
            "Attention row of the query's category token (and, for contrast, of the last prompt token) over "
            "the visual tokens; a hit when the argmax patch centre lies in the queried object's box, "
            "`other` when it lies in another object's box. Best head chosen on even images, scored on odd.",
            "",
            "| query | layer | head mean hit | head mean other | best head | its hit (held out) |",
            "|---|---|---|---|---|---|",
        ]
        for key, rows in g["per_layer"].items():
            for r in rows:
                lines.append(
                    f"| {key} | {r['layer']} | {measured(r['head_mean_hit'])} | {measured(r['head_mean_other'])} | "
                    f"{r['best_head']} | {measured(r['best_head_hit_heldout'])} |"
                )
    lens = m.get("logit_lens")
    if lens:
        lines += [
            "",
            "### Where the answer forms (logit lens at the last prompt token, yes vs no)",
            "",
            "| layer | " + " | ".join(lens) + " |",
            "|---|" + "---|" * len(lens),
        ]
        for i in range(len(next(iter(lens.values())))):
            lines.append(
                f"| {i} | " + " | ".join(measured(lens[k][i]["accuracy"]) for k in lens) + " |"
            )
    p = m.get("pruning")
    if p and "presence" in p:
        lines += [
            "",
            f"### Pruning through `vlm_focus.wrap` (keep {p['keep']}, query `{p['query']}`)",
            "",
            "| task | full | fastv L0 | random L0 | fastv L2 | random L2 |",
            "|---|---|---|---|---|---|",
        ]
        for task in ("presence", "relation"):
            t = p[task]
            lines.append(
                f"| {task} | {measured(t['full_accuracy'])} | "
                + " | ".join(
                    f"{measured(t[f'{pr}_layer{k}_accuracy'])} ({measured(t[f'{pr}_layer{k}_retention'])} kept)"
                    for k in (0, 2)
                    for pr in ("fastv", "random")
                )
                + " |"
            )
        late_random = min(p[t]["random_layer2_retention"] for t in ("presence", "relation"))
        if late_random >= 0.98:
            lines += [
                "",
                f"At layer 2 random selection keeps {measured(late_random)} or more on both tasks: the "
                "model reads the image in layer 0 (relations fetch both centres there too), so on "
                "this organism pruning inside the LLM (K >= 1) does not separate pruners; pre-LLM "
                "pruning (K = 0) does.",
            ]
    return lines
