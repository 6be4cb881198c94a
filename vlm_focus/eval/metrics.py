"""Metric functions: POPE yes/no parsing and scores, AUROC, pointing game, COCO box AP.

The POPE parsing rule and the metric definitions follow the POPE/LLaVA evaluation (see
docs/protocols.md): yes is the positive class and the yes-ratio is the share of PREDICTED
yes (not of labels).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

NO_WORDS = ("No", "not", "no")
PARSE_RULE = (
    "text before the first '.', commas dropped, split on spaces; any word in {No, not, no} -> "
    "'no', otherwise 'yes'; an answer with neither a yes nor a no word is also counted as "
    "unparseable"
)


def parse_yes_no(answer: str) -> tuple[str, bool]:
    """``(label, parseable)`` by the POPE/LLaVA rule.

    Take the text before the first ``'.'``, drop commas, split on spaces; if any word is in
    ``{No, not, no}`` the answer is ``"no"``, otherwise ``"yes"`` (so an unparseable answer counts
    as yes). ``parseable`` is False when no word is a no-word or ``yes`` (any case).

    >>> parse_yes_no("yes."), parse_yes_no("No, there is not."), parse_yes_no("maybe")
    (('yes', True), ('no', True), ('yes', False))
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    words = answer.split(".")[0].replace(",", "").split(" ")
    if any(w in NO_WORDS for w in words):
        return "no", True
    return "yes", any(w.strip().lower() == "yes" for w in words)


def pope_metrics(labels: Sequence[str], preds: Sequence[str]) -> dict[str, float]:
    """Accuracy, precision, recall, F1 (``yes`` positive) and the yes-ratio of predictions::

        precision = TP / (TP + FP)   recall = TP / (TP + FN)   F1 = 2 P R / (P + R)
        yes_ratio = #(pred == yes) / N

    Empty denominators give 0.
    """
    if len(labels) != len(preds):
        raise ValueError(f"{len(labels)} labels but {len(preds)} predictions")
    for name, values in (("labels", labels), ("predictions", preds)):
        bad = sorted({v for v in values if v not in ("yes", "no")})
        if bad:
            raise ValueError(f"{name} must be 'yes' or 'no', got {bad[:3]}")
    t = np.asarray([v == "yes" for v in labels], dtype=bool)
    p = np.asarray([v == "yes" for v in preds], dtype=bool)
    n = len(t)
    tp, fp, fn = int((t & p).sum()), int((~t & p).sum()), int((t & ~p).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "accuracy": float((t == p).sum()) / n if n else 0.0,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "yes_ratio": float(p.sum()) / n if n else 0.0,
        "n": n,
    }


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive), ties counted half
    (the Mann-Whitney U statistic over all positive/negative pairs). ``nan`` without both classes.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    if s.shape != y.shape:
        raise ValueError(f"{s.shape[0]} scores but {y.shape[0]} labels")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = 0.5 * (i + j) + 1
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def point_in_boxes(point: Sequence[float], boxes: Sequence[Sequence[float]]) -> bool:
    """Pointing game hit: ``(x, y)`` lies inside (borders included) any ``[x, y, w, h]`` box."""
    x, y = point
    return any(bx <= x <= bx + bw and by <= y <= by + bh for bx, by, bw, bh in boxes)


def coco_box_ap(
    gt: Any, results: list[dict], image_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """COCO bbox AP of ``results`` against ``gt`` (a ``pycocotools.coco.COCO``).

    ``results`` are ``{image_id, category_id, bbox: [x, y, w, h], score}``. Detections whose image
    or category id is not in ``gt`` are dropped and counted (``loadRes`` would raise); an empty
    list gives AP = AP50 = 0 without calling ``loadRes`` (which crashes on it). Evaluation runs on
    ``image_ids`` (the images the run queried; default: every image of ``gt``), so a missed object
    of a queried image counts against recall. Returns ``AP`` (``stats[0]``, @[.5:.95]),
    ``AP50`` (``stats[1]``), and the number of detections used and dropped.
    """
    from pycocotools.cocoeval import COCOeval

    known = set(gt.getImgIds())
    image_ids_set = known if image_ids is None else {i for i in image_ids if i in known}
    category_ids = set(gt.getCatIds())
    kept, dropped = [], 0
    for r in results:
        box = r.get("bbox")
        valid_box = (
            isinstance(box, (list, tuple))
            and len(box) == 4
            and all(np.isfinite(v) for v in box)
            and box[2] > 0
            and box[3] > 0
        )
        if (
            r.get("image_id") in image_ids_set
            and r.get("category_id") in category_ids
            and valid_box
        ):
            kept.append(
                {
                    "image_id": r["image_id"],
                    "category_id": r["category_id"],
                    "bbox": [float(v) for v in box],
                    "score": float(r.get("score", 1.0)),
                }
            )
        else:
            dropped += 1
    out = {"AP": 0.0, "AP50": 0.0, "n_detections": len(kept), "n_dropped": dropped}
    if not kept:
        return out
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        dt = gt.loadRes(kept)
        ev = COCOeval(gt, dt, "bbox")
        ev.params.imgIds = sorted(image_ids_set)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    out["AP"] = max(float(ev.stats[0]), 0.0)  # -1 means "no ground truth": report 0
    out["AP50"] = max(float(ev.stats[1]), 0.0)
    return out
