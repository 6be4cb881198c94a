"""Each pruner's selection logic on constructed inputs whose right answer is known, plus the
pure math (trend fits, pad-to-square geometry, budget split, grid resampling, max-min)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from pruner_inputs import grid_layout, make_ctx, single_image, top_cells
from tiny_models import make_inputs, make_model

import vlm_focus as vf
from vlm_focus.config import FocusConfig
from vlm_focus.model_adapters import ImageLayout
from vlm_focus.model_adapters.base import grid_cells
from vlm_focus.model_adapters.llava_next import _image_patches, image_cells
from vlm_focus.pruners import get_pruner
from vlm_focus.pruners._common import ImageTokens
from vlm_focus.pruners._math import (
    content_fraction,
    fit_trend,
    maxmin_orders,
    resample_map,
    split_budget,
    tile_index,
)
from vlm_focus.pruners.diverse import diverse_keep
from vlm_focus.pruners.guided import map_to_tokens
from vlm_focus.pruners.pyramid import _EncoderCapture
from vlm_focus.pruners.text import rater_weights, select_raters

SIDE = 12
OBJECT = {r * SIDE + c for r in range(2, 5) for c in range(3, 7)}  # 12 cells, upper rows


def remove_trend(scores: torch.Tensor, x: torch.Tensor, kind: str = "exp") -> torch.Tensor:
    """``s / t(x)`` rescaled so the total mass of ``scores`` is unchanged:
    ``s' = s / t * sum(s) / sum(s / t)`` (what ``debiased`` does to one image)."""
    flat = scores.float() / fit_trend(scores, x, kind).clamp(min=1e-12)
    return flat * (float(scores.float().sum()) / max(float(flat.sum()), 1e-12))


