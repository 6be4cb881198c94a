"""The demo's request function and overlays, without gradio or a browser.

A tiny random-weight organism model (4 x 4 visual tokens, 2 decoder layers, the organism's real
tokenizer and processor) runs every request in well under a second.
"""

from __future__ import annotations

import re

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlamaConfig, LlamaForCausalLM, LlavaForConditionalGeneration

import vlm_focus as vf
from vlm_focus import grounding
from vlm_focus import hallucination as hal
from vlm_focus.demo import request as req
from vlm_focus.demo.overlays import draw_boxes, heat_overlay, kept_mask_overlay, shade_unseen
from vlm_focus.geometry import Frame, Size
from vlm_focus.grounding import Box
from vlm_focus.loading import build_inputs, decode_new_tokens
from vlm_focus.organism import sample_scene_paths
from vlm_focus.organism.scenes import IMAGE_SIZE, heldout_scenes
from vlm_focus.organism.vocab import SPECS, build_config, build_processor
from vlm_focus.timing import NOTHING_PRUNED

QUESTION = "Is there a red_circle in the image?"
SPEC = SPECS["tiny"]
N_VISUAL = SPEC.n_visual  # 16


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPEC)).eval()
    return model, build_processor(SPEC)


@pytest.fixture(scope="module")
def scene() -> np.ndarray:
    return heldout_scenes(1)[0].image()


@pytest.fixture
def always_present(monkeypatch):
    """Every phrase counts as present (the random tiny model's P(yes) is arbitrary), so its
    boxes are drawn."""
    monkeypatch.setattr(req, "presence_threshold", lambda model: 0.0)


@pytest.fixture
def never_present(monkeypatch):
    monkeypatch.setattr(req, "presence_threshold", lambda model: 1.0)


def run(tiny, image, prompt=QUESTION, **kw):
    model, processor = tiny
    options = dict(pruner="fastv", keep=0.25, layer=1, mitigation="none")
    options.update(kw)
    extra = {k: options.pop(k) for k in ("max_new_tokens", "max_side") if k in options}
    return req.run_request(
        model, processor, image, prompt, **options, **{"max_new_tokens": 4, "repeats": 1, **extra}
    )


# --- outputs --------------------------------------------------------------------------------
def test_outputs_have_the_image_size_and_the_kept_count(tiny, scene):
    result = run(tiny, scene)
    assert result.ok, result.message
    assert result.image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
    for overlay in [result.heatmap, result.kept_overlay] + [m.overlay for m in result.object_maps]:
        assert isinstance(overlay, np.ndarray)
        assert overlay.dtype == np.uint8
        assert overlay.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
    assert (result.n_kept, result.n_visual) == (4, N_VISUAL)  # ceil(0.25 * 16)
    assert result.kept_text == f"4 / {N_VISUAL} visual tokens kept (25%)"
    assert result.prefill_ms_unpruned > 0 and result.prefill_ms_pruned > 0
    assert result.speedup == pytest.approx(result.prefill_ms_unpruned / result.prefill_ms_pruned)
    line, warning = result.timing_text.split("  \n")
    pattern = r"prefill [\d.]+ ms unpruned -> [\d.]+ ms pruned: [\d.]+x \(median of 1 alternating"
    assert re.match(pattern, line)
    assert warning.startswith("warning: only 1 pair(s): too few to judge the spread")
    assert isinstance(result.answer, str) and isinstance(result.answer_unpruned, str)
    assert result.answer_mitigated == "" and result.notices == []


def test_pruner_options_and_nothing_pruned_as_the_command_lines_say(tiny, scene):
    result = run(tiny, scene, pruner="debiased", pruner_options="base=text, positional=false")
    assert result.ok, result.message
    bad = run(tiny, scene, pruner="debiased", pruner_options="bse=text")
    assert not bad.ok and "pruner 'debiased' has no option 'bse'; it takes: base" in bad.message
    everything = run(tiny, scene, keep=1.0)
    assert everything.ok and everything.timing is None
    assert everything.timing_text == NOTHING_PRUNED


def test_fixation_draws_each_decoding_steps_kept_cells(tiny, scene):
    import vlm_focus as vf

    result = run(tiny, scene, pruner="fixation", keep=0.25, layer=1, max_new_tokens=4)
    assert result.ok, result.message
    assert result.n_kept == N_VISUAL  # the prefill keeps every token
    strip = result.fixation_strip
    assert strip.dtype == np.uint8 and strip.shape[0] == 150 + 22
    model, processor = tiny
    inputs = {k: v for k, v in req.build_inputs(processor, scene, QUESTION).items()}
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=0.25, layer=1) as handle:
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    steps = len(handle.last_trace.fixations)
    assert steps >= 1 and all(f[0].numel() == 4 for f in handle.last_trace.fixations)
    panel = round(IMAGE_SIZE * 150 / IMAGE_SIZE)
    assert strip.shape[1] == steps * panel + (steps - 1) * 4  # one panel per step
    assert run(tiny, scene).fixation_strip is None  # a prefill pruner draws none


