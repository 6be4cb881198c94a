"""The video default: a prompt that carries a video is pruned by ``video_pruner`` (``"auto"``:
``diverse`` while ``pruner`` is the default ``fastv``, at any layer), an image
prompt by ``pruner``, each row of a mixed batch by its own; the pruned run still equals the
masked reference; bad values name the option; the command line and ``to_dict`` carry it."""

from __future__ import annotations

import pytest
import torch
from reference import assert_pruned_equals_masked
from tiny_models import make_case, make_model

import vlm_focus as vf
from vlm_focus import cli
from vlm_focus.config import FocusConfig
from vlm_focus.setting import RunSetting

KIND = "qwen2_5_vl"


@pytest.fixture(scope="module")
def model():
    return make_model(KIND)


def _kept(model, inputs, **wrap):
    with torch.no_grad(), vf.wrap(model, **wrap) as handle:
        model(**inputs)
        trace = handle.last_trace
    return trace.kept, trace.pruners


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _mixed(model):
    """A left-padded batch of a video row (12 visual tokens) and an image row (8)."""
    video = make_case(KIND, "video", model, batch=1)
    pair = make_case(KIND, "image", model, batch=2, seed=1)
    first = int(pair["image_grid_thw"][0].prod())  # the first image's patch rows
    image = {key: pair[key][1:] for key in ("input_ids", "attention_mask", "mm_token_type_ids")}
    image |= {
        "pixel_values": pair["pixel_values"][first:],
        "image_grid_thw": pair["image_grid_thw"][1:],
    }
    width = max(video["input_ids"].shape[1], image["input_ids"].shape[1])

    def pad(x, value):
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    out = {
        key: torch.cat([pad(video[key], 0), pad(image[key], 0)])
        for key in ("input_ids", "attention_mask", "mm_token_type_ids")
    }
    for key in ("pixel_values_videos", "video_grid_thw"):
        out[key] = video[key]
    for key in ("pixel_values", "image_grid_thw"):
        out[key] = image[key]
    return out


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_video_prompts_keep_what_diverse_keeps_and_images_what_fastv_keeps(model, keep):
    video = make_case(KIND, "video", model, batch=2)
    image = make_case(KIND, "image", model, batch=2)
    kept, names = _kept(model, video, keep=keep)
    assert names == ["diverse", "diverse"]
    assert _equal(kept, _kept(model, video, keep=keep, pruner="diverse")[0])
    assert not _equal(kept, _kept(model, video, keep=keep, video_pruner=None)[0])
    kept, names = _kept(model, image, keep=keep)
    assert names == ["fastv", "fastv"]
    assert _equal(kept, _kept(model, image, keep=keep, pruner="fastv", video_pruner=None)[0])


def test_video_pruner_none_or_a_name_or_another_pruner_chooses_the_video_pruner(model):
    video = make_case(KIND, "video", model, batch=2)
    image = make_case(KIND, "image", model, batch=2)
    fastv, names = _kept(model, video, video_pruner=None)
    assert names == ["fastv", "fastv"]
    assert _equal(fastv, _kept(model, video, video_pruner="fastv")[0])
    # a pruner the caller names runs on videos too; the default at layer 0 is diverse's
    assert _kept(model, video, pruner="random")[1] == ["random", "random"]
    assert _kept(model, video, layer=0)[1] == ["diverse", "diverse"]
    # a named video pruner runs on videos whatever pruner is, with its own defaults
    temporal, names = _kept(model, video, pruner="random", video_pruner="temporal")
    assert names == ["temporal", "temporal"]
    assert _equal(temporal, _kept(model, video, pruner="temporal")[0])
    assert _kept(model, image, video_pruner="temporal")[1] == ["fastv", "fastv"]


