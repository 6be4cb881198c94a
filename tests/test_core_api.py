"""wrap()'s contract: exact restore, identity at keep=1.0, the scores it prunes by, the trace,
and clear errors on bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from reference import assert_pruned_equals_masked, manual_decode
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus as vf
from vlm_focus.config import FocusConfig
from vlm_focus.core.attention import instruction_relevance, text_after_image
from vlm_focus.core.probe import rows_from_mask
from vlm_focus.model_adapters import get_adapter


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("kind", KINDS)
def test_remove_restores_logits_exactly(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    before = _logits(model, inputs)
    handle = vf.wrap(model, keep=0.25, layer=1)
    assert _logits(model, inputs).shape[1] < before.shape[1]
    handle.remove()
    assert torch.equal(_logits(model, inputs), before)
    fresh = make_model(kind)  # same seed: a never-wrapped twin
    assert torch.equal(_logits(fresh, inputs), before)
    handle.remove()  # idempotent


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_keep_one_is_identical_to_unwrapped(kind, layer):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    before = _logits(model, inputs)
    with vf.wrap(model, keep=1.0, layer=layer) as handle:
        after = _logits(model, inputs)
        assert handle.last_trace.n_kept == handle.last_trace.n_visual
    assert torch.equal(after, before)


@pytest.mark.parametrize("query", ["last", "text"])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_scores_equal_eager_attention_head_mean(kind, layer, query):
    model = make_model(kind, attn="eager")
    inputs = make_inputs(kind, model, batch=2)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions[layer]  # [B, H, S, S]
    mask = inputs["attention_mask"].bool()
    with vf.wrap(model, keep=0.5, layer=layer, query_rows=query, reduce="mean") as handle:
        _logits(model, inputs)
    trace = handle.last_trace
    for b in range(2):
        visual = trace.visual_positions[b]
        if query == "last":
            rows = torch.tensor([mask.shape[1] - 1])
        else:
            after = torch.arange(mask.shape[1]) > visual.max()
            rows = torch.nonzero(after & mask[b]).flatten()
        expected = attentions[b].mean(0)[rows][:, visual].mean(0)
        torch.testing.assert_close(trace.scores[b], expected, atol=1e-6, rtol=1e-5)
        top = visual[expected.topk(trace.n_kept[b]).indices].sort().values
        assert torch.equal(trace.kept[b], top)


def test_trace_records_original_positions_and_counts():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)  # rows hold 12 and 8 visual tokens
    with vf.wrap(model, keep=0.5, layer=2) as handle:
        logits = _logits(model, inputs)
    trace = handle.last_trace
    assert trace.n_visual == [12, 8]
    # Each row keeps its half: both drop 4 from their slots, and row 0 masks 2 more as keys.
    assert trace.n_kept == [6, 4]
    ids = inputs["input_ids"]
    for b in range(2):
        assert bool((ids[b, trace.kept[b]] == 120).all())
        assert torch.equal(trace.kept[b], trace.kept[b].sort().values)
        assert trace.scores[b].shape == (trace.n_visual[b],)
    assert trace.sequence.shape[1] == logits.shape[1] == ids.shape[1] - 4
    assert trace.seconds > 0
    assert [s.layer for s in trace.stages] == [2]


def test_keep_count_and_ratio_rounding():
    model = make_model("llava")  # 16 visual tokens
    inputs = make_inputs("llava", model)
    for keep, expected in [(5, 5), (0.25, 4), (0.11, 2), (2, 2), (16, 16), (1.0, 16)]:
        with vf.wrap(model, keep=keep, layer=1) as handle:
            _logits(model, inputs)
        assert handle.last_trace.n_kept == [expected]


def test_text_only_call_passes_through_unpruned():
    model = make_model("llava")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    before = _logits(model, {"input_ids": ids})
    with vf.wrap(model, keep=0.25, layer=1) as handle:
        after = _logits(model, {"input_ids": ids})
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        assert handle.last_trace is None
    assert torch.equal(after, before)
    assert out.shape == (1, 8)


def test_last_trace_describes_the_latest_call():
    model = make_model("llava")
    inputs = make_inputs("llava", model)
    with vf.wrap(model, keep=0.25, layer=1) as handle:
        _logits(model, inputs)
        assert handle.last_trace.n_kept == [4]
        _logits(model, {"input_ids": torch.tensor([[1, 5, 6, 7, 8]])})
        assert handle.last_trace is None  # not the image call's 4 kept tokens
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert handle.last_trace.n_kept == [4]  # decoding steps keep their prefill's trace


def test_wrapping_twice_raises_until_removed():
    model = make_model("llava")
    handle = vf.wrap(model)
    with pytest.raises(ValueError, match="already wrapped"):
        vf.wrap(model)
    handle.remove()
    vf.wrap(model).remove()


def test_manual_decode_loop_without_generate_matches_generate():
    for layer in (0, 2):
        model = make_model("llava")
        inputs = make_inputs("llava", model, batch=2)
        with torch.no_grad(), vf.wrap(model, keep=0.5, layer=layer):
            expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, -4:]
            assert torch.equal(manual_decode(model, inputs, 4), expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"keep": 0}, "count must be >= 2"),
        ({"keep": 1}, "keep=1 is ambiguous: pass 1.0"),
        ({"keep": -0.5}, r"ratio must lie in \(0, 1\]"),
        ({"keep": 1.5}, r"ratio must lie in \(0, 1\]"),
        ({"keep": True}, "ratio in"),
        ({"layer": -1}, "layer=-1"),
        ({"layer": 4}, r"out of range: this model has layers \[0, 4\)"),
        ({"layer": (2, 1), "keep": (0.5, 0.25)}, "strictly increasing"),
        ({"layer": (1, 2), "keep": 0.5}, "same number of stages"),
        ({"pruner": "nope"}, "unknown pruner 'nope'; registered: .*fastv"),
        ({"pruner": "fastv", "temperature": 2}, "unknown option .*allowed: .*keep"),
        ({"pruner": "random", "seed": "x"}, "seed='x' must be an int"),
        ({"query_rows": "first"}, "query_rows='first' is not one of"),
        ({"reduce": "sum"}, "reduce='sum' is not one of"),
        (
            {"query": "text"},
            r"unknown option for pruner 'fastv': \['query'\]; allowed: .*query_rows",
        ),
    ],
)
def test_bad_options_raise_value_error(options, message):
    model = make_model("llava")
    with pytest.raises(ValueError, match=message):
        vf.wrap(model, **options)
    assert not hasattr(model, "_vlm_focus_handle")


def test_query_rows_is_the_only_name_of_the_query_rows():
    with pytest.raises(TypeError, match="unexpected keyword argument 'query'"):
        FocusConfig(query="text")
    assert not hasattr(FocusConfig(), "query")


def test_instruction_relevance_is_the_head_and_row_mean_of_eager_attention():
    model = make_model("llava_next", attn="eager")
    inputs = make_inputs("llava_next", model, batch=2)  # left-padded: rows of unequal length
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions[1]  # [B, H, S, S]
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    text = text_after_image(visual, inputs["attention_mask"].bool())
    rows, valid = rows_from_mask(text)  # [B, Tq]
    index = rows[:, None, :, None].expand(-1, attentions.shape[1], -1, attentions.shape[-1])
    got = instruction_relevance(attentions.gather(2, index), valid)  # [B, S]
    for b in range(2):
        want = attentions[b][:, text[b]].mean((0, 1))
        torch.testing.assert_close(got[b], want, atol=1e-6, rtol=1e-5)
    no_rows = instruction_relevance(attentions[:, :, :3], torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(no_rows, torch.zeros(2, attentions.shape[-1]))  # no instruction: 0


def test_keep_count_above_visual_count_raises_at_call():
    model = make_model("llava")
    inputs = make_inputs("llava", model)
    with vf.wrap(model, keep=17, layer=1), pytest.raises(ValueError, match="more than the 16"):
        model(**inputs)


def test_unsupported_model_and_wrong_types():
    from transformers import LlamaConfig, LlamaForCausalLM

    text_only = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    with pytest.raises(ValueError, match="unsupported model type 'llama'.*llava, llava_next"):
        vf.wrap(text_only)
    with pytest.raises(TypeError, match="expects a transformers model"):
        vf.wrap("llava-hf/llava-1.5-7b-hf")
    with pytest.raises(TypeError, match="FocusConfig"):
        vf.wrap(make_model("llava"), config={"keep": 0.5})


def test_missing_processor_inputs_are_named():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model)
    inputs.pop("mm_token_type_ids")
    with vf.wrap(model), pytest.raises(ValueError, match="mm_token_type_ids"):
        model(**inputs)
    model = make_model("llava")
    inputs = make_inputs("llava", model)
    with vf.wrap(model), pytest.raises(ValueError, match="one per returned logit"):
        model(**inputs, labels=inputs["input_ids"][:, :-1])  # labels are taken; a wrong length


def test_config_object_and_keyword_options_combine():
    model = make_model("llava")
    config = vf.FocusConfig(pruner="random", keep=4, layer=1, options={"seed": 3})
    with vf.wrap(model, config, layer=2) as handle:
        assert handle.config.layer == 2 and handle.config.options == {"seed": 3}
    assert vf.FocusConfig(keep=8).to_dict()["keep"] == 8
    assert {"fastv", "random", "pool"} <= set(vf.pruners())


def test_register_pruner_checks_names_and_duplicates():
    class Mine(vf.Pruner):
        name = "fastv"

    with pytest.raises(ValueError, match="already registered"):
        vf.register_pruner(Mine)
    Mine.name = "Bad Name"
    with pytest.raises(ValueError, match="lowercase identifier"):
        vf.register_pruner(Mine)
    with pytest.raises(TypeError):
        vf.register_pruner(object)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_decode_without_mask_or_positions_restores_original_positions(kind):
    """With K = 0 every cache is short; positions must still continue from the full prompt."""
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=1)
    inputs.pop("attention_mask")
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=0):
        expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, -4:]
        out = model(**inputs, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        for _ in range(3):
            step = model(input_ids=token, cache=out.cache, use_cache=True)
            token = step.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
    assert torch.equal(torch.cat(tokens, 1), expected)


def test_a_config_passes_live_option_objects_as_they_are():
    """wrap(config=...) must not copy a pruner's options: guided's guide model and its
    guide_inputs callback are live objects (a copy would read a stale harness state)."""
    model, guide = make_model("llava"), make_model("llava", seed=3)
    config = vf.FocusConfig(pruner="guided", keep=0.5, layer=0, options={"guide": guide})
    with vf.wrap(model, config=config) as handle:
        assert handle.config.options["guide"] is guide


def test_a_batch_of_uneven_images_keeps_each_rows_share():
    """Each row keeps its own share (as alone), masking the rest of it as keys in the slots the
    batch keeps; equal to the masked reference in prefill and cached decode."""
    model = make_model("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", model, batch=3)  # 12, 8 and 4 visual tokens
    for attn_model in (model, make_model("qwen2_5_vl", attn="eager")):
        trace = assert_pruned_equals_masked(attn_model, inputs, steps=4, keep=0.25, layer=1)
        assert trace.n_kept == [3, 2, 1]
    for b, kept in enumerate(trace.kept):  # each row keeps what it keeps alone
        alone = inputs
        row = {
            k: v[b : b + 1] for k, v in alone.items() if k not in ("pixel_values", "image_grid_thw")
        }
        sizes = alone["image_grid_thw"].prod(-1).tolist()
        row["image_grid_thw"] = alone["image_grid_thw"][b : b + 1]
        row["pixel_values"] = alone["pixel_values"][sum(sizes[:b]) : sum(sizes[: b + 1])]
        with torch.no_grad(), vf.wrap(model, keep=0.25, layer=1) as handle:
            model(**row)
        assert torch.equal(handle.last_trace.kept[0], kept)  # the row keeps its padding
    unpadded = {**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}
    trace = assert_pruned_equals_masked(model, unpadded, steps=4, keep=0.25, layer=0)
    assert trace.n_kept == [3, 2, 1]  # SDPA without a padding mask: the mask is built
    trace = assert_pruned_equals_masked(model, inputs, steps=4, keep=(0.5, 0.25), layer=(0, 2))
    assert [[k.numel() for k in stage.kept] for stage in trace.stages] == [[6, 4, 2], [3, 2, 1]]


def test_the_common_rule_warns_with_each_rows_kept_count():
    """Where rows cannot keep their own share (a static cache), rows keep one common length;
    a row far above its share is named, once per handle, with both counts."""
    model = make_model("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", model, batch=3)
    static = dict(max_new_tokens=2, cache_implementation="static")
    with torch.no_grad(), vf.wrap(model, keep=0.25, layer=1) as handle:
        with pytest.warns(UserWarning, match=r"keep \[9, 5, 1\].*alone would keep \[3, 2, 1\]"):
            model.generate(**inputs, **static)
        assert handle.last_trace.n_kept == [9, 5, 1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.generate(**inputs, **static)  # once per handle
