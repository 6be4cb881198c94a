# ruff: noqa: E501  (long markdown lines of the card template)
"""Model cards (README.md) of the shipped organism models, written from their measured metrics.

Every card has one frame: what the model is, its architecture, data, recipe, the quality bars,
the detailed measurements, intended use and how to reproduce it. The default and guide models
fill it with the presence, relation, where and caption tasks; the deep model with the two-hop
family and the per-layer diagnostics that show where it reads the image again.
"""

from __future__ import annotations

from pathlib import Path

from .card_cooccur import cooccur_parts
from .card_deep import deep_parts
from .card_parts import (
    CHAT_LINE,
    CardParts,
    TrainedRun,
    budgets_line,
    default_details,
    latency_bar,
    measured,
    mix_text,
    optimiser,
    training_time,
    turns_text,
    verdict,
)
from .scenes import CATEGORIES, COLOURS, SHAPES


def model_card(name: str, m: dict, folder: Path) -> str:
    """Markdown model card of organism-``name`` from its metrics ``m`` and its trained
    ``folder``: what it is, data, recipe, metrics against the bars, intended use."""
    run = TrainedRun.read(Path(folder))
    if name in ("deep", "twohop-guide"):
        parts = deep_parts(name, m, run)
    elif name == "cooccur":
        parts = cooccur_parts(m, run)
    else:
        parts = _default_parts(name, m, run)
    vc, tc = run.vision, run.text
    grid = vc["image_size"] // vc["patch_size"]
    lines = [
        f"# organism-{name}",
        "",
        parts.intro,
        "",
        "## Architecture",
        f"- Vision: CLIP, {vc['image_size']} px, patch {vc['patch_size']} -> {grid} x {grid} = {grid * grid} "
        f"visual tokens, {vc['num_hidden_layers']} layers x {vc['hidden_size']}.",
        f"- Language: Llama, {tc['num_hidden_layers']} layers x {tc['hidden_size']}, "
        f"{tc['num_attention_heads']} heads, MLP {tc['intermediate_size']}, vocabulary {tc['vocab_size']} "
        + parts.vocabulary,
        CHAT_LINE + parts.chat,
        "",
        "## Data",
        *parts.data,
        "",
        f"## Recipe (`vlm-focus organism train --model {name}`)",
        *parts.recipe,
        "",
        "![learning curves](learning_curves.png)",
        "",
        "## Quality bars (held-out set, greedy decoding, standard chat template)",
        "",
        "| bar | target | measured | verdict |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in parts.bars),
        *parts.details,
    ]
    if m.get("latency"):
        lat = m["latency"]
        lines += ["", f"Load + one answer: {lat['total_s']:.2f} s (load {lat['load_s']:.2f} s)."]
    if m.get("notes"):
        lines += ["", "## Notes and shortfalls", ""] + [f"- {n}" for n in m["notes"]]
    lines += [
        "",
        "## Intended use",
        parts.use,
        "",
        "## Reproduce",
        "```",
        f"vlm-focus organism train --model {name} --out runs/{name}",
        f"vlm-focus organism eval --path runs/{name} --out runs/{name}/metrics.json",
    ]
    if parts.ship:
        lines.append(
            f"vlm-focus organism ship --path runs/{name} --name {name} --metrics runs/{name}/metrics.json"
        )
    lines += [
        "```",
        "Measured on a 2-core CPU; the numbers above come from `metrics.json` in this folder.",
    ]
    return "\n".join(lines) + "\n"


# --- organism-default and organism-guide: presence, relations, where, captions ---------------


