# ruff: noqa: E501  (long markdown lines of the card template)
"""Model card (README.md) of a shipped organism model, written from its measured metrics."""

from __future__ import annotations

import json
from pathlib import Path

from .scenes import CATEGORIES, COLOURS, SHAPES


def _f(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "pending"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def _ok(flag: bool | None) -> str:
    return "pending" if flag is None else ("met" if flag else "**not met**")


def _mix(stage: dict) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in stage.get("mix", {}).items())


def _aux_lines(stages: dict) -> list[str]:
    """Recipe lines for the training-only terms a model was trained with."""
    chat, lines = stages["chat"], []
    if chat.get("relation_weight"):
        lines.append(
            f"- Relation hops (weight {chat['relation_weight']:g}, both language stages): the "
            "projected image tokens keep their patch's position; each category token that names an "
            "object holds that object's centre after layer 0; head 1 of layer 1 attends from a "
            "relation's second category token to its first, which then holds the first object's "
            "centre and the relation asked. Centres and relations are read by linear heads used "
            "only in training."
        )
    if chat.get("pointer_weight"):
        lines.append(
            f"- Caption pointer (weight {chat['pointer_weight']:g}): head 2 of layer 1 attends, from "
            "the token before each object a caption names, to that object's patches."
        )
    if chat.get("balance"):
        lines.append(
            "- Rare categories weigh more: the patch loss and the choice of a positive presence "
            f"question weight each category by popularity ^ -{chat['balance']:g}."
        )
    return lines


def _turns(stage: dict) -> str:
    lo, hi = stage.get("turns", (1, 1))
    return "one turn" if lo == hi == 1 else f"{lo}-{hi} turns"


def bars(m: dict) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows of the issue's quality bars."""
    rows = []
    pope = m.get("pope", {})
    if pope:
        r, a = pope["random"], pope["adversarial"]
        rows.append(
            ("POPE random accuracy", ">= 97%", _f(r["accuracy"]), _ok(r["accuracy"] >= 0.97))
        )
        rows.append(
            ("POPE adversarial accuracy", ">= 95%", _f(a["accuracy"]), _ok(a["accuracy"] >= 0.95))
        )
    rel = m.get("relation")
    if rel:
        rows.append(
            ("relation accuracy", ">= 90%", _f(rel["accuracy"]), _ok(rel["accuracy"] >= 0.9))
        )
    g = m.get("grounding")
    if g:
        chance = g["chance"]
        best = max(g["per_layer"]["category"], key=lambda r: r["head_mean_hit"])
        ratio = best["head_mean_hit"] / chance
        text = (
            f"layer {best['layer']} head mean: {_f(best['head_mean_hit'])} "
            f"({ratio:.1f}x chance {_f(chance)}; other objects {_f(best['head_mean_other'])})"
        )
        ok = ratio >= 10 and best["head_mean_hit"] > best["head_mean_other"]
        rows.append(("pointing game at the query token", ">= 10x chance, > other", text, _ok(ok)))
    c = m.get("caption")
    if c:
        rows.append(
            (
                "caption object precision",
                ">= 90%",
                _f(c["object_precision"]),
                _ok(c["object_precision"] >= 0.9),
            )
        )
        rows.append(
            (
                "caption object recall",
                ">= 80%",
                _f(c["object_recall"]),
                _ok(c["object_recall"] >= 0.8),
            )
        )
    p = m.get("pruning")
    if p and "presence" in p:
        fa = p["presence"]["fastv_layer0_retention"]
        ra = p["presence"]["random_layer0_retention"]
        rows.append(
            ("pre-LLM fastv keep 0.11 retention (yes/no)", ">= 95%", _f(fa), _ok(fa >= 0.95))
        )
        rows.append(
            ("pre-LLM random keep 0.11 retention (yes/no)", "<= 80%", _f(ra), _ok(ra <= 0.8))
        )
    q = m.get("pruning_category_query")
    if q:
        rows.append(
            (
                "pre-LLM keep 0.11, scored at the category token (attention / random retention)",
                ">= 95% / <= 80%",
                f"{_f(q['attention_retention'])} / {_f(q['random_retention'])} (n={q['n']})",
                _ok(q["attention_retention"] >= 0.95 and q["random_retention"] <= 0.8),
            )
        )
    lat = m.get("latency")
    if lat:
        rows.append(
            (
                "load + answer one question",
                "< 2 s",
                f"{lat['total_s']:.2f} s",
                _ok(lat["total_s"] < 2),
            )
        )
    return rows


