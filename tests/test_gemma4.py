"""Gemma 4 (``gemma4``): a grid of its own per image (the real processor, images of different
sizes), image blocks both ways on the sliding-window layers only, per-head q/k norms, K=V full
layers with their own head size and partial RoPE, against the masked reference.

The tiny model alternates sliding-window (window 8) and full layers, and every prompt is far
longer than the window, so decode steps read sliding caches that dropped keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import assert_pruned_equals_masked
from tiny_processors import gemma4_processor, ramp_image

import vlm_focus as vf
from vlm_focus.core.attention import allowed_keys, image_blocks
from vlm_focus.core.probe import AttentionProbe
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import IMAGE, VIDEO, tiny_model

# (width, height) of each row's images: grids of 10 x 6, 4 x 14 and 8 x 8 pooled tokens
SIZES = [[(24, 40), (60, 20)], [(36, 36)]]
PROMPTS = ["describe the image", "what is in this"]


def gemma4_model(attn: str = "sdpa", **text) -> torch.nn.Module:
    return tiny_model("gemma4", attn=attn, text=text or None)


def gemma4_inputs(model, batch: int = 2) -> dict:
    """A left-padded batch from the real processor: row 0 has two images of different shapes
    with text between them, row 1 one square image and a shorter prompt."""
    processor = gemma4_processor(model)
    texts, images = [], []
    for sizes, prompt in zip(SIZES[:batch], PROMPTS[:batch], strict=True):
        content = []
        for _ in sizes:
            content += [{"type": "image"}, {"type": "text", "text": prompt}]
        message = [{"role": "user", "content": content}]
        texts.append(processor.apply_chat_template(message, add_generation_prompt=True))
        images.append([ramp_image(w, h) for w, h in sizes])
    return dict(processor(text=texts, images=images, return_tensors="pt", padding=True))


@pytest.fixture(scope="module")
def sdpa():
    model = gemma4_model()
    return model, gemma4_inputs(model)


def test_layout_one_grid_per_image_from_the_patch_positions(sdpa):
    model, inputs = sdpa
    assert bool((inputs["attention_mask"][1] == 0).any())  # row 1 is left-padded
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert [[i.grids for i in row] for row in layout] == [[[(10, 6)], [(4, 14)]], [[(8, 8)]]]
    for b, images in enumerate(layout):
        visual = torch.nonzero(inputs["input_ids"][b] == IMAGE).flatten()
        assert torch.equal(torch.cat([i.positions for i in images]), visual)
    assert torch.equal(layout[0][0].cells[7], torch.tensor([0, 1, 1]))  # row-major, 6 wide


@pytest.mark.parametrize(
    "attn,layer,pruner",
    [
        ("sdpa", 0, "fastv"),
        ("sdpa", 2, "fastv"),
        ("sdpa", 1, "debiased"),
        ("eager", 0, "random"),
        ("eager", 1, "fastv"),
        ("eager", 2, "pyramid"),
    ],
)
def test_pruned_equals_masked_reference(attn, layer, pruner):
    """Prefill logits, 6 cached greedy steps and their logits equal the unpruned model with
    the pruned keys masked from layer K on; K = 0 and K >= 1, a sliding layer (0, 2) and a
    full one (1); pyramid prunes twice (K and K + 1, a full layer)."""
    model = gemma4_model(attn)
    wrap = dict(pruner=pruner, keep=0.5, layer=layer)
    if pruner == "pyramid":
        wrap.update(layer=(layer, layer + 1), keep=(0.5, 0.25))
    trace = assert_pruned_equals_masked(model, gemma4_inputs(model), steps=6, **wrap)
    assert len(trace.stages) == (2 if pruner == "pyramid" else 1)


def test_stage_scores_equal_the_models_own_attention():
    """fastv's scores are the instruction rows' head-mean attention the model computes itself
    (eager, its own masks): at a sliding layer (here with a window of 64, so part of the
    first image is out of reach) and at a full layer with its own head size and partial RoPE."""
    model = gemma4_model("eager", sliding_window=64)
    inputs = gemma4_inputs(model)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    visual = inputs["input_ids"] == IMAGE
    for layer in (0, 1):
        wrap = dict(pruner="fastv", keep=0.5, layer=layer, reduce="mean", query_rows="text")
        with torch.no_grad(), vf.wrap(model, **wrap) as handle:
            model(**inputs)
            stage = handle.last_trace.stages[0]
        for b in range(2):
            text = torch.nonzero(visual[b]).max() < torch.arange(visual.shape[1])
            text &= inputs["attention_mask"][b].bool()
            expected = attentions[layer][b].mean(0)[text].mean(0)[visual[b]]
            torch.testing.assert_close(stage.scores[b], expected, atol=1e-6, rtol=0)


def test_probe_rows_of_image_tokens_follow_each_layers_mask():
    """Attention rows the probes compute for image-token queries equal the model's own (eager)
    rows at every layer: an image token sees later tokens of its block on the sliding layers,
    and only earlier ones on the full layers."""
    model = gemma4_model("eager", sliding_window=64)
    inputs = gemma4_inputs(model)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    rows = inputs["input_ids"] == IMAGE
    with torch.no_grad(), AttentionProbe(model, layers=None, rows=rows) as probe:
        model(**inputs)
    assert [r.layer for r in probe.records] == [0, 1, 2, 3]
    for record in probe.records:
        for b in range(2):
            positions = record.positions[b][record.mask[b]]
            expected = attentions[record.layer][b][:, positions]  # [H, Tq, S]
            torch.testing.assert_close(
                record.probs[b][:, record.mask[b]], expected, atol=1e-6, rtol=0
            )
    first = torch.nonzero(rows[0]).min()
    assert (attentions[0][0][:, first, first + 1 : first + 8] > 0).all()  # sliding: both ways
    assert (attentions[1][0][:, first, first + 1 :] == 0).all()  # full: causal


def test_window_image_blocks_rule_by_hand():
    """Image blocks see each other both ways on a sliding-window layer only."""
    visual = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    blocks = image_blocks(visual)
    valid = torch.ones(1, 6, dtype=torch.bool)
    query = torch.tensor([[2]])
    both = (blocks.gather(1, query), blocks)
    full = allowed_keys(valid, query, rule="window_image_blocks", blocks=both)
    sliding = allowed_keys(valid, query, rule="window_image_blocks", window=8, blocks=both)
    assert full[0].long().tolist() == [[1, 1, 1, 0, 0, 0]]  # causal
    assert sliding[0].long().tolist() == [[1, 1, 1, 1, 1, 0]]  # its whole block


def test_remove_restores_logits_exactly(sdpa):
    model, inputs = sdpa
    with torch.no_grad():
        before = model(**inputs).logits
        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=1)
        pruned = model(**inputs).logits
        handle.remove()
        after = model(**inputs).logits
    assert pruned.shape[1] < before.shape[1]
    assert torch.equal(before, after)


# E2B / E4B in small: per-layer embeddings, and the last two of six layers reuse the keys and
# values of layer 2 (the last sliding one before them) and layer 3 (the last full one)
SHARED = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "full_attention"] * 3,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
)


@pytest.mark.parametrize(
    "attn,layer",
    [("sdpa", 0), ("eager", 1), ("sdpa", 2), ("sdpa", (1, 2))],
)
def test_kv_shared_layers_and_per_layer_inputs_equal_masked_reference(attn, layer):
    """The shared layers read only the kept keys their source layer holds, and each layer's
    per-layer input follows the kept rows: prefill logits (the forward runs every row through
    the shared layers), and generate()'s prefill (the decoder keeps only the last row there)
    with 6 cached greedy steps, equal the masked reference; a stage at the sliding source
    itself (2), and two stages (1, 2)."""
    model = gemma4_model(attn, **SHARED)
    assert get_adapter(model).source_layers(model) == [2, 3]
    wrap = dict(pruner="fastv", keep=0.5, layer=layer)
    if isinstance(layer, tuple):
        wrap.update(keep=(0.5, 0.25))
    trace = assert_pruned_equals_masked(model, gemma4_inputs(model), steps=6, **wrap)
    assert len(trace.stages) == (2 if isinstance(layer, tuple) else 1)


def test_a_stage_after_the_first_kv_source_layer_is_refused():
    model = gemma4_model(**SHARED)
    with pytest.raises(ValueError, match=r"layer=3: .* layers \[2, 3\] .* at or before layer 2"):
        vf.wrap(model, pruner="fastv", keep=0.5, layer=3)


def test_image_blocks_that_are_not_bidirectional_are_refused():
    model = gemma4_model(use_bidirectional_attention=None)
    with pytest.raises(ValueError, match="use_bidirectional_attention=None"):
        vf.wrap(model, pruner="fastv", keep=0.5, layer=1)


def test_static_cache_is_refused(sdpa):
    model, inputs = sdpa
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=1):
        with pytest.raises(ValueError, match="static cache"):
            model.generate(**inputs, max_new_tokens=2, cache_implementation="static")
        # and the unpruned model is untouched by the refusal: a dynamic cache still works
        out = model(**inputs)  # the refusal left the handle working: a dynamic cache prunes
    assert out.logits.shape[1] < inputs["input_ids"].shape[1]


def test_a_prompt_with_a_video_prunes_its_image_and_keeps_the_video():
    """An image and a 4-frame video through the real processor: the video's tokens stay (with a
    warning), the image is pruned, and the run equals the masked reference, whose mask is the
    model's own (each frame a bidirectional block on the sliding layers)."""
    model = gemma4_model()
    processor = gemma4_processor(model)
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]
    message = [{"role": "user", "content": content + [{"type": "text", "text": "describe"}]}]
    text = processor.apply_chat_template(message, add_generation_prompt=True)
    frames = np.stack([np.asarray(ramp_image(40, 24))] * 4)
    inputs = dict(
        processor(
            text=[text],
            images=[[ramp_image(36, 36)]],
            videos=[frames],
            num_frames=4,
            return_tensors="pt",
        )
    )
    # the processor adds its video token to the word tokenizer; the tiny config has its own id
    inputs["input_ids"][inputs["input_ids"] == processor.video_token_id] = VIDEO
    assert int((inputs["input_ids"] == VIDEO).sum()) > 0
    with pytest.warns(UserWarning, match="video tokens are all kept"):
        trace = assert_pruned_equals_masked(
            model, inputs, steps=3, pruner="fastv", keep=0.5, layer=1
        )
    assert trace.n_visual == [int((inputs["input_ids"] == IMAGE).sum())]
    assert trace.n_kept[0] < trace.n_visual[0]
