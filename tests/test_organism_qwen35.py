"""organism-qwen35: its hybrid config, two-hop and clip rows through the real Qwen3VLProcessor,
the two-hop and time circuits' targets and losses, a 2-step training run and the evaluation's
arithmetic."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest
import torch

from organism import qwen35_eval, qwen_eval
from organism import qwen_data as q
from organism.architectures import ARCHITECTURES
from organism.clips import GROUPS, TEMPORAL, make_clip
from organism.questions import IGNORE, QA
from organism.vocab import (
    IMAGE_PAD,
    QWEN35_VOCAB,
    QWEN_ID,
    QWEN_VOCAB,
    TOKEN,
    VIDEO_PAD,
    VISION_START,
    Qwen35Spec,
    build_qwen35_config,
    build_qwen35_processor,
    build_qwen_processor,
)

MICRO = Qwen35Spec(
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    text_hidden=32,
    text_layers=4,
    text_heads=2,
    text_kv_heads=1,
    text_head_dim=16,
    text_mlp=64,
    linear_heads=2,
    linear_head_dim=16,
    text_mrope=(2, 1, 1),
)


@pytest.fixture(scope="module")
def processor():
    return build_qwen35_processor()


def _crop_with_two_hop(rng, form):
    for seed in range(200):
        crop = q.cropped_scene(seed)
        qa = q.two_hop_qa(crop.scene, rng, form=form)
        if qa is not None:
            return crop, qa
    raise AssertionError("no crop with a two-hop question")


@pytest.mark.parametrize("layers", [4, 8])
def test_config_keeps_qwen35s_three_to_one_pattern(layers):
    config = build_qwen35_config(dataclasses.replace(Qwen35Spec(), text_layers=layers))
    types = config.text_config.layer_types
    assert config.model_type == "qwen3_5"
    assert types.index("full_attention") == 3
    assert [i for i, t in enumerate(types) if t == "full_attention"] == list(range(3, layers, 4))
    assert types.count("linear_attention") == 3 * layers // 4


def test_config_refuses_a_depth_off_the_pattern():
    with pytest.raises(ValueError, match="multiple of 4"):
        build_qwen35_config(dataclasses.replace(Qwen35Spec(), text_layers=6))


def test_processor_is_qwen35s_and_grids_match_the_crops(processor):
    assert type(processor).__name__ == "Qwen3VLProcessor"
    crop = q.cropped_scene(5)
    rng = np.random.default_rng(0)
    out = q.encode_row(processor, q.Row(crop, [q.image_qa(crop, rng, {"presence": 1})]), "chat")
    _, _, w, h = crop.box
    assert out["image_grid_thw"][0].tolist() == [1, 2 * h // TOKEN, 2 * w // TOKEN]
    assert out["input_ids"][0].tolist().count(IMAGE_PAD) == (h // TOKEN) * (w // TOKEN)


def test_a_saved_processor_reloads_with_the_word_tokenizer(processor, tmp_path):
    # transformers maps qwen3_5 to its own byte-level BPE tokenizer whatever the folder says;
    # that class reads the word vocabulary as unknown pieces, so the loader honours the folder
    from transformers import AutoProcessor

    from vlm_focus.loading import load_processor

    processor.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(build_qwen35_config(MICRO).to_json_string())
    text = q.chat_text(processor, False, "is there a red_circle ?", "yes")
    ids = processor.tokenizer(text)["input_ids"]
    reloaded = load_processor(str(tmp_path))
    assert type(reloaded).__name__ == "Qwen3VLProcessor"
    assert reloaded.tokenizer(text)["input_ids"] == ids
    assert reloaded.tokenizer.padding_side == processor.tokenizer.padding_side
    assert AutoProcessor.from_pretrained(str(tmp_path)).tokenizer(text)["input_ids"] != ids


def test_image_mix_draws_two_hop_questions():
    rng = np.random.default_rng(1)
    crop = next(c for c in map(q.cropped_scene, range(50)) if q.two_hop_qa(c.scene, rng))
    kinds = {q.image_qa(crop, rng, {"presence": 0.5, "twohop": 0.5}).kind for _ in range(40)}
    assert kinds == {"presence", "twohop"}


@pytest.mark.parametrize("form", ["colour", "category", "shape", "is_category"])
def test_two_hop_rows_answer_and_point_at_their_objects(processor, form):
    rng = np.random.default_rng(2)
    crop, qa = _crop_with_two_hop(rng, form)
    for layout in ("cat_last", "chat"):
        out = q.encode_row(processor, q.Row(crop, [qa]), layout, query_labels=True, targets=True)
        ids, labels = out["input_ids"][0].tolist(), out["labels"][0].tolist()
        (hop,) = out["hop_targets"].tolist()
        answering, anchor, x, y, relation, first = hop
        answering, anchor, first = int(answering), int(anchor), int(first)
        # the answer is taught right after the reading position: the question's last word in
        # the category-last form, the prompt's last token in the chat form
        assert QWEN_VOCAB[labels[answering + 1]] == qa.answer
        if layout == "cat_last":
            assert ids[answering] == qa.short[-1]
        else:
            assert answering == len(ids) - 3  # before the answer and <|im_end|>
        assert ids[anchor] == QWEN_ID[crop.scene.objects[qa.objects[0]].name]
        # the lookup starts at the anchor's category token and covers the anchor
        (look,) = out["look_targets"].tolist()
        assert int(look[0]) == anchor and int(look[1]) == first
        (seen,) = out["look_masks"].numpy()
        anchor_grid = q.token_labels(
            [crop.masks()[qa.objects[0]]], [0], (crop.box[3] // TOKEN, crop.box[2] // TOKEN)
        )
        assert seen[: anchor_grid.size][anchor_grid > 0].all()
        assert ids[first] == IMAGE_PAD and ids[first - 1] != IMAGE_PAD
        assert q.RELATIONS[int(relation)] == qa.relation
        # the mask covers the hop-2 object's tokens and nothing past the image
        (mask,) = out["hop_masks"].numpy()
        _, _, w, h = crop.box
        n = (h // TOKEN) * (w // TOKEN)
        assert mask[:n].sum() >= 1 and mask[n:].sum() == 0
        labels_grid = q.token_labels([crop.masks()[qa.objects[1]]], [0], (h // TOKEN, w // TOKEN))
        assert mask[:n][labels_grid > 0].all()
        # the anchor's centre in the circuit's units
        a = crop.scene.objects[qa.objects[0]]
        half = max(q.IMAGE_SIDES) / TOKEN / 2
        assert x == pytest.approx((a.cx - crop.box[0]) / TOKEN / half - 1, abs=1e-5)
        assert y == pytest.approx((a.cy - crop.box[1]) / TOKEN / half - 1, abs=1e-5)


def test_rows_without_two_hop_questions_carry_no_hop_targets(processor):
    rng = np.random.default_rng(3)
    crop = q.cropped_scene(4)
    out = q.encode_row(
        processor, q.Row(crop, [q.image_qa(crop, rng, {"presence": 1})]), "chat", targets=True
    )
    assert out["hop_targets"].shape == (0, 6) and out["hop_masks"].shape == (0, q.MAX_TOKENS)


def test_presence_rows_look_up_the_asked_object(processor):
    rng = np.random.default_rng(5)
    for seed in range(10):
        crop = q.cropped_scene(seed)
        yes, no = q.presence_pair(crop, rng)
        out = q.encode_row(processor, q.Row(crop, [yes, no]), "cat_last", targets=True)
        ids = out["input_ids"][0].tolist()
        (look,) = out["look_targets"].tolist()  # the negative names no object: no lookup
        assert ids[int(look[0])] == yes.short[-1]
        _, _, w, h = crop.box
        labels = q.token_labels([crop.masks()[yes.objects[0]]], [0], (h // TOKEN, w // TOKEN))
        (mask,) = out["look_masks"].numpy()
        assert mask[: labels.size][labels > 0].all() and mask[labels.size :].sum() == 0


def test_look_loss_is_minus_log_mass_on_the_named_tokens():
    from organism.losses import look_loss

    attention = torch.zeros(1, 2, 6, 6)
    attention[0, 1, 5, 2:4] = torch.tensor([0.25, 0.5])  # head 1, from position 5
    targets = torch.tensor([[0.0, 5.0, 2.0]])  # row, q, first image token
    masks = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert look_loss(attention, targets, masks, head=1).item() == pytest.approx(-np.log(0.75))


def test_a_vision_pt_of_another_depth_loads_its_tower_alone(tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    from organism.qwen_train import load_tower

    torch.manual_seed(0)
    four = Qwen3_5ForConditionalGeneration(build_qwen35_config(MICRO))
    eight = Qwen3_5ForConditionalGeneration(
        build_qwen35_config(dataclasses.replace(MICRO, text_layers=8))
    )
    lm_before = {k: v.clone() for k, v in eight.model.language_model.state_dict().items()}
    load_tower(eight, four.state_dict())
    for k, v in four.model.visual.state_dict().items():
        assert torch.equal(eight.model.visual.state_dict()[k], v)
    for k, v in eight.model.language_model.state_dict().items():
        assert torch.equal(lm_before[k], v)
    wide = Qwen3_5ForConditionalGeneration(
        build_qwen35_config(dataclasses.replace(MICRO, vision_hidden=48))
    )
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_tower(eight, wide.state_dict())


def test_hop_read_trains_the_full_attention_layer_and_carry_the_layers_before(processor):
    from transformers import Qwen3_5ForConditionalGeneration

    from organism import qwen_train

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(build_qwen35_config(MICRO))
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    rng = np.random.default_rng(4)
    crop, qa = _crop_with_two_hop(rng, "colour")
    other, qa2 = _crop_with_two_hop(np.random.default_rng(9), "is_category")
    batch = q.collate(
        [
            q.encode_row(processor, q.Row(crop, [qa, qa]), "cat_last", targets=True),
            q.encode_row(processor, q.Row(other, [qa2]), "chat", query_labels=True, targets=True),
        ],
        QWEN_ID["<pad>"],
    )
    assert batch["hop_targets"][:, 0].tolist() == [0, 0, 1]  # row index first
    probe = qwen_train.CircuitProbe(model.config.text_config.hidden_size)
    terms = qwen_train._loss(model, batch, probe, attention=False)
    assert {"answer", "grid", "place", "look", "hop_carry", "hop_word", "hop_read"} <= set(terms)
    # one full-attention layer: no later half for the copy head to run in
    assert not {"copy", "relation_attention"} & set(terms)
    layers = model.model.language_model.layers
    (read,) = torch.autograd.grad(
        terms["hop_read"], layers[3].self_attn.q_proj.weight, retain_graph=True
    )
    assert read.abs().sum() > 0
    (carry,) = torch.autograd.grad(
        terms["hop_carry"], layers[2].linear_attn.in_proj_qkv.weight, retain_graph=True
    )
    assert carry.abs().sum() > 0
    (after,) = torch.autograd.grad(
        terms["hop_carry"], layers[3].mlp.down_proj.weight, retain_graph=True, allow_unused=True
    )
    assert after is None  # read at the input of the full-attention layer


def _clip_rows(processor, seeds=range(6)):
    """One clip row per seed, start / end / first questions in turn, every second one in the
    chat form."""
    rng = np.random.default_rng(11)
    out = []
    for i, seed in enumerate(seeds):
        clip = make_clip(seed)
        kind = ("start", "end", "first")[i % 3]
        form = "chat" if i % 2 else "cat_last"
        qas = [q.video_qa(clip, rng, kind) for _ in range(1 if form == "chat" else 3)]
        out.append(q.encode_row(processor, q.Row(clip, qas), form, query_labels=True, targets=True))
    return out


@pytest.mark.parametrize("form", ["cat_last", "chat"])
def test_a_clip_prompt_tokenizes_without_unknown_pieces(processor, form):
    """Qwen3.5's processor writes each temporal patch's timestamp (`<0.2 seconds>`) before it;
    organism-qwen35's words read it digit by digit. organism-qwen's vocabulary stays as it
    was, and reads the same text as unknown pieces."""
    clip = make_clip(3)
    qa = q.video_qa(clip, np.random.default_rng(0), "end")
    out = q.encode_row(processor, q.Row(clip, [qa]), form)
    ids = out["input_ids"][0].tolist()
    assert QWEN_ID["<unk>"] not in ids
    assert ids.count(VIDEO_PAD) == GROUPS * 49 and ids.count(VISION_START) == GROUPS
    starts = [i for i, t in enumerate(ids) if t == VISION_START]
    for g, at in enumerate(starts):
        stamp = f"{(g * TEMPORAL + (TEMPORAL - 1) / 2) / q.FPS:.1f}"  # the mean frame's second
        assert [QWEN35_VOCAB[t] for t in ids[at - len(stamp) - 3 : at]] == [
            "<",
            *stamp,
            "seconds",
            ">",
        ]
    assert QWEN35_VOCAB[: len(QWEN_VOCAB)] == QWEN_VOCAB
    assert build_qwen35_config().text_config.vocab_size == len(QWEN35_VOCAB)
    qwen = build_qwen_processor()
    assert len(qwen.tokenizer) == len(QWEN_VOCAB)
    text = processor.tokenizer.decode(ids)
    assert QWEN_ID["<unk>"] in qwen.tokenizer(text)["input_ids"]


def test_clip_batches_hold_clips_alone(processor):
    """With `video_batches`, a language batch is all clips or all images, so that an image
    batch is never padded to a clip's length; organism-qwen's recipe mixes them row by row."""
    from organism.qwen_train import QwenBatcher
    from organism.recipe import qwen35_recipe, qwen_recipe

    recipe = qwen35_recipe(0.01)
    chat = dataclasses.replace(recipe.stages[-1], batch=3, mix={"video": 0.5})
    batcher = QwenBatcher(recipe, processor)
    kinds = []
    for _ in range(6):
        batch = batcher.lm_batch(chat)
        videos = int((batch["input_ids"] == VIDEO_PAD).any(1).sum())
        images = int((batch["input_ids"] == IMAGE_PAD).any(1).sum())
        assert (videos, images) in ((3, 0), (0, 3))
        kinds.append(videos > 0)
    assert any(kinds) and not all(kinds)
    assert not qwen_recipe().video_batches and recipe.video_batches
    assert "video" in recipe.probe_kinds
    assert [s.mix.get("video") for s in recipe.stages] == [None, 0.0, 0.15, 0.04]
    # the chat stage's image rows: 70% two-hop
    assert recipe.stages[-1].mix == {"video": 0.04, "presence": 0.3, "twohop": 0.7}


def test_a_clip_batch_trains_one_step_on_the_hybrid(processor):
    """Clip rows on the 8-layer hybrid: each clip token's temporal patch is read after the first
    full-attention layer (layer 3 finds it through M-RoPE); a start / end question's patches are
    gathered by the last full-attention layer (7) from the position that answers, which holds
    the object and the word asked at its input; one AdamW step on the answer and circuit terms
    lowers the loss on the same batch."""
    from transformers import Qwen3_5ForConditionalGeneration

    from organism import qwen_train

    torch.manual_seed(0)
    spec = dataclasses.replace(MICRO, text_layers=8, text_heads=4, text_kv_heads=2)
    model = Qwen3_5ForConditionalGeneration(build_qwen35_config(spec))
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    assert qwen_train._time_layer(model, attention=False) == 4
    batch = q.collate(_clip_rows(processor), QWEN_ID["<pad>"])
    assert len(batch["gather_targets"]) > 0 and len(batch["copy_targets"]) > 0
    probe = qwen_train.CircuitProbe(model.config.text_config.hidden_size)
    terms = qwen_train._loss(model, dict(batch), probe, attention=False)
    assert {"answer", "time", "patch", "fetch", "gather_word", "gather", "seen", "copy"} <= set(
        terms
    )
    assert not {"grid", "place", "look", "hop_read"} & set(terms)  # no image in the batch
    layers = model.model.language_model.layers

    def grad(term: str, weight):
        (g,) = torch.autograd.grad(terms[term], weight, retain_graph=True, allow_unused=True)
        return None if g is None else g.abs().sum()

    assert grad("time", layers[3].self_attn.q_proj.weight) > 0
    assert grad("patch", layers[4].linear_attn.in_proj_qkv.weight) is None
    assert grad("gather_word", layers[6].linear_attn.in_proj_qkv.weight) > 0
    assert grad("gather_word", layers[7].self_attn.q_proj.weight) is None
    assert grad("gather", layers[7].self_attn.q_proj.weight) > 0
    assert grad("fetch", layers[3].self_attn.q_proj.weight) > 0
    assert grad("fetch", layers[4].linear_attn.in_proj_qkv.weight) is None
    assert grad("seen", layers[7].self_attn.v_proj.weight) > 0
    params = [*model.model.language_model.parameters(), *probe.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = sum(terms.values())
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = sum(qwen_train._loss(model, dict(batch), probe, attention=False).values())
    assert after < before


def test_gather_targets_mark_the_named_objects_tokens_in_its_patches(processor):
    """A start / end question about a shown object gathers that object's tokens in the patches
    it is on screen in, from its category token (category-last) or the chat answer's position;
    a question about an object the clip does not show has nothing to gather."""
    from organism.scenes import CATEGORIES

    clip = make_clip(5)
    track = clip.tracks[0]
    name = CATEGORIES[track.category]
    rng, asked = np.random.default_rng(0), {}
    while len(asked) < 2:  # one question about the first track, one about an absent object
        qa = q.video_qa(clip, rng, "end")
        named = next(c for c in CATEGORIES if QWEN_ID[c] == qa.short[-1])
        if named == name or CATEGORIES.index(named) not in clip.categories:
            asked[named == name] = (named, qa)
    rows = [
        (form, cat, q.encode_row(processor, q.Row(clip, [qa]), form, True, True))
        for form in ("cat_last", "chat")
        for cat, qa in asked.values()
    ]
    for form, cat, out in rows:
        targets, masks = out["gather_targets"], out["gather_masks"]
        if cat != name:
            assert targets.shape == (0, 4 + GROUPS)
            continue
        (pos, named, category, word, *on) = targets[0].tolist()
        ids = out["input_ids"][0].tolist()
        assert (category, word) == (track.category, 1)
        assert on == [float(track.start <= g < track.stop) for g in range(GROUPS)]
        assert ids[int(named)] == QWEN_ID[name]
        assert int(pos) == (int(named) if form == "cat_last" else len(ids) - 3)
        per_patch = masks.reshape(GROUPS, -1).sum(1)
        assert ((per_patch > 0).float().tolist()) == on


@pytest.mark.slow  # 4 stages and their probes through the DeltaNet torch fallback: 1-2 min
def test_two_step_training_saves_a_hybrid_model_that_loads(tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    from organism import qwen_train
    from organism.loop import train
    from organism.recipe import default_recipe
    from vlm_focus.loading import load_processor

    build = dataclasses.replace(qwen_train.BUILDS["qwen3_5"], spec=MICRO)
    monkeypatch.setitem(qwen_train.BUILDS, "qwen3_5", build)
    monkeypatch.setattr(qwen_eval, "Probe", functools.partial(qwen_eval.Probe, n=4))
    recipe = default_recipe("qwen35", scale=0.001)
    for stage in recipe.stages:
        stage.steps, stage.batch, stage.minutes = 2, 2, 5.0
    recipe.stages[2].mix["video"] = 0.0  # the category-last stage on images (two-hop rows)
    recipe.stages[3].mix["video"] = 1.0  # and the chat stage on clips alone
    summary = train(recipe, tmp_path, quiet=True)
    assert [s["steps_run"] for s in summary["stages"].values()] == [2, 2, 2, 2]
    assert summary["architecture"] == "qwen3_5" and summary["name"] == "organism-qwen35"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["dtype"] == "float32"
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert next(model.parameters()).dtype == torch.float32
    assert type(load_processor(str(tmp_path))).__name__ == "Qwen3VLProcessor"
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert any("hop_read_loss" in row for row in log)
    assert all("time_loss" in row for row in log if row["stage"] == "chat")
    assert all("video" in row and "cat_last_video" in row for row in log if "twohop" in row)


def test_architecture_record_names_the_qwen35_parts():
    record = ARCHITECTURES["qwen3_5"]
    assert record.part("evaluate") is qwen35_eval.evaluate
    assert record.part("train").__module__ == "organism.qwen_train"
    assert record.part("model_card").__module__ == "organism.qwen35_card"


def _qa(form: str, answer: str) -> QA:
    return QA("twohop", "?", answer, [], (0, 1), relation="left", form=form)


def test_two_hop_score_counts_first_words_per_form():
    qas = [_qa("colour", "red"), _qa("colour", "red"), _qa("colour", "blue"), _qa("shape", "no")]
    answers = ["red", "Red.", "red", "no"]
    out = qwen35_eval.score_two_hop(answers, qas)
    assert out["accuracy"] == pytest.approx(3 / 4) and out["n"] == 4
    assert out["per_form"]["colour"] == {
        "accuracy": pytest.approx(2 / 3),
        "n": 3,
        "majority_baseline": pytest.approx(2 / 3),
    }
    assert out["per_form"]["shape"]["accuracy"] == 1.0
    assert "category" not in out["per_form"]


def test_pope_split_scores_by_the_pope_rule(monkeypatch):
    crops = qwen_eval.heldout_images(3, min_objects=3)
    rows = qwen35_eval.pope_questions([c.scene for c in crops], "random")

    def always(answer):
        return lambda model, processor, media, questions: [answer] * len(questions)

    monkeypatch.setattr(qwen35_eval, "chat_answers", always("yes"))
    out = qwen35_eval.pope_split(None, None, crops, "random")
    assert out["n"] == len(rows) and out["recall"] == 1.0 and out["yes_ratio"] == 1.0
    assert out["accuracy"] == pytest.approx(np.mean([r["label"] == "yes" for r in rows]))
    assert out["unparseable"] == 0
    monkeypatch.setattr(qwen35_eval, "chat_answers", always("maybe"))
    out = qwen35_eval.pope_split(None, None, crops, "random")
    assert out["unparseable"] == len(rows) and out["yes_ratio"] == 1.0  # counted as yes


def test_evaluate_refuses_unknown_measurements(tmp_path):
    with pytest.raises(ValueError, match="pope, twohop, video, video_captions"):
        qwen35_eval.evaluate(tmp_path, only=["relations"])


def test_video_eval_counts_each_kind(monkeypatch):
    """organism-qwen's clip questions, scored per kind: here the first two questions of each
    kind are answered right, the third wrong."""
    clips, qas = qwen_eval.video_set(9)
    assert [qa.kind for qa in qas] == ["first", "start", "end"] * 3
    wrong = {"yes": "no", "no": "yes"}

    def answers(model, processor, media, questions, new_tokens):
        assert media == clips and questions == [qa.question for qa in qas]
        return [
            qa.answer + "." if i < 6 else wrong.get(qa.answer, "yes") for i, qa in enumerate(qas)
        ]

    monkeypatch.setattr(qwen_eval, "chat_answers", answers)
    out = qwen35_eval.video_eval(None, None, n=9)
    assert out["accuracy"] == pytest.approx(6 / 9) and out["n"] == 9
    for kind in qwen_eval.VIDEO_KINDS:
        assert out[f"{kind}_accuracy"] == pytest.approx(2 / 3) and out[f"{kind}_n"] == 3
    only_first = qwen_eval.score_video(["x"], qas[:1])
    assert only_first == {"accuracy": 0.0, "n": 1, "first_accuracy": 0.0, "first_n": 1}


def test_card_has_a_video_row():
    from organism import qwen35_model_path
    from organism.qwen35_card import model_card

    folder = qwen35_model_path()
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["video"] = {"accuracy": 0.9, "n": 300, "first_accuracy": 1.0}
    metrics["video_captions"] = {"precision": 0.5, "n": 200}
    card = model_card("qwen35", metrics, folder)
    assert "| video questions accuracy | >= 85% | 90.0% | met |" in card
    assert "which first 100.0%" in card and "object precision 50.0%" in card
    del metrics["video"]
    assert "| video questions accuracy | >= 85% | n/a | **not met** |" in model_card(
        "qwen35", metrics, folder
    )


def test_chat_answers_labels_stay_ignored_outside_answers(processor):
    rng = np.random.default_rng(5)
    crop, qa = _crop_with_two_hop(rng, "category")
    out = q.encode_row(processor, q.Row(crop, [qa]), "chat")
    labels = out["labels"][0].tolist()
    assert [QWEN_VOCAB[t] for t in labels if t != IGNORE] == [qa.answer, "<|im_end|>"]


def test_eight_layers_look_at_layer_three_and_read_and_copy_at_layer_seven(processor):
    """organism-qwen35's shape: the lookup trains layer 3's attention; the hop-2 read and the
    chat copy train layer 7's, on different heads."""
    from transformers import Qwen3_5ForConditionalGeneration

    from organism import qwen_train

    torch.manual_seed(0)
    spec = dataclasses.replace(MICRO, text_layers=8, text_heads=4, text_kv_heads=2)
    model = Qwen3_5ForConditionalGeneration(build_qwen35_config(spec))
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    crop, qa = _crop_with_two_hop(np.random.default_rng(4), "colour")
    batch = q.collate(
        [q.encode_row(processor, q.Row(crop, [qa]), "chat", query_labels=True, targets=True)],
        QWEN_ID["<pad>"],
    )
    probe = qwen_train.CircuitProbe(model.config.text_config.hidden_size)
    terms = qwen_train._loss(model, batch, probe, attention=False)
    assert {"look", "copy", "hop_read"} <= set(terms)
    layers = model.model.language_model.layers

    def grad(term: str, layer: int):
        weight = layers[layer].self_attn.q_proj.weight
        (g,) = torch.autograd.grad(terms[term], weight, retain_graph=True, allow_unused=True)
        return None if g is None else g.view(spec.text_heads, 2, spec.text_head_dim, -1)[:, 0]

    assert grad("look", 3).abs().sum() > 0 and grad("look", 7) is None
    copy, read = grad("copy", 7), grad("hop_read", 7)
    # each of the two layer-7 terms trains its own head's queries alone
    copy_heads = copy.abs().sum((1, 2)) > 0
    read_heads = read.abs().sum((1, 2)) > 0
    assert copy_heads.sum() == 1 and read_heads.sum() == 1 and not (copy_heads & read_heads).any()


