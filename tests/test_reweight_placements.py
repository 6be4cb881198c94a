"""attention_reweight's placements: relevant (unchanged), pai and vaf, each against a hand
computation of the biased attention at one layer; head selection; batches, pruning, SDPA and
eager, generate() and an exact restore."""

from __future__ import annotations

import math

import pytest
import torch
from reference import greedy_scores, masked_reference
from tiny_models import make_inputs, make_model

import vlm_focus as vf
from vlm_focus import hallucination as H
from vlm_focus.core.attention import instruction_relevance
from vlm_focus.core.probe import AttentionBias, rows_from_mask
from vlm_focus.hallucination._reweight import relevant_tokens
from vlm_focus.model_adapters import get_adapter


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs, steps=3, **kwargs):
    return greedy_scores(model, inputs, steps, **kwargs)


# --- relevant: the method as it was before placements, copied here as the reference ----------
class _Before:
    """The bias of attention_reweight before placements existed (its _bias_fn, verbatim)."""

    def __init__(self, model, strength, ratio):
        self.adapter = get_adapter(model)
        self.strength, self.ratio = strength, ratio
        self.relevant, self.text_rows, self._prefill, self._has_visual = {}, None, None, False

    def __call__(self, view):
        prefill, call = view.prefill, view.call
        if prefill is not self._prefill:
            self._prefill = prefill
            self.relevant.clear()
            self.text_rows = prefill.text_after_image()
            self._has_visual = bool(prefill.visual.any())
        if not self._has_visual or self.strength == 0:
            return None
        index = view.index
        if index not in self.relevant:
            if call.past != 0:
                return None
            rows, row_mask = rows_from_mask(self.text_rows)
            probs = view.attention(self.adapter, rows)
            scores = instruction_relevance(probs, row_mask)
            self.relevant[index] = relevant_tokens(scores, prefill.visual, self.ratio)
        relevant = self.relevant[index]
        batch, new = call.input_ids.shape
        total = view.width
        seq = relevant.shape[1]
        device = view.hidden.device
        is_text = torch.ones(batch, new, dtype=torch.bool, device=device)
        n_prompt = min(new, seq - call.past)
        if n_prompt > 0:
            is_text[:, :n_prompt] = self.text_rows[:, call.past : call.past + n_prompt]
        columns = torch.zeros(batch, total, device=device)
        columns[:, :seq] = relevant.float() * self.strength
        return columns[:, None, :] * is_text[:, :, None].float()


@pytest.mark.parametrize(("kind", "attn"), [("llava", "sdpa"), ("qwen2_vl", "eager")])
def test_relevant_is_bit_equal_to_the_method_before_placements(kind, attn):
    model = make_model(kind, attn)
    inputs = make_inputs(kind, model, batch=2)
    layers = [0, 2, 3]
    with AttentionBias(model, layers, _Before(model, 2.5, 0.3)):
        want = _logits(model, inputs), _generate(model, inputs)
    with H.attention_reweight(model, strength=2.5, ratio=0.3, layers=layers):
        got = _logits(model, inputs), _generate(model, inputs)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1][0], want[1][0]) and torch.equal(got[1][1], want[1][1])


# --- the hand computation: record what the eager layers compute ----------------------------
class _Recorder:
    """Wraps Llama's eager attention: per layer and call, q, k (after RoPE, before repeat),
    the mask the layer got and the attention weights it computed."""

    def __init__(self):
        from transformers.models.llama import modeling_llama

        self.module, self.original = modeling_llama, modeling_llama.eager_attention_forward
        self.calls: dict[int, list[dict]] = {}

    def __enter__(self):
        def forward(module, query, key, value, attention_mask, scaling, **kwargs):
            out, weights = self.original(
                module, query, key, value, attention_mask, scaling, **kwargs
            )
            self.calls.setdefault(module.layer_idx, []).append(
                dict(q=query, k=key, scaling=scaling, weights=weights)
            )
            return out, weights

        self.module.eager_attention_forward = forward
        return self

    def __exit__(self, *exc):
        self.module.eager_attention_forward = self.original


def _raw_logits(call):
    """``[B, H, T, L]`` q k^T * scaling, every query head on its kv head's keys."""
    q, k = call["q"].float(), call["k"].float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-1, -2) * call["scaling"]


