"""``RunSetting.answer`` runs a setting end to end: its answers equal the ones a caller got by
wrapping, building the guide's and the mitigation's inputs and zooming by hand, and it counts
what the pruning kept."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

import vlm_focus as vf
from vlm_focus import hallucination as hal
from vlm_focus import zoom as zm
from vlm_focus.config import FocusConfig, keep_count
from vlm_focus.generation import greedy_generate
from vlm_focus.loading import build_inputs, decode_new_tokens, load_model, to_model
from vlm_focus.pruners import guided_generate
from vlm_focus.setting import RunSetting

TOKENS = 4
PROMPTS = ["Is there a red triangle?", "Describe the image."]


@pytest.fixture(scope="module")
def organism():
    from organism.scenes import heldout_scenes

    model, processor = load_model(None, dtype=torch.float32)
    images = [Image.fromarray(s.image()) for s in heldout_scenes(2, min_objects=2)]
    inputs = to_model(model, build_inputs(processor, images, PROMPTS))
    return model, processor, images, inputs


def _texts(processor, inputs, sequences):
    return decode_new_tokens(processor, inputs, sequences)


def test_a_pruned_answer_is_the_wrapped_models_and_counts_its_kept_tokens(organism):
    model, processor, images, inputs = organism
    setting = RunSetting(focus=FocusConfig(keep=0.25, layer=0), max_new_tokens=TOKENS)
    with vf.wrap(model, config=setting.focus) as handle:
        expected = greedy_generate(model, inputs, max_new_tokens=TOKENS)[0]
    done = setting.answer(model, processor, images, PROMPTS)
    assert torch.equal(done.sequences, expected)
    assert done.texts == _texts(processor, inputs, expected)
    assert done.visual_kept == handle.last_trace.n_kept == done.trace.n_kept
    assert done.visual_total == handle.last_trace.n_visual
    assert done.visual_kept == [keep_count(0.25, n) for n in done.visual_total]
    assert done.zoom is None and 0 < done.prefill_s <= done.seconds


def test_the_plain_setting_attaches_nothing(organism):
    model, processor, images, inputs = organism
    setting = RunSetting(focus=FocusConfig(keep=0.25), max_new_tokens=TOKENS).plain()
    expected = greedy_generate(model, inputs, max_new_tokens=TOKENS)[0]
    done = setting.answer(model, processor, images, PROMPTS, inputs=inputs)
    assert setting == RunSetting(max_new_tokens=TOKENS)
    assert torch.equal(done.sequences, expected) and done.trace is None
    assert done.visual_kept == done.visual_total
    timed = setting.prefill_timing(model, inputs, repeats=1, answer=done)
    assert timed.timing is None and timed.visual_kept == timed.visual_total


def test_the_mitigation_gets_its_generic_inputs_built(organism):
    model, processor, images, inputs = organism
    setting = RunSetting(mitigation="instruction_contrast", max_new_tokens=TOKENS)
    generic = to_model(model, build_inputs(processor, images, [setting.generic_prompt] * 2))
    with hal.mitigate(model, "instruction_contrast", inputs, generic_inputs=generic) as active:
        expected = greedy_generate(
            model, inputs, max_new_tokens=TOKENS, **active.generate_kwargs(())
        )[0]
    done = setting.answer(model, processor, images, PROMPTS, inputs=inputs)
    assert torch.equal(done.sequences, expected)


def test_the_guide_gets_its_inputs_built(organism):
    model, processor, images, inputs = organism
    focus = FocusConfig(pruner="guided", keep=0.25, layer=0)
    setting = RunSetting(focus=focus, guide="embedded", max_new_tokens=TOKENS)
    guide = setting.load_guide("cpu")
    guide_inputs = to_model(guide.model, build_inputs(guide.processor, images, PROMPTS))
    options = {"guide": guide.model}
    with vf.wrap(model, config=dataclasses.replace(focus, options=options)) as handle:
        expected = guided_generate(
            handle, inputs, guide_inputs, max_new_tokens=TOKENS, do_sample=False
        ).sequences
    done = setting.answer(model, processor, images, PROMPTS, inputs=inputs, guide=guide)
    assert torch.equal(done.sequences, expected)
    with pytest.raises(ValueError, match="needs a guide model"):
        setting.answer(model, processor, images, PROMPTS, inputs=inputs)


def test_the_zoom_looks_closer_under_the_pruning(organism):
    model, processor, images, _ = organism
    focus = FocusConfig(keep=0.25, layer=0)
    options = zm.ZoomOptions(route="always", max_new_tokens=TOKENS)
    with vf.wrap(model, config=focus):
        expected = zm.look_closer(model, processor, images, PROMPTS, config=options)
    setting = RunSetting(focus=focus, zoom=zm.ZoomOptions(route="always"), max_new_tokens=TOKENS)
    done = setting.answer(model, processor, images, PROMPTS)
    assert done.sequences is None
    assert [f.answer for f in done.zoom] == [f.answer for f in expected]
    assert done.texts == [f.answer.strip() for f in expected]
    assert done.visual_kept == [keep_count(0.25, n) for n in done.visual_total]


def test_prefill_timing_counts_one_pruned_prefill(organism):
    model, _, _, inputs = organism
    setting = RunSetting(focus=FocusConfig(keep=0.5, layer=0))
    timed = setting.prefill_timing(model, inputs, repeats=1)
    assert timed.visual_kept == timed.trace.n_kept[0] == keep_count(0.5, timed.visual_total)
    assert timed.timing is not None and timed.timing.runs == 1
