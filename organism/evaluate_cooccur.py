"""The co-occurrence prior's measurements (organism-cooccur): how often a model names or affirms
an anchor's absent companion, in POPE questions and in captions.
"""

from __future__ import annotations

import dataclasses

from vlm_focus.eval.pope import evaluate as evaluate_pope
from vlm_focus.setting import RunSetting

from .answering import ANSWER_TOKENS, BATCH, QUESTION_SEED, picture
from .scenes import CATEGORIES, Scene
from .vocab import CAPTION_PROMPT

#: Probe scenes per set: calibration scenes choose settings, held-out scenes are reported.
COOCCUR_IMAGES = 200
#: New tokens per caption at most (the last unfinished sentence of a longer one is dropped).
CAPTION_TOKENS = 64


def cooccur_set(n: int = COOCCUR_IMAGES, calibration: bool = False, prior=None):
    """(scenes, POPE rows) of the co-occurrence probe: ``n`` scenes holding an anchor without its
    companion (`scenes.cooccur_probe_scenes`, from the held-out or calibration seeds) and their
    present / cooccur / other questions (`data.cooccur_pope_rows`)."""
    from .questions import cooccur_pope_rows
    from .scenes import (
        COOCCUR_CALIBRATION_SEED_BASE,
        COOCCUR_HELDOUT_SEED_BASE,
        CooccurPrior,
        cooccur_probe_scenes,
    )

    prior = prior or CooccurPrior()
    first = COOCCUR_CALIBRATION_SEED_BASE if calibration else COOCCUR_HELDOUT_SEED_BASE
    scenes = cooccur_probe_scenes(first, n, prior)
    return scenes, cooccur_pope_rows(scenes, prior, seed=QUESTION_SEED)


def cooccur_scores(records: list[dict]) -> dict:
    """Scores of answered co-occurrence rows (each with ``split`` and ``pred``/``label``):

    - ``precision_cooccur`` = TP / (TP + FP on the cooccur questions) and ``precision_other`` =
      TP / (TP + FP on the other questions): the same present-object questions (TP), and as
      many absent-object questions each, so they differ only in which absent objects are asked;
    - ``gap`` = precision_other - precision_cooccur;
    - ``fpr_cooccur`` / ``fpr_other``: the share of yes on each set of absent-object questions;
    - ``recall`` (present questions), ``f1`` and ``accuracy`` over every row, and the
      ``yes_ratio`` = share of predicted yes over every row."""
    from vlm_focus.eval.metrics import pope_metrics

    by = {k: [r for r in records if r["split"] == k] for k in ("present", "cooccur", "other")}

    def scores(rows: list[dict]) -> dict:
        return pope_metrics([r["label"] for r in rows], [r["pred"] for r in rows])

    out = {k: v for k, v in scores(records).items() if k != "n"}
    for k in ("cooccur", "other"):
        out[f"precision_{k}"] = scores(by["present"] + by[k])["precision"]
        out[f"fpr_{k}"] = scores(by[k])["yes_ratio"]  # every one of them is a "no"
    out["unparseable"] = sum(not r.get("parseable", True) for r in records)
    out["n"] = {k: len(v) for k, v in by.items()}
    out["gap"] = out["precision_other"] - out["precision_cooccur"]
    return out


def cooccur_captions(scenes: list[Scene], captions: list[str], prior=None) -> dict:
    """CHAIR (`vlm_focus.eval.chair`) of captions of the probe scenes against their exact
    objects, and ``companion_rate``: the share of captions that name an absent companion of an
    anchor in the scene."""
    from vlm_focus.eval.chair import ObjectWords, chair_metrics, extract_objects

    from .scenes import CooccurPrior, unmet_companions

    prior = prior or CooccurPrior()
    table = ObjectWords.for_categories(CATEGORIES)
    caps = {s.seed: c for s, c in zip(scenes, captions, strict=True)}
    truth = {s.seed: {o.name for o in s.objects} for s in scenes}
    out = chair_metrics(caps, truth, table)
    named = 0
    for s, c in zip(scenes, captions, strict=True):
        said = set(extract_objects(c, table))
        named += any(CATEGORIES[b] in said for _, b in unmet_companions(s, prior))
    out["companion_rate"] = named / max(len(scenes), 1)
    return out


