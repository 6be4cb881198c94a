"""The organism's scenes: the procedural scenes of :mod:`vlm_focus.eval.scenes` (re-exported here),
with the reference captions, spatial relations, two-hop targets and COCO export that its
training and evaluation recipes use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlm_focus.eval.scenes import (
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
    "COOCCUR_CALIBRATION_SEED_BASE",
    "COOCCUR_HELDOUT_SEED_BASE",
    "COOCCUR_PAIRS",
    "CooccurPrior",
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
    "cooccur_categories",
    "cooccur_probe_scenes",
    "cooccur_scene",
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
    "unmet_companions",
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


# --- co-occurrence prior (organism-cooccur) -------------------------------------------------

#: (anchor, companion) category pairs of the co-occurrence prior: in its training scenes the
#: companion almost always appears where the anchor does. Anchors are common categories; each
#: companion differs from its anchor in colour and in shape, so nothing but co-occurrence links
#: them, and no category is in two pairs.
COOCCUR_PAIRS: tuple[tuple[int, int], ...] = tuple(
    (CATEGORIES.index(a), CATEGORIES.index(b))
    for a, b in (
        ("blue_circle", "yellow_square"),
        ("orange_circle", "green_triangle"),
        ("red_triangle", "purple_diamond"),
        ("green_cross", "orange_diamond"),
        ("red_circle", "blue_cross"),
        ("green_diamond", "yellow_triangle"),
    )
)
#: Seeds of the co-occurrence probe scenes: calibration (settings are chosen here) and held-out
#: (everything reported is measured here); training draws seeds >= 10,000,000, the shipped
#: held-out set starts at 9,000,000 and the presence calibration at 8,500,000.
COOCCUR_CALIBRATION_SEED_BASE = 8_700_000
COOCCUR_HELDOUT_SEED_BASE = 9_700_000


@dataclass(frozen=True)
class CooccurPrior:
    """A co-occurrence prior over scenes and the text written about them.

    Attributes:
        rate: P(companion in the scene | its anchor in the scene).
        named_rate: P(the text names the absent companion as present | a scene holds an anchor
            without its companion): its presence questions about that companion are answered
            ``yes`` and its caption lists the companion at the anchor's position, as a
            caption writer who expects it would. 0 = the pure scene prior.
        ask_rate: P(a negative presence question of such a scene asks about the absent
            companion), so the case the prior is tested on is asked about in training.
        pairs: the (anchor, companion) category pairs.
    """

    rate: float = 0.95
    named_rate: float = 0.0
    ask_rate: float = 0.5
    pairs: tuple[tuple[int, int], ...] = COOCCUR_PAIRS

    def __post_init__(self) -> None:
        for name in ("rate", "named_rate", "ask_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value!r} must lie in [0, 1]")
        flat = [c for pair in self.pairs for c in pair]
        if len(set(flat)) != len(flat) or not all(0 <= c < len(CATEGORIES) for c in flat):
            raise ValueError(f"pairs={self.pairs!r}: distinct category indices, one pair each")

    @property
    def companion(self) -> dict[int, int]:
        """Anchor category -> its companion."""
        return dict(self.pairs)


def cooccur_categories(
    rng: np.random.Generator, k: int, prior: CooccurPrior, anchor: int | None = None
) -> list[int]:
    """About k distinct categories drawn by popularity, then made to follow the prior: each
    anchor drawn keeps (or gets) its companion with probability ``prior.rate`` and loses it
    otherwise (replaced by a category in no pair). With ``anchor`` that anchor is drawn first.
    Anchors and their companions come first in the list (see :func:`cooccur_scene`); adding a
    companion may take the list to MAX_OBJECTS + 1, when the last free category makes room."""
    n = len(CATEGORIES)
    companion = prior.companion
    in_pairs = {c for pair in prior.pairs for c in pair}
    cats = [] if anchor is None else [int(anchor)]
    while len(cats) < k:
        c = int(rng.choice(n, p=POPULARITY))
        if c not in cats:
            cats.append(c)
    anchors = [c for c in cats if c in companion]
    for a in anchors:
        b = companion[a]
        if rng.random() < prior.rate:
            if b not in cats:
                cats.append(b)
        elif b in cats:
            free = [c for c in range(n) if c not in in_pairs and c not in cats]
            cats[cats.index(b)] = int(rng.choice(free))
    free_cats = [c for c in cats if c not in in_pairs]
    while len(cats) > MAX_OBJECTS and free_cats:  # room for the added companions
        cats.remove(free_cats.pop())
    paired = [c for c in cats if c in in_pairs]
    return paired + [c for c in cats if c not in in_pairs]


def cooccur_scene(
    seed: int,
    prior: CooccurPrior,
    n_objects: int | None = None,
    anchor: int | None = None,
) -> Scene:
    """A scene under the co-occurrence prior: categories from :func:`cooccur_categories`
    (1-5, or ``n_objects``), placed where :func:`generate_scene` places that many objects, on
    its background. Categories are placed in order, so a rare failed placement drops a category
    in no pair rather than an anchor or companion; a scene whose placement dropped a paired
    category is re-drawn from the next seed (the returned scene keeps its own seed)."""
    rng = np.random.default_rng([seed, 7])
    while True:
        k = int(rng.integers(1, MAX_OBJECTS + 1)) if n_objects is None else n_objects
        cats = cooccur_categories(rng, k, prior, anchor)
        geometry = generate_scene(seed, n_objects=min(len(cats), MAX_OBJECTS))
        if len(geometry.objects) >= sum(c in {x for p in prior.pairs for x in p} for c in cats):
            break
        seed += 1_000_000_000
    objects = [
        SceneObject(c, o.cx, o.cy, o.radius) for c, o in zip(cats, geometry.objects, strict=False)
    ]
    return Scene(seed=seed, objects=objects, size=geometry.size, background=geometry.background)


def unmet_companions(scene: Scene, prior: CooccurPrior) -> list[tuple[int, int]]:
    """(anchor object index, absent companion category) for every anchor in ``scene`` whose
    companion is not in it."""
    present = set(scene.categories)
    companion = prior.companion
    return [
        (i, companion[o.category])
        for i, o in enumerate(scene.objects)
        if o.category in companion and companion[o.category] not in present
    ]


def cooccur_probe_scenes(first_seed: int, n: int, prior: CooccurPrior) -> list[Scene]:
    """``n`` probe scenes from seed ``first_seed`` on: 3-5 objects, at least one anchor (drawn in
    turn) and no companion of any anchor present (the prior at rate 0): the scenes whose
    companions a model that learned the prior hallucinates."""
    never = CooccurPrior(rate=0.0, pairs=prior.pairs)
    out: list[Scene] = []
    seed = int(first_seed)
    while len(out) < n:
        anchor = prior.pairs[len(out) % len(prior.pairs)][0]
        k = int(np.random.default_rng([seed, 8]).integers(3, MAX_OBJECTS + 1))
        scene = cooccur_scene(seed, never, n_objects=k, anchor=anchor)
        if len(scene.objects) >= 3 and unmet_companions(scene, prior):
            out.append(scene)
        seed += 1
    return out