def test_answers_equal_plain_generate_pruned_and_unpruned(tiny, scene):
    import vlm_focus as vf

    model, processor = tiny
    result = run(tiny, scene, max_new_tokens=6)
    inputs = build_inputs(processor, Image.fromarray(scene), QUESTION)
    with torch.inference_mode():
        full = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        with vf.wrap(model, pruner="fastv", keep=0.25, layer=1) as handle:
            pruned = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert result.answer_unpruned == decode_new_tokens(processor, inputs, full)[0]
    assert result.answer == decode_new_tokens(processor, inputs, pruned)[0]
    assert result.n_kept == handle.last_trace.n_kept[0]


def test_prompt_map_is_the_heatmap_of_the_phrase_with_its_boxes_and_scores(
    tiny, scene, always_present
):
    model, processor = tiny
    result = run(tiny, scene)
    m = result.prompt_map
    assert (
        m.phrase == "red_circle"
    )  # the prompt's content word; stop words and the template left out
    inputs = build_inputs(processor, Image.fromarray(scene), QUESTION)
    picture = Image.fromarray(scene)
    ref = grounding.heatmap(model, inputs, "red_circle", processor=processor, images=[picture])
    ref = ref[0][0]
    torch.testing.assert_close(m.map.pixels, ref.pixels, atol=1e-6, rtol=1e-4)
    expected_boxes = grounding.boxes(ref, max_boxes=req.MAX_BOXES)
    assert [b.xywh for b in m.boxes] == [b.xywh for b in expected_boxes]
    assert len(m.boxes) >= 1
    for box, score in zip(m.boxes, m.scores, strict=True):
        direct = grounding.region_score(
            model, inputs, box.xywh, "red_circle", processor=processor, images=[picture]
        )
        assert score == pytest.approx(float(direct[0]), abs=1e-5)
        assert 0.0 <= score <= 1.0
    rows = result.box_rows()
    assert rows[0][0] == "red_circle"
    assert rows[0][1:5] == [int(round(v)) for v in m.boxes[0].xywh]
    assert rows[0][5] == round(m.scores[0], 3)
    presence = grounding.presence(model, processor, picture, ["red_circle"])[0]
    assert m.present and m.presence == pytest.approx(presence, abs=1e-6)
    assert rows[0][6] == f"{m.presence:.3f}"
    # the overlay is the colormap blend of this map, with the boxes drawn on top
    labels = [f"#{i + 1} {s:.2f}" for i, s in enumerate(m.scores)]
    expected = draw_boxes(heat_overlay(result.image, ref.pixels), m.boxes, labels)
    assert np.abs(m.overlay.astype(int) - expected.astype(int)).max() <= 1


def test_each_object_word_of_the_answer_gets_a_map(tiny, scene, always_present):
    model, processor = tiny
    inputs = build_inputs(processor, Image.fromarray(scene), QUESTION)
    tok = processor.tokenizer
    answer = torch.tensor([tok.encode("yes , a blue_square .", add_special_tokens=False)])
    whole = Frame(0, 0, IMAGE_SIZE, IMAGE_SIZE)
    prompt_map, object_maps = req._ground(
        model, processor, inputs, QUESTION, answer, Image.fromarray(scene), whole
    )
    assert prompt_map.phrase == "red_circle"
    assert [m.phrase for m in object_maps] == ["blue_square"]
    obj = object_maps[0]
    ref = grounding.heatmap(
        model, inputs, "blue_square", answer=answer, processor=processor, images=[scene]
    )
    torch.testing.assert_close(obj.map.pixels, ref[0][0].pixels, atol=1e-6, rtol=1e-4)
    assert len(obj.boxes) == 1 and obj.scores[0] == pytest.approx(
        grounding.box_share(ref[0][0], obj.boxes[0]), abs=1e-6
    )


def test_kept_mask_darkens_exactly_the_pruned_cells(tiny, scene):
    result = run(tiny, scene, keep=0.5)
    assert (result.n_kept, result.n_visual) == (8, N_VISUAL)
    cell = IMAGE_SIZE // SPEC.grid
    same = 0
    for r in range(SPEC.grid):
        for c in range(SPEC.grid):
            inner = np.s_[r * cell + 2 : (r + 1) * cell - 2, c * cell + 2 : (c + 1) * cell - 2]
            got, img = result.kept_overlay[inner].astype(int), result.image[inner].astype(int)
            if np.array_equal(got, img):
                same += 1
            else:
                assert np.abs(got - np.round(img * 0.25)).max() <= 1
    assert same == result.n_kept


