# ruff: noqa: E501  (long markdown lines of the card template)
"""The model card of organism-deep and its two-hop guide: the two-hop family, the recipe that
takes a shipped tower, and the per-layer diagnostics that show where the model reads the image
again (the frame is :func:`.card.model_card`)."""

from __future__ import annotations

from .card_parts import (
    CardParts,
    TrainedRun,
    budgets_line,
    latency_bar,
    measured,
    mix_text,
    optimiser,
    pope_table,
    steps_run,
    training_time,
    verdict,
)
from .scenes import CATEGORIES, COLOURS, RELATION_MARGIN, SHAPES


def deep_bars(m: dict) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows of the deep model's two-hop quality bars."""
    rows = []
    t = m.get("twohop")
    if t:
        rows.append(
            (
                "two-hop accuracy, unpruned",
                ">= 90%",
                measured(t["accuracy"]),
                verdict(t["accuracy"] >= 0.9),
            )
        )
    pope = m.get("pope")
    if pope:
        low = min(pope[s]["accuracy"] for s in ("random", "popular", "adversarial"))
        text = " / ".join(
            measured(pope[s]["accuracy"]) for s in ("random", "popular", "adversarial")
        )
        rows.append(
            (
                "presence POPE accuracy (random / popular / adversarial)",
                ">= 95% each",
                text,
                verdict(low >= 0.95),
            )
        )
    p = m.get("twohop_pruning")
    if p:
        r, f = p["random_layer2_retention"], p["fastv_layer2_retention"]
        rows.append(
            (
                "K = 2, keep 0.11: random retention of two-hop accuracy",
                "<= 85%",
                measured(r),
                verdict(r <= 0.85),
            )
        )
        rows.append(
            (
                "K = 2, keep 0.11: fastv retention of two-hop accuracy",
                ">= 95%",
                measured(f),
                verdict(f >= 0.95),
            )
        )
    return rows + latency_bar(m)


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


def deep_parts(name: str, m: dict, run: TrainedRun) -> CardParts:
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
        verdict(total <= budget),
    )
    bars = [*deep_bars(m), wall]
    if name == "twohop-guide":
        size = (run.folder / "model.safetensors").stat().st_size / 1e6
        bars.append(
            ("size (float32 safetensors)", "<= 10 MB", f"{size:.1f} MB", verdict(size <= 10))
        )
    return CardParts(
        intro=_TWOHOP_GUIDE_INTRO if name == "twohop-guide" else _DEEP_INTRO,
        vocabulary="(word level; every category, position, colour and shape is one token). float32 safetensors.",
        chat=".",
        data=[
            f"- The same scenes as the other organisms: 192 x 192, 1-5 non-overlapping objects, {len(COLOURS)} colours x "
            f"{len(SHAPES)} shapes = {len(CATEGORIES)} categories, exact masks and boxes; training seeds >= 10,000,000, "
            "held-out seeds from 9,000,000.",
            "- **Two-hop family** (`organism.questions.two_hop_qa`): a question names an *anchor* object and a "
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
            f"2. Category-last curriculum, 6-8 packed questions per image ({mix_text(stages['cat_last'])}); the answer follows the question.",
            f"3. Standard chat template, one turn per image ({mix_text(chat)}); "
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
            f"{budgets_line(_trained(stages, run))}. {optimiser(run.summary)} Layers are counted from 0: pruning at K = 2 prunes "
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


def _tower_step(run: TrainedRun) -> str:
    """Recipe step 1: the tower's dense pretraining, or the shipped tower it was taken from."""
    source = run.summary.get("recipe", {}).get("tower_from")
    if not source:
        return "1. Dense vision pretraining of the tower (as for the other organisms), then frozen."
    minutes = run.summary["seconds"]["vision"] / 60
    return (
        f"1. The trained tower of organism-{source} (its dense vision pretraining, {minutes:.1f} "
        "minutes, counted in the training time below), frozen."
    )


def _trained(stages: dict, run: TrainedRun) -> dict:
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
                f"| {form} | {r['n']} | {measured(r['accuracy'])} | {measured(r['majority_baseline'])} |"
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
                f"| {split} | {r['n']} | {measured(r['accuracy'])} | {measured(r['precision'])} | {measured(r['recall'])} | "
                f"{measured(r['f1'])} | {measured(r['yes_ratio'])} |"
            )
    if m.get("pope"):
        lines += pope_table(m["pope"], "Presence POPE")
    if m.get("where"):
        w = m["where"]
        lines += [
            "",
            f"Where ({w['n']} questions): accuracy {measured(w['accuracy'])} (commonest position: {measured(w['majority_baseline'])}).",
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
            f"Uniform attention over the image would give the hop-2 object {measured(d['target_patch_share'])} of it.",
            "",
            "| layer | logit lens | hop-2 mass (head mean) | hop-2 mass (best head) | hop-2 share of image attention | anchor mass (head mean) |",
            "|---|---|---|---|---|---|",
        ]
        for r in d["per_layer"]:
            lines.append(
                f"| {r['layer']} | {measured(r['logit_lens_accuracy'])} | {measured(r['target_mass_head_mean'])} | "
                f"{measured(r['target_mass_best_head'])} (head {r['best_head']}) | "
                f"{measured(r['target_share_of_image_mass'])} | {measured(r['anchor_mass_head_mean'])} |"
            )
    lens = m.get("logit_lens")
    if lens and "presence" in lens:
        lines += [
            "",
            "Presence, for contrast (logit lens at the last prompt token, yes vs no): "
            + ", ".join(f"layer {r['layer']} {measured(r['accuracy'])}" for r in lens["presence"])
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
                f"| {k} | {measured(p[f'fastv_layer{k}_accuracy'])} ({measured(p[f'fastv_layer{k}_retention'])} kept) | "
                f"{measured(p[f'random_layer{k}_accuracy'])} ({measured(p[f'random_layer{k}_retention'])} kept) |"
            )
        lines += [
            "",
            f"Unpruned: {measured(p['full_accuracy'])}. Every pruner at K = 2 and K = 4: "
            "`benchmarks/results/pruner_quality_deep_layer2.md` and `..._layer4.md`.",
        ]
    return lines
