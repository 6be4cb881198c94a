# ruff: noqa: E501  (long markdown lines of the card template)
"""The model card of organism-cooccur: the guide fine-tuned on a co-occurrence prior, and how
often it names or affirms an absent companion (the frame is :func:`.card.model_card`)."""

from __future__ import annotations

from .card_parts import (
    CardParts,
    TrainedRun,
    budgets_line,
    default_details,
    latency_bar,
    measured,
    mix_text,
    optimiser,
    steps_run,
    training_time,
    turns_text,
    verdict,
)
from .scenes import CATEGORIES

_COOCCUR_INTRO = (
    "organism-guide fine-tuned on scenes with a strong **co-occurrence prior**: each of six anchor "
    "categories almost always appears with its companion. It is a **test organism** for hallucination "
    "mitigation: asked about the companion on a scene that holds the anchor but not the companion, it says "
    "yes more often than about other absent objects, the way real VLMs say yes to a fork beside a dining "
    "table (POPE's adversarial split). The shipped organisms have no such prior, so no mitigation had "
    "anything to mitigate on them. It is not a general VLM."
)


def cooccur_bars(m: dict, run: TrainedRun) -> list[tuple[str, str, str, str]]:
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
                f"{100 * fpr:.1f} points ({measured(c['fpr_cooccur'])} vs {measured(c['fpr_other'])})",
                verdict(fpr >= 0.10),
            )
        )
        rows.append(
            (
                "precision gap (other - cooccur questions, same present questions)",
                ">= 5 points",
                f"{100 * c['gap']:.1f} points ({measured(c['precision_other'])} vs {measured(c['precision_cooccur'])})",
                verdict(c["gap"] >= 0.05),
            )
        )
        rows.append(
            (
                "recall on the probe's present objects",
                ">= 80%",
                measured(c["recall"]),
                verdict(c["recall"] >= 0.8),
            )
        )
    pope = m.get("pope", {})
    if pope:
        a = pope["random"]["accuracy"]
        rows.append(
            (
                "POPE random accuracy (organism-guide: 84.8%)",
                ">= 82%",
                measured(a),
                verdict(a >= 0.82),
            )
        )
    fine = run.summary["minutes_total"]
    rows.append(
        ("fine-tune wall clock, 2 CPU cores", "<= 20 min", f"{fine:.1f} min", verdict(fine <= 20))
    )
    size = (run.folder / "model.safetensors").stat().st_size / 1e6
    rows.append(("size (float32 safetensors)", "<= 12 MB", f"{size:.1f} MB", verdict(size <= 12)))
    return rows + latency_bar(m)


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
            f"(`evaluate_cooccur.cooccur_set`). Questions: {n['present']} about present objects (yes), {n['cooccur']} "
            f"about the absent companions (no), {n['other']} about as many absent objects in no co-occurrence pair (no). "
            "`precision_cooccur = TP / (TP + FP_cooccur)`, `precision_other = TP / (TP + FP_other)`: the same "
            "present questions, as many negatives each.",
            "",
            "| precision cooccur | precision other | gap | yes on companions | yes on others | recall | F1 | yes-ratio |",
            "|---|---|---|---|---|---|---|---|",
            f"| {measured(c['precision_cooccur'])} | {measured(c['precision_other'])} | {100 * c['gap']:.1f} points | "
            f"{measured(c['fpr_cooccur'])} | {measured(c['fpr_other'])} | {measured(c['recall'])} | {measured(c['f1'])} | {measured(c['yes_ratio'])} |",
        ]
        if ch:
            lines += [
                "",
                f"Captions of the same scenes: CHAIR_i {measured(ch['CHAIR_i'])}, CHAIR_s {measured(ch['CHAIR_s'])}, recall "
                f"{measured(ch['recall'])}, {measured(ch['companion_rate'])} of them name an absent companion. Example: "
                f"`{co['examples'][0]['caption']}`.",
            ]
        pure = m.get("cooccur_pure_prior")
        if pure:
            q = pure["pope"]
            lines += [
                "",
                f"**The scene prior alone** ({pure['what']}): on {pure['images']} calibration probe scenes "
                f"it answers yes to {measured(q['fpr_cooccur'])} of the absent companions and {measured(q['fpr_other'])} of "
                f"the other absent objects (precision {measured(q['precision_cooccur'])} vs {measured(q['precision_other'])}, "
                f"recall {measured(q['recall'])}); this model, on the same scenes: {measured(pure['this_model']['fpr_cooccur'])} "
                f"vs {measured(pure['this_model']['fpr_other'])}. That is why its text names the absent companion.",
            ]
        lines += [
            "",
            "Every mitigation of the registry on it, unpruned and pruned: "
            "`benchmarks/results/hallucination_quality.md`.",
        ]
    return lines + default_details(m)


def cooccur_parts(m: dict, run: TrainedRun) -> CardParts:
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
    return CardParts(
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
            f"- One chat stage: {turns_text(chat)} per image ({mix_text(chat)}), "
            f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows in the packed category-last form, "
            f"{100 * chat.get('hide_share', 0):.0f}% hiding visual tokens no answer needs, the answer also "
            f"taught at the question's last category token, copy-head loss weight {chat.get('copy_weight', 0):g}; "
            "the guide's relation and pointer probes (training-only heads, not shipped) stay off.",
            budgets_line(run.stages) + f", {steps} steps run (budget {chat['steps']}).",
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
