"""Qwen3.5 (``qwen3_5``): grounding, probes and mitigation on a hybrid decoder (tiny layer
types: linear, linear, full, linear).

Only the full-attention layer has attention rows. The defaults that pick layers (grounding,
probes, VAS, the mitigations that read or bias attention) choose it; an explicitly named linear
layer is refused with the layers to use instead, and so is a contrast that would hide tokens
from a linear layer. The probe's rows at the full layer equal the model's own eager attention:
prefill of a left-padded batch of two images of two sizes, cached decode, and a model pruned at
a linear or the full layer (over the kept keys). A planted peak lands on its cell in the
original pixels of a non-square image through the real processor.
"""

from __future__ import annotations

import pytest
import torch
from tiny_processors import hybrid_processor, noise_image

import vlm_focus as vf
import vlm_focus.core.layer_view as layer_view_module
from vlm_focus import grounding as G
from vlm_focus import hallucination as H
from vlm_focus import zoom
from vlm_focus.core.probe import AttentionProbe, attention_layers
from vlm_focus.geometry import Size
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import tiny_model

FULL = 2  # the tiny decoder's one full-attention layer
LINEAR_ERROR = (
    r"decoder layer\(s\) \[{}\] of this 'qwen3_5' model are linear-attention"
    r".*use its full-attention layers \[2\]"
)
SIZES = [(120, 40), (60, 60)]  # (width, height): a wide image and a square one

_MODELS: dict = {}


def _model(attn: str = "sdpa"):
    if attn not in _MODELS:
        _MODELS[attn] = tiny_model("qwen3_5", attn=attn)
    return _MODELS[attn]


def _inputs(model) -> dict:
    """A left-padded batch of two prompts, one image each, of the two :data:`SIZES`."""
    processor = hybrid_processor(model)
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    return dict(
        processor(
            text=["<|vision_start|><|image_pad|><|vision_end|> describe the image"] * 2,
            images=images,
            padding=True,
            return_tensors="pt",
        )
    )


# --- which layers -------------------------------------------------------------------------
def test_defaults_choose_the_full_attention_layers():
    model = _model()
    assert get_adapter(model).recurrent_layers(model) == {0, 1, 3}
    assert attention_layers(model) == [FULL]
    assert G.default_layers(model) == [FULL]
    assert AttentionProbe(model).layers == [FULL]
    for placement in ("relevant", "pai", "vaf"):
        assert H.attention_reweight(model, placement=placement).layers == [FULL]
    assert H.attention_reweight(model, placement="pai", skip=1).layers == [FULL]
    with pytest.raises(ValueError, match=r"skip=3 leaves none of this model's attention layers"):
        H.attention_reweight(model, placement="pai", skip=3)
    assert H.visual_beam(model).layers == [FULL]
    inputs = _inputs(model)
    assert H.vas(model, inputs).layers == [FULL]
    assert H.instruction_contrast(model, inputs, inputs).layers == [FULL]


