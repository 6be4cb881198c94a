"""Gemma 3 (``gemma3``) on a static cache (``cache_implementation="static"`` or a ``StaticCache``
the caller builds) under ``vf.wrap``, eager and with the decode steps compiled.

Unwrapped, each sliding-window layer of a static cache is a ring buffer of its newest
``sliding_window`` keys (``StaticSlidingWindowLayer``). Pruned, a sliding layer holds its kept
prompt in a plain buffer and its decode mask is built from original positions, window
included. The tiny model's window (8) is shorter than every prompt here (~49 tokens) and than
the decode, so the window matters at every step. Each run equals the dynamic-cache pruned run
and the masked reference (reference.py, itself on the dynamic cache)."""

from __future__ import annotations

import host_reads
import pytest
import torch
import torch._dynamo
from host_reads import on_device, per_forward
from reference import ATOL, greedy_generate, manual_decode, masked_reference
from test_gemma3 import gemma_inputs, gemma_model
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

import vlm_focus as vf
from vlm_focus.model_adapters import get_adapter

STEPS = 12


def _static_cache(model, inputs, steps=STEPS):
    width = inputs["input_ids"].shape[1] + steps
    return StaticCache(config=model.config.get_text_config(), max_cache_len=width)


def _compile_config(dynamic):
    """``generate()``'s own compiled decoding, on any device, failing on a graph break;
    dynamo's caches are emptied first."""
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=dynamic)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    torch._dynamo.reset()
    counters.clear()
    return config


def _check(attn, layer, keep=0.5, batch=2, images=2, seed=0, compiled=None):
    """The pruned run on a static cache against the dynamic-cache pruned run and the masked
    reference: sequences equal, every step's logits within ATOL. Returns the trace, each cache
    layer's class and width while wrapped, and dynamo's graph count (``compiled``:
    ``dynamic=`` of the compile config)."""
    model = gemma_model(attn)
    inputs = gemma_inputs(batch=batch, images=images, seed=seed)
    cache = _static_cache(model, inputs)
    options = {} if compiled is None else {"compile_config": _compile_config(compiled)}
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=keep, layer=layer) as handle:
        sequences, logits = greedy_generate(model, inputs, STEPS, cache=cache, **options)
        graphs = counters["stats"]["unique_graphs"]
        held = [(type(layer), layer.keys.shape[2]) for layer in cache.layers]
        trace = handle.last_trace
        dynamic = greedy_generate(model, inputs, STEPS)
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    assert torch.equal(sequences, dynamic[0])
    torch.testing.assert_close(logits, dynamic[1], atol=ATOL, rtol=0)
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), masked_reference(model, layers, trace):
        reference = greedy_generate(model, inputs, STEPS)
    assert torch.equal(sequences, reference[0])
    torch.testing.assert_close(logits, reference[1], atol=ATOL, rtol=0)
    return trace, held, graphs


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_cache_equals_the_dynamic_run_and_the_masked_reference(attn, layer):
    """Batch 2, left-padded, two images a row; K = 0 (layer 0 is a sliding one) and K = 2."""
    trace, held, _ = _check(attn, layer)
    prompt = trace.visual.shape[1]
    dropped = trace.stages[0].keep.logical_not().sum(1).min().item()
    room = prompt + STEPS
    window = 8  # the tiny model's
    for index, (kind, width) in enumerate(held):
        if index < layer:  # not pruned: the model's own (sliding layers: a ring buffer)
            sliding = index % 2 == 0  # the tiny model's layer types alternate from sliding
            own = (StaticSlidingWindowLayer, window) if sliding else (StaticLayer, room)
            assert (kind, width) == own
            continue
        # a pruned layer holds a plain buffer of its kept prompt and the generated tokens
        assert kind is StaticLayer
        assert width == room - dropped


def test_a_multi_stage_schedule_on_a_static_cache():
    trace, _, _ = _check("eager", (1, 2), keep=(0.5, 0.25))
    assert [s.layer for s in trace.stages] == [1, 2]