def bars(m: dict) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows of the default and guide models' quality bars."""
    rows = []
    pope = m.get("pope", {})
    if pope:
        r, a = pope["random"], pope["adversarial"]
        rows.append(
            (
                "POPE random accuracy",
                ">= 97%",
                measured(r["accuracy"]),
                verdict(r["accuracy"] >= 0.97),
            )
        )
        rows.append(
            (
                "POPE adversarial accuracy",
                ">= 95%",
                measured(a["accuracy"]),
                verdict(a["accuracy"] >= 0.95),
            )
        )
    rel = m.get("relation")
    if rel:
        rows.append(
            (
                "relation accuracy",
                ">= 90%",
                measured(rel["accuracy"]),
                verdict(rel["accuracy"] >= 0.9),
            )
        )
    g = m.get("grounding")
    if g:
        chance = g["chance"]
        best = max(g["per_layer"]["category"], key=lambda r: r["head_mean_hit"])
        ratio = best["head_mean_hit"] / chance
        text = (
            f"layer {best['layer']} head mean: {measured(best['head_mean_hit'])} "
            f"({ratio:.1f}x chance {measured(chance)}; other objects {measured(best['head_mean_other'])})"
        )
        ok = ratio >= 10 and best["head_mean_hit"] > best["head_mean_other"]
        rows.append(
            ("pointing game at the query token", ">= 10x chance, > other", text, verdict(ok))
        )
    c = m.get("caption")
    if c:
        precision, recall = c["object_precision"], c["object_recall"]
        rows.append(
            ("caption object precision", ">= 90%", measured(precision), verdict(precision >= 0.9))
        )
        rows.append(("caption object recall", ">= 80%", measured(recall), verdict(recall >= 0.8)))
    p = m.get("pruning")
    if p and "presence" in p:
        fa = p["presence"]["fastv_layer0_retention"]
        ra = p["presence"]["random_layer0_retention"]
        rows.append(
            (
                "pre-LLM fastv keep 0.11 retention (yes/no)",
                ">= 95%",
                measured(fa),
                verdict(fa >= 0.95),
            )
        )
        rows.append(
            (
                "pre-LLM random keep 0.11 retention (yes/no)",
                "<= 80%",
                measured(ra),
                verdict(ra <= 0.8),
            )
        )
    q = m.get("pruning_category_query")
    if q:
        rows.append(
            (
                "pre-LLM keep 0.11, scored at the category token (attention / random retention)",
                ">= 95% / <= 80%",
                f"{measured(q['attention_retention'])} / {measured(q['random_retention'])} (n={q['n']})",
                verdict(q["attention_retention"] >= 0.95 and q["random_retention"] <= 0.8),
            )
        )
    return rows + latency_bar(m)


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


def _default_parts(name: str, m: dict, run: TrainedRun) -> CardParts:
    stages = run.stages
    chat = stages["chat"]
    return CardParts(
        intro="A small LLaVA-architecture vision-language model (`LlavaForConditionalGeneration`: CLIP vision "
        "tower + Llama language model) trained from scratch on CPU on procedurally generated scenes. "
        "It is a **test organism** for vlm_focus: it makes pruning, grounding and hallucination "
        "measurements meaningful offline. It is not a general VLM and knows nothing beyond its scenes.",
        vocabulary="(word level; every object category and every coarse position is one token).",
        chat=" (`processor.apply_chat_template` produces it).",
        data=[
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
        ],
        recipe=[
            "1. Dense vision pretraining: tower + per-patch head on `hidden_states[-1][:, 1:]`, targets from the "
            "exact masks (category or background, weight 0.3 on background) plus each patch's row and column. "
            "The tower is then frozen.",
            "2. Category-last curriculum: each category token's embedding starts at the mean projected feature of "
            "its patches; 6-8 packed questions per image, the answer right after the last category token "
            f"({mix_text(stages['cat_last'])}); hard, co-occurring and random negatives.",
            f"3. Standard chat template: {turns_text(chat)} per image ({mix_text(chat)}); "
            "the answer's first token is also the target at the question's last category token, and "
            f"(weight {chat.get('copy_weight', 0):g}) head 0 of the later half of the layers is trained "
            "to attend from the answer position to that token, the copy step a from-scratch LM finds late; "
            f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows stay in the packed category-last form.",
            "- In both language stages "
            f"{100 * chat.get('hide_share', 0):.0f}% of the rows hide a random 50-100% of the visual "
            "tokens that no answer of the row needs (through the attention mask), so answers rest on their "
            "evidence rather than on the whole visual context.",
            *_aux_lines(stages),
            budgets_line(stages) + ".",
            f"- {optimiser(run.summary)} Each stage stops at its step budget or its wall-clock budget, whichever comes first.",
            training_time(run.summary) + ". Curves are plotted against wall-clock minutes.",
        ],
        bars=bars(m),
        details=default_details(m),
        use="Testing and demonstrating vlm_focus (pruning, grounding, hallucination mitigation) offline and on "
        "CPU, and a reproducible benchmark for those methods. Not a general VLM: it answers only about its "
        "own scene vocabulary.",
    )
