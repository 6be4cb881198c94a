"""A static cache (``cache_implementation="static"`` or a ``StaticCache`` the caller builds)
under ``vf.wrap``: every layer >= K holds only its kept tokens in its preallocated buffer, and
the pruned run equals the unpruned model with the pruned visual keys masked (reference.py, run
on the default dynamic cache), in prefill and 16 cached decode steps; eager, and with the decode
steps compiled by ``generate()``'s own ``compile_config`` path (one graph per hook and forward,
no graph break, no recompilation)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from reference import fixation_reference, greedy_generate, manual_decode, masked_reference
from tiny_models import make_case, make_model
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

import vlm_focus as vf

ATOL = 2e-5
STEPS = 16


def _generate(model, inputs, **kwargs):
    return greedy_generate(model, inputs, STEPS, **kwargs)


def compiled(backend: str) -> dict:
    """``generate()`` keyword arguments that compile its decode steps on any device (it
    compiles on CUDA by default), failing on a graph break (``fullgraph``); dynamo's caches are
    emptied first, so each model compiles afresh."""
    config = CompileConfig(backend=backend, fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    torch._dynamo.reset()
    counters.clear()
    return {"compile_config": config}


def _check(kind, attn, batch, layer, pruner="fastv", keep=0.5, cache=None, backend=None, **options):
    model = make_model(kind, attn=attn)
    inputs = make_case(kind, "image", model, batch=batch)
    layers = model.model.language_model.layers
    static = {"cache_implementation": "static"} if cache is None else {"cache": cache(model)}
    if backend is not None:
        static.update(compiled(backend))
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=keep, layer=layer, **options) as h:
        sequences, logits = _generate(model, inputs, **static)
        trace = h.last_trace
    if backend is not None:  # each hooked frame and the forward compiled once, for every step
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    if pruner == "fixation":
        reference = fixation_reference(model, layers, layer, trace)
        assert len(trace.fixations) == STEPS - 1
        for step in trace.fixations:  # every step reads its keep, among what the prompt kept
            for fixed, kept in zip(step, trace.kept, strict=True):
                assert set(fixed.tolist()) < set(kept.tolist())
    else:
        reference = masked_reference(model, layers, trace)
        assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    with torch.no_grad(), reference:
        ref_sequences, ref_logits = _generate(model, inputs)  # dynamic cache
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    return model, inputs, trace


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "qwen3_vl", "llava_onevision"])
def test_static_cache_equals_the_masked_reference(kind, attn, layer):
    _check(kind, attn, 2, layer)  # batch 2, left-padded, rows of different visual counts


@pytest.mark.parametrize("kind", ["llava_next", "qwen2_vl", "qwen3_vl_moe", "internvl"])
def test_static_cache_at_batch_one(kind):
    _check(kind, "sdpa", 1, 2)


@pytest.mark.parametrize("pruner", ["pyramid", "random", "debiased", "diverse", "pool", "text"])
def test_static_cache_with_other_pruners(pruner):
    _check("qwen2_5_vl", "sdpa", 2, 0, pruner=pruner)


@pytest.mark.parametrize("kind", ["llava", "qwen3_vl"])
def test_static_cache_with_a_multi_stage_schedule(kind):
    _, _, trace = _check(kind, "eager", 2, (0, 1, 3), keep=(0.75, 0.5, 0.25))
    assert [s.layer for s in trace.stages] == [0, 1, 3]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_fixation_on_a_static_cache_equals_its_reference(kind, attn):
    _check(kind, attn, 2, 1, pruner="fixation", keep=0.25)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["llava", "qwen3_vl"])
def test_fixation_within_a_pruned_prompt_equals_its_reference(kind, static):
    cache = None if static else (lambda model: None)  # None: generate()'s dynamic cache
    _check(
        kind, "sdpa", 2, 2, pruner="fixation", keep=0.2, prefill_keep=0.5, refresh=2, cache=cache
    )


def test_a_static_cache_the_caller_builds():
    def build(model):
        return StaticCache(config=model.config.get_text_config(), max_cache_len=64)

    for layer in (0, 2):
        _check("llava", "sdpa", 2, layer, cache=build)


def test_pruned_layers_hold_buffers_only_as_wide_as_what_they_keep():
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)
    prompt = inputs["input_ids"].shape[1]
    cache = StaticCache(config=model.config.get_text_config(), max_cache_len=prompt + STEPS)
    handle = vf.wrap(model, keep=(0.5, 0.25), layer=(1, 2), pruner="fastv")
    with torch.no_grad():
        _generate(model, inputs, cache=cache)
    first, second = handle.last_trace.stages
    dropped = [
        int(first.keep.logical_not().sum(1).min()),
        int(second.keep.logical_not().sum(1).min()),
    ]
    widths = [layer.keys.shape[2] for layer in cache.layers]
    assert widths[0] == prompt + STEPS  # layer 0 sizes every mask
    assert widths[1] == prompt + STEPS - dropped[0]
    assert widths[2:] == [prompt + STEPS - sum(dropped)] * (len(widths) - 2)
    handle.remove()  # the cache is whole again, for the unwrapped model
    assert {layer.max_cache_len for layer in cache.layers} == {prompt + STEPS}
    cache.reset()
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)


def test_a_static_cache_too_short_says_the_size_needed():
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)
    prompt = inputs["input_ids"].shape[1]
    config = model.config.get_text_config()
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=2):
        short = StaticCache(config=config, max_cache_len=prompt + 2)
        with pytest.raises(ValueError, match=rf"holds {prompt + 2} tokens, and this step needs"):
            model.generate(**inputs, cache=short, max_new_tokens=5, do_sample=False)
        shorter = StaticCache(config=config, max_cache_len=prompt - 3)
        with pytest.raises(ValueError, match=rf"holds {prompt - 3} tokens and the prompt has"):
            model.generate(**inputs, cache=shorter, max_new_tokens=5, do_sample=False)


def test_remove_after_a_static_cache_run_restores_the_model_exactly():
    model = make_model("qwen2_5_vl")
    inputs = make_case("qwen2_5_vl", "image", model, batch=2)
    with torch.no_grad():
        before = _generate(model, inputs, cache_implementation="static")
        handle = vf.wrap(model, keep=0.25, layer=0)
        _generate(model, inputs, cache_implementation="static")
        handle.remove()
        after = _generate(model, inputs, cache_implementation="static")
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_manual_decode_loop_on_a_static_cache_matches_generate():
    for layer in (0, 2):
        model = make_model("llava")
        inputs = make_case("llava", "image", model, batch=2)
        config = model.config.get_text_config()
        with torch.no_grad(), vf.wrap(model, keep=0.5, layer=layer):
            expected = model.generate(
                **inputs, max_new_tokens=4, do_sample=False, cache_implementation="static"
            )[:, -4:]
            cache = StaticCache(config=config, max_cache_len=64)
            assert torch.equal(manual_decode(model, inputs, 4, cache), expected), layer


# --- compiled decode steps -------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "qwen3_vl", "llava_onevision"])
def test_compiled_static_decode_equals_the_masked_reference(kind, attn, layer):
    _check(kind, attn, 2, layer, backend="eager")


@pytest.mark.parametrize("pruner", ["pyramid", "random"])
def test_compiled_static_decode_with_other_pruners(pruner):
    _check("qwen2_5_vl", "sdpa", 2, 0, pruner=pruner, backend="eager")


def test_compiled_static_decode_at_batch_one_with_a_multi_stage_schedule():
    _check("qwen3_vl", "sdpa", 1, (0, 1, 3), keep=(0.75, 0.5, 0.25), backend="eager")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_fixation_equals_its_reference(attn):
    _check("llava", attn, 2, 1, pruner="fixation", keep=0.25, refresh=2, backend="eager")


def test_compiled_decode_with_inductor_equals_the_masked_reference():
    # the real compiler (C++ kernels on the CPU); the matrix above traces with dynamo only
    _check("llava", "sdpa", 2, 2, backend="inductor")


def test_32_compiled_decode_steps_do_not_recompile():
    model = make_model("qwen3_vl")
    inputs = make_case("qwen3_vl", "image", model, batch=2)
    other = make_case("qwen3_vl", "image", model, batch=2, seed=1)  # same length, new pixels
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=0.25, layer=2, refresh=3):
        options = compiled("eager")
        # warm-up: generate() keeps the longest static cache it built, so shapes stay put
        greedy_generate(model, inputs, 33, cache_implementation="static", **options)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for case in (inputs, other):
                greedy_generate(model, case, 33, cache_implementation="static", **options)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_decode_step_has_no_graph_break():
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)
    config = model.config.get_text_config()
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=0):
        cache = StaticCache(config=config, max_cache_len=40)
        out = model(**inputs, cache=cache, use_cache=True)
        mask = torch.cat(
            [inputs["attention_mask"], torch.ones_like(inputs["attention_mask"][:, :1])], 1
        )
        step = {
            "input_ids": out.logits[:, -1:].argmax(-1),
            "attention_mask": mask,
            "position_ids": mask.long().cumsum(-1)[:, -1:] - 1,
            "cache": cache,
            "use_cache": True,
        }
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**step)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count >= 1


def test_compiling_a_prompt_is_refused_with_the_way_that_works():
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=2):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="runs one-token decode steps on a static cache"):
            torch.compile(model, backend="eager", fullgraph=True)(**inputs)
