"""POPE question building on a small COCO-format set: labels, the three negative rules, counts,
seeds, and reading question files."""

import json
from collections import Counter

import pytest

from vlm_focus.eval.pope import (
    build_questions,
    question_text,
    read_questions,
    select_images,
    write_questions,
)
from vlm_focus.organism.scenes import coco_instances, generate_scene


@pytest.fixture(scope="module")
def instances():
    # organism scenes: Zipf-like category popularity and fixed companions (COCO format, 30 cats)
    return coco_instances([generate_scene(seed) for seed in range(100, 160)])


def _present(instances):
    out = {img["id"]: set() for img in instances["images"]}
    for a in instances["annotations"]:
        out[a["image_id"]].add(a["category_id"])
    return out


def _statistics(instances):
    """Brute-force image frequency and pair co-occurrence, independent of the module."""
    present = _present(instances)
    cats = [c["id"] for c in instances["categories"]]
    freq = {c: sum(c in p for p in present.values()) for c in cats}
    co = {(a, b): sum(a in p and b in p for p in present.values()) for a in cats for b in cats}
    return present, freq, co


def test_question_text_article():
    assert question_text("apple") == "Is there an apple in the image?"
    assert question_text("red_circle") == "Is there a red_circle in the image?"
    assert question_text("orange_cross") == "Is there an orange_cross in the image?"


@pytest.mark.parametrize("split", ["random", "popular", "adversarial"])
def test_labels_counts_and_presence(instances, split):
    present, _, _ = _statistics(instances)
    rows = build_questions(instances, split, n_images=500, seed=0)
    eligible = [i for i, p in present.items() if len(p) >= 3]
    assert len(rows) == 6 * len(eligible) and len(eligible) >= 10
    names = {c["id"]: c["name"] for c in instances["categories"]}
    for image_id, n in Counter(r["image_id"] for r in rows).items():
        assert n == 6
        qs = [r for r in rows if r["image_id"] == image_id]
        assert [r["label"] for r in qs] == ["yes"] * 3 + ["no"] * 3
        assert len({r["category_id"] for r in qs}) == 6
    for r in rows:
        assert (r["category_id"] in present[r["image_id"]]) == (r["label"] == "yes")
        assert r["text"] == question_text(names[r["category_id"]])
        assert r["image"] == f"scene_{r['image_id']}.png"
    assert [r["question_id"] for r in rows] == list(range(1, len(rows) + 1))


def test_popular_negatives_are_the_most_frequent_absent(instances):
    present, freq, _ = _statistics(instances)
    rows = build_questions(instances, "popular")
    for image_id in {r["image_id"] for r in rows}:
        negatives = [r["category_id"] for r in rows if r["image_id"] == image_id][3:]
        absent = sorted((c for c in freq if c not in present[image_id]), key=lambda c: -freq[c])
        assert negatives == sorted(negatives, key=lambda c: (-freq[c], c))
        assert min(freq[c] for c in negatives) >= max(freq[c] for c in absent if c not in negatives)


def test_adversarial_negatives_cooccur_most(instances):
    present, freq, co = _statistics(instances)
    rows = build_questions(instances, "adversarial")
    popular = build_questions(instances, "popular")
    differs = 0
    for image_id in {r["image_id"] for r in rows}:
        negatives = [r["category_id"] for r in rows if r["image_id"] == image_id][3:]
        absent = [c for c in freq if c not in present[image_id]]
        score = {c: sum(co[(p, c)] for p in present[image_id]) for c in absent}
        assert min(score[c] for c in negatives) >= max(
            score[c] for c in absent if c not in negatives
        )
        pop = [r["category_id"] for r in popular if r["image_id"] == image_id][3:]
        differs += pop != negatives
    assert differs > 0  # the rules are not the same here


def test_splits_share_images_and_positives_and_seeds_are_stable(instances):
    by_split = {s: build_questions(instances, s, seed=3) for s in ("random", "popular")}
    pos = {s: [(r["image_id"], r["category_id"]) for r in rows if r["label"] == "yes"]
           for s, rows in by_split.items()}  # fmt: skip
    assert pos["random"] == pos["popular"]
    assert build_questions(instances, "random", seed=3) == by_split["random"]
    other = build_questions(instances, "random", seed=4)
    assert [r["category_id"] for r in other] != [r["category_id"] for r in by_split["random"]]


def test_image_sampling_is_seeded_and_sorted(instances):
    a = select_images(instances, 5, 3, seed=1)
    assert a == select_images(instances, 5, 3, seed=1) == sorted(a) and len(a) == 5
    assert a != select_images(instances, 5, 3, seed=2)
    rows = build_questions(instances, "random", n_images=5, seed=1)
    assert sorted({r["image_id"] for r in rows}) == a and len(rows) == 30


def test_read_questions_round_trip_and_errors(tmp_path, instances):
    rows = build_questions(instances, "random")[:12]
    path = write_questions(rows, tmp_path / "pope_random.jsonl")
    assert read_questions(path) == rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_questions(bad)
    bad.write_text(json.dumps({"question_id": 1, "image": "x.png", "text": "q"}) + "\n")
    with pytest.raises(ValueError, match="needs question_id, image, text, label"):
        read_questions(bad)
    bad.write_text(json.dumps({**rows[0], "label": "maybe"}) + "\n")
    with pytest.raises(ValueError, match="yes or no"):
        read_questions(bad)
    bad.write_text((json.dumps(rows[0]) + "\n") * 2)
    with pytest.raises(ValueError, match="duplicate"):
        read_questions(bad)
    with pytest.raises(FileNotFoundError):
        read_questions(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="split"):
        build_questions(instances, "hard")
