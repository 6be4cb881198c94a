"""Decode-time fixation: each decoding step equals the unpruned model with that step's
unselected visual keys masked from the focal layer on (``reference.fixation_reference``), for
16 cached steps; keep=1.0 is the unwrapped model; the selection follows a moving peak and the
warm start stays in its neighbourhood; bad options get clear errors."""

from __future__ import annotations

import pytest
import torch
from pruner_inputs import HEAD, FakeLayer, grid_layout
from reference import fixation_reference, greedy_generate
from tiny_models import KINDS, make_case, make_inputs, make_model

import vlm_focus as vf
from vlm_focus.core.fixation import StepFixation
from vlm_focus.core.pruner import StepReuse
from vlm_focus.model_adapters.llava import LLAVA

ATOL = 2e-5


def _check(kind, attn, layer, steps=16, **options):
    model = make_model(kind, attn=attn)
    inputs = make_inputs(kind, model, batch=2)
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner="fixation", layer=layer, **options) as handle:
        sequences, logits = greedy_generate(model, inputs, steps)
        trace = handle.last_trace
    with torch.no_grad(), fixation_reference(model, layers, layer, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, steps)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    return trace


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_step_equals_its_masked_reference(kind, attn):
    trace = _check(kind, attn, layer=1, keep=0.25)
    assert len(trace.fixations) == 15  # one per cached decode step (the first token is prefill)
    for step in trace.fixations:
        for b, kept in enumerate(step):
            assert kept.numel() < trace.n_visual[b]
            assert set(kept.tolist()) <= set(trace.visual_positions[b].tolist())
    assert trace.n_kept == trace.n_visual  # the prefill keeps every token


@pytest.mark.parametrize(
    "kind,case", [("qwen3_vl", "image"), ("qwen3_vl", "video"), ("llava_onevision", "image")]
)
def test_newer_layouts_equal_the_reference(kind, case):
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=0.25, layer=1, refresh=2) as h:
        sequences, logits = greedy_generate(model, inputs, 8)
        trace = h.last_trace
    with torch.no_grad(), fixation_reference(model, layers, 1, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, 8)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_warm_start_and_pruning_before_the_first_layer_equal_the_reference(kind):
    _check(kind, "sdpa", layer=0, keep=0.25, refresh=3, radius=1)


def test_keep_all_decodes_exactly_like_the_unwrapped_model():
    model = make_model("llava_next")
    inputs = make_inputs("llava_next", model, batch=2)
    with torch.no_grad():
        plain = greedy_generate(model, inputs, 8)
        with vf.wrap(model, pruner="fixation", keep=1.0, layer=1):
            fixed = greedy_generate(model, inputs, 8)
    assert torch.equal(plain[0], fixed[0]) and torch.equal(plain[1], fixed[1])


@pytest.mark.parametrize("generate", [dict(num_beams=2), dict(do_sample=True, top_k=5)])
def test_beam_search_and_sampling_equal_the_reference(generate):
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    layers = model.model.language_model.layers
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, **generate)
    torch.manual_seed(0)
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=0.25, layer=1) as handle:
        out = model.generate(**inputs, **kwargs)
        trace = handle.last_trace
    torch.manual_seed(0)
    with torch.no_grad(), fixation_reference(model, layers, 1, trace):
        ref = model.generate(**inputs, **kwargs)
    assert torch.equal(out, ref)


def test_fixation_follows_a_moving_peak_and_the_warm_start_stays_near():
    """A 6x6 image whose focal attention peaks on one cell per step: step 0 (a refresh) and
    step 1 (warm, the peak moved one cell) follow it; at step 2 it jumps across the grid, and
    the warm start keeps to the last fixation's neighbourhood; step 3 refreshes and finds it."""
    image = grid_layout(2, 6, 6)
    seq = 2 + 36 + 3
    visual = torch.zeros(1, seq, dtype=torch.bool)
    visual[0, image.positions] = True
    fixation = StepFixation(LLAVA, [[image]], visual, [36], [36], 1, "mean", refresh=3, radius=1)
    layer = FakeLayer()
    hidden = torch.zeros(1, 1, 10)
    hidden[0, 0, 0] = 1.0  # q = e_0, so a key's logit is its first component
    rope = (torch.ones(1, 1, HEAD), torch.zeros(1, 1, HEAD))
    picked = []
    for r, c in [(0, 0), (0, 1), (5, 5), (5, 5)]:
        keys = torch.zeros(1, 1, seq, HEAD)
        keys[0, 0, 2 + r * 6 + c, 0] = 8.0  # the peak
        keys[0, 0, 2 + 2 * 6 + 2, 0] = 4.0  # a weaker blob in the middle
        fixation.begin_step(None)
        fixation.fixate(layer, hidden, {"position_embeddings": rope}, keys)
        (kept,) = torch.nonzero(fixation.kept_steps()[-1][0]).T
        picked.append(divmod(int(kept[0]) - 2, 6))
    assert picked[0] == (0, 0) and picked[1] == (0, 1)
    assert max(abs(picked[2][0] - 0), abs(picked[2][1] - 1)) <= 1  # stayed in the neighbourhood
    assert picked[3] == (5, 5)


def test_bad_options_are_named():
    model = make_model("llava")
    with pytest.raises(ValueError, match=r"keep=0.5 per step exceeds prefill_keep=0.25"):
        vf.wrap(model, pruner="fixation", keep=0.5, prefill_keep=0.25)
    inputs = make_case("llava", "image", model)
    with vf.wrap(model, pruner="fixation", keep=8, prefill_keep=0.25), torch.no_grad():
        with pytest.raises(ValueError, match=r"keep=8 asks for more visual tokens per step"):
            model(**inputs)
    with pytest.raises(ValueError, match="refresh=0 must be an int >= 1"):
        vf.wrap(model, pruner="fixation", refresh=0)
    with pytest.raises(ValueError, match="radius=-1 must be an int >= 0"):
        vf.wrap(model, pruner="fixation", radius=-1)
    with pytest.raises(ValueError, match="layer=9 is out of range"):
        vf.wrap(model, pruner="fixation", layer=9)
    with pytest.raises(ValueError, match="keep=1.5"):
        vf.wrap(model, pruner="fixation", keep=1.5)


def test_the_pruner_declares_how_steps_reuse_a_fixation():
    """The engine takes refresh and radius from the pruner's declaration (``step_reuse``); a
    prefill pruner declares the default, every step re-scoring every visual token."""
    model = make_model("llava")
    inputs = make_inputs("llava", model)
    options = dict(pruner="fixation", keep=0.25, layer=1, refresh=3, radius=2)
    with torch.no_grad(), vf.wrap(model, **options) as handle:
        assert handle._engine.pruner.step_reuse() == StepReuse(refresh=3, radius=2)
        model(**inputs)
        fixation = handle.last_trace.fixation
        assert (fixation.refresh, fixation.radius) == (3, 2)
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=1) as handle:
        assert handle._engine.pruner.step_reuse() == StepReuse(refresh=1, radius=0)
