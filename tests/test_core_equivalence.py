"""A pruned run equals the unpruned model with the pruned visual keys masked out (reference.py):
prefill logits and 8 greedy decode steps with KV cache, SDPA and eager, batch 1 and a
left-padded batch 2 whose rows hold different visual-token counts, K = 0 and K = 2."""

from __future__ import annotations

import pytest
from reference import assert_pruned_equals_masked, greedy_generate
from tiny_models import KINDS, make_inputs, make_model


def _generate(model, inputs, steps=8):
    return greedy_generate(model, inputs, steps)


def _check(kind, attn, batch, layer, pruner="fastv", keep=0.5, prompt_len=6, **options):
    model = make_model(kind, attn=attn)
    inputs = make_inputs(kind, model, batch=batch, prompt_len=prompt_len)
    return assert_pruned_equals_masked(
        model, inputs, pruner=pruner, keep=keep, layer=layer, **options
    )


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