# --- the shipped model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    from organism import qwen35_model_path
    from vlm_focus.loading import load_model

    return load_model(str(qwen35_model_path()))


def test_shipped_organism_is_a_float32_qwen3_5_within_its_size(shipped):
    from organism import qwen35_model_path

    model, processor = shipped
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert next(model.parameters()).dtype == torch.float32
    assert (qwen35_model_path() / "model.safetensors").stat().st_size <= 25e6
    metrics = json.loads((qwen35_model_path() / "metrics.json").read_text())
    assert metrics["pope"]["accuracy"] >= 0.95 and metrics["two_hop"]["accuracy"] >= 0.90


def test_shipped_organism_answers_held_out_presence_and_two_hop(shipped):
    """The first 16 held-out presence and two-hop questions, greedy, through the saved processor
    (the card gives the full measurements)."""
    model, processor = shipped
    rng = np.random.default_rng(0)
    crops = qwen_eval.heldout_images(8)
    qas = [qa for c in crops for qa in q.presence_pair(c, rng)]
    scenes = [c for c in crops for _ in range(2)]
    answers = qwen_eval.chat_answers(model, processor, scenes, [qa.question for qa in qas])
    presence = np.mean([qwen_eval.first_word(a) == qa.answer for a, qa in zip(answers, qas)])
    crops, qas = qwen_eval.two_hop_set(16)
    answers = qwen_eval.chat_answers(model, processor, crops, [qa.question for qa in qas])
    two_hop = np.mean([qwen_eval.first_word(a) == qa.answer for a, qa in zip(answers, qas)])
    assert presence >= 0.9 and two_hop >= 0.75, (presence, two_hop)


