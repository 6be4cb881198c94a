"""Organism models: processor/tokenizer consistency, a training smoke run, the shipped models."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from organism import build_prompt, default_model_path, guide_model_path  # noqa: E402
from organism.data import Batcher, chat_ids, patch_labels, pixel_values  # noqa: E402
from organism.questions import IGNORE, QA  # noqa: E402
from organism.scenes import generate_scene  # noqa: E402
from organism.vocab import (  # noqa: E402
    EOS,
    NO,
    SPECS,
    UNK,
    YES,
    build_config,
    build_processor,
    encode,
)


def _messages(question: str, answer: str | None = None) -> list[dict]:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return msgs


def test_training_ids_equal_processor_ids():
    from PIL import Image

    spec = SPECS["default"]
    processor = build_processor(spec)
    scene = generate_scene(11, n_objects=3)
    question = (
        "Is there an orange_cross in the image?\nAnswer the question using a single word or phrase."
    )
    text = processor.apply_chat_template(_messages(question, "no"))
    inputs = processor(images=Image.fromarray(scene.image()), text=text, return_tensors="pt")
    ids, labels = chat_ids([QA("presence", question, "no", [])], spec.n_visual)
    assert inputs["input_ids"][0].tolist() == ids
    assert labels[-2:] == encode("no") + [EOS] and set(labels[:-2]) == {IGNORE}
    assert UNK not in ids
    # Equal on the PIL back end (no torchvision); torchvision's back end rounds the
    # normalisation differently, by at most 2.4e-7 on these scenes.
    torch.testing.assert_close(inputs["pixel_values"], pixel_values([scene]), rtol=0, atol=1e-6)
    prompt = processor.apply_chat_template(
        _messages("Is there a red_circle in the image?"), add_generation_prompt=True
    )
    assert prompt == build_prompt("Is there a red_circle in the image?")


def test_patch_labels_follow_masks():
    scene = generate_scene(4, n_objects=2)
    labels = patch_labels(scene, 16).reshape(12, 12)
    for o in scene.objects:
        cover = o.mask().reshape(12, 16, 12, 16).mean(axis=(1, 3))
        assert np.all(labels[cover >= 0.5] == o.category + 1)
    assert (labels == 0).mean() > 0.5


def test_training_smoke_reduces_loss():
    from transformers import LlavaForConditionalGeneration

    from organism.llava_train import train_lm, train_vision
    from organism.recipe import StageConfig

    torch.manual_seed(0)
    spec = SPECS["tiny"]
    model = LlavaForConditionalGeneration(build_config(spec))
    batcher = Batcher(spec.n_visual, spec.patch, seed=0)
    losses: dict[str, list[float]] = {"vision": [], "chat": []}

    def log(stage, step, seconds, values):
        losses[stage].append(values["loss"])

    train_vision(
        model, spec, StageConfig("vision", 12, 2.0, 5e-3, batch=8, warmup=1), batcher, log, 1
    )
    assert not any(p.requires_grad for p in model.model.vision_tower.parameters())
    stage = StageConfig(
        "chat", 25, 2.0, 5e-3, batch=8, warmup=1, mix={"presence": 1.0}, turns=(1, 2)
    )
    train_lm(model, stage, batcher, None, log, every=1000, log_every=1)
    v, c = losses["vision"], losses["chat"]
    assert len(v) == 12 and len(c) == 25
    assert np.mean(v[-3:]) < 0.8 * np.mean(v[:3])
    assert np.mean(c[-5:]) < 0.5 * np.mean(c[:3])


def _fixed(path):
    return json.loads((path / "fixed_questions.json").read_text())


@pytest.mark.parametrize("which", ["default", "guide"])
def test_shipped_model_answers_fixed_questions(which):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from organism.answering import answer
    from organism.pope import parse_yes_no

    path = default_model_path() if which == "default" else guide_model_path()
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    assert model.config.image_seq_length == SPECS[which].n_visual
    fixed = _fixed(path)
    rows = fixed["questions"]
    assert len(rows) == 20
    scenes = [generate_scene(r["image_id"]) for r in rows]
    answers = answer(model, processor, scenes, [r["text"] for r in rows])
    parsed = [parse_yes_no(a) for a in answers]
    assert all(ok for _, ok in parsed)
    accuracy = np.mean([p == r["label"] for (p, _), r in zip(parsed, rows, strict=True)])
    assert abs(accuracy - fixed["reported_accuracy"]) <= 0.05 + 1e-9


def test_default_model_answers_with_yes_or_no_and_grid_matches():
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = default_model_path()
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    scene = generate_scene(_fixed(path)["questions"][0]["image_id"])
    prompt = build_prompt(f"Is there a {scene.objects[0].name} in the image?")
    inputs = processor(images=Image.fromarray(scene.image()), text=prompt, return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_index).sum()) == 144
    with torch.no_grad():
        probs = model(**inputs).logits[0, -1].softmax(-1)
    assert float(probs[YES] + probs[NO]) > 0.9


def test_hidden_patches_spare_every_object_an_answer_needs():
    from organism.data import hidden_patches
    from organism.questions import relation_qa, where_qa

    rng = np.random.default_rng(0)
    for seed in range(30):
        scene = generate_scene(seed, n_objects=4)
        qas = [q for q in (relation_qa(scene, rng), where_qa(scene, rng)) if q is not None]
        needed = {i for q in qas for i in q.objects}
        hide = hidden_patches(scene, qas, 16, rng).reshape(12, 12)
        for i, o in enumerate(scene.objects):
            touched = o.mask().reshape(12, 16, 12, 16).any(axis=(1, 3))
            if i in needed:
                assert not hide[touched].any()
        assert hide.any()


def test_rows_with_hidden_patches_mask_only_image_tokens():
    from organism.vocab import IMAGE, PAD

    batch = Batcher(144, 16, seed=1).text(8, "chat", {"presence": 1.0}, (1, 2), hide_share=1.0)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    assert torch.equal(mask | (ids == IMAGE), ids != PAD)
    assert (~mask & (ids == IMAGE)).any()


def test_copy_target_points_from_the_answer_position_to_the_last_category():
    from organism.data import copy_target
    from organism.questions import caption_qa
    from organism.vocab import TOKEN_ID

    question = "Is the red_circle left of the blue_square?"
    ids, _ = chat_ids([QA("relation", question, "yes", [])], 4)
    q, k = copy_target(ids)
    assert ids[q] == TOKEN_ID[":"] and ids[q - 1] == TOKEN_ID["assistant"]
    assert ids[k] == TOKEN_ID["blue_square"] and q == len(ids) - 3  # then "yes" <eos>
    caption_ids, _ = chat_ids([caption_qa(generate_scene(3))], 4)
    assert copy_target(caption_ids) is None


def test_query_labels_put_the_answer_after_the_category_token():
    from organism.vocab import TOKEN_ID

    ids, labels = chat_ids(
        [QA("presence", "Is there a red_circle in the image?", "no", [])], 4, query_labels=True
    )
    cat = ids.index(TOKEN_ID["red_circle"])
    assert labels[cat + 1] == NO and labels[-2:] == [NO, EOS]
    assert sum(lab != IGNORE for lab in labels) == 3


@pytest.mark.parametrize("form", ["cat_last", "chat"])
def test_position_and_relation_targets_name_the_right_tokens(form):
    from organism.questions import CATEGORY_IDS
    from organism.scenes import CATEGORIES, RELATIONS

    batcher = Batcher(4, 16, seed=3)
    state = batcher.rng.bit_generator.state  # to re-draw the batch's scenes below
    batch = batcher.text(6, form, {"relation": 0.6, "where": 0.2, "presence": 0.2}, (3, 3))
    batcher.rng.bit_generator.state = state
    scenes = batcher.scenes(6)
    ids = batch["input_ids"]
    places, relations = batch["position_targets"], batch["relation_targets"]
    assert len(places) > 0 and len(relations) > 0
    for row, pos, x, y in places.tolist():
        token = int(ids[int(row), int(pos)])
        assert token in CATEGORY_IDS
        obj = scenes[int(row)].find(CATEGORIES.index(_name(token)))
        assert (x, y) == pytest.approx((2 * obj.cx / 192 - 1, 2 * obj.cy / 192 - 1), abs=1e-5)
    for row, second, first, x, y, word in relations.tolist():
        assert first < second and int(ids[int(row), int(first)]) in CATEGORY_IDS
        assert int(ids[int(row), int(second)]) in CATEGORY_IDS
        between = [_name(int(t)) for t in ids[int(row), int(first) + 1 : int(second)]]
        assert RELATIONS[int(word)] in between
        assert [p for p in places.tolist() if p[:2] == [row, first]][0][2:] == [x, y]


def _name(token: int) -> str:
    from organism.vocab import VOCAB

    return VOCAB[token]


def test_relation_and_pointer_losses_train():
    from transformers import LlavaForConditionalGeneration

    from organism.llava_train import train_lm, train_vision
    from organism.recipe import StageConfig

    torch.manual_seed(0)
    spec = SPECS["tiny"]
    model = LlavaForConditionalGeneration(build_config(spec))
    batcher = Batcher(spec.n_visual, spec.patch, seed=0)
    vision = StageConfig("vision", 12, 2.0, 5e-3, batch=8, warmup=1)
    train_vision(model, spec, vision, batcher, lambda *a: None, 1)  # patches learn where they are
    terms: list[float] = []
    stage = StageConfig(
        "chat", 30, 2.0, 5e-3, batch=8, warmup=1, mix={"relation": 0.5, "caption": 0.5}
    )
    stage.relation_weight = stage.pointer_weight = 1.0
    train_lm(model, stage, batcher, None, lambda *a: terms.append(a[3]), 1000, 1)
    assert len(terms) == 30
    for name in (
        "grid_loss",
        "place_loss",
        "relation_attention_loss",
        "carry_loss",
        "word_loss",
        "pointer_loss",
    ):
        values = [t[name] for t in terms if name in t]
        assert len(values) >= 20 and all(np.isfinite(values)), name
    pointer = [t["pointer_loss"] for t in terms if "pointer_loss" in t]
    assert np.mean(pointer[-5:]) < 0.9 * np.mean(pointer[:3])
    assert model.config.text_config._attn_implementation == "sdpa"  # restored after the stage


def test_relation_terms_reach_the_parts_they_train():
    from transformers import LlavaForConditionalGeneration

    from organism.losses import RelationProbe, relation_loss
    from organism.vocab import IMAGE

    torch.manual_seed(0)
    spec = SPECS["tiny"]
    model = LlavaForConditionalGeneration(build_config(spec))
    model.set_attn_implementation("eager")
    batch = Batcher(spec.n_visual, spec.patch, seed=0).text(
        4, "cat_last", {"relation": 1.0}, (3, 3)
    )
    places, relations = batch.pop("position_targets"), batch.pop("relation_targets")
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=batch["pixel_values"],
        output_attentions=True,
        output_hidden_states=True,
    )
    probe = RelationProbe(spec.text_hidden)
    terms = relation_loss(
        probe, out.hidden_states, out.attentions, places, relations, batch["input_ids"] == IMAGE
    )
    layers = model.model.language_model.layers
    reaches = {
        "grid": model.model.multi_modal_projector.linear_2.weight,
        "place": layers[0].self_attn.v_proj.weight,
        "relation_attention": layers[1].self_attn.k_proj.weight,
        "carry": layers[1].self_attn.v_proj.weight,
        "word": layers[1].self_attn.q_proj.weight,
    }
    for name, weight in reaches.items():
        (grad,) = torch.autograd.grad(terms[name], weight, retain_graph=True)
        assert grad.abs().sum() > 0, name


def test_caption_pointer_targets_point_at_the_object_named_next():
    from organism.data import object_patches
    from organism.scenes import CATEGORIES
    from organism.vocab import IMAGE

    batcher = Batcher(144, 16, seed=5)
    state = batcher.rng.bit_generator.state  # to re-draw the batch's scenes below
    batch = batcher.text(4, "chat", {"caption": 1.0}, (1, 1))
    batcher.rng.bit_generator.state = state
    scenes = batcher.scenes(4)
    ids, targets, masks = batch["input_ids"], batch["pointer_targets"], batch["pointer_masks"]
    assert len(targets) == sum(len(s.objects) for s in scenes)
    for (row, pos, start), mask in zip(targets.tolist(), masks, strict=True):
        assert ids[row, start] == IMAGE and ids[row, start - 1] != IMAGE
        index = scenes[row].categories.index(CATEGORIES.index(_name(int(ids[row, pos + 1]))))
        assert torch.equal(mask, torch.from_numpy(object_patches(scenes[row], index, 16)))
    positions = batch["position_targets"]
    assert {(int(r), int(p) - 1) for r, p, *_ in positions.tolist()} == {
        (r, p) for r, p, _ in targets.tolist()
    }
