"""The organism's scenes: the procedural scenes of :mod:`vlm_focus.eval.scenes` (re-exported here),
with the reference captions, spatial relations, two-hop targets and COCO export that its
training and evaluation recipes use.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..eval.scenes import (
    CATEGORIES,
    COLOURS,
    COMPANIONS,
    HELDOUT_SEED_BASE,
    IMAGE_SIZE,
    MAX_OBJECTS,
    MAX_RADIUS,
    MIN_RADIUS,
    POPULARITY,
    POSITIONS,
    SHAPES,
    Scene,
    SceneObject,
    generate_scene,
    heldout_scenes,
    render,
    scenes_from,
    shape_mask,
)

__all__ = [
    "CATEGORIES",
    "COLOURS",
    "COMPANIONS",
    "HELDOUT_SEED_BASE",
    "IMAGE_SIZE",
    "MAX_OBJECTS",
    "MAX_RADIUS",
    "MIN_RADIUS",
    "POPULARITY",
    "POSITIONS",
    "RELATIONS",
    "RELATION_MARGIN",
    "SHAPES",
    "Scene",
    "SceneObject",
    "caption",
    "coco_instances",
    "direction_offsets",
    "generate_scene",
    "heldout_scenes",
    "in_direction",
    "relation_holds",
    "render",
    "scenes_from",
    "shape_mask",
    "two_hop_pairs",
    "two_hop_target",
    "write_dataset",
]

RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
RELATION_MARGIN = 16  # px: a relation is only asked when the centres differ by at least this much


def caption(scene: Scene) -> str:
    """Reference caption: `category position` items in category order, joined by ' , '."""
    items = sorted(scene.objects, key=lambda o: o.category)
    return " , ".join(f"{o.name} {o.position(scene.size)}" for o in items)


def relation_holds(a: SceneObject, b: SceneObject, relation: str) -> bool | None:
    """Truth of 'a is {relation} of b' from the centres; None when the margin is too small."""
    if relation in ("left", "right"):
        d = b.cx - a.cx if relation == "left" else a.cx - b.cx
    elif relation in ("above", "below"):
        d = b.cy - a.cy if relation == "above" else a.cy - b.cy
    else:
        raise ValueError(f"relation={relation!r}; allowed: {RELATIONS}")
    if abs(d) < RELATION_MARGIN:
        return None
    return d > 0


def _rle(mask: np.ndarray) -> dict:
    """Uncompressed COCO RLE (column-major run lengths, starting with a zero run)."""
    flat = mask.astype(np.uint8).flatten(order="F")
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0] == 1:
        counts = [0] + counts
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": [int(c) for c in counts]}


def coco_instances(scenes: list[Scene], file_names: list[str] | None = None) -> dict:
    """COCO `instances` dict: images, exact RLE masks, tight boxes, categories (ids start at 1)."""
    images, annotations = [], []
    for i, s in enumerate(scenes):
        name = file_names[i] if file_names else f"scene_{s.seed}.png"
        images.append({"id": s.seed, "file_name": name, "width": s.size, "height": s.size})
        for o in s.objects:
            m = o.mask(s.size)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": s.seed,
                    "category_id": o.category + 1,
                    "bbox": list(o.box(s.size)),
                    "area": int(m.sum()),
                    "segmentation": _rle(m),
                    "iscrowd": 0,
                }
            )
    cats = [
        {"id": i + 1, "name": n, "supercategory": n.split("_")[1]} for i, n in enumerate(CATEGORIES)
    ]
    return {"images": images, "annotations": annotations, "categories": cats}


def write_dataset(scenes: list[Scene], out_dir: Path, images: bool = True) -> Path:
    """Write PNGs (optional), `instances.json` and `captions.json`; return the instances path."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f"scene_{s.seed}.png" for s in scenes]
    if images:
        for s, n in zip(scenes, names, strict=True):
            Image.fromarray(s.image()).save(out_dir / n)
    path = out_dir / "instances.json"
    path.write_text(json.dumps(coco_instances(scenes, names)))
    caps = [{"image_id": s.seed, "caption": caption(s)} for s in scenes]
    (out_dir / "captions.json").write_text(json.dumps(caps))
    return path


def direction_offsets(a: SceneObject, b: SceneObject, relation: str) -> tuple[float, float]:
    """(along, across) offsets in px of `a`'s centre from `b`'s for 'a is {relation} of b':
    `along` > 0 when `a` lies that way, `across` the distance perpendicular to it."""
    dx, dy = a.cx - b.cx, a.cy - b.cy
    along = {"left": -dx, "right": dx, "above": -dy, "below": dy}
    if relation not in along:
        raise ValueError(f"relation={relation!r}; allowed: {RELATIONS}")
    across = abs(dy) if relation in ("left", "right") else abs(dx)
    return along[relation], across


def in_direction(a: SceneObject, b: SceneObject, relation: str) -> bool | None:
    """Whether `a` lies {relation} of `b` in the two-hop sense, or None when it is too close
    to call: `a` is that way when its centre lies in the 90-degree cone opening from `b`'s
    centre in that direction (along - across >= RELATION_MARGIN), clearly not when
    along - across <= -RELATION_MARGIN."""
    along, across = direction_offsets(a, b, relation)
    score = along - across
    if abs(score) < RELATION_MARGIN:
        return None
    return score > 0


def two_hop_target(scene: Scene, anchor: int, relation: str) -> int | None:
    """Index of the one object {relation} of object `anchor`, or None when that is not unique.

    Unique means: exactly one other object lies in the direction's cone, and no other object is
    too close to its border to call (`in_direction` is None). Every two-hop question is asked
    only about such a (scene, anchor, relation)."""
    if relation not in RELATIONS:
        raise ValueError(f"relation={relation!r}; allowed: {RELATIONS}")
    a = scene.objects[anchor]
    found: list[int] = []
    for i, o in enumerate(scene.objects):
        if i == anchor:
            continue
        side = in_direction(o, a, relation)
        if side is None:
            return None
        if side:
            found.append(i)
    return found[0] if len(found) == 1 else None


def two_hop_pairs(scene: Scene) -> list[tuple[int, str, int]]:
    """Every (anchor index, relation, target index) with a unique two-hop answer."""
    out = []
    for i in range(len(scene.objects)):
        for rel in RELATIONS:
            t = two_hop_target(scene, i, rel)
            if t is not None:
                out.append((i, rel, t))
    return out
