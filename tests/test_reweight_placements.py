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
