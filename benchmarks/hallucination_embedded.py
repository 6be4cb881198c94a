"""The second table of `hallucination_quality.py`: POPE adversarial and CHAIR on the embedded
model (organism-default), greedy, the shift at each method's recall and every method at its
defaults (``--embedded N``)."""

from __future__ import annotations

import dataclasses
import json

from paired_stats import equal_recall_shift, mcnemar

from organism import default_model_path
from organism.evaluate_cooccur import yes_no_margins
from vlm_focus.loading import load_model
from vlm_focus.setting import RunSetting


def embedded_table(args, ms: list, runs, bar) -> dict:
    """POPE adversarial and CHAIR on organism-default: greedy, the shift at each method's
    recall, and every method at its defaults (first ``args.embedded`` held-out images)."""
    from PIL import Image

    from vlm_focus.asset_paths import CAPTION_PROMPT, heldout_path
    from vlm_focus.eval.chair import (
        EMBEDDED_MAX_NEW_TOKENS,
        ObjectWords,
        chair_metrics,
        drop_unfinished,
        truth_objects,
    )
    from vlm_focus.eval.generation import Generator
    from vlm_focus.eval.metrics import pope_metrics
    from vlm_focus.eval.pope import LLAVA_SUFFIX, read_questions
    from vlm_focus.eval.pope import evaluate as evaluate_pope
    from vlm_focus.eval.scenes import generate_scene

    path = default_model_path()
    model, processor = load_model(str(path))
    rows = read_questions(heldout_path("pope_adversarial.jsonl"))
    ids = list(dict.fromkeys(r["image_id"] for r in rows))[: args.embedded]
    rows = [r for r in rows if r["image_id"] in set(ids)]
    instances = json.loads(heldout_path("instances.json").read_text())
    names = {c["id"]: c["name"] for c in instances["categories"]}
    table = ObjectWords.for_categories(names.values())
    refs: dict[int, list[str]] = {}
    for c in json.loads(heldout_path("captions.json").read_text()):
        refs.setdefault(c["image_id"], []).append(c["caption"])
    objs: dict[int, set[str]] = {i: set() for i in ids}
    for a in instances["annotations"]:
        if a["image_id"] in objs:
            objs[a["image_id"]].add(names[a["category_id"]])
    truth = {i: truth_objects(objs[i], refs.get(i, []), table) for i in ids}

    def image(row):
        return Image.fromarray(generate_scene(int(row["image_id"])).image())

    def run(mitigation: str, options: dict, margins: bool) -> dict:
        key = {
            "embedded": str(path),
            "n": len(ids),
            "mitigation": mitigation,
            "options": options,
            "margins": margins,
        }

        def compute() -> dict:
            setting = RunSetting(mitigation=mitigation, mitigation_options=options)
            pope = evaluate_pope(
                model,
                processor,
                rows,
                dataclasses.replace(setting, max_new_tokens=2),
                images=image,
                suffix=LLAVA_SUFFIX,
                batch_size=32,
            )
            records = [
                {"label": r["label"], "pred": r["pred"], "split": "all"} for r in pope.records
            ]
            if margins:
                found = yes_no_margins(model, processor, rows, image, setting, LLAVA_SUFFIX)
                for r, m in zip(records, found, strict=True):
                    r["margin"] = m
            tokens_max = EMBEDDED_MAX_NEW_TOKENS
            gen = Generator(
                model, processor, dataclasses.replace(setting, max_new_tokens=tokens_max)
            )
            caps, tokens = {}, []
            for i in range(0, len(ids), 32):
                chunk = ids[i : i + 32]
                pictures = [image({"image_id": j}) for j in chunk]
                texts, facts = gen(pictures, [CAPTION_PROMPT] * len(chunk))
                for j, text, fact in zip(chunk, texts, facts, strict=True):
                    cut = fact["new_tokens"] >= tokens_max
                    caps[j] = drop_unfinished(text) if cut else text
                    tokens.append(fact["new_tokens"])
            chair = chair_metrics(caps, truth, table)
            chair["tokens"] = sum(tokens) / max(len(tokens), 1)
            return {"pope": pope.scores(), "records": records, "chair": chair}

        out = runs.get(key, compute)
        bar.update()
        return out

    greedy = run("none", {}, True)
    labels = [r["label"] for r in greedy["records"]]
    margins = [r["margin"] for r in greedy["records"]]
    greedy_preds = [r["pred"] for r in greedy["records"]]
    out = [{"label": "greedy", **greedy["pope"], **_caption(greedy)}]
    for m in ms:
        done = run(m.mitigation, m.options(), False)
        preds = [r["pred"] for r in done["records"]]
        delta, shift_preds = equal_recall_shift(margins, labels, preds)
        shift = pope_metrics(labels, shift_preds)
        label = f"shift at {m.label}'s recall (delta = {delta:+.2f})"
        out.append({"label": label, "kind": "shift", **shift})
        out.append(
            {
                "label": m.label,
                **done["pope"],
                **_caption(done),
                "mcnemar_greedy": mcnemar(preds, greedy_preds, labels),
                "mcnemar_shift": mcnemar(preds, shift_preds, labels),
            }
        )
    return {"model": str(path), "images": len(ids), "questions": len(rows), "rows": out}


def _caption(run: dict) -> dict:
    return {f"caption_{k}": v for k, v in run["chair"].items()}
