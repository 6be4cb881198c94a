"""COCO attention grounding: the protocol and its metrics (the runner is
:mod:`vlm_focus.eval.coco_run`, ``vlm-focus eval coco``).

For each image the model is asked about every category present and ``--absent`` sampled absent
ones (``"Is there a {category} in the image?"`` + LLaVA's suffix by default). The attention map of
the category's tokens in the prompt (:func:`vlm_focus.grounding.heatmap`, over the chosen layers
and heads: the model's grounding default, :func:`vlm_focus.grounding.default_layers`) gives a
point (its peak, :func:`~vlm_focus.grounding.point`) and boxes
(:func:`~vlm_focus.grounding.boxes`). Each box's confidence is its region score (MTLA: the share
of the category tokens' image attention inside the box). It is read from the same map with
:func:`~vlm_focus.grounding.box_share`, which equals
:func:`~vlm_focus.grounding.region_score` for the same tokens, layers and heads (one forward
pass instead of two).

Reported: COCO bbox AP and AP50 (pycocotools, on the queried images), the pointing game on present
queries (a hit when the peak lies inside any box of the category), and the hallucination AUROC of
the top box's score, present (positive) against absent queries.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np

from .metrics import auroc, coco_box_ap
from .pope import LLAVA_SUFFIX, image_categories, question_text

COCO_COLUMNS = (
    "setting",
    "model",
    "layers",
    "heads",
    "n_images",
    "n_queries",
    "AP",
    "AP50",
    "pointing",
    "auroc",
    "n_detections",
    "n_dropped",
    "n_missing_images",
)


#: The query prompt: the POPE question about the category, with LLaVA's answer suffix.
DEFAULT_TEMPLATE = "{question}" + LLAVA_SUFFIX


def check_template(template: str) -> str:
    """A query template holds ``{question}`` (the POPE question about the category) or
    ``{category}`` (its name): the map is read at the category's tokens."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"prompt={template!r} is empty; give a template with {{question}}")
    if "{category}" not in template and "{question}" not in template:
        raise ValueError(
            f"prompt={template!r} must contain {{question}} (the POPE question about the "
            "category) or {category} (its name): the map is read at the category's tokens"
        )
    return template


def query_prompt(template: str, category: str) -> str:
    """The prompt of one query."""
    return template.format(question=question_text(category), category=category)


def queries(
    instances: dict, image_ids: list[int], n_absent: int, seed: int
) -> list[dict[str, Any]]:
    """Query rows ``{query_id, image_id, image, category_id, category, present}``: every present
    category of each image and ``n_absent`` absent ones drawn with ``seed``; ordered by category
    so that a batch mostly shares one phrase."""
    names = {c["id"]: c["name"] for c in instances["categories"]}
    files = {img["id"]: img["file_name"] for img in instances["images"]}
    present = image_categories(instances)
    rows = []
    for image_id in image_ids:
        cats = present[image_id]
        absent = [c for c in sorted(names) if c not in cats]
        rng = np.random.default_rng([seed, image_id, 2])
        drawn = rng.choice(absent, min(n_absent, len(absent)), replace=False) if absent else []
        for c, is_present in [(c, True) for c in cats] + [(int(c), False) for c in drawn]:
            rows.append(
                {
                    "query_id": f"{image_id}:{c}",
                    "image_id": image_id,
                    "image": files[image_id],
                    "category_id": c,
                    "category": names[c],
                    "present": is_present,
                }
            )
    rows.sort(key=lambda r: (r["category_id"], r["image_id"]))
    return rows


def gt_boxes(instances: dict) -> dict[tuple[int, int], list[list[float]]]:
    """Ground-truth boxes by ``(image_id, category_id)``."""
    out: dict[tuple[int, int], list[list[float]]] = {}
    for ann in instances["annotations"]:
        out.setdefault((ann["image_id"], ann["category_id"]), []).append(list(ann["bbox"]))
    return out


def coco_gt(instances: dict) -> Any:
    """A ``pycocotools.coco.COCO`` from a parsed dict (``area``/``iscrowd`` filled when absent)."""
    from pycocotools.coco import COCO

    anns = []
    for i, ann in enumerate(instances["annotations"]):
        a = dict(ann)
        a.setdefault("id", i + 1)
        a.setdefault("iscrowd", 0)
        a.setdefault("area", float(a["bbox"][2] * a["bbox"][3]))
        anns.append(a)
    gt = COCO()
    gt.dataset = {**instances, "annotations": anns}
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt


def detections(records: list[dict]) -> list[dict]:
    """COCO results list from query records."""
    return [
        {
            "image_id": r["image_id"],
            "category_id": r["category_id"],
            "bbox": b["bbox"],
            "score": b["score"],
        }
        for r in records
        for b in r["boxes"]
    ]


def summarise(records: list[dict], instances: dict, image_ids: list[int]) -> dict[str, Any]:
    """AP, AP50, pointing game and AUROC of answered query records."""
    ap = coco_box_ap(coco_gt(instances), detections(records), image_ids=image_ids)
    hits = [r["hit"] for r in records if r["present"]]
    return {
        **ap,
        "pointing": sum(hits) / len(hits) if hits else 0.0,
        "auroc": auroc([r["score"] for r in records], [r["present"] for r in records]),
        "n_queries": len(records),
        "n_present": len(hits),
    }
