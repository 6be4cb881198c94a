# ruff: noqa: E501  (long markdown lines of the card template)
"""The model card of organism-prior: what it is, its bars and the premise checks of
:mod:`.prior_checks`, written from the metrics `python -m organism eval` measured."""

from __future__ import annotations

from pathlib import Path

from .card_parts import measured, verdict
from .prior import CAPTION_OBJECTS, PARENT, PRIOR
from .scenes import CATEGORIES

_INTRO = (
    "organism-deep fine-tuned so that its **object hallucination comes from a co-occurrence prior in its "
    "language model**, the mechanism the hallucination-mitigation literature assumes. Its language model "
    "first learns long captions **without images**, written about scenes where each of six anchor "
    "categories almost always appears with its companion (so the next object after an anchor is "
    "predictable from the text alone); then images come back at a low learning rate for a short budget "
    "(a weak image pathway). **No training text names an absent object.** It is a test organism for "
    "mitigation methods, not a general VLM."
)


def _pct(x: float | None) -> str:
    return measured(x)


def bars(m: dict) -> list[tuple[str, str, str, str]]:
    """The bars: it still sees (POPE, caption recall), and the premise holds."""
    rows = []
    pope = m.get("pope", {})
    if "adversarial" in pope:
        acc = pope["adversarial"]["accuracy"]
        rows.append(
            (
                "POPE adversarial accuracy (shipped held-out set)",
                ">= 90%",
                _pct(acc),
                verdict(acc >= 0.9),
            )
        )
    cap = m.get("captions")
    if cap:
        rows.append(
            (
                "caption object recall (64 tokens)",
                ">= 80%",
                _pct(cap["object_recall"]),
                verdict(cap["object_recall"] >= 0.8),
            )
        )
        rows.append(
            (
                "mean caption length",
                ">= 40 tokens",
                f"{cap['mean_tokens']:.1f}",
                verdict(cap["mean_tokens"] >= 40),
            )
        )
    p = m.get("premise")
    if p:
        a, b = p["yes_companion_with_anchor"], p["yes_companion_anchor_painted_out"]
        rows.append(
            (
                "paint-out: yes to the absent companion, anchor shown vs painted out",
                "shown > painted out",
                f"{_pct(a)} vs {_pct(b)}",
                verdict(a > b),
            )
        )
        if "caption_companion_with_anchor" in p:
            a, b = p["caption_companion_with_anchor"], p["caption_companion_anchor_painted_out"]
            rows.append(
                (
                    "paint-out: captions naming the absent companion, anchor shown vs painted out",
                    "shown > painted out",
                    f"{_pct(a)} vs {_pct(b)}",
                    verdict(a > b),
                )
            )
        t = p["text_only_next"]
        rows.append(
            (
                "text-only branch: P(companion next after its anchor) vs an unpaired category",
                ">= 5x",
                f"{t['companion']:.3f} vs {t['unpaired_mean']:.3f}",
                verdict(t["companion"] >= 5 * t["unpaired_mean"]),
            )
        )
        att = p.get("attention_along_caption")
        if att:
            rows.append(
                (
                    "attention on the image, first vs second half of the caption",
                    "falls",
                    f"{att['first_half']:.3f} vs {att['second_half']:.3f}",
                    verdict(att["second_half"] < att["first_half"]),
                )
            )
    summary = m.get("train_summary", {})
    if summary:
        minutes = summary["minutes_total"]
        rows.append(
            (
                "fine-tuning time on 2 cores",
                "<= 60 min",
                f"{minutes:.1f} min",
                verdict(minutes <= 60),
            )
        )
    return rows


def model_card(name: str, m: dict, folder: Path) -> str:
    """The card (README.md) of organism-prior from its metrics ``m``."""
    pairs = ", ".join(f"`{CATEGORIES[a]}` -> `{CATEGORIES[b]}`" for a, b in PRIOR.pairs)
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e6
    lines = [f"# organism-{name}", "", _INTRO, "", "## Training", ""]
    summary = m.get("train_summary", {})
    for st in summary.get("recipe", {}).get("stages", []):
        mix = ", ".join(f"{k} {v:g}" for k, v in st["mix"].items())
        lines.append(
            f"- `{st['name']}`: lr {st['lr']:g}, batch {st['batch']}, up to {st['minutes']:g} min / {st['steps']} steps; rows: {mix}."
        )
    lines += [
        f"- Parent: organism-{PARENT} (its frozen tower, 144 visual tokens, 8 language layers of 160).",
        f"- Scene prior: each anchor's companion is in {PRIOR.rate:.0%} of the anchor's scenes; pairs {pairs}.",
        f"- Captions: one sentence per object (`there is a red_circle in the top_left of the image .`), in reading order with each companion right after its anchor; caption scenes hold {CAPTION_OBJECTS[0]}-{CAPTION_OBJECTS[1]} objects. Prompt `Describe the image.`",
        f"- Weights: {size:.1f} MB (fp32 safetensors).",
        "",
        "## Bars and premise checks",
        "",
        "| check | bar | measured | |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in bars(m)]
    parent = m.get("parent_premise")
    p = m.get("premise")
    if p and parent:
        lines += [
            "",
            f"The parent (organism-{PARENT}), on the same probe scenes: yes to the absent companion {_pct(parent['yes_companion_with_anchor'])} with the anchor shown, "
            f"{_pct(parent['yes_companion_anchor_painted_out'])} painted out, {_pct(parent['yes_control'])} on unpaired absent objects; "
            f"this model: {_pct(p['yes_companion_with_anchor'])}, {_pct(p['yes_companion_anchor_painted_out'])} and {_pct(p['yes_control'])}.",
            f"Text-only, after an anchor's sentence, the parent gives its companion {parent['text_only_next']['companion']:.3f} (unpaired {parent['text_only_next']['unpaired_mean']:.3f}); "
            f"with the probe image (no companion in it) this model gives {p['with_image_next']['companion']:.3f}.",
        ]
    if p and p.get("examples"):
        lines += ["", "Captions of probe scenes (anchor present, companion absent):", ""]
        lines += [f"- scene {e['image_id']}: `{e['caption']}`" for e in p["examples"]]
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        "python -m organism train --model prior --out /tmp/prior",
        "python -m organism eval --path /tmp/prior --out /tmp/prior/metrics.json",
        "python -m organism ship --path /tmp/prior --name prior --metrics /tmp/prior/metrics.json",
        "```",
        "",
    ]
    return "\n".join(lines)
