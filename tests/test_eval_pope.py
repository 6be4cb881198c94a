"""POPE question building on a small COCO-format set: labels, the three negative rules, counts,
seeds, and reading question files; ``evaluate`` on the embedded organism: one answer per
distinct prompt, equal to the prompt answered alone, parsed and scored per split."""

import json
from collections import Counter

import pytest
import torch
from PIL import Image

from organism.scenes import coco_instances, generate_scene
from vlm_focus.eval import generation
from vlm_focus.eval.metrics import parse_yes_no, pope_metrics
from vlm_focus.eval.pope import (
    build_questions,
    evaluate,
    question_text,
    read_questions,
    select_images,
    summarise,
    write_questions,
)
from vlm_focus.setting import RunSetting


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


# --- evaluate(): POPE rows answered under a run setting --------------------------------------


@pytest.fixture(scope="module")
def organism():
    """The embedded organism model, its processor, three held-out scenes by seed and their POPE
    rows of two splits (the same images and positives in both)."""
    from organism.pope import pope_eligible, pope_questions
    from vlm_focus.loading import load_model

    model, processor = load_model(None, dtype=torch.float32)
    scenes = pope_eligible(3)
    rows = [
        {**r, "split": split}
        for split in ("random", "adversarial")
        for r in pope_questions(scenes, split)
    ]
    return model, processor, {s.seed: s for s in scenes}, rows


def _reader(scenes):
    def read(row):
        return Image.fromarray(scenes[row["image_id"]].image())

    return read


def _key(record):
    return record["split"], record["question_id"]


def test_evaluate_answers_each_prompt_once_and_scores_each_split(organism, monkeypatch):
    model, processor, scenes, rows = organism
    setting = RunSetting(max_new_tokens=2)
    reference = generation.Generator(model, processor, setting)
    distinct = sorted({(r["image_id"], r["text"]) for r in rows})
    alone = {  # each prompt answered by itself, batch of one
        (i, text): reference([_reader(scenes)({"image_id": i})], [text])[0][0]
        for i, text in distinct
    }
    asked, batches = [], []
    original = generation.Generator.__call__

    def counting(self, images, prompts, **kwargs):
        asked.extend(prompts)
        return original(self, images, prompts, **kwargs)

    monkeypatch.setattr(generation.Generator, "__call__", counting)
    result = evaluate(
        model,
        processor,
        rows,
        setting,
        images=_reader(scenes),
        suffix="",
        batch_size=5,
        on_batch=batches.append,
    )
    assert len(asked) == len(distinct) < len(rows)  # the shared positives are asked once
    assert len(batches) == -(-len(distinct) // 5)
    assert sorted(_key(r) for b in batches for r in b) == sorted(_key(r) for r in rows)
    for row, record in zip(rows, result.records, strict=True):
        assert _key(record) == _key(row) and record["label"] == row["label"]
        assert record["answer"] == alone[(row["image_id"], row["text"])]
        assert (record["pred"], record["parseable"]) == parse_yes_no(record["answer"])
        assert record["visual_kept"] == record["visual_total"] == 144
    assert list(result.metrics) == ["random", "adversarial"]
    for split, metrics in result.metrics.items():
        records = [r for r in result.records if r["split"] == split]
        assert metrics == summarise(records) and metrics["n"] == 18
        labels, preds = [r["label"] for r in records], [r["pred"] for r in records]
        assert result.scores(split) == {**pope_metrics(labels, preds), "unparseable": 0}
    assert result.metrics["random"]["accuracy"] >= 0.9  # the organism knows its scenes
    assert result.suffix == "" and result.setting == setting.describe()


def test_evaluate_reads_an_image_folder_and_prunes_by_the_setting(organism, tmp_path):
    from vlm_focus.config import FocusConfig, keep_count

    model, processor, scenes, rows = organism
    rows = rows[:6]
    for row in rows:
        _reader(scenes)(row).save(tmp_path / row["image"])
    plain = RunSetting(max_new_tokens=2)
    from_files = evaluate(model, processor, rows, plain, images=tmp_path, suffix="")
    in_memory = evaluate(model, processor, rows, plain, images=_reader(scenes), suffix="")
    assert from_files.records == [
        {**r, "prefill_s": f["prefill_s"], "generate_s": f["generate_s"]}
        for r, f in zip(in_memory.records, from_files.records, strict=True)
    ]
    pruned = RunSetting(focus=FocusConfig(pruner="fastv", keep=0.25, layer=1), max_new_tokens=2)
    result = evaluate(model, processor, rows, pruned, images=tmp_path, suffix="")
    assert {r["visual_kept"] for r in result.records} == {keep_count(0.25, 144)}
    assert result.metrics["random"]["visual_kept"] == keep_count(0.25, 144)
    assert result.metrics["random"]["visual_total"] == 144


def test_evaluate_names_bad_questions(organism):
    model, processor, _, rows = organism
    setting = RunSetting()
    with pytest.raises(ValueError, match=r"questions\[1\] must be a POPE row with question_id"):
        evaluate(model, processor, [rows[0], {"text": "Is there a cat?"}], setting)
    with pytest.raises(ValueError, match=r"questions\[0\]: label must be 'yes' or 'no'"):
        evaluate(model, processor, [{**rows[0], "label": "maybe"}], setting)
    with pytest.raises(ValueError, match="batch_size=0"):
        evaluate(model, processor, rows, setting, batch_size=0)
    with pytest.raises(ValueError, match="split='popular'"):
        evaluate(model, processor, [], setting).scores("popular")
