"""Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``): pruning a hybrid decoder of Gated DeltaNet and
full-attention layers (tiny layer types: linear, linear, full, linear).

The masked reference is undefined here (a linear layer cannot mask a token out), so every
pruned run is checked against :class:`reference_hybrid.HybridReference`: the model's own decoder
layers called by hand, the dropped rows gone from the stage layer on. Prefill logits of every
valid kept row and 6 cached decode steps agree, for each pruner at a linear and a full stage
layer, K = 0 and K >= 1, SDPA and eager, a left-padded batch of 2, two images in one prompt and
a video; the real processor builds images of two sizes and a video. The reference itself equals
the unpruned model when it keeps everything.

On a static cache (``cache_implementation="static"``, or a ``StaticCache`` the caller builds)
greedy generation, with or without compiled decode steps (one graph, no recompilation), equals
the dynamic-cache run at every stage layer and on a decoder with two full-attention layers and
three stages, with no host read per decode step.
"""

from __future__ import annotations

import dataclasses

import host_reads
import pytest
import torch
import torch._dynamo
from host_reads import on_device, per_forward
from reference import greedy_generate
from reference_hybrid import HybridReference
from test_static_cache import compiled
from tiny_models import _qwen_types, make_case
from tiny_processors import hybrid_processor, noise_image, noise_video
from torch._dynamo.utils import counters
from transformers import StaticCache
from transformers.models.qwen3_5 import modeling_qwen3_5

import vlm_focus as vf
from vlm_focus.core.attention import allowed_keys, attention_probs, layer_qk
from vlm_focus.model_adapters import get_adapter, register_adapter
from vlm_focus.model_adapters.qwen3_5 import QWEN3_5, DeltaNetScorer
from vlm_focus.model_adapters.tiny import BOS, IMAGE, VISION_END, VISION_START, tiny_model

LINEAR, FULL = 1, 2  # stage layers of each kind in the tiny decoder (layer 0 is linear too)
TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])  # 6 decode steps
ATOL = 2e-5

_MODELS: dict = {}


def _model(attn: str = "sdpa", kind: str = "qwen3_5"):
    if (kind, attn) not in _MODELS:
        _MODELS[kind, attn] = tiny_model(kind, attn=attn)
    return _MODELS[kind, attn]


def _two_images(model, batch: int = 2) -> dict:
    """Left-padded rows with two images each, text between and after them."""
    gen = torch.Generator().manual_seed(3)
    grids = [[1, 4, 8], [1, 8, 4], [1, 4, 4], [1, 8, 8]][: 2 * batch]
    rows = []
    for b in range(batch):
        row = [BOS, 5, 6]
        for t, h, w in grids[2 * b : 2 * b + 2]:
            row += [VISION_START] + [IMAGE] * (t * h * w // 4) + [VISION_END] + [7] * (1 + b)
        rows.append(row + [8, 9, 10])
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
        types[b, width - len(row) :] = torch.tensor(_qwen_types(row))
    vision = model.config.vision_config
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=gen)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        mm_token_type_ids=types,
        pixel_values=pixels,
        image_grid_thw=torch.tensor(grids),
    )


def _inputs(model, case: str) -> dict:
    if case == "two_images":
        return _two_images(model)
    return make_case("qwen3_vl", case, model, batch=2)


def _stage_rows(trace, seq: int) -> dict[int, torch.Tensor]:
    """Per stage layer, the original positions each row keeps (all but its dropped visual)."""
    stages = {}
    for stage in trace.stages:
        rows = []
        for b, kept in enumerate(stage.kept):
            dropped = set(trace.visual_positions[b].tolist()) - set(kept.tolist())
            rows.append([p for p in range(seq) if p not in dropped])
        stages[stage.layer] = torch.tensor(rows)
    return stages


