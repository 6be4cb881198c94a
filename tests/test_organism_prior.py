"""organism-prior's training text: truthful long captions in reading order with each companion
after its anchor, text-only rows equal to the processor's, and batches whose images match
their rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from organism.answering import picture
from organism.prior import (
    PRIOR,
    PriorBatcher,
    caption_ids,
    long_caption,
    reading_order,
)
from organism.prior_checks import painted_out, probe_scenes
from organism.questions import IGNORE
from organism.scenes import CATEGORIES, Scene, SceneObject, cooccur_scene, unmet_companions
from organism.vocab import IMAGE, SPECS, build_processor, encode


def _scene(*objects: tuple[str, float, float]) -> Scene:
    return Scene(7, [SceneObject(CATEGORIES.index(c), x, y, 16) for c, x, y in objects])


def test_reading_order_is_by_band_then_left_to_right_with_companions_after_anchors():
    anchor, companion = (CATEGORIES[c] for c in PRIOR.pairs[0])
    scene = _scene(
        ("red_square", 150, 20),  # top band, right
        (companion, 20, 170),  # bottom band: moved after its anchor
        ("orange_square", 30, 25),  # top band, left
        (anchor, 100, 100),  # middle band
    )
    assert [scene.objects[i].name for i in reading_order(scene)] == [
        "orange_square",
        "red_square",
        anchor,
        companion,
    ]


def test_long_captions_name_exactly_the_scene_and_run_long():
    lengths = []
    rng = np.random.default_rng(0)
    for seed in range(60):
        scene = cooccur_scene(10_000_000 + seed, PRIOR, n_objects=int(rng.integers(3, 6)))
        text = long_caption(scene)
        named = [w for w in text.split() if w in CATEGORIES]
        assert sorted(named) == sorted(o.name for o in scene.objects)  # truthful, complete
        lengths.append(len(encode(text)))
    assert np.mean(lengths) >= 40


@pytest.mark.parametrize("with_image", [False, True])
def test_caption_rows_equal_the_processors_ids(with_image):
    processor = build_processor(SPECS["deep"])
    scene = cooccur_scene(10_000_003, PRIOR, n_objects=4)
    content = [{"type": "text", "text": "Describe the image."}]
    if with_image:
        content.insert(0, {"type": "image"})
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    kwargs = {"images": [picture(scene)]} if with_image else {}
    ids = processor(text=[text], return_tensors="pt", **kwargs)["input_ids"][0].tolist()
    row, labels = caption_ids(scene, SPECS["deep"].n_visual if with_image else 0)
    assert row[: len(ids)] == ids
    assert labels[: len(ids)] == [IGNORE] * len(ids)
    assert labels[len(ids) :] == row[len(ids) :]  # the loss is on the caption and its <eos>


def test_batches_hold_one_image_per_image_row():
    batcher = PriorBatcher(SPECS["deep"].n_visual, seed=1)
    batch = batcher.batch(12, {"caption": 0.4, "presence": 0.3, "text_caption": 0.3})
    image_rows = (batch["input_ids"] == IMAGE).any(1)
    assert 0 < int(image_rows.sum()) < 12
    assert batch["pixel_values"].shape[0] == int(image_rows.sum())
    assert int((batch["input_ids"] == IMAGE).sum()) == batch["pixel_values"].shape[0] * 144
    text_only = batcher.batch(4, {"text_caption": 1.0})
    assert "pixel_values" not in text_only
    assert torch.equal(text_only["attention_mask"], (text_only["input_ids"] != 0).long())


def test_probe_scenes_painted_out_lose_only_their_unmet_anchors():
    for scene in probe_scenes(6):
        anchors = {i for i, _ in unmet_companions(scene, PRIOR)}
        painted = painted_out(scene)
        kept = [o for i, o in enumerate(scene.objects) if i not in anchors]
        assert painted.objects == kept and painted.seed == scene.seed
        assert not unmet_companions(painted, PRIOR)