@pytest.mark.parametrize("linear", [0, 1, 3, -1])
def test_an_explicit_linear_layer_is_refused_with_the_full_ones(linear):
    model = _model()
    inputs = _inputs(model)
    index = linear % 4
    match = LINEAR_ERROR.format(index)
    calls = [
        lambda: AttentionProbe(model, [FULL, linear]),
        lambda: G.heatmap(model, inputs, layers=[linear]),
        lambda: G.GroundingPass(model, inputs, layers=[linear]),
        lambda: G.select_localization_heads(model, [inputs], layers=[linear]),
        lambda: H.vas(model, inputs, layers=[linear]),
        lambda: H.attention_reweight(model, layers=[linear]),
        lambda: H.visual_beam(model, layers=[linear]),
        lambda: H.instruction_contrast(model, inputs, inputs, layers=[linear]),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    processor = hybrid_processor(model)
    image = noise_image(*SIZES[0], seed=0)
    with pytest.raises(ValueError, match=match):
        vf.ground(model, processor, image, "image", layers=[linear])
    model.config.vlm_focus_grounding = {"layers": [linear]}
    try:
        with pytest.raises(ValueError, match=r"vlm_focus_grounding\['layers'\].*linear-attention"):
            G.default_layers(model)
    finally:
        del model.config.vlm_focus_grounding


# --- the probe reads the model's own attention ---------------------------------------------
def test_probe_rows_at_the_full_layer_equal_eager_attention_prefill_and_decode():
    model = _model("eager")
    inputs = _inputs(model)
    assert inputs["attention_mask"][:, 0].tolist().count(0) == 1  # one row is left-padded
    with torch.no_grad(), AttentionProbe(model, rows="text") as probe:
        out = model(**inputs, output_attentions=True)
    # transformers returns attentions of the full-attention layers only, in order
    assert len(out.attentions) == 1
    (rec,) = probe.records
    assert rec.layer == FULL
    ref = out.attentions[0]  # [B, H, S, S]
    for b in range(2):
        rows = rec.positions[b][rec.mask[b]]
        torch.testing.assert_close(rec.probs[b][:, rec.mask[b]], ref[b][:, rows], atol=1e-5, rtol=0)
    with torch.no_grad(), AttentionProbe(model, rows=None, decode=True) as probe:
        gen = model.generate(
            **inputs,
            max_new_tokens=3,
            do_sample=False,
            output_attentions=True,
            return_dict_in_generate=True,
        )
    assert [r.step for r in probe.records] == [1, 2]
    for rec in probe.records:
        step = gen.attentions[rec.step][0][:, :, -1]  # [B, H, L]
        torch.testing.assert_close(rec.probs[:, :, 0], step, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [1, FULL])  # a linear and the full stage layer
def test_probe_rows_on_a_pruned_model_equal_its_eager_attention_over_the_kept_keys(stage):
    model = _model("eager")
    inputs = _inputs(model)
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=stage) as handle:
        with torch.no_grad(), AttentionProbe(model, rows="text") as probe:
            out = model(**inputs, output_attentions=True)
        kept = handle.last_trace.kept
    (rec,) = probe.records
    ref = out.attentions[0]  # [B, H, S', S']: the full layer holds the kept tokens only
    for b in range(2):
        held = ~visual[b]
        held[kept[b]] = True
        held = torch.nonzero(held).flatten()  # original positions of the layer's tokens
        assert held.numel() == ref.shape[-1]
        local = {int(p): i for i, p in enumerate(held)}
        rows = rec.positions[b][rec.mask[b]]
        want = ref[b][:, [local[int(r)] for r in rows]]  # [H, Tq, S']
        got = rec.probs[b][:, rec.mask[b]]  # [H, Tq, S] in original positions
        torch.testing.assert_close(got[..., held], want, atol=1e-5, rtol=0)
        dropped = torch.ones(got.shape[-1], dtype=torch.bool)
        dropped[held] = False
        assert float(got[..., dropped].abs().max()) == 0.0


def test_vas_equals_the_visual_share_of_eager_attention():
    model = _model("eager")
    inputs = _inputs(model)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    last = out.attentions[0][:, :, -1]  # [B, H, S]: the last prompt token's row
    want = (last * visual[:, None]).sum(-1).mean(-1)  # [B]
    got = H.vas(model, inputs)
    torch.testing.assert_close(got.overall, want, atol=1e-5, rtol=0)


