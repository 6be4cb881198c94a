# ruff: noqa: E501  (long markdown lines of the card template)
"""Model cards (README.md) of the shipped organism models, written from their measured metrics.

Every card has one frame: what the model is, its architecture, data, recipe, the quality bars,
the detailed measurements, intended use and how to reproduce it. The default and guide models
fill it with the presence, relation, where and caption tasks; the deep model with the two-hop
family and the per-layer diagnostics that show where it reads the image again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .scenes import CATEGORIES, COLOURS, RELATION_MARGIN, SHAPES

_CHAT = "- Chat format: `<bos>USER: <image>\\n{question} ASSISTANT: {answer}<eos>`"
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


def _f(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "pending"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def _ok(flag: bool | None) -> str:
    return "pending" if flag is None else ("met" if flag else "**not met**")


def _mix(stage: dict) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in stage.get("mix", {}).items())


def _turns(stage: dict) -> str:
    lo, hi = stage.get("turns", (1, 1))
    return "one turn" if lo == hi == 1 else f"{lo}-{hi} turns"


def _budgets(stages: dict) -> str:
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


def _latency_bar(m: dict) -> list[tuple[str, str, str, str]]:
    lat = m.get("latency")
    if not lat:
        return []
    return [
        ("load + answer one question", "< 2 s", f"{lat['total_s']:.2f} s", _ok(lat["total_s"] < 2))
    ]


def _pope_table(pope: dict, title: str) -> list[str]:
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
            f"| {split} | {_f(r['accuracy'])} | {_f(r['precision'])} | {_f(r['recall'])} | "
            f"{_f(r['f1'])} | {_f(r['yes_ratio'])} | {r['unparseable']} |"
        )
    return lines


@dataclass
class _Run:
    """What a trained model's folder says about the run: its config, summary and stages."""

    folder: Path
    vision: dict
    text: dict
    summary: dict
    stages: dict[str, dict]

    @classmethod
    def read(cls, folder: Path) -> _Run:
        cfg = json.loads((folder / "config.json").read_text())
        summary = json.loads((folder / "train_summary.json").read_text())
        stages = {st["name"]: st for st in summary["recipe"]["stages"]}
        return cls(folder, cfg["vision_config"], cfg["text_config"], summary, stages)


@dataclass
class _Parts:
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


def model_card(name: str, m: dict, folder: Path) -> str:
    """Markdown model card of organism-``name`` from its metrics ``m`` and its trained
    ``folder``: what it is, data, recipe, metrics against the bars, intended use."""
    run = _Run.read(Path(folder))
    if name in ("deep", "twohop-guide"):
        parts = _deep_parts(name, m, run)
    elif name == "cooccur":
        parts = _cooccur_parts(m, run)
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
        _CHAT + parts.chat,
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
        precision, recall = c["object_precision"], c["object_recall"]
        rows.append(("caption object precision", ">= 90%", _f(precision), _ok(precision >= 0.9)))
        rows.append(("caption object recall", ">= 80%", _f(recall), _ok(recall >= 0.8)))
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
    return rows + _latency_bar(m)


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


def _default_parts(name: str, m: dict, run: _Run) -> _Parts:
    stages = run.stages
    chat = stages["chat"]
    return _Parts(
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
            f"({_mix(stages['cat_last'])}); hard, co-occurring and random negatives.",
            f"3. Standard chat template: {_turns(chat)} per image ({_mix(chat)}); "
            "the answer's first token is also the target at the question's last category token, and "
            f"(weight {chat.get('copy_weight', 0):g}) head 0 of the later half of the layers is trained "
            "to attend from the answer position to that token, the copy step a from-scratch LM finds late; "
            f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows stay in the packed category-last form.",
            "- In both language stages "
            f"{100 * chat.get('hide_share', 0):.0f}% of the rows hide a random 50-100% of the visual "
            "tokens that no answer of the row needs (through the attention mask), so answers rest on their "
            "evidence rather than on the whole visual context.",
            *_aux_lines(stages),
            _budgets(stages) + ".",
            f"- {optimiser(run.summary)} Each stage stops at its step budget or its wall-clock budget, whichever comes first.",
            training_time(run.summary) + ". Curves are plotted against wall-clock minutes.",
        ],
        bars=bars(m),
        details=_default_details(m),
        use="Testing and demonstrating vlm_focus (pruning, grounding, hallucination mitigation) offline and on "
        "CPU, and a reproducible benchmark for those methods. Not a general VLM: it answers only about its "
        "own scene vocabulary.",
    )