def test_kept_grid_maps_trace_positions_to_cells(tiny, scene):
    import vlm_focus as vf
    from vlm_focus.model_adapters import get_adapter

    model, processor = tiny
    inputs = build_inputs(processor, Image.fromarray(scene), QUESTION)
    with vf.wrap(model, pruner="fastv", keep=3, layer=1) as handle:
        model(**inputs)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    kept = handle.last_trace.kept[0]
    frames = get_adapter(model).frames(layout, Size(IMAGE_SIZE, IMAGE_SIZE), processor=processor)
    grid, frame = req.kept_grid(layout, kept, frames)
    assert grid.shape == (SPEC.grid, SPEC.grid) and grid.sum() == 3
    first = int(layout.positions[0])
    for pos in kept.tolist():  # LLaVA: row-major grid, one token per cell
        r, c = divmod(pos - first, SPEC.grid)
        assert grid[r, c]
    assert frame == Frame(0.0, 0.0, IMAGE_SIZE, IMAGE_SIZE)  # a square scene: crop = whole


@pytest.mark.parametrize(
    "mitigation", ["attention_reweight", "visual_beam", "instruction_contrast"]
)
def test_mitigated_answer_equals_the_mitigation_on_the_pruned_model(tiny, scene, mitigation):
    model, processor = tiny
    result = run(tiny, scene, mitigation=mitigation, max_new_tokens=5)
    assert result.ok, result.message
    inputs = build_inputs(processor, Image.fromarray(scene), QUESTION)
    kw = dict(max_new_tokens=5, do_sample=False)
    pruning = dict(pruner="fastv", keep=0.25, layer=1)  # run()'s options: mitigated while pruned
    with torch.inference_mode(), vf.wrap(model, **pruning):
        if mitigation == "attention_reweight":
            with hal.attention_reweight(model, strength=1.0):
                out = model.generate(**inputs, **kw)
        elif mitigation == "visual_beam":
            with hal.visual_beam(model, weight=1.0) as proc:
                out = model.generate(**inputs, **kw, num_beams=3, logits_processor=[proc])
        else:
            generic = build_inputs(processor, Image.fromarray(scene), grounding.GENERIC_PROMPT)
            with hal.instruction_contrast(model, inputs, generic) as proc:
                out = model.generate(**inputs, **kw, logits_processor=[proc])
    assert result.mitigation == mitigation
    assert result.answer_mitigated == decode_new_tokens(processor, inputs, out)[0]


def test_sample_scene_path_is_accepted(tiny):
    paths = sample_scene_paths()
    assert len(paths) >= 1
    result = run(tiny, str(paths[0]))
    assert result.ok, result.message
    assert result.image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)


# --- bad input: a message, never an exception ----------------------------------------------
def test_no_image(tiny):
    for image in (None, ""):
        result = run(tiny, image)
        assert not result.ok and result.message == (
            "No image: upload an image or pick a sample scene."
        )
        assert result.heatmap is None and result.kept_overlay is None


def test_non_image_and_corrupt_files(tiny, scene, tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("this is not a picture")
    result = run(tiny, str(text))
    assert not result.ok
    assert (
        result.message == "The file 'notes.png' is not an image: it could not be read as an image."
    )
    good = tmp_path / "good.png"
    Image.fromarray(scene).save(good)
    broken = tmp_path / "broken.png"
    broken.write_bytes(good.read_bytes()[:400])  # header fine, pixel data cut off
    result = run(tiny, str(broken))
    assert not result.ok
    assert result.message == "The file 'broken.png' is corrupt: it could not be read as an image."
    result = run(tiny, str(tmp_path / "missing.png"))
    assert not result.ok and result.message == "Image file not found: missing.png"


def test_huge_image_is_downscaled_with_a_notice(tiny, scene, always_present):
    big = cv2.resize(scene, (3000, 2000), interpolation=cv2.INTER_NEAREST)
    with pytest.warns(grounding.UnseenRegionWarning):
        result = run(tiny, big)
    assert result.ok, result.message
    assert result.image.shape == (896, req.MAX_SIDE, 3)  # 3000 x 2000 -> 1344 x 896
    assert result.notices == [
        "The image was 3000x2000 pixels; it was downscaled to 1344x896 for this demo.",
        "The model saw only x 224-1120, y 0-896 of the 1344x896 image (67%): its processor "
        "crops the photo, so the shaded part was never seen and nothing there can be found.",
    ]
    assert result.heatmap.shape == result.kept_overlay.shape == (896, 1344, 3)
    m = result.prompt_map
    assert len(m.boxes) >= 1
    for box, score in zip(m.boxes, m.scores, strict=True):  # found on a 384 px copy, scaled back
        assert Frame(0, 0, 1344, 896).covers(box)
        assert score == pytest.approx(grounding.box_share(m.map, box)) and 0 <= score <= 1


def test_image_beyond_the_pixel_limit_is_refused_before_decoding(tiny, tmp_path):
    path = tmp_path / "bomb.png"
    Image.new("1", (12000, 9000)).save(path)  # 108 megapixels, a few kB on disk
    result = run(tiny, str(path))
    assert not result.ok
    assert result.message == (
        "The image is too large to process (12000x9000 = 108 megapixels; the limit is 100)."
    )


def test_empty_or_overlong_prompt(tiny, scene):
    for prompt in ("", "   \n", None):
        result = run(tiny, scene, prompt=prompt)
        assert not result.ok
        assert result.message == "The prompt is empty: type a question or a phrase."
    result = run(tiny, scene, prompt="a" * 1001)
    assert not result.ok and result.message == (
        "The prompt is 1001 characters long; the limit is 1000."
    )


def test_unsupported_model(tiny, scene):
    _, processor = tiny
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    result = req.run_request(LlamaForCausalLM(config), processor, scene, QUESTION)
    assert not result.ok
    assert result.message.startswith("This model is not supported (model type 'llama');")
    assert "llava" in result.message and "qwen2_vl" in result.message


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(pruner="nope"), "Unknown pruner 'nope'; choose one of "),
        (dict(keep=0.0), "keep=0.0: a ratio must lie in (0, 1]; a count is an int >= 2."),
        (dict(keep=1.5), "keep=1.5: a ratio must lie in (0, 1]; a count is an int >= 2."),
        (dict(layer=2), "layer=2: this model prunes at a layer in [0, 2)."),
        (dict(layer=-1), "layer=-1: this model prunes at a layer in [0, 2)."),
        (dict(mitigation="magic"), "Unknown mitigation 'magic'; choose one of none, "),
    ],
)
def test_bad_options(tiny, scene, options, message):
    result = run(tiny, scene, **options)
    assert not result.ok
    assert result.message.startswith(message)