# --- maps, points and boxes in original pixels ---------------------------------------------
def test_planted_peak_lands_in_original_pixels_through_the_real_processor(monkeypatch):
    model = _model()
    inputs = _inputs(model)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    targets, cells, grids = [], [], []
    for b in range(2):
        image = layout[b][0]
        rows, cols = image.grids[0]
        cell = (rows // 2, cols - 1)
        index = int(torch.nonzero((image.cells == torch.tensor([0, *cell])).all(1)).flatten()[0])
        targets.append(int(image.positions[index]))
        cells.append(cell)
        grids.append((rows, cols))

    def planted(q, k, scaling, allowed):  # every row puts all its attention on targets[b]
        probs = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for b in range(q.shape[0]):
            probs[b, :, :, targets[b]] = 1.0
        return probs

    monkeypatch.setattr(layer_view_module, "attention_probs", planted)
    # the processor's own geometry and the images' own sizes
    processor = hybrid_processor(model)
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    assert G.GroundingPass(model, inputs, processor=processor, images=images).layers == [FULL]
    maps = G.heatmap(model, inputs, processor=processor, images=images)
    for b, (width, height) in enumerate(SIZES):
        heat = maps[b][0]
        rows, cols = grids[b]
        assert tuple(heat.grid.shape) == (rows, cols)
        assert heat.pixels.shape == (height, width)
        assert heat.size == Size(width, height)
        assert divmod(int(heat.grid.argmax()), cols) == cells[b]
        # the processor resizes the whole image (no crop, no pad): cell (r, c) covers
        # [c W / cols, (c + 1) W / cols] x [r H / rows, (r + 1) H / rows] of the original
        r, c = cells[b]
        x0, x1 = c * width / cols, (c + 1) * width / cols
        y0, y1 = r * height / rows, (r + 1) * height / rows
        px, py = G.point(heat, sigma=0)
        assert x0 <= px <= x1 and y0 <= py <= y1
        (box,) = G.boxes(heat, max_boxes=1)  # thresholds the smoothed pixel map
        centre = (box.x0 + box.width / 2, box.y0 + box.height / 2)
        assert x0 <= centre[0] <= x1 and y0 <= centre[1] <= y1, (box, (x0, y0, x1, y1))
        assert 0 <= box.x0 and box.x0 + box.width <= width
        assert 0 <= box.y0 and box.y0 + box.height <= height


def test_zoom_maps_the_full_layer_and_refuses_a_linear_one():
    model = _model()
    processor = hybrid_processor(model)
    image = noise_image(96, 64, seed=2)
    question = "describe the image"
    found = zoom.look_closer(
        model, processor, image, question, max_new_tokens=2, min_size=24, anchor="peak"
    )
    assert found.zoomed and found.map.size == Size(96, 64)
    assert found.map.pixels.shape == (64, 96)
    with pytest.raises(ValueError, match=LINEAR_ERROR.format(0)):
        zoom.look_closer(
            model, processor, image, question, max_new_tokens=2, min_size=24, layers=[0]
        )


# --- mitigation at the full layer -----------------------------------------------------------
def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_attention_reweight_changes_the_instruction_rows_only_and_restores():
    model = _model()
    inputs = _inputs(model)
    valid = inputs["attention_mask"].bool()
    base = _logits(model, inputs)
    with H.attention_reweight(model, strength=3.0) as rw:
        assert rw.layers == [FULL]
        boosted = _logits(model, inputs)
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    for b in range(2):
        last = int(torch.nonzero(visual[b]).max())
        prefix = valid[b].clone()
        prefix[last + 1 :] = False
        # rows up to the image are untouched (causal); the instruction rows change
        torch.testing.assert_close(boosted[b][prefix], base[b][prefix], atol=1e-5, rtol=0)
        assert float((boosted[b, last + 1 :] - base[b, last + 1 :]).abs().max()) > 1e-3
    assert torch.equal(_logits(model, inputs), base)


def test_a_contrast_that_hides_tokens_from_linear_layers_is_refused():
    model = _model()
    inputs = _inputs(model)
    with (
        H.instruction_contrast(model, inputs, inputs) as proc,
        pytest.raises(ValueError, match=r"decoder layers \[0, 1, 3\], which are linear-attention"),
    ):
        model.generate(**inputs, max_new_tokens=2, do_sample=False, logits_processor=[proc])