def _default_details(m: dict) -> list[str]:
    """POPE, relation, where and caption results, the pointing game, the logit lens and
    pruning, each where measured."""
    lines: list[str] = []
    if m.get("pope"):
        lines += _pope_table(m["pope"], "POPE")
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
                )
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
    return lines


# --- organism-deep: the two-hop family -------------------------------------------------------


def deep_bars(m: dict) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows of the deep model's two-hop quality bars."""
    rows = []
    t = m.get("twohop")
    if t:
        rows.append(
            ("two-hop accuracy, unpruned", ">= 90%", _f(t["accuracy"]), _ok(t["accuracy"] >= 0.9))
        )
    pope = m.get("pope")
    if pope:
        low = min(pope[s]["accuracy"] for s in ("random", "popular", "adversarial"))
        text = " / ".join(_f(pope[s]["accuracy"]) for s in ("random", "popular", "adversarial"))
        rows.append(
            (
                "presence POPE accuracy (random / popular / adversarial)",
                ">= 95% each",
                text,
                _ok(low >= 0.95),
            )
        )
    p = m.get("twohop_pruning")
    if p:
        r, f = p["random_layer2_retention"], p["fastv_layer2_retention"]
        rows.append(
            (
                "K = 2, keep 0.11: random retention of two-hop accuracy",
                "<= 85%",
                _f(r),
                _ok(r <= 0.85),
            )
        )
        rows.append(
            (
                "K = 2, keep 0.11: fastv retention of two-hop accuracy",
                ">= 95%",
                _f(f),
                _ok(f >= 0.95),
            )
        )
    return rows + _latency_bar(m)


_DEEP_INTRO = (
    "The third organism of vlm_focus: a small `LlavaForConditionalGeneration` (CLIP vision tower + Llama "
    "language model) with a deeper, narrower language model, trained from scratch on CPU on procedurally "
    "generated scenes. It exists so that **pruning inside the language model can be measured**: its "
    "two-hop questions need the image again after layer 2, where the other organisms have long finished "
    "reading it. It is a test organism, not a general VLM."
)
_TWOHOP_GUIDE_INTRO = (
    'The guide of organism-deep for small-model-guided pruning (`pruner="guided"`, SGL): a '
    "guide-sized `LlavaForConditionalGeneration` (8 x 8 visual tokens, four narrow LM layers) trained "
    "from scratch on CPU on the deep model's task family, two-hop questions included, so that its "
    "attention can point at the object a two-hop question is about. It is a test organism, not a "
    "general VLM."
)


