"""Is the grounded object there at all? Candidate presence signals on the embedded organisms:
the threshold chosen on calibration scenes, AUROC and accuracy on held-out ones.

Every query runs ``vf.ground(model, processor, image, category)`` (the shipped call, default
layers) on a scene; half the queries name a present object, half an absent one (a third hard,
a third companion, a third random, as in ``grounding_quality.py``). Candidates, each read from
that one call:

* ``P(yes)``: the model's own answer to the presence question, ``Grounding.presence``;
* VAS: the attention the phrase's tokens put on the image (``map.mass + map.other``);
* MTLA: the share of the map inside its best box (``box_share`` of ``boxes(map)[0]``);
* peak ratio: the map's largest cell over its mean cell.

The signal with the best calibration AUROC is the presence score; its threshold is the one
that maximises balanced accuracy on the calibration queries (the middle one of a tie). Phrases
the tokenizer cannot spell are reported apart (they should all come out absent).

    python benchmarks/grounding_presence.py                  # organism-default, -deep, -guide
    python benchmarks/grounding_presence.py --calibration 60 --images 100 --threads 1
    python benchmarks/grounding_presence.py --smoke          # tiny random model: runs, no meaning
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
from grounding_layers import (
    calibration_scenes,
    load_organisms,
    organism_parser,
    run_header,
)
from grounding_quality import CALIBRATION_SEED_BASE, _progress, grounding_queries, present_vs_absent
from PIL import Image

import vlm_focus as vf
from organism.scenes import CATEGORIES, heldout_scenes
from vlm_focus import grounding as G

SIGNALS = ("P(yes)", "VAS", "MTLA top box", "peak ratio")
#: Phrases the organisms' word-level tokenizers do not know (they encode to the unknown token).
UNKNOWN = ("elephant", "dog", "person", "red circle", "pink_circle")


def signals(found) -> dict[str, float]:
    heat = found.map
    top = G.boxes(heat, max_boxes=1)
    grid = heat.grid.double()
    return {
        "P(yes)": found.presence,
        "VAS": heat.mass + heat.other,
        "MTLA top box": G.box_share(heat, top[0]) if top else 0.0,
        "peak ratio": float(grid.max() / grid.mean().clamp(min=1e-30)),
    }


def run(model, processor, scenes, desc: str) -> list[dict]:
    rows = []
    for scene, category, present in _progress(grounding_queries(scenes), desc):
        picture = Image.fromarray(scene.image())
        found = vf.ground(model, processor, picture, CATEGORIES[category])
        rows.append({"present": present, "seed": scene.seed, **signals(found)})
    return rows


def choose_threshold(positive: list[float], negative: list[float]) -> float:
    """The threshold ``t`` (present when ``score > t``) that maximises balanced accuracy
    ``(TPR + TNR) / 2``, among midpoints between consecutive distinct scores; the middle one of
    a tie."""
    values = np.unique(np.concatenate([positive, negative]))
    cuts = (values[:-1] + values[1:]) / 2 if values.size > 1 else values
    pos, neg = np.asarray(positive), np.asarray(negative)
    balanced = np.array([((pos > t).mean() + (neg <= t).mean()) / 2 for t in cuts])
    best = np.flatnonzero(balanced == balanced.max())
    return float(cuts[best[len(best) // 2]])


def rates(positive: list[float], negative: list[float], t: float) -> dict[str, float]:
    pos, neg = np.asarray(positive), np.asarray(negative)
    tpr, fpr = float((pos > t).mean()), float((neg > t).mean())
    correct = (pos > t).sum() + (neg <= t).sum()
    return {"tpr": tpr, "fpr": fpr, "accuracy": float(correct / (pos.size + neg.size))}


def measure(name: str, model, processor, args) -> dict:
    cal = run(model, processor, calibration_scenes(args.calibration), f"{name} calibration")
    held = run(model, processor, heldout_scenes(args.images), f"{name} held-out")
    out: dict = {"model": name, "n_calibration": len(cal), "n_heldout": len(held), "signals": {}}
    for signal in SIGNALS:
        split = {
            part: (
                [r[signal] for r in rows if r["present"]],
                [r[signal] for r in rows if not r["present"]],
            )
            for part, rows in (("calibration", cal), ("heldout", held))
        }
        t = choose_threshold(*split["calibration"])
        out["signals"][signal] = {
            "calibration_auroc": present_vs_absent(*split["calibration"]),
            "heldout_auroc": present_vs_absent(*split["heldout"]),
            "threshold": t,
            "calibration": rates(*split["calibration"], t),
            "heldout": rates(*split["heldout"], t),
        }
    chosen = max(SIGNALS, key=lambda s: out["signals"][s]["calibration_auroc"])
    out["chosen"] = chosen
    out["stored_threshold"] = G.presence_threshold(model)
    held_yes = (
        [r["P(yes)"] for r in held if r["present"]],
        [r["P(yes)"] for r in held if not r["present"]],
    )
    out["heldout_at_stored"] = rates(*held_yes, out["stored_threshold"])
    out["heldout_at_half"] = rates(*held_yes, 0.5)
    scene = heldout_scenes(1)[0]
    picture = Image.fromarray(scene.image())
    tok = processor.tokenizer
    unknown = {}
    for phrase in UNKNOWN:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = vf.ground(model, processor, picture, phrase)
        tokens = tok.convert_ids_to_tokens(tok.encode(phrase, add_special_tokens=False))
        unknown[phrase] = {"presence": found.presence, "present": found.present, "tokens": tokens}
    out["unknown_scene"] = {
        "seed": scene.seed,
        "objects": [CATEGORIES[c] for c in scene.categories],
    }
    out["unknown_phrases"] = unknown
    return out


def write_report(report: dict, out: Path) -> None:
    lines = [
        "# Presence: is the grounded object in the image at all?",
        "",
        f"Machine: {report['machine']}. torch {report['torch']}, transformers "
        f"{report['transformers']}. Run took {report['seconds']:.0f} s.",
        "",
        f"Command: `{report['command']}`",
        "",
        "Each query is one `vf.ground(model, processor, image, category)` call (default "
        "layers, prompt `Is there a {category} in the image?`): every present object of a "
        "scene and as many absent categories (hard / companion / random). Calibration: "
        f"{report['calibration']} scenes with >= 2 objects, seeds from {CALIBRATION_SEED_BASE}; "
        f"held-out: the first {report['images']} held-out scenes (seeds from 9000000). The "
        "threshold (present when score > t) maximises balanced accuracy on calibration; "
        "accuracy, TPR and FPR are then measured on held-out at that threshold. The signal "
        "with the best calibration AUROC is the presence score.",
        "",
        "| model | signal | AUROC calibration | AUROC held-out | threshold | held-out accuracy "
        "| held-out TPR | held-out FPR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in report["models"]:
        for signal, v in m["signals"].items():
            mark = " (chosen)" if signal == m["chosen"] else ""
            h = v["heldout"]
            lines.append(
                f"| {m['model']} ({m['n_calibration']} / {m['n_heldout']} queries) | "
                f"{signal}{mark} | {v['calibration_auroc']:.4f} | {v['heldout_auroc']:.4f} | "
                f"{v['threshold']:.4g} | {h['accuracy']:.3f} | {h['tpr']:.3f} | {h['fpr']:.3f} |"
            )
    lines += [
        "",
        "## The shipped threshold (config.json `vlm_focus_grounding.presence_threshold`)",
        "",
        "| model | stored threshold | held-out accuracy | TPR | FPR | at 0.5: accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for m in report["models"]:
        s, half = m["heldout_at_stored"], m["heldout_at_half"]
        lines.append(
            f"| {m['model']} | {m['stored_threshold']:.4g} | {s['accuracy']:.3f} | "
            f"{s['tpr']:.3f} | {s['fpr']:.3f} | {half['accuracy']:.3f} |"
        )
    scene = report["models"][0]["unknown_scene"]
    lines += [
        "",
        "## Phrases outside the scenes' vocabulary",
        "",
        f"Held-out scene {scene['seed']} ({', '.join(scene['objects'])}). Each cell: the "
        "presence score, the verdict and the tokens the phrase encodes to; a phrase holding the "
        "unknown token scores 0 (the model never read it).",
        "",
        "| model | " + " | ".join(f"`{p}`" for p in UNKNOWN) + " |",
        "|---|" + "---|" * len(UNKNOWN),
    ]
    for m in report["models"]:
        cells = [
            f"{v['presence']:.3f} {'present' if v['present'] else 'absent'} "
            f"({' '.join(v['tokens'])})"
            for v in m["unknown_phrases"].values()
        ]
        lines.append(f"| {m['model']} | " + " | ".join(cells) + " |")
    for m in report["models"]:
        said_yes = [
            f"`{p}`"
            for p, v in m["unknown_phrases"].items()
            if v["present"] and "<unk>" not in " ".join(v["tokens"])
        ]
        if said_yes:
            lines += [
                "",
                f"{m['model']} spells {', '.join(said_yes)} with words it knows and answers yes "
                "although the scene holds no such object: the presence score is the model's "
                "own answer, as good as the model is on the question asked.",
            ]
    lines.append("")
    (out / "grounding_presence.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = organism_parser(__doc__)
    args = parser.parse_args(argv)
    start = time.time()
    loaded, out = load_organisms(parser, args, "grounding_presence")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", G.UnseenRegionWarning)  # square scenes: never raised
        results = [measure(name, m, p, args) for name, (m, p) in loaded.items()]
    report = {
        **run_header("grounding_presence", argv, start),
        "calibration": args.calibration,
        "images": args.images,
        "models": results,
    }
    write_report(report, out)
    (out / "grounding_presence.json").write_text(json.dumps(report, indent=1))
    print((out / "grounding_presence.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