def _decode(
    model, inputs: dict, tokens: torch.Tensor, cache=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits, then one cached step per column of ``tokens`` (positioned as generate()
    positions a Qwen step: the mask's count plus ``rope_deltas``), their logits; on ``cache``
    when given (else a dynamic one)."""
    out = model(**inputs, cache=cache, use_cache=True)
    cache, mask = out.past_key_values, inputs["attention_mask"]
    steps = []
    for t in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
        position = mask.cumsum(-1)[:, -1:] - 1 + model.model.rope_deltas
        step = model(
            input_ids=tokens[:, t : t + 1],
            attention_mask=mask,
            position_ids=position[None].expand(3, -1, -1),
            cache=cache,
            use_cache=True,
        )
        steps.append(step.logits)
    return out.logits, torch.cat(steps, 1)


def _check(model, inputs: dict, **wrap):
    """The pruned run equals the hybrid reference on the same kept set; returns its trace."""
    tokens = TOKENS[: inputs["input_ids"].shape[0]]
    with torch.no_grad():
        with vf.wrap(model, **wrap) as handle:
            logits, steps = _decode(model, inputs, tokens)
            trace = handle.last_trace
        reference = HybridReference(model, inputs, _stage_rows(trace, inputs["input_ids"].shape[1]))
        ref_logits, ref_steps = reference.run(tokens)
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    assert logits.shape == ref_logits.shape
    valid = inputs["attention_mask"].gather(1, trace.sequence).bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps, ref_steps, atol=ATOL, rtol=0)
    return trace


# --- the reference is not vacuous ---------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_reference_keeping_everything_is_the_model(attn):
    model = _model(attn)
    inputs = _inputs(model, "image")
    with torch.no_grad():
        logits, steps = _decode(model, inputs, TOKENS)
        ref_logits, ref_steps = HybridReference(model, inputs, {}).run(TOKENS)
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps, ref_steps, atol=ATOL, rtol=0)
    # and pruning changes the answer: the comparison below can fail
    with torch.no_grad(), vf.wrap(model, pruner="random", keep=0.25, layer=LINEAR):
        pruned = model(**inputs).logits[:, -1]
    assert (pruned - logits[:, -1]).abs().max() > 1e-3


# --- pruned == reference ------------------------------------------------------------------------
SETTINGS = [
    dict(pruner="fastv", layer=0),
    dict(pruner="fastv", layer=LINEAR),
    dict(pruner="fastv", layer=FULL),
    dict(pruner="random", layer=FULL),
    dict(pruner="debiased", layer=LINEAR),
    dict(pruner="debiased", layer=FULL),
    dict(pruner="diverse", layer=3),  # a linear layer with no full layer after it
    dict(pruner="pyramid", layer=(LINEAR, FULL), keep=(0.6, 0.5)),
    dict(pruner="pyramid", layer=(0, FULL), keep=(0.7, 0.4)),
]


EAGER = [SETTINGS[0], SETTINGS[1], SETTINGS[5], SETTINGS[7]]


def _name(setting: dict) -> str:
    return f"{setting['pruner']}-{setting['layer']}"


@pytest.mark.parametrize(
    ("setting", "attn"),
    [(s, "sdpa") for s in SETTINGS] + [(s, "eager") for s in EAGER],
    ids=lambda x: _name(x) if isinstance(x, dict) else x,
)
def test_pruned_equals_the_hybrid_reference(setting, attn):
    _check(_model(attn), _inputs(_model(attn), "image"), **{"keep": 0.5, **setting})


@pytest.mark.parametrize("case", ["video", "two_images"])
@pytest.mark.parametrize("setting", [SETTINGS[1], SETTINGS[8]], ids=_name)
def test_video_and_two_images_equal_the_hybrid_reference(case, setting):
    model = _model("sdpa")
    _check(model, _inputs(model, case), **{"keep": 0.5, **setting})


def test_moe_equals_the_hybrid_reference():
    model = _model("sdpa", "qwen3_5_moe")
    assert get_adapter(model).recurrent_layers(model) == {0, 1, 3}
    _check(model, _inputs(model, "image"), pruner="fastv", keep=0.5, layer=LINEAR)


def test_real_processor_images_of_two_sizes_and_a_video():
    model = _model("sdpa")
    processor = hybrid_processor(model)
    images = [noise_image(120, 40, seed=0), noise_image(60, 60, seed=1)]
    inputs = dict(
        processor(
            text=["<|vision_start|><|image_pad|><|vision_end|> describe the image"] * 2,
            images=images,
            padding=True,
            return_tensors="pt",
        )
    )
    grids = inputs["image_grid_thw"]
    assert not torch.equal(grids[0], grids[1])  # two sizes, two grids
    assert inputs["attention_mask"][:, 0].tolist().count(0) == 1  # one row is left-padded
    _check(model, inputs, pruner="fastv", keep=0.5, layer=LINEAR)
    video = noise_video(4, 64, 48, seed=2)
    inputs = dict(
        processor(
            text=["<|vision_start|><|video_pad|><|vision_end|> what is in this video ?"],
            videos=[video],
            videos_kwargs={"video_metadata": [{"total_num_frames": 4, "fps": 2.0}]},
            return_tensors="pt",
        )
    )
    _check(model, inputs, pruner="debiased", keep=0.5, layer=FULL)


# --- scoring ----------------------------------------------------------------------------------
def test_stages_score_with_the_next_full_layer_or_their_own():
    model = _model()
    layers = QWEN3_5.decoder_layers(model)
    assert QWEN3_5.recurrent_layers(model) == {0, 1, 3}
    assert [QWEN3_5.scoring_layer(model, i) is layers[FULL] for i in range(4)] == [True] * 4
    delta = dataclasses.replace(QWEN3_5, linear_scoring="delta_qk")
    assert isinstance(delta.scoring_layer(model, LINEAR), DeltaNetScorer)
    assert delta.scoring_layer(model, FULL) is layers[FULL]
    with pytest.raises(ValueError, match="linear_scoring='nearest' for 'qwen3_5'; allowed"):
        dataclasses.replace(QWEN3_5, linear_scoring="nearest")


def _grab_input(seen: dict):
    """A layer pre-hook that files the layer's input hidden states under ``seen["input"]``."""

    def hook(module, args, kwargs):
        seen["input"] = args[0] if args else kwargs["hidden_states"]

    return hook


def test_full_layer_q_k_are_its_own_attention_with_gate_and_partial_rope():
    """Gated queries, q/k norms and RoPE over half the head: the scoring rows equal the
    attention weights the layer's own eager attention returns."""
    model = _model("eager")
    inputs = _inputs(model, "image")
    seen = {}
    layer = QWEN3_5.decoder_layers(model)[FULL]

    def grab(module, args, kwargs, output):
        seen["weights"] = output[1]
        seen["hidden"] = kwargs["hidden_states"]
        seen["rope"] = kwargs["position_embeddings"]

    handle = layer.self_attn.register_forward_hook(grab, with_kwargs=True)
    grab_input = layer.register_forward_pre_hook(_grab_input(seen), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
        grab_input.remove()
    cos, sin = seen["rope"]
    assert cos.shape[-1] < layer.self_attn.head_dim  # partial rotary
    seq = seen["input"].shape[1]
    rows = torch.tensor([[seq - 1, seq - 3]] * 2)
    with torch.no_grad():
        q, k = layer_qk(QWEN3_5, layer, seen["input"], cos, sin, rows)
        valid = inputs["attention_mask"].bool()
        probs = attention_probs(q, k, layer.self_attn.scaling, allowed_keys(valid, rows))
    own = seen["weights"][:, :, rows[0]]
    torch.testing.assert_close(
        probs[valid[:, None, None].expand_as(probs)].view(-1),
        own[valid[:, None, None].expand_as(own)].view(-1),
        atol=1e-5,
        rtol=0,
    )


def test_delta_qk_are_the_deltanets_own_queries_and_keys(monkeypatch):
    model = _model()
    inputs = make_case("qwen3_vl", "image", model, batch=1)  # no padding
    layer = QWEN3_5.decoder_layers(model)[LINEAR]
    seen = {}
    real = modeling_qwen3_5.torch_chunk_gated_delta_rule

    def spy(query, key, *args, **kwargs):
        seen.setdefault("qk", []).append((query, key))  # one call per linear layer, in order
        return real(query, key, *args, **kwargs)

    grab = layer.register_forward_pre_hook(_grab_input(seen), with_kwargs=True)
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", spy)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        grab.remove()
    scorer = DeltaNetScorer(QWEN3_5, layer)
    seq = seen["input"].shape[1]
    rows = torch.arange(seq)[None]
    with torch.no_grad():
        q, k = scorer.query_key(seen["input"], None, None, rows)
    own_q, own_k = (modeling_qwen3_5.l2norm(x.float(), dim=-1) for x in seen["qk"][LINEAR])
    torch.testing.assert_close(q, own_q.transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(k, own_k.transpose(1, 2), atol=1e-5, rtol=0)
    assert scorer.self_attn.scaling == layer.linear_attn.head_k_dim**-0.5


def test_delta_qk_scoring_equals_the_reference():
    model = _model("sdpa")
    inputs = _inputs(model, "image")
    register_adapter(dataclasses.replace(QWEN3_5, linear_scoring="delta_qk"), replace=True)
    try:
        with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=LINEAR) as h:
            model(**inputs)
            delta_scores = h.last_trace.stages[0].scores
        _check(model, inputs, pruner="fastv", keep=0.5, layer=LINEAR)
        _check(model, inputs, pruner="pyramid", layer=(0, FULL), keep=(0.7, 0.4))
    finally:
        register_adapter(QWEN3_5, replace=True)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=LINEAR) as h:
        model(**inputs)
        next_full_scores = h.last_trace.stages[0].scores
    assert not torch.allclose(
        torch.cat(delta_scores), torch.cat(next_full_scores)
    )  # the rule reached the scores


# --- exactness, caches, refusals --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_keep_all_changes_nothing_and_remove_is_exact(kind):
    model = _model("sdpa", kind)
    inputs = _inputs(model, "image")
    with torch.no_grad():
        before = model(**inputs).logits
        with vf.wrap(model, pruner="fastv", keep=1.0, layer=LINEAR):
            assert torch.equal(model(**inputs).logits, before)
        handle = vf.wrap(model, pruner="fastv", keep=0.5, layer=LINEAR)
        assert not torch.equal(model(**inputs).logits[:, -1], before[:, -1])
        handle.remove()
        assert torch.equal(model(**inputs).logits, before)


@pytest.mark.parametrize("pruner,layer", [("fastv", LINEAR), ("fastv", FULL), ("pyramid", 0)])
def test_no_host_reads_per_decode_step(pruner, layer):
    model = _model()
    inputs = on_device(_inputs(model, "image"))
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=layer):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"


@pytest.mark.parametrize("layer", [0, LINEAR, FULL])
def test_every_cache_layer_reports_the_original_length(layer):
    model = _model()
    inputs = _inputs(model, "image")
    seq = inputs["input_ids"].shape[1]
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer):
        cache = model(**inputs, use_cache=True).past_key_values
    # linear layers count tokens too (a 0-d tensor); the model reads layer 0's
    assert [int(cache.get_seq_length(i)) for i in range(4)] == [seq] * 4
    assert int(cache.get_seq_length()) == seq


