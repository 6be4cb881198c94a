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

:func:`evaluate` answers a list of such rows under one run setting through the evaluations'
:class:`~vlm_focus.eval.generation.Generator`, parses each answer by the POPE/LLaVA rule and
scores every split (:func:`summarise`); ``vlm-focus eval pope`` calls it batch by batch and
appends each answer to a resumable JSONL log (see :mod:`vlm_focus.eval.runner`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from .metrics import PARSE_RULE, parse_yes_no, pope_metrics

if TYPE_CHECKING:
    import torch

    from ..setting import RunSetting

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


def answer_scores(records: list[dict]) -> dict[str, Any]:
    """What the answers of POPE records alone decide: the metrics of their labels and
    predictions (:func:`~vlm_focus.eval.metrics.pope_metrics`) and the unparseable count."""
    out: dict[str, Any] = pope_metrics([r["label"] for r in records], [r["pred"] for r in records])
    out["unparseable"] = sum(not r["parseable"] for r in records)
    return out


def summarise(records: list[dict]) -> dict[str, Any]:
    """:func:`answer_scores` of answered POPE records, plus the mean visual tokens kept and in
    total, the prefill time per question and the tokens/s of decoding."""
    out = answer_scores(records)
    n = max(len(records), 1)
    out["visual_kept"] = sum(r["visual_kept"] for r in records) / n
    out["visual_total"] = sum(r["visual_total"] for r in records) / n
    out["prefill_ms"] = 1e3 * sum(r["prefill_s"] for r in records) / n
    seconds = sum(r["generate_s"] for r in records)
    out["tokens_per_s"] = sum(r["new_tokens"] for r in records) / seconds if seconds else 0.0
    return out


def running_metric(records: list[dict]) -> str:
    """Progress-bar text: running accuracy and F1."""
    m = pope_metrics([r["label"] for r in records], [r["pred"] for r in records])
    return f"acc={m['accuracy']:.3f} f1={m['f1']:.3f}"


#: The split of :attr:`PopeResult.metrics` that rows without a ``split`` count under.
NO_SPLIT = "all"


@dataclass
class PopeResult:
    """POPE answers under one run setting, and their scores.

    ``records``: one per question, in question order: ``question_id``, ``image``, ``question``,
    ``label`` (and ``split`` when the row has one), ``answer``, ``pred`` (the POPE/LLaVA rule's
    ``yes``/``no``), ``parseable``, then the :class:`~vlm_focus.eval.generation.Generator`'s
    facts: ``visual_kept``, ``visual_total``, ``new_tokens``, ``prefill_s`` and ``generate_s``
    (the batch's seconds shared evenly over its rows), and the zoom's with one.
    ``metrics``: per split (:data:`NO_SPLIT` for rows without one), :func:`summarise` of its
    records: accuracy, precision, recall, F1, predicted yes-ratio, unparseable, mean visual
    tokens kept/total, prefill ms per question, tokens/s.
    """

    records: list[dict[str, Any]]
    metrics: dict[str, dict[str, Any]]
    setting: dict[str, Any] = field(default_factory=dict)
    suffix: str = LLAVA_SUFFIX
    parse_rule: str = PARSE_RULE

    def scores(self, split: str = NO_SPLIT) -> dict[str, Any]:
        """:func:`answer_scores` of one split: its metrics without the token counts and timing
        (the same for every run that gives the same answers)."""
        if split not in self.metrics:
            raise ValueError(f"split={split!r}; this result has {', '.join(self.metrics)}")
        return answer_scores([r for r in self.records if r.get("split", NO_SPLIT) == split])


def evaluate(
    model: torch.nn.Module,
    processor: Any,
    questions: Sequence[dict],
    setting: RunSetting,
    *,
    images: str | Path | Callable[[dict], Any] | None = None,
    suffix: str = LLAVA_SUFFIX,
    batch_size: int = 8,
    guide: torch.nn.Module | None = None,
    guide_processor: Any = None,
    progress: bool | str = False,
    on_batch: Callable[[list[dict]], None] | None = None,
) -> PopeResult:
    """Answer POPE ``questions`` under ``setting``, parse each answer by the POPE/LLaVA rule and
    score every split (``yes`` positive; the yes-ratio is the share of predicted yes).

    ``questions`` are POPE rows (:func:`build_questions`, :func:`read_questions`): each needs
    ``question_id``, ``image``, ``text`` and ``label`` (``yes``/``no``), and may name its
    ``split`` (and, for a zoom, the queried ``category``). The prompt is ``text + suffix`` in
    the model's chat template; every answer comes from one
    :class:`~vlm_focus.eval.generation.Generator` (greedy, pruned, mitigated or zoomed as
    ``setting`` says; ``guide``/``guide_processor`` are the small model of a pruner that needs
    one), ``batch_size`` prompts per ``generate()`` call. Rows with the same ``image`` and
    ``text`` are answered once. ``images``: the folder the rows' ``image`` names lie in, or a
    function from a row to its image (a PIL image or a path); by default ``image`` is itself a
    path. ``progress`` shows a bar (a string is its label); ``on_batch`` receives the records
    of each finished ``generate()`` call, in question order.
    """
    from .generation import Generator  # transformers loads with the first run, not the import

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    rows = _checked(questions)
    image_of = _image_reader(images)
    generator = Generator(model, processor, setting, guide=guide, guide_processor=guide_processor)
    groups: dict[tuple[str, str], list[int]] = {}  # the rows of each distinct (image, text)
    for i, row in enumerate(rows):
        groups.setdefault((str(row["image"]), row["text"]), []).append(i)
    todo = list(groups.values())
    records: list[dict] = [{}] * len(rows)
    label = progress if isinstance(progress, str) else f"pope {setting.tag}"
    with tqdm(total=len(rows), desc=label, disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            asked = [rows[group[0]] for group in chunk]
            pictures = [image_of(r) for r in asked]
            prompts = [r["text"] + suffix for r in asked]
            if setting.zoom is not None:  # the crop follows the queried object's attention
                focus = [r.get("category") for r in asked]
                answers, facts = generator(pictures, prompts, focus=focus)
            else:
                answers, facts = generator(pictures, prompts)
            for group, answer, fact in zip(chunk, answers, facts, strict=True):
                for i in group:
                    records[i] = _record(rows[i], answer, dict(fact))
            finished = sorted(i for group in chunk for i in group)
            if on_batch is not None:
                on_batch([records[i] for i in finished])
            bar.update(len(finished))
            if progress:
                bar.set_postfix_str(running_metric([r for r in records if r]), refresh=False)
    splits: dict[str, list[dict]] = {}
    for row, record in zip(rows, records, strict=True):
        splits.setdefault(row.get("split", NO_SPLIT), []).append(record)
    return PopeResult(
        records=records,
        metrics={split: summarise(part) for split, part in splits.items()},
        setting=setting.describe(),
        suffix=suffix,
    )


def _checked(questions: Sequence[dict]) -> list[dict]:
    rows = list(questions)
    for number, row in enumerate(rows):
        if not isinstance(row, dict) or any(k not in row for k in QUESTION_FIELDS):
            raise ValueError(
                f"questions[{number}] must be a POPE row with {', '.join(QUESTION_FIELDS)}"
            )
        if row["label"] not in ("yes", "no"):
            raise ValueError(
                f"questions[{number}]: label must be 'yes' or 'no', got {row['label']!r}"
            )
    return rows


def _image_reader(images: str | Path | Callable[[dict], Any] | None) -> Callable[[dict], Any]:
    """A row's image: ``images(row)``, the row's ``image`` in the folder ``images``, or the
    row's ``image`` itself."""
    if callable(images):
        return images
    folder = None if images is None else Path(images)

    def read(row: dict) -> Any:
        return row["image"] if folder is None else folder / row["image"]

    return read


def _record(row: dict, answer: str, fact: dict) -> dict:
    """A question's record: the row's identity, the answer, its parse, the Generator's facts."""
    pred, parseable = parse_yes_no(answer)
    record = {
        "question_id": row["question_id"],
        "image": row["image"],
        "question": row["text"],
        "label": row["label"],
    }
    if "split" in row:
        record["split"] = row["split"]
    return {**record, "answer": answer, "pred": pred, "parseable": parseable, **fact}