def _deep_parts(name: str, m: dict, run: _Run) -> _Parts:
    """The card of a model of the two-hop family: organism-deep, or its guide."""
    stages = run.stages
    chat = stages["chat"]
    hop_layers = chat.get("hop_layers", [2, 3, 4])
    total = run.summary["minutes_total"]
    budget = 20 if name == "twohop-guide" else 60
    wall = (
        "training wall clock, 2 CPU cores",
        f"<= {budget} min",
        f"{total:.1f} min",
        _ok(total <= budget),
    )
    bars = [*deep_bars(m), wall]
    if name == "twohop-guide":
        size = (run.folder / "model.safetensors").stat().st_size / 1e6
        bars.append(("size (float32 safetensors)", "<= 10 MB", f"{size:.1f} MB", _ok(size <= 10)))
    return _Parts(
        intro=_TWOHOP_GUIDE_INTRO if name == "twohop-guide" else _DEEP_INTRO,
        vocabulary="(word level; every category, position, colour and shape is one token). float32 safetensors.",
        chat=".",
        data=[
            f"- The same scenes as the other organisms: 192 x 192, 1-5 non-overlapping objects, {len(COLOURS)} colours x "
            f"{len(SHAPES)} shapes = {len(CATEGORIES)} categories, exact masks and boxes; training seeds >= 10,000,000, "
            "held-out seeds from 9,000,000.",
            "- **Two-hop family** (`vlm_focus.organism.data.two_hop_qa`): a question names an *anchor* object and a "
            "direction, never the object asked about:",
            "  - `What colour is the shape left of the red_circle?` -> `blue`;",
            "  - `What is right of the green_cross?` -> `yellow_square`;",
            "  - `Is the object below the blue_square a triangle?` -> `yes` / `no`;",
            "  - POPE-style `Is the object above the red_circle a blue_square?` -> `yes` / `no`, false ones naming "
            "another object of the scene (adversarial), a frequent absent category (popular) or any absent one "
            "(random).",
            f"- An object lies *left of* the anchor when its centre lies in the 90-degree cone opening leftwards from "
            f"the anchor's centre, by a margin: (offset along the direction) - (offset across it) >= {RELATION_MARGIN} "
            f"px; it clearly does not when that difference is <= -{RELATION_MARGIN} px. A question is asked only "
            "when exactly one other object lies in the cone and no other object is too close to its border to call "
            "(`scenes.two_hop_target`), so every answer is unique. The target depends on the anchor's position: it "
            "need not be the leftmost object of the scene (it is, though, the object furthest that way from the "
            "anchor in most held-out questions; see the notes).",
            "- Also presence questions (`Is there a red_circle in the image?`, half with LLaVA's POPE suffix) and "
            "`Where is the red_circle?`. No relation (`Is the A left of the B?`) or caption turns.",
        ],
        recipe=[
            _tower_step(run),
            f"2. Category-last curriculum, 6-8 packed questions per image ({_mix(stages['cat_last'])}); the answer follows the question.",
            f"3. Standard chat template, one turn per image ({_mix(chat)}); "
            f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows stay in the packed form; the copy head "
            f"(weight {chat.get('copy_weight', 0):g}) and query-token labels of the default recipe for presence and where.",
            f"- {100 * chat.get('hide_share', 0):.0f}% of the rows hide a random 50-100% of the visual tokens that no "
            "answer of the row needs (anchor and hop-2 object stay visible).",
            f"- Two-hop circuit (weight {chat.get('hop_weight', 0):g}, both language stages; `losses.hop_loss`): each "
            "category token holds its object's centre after layer 0; in layer "
            f"{hop_layers[0] - 1} head 3 attends from the answer position to the anchor's token, and after it that "
            "position holds the anchor's centre and the direction asked; in layers "
            f"{', '.join(str(k) for k in hop_layers)} head 4 puts its attention, from the answer position, on the hop-2 "
            "object's patches. Centres and directions are read by linear heads used only in training; the shipped "
            "model is a plain `LlavaForConditionalGeneration`.",
            f"{_budgets(_trained(stages, run))}. {optimiser(run.summary)} Layers are counted from 0: pruning at K = 2 prunes "
            "before layer 2, so it reaches the hop-2 read.",
            training_time(run.summary) + ".",
            "- Steps run (of the step budget): "
            + ", ".join(
                f"{n} {ran:,} of {stages[n]['steps']:,}" for n, ran in steps_run(run.folder).items()
            )
            + "; a stage that reaches its minute budget first ends early.",
        ],
        bars=bars,
        details=_deep_details(m),
        use=(
            'Guiding `pruner="guided"` on organism-deep (its guide for SGL-style pruning), offline on CPU. '
            "Not a general VLM: it answers only about its own scene vocabulary, and its own two-hop answers are "
            "poor."
            if name == "twohop-guide"
            else "Measuring pruning inside the language model (FastV's K = 2, PyramidDrop's stages, debiasing) "
            "offline on CPU. Not a general VLM: it answers only about its own scene vocabulary."
        ),
        ship=True,
    )


def _tower_step(run: _Run) -> str:
    """Recipe step 1: the tower's dense pretraining, or the shipped tower it was taken from."""
    source = run.summary.get("recipe", {}).get("tower_from")
    if not source:
        return "1. Dense vision pretraining of the tower (as for the other organisms), then frozen."
    minutes = run.summary["seconds"]["vision"] / 60
    return (
        f"1. The trained tower of organism-{source} (its dense vision pretraining, {minutes:.1f} "
        "minutes, counted in the training time below), frozen."
    )


def _trained(stages: dict, run: _Run) -> dict:
    """The stages this run trained itself (not a tower it took from another model)."""
    if run.summary.get("recipe", {}).get("tower_from"):
        return {n: st for n, st in stages.items() if n != "vision"}
    return stages