def test_generate_matches_the_manual_decode():
    model = _model()
    inputs = _inputs(model, "image")
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=LINEAR):
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        logits, steps = _decode(model, inputs, out[:, -4:-1])
    greedy = torch.cat([logits[:, -1:], steps], 1).argmax(-1)
    assert torch.equal(greedy, out[:, -4:])


def test_decode_time_pruner_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="cannot do"):
        vf.wrap(model, pruner="fixation", keep=0.5, layer=LINEAR)


# --- a static cache and compiled decode steps -----------------------------------------------
# The full-attention layers hold StaticLayer buffers (each pruned one only its kept tokens), the
# linear layers their fixed-size states; the run equals the same pruned run on the default
# dynamic cache, which the tests above check against the hybrid reference.
STATIC_STEPS = 8
#: six layers, two of them full: the first (layer 1) sizes the model's masks, layer 4 is resized
TWO_FULL = ["linear_attention", "full_attention", "linear_attention"] * 2


def _static_equals_dynamic(model, inputs, backend=None, cache=None, **wrap):
    """Greedy generate on a static cache (built by generate(), or ``cache``; decode steps
    compiled with ``backend``) equals the dynamic-cache run of the same pruning; returns the
    trace and the static cache's layers when ``cache`` was given."""
    static = {"cache_implementation": "static"} if cache is None else {"cache": cache}
    if backend is not None:
        static.update(compiled(backend))
    with torch.no_grad(), vf.wrap(model, **wrap) as handle:
        sequences, logits = greedy_generate(model, inputs, STATIC_STEPS, **static)
        trace = handle.last_trace
        widths = None if cache is None else [_width(layer) for layer in cache.layers]
        ref_sequences, ref_logits = greedy_generate(model, inputs, STATIC_STEPS)
    if backend is not None:  # each hooked frame and the forward compiled once, for every step
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    return trace, widths