def test_model_failure_is_a_message(tiny, scene, monkeypatch):
    model, _ = tiny

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(model, "generate", broken)
    result = run(tiny, scene)
    assert not result.ok
    assert result.message == "The request failed (RuntimeError: out of memory)."


# --- overlays -------------------------------------------------------------------------------
def test_heat_overlay_is_the_colormap_blend():
    image = np.full((6, 8, 3), 100, np.uint8)
    density = np.zeros((6, 8))
    density[2, 3] = 4.0
    density[5, 7] = 1.0
    out = heat_overlay(image, density)
    assert out.shape == (6, 8, 3) and out.dtype == np.uint8
    jet = cv2.cvtColor(
        cv2.applyColorMap(np.array([[0, 64, 255]], np.uint8), cv2.COLORMAP_JET), cv2.COLOR_BGR2RGB
    )[0]
    np.testing.assert_allclose(out[0, 0], np.round(0.5 * 100 + 0.5 * jet[0]), atol=1)
    np.testing.assert_allclose(out[5, 7], np.round(0.5 * 100 + 0.5 * jet[1]), atol=1)
    np.testing.assert_allclose(out[2, 3], np.round(0.5 * 100 + 0.5 * jet[2]), atol=1)
    with pytest.raises(ValueError, match="map shape"):
        heat_overlay(image, np.zeros((5, 8)))


def test_kept_mask_overlay_on_a_cropped_frame():
    image = np.full((4, 8, 3), 200, np.uint8)
    kept = np.array([[True, False], [False, True]])
    out = kept_mask_overlay(image, kept, Frame(2.0, 0.0, 4.0, 4.0), outline=False)  # central
    with pytest.raises(TypeError, match="Frame"):
        kept_mask_overlay(image, kept, (0.0, 2.0, 4.0, 4.0))  # a bare tuple: which order?
    assert (out[:, :2] == 200).all() and (out[:, 6:] == 200).all()  # outside the frame
    assert (out[0:2, 2:4] == 200).all() and (out[2:4, 4:6] == 200).all()  # kept cells
    assert (out[0:2, 4:6] == 50).all() and (out[2:4, 2:4] == 50).all()  # pruned: 200 * 0.25


def test_draw_boxes_draws_the_rectangle_edges():
    image = np.zeros((40, 40, 3), np.uint8)
    out = draw_boxes(image, [Box(10, 5, 20, 10, 0.5)])
    assert (out[5, 10:30] == 255).all() and (out[14, 10:30] == 255).all()
    assert (out[5:15, 10] == 255).all() and (out[5:15, 29] == 255).all()
    assert (out[9, 15] == 0).all()  # inside stays untouched


def test_a_prompt_that_names_no_object_is_mapped_but_not_grounded(tiny, scene, always_present):
    """ "Describe the image." names no object: the page shows where the question looks, with
    no box, no presence and no row in the table."""
    result = run(tiny, scene, prompt="Describe the image.")
    assert result.ok, result.message
    m = result.prompt_map
    assert m.phrase == "Describe the image."
    model, processor = tiny
    inputs = build_inputs(processor, Image.fromarray(scene), "Describe the image.")
    ref = grounding.heatmap(
        model, inputs, "Describe the image.", processor=processor, images=[scene]
    )[0][0]
    torch.testing.assert_close(m.map.pixels, ref.pixels, atol=1e-6, rtol=1e-4)
    assert m.boxes == [] and m.scores == [] and m.presence is None and m.present is None
    np.testing.assert_array_equal(m.overlay, heat_overlay(result.image, m.map.pixels))
    assert all(row[0] != m.phrase for row in result.box_rows())
    assert any(n.startswith("The prompt names no object") for n in result.notices)