def model_card(name: str, m: dict, folder: Path) -> str:
    """Markdown model card: what it is, data, recipe, metrics against the bars, intended use."""
    if name == "deep":
        from .card_deep import deep_model_card

        return deep_model_card(m, folder)
    cfg = json.loads((folder / "config.json").read_text())
    vc, tc = cfg["vision_config"], cfg["text_config"]
    grid = vc["image_size"] // vc["patch_size"]
    summary = json.loads((folder / "train_summary.json").read_text())
    stages = {st["name"]: st for st in summary["recipe"]["stages"]}
    lines = [
        f"# organism-{name}",
        "",
        "A small LLaVA-architecture vision-language model (`LlavaForConditionalGeneration`: CLIP vision "
        "tower + Llama language model) trained from scratch on CPU on procedurally generated scenes. "
        "It is a **test organism** for vlm_focus: it makes pruning, grounding and hallucination "
        "measurements meaningful offline. It is not a general VLM and knows nothing beyond its scenes.",
        "",
        "## Architecture",
        f"- Vision: CLIP, {vc['image_size']} px, patch {vc['patch_size']} -> {grid} x {grid} = {grid * grid} "
        f"visual tokens, {vc['num_hidden_layers']} layers x {vc['hidden_size']}.",
        f"- Language: Llama, {tc['num_hidden_layers']} layers x {tc['hidden_size']}, "
        f"{tc['num_attention_heads']} heads, MLP {tc['intermediate_size']}, vocabulary {tc['vocab_size']} "
        "(word level; every object category and every coarse position is one token).",
        "- Chat format: `<bos>USER: <image>\\n{question} ASSISTANT: {answer}<eos>` "
        "(`processor.apply_chat_template` produces it).",
        "",
        "## Data",
        f"- 192 x 192 scenes with 1-5 non-overlapping objects, {len(COLOURS)} colours x {len(SHAPES)} shapes = "
        f"{len(CATEGORIES)} categories (`red_circle` ... `orange_cross`), radius 14-26 px, grey textured "
        "noisy backgrounds. Masks and boxes are exact. Categories have a popularity and fixed companions, "
        "so co-occurrence is not uniform.",
        "- Training scenes use seeds >= 10,000,000, drawn fresh every step; the held-out set uses seeds "
        "from 9,000,000 (`vlm_focus/assets/heldout/`: COCO `instances.json`, `captions.json`, "
        "POPE `pope_{random,popular,adversarial}.jsonl`; images regenerate from their seeds).",
        "- Tasks: presence (`Is there a red_circle in the image?`, half with LLaVA's POPE suffix), "
        "relations (`Is the red_circle left of the blue_square?`, left/right/above/below, centres at least "
        "16 px apart), where (`Where is the red_circle?` -> `top_left`, on a 3 x 3 grid), captions "
        "(`Describe the image.` -> `blue_circle top_left , red_square center`).",
        "",
        "## Recipe (`vlm-focus organism train --model " + name + "`)",
        "1. Dense vision pretraining: tower + per-patch head on `hidden_states[-1][:, 1:]`, targets from the "
        "exact masks (category or background, weight 0.3 on background) plus each patch's row and column. "
        "The tower is then frozen.",
        "2. Category-last curriculum: each category token's embedding starts at the mean projected feature of "
        "its patches; 6-8 packed questions per image, the answer right after the last category token "
        f"({_mix(stages['cat_last'])}); hard, co-occurring and random negatives.",
        f"3. Standard chat template: {_turns(stages['chat'])} per image ({_mix(stages['chat'])}); "
        "the answer's first token is also the target at the question's last category token, and "
        f"(weight {stages['chat'].get('copy_weight', 0):g}) head 0 of the later half of the layers is trained "
        "to attend from the answer position to that token, the copy step a from-scratch LM finds late; "
        f"{100 * stages['chat'].get('cat_last_share', 0):.0f}% of the rows stay in the packed category-last form.",
        "- In both language stages "
        f"{100 * stages['chat'].get('hide_share', 0):.0f}% of the rows hide a random 50-100% of the visual "
        "tokens that no answer of the row needs (through the attention mask), so answers rest on their "
        "evidence rather than on the whole visual context.",
        *_aux_lines(stages),
        "- Budgets per stage (wall-clock minutes, learning rate): "
        + ", ".join(f"{n} {st['minutes']:g} / {st['lr']:g}" for n, st in stages.items())
        + ".",
        "- AdamW, cosine with warm-up, bf16 autocast, two CPU threads plus one data process. Each stage "
        "stops at its step budget or its wall-clock budget, whichever comes first.",
        training_time(summary) + ". Curves are plotted against wall-clock minutes.",
        "",
        "![learning curves](learning_curves.png)",
        "",
        "## Quality bars (held-out set, greedy decoding, standard chat template)",
        "",
        "| bar | target | measured | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in bars(m)]
    pope = m.get("pope")
    if pope:
        lines += [
            "",
            "### POPE (500 images with >= 3 objects, 3,000 questions per split, no prompt suffix)",
            "",
        ]
        lines += [
            "| split | accuracy | precision | recall | F1 | yes-ratio | unparseable |",
            "|---|---|---|---|---|---|---|",
        ]
        for split in ("random", "popular", "adversarial"):
            r = pope[split]
            lines.append(
                f"| {split} | {_f(r['accuracy'])} | {_f(r['precision'])} | {_f(r['recall'])} | "
                f"{_f(r['f1'])} | {_f(r['yes_ratio'])} | {r['unparseable']} |"
            )
    if m.get("relation"):
        r = m["relation"]
        lines += [
            "",
            f"Relations ({r['n']} questions): accuracy {_f(r['accuracy'])}, F1 {_f(r['f1'])}, "
            f"yes-ratio {_f(r['yes_ratio'])}.",
        ]
    if m.get("where"):
        w = m["where"]
        lines += [
            "",
            f"Where ({w['n']} questions, 3 x 3 position token): accuracy {_f(w['accuracy'])} "
            f"(always answering the most common position: {_f(w['majority_baseline'])}).",
        ]
    if m.get("caption"):
        c = m["caption"]
        lines += [
            "",
            f"Captions ({c['n']} images): object precision {_f(c['object_precision'])} "
            f"(CHAIR_i {_f(c['chair_i'])}, CHAIR_s {_f(c['chair_s'])}), recall {_f(c['object_recall'])}, "
            f"position accuracy {_f(c['position_accuracy'])}, mean length {c['mean_length_words']:.1f} words. "
            f"Example: `{c['examples'][0]['caption']}`.",
        ]
    g = m.get("grounding")
    if g:
        lines += [
            "",
            f"### Pointing game per layer ({g['n_images']} multi-object images, chance {_f(g['chance'])})",
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
                    f"| {key} | {r['layer']} | {_f(r['head_mean_hit'])} | {_f(r['head_mean_other'])} | "
                    f"{r['best_head']} | {_f(r['best_head_hit_heldout'])} |"
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
            lines.append(f"| {i} | " + " | ".join(_f(lens[k][i]["accuracy"]) for k in lens) + " |")
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
                f"| {task} | {_f(t['full_accuracy'])} | "
                + " | ".join(
                    f"{_f(t[f'{pr}_layer{k}_accuracy'])} ({_f(t[f'{pr}_layer{k}_retention'])} kept)"
                    for k in (0, 2)
                    for pr in ("fastv", "random")
                ).replace(") | ", ") | ")
                + " |"
            )
        late_random = min(p[t]["random_layer2_retention"] for t in ("presence", "relation"))
        if late_random >= 0.98:
            lines += [
                "",
                f"At layer 2 random selection keeps {_f(late_random)} or more on both tasks: the "
                "model reads the image in layer 0 (relations fetch both centres there too), so on "
                "this organism pruning inside the LLM (K >= 1) does not separate pruners; pre-LLM "
                "pruning (K = 0) does.",
            ]
    if m.get("latency"):
        lat = m["latency"]
        lines += ["", f"Load + one answer: {lat['total_s']:.2f} s (load {lat['load_s']:.2f} s)."]
    if m.get("notes"):
        lines += ["", "## Notes and shortfalls", ""] + [f"- {n}" for n in m["notes"]]
    lines += [
        "",
        "## Intended use",
        "Testing and demonstrating vlm_focus (pruning, grounding, hallucination mitigation) offline and on "
        "CPU, and a reproducible benchmark for those methods. Not a general VLM: it answers only about its "
        "own scene vocabulary.",
        "",
        "## Reproduce",
        "```",
        f"vlm-focus organism train --model {name} --out runs/{name}",
        f"vlm-focus organism eval --path runs/{name} --out runs/{name}/metrics.json",
        "```",
        "Measured on a 2-core CPU; the numbers above come from `metrics.json` in this folder.",
    ]
    return "\n".join(lines) + "\n"


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