def _width(layer) -> int | None:
    """A static attention layer's buffer width, ``None`` for a linear layer (no buffer)."""
    keys = getattr(layer, "keys", None)
    return None if keys is None else keys.shape[2]


@pytest.mark.parametrize("layer", [0, LINEAR, FULL, 3])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_cache_equals_the_dynamic_cache_run(attn, layer):
    # layers 0-2 prune the layer that sizes the masks (FULL), layer 3 prunes after it
    model = _model(attn)
    _static_equals_dynamic(model, _inputs(model, "image"), pruner="fastv", keep=0.5, layer=layer)


@pytest.mark.parametrize("layer", [0, FULL])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_static_decode_equals_the_dynamic_cache_run(attn, layer):
    model = _model(attn)
    inputs = _inputs(model, "image")
    _static_equals_dynamic(model, inputs, "eager", pruner="fastv", keep=0.5, layer=layer)


def test_moe_on_a_compiled_static_cache_equals_the_dynamic_cache_run():
    model = _model(kind="qwen3_5_moe")
    inputs = _inputs(model, "image")
    _static_equals_dynamic(model, inputs, "eager", pruner="fastv", keep=0.5, layer=LINEAR)


def test_compiled_decode_steps_do_not_recompile_for_new_pixels():
    model = _model()
    inputs = _inputs(model, "image")
    other = make_case("qwen3_vl", "image", model, batch=2, seed=1)  # same length, new pixels
    assert other["input_ids"].shape == inputs["input_ids"].shape
    options = dict(cache_implementation="static", **compiled("eager"))
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=LINEAR):
        greedy_generate(model, inputs, STATIC_STEPS, **options)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for case in (inputs, other):
                greedy_generate(model, case, STATIC_STEPS, **options)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("backend", [None, "eager"])
