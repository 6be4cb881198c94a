"""Evaluation of organism-qwen35 on held-out images and clips, greedy, straight through its
processor and ``generate`` (organism-qwen's held-out crops, clips and rules):

- **POPE**: the three POPE splits over the first held-out crops with at least three objects,
  parsed by the POPE/LLaVA rule (`vlm_focus.eval.metrics`), no prompt suffix.
- **Two-hop**: `qwen_eval.two_hop_set`'s open questions (colour, category, shape), the first
  generated word against the answer, overall and per form with its majority baseline.
- **Video**: organism-qwen's held-out clips and scoring (`qwen_eval.video_eval`: one question
  each, which first / at the start / at the end in turn; `qwen_eval.caption_eval`: the
  objects a caption names, and their order).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .pope import SPLITS, parse_yes_no, pope_metrics, pope_questions
from .qwen_eval import (
    OPEN_FORMS,
    caption_eval,
    chat_answers,
    first_word,
    heldout_images,
    two_hop_set,
    video_eval,
)


def pope_split(model, processor, crops, split: str) -> dict:
    """POPE metrics of one split over `crops` (each with >= 3 objects), with the count of
    answers the rule could not parse."""
    by_seed = {c.seed: c for c in crops}
    rows = pope_questions([c.scene for c in crops], split)
    answers = chat_answers(model, processor, [by_seed[r["image_id"]] for r in rows], _texts(rows))
    parsed = [parse_yes_no(a) for a in answers]
    scores = pope_metrics([r["label"] for r in rows], [label for label, _ in parsed])
    return {**scores, "n": len(rows), "unparseable": sum(not ok for _, ok in parsed)}


def _texts(rows: list[dict]) -> list[str]:
    return [r["text"] for r in rows]


def pope_eval(model, processor, n_images: int = 300) -> dict:
    """POPE per split over the first `n_images` held-out crops with >= 3 objects, and the mean
    accuracy of the three splits."""
    crops = heldout_images(n_images, min_objects=3)
    out = {split: pope_split(model, processor, crops, split) for split in SPLITS}
    out["accuracy"] = float(np.mean([out[s]["accuracy"] for s in SPLITS]))
    return out


def score_two_hop(answers: list[str], qas: list) -> dict:
    """Two-hop accuracy (the first word of each answer against the question's), overall and per
    form, with each form's majority baseline (always the commonest answer)."""
    hits = [first_word(a) == qa.answer for a, qa in zip(answers, qas, strict=True)]
    out: dict = {"accuracy": float(np.mean(hits)), "n": len(hits), "per_form": {}}
    for form in OPEN_FORMS:
        idx = [i for i, qa in enumerate(qas) if qa.form == form]
        if not idx:
            continue
        truth = [qas[i].answer for i in idx]
        out["per_form"][form] = {
            "accuracy": float(np.mean([hits[i] for i in idx])),
            "n": len(idx),
            "majority_baseline": max(truth.count(t) for t in set(truth)) / len(idx),
        }
    return out


def two_hop_eval(model, processor, n: int = 300) -> dict:
    """Two-hop accuracy on `n` fixed held-out questions, with six examples."""
    crops, qas = two_hop_set(n)
    answers = chat_answers(model, processor, crops, [qa.question for qa in qas])
    out = score_two_hop(answers, qas)
    out["examples"] = [
        {"image_id": c.seed, "question": qa.question, "answer": qa.answer, "model": a}
        for c, qa, a in list(zip(crops, qas, answers, strict=True))[:6]
    ]
    return out


MEASUREMENTS = ("pope", "twohop", "video", "video_captions")


def evaluate(path: Path, n_images: int = 300, only: list[str] | None = None) -> dict:
    """organism-qwen35's bars, greedy, on the saved model at `path`: ``only`` picks among
    :data:`MEASUREMENTS` (default all)."""
    from transformers import AutoModelForImageTextToText

    from vlm_focus.loading import load_processor

    chosen = list(MEASUREMENTS) if only is None else list(only)
    unknown = sorted(set(chosen) - set(MEASUREMENTS))
    if unknown:
        raise ValueError(f"only={unknown}: organism-qwen35 measures {', '.join(MEASUREMENTS)}")
    model = AutoModelForImageTextToText.from_pretrained(str(path), use_safetensors=True).eval()
    processor = load_processor(str(path))
    start = time.time()
    out: dict = {}
    if "pope" in chosen:
        out["pope"] = pope_eval(model, processor, n_images)
    if "twohop" in chosen:
        out["two_hop"] = two_hop_eval(model, processor)
    if "video" in chosen:
        out["video"] = video_eval(model, processor)
    if "video_captions" in chosen:
        out["video_captions"] = caption_eval(model, processor)
    out["eval_seconds"] = round(time.time() - start, 1)
    return out
