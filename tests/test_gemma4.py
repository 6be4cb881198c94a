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


def video_inputs(model, batch: int = 2) -> dict:
    """A left-padded batch from the real processor: row 0 an image and a 4-frame video of
    6 x 10 pooled tokens a frame, row 1 a 2-frame video of 8 x 8 and a shorter prompt."""
    processor = gemma4_processor(model)
    image = {"type": "image"}
    rows = [
        ([image, {"type": "text", "text": "and"}, {"type": "video"}], (40, 24), 4),
        ([{"type": "video"}], (36, 36), 2),
    ][:batch]
    texts, images, videos = [], [], []
    for content, (w, h), n in rows:
        message = [{"role": "user", "content": content + [{"type": "text", "text": "what"}]}]
        texts.append(processor.apply_chat_template(message, add_generation_prompt=True))
        images.append([ramp_image(36, 36)] if image in content else [])
        # noise frames: no two tokens alike, so a diversity pruner meets no ties
        rng = np.random.default_rng(n)
        videos.append(rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8))
    inputs = dict(
        processor(
            text=texts,
            images=images,
            videos=videos,
            padding=True,
            return_tensors="pt",
            videos_kwargs={"do_sample_frames": False},
        )
    )
    # the processor adds its video token to the word tokenizer; the tiny config has its own id
    inputs["input_ids"][inputs["input_ids"] == processor.video_token_id] = VIDEO
    # generate() numbers a left-padded row from its first token, a bare forward from the
    # padding; the same numbers in both keep the hidden states bitwise equal, which max-min's
    # near-ties between tokens need for generate() to keep the forward's set
    inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return inputs


def test_layout_one_view_per_video_frame():
    model = gemma4_model()
    inputs = video_inputs(model)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert [[(i.kind, i.grids) for i in row] for row in layout] == [
        [("image", [(8, 8)]), ("video", [(6, 10)] * 4)],
        [("video", [(8, 8)] * 2)],
    ]
    for b, row in enumerate(layout):
        video = torch.nonzero(inputs["input_ids"][b] == VIDEO).flatten()
        assert torch.equal(row[-1].positions, video)
        # each frame a view, row-major: the second frame's eighth token is row 0, column 7
        width = row[-1].grids[0][1]
        frame = row[-1].cells[row[-1].cells[:, 0] == 1]
        assert frame[7].tolist() == [1, 7 // width, 7 % width]


@pytest.mark.parametrize(
    "attn,layer,pruner,video_pruner",
    [
        ("sdpa", 1, "fastv", "auto"),
        ("eager", 0, "fastv", "auto"),  # auto: diverse on the videos
        ("sdpa", 2, "fastv", None),
        ("eager", 1, "random", "diverse"),
    ],
)
def test_videos_pruned_equal_masked_reference(attn, layer, pruner, video_pruner):
    """Videos beside an image, batch 2 with left padding: prefill and 4 cached greedy steps
    equal the masked reference, whose mask is the model's own (each frame a block both ways
    on the sliding layers), at a sliding (0, 2) and a full (1) layer."""
    model = gemma4_model(attn)
    inputs = video_inputs(model)
    assert bool((inputs["attention_mask"][1] == 0).any())
    trace = assert_pruned_equals_masked(
        model,
        inputs,
        steps=4,
        pruner=pruner,
        keep=0.5,
        layer=layer,
        video_pruner=video_pruner,
    )
    visual = (inputs["input_ids"] == IMAGE) | (inputs["input_ids"] == VIDEO)
    assert trace.n_visual == visual.sum(1).tolist()
    assert all(k < n for k, n in zip(trace.n_kept, trace.n_visual, strict=True))
