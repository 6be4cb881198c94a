"""POPE question files for a generated set, built by the POPE rules.

Images with >= 3 objects; per image 3 positive questions (present categories) and 3 negative ones;
negatives are random (uniform over absent categories), popular (the most frequent categories of
the set, in order, that are absent) or adversarial (the categories that co-occur most with the
image's objects, in order, that are absent). The three splits share images and positives.
Question text: "Is there a/an {category} in the image?".
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from .scenes import CATEGORIES, Scene, heldout_scenes, write_dataset
from .vocab import presence_question

SPLITS = ("random", "popular", "adversarial")


def pope_questions(
    scenes: list[Scene], split: str, seed: int = 0, per_image: int = 3
) -> list[dict]:
    """POPE rows `{question_id, image_id, image, text, label, category}` for one split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {SPLITS}")
    eligible = [s for s in scenes if len(s.objects) >= per_image]
    freq = Counter(c for s in eligible for c in s.categories)
    popular = sorted(range(len(CATEGORIES)), key=lambda c: (-freq[c], c))
    co = np.zeros((len(CATEGORIES), len(CATEGORIES)), dtype=np.int64)
    for s in eligible:
        for a in s.categories:
            for b in s.categories:
                if a != b:
                    co[a, b] += 1
    rows: list[dict] = []
    for s in eligible:
        rng = np.random.default_rng([seed, s.seed])  # positives: same draw in every split
        present = s.categories
        positives = [int(c) for c in rng.choice(present, per_image, replace=False)]
        absent = [c for c in range(len(CATEGORIES)) if c not in present]
        if split == "random":
            negatives = [int(c) for c in np.random.default_rng([seed, s.seed, 1]).choice(
                absent, per_image, replace=False)]  # fmt: skip
        elif split == "popular":
            negatives = [c for c in popular if c not in present][:per_image]
        else:
            score = co[present].sum(0)
            ranked = sorted(absent, key=lambda c: (-score[c], -freq[c], c))
            negatives = ranked[:per_image]
        for c, label in [(c, "yes") for c in positives] + [(c, "no") for c in negatives]:
            rows.append(
                {
                    "question_id": len(rows) + 1,
                    "image_id": s.seed,
                    "image": f"scene_{s.seed}.png",
                    "text": presence_question(CATEGORIES[c]),
                    "label": label,
                    "category": CATEGORIES[c],
                }
            )
    return rows


def pope_eligible(n: int) -> list[Scene]:
    """The held-out POPE image set: the first n held-out scenes with >= 3 objects."""
    return heldout_scenes(n, min_objects=3)


def write_heldout(out_dir: Path, n: int = 500, images: bool = True) -> None:
    """Write the held-out POPE set: PNGs, instances.json, captions.json and pope_<split>.jsonl."""
    out_dir = Path(out_dir)
    scenes = pope_eligible(n)
    write_dataset(scenes, out_dir, images=images)
    for split in SPLITS:
        rows = pope_questions(scenes, split)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (out_dir / f"pope_{split}.jsonl").write_text(text)


def parse_yes_no(answer: str) -> tuple[str, bool]:
    """POPE/LLaVA rule: text before the first '.', commas dropped, split on spaces; any of
    {No, not, no} -> 'no', otherwise 'yes'. Also returns whether the answer was parseable
    (contains 'yes' or a 'no' word)."""
    words = answer.split(".")[0].replace(",", "").split()
    if any(w in ("No", "not", "no") for w in words):
        return "no", True
    return "yes", any(w.lower() == "yes" for w in words)


def pope_metrics(labels: list[str], preds: list[str]) -> dict[str, float]:
    """Accuracy, precision, recall, F1 with 'yes' positive; yes-ratio of PREDICTIONS."""
    tp = sum(p == "yes" and t == "yes" for t, p in zip(labels, preds, strict=True))
    fp = sum(p == "yes" and t == "no" for t, p in zip(labels, preds, strict=True))
    fn = sum(p == "no" and t == "yes" for t, p in zip(labels, preds, strict=True))
    n = len(labels)
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    return {
        "accuracy": sum(t == p for t, p in zip(labels, preds, strict=True)) / max(n, 1),
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / max(precision + recall, 1e-12),
        "yes_ratio": sum(p == "yes" for p in preds) / max(n, 1),
        "n": n,
    }
