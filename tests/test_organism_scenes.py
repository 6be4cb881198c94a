"""Scene generator: determinism, exact masks and boxes, COCO validity, co-occurrence, POPE rules."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from organism.pope import (
    SPLITS,
    parse_yes_no,
    pope_eligible,
    pope_metrics,
    pope_questions,
)
from organism.scenes import (
    CATEGORIES,
    COLOURS,
    COMPANIONS,
    SHAPES,
    caption,
    generate_scene,
    heldout_scenes,
    relation_holds,
    shape_mask,
    write_dataset,
)


def test_vocabulary_sizes():
    assert len(COLOURS) >= 6 and len(SHAPES) >= 5
    assert len(CATEGORIES) == len(COLOURS) * len(SHAPES) == len(set(CATEGORIES))


def test_generator_is_deterministic():
    for seed in (0, 7, 123456):
        a, b = generate_scene(seed), generate_scene(seed)
        assert a.objects == b.objects and a.background == b.background
        assert np.array_equal(a.image(), b.image())
    assert not np.array_equal(generate_scene(1).image(), generate_scene(2).image())


def test_object_counts_and_no_overlap():
    counts = Counter()
    for seed in range(120):
        s = generate_scene(seed)
        counts[len(s.objects)] += 1
        assert len(set(s.categories)) == len(s.objects)
        total = np.zeros((s.size, s.size), dtype=np.int32)
        for o in s.objects:
            total += o.mask()
        assert total.max() <= 1
    assert set(counts) == {1, 2, 3, 4, 5}


def test_masks_and_boxes_are_exact():
    s = generate_scene(42, n_objects=4)
    img = s.image().astype(int)
    for o in s.objects:
        m = o.mask()
        ys, xs = np.nonzero(m)
        x, y, w, h = o.box()
        assert (x, y, x + w - 1, y + h - 1) == (xs.min(), ys.min(), xs.max(), ys.max())
        # every mask pixel carries the object's colour (up to shade jitter and noise), none outside
        colour = np.asarray(COLOURS[o.name.split("_")[0]])
        err = np.abs(img[m] - colour).max(axis=1)
        assert np.percentile(err, 99) < 40
    # a circle of radius 10 at a pixel centre: the exact pixel-centre count
    circle = shape_mask("circle", 50.5, 50.5, 10.0)
    yy, xx = np.mgrid[0:192, 0:192] + 0.5
    assert circle.sum() == int(((xx - 50.5) ** 2 + (yy - 50.5) ** 2 <= 100).sum())


def test_coco_json_loads_in_pycocotools(tmp_path):
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO

    scenes = [generate_scene(seed) for seed in range(12)]
    path = write_dataset(scenes, tmp_path, images=False)
    coco = COCO(str(path))
    assert len(coco.getImgIds()) == 12
    assert len(coco.getAnnIds()) == sum(len(s.objects) for s in scenes)
    assert len(coco.getCatIds()) == len(CATEGORIES)
    for s in scenes:
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[s.seed]))
        for ann, o in zip(anns, s.objects, strict=True):
            assert np.array_equal(coco.annToMask(ann).astype(bool), o.mask())
            assert ann["bbox"] == list(o.box())
            rle = coco.annToRLE(ann)
            assert list(mask_utils.toBbox(rle)) == [float(v) for v in o.box()]
            assert ann["category_id"] == o.category + 1
    caps = json.loads((tmp_path / "captions.json").read_text())
    assert caps[0]["caption"] == caption(scenes[0])


def test_caption_lists_every_object_with_position():
    s = generate_scene(5, n_objects=3)
    items = caption(s).split(" , ")
    assert len(items) == 3
    assert sorted(i.split()[0] for i in items) == sorted(o.name for o in s.objects)
    assert [CATEGORIES.index(i.split()[0]) for i in items] == sorted(s.categories)


def test_relations_follow_centres():
    s = generate_scene(3, n_objects=2)
    a, b = s.objects
    truth = relation_holds(a, b, "left")
    if truth is not None:
        assert truth == (a.cx < b.cx)
        assert relation_holds(b, a, "right") == truth
    with pytest.raises(ValueError):
        relation_holds(a, b, "near")


def test_cooccurrence_is_not_uniform():
    pairs = Counter()
    for seed in range(1500):
        cats = generate_scene(seed).categories
        pairs.update(frozenset((x, y)) for x in cats for y in cats if x < y)
    companion = [
        pairs[frozenset((i, int(c)))] for i in range(len(CATEGORIES)) for c in COMPANIONS[i]
    ]
    mean_pair = sum(pairs.values()) / (len(CATEGORIES) * (len(CATEGORIES) - 1) / 2)
    assert np.mean(companion) > 2 * mean_pair


def test_heldout_set_is_fixed_and_disjoint_from_training():
    from organism.data import TRAIN_SEED_BASE
    from organism.scenes import HELDOUT_SEED_BASE

    a, b = heldout_scenes(5), heldout_scenes(5)
    assert [s.seed for s in a] == [s.seed for s in b]
    assert all(HELDOUT_SEED_BASE <= s.seed < TRAIN_SEED_BASE for s in a)


def test_pope_questions_obey_the_rules():
    scenes = pope_eligible(60)
    assert all(len(s.objects) >= 3 for s in scenes)
    by_id = {s.seed: s for s in scenes}
    splits = {split: pope_questions(scenes, split) for split in SPLITS}
    freq = Counter(c for s in scenes for c in s.categories)
    for split, rows in splits.items():
        assert len(rows) == 6 * len(scenes)
        per_image = Counter((r["image_id"], r["label"]) for r in rows)
        assert set(per_image.values()) == {3}
        for r in rows:
            present = {o.name for o in by_id[r["image_id"]].objects}
            assert (r["category"] in present) == (r["label"] == "yes")
            art = "an" if r["category"][0] in "aeiou" else "a"
            assert r["text"] == f"Is there {art} {r['category']} in the image?"
        if split == "popular":
            for s in scenes:
                negs = [
                    r["category"] for r in rows if r["image_id"] == s.seed and r["label"] == "no"
                ]
                ranked = sorted(range(len(CATEGORIES)), key=lambda c: (-freq[c], c))
                expected = [CATEGORIES[c] for c in ranked if c not in s.categories][:3]
                assert negs == expected
    positives = [
        [(r["image_id"], r["category"]) for r in rows if r["label"] == "yes"]
        for rows in splits.values()
    ]
    assert positives[0] == positives[1] == positives[2]
    negatives = [
        {(r["image_id"], r["category"]) for r in rows if r["label"] == "no"}
        for rows in splits.values()
    ]
    assert negatives[0] != negatives[2]


def test_pope_answer_parsing_and_metrics():
    assert parse_yes_no("yes") == ("yes", True)
    assert parse_yes_no("No, there is not.") == ("no", True)
    assert parse_yes_no("red_circle") == ("yes", False)
    assert parse_yes_no("yes. no") == ("yes", True)
    m = pope_metrics(["yes", "yes", "no", "no"], ["yes", "no", "yes", "no"])
    assert m["accuracy"] == 0.5 and m["precision"] == 0.5 and m["recall"] == 0.5
    assert m["yes_ratio"] == 0.5
    m = pope_metrics(["yes", "no", "no", "no"], ["yes", "yes", "yes", "no"])
    assert m["yes_ratio"] == 0.75 and m["f1"] == pytest.approx(2 * (1 / 3) / (1 + 1 / 3))