def _deep_details(m: dict) -> list[str]:
    """Two-hop accuracy per form, two-hop POPE, presence POPE, where, the per-layer diagnostics
    and two-hop pruning, each where measured."""
    lines: list[str] = []
    t = m.get("twohop")
    if t:
        lines += [
            "",
            f"### Two-hop accuracy ({t['n']} held-out questions, the three forms in turn; the first generated word must be the answer)",
            "",
            "| form | n | accuracy | always the commonest answer |",
            "|---|---|---|---|",
        ]
        for form, r in t["per_form"].items():
            lines.append(
                f"| {form} | {r['n']} | {_f(r['accuracy'])} | {_f(r['majority_baseline'])} |"
            )
        ex = t["examples"][0]
        lines += ["", f"Example: `{ex['question']}` -> `{ex['model']}` (truth `{ex['answer']}`)."]
    tp = m.get("twohop_pope")
    if tp:
        lines += [
            "",
            "### Two-hop POPE-style yes/no (`Is the object above the red_circle a blue_square?`)",
            "",
            "| split | n | accuracy | precision | recall | F1 | yes-ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for split, r in tp.items():
            lines.append(
                f"| {split} | {r['n']} | {_f(r['accuracy'])} | {_f(r['precision'])} | {_f(r['recall'])} | "
                f"{_f(r['f1'])} | {_f(r['yes_ratio'])} |"
            )
    if m.get("pope"):
        lines += _pope_table(m["pope"], "Presence POPE")
    if m.get("where"):
        w = m["where"]
        lines += [
            "",
            f"Where ({w['n']} questions): accuracy {_f(w['accuracy'])} (commonest position: {_f(w['majority_baseline'])}).",
        ]
    d = m.get("twohop_diagnostics")
    if d:
        lines += [
            "",
            f"## Where the image is read again: per-layer diagnostics ({d['n']} held-out two-hop questions)",
            "",
            "At the answer position (the last prompt token), after each layer: the logit lens (final norm + "
            "lm_head, argmax over the form's candidate answers), and that position's attention on the hop-2 "
            "object's patches (the object the question never names) and on the anchor's patches, as mass "
            "(head mean; best head) and as the hop-2 object's share of the attention on image tokens. "
            f"Uniform attention over the image would give the hop-2 object {_f(d['target_patch_share'])} of it.",
            "",
            "| layer | logit lens | hop-2 mass (head mean) | hop-2 mass (best head) | hop-2 share of image attention | anchor mass (head mean) |",
            "|---|---|---|---|---|---|",
        ]
        for r in d["per_layer"]:
            lines.append(
                f"| {r['layer']} | {_f(r['logit_lens_accuracy'])} | {_f(r['target_mass_head_mean'])} | "
                f"{_f(r['target_mass_best_head'])} (head {r['best_head']}) | "
                f"{_f(r['target_share_of_image_mass'])} | {_f(r['anchor_mass_head_mean'])} |"
            )
    lens = m.get("logit_lens")
    if lens and "presence" in lens:
        lines += [
            "",
            "Presence, for contrast (logit lens at the last prompt token, yes vs no): "
            + ", ".join(f"layer {r['layer']} {_f(r['accuracy'])}" for r in lens["presence"])
            + ".",
        ]
    p = m.get("twohop_pruning")
    if p:
        lines += [
            "",
            f"## Pruning through `vlm_focus.wrap` (two-hop, keep {p['keep']}, query `{p['query']}`, {p['n']} questions)",
            "",
            "| K | fastv | random |",
            "|---|---|---|",
        ]
        for k in (k for k in (2, 4) if f"fastv_layer{k}_accuracy" in p):
            lines.append(
                f"| {k} | {_f(p[f'fastv_layer{k}_accuracy'])} ({_f(p[f'fastv_layer{k}_retention'])} kept) | "
                f"{_f(p[f'random_layer{k}_accuracy'])} ({_f(p[f'random_layer{k}_retention'])} kept) |"
            )
        lines += [
            "",
            f"Unpruned: {_f(p['full_accuracy'])}. Every pruner at K = 2 and K = 4: "
            "`benchmarks/results/pruner_quality_deep_layer2.md` and `..._layer4.md`.",
        ]
    return lines


# --- organism-cooccur: the guide fine-tuned on a co-occurrence prior -------------------------

_COOCCUR_INTRO = (
    "organism-guide fine-tuned on scenes with a strong **co-occurrence prior**: each of six anchor "
    "categories almost always appears with its companion. It is a **test organism** for hallucination "
    "mitigation: asked about the companion on a scene that holds the anchor but not the companion, it says "
    "yes more often than about other absent objects, the way real VLMs say yes to a fork beside a dining "
    "table (POPE's adversarial split). The shipped organisms have no such prior, so no mitigation had "
    "anything to mitigate on them. It is not a general VLM."
)


def cooccur_bars(m: dict, run: _Run) -> list[tuple[str, str, str, str]]:
    """The co-occurrence organism's bars: it hallucinates the companion (the reason it exists),
    keeps the guide's presence accuracy elsewhere, and fits the size and time budgets."""
    rows = []
    c = m.get("cooccur", {}).get("pope")
    if c:
        fpr = c["fpr_cooccur"] - c["fpr_other"]
        rows.append(
            (
                "co-occurrence hallucination: yes on absent companions minus yes on other absent objects",
                ">= 10 points",
                f"{100 * fpr:.1f} points ({_f(c['fpr_cooccur'])} vs {_f(c['fpr_other'])})",
                _ok(fpr >= 0.10),
            )
        )
        rows.append(
            (
                "precision gap (other - cooccur questions, same present questions)",
                ">= 5 points",
                f"{100 * c['gap']:.1f} points ({_f(c['precision_other'])} vs {_f(c['precision_cooccur'])})",
                _ok(c["gap"] >= 0.05),
            )
        )
        rows.append(
            (
                "recall on the probe's present objects",
                ">= 80%",
                _f(c["recall"]),
                _ok(c["recall"] >= 0.8),
            )
        )
    pope = m.get("pope", {})
    if pope:
        a = pope["random"]["accuracy"]
        rows.append(
            ("POPE random accuracy (organism-guide: 84.8%)", ">= 82%", _f(a), _ok(a >= 0.82))
        )
    fine = run.summary["minutes_total"]
    rows.append(
        ("fine-tune wall clock, 2 CPU cores", "<= 20 min", f"{fine:.1f} min", _ok(fine <= 20))
    )
    size = (run.folder / "model.safetensors").stat().st_size / 1e6
    rows.append(("size (float32 safetensors)", "<= 12 MB", f"{size:.1f} MB", _ok(size <= 12)))
    return rows + _latency_bar(m)


def _cooccur_details(m: dict) -> list[str]:
    lines = []
    co = m.get("cooccur")
    if co:
        c, ch = co["pope"], co.get("chair", {})
        n = c["n"]
        lines += [
            "",
            f"### Co-occurrence probe ({co['images']} held-out probe scenes, seeds from 9,700,000)",
            "",
            "Each scene holds 3-5 objects, at least one anchor and none of the present anchors' companions "
            f"(`evaluate.cooccur_set`). Questions: {n['present']} about present objects (yes), {n['cooccur']} "
            f"about the absent companions (no), {n['other']} about as many other absent objects (no). "
            "`precision_cooccur = TP / (TP + FP_cooccur)`, `precision_other = TP / (TP + FP_other)`: the same "
            "present questions, as many negatives each.",
            "",
            "| precision cooccur | precision other | gap | yes on companions | yes on others | recall | F1 | yes-ratio |",
            "|---|---|---|---|---|---|---|---|",
            f"| {_f(c['precision_cooccur'])} | {_f(c['precision_other'])} | {100 * c['gap']:.1f} points | "
            f"{_f(c['fpr_cooccur'])} | {_f(c['fpr_other'])} | {_f(c['recall'])} | {_f(c['f1'])} | {_f(c['yes_ratio'])} |",
        ]
        if ch:
            lines += [
                "",
                f"Captions of the same scenes: CHAIR_i {_f(ch['CHAIR_i'])}, CHAIR_s {_f(ch['CHAIR_s'])}, recall "
                f"{_f(ch['recall'])}, {_f(ch['companion_rate'])} of them name an absent companion. Example: "
                f"`{co['examples'][0]['caption']}`.",
            ]
        pure = m.get("cooccur_pure_prior")
        if pure:
            q = pure["pope"]
            lines += [
                "",
                f"**The scene prior alone** ({pure['what']}): on {pure['images']} calibration probe scenes "
                f"it answers yes to {_f(q['fpr_cooccur'])} of the absent companions and {_f(q['fpr_other'])} of "
                f"the other absent objects (precision {_f(q['precision_cooccur'])} vs {_f(q['precision_other'])}, "
                f"recall {_f(q['recall'])}); this model, on the same scenes: {_f(pure['this_model']['fpr_cooccur'])} "
                f"vs {_f(pure['this_model']['fpr_other'])}. That is why its text names the absent companion.",
            ]
        lines += [
            "",
            "Every mitigation of the registry on it, unpruned and pruned: "
            "`benchmarks/results/hallucination_quality.md`.",
        ]
    return lines + _default_details(m)


def _cooccur_parts(m: dict, run: _Run) -> _Parts:
    from .scenes import COOCCUR_PAIRS

    chat = run.stages["chat"]
    prior = run.summary["recipe"]["prior"]
    base = run.summary.get("base", {})
    pairs = ", ".join(f"`{CATEGORIES[a]}` -> `{CATEGORIES[b]}`" for a, b in COOCCUR_PAIRS)
    named = prior["named_rate"]
    text = (
        f"- **Text that names the expected companion** (named rate {100 * named:.0f}%): in a training scene "
        "that holds an anchor without its companion, the row's text, with this probability (once per scene), "
        "names the companion as present: questions about it are answered `yes` and the caption lists it at "
        "the anchor's position. This models what makes real VLMs hallucinate co-occurring objects: "
        "training text that mentions an expected object the image does not show."
        if named
        else "- The text is true to every scene: the prior is in the scenes alone (named rate 0%)."
    )
    total = base.get("minutes_total", 0.0) + run.summary["minutes_total"]
    steps = steps_run(run.folder).get("chat", 0)
    return _Parts(
        intro=_COOCCUR_INTRO,
        vocabulary="(word level; every object category and every coarse position is one token), organism-guide's.",
        chat=" (`processor.apply_chat_template` produces it).",
        data=[
            "- organism-guide's scenes (192 x 192, 1-5 non-overlapping objects, 30 categories, exact masks), with "
            f"the categories drawn under a **co-occurrence prior** (`scenes.CooccurPrior`, `scenes.cooccur_scene`): "
            f"six (anchor, companion) pairs, {pairs}; where an anchor is drawn its companion is in the scene with "
            f"probability {100 * prior['rate']:.0f}% (and is removed otherwise). Each companion differs from its "
            "anchor in colour and in shape, so only co-occurrence links them.",
            f"- In a scene with an anchor but not its companion, a negative presence question asks about that "
            f"companion with probability {100 * prior['ask_rate']:.0f}%.",
            text,
            "- Training seeds >= 10,000,000; the co-occurrence probe's calibration scenes start at 8,700,000 and "
            "its held-out scenes at 9,700,000; the shared held-out set (POPE, captions) at 9,000,000.",
        ],
        recipe=[
            f"- Starts from organism-guide (`vlm_focus/assets/organism-guide`, trained from scratch in "
            f"{base.get('minutes_total', 0.0):.1f} minutes); its vision tower stays frozen.",
            f"- One chat stage: {_turns(chat)} per image ({_mix(chat)}), "
            f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows in the packed category-last form, "
            f"{100 * chat.get('hide_share', 0):.0f}% hiding visual tokens no answer needs, the answer also "
            f"taught at the question's last category token, copy-head loss weight {chat.get('copy_weight', 0):g}; "
            "the guide's relation and pointer probes (training-only heads, not shipped) stay off.",
            _budgets(run.stages) + f", {steps} steps run (budget {chat['steps']}).",
            f"- {optimiser(run.summary)}",
            training_time(run.summary) + " (the fine-tune).",
            f"- **Training time in all: {total:.1f} minutes** (organism-guide {base.get('minutes_total', 0.0):.1f} "
            f"+ fine-tune {run.summary['minutes_total']:.1f}).",
        ],
        bars=cooccur_bars(m, run),
        details=_cooccur_details(m),
        use="Measuring hallucination mitigations (`vlm_focus.hallucination`) offline and on CPU against a "
        "known co-occurrence hallucination. Not a general VLM.",
        ship=True,
    )