def test_only_objects_are_grounded_and_each_once(tiny, scene, always_present):
    """Places (`top_right`, `center`) and question words (`where`) are no objects; an object the
    answer names twice gets one map, of both mentions."""
    model, processor = tiny
    question = "Where is the red_circle?"
    inputs = build_inputs(processor, Image.fromarray(scene), question)
    tok = processor.tokenizer
    text = "red_triangle top_right , blue_square center , red_triangle center"
    answer = torch.tensor([tok.encode(text, add_special_tokens=False)])
    whole = Frame(0, 0, IMAGE_SIZE, IMAGE_SIZE)
    prompt_map, object_maps = req._ground(
        model, processor, inputs, question, answer, Image.fromarray(scene), whole
    )
    assert prompt_map.phrase == "red_circle"
    assert [m.phrase for m in object_maps] == ["red_triangle", "blue_square"]
    seq = inputs["input_ids"].shape[1]
    both = torch.zeros(1, seq + answer.shape[1], dtype=torch.bool)
    both[0, [seq, seq + 6]] = True  # the two red_triangle tokens
    ref = grounding.heatmap(model, inputs, both, answer=answer, processor=processor, images=[scene])
    torch.testing.assert_close(object_maps[0].map.pixels, ref[0][0].pixels, atol=1e-6, rtol=1e-4)


def test_words_the_model_cannot_read_are_named_in_a_notice(tiny, scene):
    result = run(tiny, scene, prompt="Is there a big elephant in the image?")
    assert result.ok, result.message
    assert any(
        n.startswith("The model cannot read 'big', 'elephant': its tokenizer does not know")
        for n in result.notices
    ), result.notices
    known = run(tiny, scene, prompt="Is there a green_square in the image?")
    assert not any("cannot read" in n for n in known.notices), known.notices


@pytest.mark.parametrize("kind", ["llava_next", "qwen2_vl", "qwen2_5_vl"])
def test_kept_grid_on_multi_view_and_merged_grids(kind):
    from tiny_models import make_inputs, make_model

    import vlm_focus as vf
    from vlm_focus.model_adapters import get_adapter

    model = make_model(kind).eval()
    inputs = make_inputs(kind, model)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=1) as handle:
        model(**inputs)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    kept = handle.last_trace.kept[0]
    size = layout.image_size or Size(width=90, height=120)  # LLaVA-NeXT knows its own
    if kind != "llava_next":  # a size that fits the merged grid's aspect
        rows, cols = layout.grids[0]
        size = Size(width=cols * 30, height=rows * 30)
    grid, frame = req.kept_grid(layout, kept, get_adapter(model).frames(layout, size))
    finest = max(range(len(layout.grids)), key=lambda v: layout.grids[v][0] * layout.grids[v][1])
    assert grid.shape == layout.grids[finest]
    in_view = (layout.cells[:, 0] == finest) & (layout.cells[:, 1] >= 0)
    survived = torch.isin(layout.positions, kept)
    assert grid.sum() == int((survived & in_view).sum()) > 0
    for i in torch.nonzero(survived & in_view).flatten().tolist():
        _, r, c = layout.cells[i].tolist()
        assert grid[r, c]
    assert frame == Frame(0.0, 0.0, size.width, size.height)  # resized to the grid
    overlay = kept_mask_overlay(np.full((size.height, size.width, 3), 200, np.uint8), grid, frame)
    assert overlay.shape == (size.height, size.width, 3)
    if kind != "llava_next":  # one merged grid holds every visual token
        assert grid.sum() == handle.last_trace.n_kept[0]


def test_absent_phrases_show_not_found_and_no_box(tiny, scene, never_present):
    result = run(tiny, scene, prompt="Is there a red_circle in the image?")
    assert result.ok, result.message
    m = result.prompt_map
    assert m.present is False and m.boxes == [] and m.scores == []
    assert m.caption == "red_circle: not found"
    rows = result.box_rows()
    assert rows[0] == ["red_circle", None, None, None, None, None, f"not found ({m.presence:.3f})"]
    # the overlay is the map with the words, and no box outline
    plain = heat_overlay(result.image, m.map.pixels)
    band = m.overlay[:24].astype(int) - plain[:24].astype(int)
    assert np.abs(band).max() > 50  # the label
    np.testing.assert_array_equal(m.overlay[40:], plain[40:])
    assert all(o.present is False and o.boxes == [] for o in result.object_maps)