def test_two_full_layers_and_three_stages_on_a_static_cache(backend):
    model = tiny_model("qwen3_5", text={"layer_types": TWO_FULL, "num_hidden_layers": 6})
    inputs = _inputs(model, "image")
    wrap = dict(pruner="fastv", keep=(0.75, 0.5, 0.25), layer=(0, 2, 4))
    if backend is None:  # this decoder's dynamic-cache run is its reference's, like the others'
        _check(model, inputs, **wrap)
    room = inputs["input_ids"].shape[1] + STATIC_STEPS
    cache = StaticCache(config=model.config.get_text_config(), max_cache_len=room)
    trace, widths = _static_equals_dynamic(model, inputs, backend, cache, **wrap)
    assert [s.layer for s in trace.stages] == [0, 2, 4]
    dropped = sum(int(s.keep.logical_not().sum(1).min()) for s in trace.stages)
    # the mask layer (1) keeps the cache's width, layer 4 holds its kept prompt and the steps,
    # the linear layers hold no buffer
    assert widths == [None, room, None, None, room - dropped, None]


def test_remove_gives_the_static_buffers_their_width_back():
    model = tiny_model("qwen3_5", text={"layer_types": TWO_FULL, "num_hidden_layers": 6})
    inputs = _inputs(model, "image")
    room = inputs["input_ids"].shape[1] + STATIC_STEPS
    cache = StaticCache(config=model.config.get_text_config(), max_cache_len=room)
    handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=2)
    with torch.no_grad():
        greedy_generate(model, inputs, STATIC_STEPS, cache=cache)
    assert cache.layers[4].max_cache_len < room
    handle.remove()  # the cache is whole again, for the unwrapped model
    buffers = [layer.max_cache_len for layer in cache.layers if hasattr(layer, "max_cache_len")]
    assert buffers == [room, room]
    cache.reset()
    with torch.no_grad():
        ref_sequences, ref_logits = greedy_generate(model, inputs, STATIC_STEPS)
        sequences, logits = greedy_generate(model, inputs, STATIC_STEPS, cache=cache)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer", [0, FULL])
def test_a_manual_decode_loop_on_a_static_cache_equals_the_dynamic_one(layer):
    # the model builds its own masks from the 2-D mask (no generate())
    model = _model()
    inputs = _inputs(model, "image")
    width = inputs["input_ids"].shape[1] + TOKENS.shape[1]
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer):
        logits, steps = _decode(model, inputs, TOKENS)
        cache = StaticCache(config=model.config.get_text_config(), max_cache_len=width)
        static_logits, static_steps = _decode(model, inputs, TOKENS, cache)
    torch.testing.assert_close(static_logits, logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(static_steps, steps, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer", [0, FULL])
def test_no_host_reads_per_static_decode_step(layer):
    model = _model()
    inputs = on_device(_inputs(model, "image"))
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer):
        with per_forward(model) as marks:
            model.generate(
                **inputs, max_new_tokens=4, do_sample=False, cache_implementation="static"
            )
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"
