"""Reading and steering attention on a pruned model.

The independent reference is the one the pruning tests use (reference.py): the unpruned model
with the pruned visual keys masked out at every layer >= the stage that pruned them. Probes read
the attention a layer really computes (its own mask included), so with the same kept set the
pruned model's probes, VAS, attention reweighting and instruction contrast must equal the same
methods run on the reference, in prefill and cached ``generate()``, batch 2 with left padding.
"""

from __future__ import annotations

import pytest
import torch
from reference import _masking, masked_reference
from test_hallucination import _generate
from tiny_models import make_inputs, make_model

import vlm_focus as vf
from vlm_focus import hallucination as H
from vlm_focus.core.probe import AttentionProbe

ATOL = 2e-5


def _pruned_trace(model, inputs, layer):
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        model(**inputs)
        return handle.last_trace


def _wrap(model, layer):
    return vf.wrap(model, pruner="fastv", keep=0.5, layer=layer)


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_probes_on_a_pruned_model_equal_the_masked_reference(kind, attn, layer):
    model = make_model(kind, attn)
    inputs = make_inputs(kind, model, batch=2)
    layers = model.model.language_model.layers
    trace = _pruned_trace(model, inputs, layer)

    def records(context):
        with torch.no_grad(), context:
            with AttentionProbe(model, rows="text", decode=True) as probe:
                model.generate(**inputs, max_new_tokens=3, do_sample=False)
        return probe.records

    pruned = records(_wrap(model, layer))
    reference = records(masked_reference(model, layers, trace))
    assert len(pruned) == len(reference) == 3 * len(layers)
    for a, b in zip(pruned, reference, strict=True):
        assert (a.layer, a.step) == (b.layer, b.step)
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.probs, b.probs, atol=ATOL, rtol=0)
    # a pruned layer pays nothing to the keys it no longer holds
    dropped = [
        sorted(set(v.tolist()) - set(k.tolist()))
        for v, k in zip(trace.visual_positions, trace.kept, strict=True)
    ]
    late = next(r for r in pruned if r.layer == len(layers) - 1 and r.step == 0)
    for b, gone in enumerate(dropped):
        assert gone and float(late.probs[b][..., gone].abs().max()) == 0.0


