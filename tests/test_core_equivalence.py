"""A pruned run equals the unpruned model with the pruned visual keys masked out (reference.py):
prefill logits and 8 greedy decode steps with KV cache, SDPA and eager, batch 1 and a
left-padded batch 2 whose rows hold different visual-token counts, K = 0 and K = 2."""

from __future__ import annotations

import pytest
import torch
from reference import greedy_generate, masked_reference
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus as vf

ATOL = 2e-5  # fp32: only summation order differs between the two runs


def _generate(model, inputs, steps=8):
    return greedy_generate(model, inputs, steps)


def _check(kind, attn, batch, layer, pruner="fastv", keep=0.5, prompt_len=6, **options):
    model = make_model(kind, attn=attn)
    inputs = make_inputs(kind, model, batch=batch, prompt_len=prompt_len)
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=keep, layer=layer, **options) as h:
        logits = model(**inputs).logits[:, -1]
        trace = h.last_trace
        sequences, step_logits = _generate(model, inputs)
        # generate() re-runs prefill: the kept set must be the same as for the plain forward.
        for a, b in zip(trace.kept, h.last_trace.kept):
            assert torch.equal(a, b)
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual))
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_logits = model(**inputs).logits[:, -1]
        ref_sequences, ref_step_logits = _generate(model, inputs)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(step_logits, ref_step_logits, atol=ATOL, rtol=0)
    return trace


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_pruned_equals_masked_reference(kind, attn, batch, layer):
    trace = _check(kind, attn, batch, layer)
    assert [s.layer for s in trace.stages] == [layer]


@pytest.mark.parametrize("kind", KINDS)
def test_generate_four_token_prompt_matches_reference(kind):
    _check(kind, "sdpa", 2, 2, keep=0.25, prompt_len=4)


@pytest.mark.parametrize("pruner", ["random", "pool"])
@pytest.mark.parametrize("kind", KINDS)
def test_baselines_match_reference(kind, pruner):
    _check(kind, "sdpa", 2, 1, pruner=pruner, keep=0.5)


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_multi_stage_schedule_matches_reference(kind, attn):
    trace = _check(kind, attn, 2, (0, 1, 3), keep=(0.75, 0.5, 0.25))
    assert [s.layer for s in trace.stages] == [0, 1, 3]
    for earlier, later in zip(trace.stages, trace.stages[1:]):
        for a, b in zip(earlier.kept, later.kept):
            assert set(b.tolist()) <= set(a.tolist())  # each stage prunes what the last kept


@pytest.mark.parametrize("query", ["last", "text"])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_query_and_reduce_options_match_reference(query, reduce):
    _check("llava", "eager", 2, 2, query_rows=query, reduce=reduce)
