"""POPE: question files built from any COCO-format instances file, and the yes/no run.

Question building follows POPE (Li et al., 2023) as summarised in docs/protocols.md:

- images with at least ``per_image`` annotated object categories; ``n_images`` of them (all when
  fewer, else a seeded sample), the same images and the same positives in every split;
- per image ``per_image`` positive questions (categories present, a seeded draw) and
  ``per_image`` negatives (categories absent) chosen by the split:
  ``random``: uniform over the absent categories (seeded);
  ``popular``: the most frequent categories of the dataset (images containing them), most
  frequent first, that are absent from the image;
  ``adversarial``: the absent categories that co-occur most with the image's categories
  (``score(c) = sum_{p present} #images containing both p and c``), highest first;
  ties go to the more frequent category, then the smaller category id;
- question text ``"Is there a/an {category} in the image?"`` ('an' before a vowel).

The run appends each answer to a resumable JSONL log (see :mod:`vlm_focus.eval.runner`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("random", "popular", "adversarial")
LLAVA_SUFFIX = "\nAnswer the question using a single word or phrase."
QUESTION_FIELDS = ("question_id", "image", "text", "label")


def question_text(category: str) -> str:
    """``"Is there a {category} in the image?"`` with 'an' before a vowel."""
    article = "an" if category[:1].lower() in "aeiou" else "a"
    return f"Is there {article} {category} in the image?"


def image_categories(instances: dict) -> dict[int, list[int]]:
    """Sorted category ids present in each image (images without annotations map to ``[]``)."""
    present: dict[int, set[int]] = {img["id"]: set() for img in instances["images"]}
    for ann in instances["annotations"]:
        if ann["image_id"] in present:
            present[ann["image_id"]].add(ann["category_id"])
    return {i: sorted(c) for i, c in present.items()}


def category_statistics(instances: dict) -> tuple[Counter, dict[int, Counter]]:
    """Image frequency of each category and the image co-occurrence counts of each pair."""
    present = image_categories(instances)
    freq: Counter = Counter()
    co: dict[int, Counter] = {c["id"]: Counter() for c in instances["categories"]}
    for cats in present.values():
        freq.update(cats)
        for a in cats:
            co[a].update(b for b in cats if b != a)
    return freq, co


def select_images(instances: dict, n_images: int, per_image: int, seed: int) -> list[int]:
    """Ids of the POPE images: those with >= ``per_image`` categories; a seeded sample of
    ``n_images`` when there are more, returned in id order."""
    present = image_categories(instances)
    eligible = sorted(i for i, c in present.items() if len(c) >= per_image)
    if len(eligible) > n_images:
        rng = np.random.default_rng(seed)
        eligible = sorted(int(i) for i in rng.choice(eligible, n_images, replace=False))
    return eligible


def build_questions(
    instances: dict,
    split: str,
    *,
    n_images: int = 500,
    per_image: int = 3,
    seed: int = 0,
) -> list[dict]:
    """POPE rows ``{question_id, image_id, image, text, label, category, category_id}``.

    ``question_id`` counts from 1 in image order, positives then negatives per image; the same
    ``(instances, n_images, per_image, seed)`` give the same rows in every process and run.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {', '.join(SPLITS)}")
    if per_image < 1 or n_images < 1:
        raise ValueError(f"per_image={per_image} and n_images={n_images} must be >= 1")
    names = {c["id"]: c["name"] for c in instances["categories"]}
    files = {img["id"]: img["file_name"] for img in instances["images"]}
    all_ids = sorted(names)
    present = image_categories(instances)
    freq, co = category_statistics(instances)
    popular = sorted(all_ids, key=lambda c: (-freq[c], c))
    rows: list[dict] = []
    for image_id in select_images(instances, n_images, per_image, seed):
        cats = present[image_id]
        absent = [c for c in all_ids if c not in cats]
        if len(absent) < per_image:
            raise ValueError(
                f"image {image_id} has only {len(absent)} absent categories; need {per_image}"
            )
        rng = np.random.default_rng([seed, image_id])  # same positives in every split
        positives = [int(c) for c in rng.choice(cats, per_image, replace=False)]
        if split == "random":
            pick = np.random.default_rng([seed, image_id, 1]).choice(absent, per_image, False)
            negatives = [int(c) for c in pick]
        elif split == "popular":
            negatives = [c for c in popular if c not in cats][:per_image]
        else:
            score = {c: sum(co[p][c] for p in cats) for c in absent}
            negatives = sorted(absent, key=lambda c: (-score[c], -freq[c], c))[:per_image]
        for c, label in [(c, "yes") for c in positives] + [(c, "no") for c in negatives]:
            rows.append(
                {
                    "question_id": len(rows) + 1,
                    "image_id": image_id,
                    "image": files[image_id],
                    "text": question_text(names[c]),
                    "label": label,
                    "category": names[c],
                    "category_id": c,
                }
            )
    return rows


def write_questions(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_questions(path: str | Path) -> list[dict]:
    """Rows of a POPE jsonl file (``question_id``, ``image``, ``text``, ``label`` each line);
    ``ValueError`` naming the line for a malformed file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    rows, ids = [], set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err})") from err
        if not isinstance(row, dict) or any(k not in row for k in QUESTION_FIELDS):
            raise ValueError(f"{path}:{number}: a POPE row needs {', '.join(QUESTION_FIELDS)}")
        label = str(row["label"]).strip().lower()
        if label not in ("yes", "no"):
            raise ValueError(f"{path}:{number}: label must be yes or no, got {row['label']!r}")
        if row["question_id"] in ids:
            raise ValueError(f"{path}:{number}: duplicate question_id {row['question_id']!r}")
        ids.add(row["question_id"])
        rows.append({**row, "label": label})
    if not rows:
        raise ValueError(f"{path}: no questions")
    return rows


def summarise(records: list[dict]) -> dict[str, Any]:
    """Metrics of answered POPE records (see :func:`vlm_focus.eval.metrics.pope_metrics`) plus
    the unparseable count, visual tokens kept, prefill time per question and tokens/s."""
    from .metrics import pope_metrics

    out: dict[str, Any] = pope_metrics([r["label"] for r in records], [r["pred"] for r in records])
    n = max(len(records), 1)
    out["unparseable"] = sum(not r["parseable"] for r in records)
    out["visual_kept"] = sum(r["visual_kept"] for r in records) / n
    out["visual_total"] = sum(r["visual_total"] for r in records) / n
    out["prefill_ms"] = 1e3 * sum(r["prefill_s"] for r in records) / n
    seconds = sum(r["generate_s"] for r in records)
    out["tokens_per_s"] = sum(r["new_tokens"] for r in records) / seconds if seconds else 0.0
    return out


def running_metric(records: list[dict]) -> str:
    """Progress-bar text: running accuracy and F1."""
    from .metrics import pope_metrics

    m = pope_metrics([r["label"] for r in records], [r["pred"] for r in records])
    return f"acc={m['accuracy']:.3f} f1={m['f1']:.3f}"