def _base_mask(valid, rows):
    """``[B, 1, T, L]`` 0 / -inf: causal + padding, for query positions ``rows``."""
    keys = torch.arange(valid.shape[1])
    allowed = valid[:, None, :] & (keys[None, None, :] <= torch.as_tensor(rows)[None, :, None])
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]


def _layout(model, inputs):
    valid = inputs["attention_mask"].bool()
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    index = torch.arange(valid.shape[1]).expand_as(valid)
    last = torch.where(visual, index, -1).amax(1, keepdim=True)
    first = torch.where(visual, index, valid.shape[1]).amin(1, keepdim=True)
    text = valid & (index > last)  # the instruction
    before = valid & (index < first)  # BOS and the text before the image
    return valid, visual, text, before


def _head_choice(probs, text, visual, share):
    """The heads whose instruction rows put the most attention on the image, by hand."""
    mass = torch.stack(
        [(probs[b][:, text[b]][..., visual[b]]).sum(-1).mean(-1) for b in range(len(text))]
    )  # [B, H]
    n = max(1, round(share * probs.shape[1]))
    chosen = torch.zeros_like(mass, dtype=torch.bool)
    for b in range(len(text)):
        chosen[b, mass[b].topk(n).indices] = True
    return chosen


def _expected_bias(placement, z, base, layout, strength, ratio, suppress, share):
    """The bias a placement adds at one layer of the prefill, from the formulas."""
    valid, visual, text, before = layout
    probs = torch.softmax(z + base, -1)  # the layer's attention before the bias
    batch, n_heads, seq, _ = z.shape
    bias = torch.zeros(batch, n_heads, seq, seq)
    rows = text[:, None, :, None]
    if placement == "relevant":
        relevant = torch.zeros_like(visual)
        for b in range(batch):
            score = probs[b][:, text[b]].mean((0, 1))  # [S]
            idx = torch.nonzero(visual[b]).flatten()
            n = max(1, round(ratio * len(idx)))
            relevant[b, idx[score[idx].topk(n).indices]] = True
        bias = (rows & relevant[:, None, None, :]).float() * strength
    elif placement == "vaf":
        bias = rows.float() * (
            visual[:, None, None, :] * torch.log(torch.tensor(1 + strength))
            + before[:, None, None, :] * torch.log(torch.tensor(1 - suppress))
        )
    else:  # pai: the last prompt row only, every image key
        bias[:, :, -1] = strength * z[:, :, -1].abs() * visual[:, None, :]
    if share < 1:
        bias = bias * _head_choice(probs, text, visual, share)[:, :, None, None]
    return bias.expand(batch, n_heads, seq, seq)


CASES = [  # placement, options, the layer checked, the layers it reweights
    ("relevant", dict(strength=1.5, ratio=0.3, layers=[1]), 1, [1]),
    ("relevant", dict(strength=1.5, ratio=0.3, layers=[2], heads=0.5), 2, [2]),
    ("pai", dict(strength=0.5), 2, [2, 3]),
    ("pai", dict(strength=0.5, skip=1, heads=0.5), 1, [1, 2, 3]),
    ("vaf", dict(strength=0.8, suppress=0.4), 1, [1]),
    ("vaf", dict(strength=0.8, suppress=0.4, heads=0.25, layers=[2]), 2, [2]),
]


