"""``vlm-focus eval coco``: attention grounding on a COCO-format set.

For each image the model is asked about every category present and ``--absent`` sampled absent
ones (``"Is there a {category} in the image?"`` + LLaVA's suffix by default). The attention map of
the category's tokens in the prompt (:func:`vlm_focus.grounding.heatmap`, all layers and heads)
gives a point (its peak, :func:`~vlm_focus.grounding.point`) and boxes
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

import argparse
import contextlib
import io
import sys
from typing import Any

import numpy as np

from .metrics import auroc, coco_box_ap, point_in_boxes
from .pope import LLAVA_SUFFIX, image_categories, question_text

COCO_COLUMNS = (
    "model", "n_images", "n_queries", "AP", "AP50", "pointing", "auroc", "n_detections",
    "n_dropped", "n_missing_images",
)  # fmt: skip


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
        {"image_id": r["image_id"], "category_id": r["category_id"], "bbox": b["bbox"],
         "score": b["score"]}
        for r in records
        for b in r["boxes"]
    ]  # fmt: skip


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


def run_coco(args: argparse.Namespace) -> dict | None:
    from .. import grounding
    from ..loading import load_image
    from .cli import load, model_tag, write_json
    from .data import resolve_set, split_missing
    from .generation import Generator, Setting
    from .runner import process_state, run_items
    from .tables import write_table

    if args.max_boxes < 1 or args.absent < 0:
        raise ValueError("--max-boxes must be >= 1 and --absent >= 0")
    template = args.prompt or "{question}" + LLAVA_SUFFIX
    if "{category}" not in template and "{question}" not in template:
        raise ValueError("--prompt must contain {category} (the phrase the map is read from)")
    state = process_state()
    cocoset = resolve_set(args, state)
    present_cats = image_categories(cocoset.instances)
    ids = sorted(i for i, c in present_cats.items() if c)
    if len(ids) > args.n_images:
        rng = np.random.default_rng(args.seed)
        ids = sorted(int(i) for i in rng.choice(ids, args.n_images, replace=False))
    ids = ids[: args.limit] if args.limit else ids
    rows = queries(cocoset.instances, ids, args.absent, args.seed)
    rows, missing = split_missing(rows, cocoset, args.on_missing)
    missing_images = sorted({r["image_id"] for r in missing})
    ids = [i for i in ids if i not in set(missing_images)]
    model, processor = load(args, state)
    generator = Generator(model, processor, Setting())
    truth = gt_boxes(cocoset.instances)

    def prompt(r: dict) -> str:
        return template.format(question=question_text(r["category"]), category=r["category"])

    def process(batch: list[dict]) -> list[dict]:
        out: dict[str, dict] = {}
        groups: dict[str, list[dict]] = {}
        for r in batch:
            groups.setdefault(r["category"], []).append(r)
        for name, group in groups.items():
            images = [load_image(cocoset.images_dir / r["image"]) for r in group]
            inputs = generator.inputs(images, [prompt(r) for r in group])
            generator.visual_counts(inputs)
            sizes = [(im.height, im.width) for im in images]
            maps = grounding.heatmap(model, inputs, name, tokenizer=processor, image_size=sizes)
            for r, row_maps in zip(group, maps, strict=True):
                heat = row_maps[0]
                x, y = grounding.point(heat)
                found = grounding.boxes(heat, max_boxes=args.max_boxes)
                boxes = [
                    {"bbox": [round(v, 2) for v in b.xywh],
                     "score": float(grounding.box_share(heat, b))}
                    for b in found
                ]  # fmt: skip
                boxes.sort(key=lambda b: -b["score"])
                key = (r["image_id"], r["category_id"])
                out[r["query_id"]] = {
                    **{k: r[k] for k in ("query_id", "image_id", "category_id", "category")},
                    "present": r["present"],
                    "point": [x, y],
                    "hit": point_in_boxes((x, y), truth.get(key, [])) if r["present"] else None,
                    "boxes": boxes,
                    "score": boxes[0]["score"] if boxes else 0.0,
                }
        return [out[r["query_id"]] for r in batch]

    def metric(records: list[dict]) -> str:
        hits = [r["hit"] for r in records if r["present"]]
        a = auroc([r["score"] for r in records], [r["present"] for r in records])
        return f"pointing={sum(hits) / max(len(hits), 1):.3f} auroc={a:.3f}"

    root = args.out / "coco" / model_tag(args.model)
    records = run_items(
        rows,
        process,
        root / "queries.jsonl",
        key="query_id",
        batch_size=args.batch_size,
        state=state,
        desc="coco grounding",
        metric=metric,
        config={
            "model": args.model or "embedded",
            "prompt": template,
            "absent": args.absent,
            "max_boxes": args.max_boxes,
            "seed": args.seed,
            "instances": str(cocoset.instances_path),
        },
    )
    if not state.is_main_process:
        return None
    summary = {
        "model": args.model or "embedded",
        "n_images": len(ids),
        **summarise(records, cocoset.instances, ids),
        "n_missing_images": len(missing_images),
        "prompt": template,
        "absent_per_image": args.absent,
        "max_boxes": args.max_boxes,
        "map_rule": "heatmap of the category tokens in the prompt, all layers and heads",
        "box_rule": "grounding.boxes: Gaussian smoothing, Otsu threshold, connected components",
        "score_rule": "region score (MTLA) of each box = grounding.box_share of the same map",
        "pointing_rule": "hit when the map's peak lies inside any box of the queried category",
        "auroc_rule": "top box score, present (positive) vs absent queries",
        "set": cocoset.describe(),
        "processes": state.num_processes,
    }
    write_json(root / "summary.json", summary)
    write_json(root / "detections.json", detections(records))
    write_table([summary], COCO_COLUMNS, root / "table")
    from .plots import grounding_examples

    grounding_examples(records, truth, cocoset.image_path, root / "examples.png")
    print(
        f"coco: AP {summary['AP']:.4f} AP50 {summary['AP50']:.4f} pointing "
        f"{summary['pointing']:.4f} AUROC {summary['auroc']:.4f} "
        f"({summary['n_queries']} queries, {summary['n_images']} images) -> {root}",
        file=sys.stderr,
    )
    return summary
