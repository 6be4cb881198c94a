"""Every registered pruner through wrap() on the four tiny model classes, batch 2 with ragged
visual counts and left padding, prefill + generate(): the pruned model equals the masked
reference (the unpruned model with each stage's pruned keys masked from its layer on)."""

from __future__ import annotations

import pytest
import torch
from reference import greedy_generate, masked_reference
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus as vf
from vlm_focus.config import keep_count
from vlm_focus.pruners import guided_generate

ATOL = 2e-5
STEPS = 4


def _generate(model, inputs, steps=STEPS):
    return greedy_generate(model, inputs, steps)


def _guide_options(seed=3):
    guide = make_model("llava", seed=seed)
    return dict(guide=guide, guide_inputs=make_inputs("llava", guide, batch=2, seed=5))


def check(kind, pruner, layer=1, keep=0.5, attn="sdpa", **options):
    model = make_model(kind, attn=attn)
    inputs = make_inputs(kind, model, batch=2)
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=keep, layer=layer, **options) as h:
        logits = model(**inputs).logits[:, -1]
        trace = h.last_trace
        sequences, step_logits = _generate(model, inputs)
        for a, b in zip(trace.kept, h.last_trace.kept, strict=True):
            assert torch.equal(a, b)  # generate() re-runs prefill: same kept set
    stages = trace.stages
    assert len(stages) == (len(layer) if isinstance(layer, tuple) else 1)
    keeps = keep if isinstance(keep, tuple) else (keep,)
    for i, stage in enumerate(stages):
        for b, kept in enumerate(stage.kept):
            # exact counts: every row keeps its own share, per stage (keeps are nested ratios)
            assert kept.numel() == keep_count(keeps[i], trace.n_visual[b])
            assert set(kept.tolist()) <= set(trace.visual_positions[b].tolist())
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_logits = model(**inputs).logits[:, -1]
        ref_sequences, ref_step_logits = _generate(model, inputs)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(step_logits, ref_step_logits, atol=ATOL, rtol=0)
    return trace


PRUNERS = {
    "text": {},
    "debiased": {},
    "debiased_text": {"base": "text", "trend": "monotone", "axis": "row"},
    "pyramid": {},
    "diverse": {"pool": 2.0},
}


@pytest.mark.parametrize("name", sorted(PRUNERS))
@pytest.mark.parametrize("kind", KINDS)
def test_pruner_matches_reference(kind, name):
    pruner = name.split("_")[0]
    check(kind, pruner, **PRUNERS[name])


@pytest.mark.parametrize("kind", KINDS)
def test_guided_matches_reference_before_the_llm(kind):
    check(kind, "guided", layer=0, **_guide_options())


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("pruner", ["pyramid", "debiased"])
def test_multi_stage_schedule_matches_reference(kind, pruner):
    trace = check(kind, pruner, layer=(0, 1, 3), keep=(0.75, 0.5, 0.25))
    assert [s.layer for s in trace.stages] == [0, 1, 3]
    for earlier, later in zip(trace.stages, trace.stages[1:]):
        for a, b in zip(earlier.kept, later.kept, strict=True):
            assert set(b.tolist()) <= set(a.tolist())


def test_guided_generate_runs_large_model_or_exits_early():
    model = make_model("llava_next")
    inputs = make_inputs("llava_next", model, batch=2)
    options = _guide_options()
    guide_inputs = options.pop("guide_inputs")
    with torch.no_grad():
        handle = vf.wrap(model, pruner="guided", keep=0.5, layer=0, early_exit=1.0, **options)
        out = guided_generate(handle, inputs, guide_inputs, max_new_tokens=3, do_sample=False)
        assert not out.early_exit and handle.last_trace.stages  # random guide: not confident
        assert out.sequences.shape == (2, inputs["input_ids"].shape[1] + 3)
        assert not handle.last_trace.early_exit
        handle.remove()
        handle = vf.wrap(model, pruner="guided", keep=0.5, layer=0, early_exit=1e-6, **options)
        out = guided_generate(handle, inputs, guide_inputs, max_new_tokens=3, do_sample=False)
        trace = handle.last_trace
        handle.remove()
    assert out.early_exit and trace.early_exit and not trace.stages
    assert out.sequences.shape == (2, guide_inputs["input_ids"].shape[1] + 3)
    assert len(out.confidence) == 2 and all(0 < c <= 1 for c in out.confidence)
