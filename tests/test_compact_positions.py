"""``positions="compact"``: with one stage at layer 0 the pruned run IS the unpruned model run
on the pruned prompt, the visual tokens it dropped never in it (as vLLM serves a LLaVA whose
image placeholders are already pruned). The reference is a plain, unwrapped model fed the
merged embeddings without the pruned rows and a mask of the shorter length: prefill logits and
cached greedy decoding (ids and every step's logits), SDPA and eager, a left-padded batch of 2
whose rows differ in length, dynamic and static caches, compiled decode steps."""

from __future__ import annotations

import host_reads
import pytest
import torch
from host_reads import on_device, per_forward
from reference import greedy_generate
from test_static_cache import compiled
from tiny_models import make_case, make_model
from torch._dynamo.utils import counters

import vlm_focus as vf

ATOL = 2e-5  # fp32: only summation order may differ between the two runs
STEPS = 6
COMPACT = dict(pruner="fastv", keep=0.5, layer=0, positions="compact")


def _merged_embeddings(model, inputs) -> torch.Tensor:
    """``[B, S, D]``: what the unwrapped model's decoder gets (text and image features merged)."""
    seen = {}

    def record(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        model(**inputs)
    finally:
        handle.remove()
    return seen["embeds"]


def _pruned_prompt(model, inputs, kept: torch.Tensor) -> dict:
    """The prompt without its pruned visual tokens: ``kept`` ``[B, S']`` are the original
    positions the wrapped run kept (its trace's ``sequence``)."""
    embeds = _merged_embeddings(model, inputs)
    rows = kept[..., None].expand(-1, -1, embeds.shape[-1])
    return dict(
        inputs_embeds=embeds.gather(1, rows),
        attention_mask=inputs["attention_mask"].gather(1, kept),
    )


def _check(kind, attn, **generate_kwargs):
    model = make_model(kind, attn=attn)
    inputs = make_case(kind, "image", model, batch=2)
    prompt = inputs["input_ids"].shape[1]
    with torch.no_grad(), vf.wrap(model, **COMPACT) as handle:
        logits = model(**inputs).logits
        kept = handle.last_trace.sequence
        sequences, step_logits = greedy_generate(model, inputs, STEPS, **generate_kwargs)
        assert torch.equal(handle.last_trace.sequence, kept)  # generate() kept the same set
    with torch.no_grad():
        pruned = _pruned_prompt(model, inputs, kept)
        ref_logits = model(**pruned).logits
        ref_sequences, ref_step_logits = greedy_generate(model, pruned, STEPS)
    assert kept.shape[1] < prompt and logits.shape[1] == kept.shape[1]
    valid = pruned["attention_mask"].bool()  # padding rows attend to nothing: not compared
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=ATOL, rtol=0)
    assert torch.equal(sequences[:, prompt:], ref_sequences[:, -STEPS:])
    torch.testing.assert_close(step_logits, ref_step_logits, atol=ATOL, rtol=0)
    return model, inputs, pruned


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava", "llava_next", "llava_onevision"])
def test_compact_equals_the_unwrapped_model_on_the_pruned_prompt(kind, attn):
    _check(kind, attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compact_on_a_static_cache(attn):
    _check("llava", attn, cache_implementation="static")


def test_compact_with_compiled_decode_steps():
    _check("llava_next", "sdpa", cache_implementation="static", **compiled("eager"))
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("positions", [True, False])
def test_a_manual_decode_loop(positions):
    """Steps that pass the unpruned prompt's positions (counted over its mask) are shifted;
    steps without any count on from layer 0's cache, which holds the pruned prompt."""
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)

    def loop(model, inputs):
        out = model(**inputs, use_cache=True)
        cache, mask = out.past_key_values, inputs["attention_mask"]
        token = out.logits[:, -1:].argmax(-1)
        tokens, logits = [token], []
        for _ in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            step = {"position_ids": mask.cumsum(-1)[:, -1:] - 1} if positions else {}
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True, **step)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            logits.append(out.logits[:, -1])
        return torch.cat(tokens, 1), torch.stack(logits, 1)

    with torch.no_grad(), vf.wrap(model, **COMPACT) as handle:
        tokens, logits = loop(model, inputs)
        pruned = _pruned_prompt(model, inputs, handle.last_trace.sequence)
    with torch.no_grad():
        ref_tokens, ref_logits = loop(model, pruned)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_compact_keeps_the_tokens_original_keeps():
    """Only RoPE positions change: the scores, the tokens every layer holds and the trace's
    ORIGINAL positions are those of positions="original". (In a batch of uneven rows, original
    positions also mask the rest of a larger row's share among those tokens; compact, which
    numbers every slot, keeps them.)"""
    model = make_model("llava_next")
    inputs = make_case("llava_next", "image", model, batch=2)
    traces = {}
    for positions in ("original", "compact"):
        with torch.no_grad(), vf.wrap(model, **{**COMPACT, "positions": positions}) as handle:
            model(**inputs)
            traces[positions] = handle.last_trace
    original, compact = traces["original"], traces["compact"]
    assert torch.equal(original.sequence, compact.sequence)
    for a, b in zip(original.kept, compact.kept, strict=True):
        assert set(a.tolist()) <= set(b.tolist())
    assert all(torch.equal(a, b) for a, b in zip(original.scores, compact.scores, strict=True))
    n_visual = [int(v.numel()) for v in original.visual_positions]
    assert compact.n_visual == n_visual and min(compact.n_kept) == min(original.n_kept)


def test_remove_restores_the_model_exactly():
    model = make_model("llava_onevision")
    inputs = make_case("llava_onevision", "image", model, batch=2)
    with torch.no_grad():
        before = model(**inputs).logits, greedy_generate(model, inputs, STEPS)
        handle = vf.wrap(model, **COMPACT)
        model(**inputs), greedy_generate(model, inputs, STEPS)
        handle.remove()
        after = model(**inputs).logits, greedy_generate(model, inputs, STEPS)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))


def test_no_host_read_per_decode_step():
    model = make_model("llava")
    inputs = on_device(make_case("llava", "image", model, batch=2))
    with torch.no_grad(), vf.wrap(model, **COMPACT):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"


@pytest.mark.parametrize(
    "kind,options,message",
    [
        ("llava", dict(layer=2), r"one pruning stage at layer=0 .*got layer=2"),
        (
            "llava",
            dict(layer=(0, 1), keep=(0.5, 0.25)),
            r"one pruning stage at layer=0 .*got layer=\(0, 1\)",
        ),
        (
            "qwen2_vl",
            {},
            r"1-D RoPE positions \(internvl, llava, llava_next, llava_onevision\); 'qwen2_vl'",
        ),
        ("qwen3_vl", {}, r"'qwen3_vl' positions visual tokens by their grid cells \(M-RoPE\)"),
    ],
)
def test_unsupported_settings_are_refused_at_wrap(kind, options, message):
    model = make_model(kind)
    with pytest.raises(ValueError, match=message):
        vf.wrap(model, **{**COMPACT, **options})
    assert getattr(model, "_vlm_focus_handle", None) is None  # nothing stays attached
    vf.wrap(model, **{**COMPACT, **options, "positions": "original"}).remove()


def test_an_unknown_positions_value_names_the_choices():
    with pytest.raises(
        ValueError, match=r"positions='nope' is not one of \('original', 'compact'\)"
    ):
        vf.FocusConfig(positions="nope")
