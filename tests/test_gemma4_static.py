"""Gemma 4 (``gemma4``) on a static cache (``cache_implementation="static"`` or a ``StaticCache``
the caller builds) under ``vf.wrap``, eager and with the decode steps compiled.

As on Gemma 3 (``test_gemma3_static.py``), a pruned sliding layer trades its ring buffer for a
plain one of its kept prompt and its decode mask is built from original positions. Gemma 4
adds KV-shared layers (E2B / E4B): they hold no buffer (``DummyLayer``) and attend to their
source layer's, so their prefill and decode masks are the source's per-slot masks. The
batches' rows have different visual token counts, so a static cache keeps one common count
per row (its masks are fixed per slot) where a dynamic cache masks each row's own share: each
static run is checked against the masked reference of its own kept set (reference.py, on the
dynamic cache)."""

from __future__ import annotations

import host_reads
import pytest
import torch
import torch._dynamo
from host_reads import on_device, per_forward
from reference import ATOL, greedy_generate, manual_decode, masked_reference
from test_gemma3_static import _compile_config, _static_cache
from test_gemma4 import SHARED, gemma4_inputs, gemma4_model, video_inputs
from torch._dynamo.utils import counters
from transformers.cache_utils import DummyLayer, StaticLayer, StaticSlidingWindowLayer

import vlm_focus as vf
from vlm_focus.model_adapters import get_adapter

STEPS = 8
# the batches' rows have different visual token counts on purpose (see the module docstring)
pytestmark = pytest.mark.filterwarnings("ignore:vlm_focus. rows with")


def _check(model, inputs, layer, keep=0.5, pruner="fastv", compiled=None, **options):
    """The pruned run on a static cache against the masked reference of its kept set:
    sequences equal, every step's logits within ATOL. Returns the trace, each cache layer's
    class and width while wrapped, and dynamo's graph count (``compiled``: ``dynamic=`` of the
    compile config)."""
    cache = _static_cache(model, inputs, STEPS)
    if compiled is not None:
        options["compile_config"] = _compile_config(compiled)
    wrap = dict(pruner=pruner, keep=keep, layer=layer)
    with torch.no_grad(), vf.wrap(model, **wrap) as handle:
        sequences, logits = greedy_generate(model, inputs, STEPS, cache=cache, **options)
        held = [(type(x), None if x.keys is None else x.keys.shape[2]) for x in cache.layers]
        trace = handle.last_trace
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), masked_reference(model, layers, trace):
        reference = greedy_generate(model, inputs, STEPS)
    assert torch.equal(sequences, reference[0])
    torch.testing.assert_close(logits, reference[1], atol=ATOL, rtol=0)
    return trace, held, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("attn,layer", [("sdpa", 0), ("eager", 1), ("sdpa", 2)])
def test_static_cache_equals_the_masked_reference(attn, layer):
    """Batch 2, left-padded, rows of 116 and 64 image tokens; K = 0 and 2 (sliding layers),
    K = 1 (a full one). Pruned layers hold plain buffers of the kept prompt and the decode."""
    model = gemma4_model(attn)
    inputs = gemma4_inputs(model)
    trace, held, _ = _check(model, inputs, layer)
    room = inputs["input_ids"].shape[1] + STEPS
    dropped = trace.stages[0].keep.logical_not().sum(1).min().item()
    for index, (kind, width) in enumerate(held):
        if index < layer:  # not pruned: the model's own (sliding layers: a ring buffer)
            sliding = index % 2 == 0  # the tiny model's layer types alternate from sliding
            assert (kind, width) == (
                (StaticSlidingWindowLayer, 8) if sliding else (StaticLayer, room)
            )
        else:
            assert (kind, width) == (StaticLayer, room - dropped)