def test_run_and_bench_on_the_shipped_organism(tmp_path, capsys):
    """``vlm-focus run`` and ``bench`` on the shipped hybrid checkpoint and a held-out scene:
    pruned at the linear layer 2, it answers a presence question both ways as unpruned."""
    from PIL import Image

    from organism import qwen35_model_path
    from vlm_focus import cli

    crop = qwen_eval.heldout_images(1)[0]
    Image.fromarray(crop.image()).save(tmp_path / "scene.png")
    yes, no = q.presence_pair(crop, np.random.default_rng(0))
    argv = ["--model", str(qwen35_model_path()), "--image", str(tmp_path / "scene.png")]
    for qa in (yes, no):
        run = ["run", *argv, "--prompt", qa.question, "--keep", "0.25", "--layer", "2"]
        assert cli.main([*run, "--repeats", "1", "--max-new-tokens", "2", "--json"]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["model"] == "qwen3_5" and report["pruned"]
        assert 4 * report["visual_kept"] <= report["visual_total"] + 3
        for side in ("unpruned", "pruned"):
            assert qwen_eval.first_word(report[f"answer_{side}"]) == qa.answer, report
    assert cli.main(["bench", *argv, "--keeps", "1.0,0.25", "--repeats", "1"]) == 0
    assert "kept" in capsys.readouterr().out