def test_one_image_at_batch_one_and_a_decode_past_the_window():
    _check("sdpa", 1, keep=0.25, batch=1, images=1, seed=3)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_decode_at_layer_0_is_one_graph(attn):
    """At K = 0 every sliding layer is pruned and holds a plain buffer, so the compiled step
    is one graph that no step recompiles (``dynamic=False``: any recompile would show)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, _, graphs = _check(attn, 0, compiled=False)
    assert graphs == 1


def test_a_second_prompt_reuses_the_compiled_step():
    """``generate()`` keeps its static cache for the next prompt of the same length (new
    tokens and pixels): the pruned layers keep their plain buffers, nothing recompiles, and
    the second prompt still equals its dynamic-cache run."""
    model = gemma_model("sdpa")
    first, second = gemma_inputs(seed=0), gemma_inputs(seed=1)
    config = _compile_config(False)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=0):
        static = {"cache_implementation": "static", "compile_config": config}
        greedy_generate(model, first, STEPS, **static)
        with torch._dynamo.config.patch(error_on_recompile=True):
            sequences, logits = greedy_generate(model, second, STEPS, **static)
        dynamic = greedy_generate(model, second, STEPS)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(sequences, dynamic[0])
    torch.testing.assert_close(logits, dynamic[1], atol=ATOL, rtol=0)


def test_compiled_decode_at_layer_2_compiles_as_the_unwrapped_model_does():
    """At K = 2 layer 0 keeps the model's ring buffer, whose Python length the compiled step
    guards on: unwrapped, transformers compiles it twice (``dynamic=None`` makes the length
    symbolic after one recompile; ``dynamic=False`` recompiles every step). Pruned, no more."""
    model = gemma_model("sdpa")
    inputs = gemma_inputs()
    with torch.no_grad():
        config = _compile_config(None)
        greedy_generate(model, inputs, STEPS, cache_implementation="static", compile_config=config)
    unwrapped = counters["stats"]["unique_graphs"]
    _, _, graphs = _check("sdpa", 2, compiled=None)
    assert graphs == unwrapped == 2


@pytest.mark.parametrize("layer", [0, 2])
def test_a_manual_decode_loop_on_a_caller_built_static_cache(layer):
    """``model(...)`` calls on a ``StaticCache`` the caller built: the model sizes its masks
    itself inside the call, from its first layer of each kind, so the pruned layers are sized
    only when they run. Equal to the same loop on the masked reference."""
    model = gemma_model("sdpa")
    inputs = gemma_inputs()
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        static = manual_decode(model, inputs, 6, _static_cache(model, inputs))
        trace = handle.last_trace
        dynamic = manual_decode(model, inputs, 6)
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), masked_reference(model, layers, trace):
        reference = manual_decode(model, inputs, 6)
    assert torch.equal(static, dynamic) and torch.equal(static, reference)


def test_remove_gives_the_cache_its_ring_buffers_back():
    model = gemma_model("sdpa")
    inputs = gemma_inputs()
    cache = _static_cache(model, inputs)
    kinds = [type(layer) for layer in cache.layers]
    with torch.no_grad():
        before = greedy_generate(model, inputs, STEPS, cache_implementation="static")
        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=0)
        greedy_generate(model, inputs, STEPS, cache=cache)
        assert [type(layer) for layer in cache.layers] == [StaticLayer] * len(kinds)
        handle.remove()
        assert [type(layer) for layer in cache.layers] == kinds
        cache.reset()
        again = greedy_generate(model, inputs, STEPS, cache=cache)
        after = greedy_generate(model, inputs, STEPS, cache_implementation="static")
    for run in (again, after):
        assert torch.equal(before[0], run[0]) and torch.equal(before[1], run[1])


def test_remove_after_decoding_under_inference_mode():
    """A static cache that ``generate()`` builds under ``torch.inference_mode()`` (and keeps on
    the model for the next call) holds inference tensors, which only inference mode may change
    in place: ``remove()`` outside it still gives the ring buffers back, and the unwrapped model
    then decodes as before."""
    model = gemma_model("sdpa")
    inputs = gemma_inputs()
    static = dict(cache_implementation="static")
    with torch.inference_mode():
        before = greedy_generate(model, inputs, STEPS, **static)
    with vf.wrap(model, pruner="fastv", keep=0.25, layer=2):
        with torch.inference_mode():
            greedy_generate(model, inputs, STEPS, **static)
    with torch.inference_mode():
        again = greedy_generate(model, inputs, STEPS, **static)
    assert torch.equal(before[0], again[0]) and torch.equal(before[1], again[1])


@pytest.mark.parametrize("layer", [0, 2])
def test_no_host_reads_per_decode_step(layer):
    model = gemma_model("sdpa")
    inputs = on_device(gemma_inputs())
    host_reads.reads.clear()
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer):
        with per_forward(model) as marks:
            model.generate(
                **inputs, max_new_tokens=6, do_sample=False, cache_implementation="static"
            )
    # marks: before each forward (after the engine's model hook), then at the end
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"