def maxmin_order(features: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`maxmin_orders` of one set of ``[n, D]`` features: ``count`` indices."""
    everything = torch.ones(1, features.shape[0], dtype=torch.bool)
    return maxmin_orders(features[None], everything, count)[0]


def _pruner(name, config=None, **options):
    cls = get_pruner(name)
    return cls(config or FocusConfig(pruner=name), cls.Options(**options))


def _recency_scene(seed=0):
    """log score = 0.04 * index (bottom rows ~300x the top) + log 8 on a planted object."""
    gen = torch.Generator().manual_seed(seed)
    log_scores = 0.04 * torch.arange(SIDE * SIDE, dtype=torch.float32)
    log_scores += 0.1 * torch.randn(SIDE * SIDE, generator=gen)
    log_scores[sorted(OBJECT)] += math.log(8.0)
    return log_scores


# --- debiased: recency ---------------------------------------------------------------------------
def test_fastv_picks_bottom_rows_under_recency():
    hidden = single_image(_recency_scene())
    ctx = make_ctx(hidden, [[grid_layout(2, SIDE, SIDE)]])
    kept = top_cells(_pruner("fastv").select(ctx, 12).scores, ctx, 12)
    assert all(i >= SIDE * (SIDE - 2) for i in kept)  # the two bottom rows
    assert not kept & OBJECT


@pytest.mark.parametrize("trend", ["exp", "monotone"])
@pytest.mark.parametrize("axis", ["sequence", "row"])
def test_debiased_picks_the_planted_object(trend, axis):
    hidden = single_image(_recency_scene())
    ctx = make_ctx(hidden, [[grid_layout(2, SIDE, SIDE)]])
    pruner = _pruner("debiased", trend=trend, axis=axis)
    assert top_cells(pruner.select(ctx, 12).scores, ctx, 12) == OBJECT
    off = _pruner("debiased", trend=trend, axis=axis, positional=False)
    assert not top_cells(off.select(ctx, 12).scores, ctx, 12) & OBJECT  # the switch works


def test_exponential_trend_is_recovered_despite_outliers():
    x = torch.arange(100, dtype=torch.float32)
    scores = torch.exp(0.5 + 0.03 * x)
    scores[[10, 40, 41]] *= 50.0  # positive outliers (object, sinks)
    trend = fit_trend(scores, x, "exp")
    torch.testing.assert_close(trend, torch.exp(0.5 + 0.03 * x), rtol=1e-4, atol=0)
    flat = remove_trend(scores, x, "exp")
    assert set(flat.topk(3).indices.tolist()) == {10, 40, 41}
    torch.testing.assert_close(flat.sum(), scores.sum())  # mass kept


def test_monotone_trend_is_isotonic_on_row_medians():
    rows = torch.arange(6).repeat_interleave(4).float()
    medians = torch.tensor([1.0, 3.0, 2.0, 5.0, 8.0, 8.0])
    scores = medians.repeat_interleave(4)
    trend = fit_trend(scores, rows, "monotone")
    expected = torch.tensor([1.0, math.sqrt(6.0), math.sqrt(6.0), 5.0, 8.0, 8.0])  # pooled in log
    torch.testing.assert_close(trend.view(6, 4)[:, 0], expected, rtol=1e-5, atol=0)
    falling = fit_trend(scores.flip(0), rows, "monotone")
    torch.testing.assert_close(falling, trend.flip(0), rtol=1e-5, atol=0)


# --- debiased: padding patches and sinks ----------------------------------------------------------
def test_content_fraction_of_pad_to_square():
    fraction = content_fraction((100, 300), (6, 6))  # wide image: bands above and below
    expected = torch.zeros(6, 6)
    expected[2:4] = 1.0
    torch.testing.assert_close(fraction, expected)
    half = content_fraction((300, 150), (4, 4))  # tall: 75 px of padding left and right
    torch.testing.assert_close(half[0], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    odd = content_fraction((90, 300), (4, 4))  # top = 105 px: row 1 is 30/75 covered
    torch.testing.assert_close(odd[:, 0], torch.tensor([0.0, 0.6, 0.6, 0.0]), rtol=0, atol=1e-6)


def test_padding_patches_with_inflated_scores_are_suppressed():
    log_scores = torch.zeros(SIDE, SIDE)
    log_scores[:3] = log_scores[9:] = math.log(50.0)  # pad rows: inflated
    target = {r * SIDE + c for r in (5, 6) for c in range(4, 10)}
    log_scores.view(-1)[sorted(target)] = math.log(5.0)
    ctx = make_ctx(single_image(log_scores), [[grid_layout(2, SIDE, SIDE)]])
    fastv = top_cells(_pruner("fastv").select(ctx, 12).scores, ctx, 12)
    assert all(i // SIDE in (0, 1, 2, 9, 10, 11) for i in fastv)
    # a 400 x 200 image padded to a square (LLaVA's fallback is a centre crop: say so)
    size = {"width": 400, "height": 200}
    options = dict(positional=False, sinks=False, pad_to_square=True, image_sizes=[size])
    debiased = _pruner("debiased", **options).select(ctx, 12).scores
    assert top_cells(debiased, ctx, 12) == target
    assert float(debiased[0, 2 : 2 + 3 * SIDE].abs().sum()) == 0.0  # pure padding: zero
    off = _pruner("debiased", **{**options, "padding": False}).select(ctx, 12).scores
    assert top_cells(off, ctx, 12) == fastv
    cropped = _pruner("debiased", **{**options, "pad_to_square": None}).select(ctx, 12).scores
    assert top_cells(cropped, ctx, 12) == fastv  # the adapter's fallback pads nothing
    with pytest.raises(TypeError, match=r"image_sizes\[0\]=\(200, 400\) is ambiguous"):
        _pruner("debiased", **{**options, "image_sizes": [(200, 400)]})  # a bare pair


@pytest.mark.parametrize("sink_by", ["activation", "attention", "both"])
def test_sink_token_is_down_weighted(sink_by):
    log_scores = torch.zeros(SIDE * SIDE)
    target = list(range(40, 48))
    log_scores[target] = math.log(6.0)
    log_scores[100] = math.log(400.0)  # the sink: takes most of the attention
    hidden = single_image(log_scores)
    hidden[0, 2:-4, 8] = 1.0
    hidden[0, 2 + 100, 8] = 300.0  # massive activation in a dim the attention never reads
    ctx = make_ctx(hidden, [[grid_layout(2, SIDE, SIDE)]])
    assert 100 in top_cells(_pruner("fastv").select(ctx, 8).scores, ctx, 8)
    base = dict(positional=False, padding=False, sink_by=sink_by)
    assert top_cells(_pruner("debiased", **base).select(ctx, 8).scores, ctx, 8) == set(target)
    assert 100 in top_cells(_pruner("debiased", **base, sinks=False).select(ctx, 8).scores, ctx, 8)


# --- text raters ---------------------------------------------------------------------------------
def test_raters_are_rows_above_mean_image_mass():
    mass = torch.tensor([[0.1, 0.5, 0.2, 0.6], [0.3, 0.3, 0.9, 0.0]])
    valid = torch.tensor([[True] * 4, [False, True, True, True]])
    raters = select_raters(mass, valid)
    assert raters.tolist() == [[False, True, False, True], [False, False, True, False]]
    prior = torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    weights = rater_weights(raters, prior)
    torch.testing.assert_close(weights, torch.tensor([[0, 0.75, 0, 0.25], [0, 0, 1.0, 0]]))


def _rater_scene():
    """Rows 146, 147 look hard at region A; rows 148, 149 (the last) mostly look at text and,
    inside the image, at region B. fastv (last row) picks B, text (raters) picks A."""
    n = SIDE * SIDE
    hidden = torch.zeros(1, 2 + n + 4, 10)
    region_a, region_b = list(range(26, 32)), list(range(110, 116))
    hidden[0, [2 + i for i in region_a], 4] = 3.0  # keys: A along dim 0, B dim 1, text dim 2
    hidden[0, [2 + i for i in region_b], 5] = 3.0
    text = [0, 1] + list(range(2 + n, 2 + n + 4))
    hidden[0, text, 6] = 3.0
    hidden[0, 2 + n : 2 + n + 2, 0] = 2.0  # raters' queries
    hidden[0, 2 + n + 2 :, 1] = 1.0  # the others' queries
    hidden[0, 2 + n + 2 :, 2] = 2.0
    return hidden, set(region_a), set(region_b)


@pytest.mark.parametrize("prior", [False, True])
def test_text_raters_pick_the_instruction_relevant_region(prior):
    hidden, region_a, region_b = _rater_scene()
    ctx = make_ctx(hidden, [[grid_layout(2, SIDE, SIDE)]])
    assert top_cells(_pruner("fastv").select(ctx, 6).scores, ctx, 6) == region_b
    assert top_cells(_pruner("text", prior=prior).select(ctx, 6).scores, ctx, 6) == region_a
    debiased = _pruner("debiased", base="text", base_options={"prior": prior})
    assert top_cells(debiased.select(ctx, 6).scores, ctx, 6) == region_a


# --- pyramid -------------------------------------------------------------------------------------
def test_budget_split_across_five_crops_is_proportional_with_minimums():
    saliency = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    counts = split_budget(saliency, torch.full((5,), 16), 30, minimum=2)
    assert counts.tolist() == [10, 8, 5, 4, 3]  # 2 each + 20 * saliency
    capped = split_budget(
        torch.tensor([0.9, 0.025, 0.025, 0.025, 0.025]),
        torch.tensor([8, 16, 16, 16, 16]),
        30,
        minimum=2,
    )
    assert capped.tolist() == [8, 6, 6, 5, 5]  # crop 0 full, the rest shared evenly
    assert split_budget(saliency, torch.full((5,), 16), 3, minimum=2).tolist() == [2, 1, 0, 0, 0]


def test_tiles_cut_each_side_by_integer_division():
    r, c = torch.arange(3).repeat_interleave(5), torch.arange(5).repeat(3)
    tiles = tile_index(r, c, 3, 5, 2).view(3, 5)  # rows 0-1 | 2, columns 0-2 | 3-4
    assert tiles.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [2, 2, 2, 3, 3]]
    per_cell = tile_index(r, c, torch.full((15,), 3), torch.full((15,), 5), 2)  # sizes per cell
    assert torch.equal(per_cell.view(3, 5), tiles)
    assert tile_index(r, c, 3, 5, 1).unique().tolist() == [0]


def test_pyramid_region_budgets_and_token_ranks():
    """Four 6x6 tiles with norm (bottom-up) mass 400:200:110:90 split 16 tokens as 1 each + 12
    in proportion (7, 4, 3, 2); inside each tile the top-down attention ramp picks the tokens."""
    log_scores = torch.arange(SIDE * SIDE, dtype=torch.float32).flip(0) * 0.01  # top-left first
    hidden = single_image(log_scores)
    tile = torch.zeros(SIDE, SIDE)
    tile[:6, :6], tile[:6, 6:], tile[6:, :6], tile[6:, 6:] = 400.0, 200.0, 110.0, 90.0
    hidden[0, 2:-4, 9] = tile.flatten()
    ctx = make_ctx(hidden, [[grid_layout(2, SIDE, SIDE)]])
    pruner = _pruner("pyramid", bottom_up="norm", alpha=1.0, tiles=2, min_per_region=1)
    scores = pruner.select(ctx, 16).scores
    kept = top_cells(scores, ctx, 16)
    assert (scores[0] >= 2).sum() == 16  # exactly the budget is marked
    index = torch.arange(SIDE * SIDE).view(SIDE, SIDE)
    expected = set()
    for block, n in (
        (index[:6, :6], 7),
        (index[:6, 6:], 4),
        (index[6:, :6], 3),
        (index[6:, 6:], 2),
    ):
        expected |= set(sorted(block.flatten().tolist())[:n])  # lowest index = most attention
    assert kept == expected


def test_pyramid_splits_anyres_budget_by_base_image_saliency():
    """LLaVA-NeXT layout: base 4x4 + 2x2 crops (8x8 hi-res grid + newlines). The base image's
    [CLS] map puts 0.4/0.3/0.2/0.1 on its quadrants, so with 44 tokens and a minimum of 2 the
    base (mass 1, share 17 > its 16 tokens) is kept whole and the other 20 go to the crops
    (masses 0.4..0.1) as 8, 6, 4, 2 on top of their minimum."""
    model = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(image_size=16, patch_size=4),
            image_grid_pinpoints=[[32, 32]],
        )
    )
    cells, grids = image_cells(model, [32, 32], anyres=True)
    patches, n_crops = _image_patches(model, [32, 32], anyres=True)
    assert n_crops == 5 and grids == [(4, 4), (8, 8)]
    layout = ImageLayout(
        torch.arange(2, 2 + cells.shape[0]), cells, grids, patches=patches, n_crops=n_crops
    )
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, cells.shape[0] + 6, 10, generator=gen)
    ctx = make_ctx(hidden, [[layout]])
    pruner = _pruner("pyramid", min_per_region=2)
    quadrant = torch.tensor([[0.4, 0.3], [0.2, 0.1]]) / 4
    maps = torch.rand(5, 16, generator=gen)
    maps[0] = quadrant.repeat_interleave(2, 0).repeat_interleave(2, 1).flatten()
    pruner._capture.maps = maps
    scores = pruner.select(ctx, 44).scores[0, 2 : 2 + cells.shape[0]]
    crop = patches[:, 0].clone()
    for i in torch.nonzero(crop < 0).flatten().tolist():
        crop[i] = crop[i - 1]  # a newline belongs to the crop of the token before it
    assert torch.bincount(crop[scores >= 2], minlength=5).tolist() == [16, 10, 8, 6, 4]


def test_encoder_cls_attention_matches_eager_attention():
    model = make_model("llava", attn="eager")
    inputs = make_inputs("llava", model, batch=2)
    capture = _EncoderCapture()
    handles = capture.attach(model, vf.model_adapters.get_adapter(model))
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True)
    for h in handles:
        h.remove()
    # vision_feature_layer = -1 reads the last layer's output: its attention scores the patches
    expected = out.attentions[-1][:, :, 0, 1:].mean(1)
    torch.testing.assert_close(capture.maps, expected, atol=1e-6, rtol=0)


# --- guided: grid resampling ---------------------------------------------------------------------
def _guide_map():
    grid = torch.zeros(24, 24)
    grid[6:12, 12:18] = 1.0  # y in [0.25, 0.5), x in [0.5, 0.75)
    return grid


def test_guide_map_24_onto_16_grid():
    mapped = resample_map(_guide_map(), (16, 16))
    expected = torch.zeros(16, 16)
    expected[4:8, 8:12] = 1.0
    torch.testing.assert_close(mapped, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(resample_map(mapped, (24, 24)), _guide_map(), atol=1e-6, rtol=0)


def test_guide_map_onto_anyres_grid_lands_in_the_right_cells():
    vision = SimpleNamespace(image_size=336, patch_size=21)  # 16 x 16 per crop
    model = SimpleNamespace(
        config=SimpleNamespace(vision_config=vision, image_grid_pinpoints=[[336, 672]])
    )
    cells, grids = image_cells(model, [300, 672], anyres=True)
    assert grids == [(16, 16), (14, 32)]  # the 1 x 2 crop canvas, unpadded to 14 rows
    layout = ImageLayout(torch.arange(cells.shape[0]), cells, grids)
    tokens = ImageTokens(
        0, 0, layout, torch.arange(cells.shape[0]), cells, torch.arange(cells.shape[0])
    )
    values = map_to_tokens({0: _guide_map()}, tokens)
    base = torch.zeros(16, 16)
    base[cells[:256, 1], cells[:256, 2]] = values[:256]
    assert set(torch.nonzero(base > 0).flatten(0).view(-1, 2)[:, 0].tolist()) == {4, 5, 6, 7}
    assert torch.equal(base > 0, resample_map(_guide_map(), (16, 16)) > 0)
    hires = (cells[:, 0] == 1) & (cells[:, 1] >= 0)
    hot = cells[hires][values[hires] > 1e-6]
    assert set(hot[:, 1].tolist()) == {3, 4, 5, 6}  # y in [3.5, 7): row 3 half covered
    assert set(hot[:, 2].tolist()) == set(range(16, 24))  # x in [16, 24)
    full = hot[(values[hires][values[hires] > 1e-6] >= values.max() - 1e-5)]
    assert set(full[:, 1].tolist()) == {4, 5, 6}
    newline = cells[:, 1] < 0
    assert torch.equal(values[newline], values[torch.nonzero(newline).flatten() - 1])


def test_guided_scores_follow_the_guide_map():
    guide = make_model("llava", seed=3)
    pruner = _pruner("guided", guide=guide)
    from vlm_focus.pruners.guided import GuideResult

    pruner._pending = GuideResult(maps=[[{0: _guide_map()}]])
    ctx = make_ctx(single_image(torch.zeros(256)), [[grid_layout(2, 16, 16)]])
    kept = top_cells(pruner.select(ctx, 16).scores, ctx, 16)
    assert kept == {r * 16 + c for r in range(4, 8) for c in range(8, 12)}


# --- diverse -------------------------------------------------------------------------------------
def test_maxmin_takes_one_token_per_cluster_first():
    gen = torch.Generator().manual_seed(0)
    centres = torch.eye(8)[:4] * 5.0
    features = centres.repeat_interleave(10, 0) + 0.05 * torch.randn(40, 8, generator=gen)
    order = maxmin_order(features, 4)
    assert sorted((order // 10).tolist()) == [0, 1, 2, 3]
    relevance = torch.zeros(40)
    relevance[0:10] = relevance[20:30] = 1.0  # the instruction cares about clusters 0 and 2
    kept = diverse_keep(features, 2, pool=2.0, relevance=relevance)
    assert sorted((kept // 10).tolist()) == [0, 2]


def test_diverse_pruner_keeps_distinct_tokens():
    hidden = single_image(torch.zeros(16), n_before=2, n_after=2)
    hidden[0, 2:18, 8] = 1.0
    hidden[0, [2 + 3, 2 + 12], 8] = -1.0  # two tokens point the other way
    hidden[0, 2:18, 9] = torch.linspace(0, 0.01, 16)
    ctx = make_ctx(hidden, [[grid_layout(2, 4, 4)]])
    kept = top_cells(_pruner("diverse").select(ctx, 2).scores, ctx, 2)
    assert len(kept & {3, 12}) == 1 and len(kept) == 2


# --- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, options, word",
    [
        ("debiased", {"base": "random"}, "base"),
        ("debiased", {"trend": "linear"}, "trend"),
        ("debiased", {"axis": "col"}, "axis"),
        ("debiased", {"sink_weight": 2.0}, "sink_weight"),
        ("text", {"prior": 1}, "prior"),
        ("pyramid", {"alpha": 1.5}, "alpha"),
        ("pyramid", {"bottom_up": "cls"}, "bottom_up"),
        ("diverse", {"pool": 0.5}, "pool"),
        ("guided", {}, "guide"),
        ("guided", {"guide": torch.nn.Linear(2, 2)}, "guide"),
    ],
)
def test_bad_options_raise_naming_the_option(name, options, word):
    with pytest.raises(ValueError, match=word):
        get_pruner(name).Options(**options)


def test_every_pruner_is_documented_and_registered():
    for name in ("fastv", "text", "debiased", "pyramid", "guided", "diverse", "random", "pool"):
        cls = get_pruner(name)
        assert cls.summary and cls.__doc__ and cls.name == name
    assert get_pruner("text").attention_based and not get_pruner("pyramid").attention_based


def test_grid_cells_used_by_fake_layouts():
    assert grid_cells(2, 3)[4].tolist() == [0, 1, 1]


@pytest.mark.parametrize("answer_tokens", [0, 3])
def test_guide_map_is_all_layer_instruction_attention(answer_tokens):
    """The guide map equals eager attention from the instruction rows (and the guide's own
    greedy answer), head mean, averaged over rows, summed over every layer."""
    from vlm_focus.pruners.guided import guide_attention

    guide = make_model("llava", attn="eager", seed=3)
    inputs = make_inputs("llava", guide, batch=2, seed=5)
    result = guide_attention(guide, inputs, answer_tokens=answer_tokens)
    full = dict(inputs)
    if answer_tokens:
        assert result.sequences.shape[1] == inputs["input_ids"].shape[1] + answer_tokens
        full["input_ids"] = result.sequences
        full["attention_mask"] = torch.cat(
            [inputs["attention_mask"], torch.ones(2, answer_tokens, dtype=torch.long)], 1
        )  # random weights: no EOS in three tokens
    with torch.no_grad():
        attentions = guide(**full, output_attentions=True).attentions  # [B, H, S, S] per layer
    ids, mask = full["input_ids"], full["attention_mask"].bool()
    for b in range(2):
        image = torch.nonzero(ids[b] == 120).flatten()
        rows = torch.arange(int(image[-1]) + 1, ids.shape[1])
        rows = rows[mask[b, rows]]
        expected = sum(a[b, :, rows][:, :, image].mean(0).mean(0) for a in attentions)
        torch.testing.assert_close(result.maps[b][0][0].flatten(), expected, atol=1e-5, rtol=0)
