"""Model adapters lay each image's tokens on the right 2-D grid, checked against the models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import IMAGE, make_inputs, make_model

import vlm_focus as vf
from vlm_focus.model_adapters import get_adapter


def _layout(kind, batch=2):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=batch)
    adapter = get_adapter(model)
    return model, inputs, adapter.layout(model, inputs["input_ids"], inputs)


def test_llava_square_grid():
    model, inputs, layout = _layout("llava")
    for b, images in enumerate(layout):
        (image,) = images
        assert image.grids == [(4, 4)]
        assert torch.equal(
            image.positions, torch.nonzero(inputs["input_ids"][b] == IMAGE).flatten()
        )
        assert image.cells[5].tolist() == [0, 1, 1]  # row-major: token 5 = row 1, col 1


def test_llava_next_newlines_and_unpadded_grid_match_the_model():
    model, inputs, layout = _layout("llava_next")
    with torch.no_grad():
        features = model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"]
        ).pooler_output
    newline = model.model.image_newline
    for b, images in enumerate(layout):
        (image,) = images
        assert image.cells.shape[0] == features[b].shape[0]
        is_newline = (image.cells[:, 0] == 1) & (image.cells[:, 1] < 0)
        # the model's newline embedding sits exactly where the layout says
        matches = (features[b] == newline).all(-1)
        assert torch.equal(matches, is_newline)
        (h, w) = image.grids[1]
        assert int(is_newline.sum()) == h
        hires = image.cells[(image.cells[:, 0] == 1) & (image.cells[:, 1] >= 0)]
        assert hires[:, 1].max() == h - 1 and hires[:, 2].max() == w - 1
    # 40x70 (wide) image: unpadding removes rows, so the hi-res grid is wider than tall.
    assert layout[0][0].grids[1][1] > layout[0][0].grids[1][0]
    assert layout[1][0].grids[1][0] > layout[1][0].grids[1][1]  # 64x30 is tall


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_merged_grid_from_image_grid_thw(kind):
    model, inputs, layout = _layout(kind)
    assert layout[0][0].grids == [(4, 3)] and layout[1][0].grids == [(2, 4)]
    assert layout[0][0].cells[-1].tolist() == [0, 3, 2]
    for b, images in enumerate(layout):
        ids = inputs["input_ids"][b]
        assert torch.equal(images[0].positions, torch.nonzero(ids == IMAGE).flatten())


def test_qwen_two_images_in_one_row_are_split_by_grid():
    model = make_model("qwen2_vl")
    ids = torch.tensor([[1, 122] + [IMAGE] * 6 + [123, 5, 122] + [IMAGE] * 2 + [123, 7]])
    inputs = {"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 4]])}
    (row,) = get_adapter(model).layout(model, ids, inputs)
    assert [im.grids for im in row] == [[(2, 3)], [(1, 2)]]
    assert row[1].positions.tolist() == [11, 12]
    with pytest.raises(ValueError, match="image_grid_thw"):
        get_adapter(model).layout(model, ids, {"image_grid_thw": torch.tensor([[1, 4, 6]])})


def test_unknown_model_type_lists_supported_and_registration_works():
    model = make_model("llava")
    model.config.model_type = "my_vlm"
    with pytest.raises(
        ValueError,
        match=(
            "supported: gemma3, gemma4, internvl, llava, llava_next, llava_onevision, .*qwen2_vl, "
            "qwen3_5, qwen3_5_moe, qwen3_vl"
        ),
    ):
        vf.wrap(model)
    llava = get_adapter(make_model("llava"))
    vf.register_adapter(dataclasses.replace(llava, model_type="my_vlm"))
    try:
        assert "my_vlm" in vf.supported_models()
        inputs = make_inputs("llava", model)
        with vf.wrap(model, keep=4, layer=1) as handle:
            model(**inputs)
        assert handle.last_trace.n_kept == [4]
        with pytest.raises(ValueError, match="already registered"):
            vf.register_adapter(dataclasses.replace(llava, model_type="my_vlm"))
    finally:
        from vlm_focus.model_adapters import _ADAPTERS

        _ADAPTERS.pop("my_vlm")


def test_every_supported_class_has_a_tiny_config_and_others_are_named():
    from vlm_focus import supported_models
    from vlm_focus.model_adapters.tiny import tiny_config, tiny_types

    assert tiny_types() == sorted(supported_models())
    config = tiny_config("llava", text=dict(num_hidden_layers=3))
    assert config.model_type == "llava" and config.text_config.num_hidden_layers == 3
    rope = tiny_config("qwen3_vl", text=dict(rope_parameters={"rope_theta": 1e6}))
    rope = rope.text_config.rope_parameters  # an override names only what it changes
    assert rope["rope_theta"] == 1e6 and rope["mrope_interleaved"] is True
    assert rope["mrope_section"] == [2, 3, 3]
    with pytest.raises(
        ValueError,
        match="model_type='gpt2' has no tiny config; allowed: gemma3, gemma4, internvl, llava",
    ):
        tiny_config("gpt2")


def test_adapters_declare_their_processors_arithmetic():
    """Each adapter names the resize rule its processor follows; geometry does the arithmetic,
    refuses a processor without a rule, and an adapter with an unknown rule does not build."""
    from vlm_focus import geometry as geo
    from vlm_focus.model_adapters import ImageLayout
    from vlm_focus.model_adapters.base import grid_cells

    rules = {name: get_adapter(make_model(name)).processor_rule for name in ("llava", "qwen2_vl")}
    assert rules == {"llava": "single", "qwen2_vl": "dynamic"}
    llava = get_adapter(make_model("llava"))
    layout = ImageLayout(torch.arange(4), grid_cells(2, 2), [(2, 2)])
    size = geo.Size(90, 60)
    assert llava.frames(layout, size) == [geo.Frame(15.0, 0.0, 60.0, 60.0)]  # fallback: crop
    assert llava.frames(layout, size, rule="pad") == [geo.rule_frame(size, "pad")]
    processor = type("Processor", (), {"do_resize": True, "size": {"shortest_edge": 4}})()
    with pytest.raises(ValueError, match="needs processor_rule="):
        geo.view_frames(layout, size, processor=processor)
    with pytest.raises(ValueError, match="processor_rule='tiles'; allowed"):
        dataclasses.replace(llava, processor_rule="tiles")


def test_video_and_mask_rule_are_declared_and_match_the_classes():
    """``video`` is what the real class can do (its base model encodes videos, its config names
    a video token); every built-in adapter's mask is causal but Gemma 3's (bidirectional image
    blocks) and Gemma 4's (the same, on its sliding-window layers only); an unknown rule does
    not build, and ``allowed_keys`` refuses one it has no branch for."""
    from vlm_focus.core.attention import MASK_RULES, allowed_keys
    from vlm_focus.model_adapters.tiny import tiny_model

    for name in vf.supported_models():
        model = tiny_model(name)
        adapter = get_adapter(model)
        # the base model encodes (Gemma 4's top-level class does not forward the method)
        reads_videos = hasattr(model.model, "get_video_features")
        assert adapter.video == reads_videos, name
        assert (adapter.token_ids(model)[1] is not None) == reads_videos, name
        rules = {"gemma3": "image_blocks", "gemma4": "window_image_blocks"}
        rule = rules.get(name, "causal")
        assert adapter.mask_rule == rule, name
    assert vf.supported_models(video=True) == [
        "gemma4",
        "llava_onevision",
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
    ]
    llava = get_adapter(make_model("llava"))
    assert MASK_RULES == ("causal", "image_blocks", "window_image_blocks")
    with pytest.raises(ValueError, match="mask_rule='sliding_window'; allowed"):
        dataclasses.replace(llava, mask_rule="sliding_window")
    with pytest.raises(ValueError, match="declares video=True but no video_token_attrs"):
        dataclasses.replace(llava, video=True)
    valid = torch.tensor([[False, True, True, True]])
    query = torch.tensor([[2, 3]])
    expected = torch.tensor([[[False, True, True, False], [False, True, True, True]]])
    assert torch.equal(allowed_keys(valid, query, rule="causal"), expected)
    with pytest.raises(ValueError, match="mask_rule='bidirectional_images'; allowed"):
        allowed_keys(valid, query, rule="bidirectional_images")


def test_an_adapter_without_static_cache_support_refuses_one_and_keeps_working():
    """Every built-in class prunes on a static cache; an adapter registered with
    ``static_cache=False`` refuses one with a message that names the way that works, and the
    handle still prunes on the default dynamic cache."""
    model = make_model("llava")
    model.config.model_type = "my_dynamic_vlm"
    llava = get_adapter(make_model("llava"))
    vf.register_adapter(dataclasses.replace(llava, model_type="my_dynamic_vlm", static_cache=False))
    try:
        assert "my_dynamic_vlm" not in vf.supported_models(static_cache=True)
        inputs = make_inputs("llava", model)
        with torch.no_grad(), vf.wrap(model, keep=4, layer=1) as handle:
            with pytest.raises(ValueError, match="static cache.*use the default dynamic cache"):
                model.generate(**inputs, max_new_tokens=2, cache_implementation="static")
            model(**inputs)
        assert handle.last_trace.n_kept == [4]
    finally:
        from vlm_focus.model_adapters import _ADAPTERS

        _ADAPTERS.pop("my_dynamic_vlm")
