"""attention_reweight's placements: relevant (unchanged), pai and vaf, each against a hand
computation of the biased attention at one layer; head selection; batches, pruning, SDPA and
eager, generate() and an exact restore."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_inputs, make_model

from vlm_focus import hallucination as H
from vlm_focus.core.attention import instruction_relevance
from vlm_focus.core.probe import AttentionBias, rows_from_mask
from vlm_focus.hallucination._reweight import relevant_tokens
from vlm_focus.model_adapters import get_adapter


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs, steps=3):
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
    scores = torch.stack(out.scores, 1)
    return out.sequences, scores.masked_fill(torch.isinf(scores), 0.0)


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