@pytest.mark.parametrize("layer", [0, 2, (1, 2)])
def test_kv_shared_layers_read_their_source_buffer(layer):
    """E2B / E4B in small (per-layer inputs; layers 4 and 5 reuse layers 2's and 3's keys): the
    shared layers keep their ``DummyLayer`` and read the source's pruned buffer, in prefill
    (generate() runs only the last row through them) and decode; two stages at (1, 2)."""
    model = gemma4_model("sdpa", **SHARED)
    keep = (0.5, 0.25) if isinstance(layer, tuple) else 0.5
    _, held, _ = _check(model, gemma4_inputs(model), layer, keep=keep)
    assert [kind for kind, _ in held[4:]] == [DummyLayer, DummyLayer]


def test_videos_on_a_static_cache():
    """An image and a video in one row, a video alone in the other; videos by ``diverse``."""
    model = gemma4_model("sdpa")
    _check(model, video_inputs(model), 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_decode_at_layer_0_is_one_graph(attn):
    """At K = 0 every layer holds a plain buffer, so the compiled step is one graph that no
    step recompiles (``dynamic=False``: any recompile would show)."""
    model = gemma4_model(attn)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, _, graphs = _check(model, gemma4_inputs(model), 0, compiled=False)
    assert graphs == 1


def test_compiled_decode_with_kv_shared_layers():
    model = gemma4_model("sdpa", **SHARED)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, _, graphs = _check(model, gemma4_inputs(model), 0, compiled=False)
    assert graphs == 1


@pytest.mark.parametrize("layer", [0, 2])
def test_a_manual_decode_loop_on_a_caller_built_static_cache(layer):
    model = gemma4_model("sdpa", **SHARED)
    inputs = gemma4_inputs(model)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        static = manual_decode(model, inputs, 6, _static_cache(model, inputs, STEPS))
        trace = handle.last_trace
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), masked_reference(model, layers, trace):
        reference = manual_decode(model, inputs, 6)
    assert torch.equal(static, reference)


def test_remove_gives_the_cache_its_ring_buffers_back():
    model = gemma4_model("sdpa", **SHARED)
    inputs = gemma4_inputs(model)
    cache = _static_cache(model, inputs, STEPS)
    kinds = [type(layer) for layer in cache.layers]
    with torch.no_grad():
        before = greedy_generate(model, inputs, STEPS, cache_implementation="static")
        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=0)
        greedy_generate(model, inputs, STEPS, cache=cache)
        assert [type(layer) for layer in cache.layers] == [StaticLayer] * 4 + [DummyLayer] * 2
        handle.remove()
        assert [type(layer) for layer in cache.layers] == kinds
        cache.reset()
        again = greedy_generate(model, inputs, STEPS, cache=cache)
        after = greedy_generate(model, inputs, STEPS, cache_implementation="static")
    for run in (again, after):
        assert torch.equal(before[0], run[0]) and torch.equal(before[1], run[1])


@pytest.mark.parametrize("layer", [0, 2])
def test_no_host_reads_per_decode_step(layer):
    model = gemma4_model("sdpa", **SHARED)
    inputs = on_device(gemma4_inputs(model))
    host_reads.reads.clear()
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer):
        with per_forward(model) as marks:
            model.generate(
                **inputs, max_new_tokens=6, do_sample=False, cache_implementation="static"
            )
    # marks: before each forward (after the engine's model hook), then at the end
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"


def test_compiled_decode_at_layer_2_compiles_as_the_unwrapped_model_does():
    """At K = 2 layer 0 keeps the model's ring buffer, whose Python length the compiled step
    guards on, as on Gemma 3: transformers' default ``dynamic=None`` compiles the unwrapped
    model more than once, and the pruned one no more often."""
    model = gemma4_model("sdpa")
    inputs = gemma4_inputs(model)
    config = _compile_config(None)
    with torch.no_grad():
        greedy_generate(model, inputs, STEPS, cache_implementation="static", compile_config=config)
    unwrapped = counters["stats"]["unique_graphs"]
    _, _, graphs = _check(model, inputs, 2, compiled=None)
    assert graphs == unwrapped == 2
