"""The planted positional bias and sinks (vlm_focus.eval.planted_bias): the key bias arithmetic,
the model's own attention logits shifted by exactly that bias, cached decoding equal to a full
recompute, and the pruners' scores reading the same bias."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_inputs, make_model

import vlm_focus as vf
from vlm_focus.eval.planted_bias import PlantedBias, planted_key_bias
from vlm_focus.model_adapters import get_adapter


def test_key_bias_ramps_over_visual_tokens_and_marks_the_emptiest():
    visual = torch.tensor([[False, True, True, True, True, True, False]])
    embeds = torch.zeros(1, 7, 3)
    embeds[0, 1:6] = torch.tensor(
        [[1.0, 0, 0], [1.0, 0, 0.02], [0, 1.0, 0], [1.0, 0.01, 0], [0, 0, 1.0]]
    )
    bias = planted_key_bias(embeds, visual, positional=4.0, sinks=0.0, n_sinks=2)
    assert bias[0].tolist() == pytest.approx([0, 0, 1, 2, 3, 4, 0])
    bias = planted_key_bias(embeds, visual, positional=0.0, sinks=5.0, n_sinks=2)
    # the row's median visual embedding is (1, 0, 0): tokens 1 and 4 lie closest
    assert bias[0].tolist() == pytest.approx([0, 5, 0, 0, 5, 0, 0])


def _last_row_attention(model, inputs, layer):
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    return out.attentions[layer][:, :, -1].float()  # [B, H, S]


def test_attention_logits_shift_by_the_planted_bias():
    # layer 0, where both runs' hidden states are the same: later layers see changed inputs
    layer = 0
    model = make_model("llava", attn="eager")
    inputs = make_inputs("llava", model, batch=2)
    with PlantedBias(model) as plant:
        reference = _last_row_attention(model, inputs, layer)
    with PlantedBias(model, positional=3.0, sinks=2.0, n_sinks=3) as plant:
        biased = _last_row_attention(model, inputs, layer)
        bias = plant._keys  # the last layer's: the whole prompt, nothing pruned
    valid = inputs["attention_mask"].bool()
    for b in range(2):
        shift = (biased[b].log() - reference[b].log())[:, valid[b]]  # [H, S_valid]
        expected = bias[b, valid[b]]
        assert expected.abs().max() > 2.9
        torch.testing.assert_close(
            shift - shift[:, :1], (expected - expected[0]).expand_as(shift), atol=2e-3, rtol=0
        )


def test_cached_decoding_equals_a_full_recompute_under_the_plant():
    model = make_model("llava", attn="sdpa")
    inputs = make_inputs("llava", model, batch=2)
    with PlantedBias(model, positional=4.0, sinks=3.0), torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
        full = model(
            input_ids=out.sequences,
            attention_mask=mask,
            pixel_values=inputs["pixel_values"],
            use_cache=False,
        ).logits
    cached = torch.stack(out.logits, 1)  # [B, 3, V]
    torch.testing.assert_close(full[:, -4:-1], cached, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer", [0, 2])
def test_the_pruners_scores_read_the_planted_bias(layer):
    model = make_model("llava", attn="sdpa")
    inputs = make_inputs("llava", model, batch=2)
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    with (
        PlantedBias(model, positional=60.0),
        vf.wrap(model, pruner="fastv", keep=4, layer=layer) as handle,
        torch.no_grad(),
    ):
        model(**inputs)
    stage = handle.last_trace.stages[0]
    for b in range(2):
        where = visual[b].nonzero()[:, 0]
        kept = stage.positions[b][stage.keep[b] & stage.visual[b]]
        assert kept.tolist() == where[-4:].tolist()  # the latest visual tokens win


def test_bad_settings_and_models_are_refused():
    model = make_model("llava")
    with pytest.raises(ValueError, match="positional"):
        PlantedBias(model, positional="strong")
    with pytest.raises(ValueError, match="sinks"):
        PlantedBias(model, sinks=float("inf"))
    with pytest.raises(ValueError, match="n_sinks"):
        PlantedBias(model, n_sinks=-1)
    with pytest.raises(ValueError, match="1-D RoPE"):
        PlantedBias(make_model("qwen2_vl"))
