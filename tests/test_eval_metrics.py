"""Evaluation metrics against hand-computed values: POPE parsing and scores, AUROC, pointing,
COCO box AP (planted perfect and shifted sets, empty and unknown ids), CHAIR."""

import math

import numpy as np
import pytest

from vlm_focus.eval.chair import (
    ObjectWords,
    chair_metrics,
    drop_unfinished,
    extract_objects,
    singular,
    truth_objects,
)
from vlm_focus.eval.coco import coco_gt
from vlm_focus.eval.metrics import auroc, coco_box_ap, parse_yes_no, point_in_boxes, pope_metrics


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("yes.", ("yes", True)),
        ("Yes", ("yes", True)),
        ("No, there is not.", ("no", True)),
        ("no", ("no", True)),
        ("There is not a dog.", ("no", True)),
        ("Nope", ("yes", False)),  # not a no-word: counts as yes, flagged unparseable
        ("", ("yes", False)),
        ("Yes. But no, not really", ("yes", True)),  # only the text before the first '.'
        ("Yes, no", ("no", True)),  # commas dropped, then a no-word
        ("NO", ("yes", False)),  # the rule is case-sensitive: {No, not, no}
    ],
)
def test_parse_yes_no_follows_the_pope_rule(answer, expected):
    assert parse_yes_no(answer) == expected