def test_vas_on_a_pruned_model_equals_the_masked_reference():
    model = make_model("llava_next")
    inputs = make_inputs("llava_next", model, batch=2)
    layers = model.model.language_model.layers
    trace = _pruned_trace(model, inputs, 2)
    with _wrap(model, 2):
        pruned = H.vas(model, inputs, query_rows="text")
    with masked_reference(model, layers, trace):
        reference = H.vas(model, inputs, query_rows="text")
    unpruned = H.vas(model, inputs, query_rows="text")
    torch.testing.assert_close(pruned.per_head, reference.per_head, atol=ATOL, rtol=0)
    assert not torch.allclose(pruned.per_layer[:, 2:], unpruned.per_layer[:, 2:], atol=1e-4)
    torch.testing.assert_close(
        pruned.per_layer[:, :2], unpruned.per_layer[:, :2], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_attention_reweight_on_a_pruned_model_equals_the_masked_reference(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    layers = model.model.language_model.layers
    # the reweighting changes the layers before the stage, so it picks its own kept set
    with _wrap(model, 2) as handle, H.attention_reweight(model, strength=2.0, ratio=0.3):
        seq, scores = _generate(model, inputs)
        trace = handle.last_trace
    with (
        masked_reference(model, layers, trace),
        H.attention_reweight(model, strength=2.0, ratio=0.3),
    ):
        ref_seq, ref_scores = _generate(model, inputs)
    with _wrap(model, 2):
        plain_seq, plain_scores = _generate(model, inputs)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
    assert float((scores - plain_scores).abs().max()) > 1e-3  # the reweighting acted


def _dropped_sets(trace):
    """Per stage layer, per row, the original positions of the visual tokens it lacks."""
    return [
        (
            stage.layer,
            [
                set(v.tolist()) - set(k.tolist())
                for v, k in zip(trace.visual_positions, stage.kept, strict=True)
            ],
        )
        for stage in trace.stages
    ]


def test_instruction_contrast_on_a_pruned_model_equals_the_masked_reference():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    generic = make_inputs("llava", model, batch=2, prompt_len=3, seed=5)
    generic["pixel_values"] = inputs["pixel_values"]
    layers = model.model.language_model.layers
    # each prompt is pruned on its own: the reference masks the user prompt's dropped keys in
    # its passes (prefill, decode, the contrast's side passes) and the generic prompt's in its
    by_width = {
        inputs["input_ids"].shape[1]: _dropped_sets(_pruned_trace(model, inputs, 2)),
        generic["input_ids"].shape[1]: _dropped_sets(_pruned_trace(model, generic, 2)),
    }
    assert len(by_width) == 2

    def dropped(index, call):
        width = call["mask2d"].shape[1]
        stages = by_width[width if width in by_width else inputs["input_ids"].shape[1]]
        return next((sets for layer, sets in reversed(stages) if index >= layer), None)

    def run(context):
        with context:
            with H.instruction_contrast(model, inputs, generic, alpha=1.0, beta=0.0) as proc:
                out = _generate(model, inputs, logits_processor=[proc])
        return out, proc.irrelevant

    (seq, scores), irrelevant = run(_wrap(model, 2))
    (ref_seq, ref_scores), ref_irrelevant = run(_masking(model, layers, dropped))
    assert torch.equal(irrelevant, ref_irrelevant)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
    with _wrap(model, 2):
        plain_seq, plain_scores = _generate(model, inputs)
    assert float((scores - plain_scores).abs().max()) > 1e-3  # the contrast acted


def test_probes_refuse_fixation_decode_steps_and_pruned_query_rows():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=1)
    with vf.wrap(model, pruner="fixation", keep=0.25, layer=1):
        with pytest.raises(ValueError, match="fixation"):
            with AttentionProbe(model, layers=[2], rows="last", decode=True):
                model.generate(**inputs, max_new_tokens=2, do_sample=False)
    visual = torch.nonzero(inputs["input_ids"][0] == model.config.image_token_id).flatten()
    with vf.wrap(model, pruner="fastv", keep=0.1, layer=1):
        with pytest.raises(ValueError, match="pruning removed"):
            with AttentionProbe(model, layers=[3], rows=visual[None]):
                model(**inputs)


def test_visual_beam_on_a_pruned_model_equals_the_masked_reference():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    layers = model.model.language_model.layers

    def run(context):
        with context as handle, H.visual_beam(model, weight=2.0) as proc:
            out = _generate(model, inputs, num_beams=3, logits_processor=[proc])
        return out, proc.history, getattr(handle, "last_trace", None)

    (seq, scores), history, trace = run(_wrap(model, 2))
    assert len(trace.kept) == 6  # the beam copies of each prompt
    (ref_seq, ref_scores), ref_history, _ = run(masked_reference(model, layers, trace))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
    for a, b in zip(history, ref_history, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_grounding_on_a_pruned_model_equals_the_masked_reference():
    from vlm_focus import grounding as G

    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    layers = model.model.language_model.layers
    with torch.no_grad(), _wrap(model, 2) as handle:
        answer = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        answer = answer[:, inputs["input_ids"].shape[1] :]
        pruned = G.GroundingPass(model, inputs, answer=answer)
        trace = handle.last_trace  # the pass scores with the prompt rows, as generate() did
    with torch.no_grad(), masked_reference(model, layers, trace):
        reference = G.GroundingPass(model, inputs, answer=answer)
    for b in range(2):
        torch.testing.assert_close(
            pruned.map(row=b).grid, reference.map(row=b).grid, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize(
    "kind, pruner, layer, keep",
    [
        ("llava", "fastv", 2, 0.25),
        ("qwen2_vl", "text", 2, 0.25),
        ("llava", "pyramid", (1, 2), (0.5, 0.25)),
    ],
)
def test_grounding_a_generated_answer_keeps_the_generations_visual_tokens(
    kind, pruner, layer, keep
):
    """Over prompt + answer, the pruner scores with the prompt's rows (as the prefill did), so
    the map is read from the tokens the answer was generated from."""
    from vlm_focus import grounding as G

    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    with torch.no_grad(), vf.wrap(model, pruner=pruner, layer=layer, keep=keep) as handle:
        answer = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        generated = handle.last_trace
        G.GroundingPass(model, inputs, answer=answer[:, inputs["input_ids"].shape[1] :])
        grounded = handle.last_trace
    assert len(grounded.stages) == len(generated.stages) >= 1
    for ours, theirs in zip(grounded.stages, generated.stages, strict=True):
        for a, b in zip(ours.kept, theirs.kept, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(ours.scores, theirs.scores, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_guide_built_from_the_inputs_reads_the_prompt_in_a_grounding_pass():
    from vlm_focus import grounding as G

    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    seen = []

    def guide_inputs(large):  # the guide shares the large model's config, so its inputs fit
        seen.append(large["input_ids"].shape[1])
        ids, mask = large["input_ids"], large["attention_mask"]
        return dict(input_ids=ids, attention_mask=mask, pixel_values=inputs["pixel_values"])

    options = dict(guide=make_model("llava", seed=3), guide_inputs=guide_inputs)
    with torch.no_grad(), vf.wrap(model, pruner="guided", keep=0.25, layer=2, **options) as handle:
        answer = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        generated = handle.last_trace
        G.GroundingPass(model, inputs, answer=answer[:, inputs["input_ids"].shape[1] :])
        grounded = handle.last_trace
    assert seen == [inputs["input_ids"].shape[1]] * 2
    for a, b in zip(grounded.kept, generated.kept, strict=True):
        assert torch.equal(a, b)