def test_a_wide_photo_is_drawn_through_the_processors_centre_crop(tiny, scene, always_present):
    wide = np.full((IMAGE_SIZE, IMAGE_SIZE * 3 // 2, 3), 200, np.uint8)
    left = IMAGE_SIZE // 4
    wide[:, left : left + IMAGE_SIZE] = scene  # the scene in the middle, padded left and right
    result = run(tiny, wide, keep=0.5)
    assert result.ok, result.message
    assert result.image.shape == wide.shape
    crop = Frame(float(left), 0.0, float(IMAGE_SIZE), float(IMAGE_SIZE))
    assert result.prompt_map.map.frames == [crop]  # the organism's processor centre-crops
    pixels = result.prompt_map.map.pixels
    assert float(pixels[:, :left].abs().sum()) == 0.0 and float(pixels[:, -left:].abs().sum()) == 0
    assert result.prompt_map.map.seen == crop
    # the part the processor crops away is shaded on every overlay, and a notice says so
    for overlay in (result.kept_overlay, result.heatmap):
        assert (overlay[:, :left] <= wide[:, :left]).all()
        assert overlay[:, :left].mean() < 0.5 * wide[:, :left].mean()
        assert overlay[:, -left:].mean() < 0.5 * wide[:, -left:].mean()
    assert any(f"x {left}-{left + IMAGE_SIZE}, y 0-{IMAGE_SIZE}" in n for n in result.notices)
    for box in result.prompt_map.boxes:
        assert left - 1 <= box.x0 and box.x1 <= left + IMAGE_SIZE + 1


# --- look closer ----------------------------------------------------------------------------
def test_zoom_answer_equals_look_closer_under_the_same_wrap(tiny, scene, monkeypatch):
    from vlm_focus import zoom

    model, processor = tiny
    # both layers (the stored grounding default, read by the demo and the zoom alike): this
    # random model's layer-0 map is too flat to crop
    monkeypatch.setattr(model.config, "vlm_focus_grounding", {"layers": [0, 1]}, raising=False)
    big = cv2.resize(scene, (768, 576), interpolation=cv2.INTER_NEAREST)  # larger than the view
    result = run(tiny, big, zoom=True, max_new_tokens=6)
    assert result.ok, result.message
    with vf.wrap(model, pruner="fastv", keep=0.25, layer=1):
        found = zoom.look_closer(
            model, processor, Image.fromarray(big), QUESTION, route="always", max_new_tokens=6
        )
    assert found.zoomed and result.zoomed
    assert result.answer_zoomed == found.answer
    assert result.zoom_crops == found.crops
    assert not any("nothing to crop" in n for n in result.notices)
    # the crop is drawn on the zoom's own map: its edge pixels take the first box colour
    crop = found.crops[0]
    base = heat_overlay(big, found.map.pixels)
    seen = Frame(96, 0, 576, 576)  # 768 x 576, centre-cropped: the sides are shaded
    expected = shade_unseen(draw_boxes(base, [crop], ["zoom #1"]), seen)
    np.testing.assert_array_equal(result.zoom_overlay, expected)
    assert result.answer == run(tiny, big, max_new_tokens=6).answer  # the plain pruned answer


def test_zoom_on_a_small_image_says_there_is_nothing_to_crop(tiny, scene):
    result = run(tiny, scene, zoom=True, max_new_tokens=6)
    assert result.ok, result.message
    assert not result.zoomed and result.answer_zoomed == result.answer
    side = IMAGE_SIZE
    assert any(f"({side}x{side} px)" in n and "nothing to crop" in n for n in result.notices)
    np.testing.assert_array_equal(result.zoom_overlay, scene)  # no map read, no box drawn
    plain = run(tiny, scene)
    assert plain.answer_zoomed == "" and plain.zoom_overlay is None


# --- the embedded organism on its bundled sample -------------------------------------------
def test_the_sample_square_is_boxed_and_an_absent_circle_is_not_found():
    """scene_9000001 holds a green_square at (92, 62, 33, 32) and no red_circle."""
    from vlm_focus.loading import load_model

    model, processor = load_model(dtype=torch.float32)
    sample = next(p for p in sample_scene_paths() if p.stem == "scene_9000001")
    found = req.run_request(
        model,
        processor,
        str(sample),
        "Is there a green_square in the image?",
        max_new_tokens=4,
        repeats=1,
    )
    assert found.ok, found.message
    m = found.prompt_map
    assert m.phrase == "green_square" and m.present and m.presence > 0.9
    top = m.boxes[0]
    cx, cy = top.x0 + top.width / 2, top.y0 + top.height / 2
    assert 92 <= cx <= 125 and 62 <= cy <= 94, top  # the top box's centre lies on the square
    assert found.box_rows()[0][:1] == ["green_square"]
    absent = req.run_request(
        model,
        processor,
        str(sample),
        "Is there a red_circle in the image?",
        max_new_tokens=4,
        repeats=1,
    )
    assert absent.ok and absent.answer == "no"
    assert absent.prompt_map.present is False and absent.prompt_map.boxes == []
    assert absent.box_rows()[0][6].startswith("not found")


# --- a video: the answers and the prompt's map in each frame --------------------------------
VIDEO_QUESTION = "what is in this video"
VIDEO_SIZE = Size(48, 32)
VIDEO_FPS = 4.0


def write_video(path, frames: int, size: Size = VIDEO_SIZE, fps: float = VIDEO_FPS):
    """A noise video written by OpenCV: VP8 for ``.webm`` (browsers play it), else MPEG-4."""
    from tiny_processors import noise_video

    fourcc = cv2.VideoWriter_fourcc(*("VP80" if path.suffix == ".webm" else "mp4v"))
    writer = cv2.VideoWriter(str(path), fourcc, fps, (size.width, size.height))
    for frame in noise_video(frames, size.width, size.height, seed=3):
        writer.write(np.ascontiguousarray(frame[..., ::-1]))  # OpenCV writes BGR
    writer.release()
    return path


@pytest.fixture(scope="module")
def tiny_qwen():
    """A random-weight Qwen2.5-VL (it merges two frames into one temporal patch) with its real
    processor."""
    from tiny_models import make_model
    from tiny_processors import tiny_processor

    model = make_model("qwen2_5_vl")
    return model, tiny_processor(model)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """Five frames: three views of two, two and one frame (the processor repeats the last)."""
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=5)


def run_video(model_and_processor, video, image=None, **kw):
    model, processor = model_and_processor
    options = dict(pruner="fastv", keep=0.5, layer=1, max_new_tokens=3, repeats=1)
    options.update(kw)
    return req.run_request(model, processor, image, VIDEO_QUESTION, video=video, **options)


def test_a_video_gets_both_answers_and_the_prompts_map_in_each_frame(tiny_qwen, clip):
    from vlm_focus.loading import build_video_inputs, load_video

    model, processor = tiny_qwen
    result = run_video(tiny_qwen, str(clip))
    assert result.ok, result.message
    frames, metadata = load_video(clip)
    inputs = build_video_inputs(processor, frames, metadata, VIDEO_QUESTION)
    with torch.inference_mode():
        full = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        with vf.wrap(model, pruner="fastv", keep=0.5, layer=1) as handle:
            pruned = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert result.answer_unpruned == decode_new_tokens(processor, inputs, full)[0]
    assert result.answer == decode_new_tokens(processor, inputs, pruned)[0]
    t, h, w = inputs["video_grid_thw"][0].tolist()
    assert (len(frames), t) == (5, 3)
    assert (result.n_visual, result.n_kept) == (t * h * w // 4, handle.last_trace.n_kept[0])
    assert result.n_kept == result.n_visual // 2
    # one map per view, in time order, captioned with the frames it covers
    assert [m.frames for m in result.frame_maps] == [[0, 1], [2, 3], [4]]
    assert [m.seconds for m in result.frame_maps] == [[0.0, 0.25], [0.5, 0.75], [1.0]]
    assert [m.caption.rsplit(":", 1)[0] for m in result.frame_maps] == [
        "frames 0-1 (0.00-0.25 s)",
        "frames 2-3 (0.50-0.75 s)",
        "frame 4 (1.00 s)",
    ]
    assert result.notices == [  # no object named: the whole question's map
        "Each frame shows the attention to 'what is in this video', all on one colour scale."
    ]
    # the image-only outputs stay empty
    assert result.video and result.image is None and result.kept_overlay is None
    assert result.prompt_map is None and result.object_maps == [] and result.box_rows() == []


def test_each_frames_overlay_is_its_map_on_its_first_frame_on_one_scale(tiny_qwen, clip):
    from vlm_focus.loading import build_video_inputs, load_video

    model, processor = tiny_qwen
    result = run_video(tiny_qwen, str(clip))
    frames, metadata = load_video(clip)
    inputs = build_video_inputs(processor, frames, metadata, VIDEO_QUESTION)
    gp = grounding.GroundingPass(model, inputs, processor=processor, sizes=[VIDEO_SIZE])
    assert gp.mentions(source="prompt", within=VIDEO_QUESTION) == [[]]  # it names no object
    heat = gp.map(VIDEO_QUESTION, source="prompt")
    views = heat.frame_maps
    assert len(views) == len(result.frame_maps) == 3
    peak = max(float(v.pixels.max()) for v in views)
    for view, first, got in zip(views, [0, 2, 4], result.frame_maps, strict=True):
        torch.testing.assert_close(got.map.pixels, view.pixels, atol=1e-6, rtol=1e-4)
        assert got.share == pytest.approx(view.mass / heat.mass, abs=1e-6)
        assert got.caption.endswith(f": {got.share:.0%}")
        expected = heat_overlay(frames[first], view.pixels, peak=peak)
        np.testing.assert_allclose(got.overlay, expected, atol=1)
    assert sum(m.share for m in result.frame_maps) == pytest.approx(1.0, abs=1e-6)


def test_instruction_contrast_on_a_video_contrasts_with_the_same_video(tiny_qwen, clip):
    from vlm_focus.loading import build_video_inputs, load_video

    model, processor = tiny_qwen
    result = run_video(tiny_qwen, str(clip), mitigation="instruction_contrast")
    assert result.ok, result.message
    frames, metadata = load_video(clip)
    inputs = build_video_inputs(processor, frames, metadata, VIDEO_QUESTION)
    generic = build_video_inputs(processor, frames, metadata, grounding.GENERIC_PROMPT)
    with torch.inference_mode(), vf.wrap(model, pruner="fastv", keep=0.5, layer=1):
        with hal.instruction_contrast(model, inputs, generic) as proc:
            out = model.generate(
                **inputs, max_new_tokens=3, do_sample=False, logits_processor=[proc]
            )
    assert result.answer_mitigated == decode_new_tokens(processor, inputs, out)[0]


@pytest.mark.parametrize(
    ("kind", "frames"),
    [
        ("qwen2_vl", [[0, 1], [2, 3], [4]]),
        ("qwen3_vl", [[0, 1], [2, 3], [4]]),  # a timestamp before every view
        ("llava_onevision", [[0], [1], [2], [3], [4]]),  # every frame a view of its own
    ],
)
def test_every_video_class_gets_one_map_per_view_of_its_frames(kind, frames, clip):
    from tiny_models import make_model
    from tiny_processors import tiny_processor

    model = make_model(kind)
    result = run_video((model, tiny_processor(model)), str(clip))
    assert result.ok, result.message
    assert [m.frames for m in result.frame_maps] == frames
    assert sum(m.share for m in result.frame_maps) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    ("n_views", "n_frames", "spans"),
    [
        (1, 1, [[0]]),  # one frame, repeated to fill a temporal patch of two
        (2, 4, [[0, 1], [2, 3]]),
        (3, 5, [[0, 1], [2, 3], [4]]),
        (4, 4, [[0], [1], [2], [3]]),  # a model that reads every frame as a view of its own
    ],
)
def test_frame_spans(n_views, n_frames, spans):
    assert req.frame_spans(n_views, n_frames) == spans


def test_frame_spans_refuses_nothing():
    with pytest.raises(ValueError, match="n_views=0 and n_frames=3"):
        req.frame_spans(0, 3)


def test_large_video_frames_are_downscaled_with_a_notice(tiny_qwen, clip):
    result = run_video(tiny_qwen, str(clip), max_side=24)
    assert result.ok, result.message
    assert result.notices[0] == (
        "The video's frames were 48x32 pixels; they were downscaled to 24x16 for this demo."
    )
    assert [m.overlay.shape for m in result.frame_maps] == [(16, 24, 3)] * 3


def test_bad_video_requests_are_messages(tiny_qwen, tiny, clip, scene, tmp_path):
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"this is not a video")
    picture = tmp_path / "picture.mp4"
    Image.fromarray(scene).save(picture, format="PNG")  # an image under a video's name
    cases = [
        (
            run_video(tiny_qwen, str(clip), image=scene),
            "Both an image and a video were given: clear one of them, the demo asks about one "
            "at a time.",
        ),
        (
            run_video(tiny, str(clip), layer=0),
            "This model (llava) takes images only, not videos: upload an image, or load a model "
            "that takes videos.",
        ),
        (
            run_video(tiny_qwen, str(clip), zoom=True),
            "Look closer (zoom) crops an image; untick it to ask about a video.",
        ),
        (
            run_video(tiny_qwen, str(garbage)),
            "The file 'garbage.mp4' could not be read as a video.",
        ),
        (
            run_video(tiny_qwen, str(picture)),
            "The file 'picture.mp4' could not be read as a video.",
        ),
        (run_video(tiny_qwen, str(tmp_path / "gone.mp4")), "Video file not found: gone.mp4"),
        (run_video(tiny_qwen, 3), "Unsupported video input of type int."),
    ]
    for result, message in cases:
        assert not result.ok and result.message == message
        assert result.frame_maps == [] and not result.video
    empty_prompt = req.run_request(*tiny_qwen, None, "  ", video=str(clip), layer=1)
    assert empty_prompt.message == "The prompt is empty: type a question or a phrase."
    for nothing in (None, ""):  # an empty video slot is no video: the image path answers
        assert run_video(tiny, nothing, image=scene, layer=0).ok


def test_heat_overlay_with_a_shared_peak():
    image = np.full((4, 4, 3), 100, np.uint8)
    density = np.zeros((4, 4))
    density[1, 2] = 2.0
    np.testing.assert_array_equal(
        heat_overlay(image, density, peak=2.0), heat_overlay(image, density)
    )
    half = heat_overlay(image, density, peak=4.0)  # the peak pixel sits mid-scale
    jet = cv2.cvtColor(
        cv2.applyColorMap(np.array([[0, 128]], np.uint8), cv2.COLORMAP_JET), cv2.COLOR_BGR2RGB
    )[0]
    np.testing.assert_allclose(half[1, 2], np.round(0.5 * 100 + 0.5 * jet[1]), atol=1)
    np.testing.assert_allclose(half[0, 0], np.round(0.5 * 100 + 0.5 * jet[0]), atol=1)
    above = heat_overlay(image, density * 10, peak=2.0)  # beyond the peak: the top colour
    np.testing.assert_array_equal(above, heat_overlay(image, density))