@pytest.mark.parametrize(("placement", "opts", "layer", "layers"), CASES)
def test_the_biased_attention_equals_the_hand_computation(placement, opts, layer, layers):
    model = make_model("llava", "eager")
    inputs = make_inputs("llava", model, batch=2)
    layout = _layout(model, inputs)
    seq = inputs["input_ids"].shape[1]
    base = _base_mask(layout[0], torch.arange(seq))
    with _Recorder() as plain, torch.no_grad():
        model(**inputs, output_attentions=True)
    with _Recorder() as rec, torch.no_grad():
        with H.attention_reweight(model, placement=placement, **opts) as rw:
            model(**inputs, output_attentions=True)
    assert rw.layers == layers
    for index, calls in rec.calls.items():
        call = calls[0]
        z = _raw_logits(call)
        real = layout[0][:, None, :, None]  # padding rows see no key: left out
        got = call["weights"].float() * real
        if index < layers[0]:  # before the first reweighted layer: as without it
            assert torch.equal(got, plain.calls[index][0]["weights"] * real)
        if index not in layers:  # a layer left alone adds nothing
            want = torch.softmax(z + base, -1).nan_to_num(0.0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            continue
        bias = _expected_bias(
            placement,
            z,
            base,
            layout,
            opts["strength"],
            opts.get("ratio", 0.25),
            opts.get("suppress", 0.0),
            opts.get("heads", 1.0),
        )
        want = torch.softmax(z + base + bias, -1).nan_to_num(0.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if index != layer:
            continue
        # only the intended rows and heads change, and they do
        unbiased = torch.softmax(z + base, -1).nan_to_num(0.0) * real
        moved = (got - unbiased).abs().amax(-1) > 1e-6
        intended = bias.abs().amax(-1) > 0  # [B, H, T]
        assert torch.equal(moved, intended) and bool(intended.any())
        if placement == "pai":
            assert bool(intended[:, :, -1].any()) and not bool(intended[:, :, :-1].any())
        else:  # the instruction rows only (all its heads, or the chosen ones)
            assert bool((intended <= layout[2][:, None, :]).all())
        n_heads = intended.any(-1).sum(1)  # [B]
        want_heads = max(1, round(opts.get("heads", 1.0) * 4))
        assert n_heads.tolist() == [want_heads] * 2


@pytest.mark.parametrize(
    ("placement", "opts"),
    [("pai", dict(strength=4.0, heads=0.5)), ("vaf", dict(strength=0.8, suppress=0.4))],
)
def test_decode_steps_are_biased_as_the_hand_computation(placement, opts):
    model = make_model("llava", "eager")
    inputs = make_inputs("llava", model, batch=2)
    valid, visual, text, before = _layout(model, inputs)
    seq = valid.shape[1]
    with _Recorder() as rec, torch.no_grad():
        with H.attention_reweight(model, placement=placement, layers=[2], **opts):
            model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    prefill, step = rec.calls[2][0], rec.calls[2][2]  # the second decode step
    z = _raw_logits(step)  # [B, H, 1, L]
    width = z.shape[-1]
    keys = torch.cat([valid, torch.ones(2, width - seq, dtype=torch.bool)], 1)
    base = torch.zeros(2, 1, 1, width).masked_fill(~keys[:, None, None], float("-inf"))
    image = torch.cat([visual, torch.zeros(2, width - seq, dtype=torch.bool)], 1)[:, None, None]
    if placement == "pai":
        bias = opts["strength"] * z.abs() * image
    else:
        head = torch.cat([before, torch.zeros(2, width - seq, dtype=torch.bool)], 1)[:, None, None]
        bias = image * math.log1p(opts["strength"]) + head * math.log1p(-opts["suppress"])
    if opts.get("heads", 1.0) < 1:  # the heads chosen at the prefill
        probs = torch.softmax(_raw_logits(prefill) + _base_mask(valid, torch.arange(seq)), -1)
        chosen = _head_choice(probs.nan_to_num(0.0), text, visual, opts["heads"])
        bias = bias * chosen[:, :, None, None]
    want = torch.softmax(z + base + bias, -1)
    torch.testing.assert_close(step["weights"].float(), want, atol=1e-5, rtol=0)
    assert float((want - torch.softmax(z + base, -1)).abs().max()) > 1e-3


def _wrap(model, layer):
    return vf.wrap(model, pruner="fastv", keep=0.5, layer=layer)


def _alone(inputs, b):
    """Row ``b`` of a left-padded LLaVA batch, without its padding."""
    keep = inputs["attention_mask"][b].bool()
    return dict(
        input_ids=inputs["input_ids"][b : b + 1, keep],
        attention_mask=inputs["attention_mask"][b : b + 1, keep],
        pixel_values=inputs["pixel_values"][b : b + 1],
    )


PLACED = [
    ("relevant", dict(strength=2.0, heads=0.5)),
    ("pai", dict(strength=4.0, skip=1)),  # a tiny random model's logits are small
    ("vaf", dict(strength=1.0, suppress=0.5, heads=0.5, layers=[1, 2])),
]


@pytest.mark.parametrize(("placement", "opts"), PLACED)
def test_a_left_padded_batch_equals_its_rows_alone_and_exit_restores(placement, opts):
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    base = _logits(model, inputs), _generate(model, inputs)
    with H.attention_reweight(model, placement=placement, **opts):
        seq, scores = _generate(model, inputs)
        rows = [_generate(model, _alone(inputs, b)) for b in range(2)]
    for b, (row_seq, row_scores) in enumerate(rows):
        n = row_seq.shape[1]
        assert torch.equal(seq[b, -n:], row_seq[0])
        torch.testing.assert_close(scores[b], row_scores[0], atol=1e-4, rtol=0)
    assert float((scores - base[1][1]).abs().max()) > 1e-3  # it acted
    assert torch.equal(_logits(model, inputs), base[0])  # exit restores exactly
    after = _generate(model, inputs)
    assert torch.equal(after[0], base[1][0]) and torch.equal(after[1], base[1][1])
    with H.attention_reweight(model, placement=placement, **{**opts, "strength": 0.0}):
        if placement != "vaf":  # vaf still suppresses the text before the image
            assert torch.equal(_logits(model, inputs), base[0])


@pytest.mark.parametrize(("placement", "opts"), PLACED[1:])
def test_sdpa_equals_eager_on_a_gqa_model(placement, opts):
    out = {}
    for attn in ("sdpa", "eager"):
        model = make_model("qwen2_vl", attn)
        inputs = make_inputs("qwen2_vl", model, batch=2)
        with H.attention_reweight(model, placement=placement, **opts):
            out[attn] = _generate(model, inputs)
        plain = _generate(model, inputs)
    assert torch.equal(out["sdpa"][0], out["eager"][0])
    torch.testing.assert_close(out["sdpa"][1], out["eager"][1], atol=1e-4, rtol=0)
    assert float((out["eager"][1] - plain[1]).abs().max()) > 1e-3


@pytest.mark.parametrize(("placement", "opts"), PLACED[1:])
def test_on_a_pruned_model_it_equals_the_masked_reference(placement, opts):
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    layers = model.model.language_model.layers
    opts = {**opts, "heads": 0.5, "layers": [1, 2, 3]}  # before and after the stage
    with _wrap(model, 2) as handle, H.attention_reweight(model, placement=placement, **opts):
        seq, scores = _generate(model, inputs)
        trace = handle.last_trace
    with (
        masked_reference(model, layers, trace),
        H.attention_reweight(model, placement=placement, **opts),
    ):
        ref_seq, ref_scores = _generate(model, inputs)
    with _wrap(model, 2):
        plain = _generate(model, inputs)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
    assert float((scores - plain[1]).abs().max()) > 1e-3


def test_the_options_are_checked_with_clear_errors():
    model = make_model("llava")
    with pytest.raises(ValueError, match=r"placement='fastv' is not one of \('relevant', 'pai'"):
        H.attention_reweight(model, placement="fastv")
    with pytest.raises(ValueError, match=r"skip must be >= 0, got -1"):
        H.attention_reweight(model, placement="pai", skip=-1)
    with pytest.raises(TypeError, match=r"skip must be an int, got 1.5"):
        H.attention_reweight(model, skip=1.5)
    with pytest.raises(
        ValueError, match=r"skip=4 leaves none of this model's attention layers \[0, 1, 2, 3\]"
    ):
        H.attention_reweight(model, placement="pai", skip=4)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"suppress must lie in \[0, 1\)"):
            H.attention_reweight(model, placement="vaf", suppress=bad)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"heads must lie in \(0, 1\]"):
            H.attention_reweight(model, heads=bad)
    with pytest.raises(ValueError, match=r"strength must be > -1"):
        H.attention_reweight(model, placement="vaf", strength=-1.0)
    # each placement's own layers; layers overrides them
    assert H.attention_reweight(model).layers == [0, 1, 2, 3]
    assert H.attention_reweight(model, placement="pai").layers == [2, 3]
    assert H.attention_reweight(model, placement="vaf").layers == [1]
    assert H.attention_reweight(model, placement="vaf", layers=[3]).layers == [3]
