"""The two-hop task family, its training circuit and the shipped deep organism."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from organism import deep_model_path
from organism.data import Batcher, object_patches
from organism.questions import IGNORE, colour_of, two_hop_qa
from organism.scenes import (
    CATEGORIES,
    RELATION_MARGIN,
    RELATIONS,
    SHAPES,
    Scene,
    SceneObject,
    generate_scene,
    in_direction,
    two_hop_pairs,
    two_hop_target,
)
from organism.vocab import (
    TOKEN_ID,
    TWO_HOP_FORMS,
    VOCAB,
    OrganismSpec,
    build_config,
    encode,
)

RED_CIRCLE, BLUE_SQUARE, GREEN_CROSS, YELLOW_TRIANGLE = (
    CATEGORIES.index(n) for n in ("red_circle", "blue_square", "green_cross", "yellow_triangle")
)


def _scene(*objects: tuple[int, float, float]) -> Scene:
    return Scene(seed=0, objects=[SceneObject(c, x, y, 15.0) for c, x, y in objects])


def test_constructed_scene_has_the_unique_answers_it_should():
    # anchor in the middle, one object clearly left, one clearly right, one clearly below
    s = _scene((RED_CIRCLE, 96, 96), (BLUE_SQUARE, 30, 100), (GREEN_CROSS, 165, 90),
               (YELLOW_TRIANGLE, 100, 170))  # fmt: skip
    assert two_hop_target(s, 0, "left") == 1
    assert two_hop_target(s, 0, "right") == 2
    assert two_hop_target(s, 0, "below") == 3
    assert two_hop_target(s, 0, "above") is None  # nothing up there
    # from the blue_square, everything else lies to its right: not unique
    assert two_hop_target(s, 1, "right") is None


def test_objects_near_the_cone_border_or_twice_in_it_are_never_asked_about():
    # the second object sits on the diagonal of the anchor's left cone: too close to call
    diagonal = _scene((RED_CIRCLE, 120, 96), (BLUE_SQUARE, 40, 100), (GREEN_CROSS, 70, 46))
    assert in_direction(diagonal.objects[2], diagonal.objects[0], "left") is None
    assert two_hop_target(diagonal, 0, "left") is None
    # two objects in the cone: ambiguous
    two = _scene((RED_CIRCLE, 150, 96), (BLUE_SQUARE, 40, 96), (GREEN_CROSS, 95, 100))
    assert two_hop_target(two, 0, "left") is None
    # just inside the margin: still ambiguous; just beyond it: asked
    edge = _scene((RED_CIRCLE, 100, 96), (BLUE_SQUARE, 100 - RELATION_MARGIN + 1, 96))
    assert two_hop_target(edge, 0, "left") is None
    edge.objects[1].cx = 100 - RELATION_MARGIN - 1
    assert two_hop_target(edge, 0, "left") == 1


def test_the_target_depends_on_the_anchor_not_only_on_the_direction():
    # the leftmost object is not the one left of the anchor: it lies below the anchor's cone
    s = _scene((RED_CIRCLE, 150, 40), (BLUE_SQUARE, 90, 45), (GREEN_CROSS, 40, 180))
    assert two_hop_target(s, 0, "left") == 1
    assert min(range(3), key=lambda i: s.objects[i].cx) == 2


def _brute_force_target(scene: Scene, anchor: int, relation: str) -> int | None:
    a = scene.objects[anchor]
    inside, unclear = [], False
    for i, o in enumerate(scene.objects):
        if i == anchor:
            continue
        dx, dy = o.cx - a.cx, o.cy - a.cy
        along = {"left": -dx, "right": dx, "above": -dy, "below": dy}[relation]
        across = abs(dy) if relation in ("left", "right") else abs(dx)
        score = along - across
        unclear |= abs(score) < RELATION_MARGIN
        if score >= RELATION_MARGIN:
            inside.append(i)
    return inside[0] if len(inside) == 1 and not unclear else None


def test_generated_questions_have_unique_correct_answers():
    rng = np.random.default_rng(0)
    seen = set()
    for seed in range(400):
        s = generate_scene(10_000_000 + seed)
        for anchor in range(len(s.objects)):
            for rel in RELATIONS:
                assert two_hop_target(s, anchor, rel) == _brute_force_target(s, anchor, rel)
        qa = two_hop_qa(s, rng)
        if qa is None:
            assert two_hop_pairs(s) == []
            continue
        anchor, target = qa.objects
        assert _brute_force_target(s, anchor, qa.relation) == target
        a, t = s.objects[anchor], s.objects[target]
        assert a.name in qa.question.split()[-1] or f" {a.name} " in qa.question
        seen.add(qa.form)
        if qa.form == "colour":
            assert qa.answer == colour_of(t.category)
        elif qa.form == "category":
            assert qa.answer == t.name and t.name not in qa.question
        elif qa.form == "shape":
            asked = qa.question.rstrip("?").split()[-1]
            assert (asked == SHAPES[t.category % len(SHAPES)]) == (qa.answer == "yes")
        else:
            asked = qa.question.rstrip("?").split()[-1]
            assert (asked == t.name) == (qa.answer == "yes")
        assert all(TOKEN_ID.get(w) is not None for w in qa.question.lower().rstrip("?").split())
    assert seen == set(TWO_HOP_FORMS)


def test_pope_style_negatives_follow_their_split():
    rng = np.random.default_rng(1)
    for seed in range(150):
        s = generate_scene(10_000_000 + seed)
        for split in ("adversarial", "popular", "random"):
            qa = two_hop_qa(s, rng, form="is_category", positive=False, negative=split)
            if qa is None:
                continue
            asked = CATEGORIES.index(qa.question.rstrip("?").split()[-1])
            assert asked != s.objects[qa.objects[1]].category and qa.answer == "no"
            assert (asked in s.categories) == (split == "adversarial")


def test_two_hop_words_keep_every_earlier_token_id():
    assert VOCAB[: TOKEN_ID["where"] + 1][-1] == "where"
    assert TOKEN_ID["what"] == TOKEN_ID["where"] + 1
    assert encode("What colour is the shape left of the red_circle?")[-2] == TOKEN_ID["red_circle"]


# 5 heads (the two-hop circuit uses heads 3 and 4), 4 layers, 4 x 4 visual tokens
TINY = OrganismSpec(
    "organism-tiny-deep", patch=48, vision_hidden=32, vision_layers=1, vision_heads=2,
    text_hidden=40, text_layers=4, text_heads=5, text_mlp=64,
)  # fmt: skip


@pytest.mark.parametrize("form", ["cat_last", "chat"])
def test_hop_targets_name_the_answer_position_anchor_and_target_patches(form):
    batcher = Batcher(TINY.n_visual, TINY.patch, seed=3)
    batch = batcher.text(6, form, {"twohop": 1.0}, (1, 2) if form == "chat" else (3, 4))
    hops, masks = batch["hop_targets"], batch["hop_masks"]
    assert len(hops) > 0 and masks.shape == (len(hops), TINY.n_visual)
    for (row, q, anchor, *_rest, start), mask in zip(hops.long().tolist(), masks, strict=True):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        assert VOCAB[int(ids[anchor])] in CATEGORIES
        assert labels[q] == IGNORE and labels[q + 1] != IGNORE  # q's logits give the answer
        assert int(ids[start]) == TOKEN_ID["<image>"] and int(ids[start - 1]) != TOKEN_ID["<image>"]
        assert mask.any()


def test_hop_masks_are_the_target_objects_patches():
    s = _scene((RED_CIRCLE, 96, 96), (BLUE_SQUARE, 30, 100))
    patches = object_patches(s, 1, 16).reshape(12, 12)
    rows, cols = np.nonzero(patches)
    assert cols.max() < 4 and 4 <= rows.min() and rows.max() <= 7


def test_two_hop_training_smoke_reduces_loss():
    from transformers import LlavaForConditionalGeneration

    from organism.llava_train import train_lm
    from organism.recipe import StageConfig

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(TINY))
    model.model.vision_tower.requires_grad_(False)  # a frozen random tower: the LM stages only
    batcher = Batcher(TINY.n_visual, TINY.patch, seed=0)
    rows: list[dict] = []
    stage = StageConfig(
        "chat", 24, 2.0, 5e-3, batch=6, warmup=1, mix={"twohop": 1.0}, cat_last_share=0.5,
        relation_weight=1.0, hop_weight=1.0, hop_layers=(2, 3),
    )  # fmt: skip
    train_lm(model, stage, batcher, None, lambda *a: rows.append(a[-1]), every=1000, log_every=1)
    assert len(rows) == 24 and all("hop_read_loss" in r for r in rows)
    for key in ("loss", "hop_anchor_attention_loss", "hop_read_loss"):
        values = [r[key] for r in rows]
        assert np.mean(values[-4:]) < 0.8 * np.mean(values[:3]), key


def _fixed():
    return json.loads((deep_model_path() / "fixed_questions.json").read_text())


def test_shipped_deep_model_answers_the_fixed_two_hop_questions():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from organism.answering import answer
    from organism.evaluate_twohop import fixed_two_hop_questions

    path = deep_model_path()
    model = LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    assert model.config.text_config.num_hidden_layers == 8
    fixed = _fixed()
    rows = fixed["questions"]
    assert rows == fixed_two_hop_questions() and len(rows) == 20
    scenes = [generate_scene(r["image_id"]) for r in rows]
    answers = answer(model, processor, scenes, [r["text"] for r in rows])
    acc = np.mean(
        [(a.split() or [""])[0] == r["label"] for a, r in zip(answers, rows, strict=True)]
    )
    assert abs(acc - fixed["reported_accuracy"]) <= 0.05


def test_shipped_deep_model_loads_through_the_library():
    from vlm_focus.loading import load_model

    model, processor = load_model(str(deep_model_path()))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert (
        model.config.image_seq_length == 144
        and processor.tokenizer.convert_tokens_to_ids("colour") == TOKEN_ID["colour"]
    )