def test_a_mixed_batch_prunes_each_row_with_its_own_pruner(model):
    inputs = _mixed(model)
    kept, names = _kept(model, inputs, keep=0.5)
    assert names == ["diverse", "fastv"]
    diverse = _kept(model, inputs, keep=0.5, pruner="diverse")[0]
    fastv = _kept(model, inputs, keep=0.5, video_pruner=None)[0]
    assert torch.equal(kept[0], diverse[0]) and torch.equal(kept[1], fastv[1])
    assert not torch.equal(kept[0], fastv[0]) and not torch.equal(kept[1], diverse[1])
    assert [len(k) for k in kept] == [6, 4]  # each row its own share


@pytest.mark.parametrize(
    "kind,case,attn",
    [
        (KIND, "video", "sdpa"),
        (KIND, "video", "eager"),
        (KIND, "mixed", "sdpa"),
        (KIND, "mixed", "eager"),
        ("qwen3_vl", "video", "sdpa"),
        ("llava_onevision", "video", "sdpa"),
    ],
)
def test_the_video_default_equals_the_masked_reference(kind, case, attn):
    model = make_model(kind, attn=attn)
    inputs = _mixed(model) if case == "mixed" else make_case(kind, "video", model, batch=2)
    trace = assert_pruned_equals_masked(model, inputs, steps=4, keep=0.25, layer=2)
    assert trace.pruners == (["diverse", "fastv"] if case == "mixed" else ["diverse"] * 2)


def test_the_rule_of_pruner_for_video():
    assert FocusConfig().pruner_for_video == "diverse"
    assert FocusConfig(layer=(2, 8), keep=(0.5, 0.25)).pruner_for_video == "diverse"
    assert FocusConfig(layer=0).pruner_for_video == "diverse"
    assert FocusConfig(pruner="text").pruner_for_video == "text"
    assert FocusConfig(video_pruner=None).pruner_for_video == "fastv"
    assert FocusConfig(pruner="text", video_pruner="temporal").pruner_for_video == "temporal"
    assert FocusConfig(pruner="fixation").pruner_for_video == "fixation"


def test_bad_video_pruner_values_name_the_option(model):
    with pytest.raises(TypeError, match="video_pruner must be a pruner name"):
        FocusConfig(video_pruner=3)
    with pytest.raises(ValueError, match="video_pruner='' is empty"):
        FocusConfig(video_pruner=" ")
    with pytest.raises(ValueError, match="video_pruner='nope': unknown pruner 'nope'"):
        vf.wrap(model, video_pruner="nope")
    with pytest.raises(ValueError, match="video_pruner='fixation' chooses per decoding step"):
        vf.wrap(model, video_pruner="fixation")
    with pytest.raises(ValueError, match="pruner='fixation' chooses per decoding step.*None"):
        vf.wrap(model, pruner="fixation", video_pruner="diverse")
    # the default stands aside for a decode-time pruner: it runs every prompt
    vf.wrap(model, pruner="fixation").remove()


def test_command_line_to_dict_and_run_tag_carry_it():
    assert cli.parse(["run"]).focus().video_pruner == "auto"
    assert cli.parse(["run", "--video-pruner", "none"]).focus().video_pruner is None
    assert cli.parse(["run", "--video-pruner", "temporal"]).focus().video_pruner == "temporal"
    for config in (FocusConfig(), FocusConfig(video_pruner=None), FocusConfig(video_pruner="pool")):
        assert FocusConfig(**config.to_dict()) == config
    assert RunSetting(focus=FocusConfig()).tag == "fastv-k0.25-l2"
    assert RunSetting(focus=FocusConfig(video_pruner=None)).tag == "fastv-k0.25-l2-vNone"


def test_harness_model_args_read_it_and_check_it_before_loading():
    from vlm_focus.integrations.model_args import parse_focus_args

    assert parse_focus_args({"video_pruner": "none"}).config().video_pruner is None
    assert parse_focus_args({"keep": "0.5"}).config().pruner_for_video == "diverse"
    assert parse_focus_args({"video_pruner": "temporal"}).config().pruner_for_video == "temporal"
    with pytest.raises(ValueError, match="video_pruner='nope': unknown pruner"):
        parse_focus_args({"video_pruner": "nope"})