def test_pope_metrics_hand_computed():
    answers = ["yes.", "No, there is not.", "maybe", "no", "Yes", "No"]
    labels = ["yes", "yes", "no", "no", "yes", "no"]
    preds = [parse_yes_no(a)[0] for a in answers]
    assert preds == ["yes", "no", "yes", "no", "yes", "no"]
    m = pope_metrics(labels, preds)
    # TP = 2 (0, 4), FP = 1 (2), FN = 1 (1), TN = 2 (3, 5)
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["precision"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["yes_ratio"] == pytest.approx(3 / 6)  # of predictions, not labels
    assert sum(not parse_yes_no(a)[1] for a in answers) == 1


def test_pope_yes_ratio_is_of_predictions_and_degenerate_cases():
    m = pope_metrics(["yes", "no", "no", "no"], ["yes"] * 4)
    assert m["yes_ratio"] == 1.0 and m["precision"] == 0.25 and m["recall"] == 1.0
    m = pope_metrics(["yes", "no"], ["no", "no"])
    assert m["precision"] == 0.0 and m["f1"] == 0.0 and m["accuracy"] == 0.5
    with pytest.raises(ValueError, match="yes"):
        pope_metrics(["yes"], ["maybe"])
    with pytest.raises(ValueError, match="labels"):
        pope_metrics(["yes"], [])


def test_auroc_hand_computed_with_ties():
    assert auroc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    # pairs (pos, neg): (0.5, 0.5) tie = 0.5, (0.5, 0.1) = 1, (0.7, 0.5) = 1, (0.7, 0.1) = 1
    assert auroc([0.5, 0.7, 0.5, 0.1], [True, True, False, False]) == pytest.approx(3.5 / 4)
    assert math.isnan(auroc([0.1, 0.2], [True, True]))


@pytest.mark.parametrize("seed", range(5))
def test_auroc_is_the_share_of_positive_negative_pairs_ordered_right(seed):
    gen = np.random.default_rng(seed)
    scores = gen.integers(0, 6, 40) / 5  # many ties
    labels = gen.random(40) < 0.4
    pos, neg = scores[labels][:, None], scores[~labels][None, :]
    pairs = ((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size)
    assert auroc(scores.tolist(), labels.tolist()) == pytest.approx(float(pairs), abs=1e-12)


def test_point_in_boxes_borders_included():
    assert point_in_boxes((10, 10), [[0, 0, 10, 10]])
    assert not point_in_boxes((10.5, 5), [[0, 0, 10, 10]])
    assert point_in_boxes((15, 15), [[0, 0, 10, 10], [12, 12, 5, 5]])
    assert not point_in_boxes((1, 1), [])


def _instances():
    images = [{"id": i, "file_name": f"{i}.png", "width": 100, "height": 100} for i in (1, 2)]
    boxes = [(1, 1, [10, 10, 30, 20]), (1, 2, [50, 50, 40, 40]), (2, 1, [5, 60, 20, 30])]
    anns = [
        {"id": k + 1, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
        for k, (i, c, b) in enumerate(boxes)
    ]
    cats = [{"id": 1, "name": "cat"}, {"id": 2, "name": "hot dog"}]
    return {"images": images, "annotations": anns, "categories": cats}


def test_coco_ap_planted_perfect_set_is_one():
    data = _instances()
    results = [
        {
            "image_id": a["image_id"],
            "category_id": a["category_id"],
            "bbox": a["bbox"],
            "score": 0.9,
        }
        for a in data["annotations"]
    ]
    out = coco_box_ap(coco_gt(data), results)
    assert out["AP"] == pytest.approx(1.0) and out["AP50"] == pytest.approx(1.0)
    assert out["n_detections"] == 3 and out["n_dropped"] == 0


def test_coco_ap_shifted_set():
    data = _instances()
    # every box shifted right by half its width: IoU = 0.5 w h / 1.5 w h = 1/3 < 0.5
    results = [
        {
            "image_id": a["image_id"],
            "category_id": a["category_id"],
            "bbox": [a["bbox"][0] + a["bbox"][2] / 2, *a["bbox"][1:]],
            "score": 0.9,
        }
        for a in data["annotations"]
    ]
    out = coco_box_ap(coco_gt(data), results)
    assert out["AP"] == 0.0 and out["AP50"] == 0.0
    # shifted by a tenth of the width: IoU = 0.9 / 1.1 = 0.818 -> AP50 = 1, AP = 8/10 thresholds
    results = [
        {**r, "bbox": [a["bbox"][0] + a["bbox"][2] / 10, *a["bbox"][1:]]}
        for r, a in zip(results, data["annotations"], strict=True)
    ]
    out = coco_box_ap(coco_gt(data), results)
    assert out["AP50"] == pytest.approx(1.0)
    assert out["AP"] == pytest.approx(0.7, abs=1e-6)  # hits at IoU .50 ... .80: 7 of 10


def test_coco_ap_empty_and_unknown_ids_do_not_crash():
    gt = coco_gt(_instances())
    assert coco_box_ap(gt, []) == {"AP": 0.0, "AP50": 0.0, "n_detections": 0, "n_dropped": 0}
    unknown = [
        {"image_id": 99, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 1.0},
        {"image_id": 1, "category_id": 77, "bbox": [0, 0, 5, 5], "score": 1.0},
        {"image_id": 1, "category_id": 1, "bbox": [0, 0, 0, 5], "score": 1.0},
    ]
    out = coco_box_ap(gt, unknown)
    assert out["n_dropped"] == 3 and out["AP"] == 0.0
    good = {"image_id": 1, "category_id": 1, "bbox": [10, 10, 30, 20], "score": 0.5}
    out = coco_box_ap(gt, [*unknown, good], image_ids=[1])
    assert out["n_dropped"] == 3 and out["n_detections"] == 1
    # image 1 has one box of each category; only category 1 was found: AP averages categories
    assert out["AP50"] == pytest.approx(0.5)


def test_singular_and_extraction_two_word_names_first():
    assert [singular(w) for w in ["dogs", "buses", "knives", "people", "skis", "glasses"]] == [
        "dog",
        "bus",
        "knife",
        "people",
        "ski",
        "glass",
    ]
    table = ObjectWords.for_categories(["dog", "teddy bear", "hot dog", "bear", "dining table"])
    text = "A teddy bear next to two hot dogs, a puppy and a bear on the table. Dogs!"
    assert extract_objects(text, table) == [
        "teddy bear",
        "hot dog",
        "dog",
        "bear",
        "dining table",
        "dog",
    ]


def test_extraction_of_organism_category_words():
    table = ObjectWords.for_categories(["red_circle", "blue_cross", "red_square"])
    assert extract_objects("red_circle top_left , blue_cross center , red circle", table) == [
        "red_circle",
        "blue_cross",
    ]


def test_chair_hand_computed():
    table = ObjectWords.for_categories(["dog", "cat", "hot dog", "teddy bear", "dining table"])
    truth = {
        1: truth_objects(["dog"], ["A puppy lies on a table."], table),  # dog, dining table
        2: truth_objects(["teddy bear"], [], table),
        3: truth_objects(["cat"], [], table),
    }
    assert truth[1] == {"dog", "dining table"}
    captions = {
        1: "A dog and a cat on a table.",  # dog, cat(x), dining table
        2: "Two teddy bears and a hot dog. The teddy bear smiles.",  # tb, hot dog(x), tb
        3: "A kitten sleeps.",  # cat
    }
    m = chair_metrics(captions, truth, table)
    assert m["mentions"] == 7
    assert m["CHAIR_i"] == pytest.approx(2 / 7)
    assert m["CHAIR_s"] == pytest.approx(2 / 3)
    assert m["recall"] == pytest.approx(4 / 4)  # dog, dining table, teddy bear, cat
    assert m["length"] == pytest.approx((8 + 11 + 3) / 3)


def test_drop_unfinished_sentence():
    assert drop_unfinished("A dog runs. A cat sits on the") == "A dog runs."
    assert drop_unfinished("no full stop here") == "no full stop here"