def yes_no_margins(
    model, processor, rows: list[dict], images, setting: RunSetting, suffix: str = ""
) -> list[float]:
    """Per POPE row, the logit of ``yes`` minus that of ``no`` at the first answer token of the
    greedy ``generate()`` under ``setting`` (pruned as it says; read before any mitigation's
    logits processor, so meant for the unmitigated run), batched as `evaluate_pope` batches
    (``BATCH`` rows in question order). ``images(row)`` gives a row's image; the words ``yes``
    and ``no`` are each one token of the organisms' vocabulary."""
    from transformers import LogitsProcessor

    tokenizer = getattr(processor, "tokenizer", processor)
    ids = [tokenizer(w, add_special_tokens=False).input_ids for w in ("yes", "no")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"'yes' and 'no' must be one token each, got {ids}")
    yes, no = ids[0][0], ids[1][0]

    class FirstStep(LogitsProcessor):
        """Keeps the first step's yes-minus-no logit and changes nothing."""

        def __init__(self) -> None:
            self.margin = None

        def __call__(self, input_ids, scores):
            if self.margin is None:
                self.margin = (scores[:, yes] - scores[:, no]).float().tolist()
            return scores

    setting = dataclasses.replace(setting, max_new_tokens=1)
    out: list[float] = []
    for i in range(0, len(rows), BATCH):
        chunk = rows[i : i + BATCH]
        step = FirstStep()
        setting.answer(
            model,
            processor,
            [images(r) for r in chunk],
            [r["text"] + suffix for r in chunk],
            logits_processor=[step],
        )
        out += step.margin
    return out


def cooccur_eval(
    model,
    processor,
    n: int = COOCCUR_IMAGES,
    setting: RunSetting | None = None,
    calibration: bool = False,
    captions: bool = True,
    progress: bool | str = False,
    caption_tokens: int = CAPTION_TOKENS,
    margins: bool = False,
    prior=None,
    records: bool = False,
) -> dict:
    """The co-occurrence probe under ``setting`` (default: unpruned, unmitigated): POPE scores
    (`cooccur_scores`, no prompt suffix, greedy); with ``records`` or ``margins``, each
    question's record (``question_id``, ``split``, ``label``, ``pred``, ``parseable``; with
    ``margins`` also its `yes_no_margins` ``margin``, for the unmitigated run); with
    ``captions``, CHAIR of the captions (`cooccur_captions`) under the same pruning and
    mitigation: ``caption_tokens`` new tokens at most, the last unfinished sentence dropped from
    a caption that reached the limit (CHAIR's protocol for short captions), ``tokens`` the mean
    new tokens generated."""
    from vlm_focus.eval.chair import drop_unfinished
    from vlm_focus.eval.generation import Generator

    setting = setting or RunSetting()
    scenes, rows = cooccur_set(n, calibration, prior)
    by_seed = {s.seed: s for s in scenes}

    def image(row):
        return picture(by_seed[row["image_id"]])

    result = evaluate_pope(
        model,
        processor,
        rows,
        dataclasses.replace(setting, max_new_tokens=ANSWER_TOKENS),
        images=image,
        suffix="",
        batch_size=BATCH,
        progress=progress,
    )
    answered = [
        {"question_id": row["question_id"], "split": row["split"], "label": row["label"]}
        | {"pred": record["pred"], "parseable": record["parseable"]}
        for row, record in zip(rows, result.records, strict=True)
    ]
    if margins:
        found = yes_no_margins(model, processor, rows, image, setting)
        for record, m in zip(answered, found, strict=True):
            record["margin"] = m
    out = {"pope": cooccur_scores(answered), "setting": setting.describe(), "images": n}
    if records or margins:
        out["records"] = answered
    if captions:
        generator = Generator(
            model, processor, dataclasses.replace(setting, max_new_tokens=caption_tokens)
        )
        caps, tokens = [], []
        for i in range(0, len(scenes), BATCH):
            chunk = scenes[i : i + BATCH]
            texts, facts = generator([picture(s) for s in chunk], [CAPTION_PROMPT] * len(chunk))
            for text, fact in zip(texts, facts, strict=True):
                cut = fact["new_tokens"] >= caption_tokens
                caps.append(drop_unfinished(text) if cut else text)
                tokens.append(fact["new_tokens"])
        out["chair"] = cooccur_captions(scenes, caps, prior)
        out["chair"]["tokens"] = sum(tokens) / max(len(tokens), 1)
        out["examples"] = [{"image_id": s.seed, "caption": c} for s, c in zip(scenes[:3], caps)]
    return out
