"""Pruning before the LLM (:mod:`vlm_focus.core.before_llm`, what the vLLM plugin calls)
keeps what ``vf.wrap(..., layer=0)`` keeps in transformers, on the tiny Qwen2.5-VL (this runs
in the main environment: the module imports neither vLLM nor transformers)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import IMAGE, VISION_END, VISION_START, make_model

import vlm_focus as vf
from vlm_focus.config import FocusConfig, keep_count
from vlm_focus.core.before_llm import before_llm_pruner, frame_counts, item_keep, item_layout
from vlm_focus.integrations import vllm as plugin
from vlm_focus.model_adapters import get_adapter
from vlm_focus.pruners import spread_order, tile_index


def _inputs(grid: tuple[int, int, int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    n = t * h * w // 4
    text = torch.randint(3, 100, (9,), generator=gen).tolist()
    row = text[:3] + [VISION_START] + [IMAGE] * n + [VISION_END] + text[3:]
    ids = torch.tensor([row])
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMAGE).long(),
        pixel_values=torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=gen),
        image_grid_thw=torch.tensor([grid]),
    )


def _kept_by_wrap(model, inputs: dict, **options) -> torch.Tensor:
    first = int((inputs["input_ids"][0] == IMAGE).nonzero()[0])
    with vf.wrap(model, layer=0, budget="frame", **options) as handle, torch.no_grad():
        model(**inputs)
        return handle.last_trace.kept[0] - first


@pytest.mark.parametrize("grid", [(1, 16, 12), (1, 8, 16), (1, 10, 6)])
@pytest.mark.parametrize("keep", [0.25, 0.5, 7])
def test_pool_pyramid_and_diverse_keep_what_wrap_keeps(grid, keep):
    model = make_model("qwen2_5_vl")
    inputs = _inputs(grid, seed=sum(grid))
    rows, cols = grid[1] // 2, grid[2] // 2
    n_keep = keep_count(keep, rows * cols, clamp=True)
    with torch.no_grad():
        embeds = model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output[0]  # [rows * cols, D]
    for pruner, options in (("pool", {}), ("pyramid", {"alpha": 0.0}), ("diverse", {})):
        expected = _kept_by_wrap(model, inputs, pruner=pruner, keep=keep, **options)
        chosen = before_llm_pruner(FocusConfig(pruner=pruner, layer=0))
        got = item_keep(
            chosen,
            item_layout(rows, cols),
            n_keep,
            hidden=embeds[None],
            where=torch.arange(rows * cols),
            adapter=get_adapter(model),
        )
        assert got.tolist() == expected.tolist(), pruner


def test_spread_rank_is_a_permutation_that_starts_at_the_centre():
    rank = spread_order(4, 6)
    assert sorted(rank.tolist()) == list(range(24))
    # the four cells around (2.0, 3.0) tie; the lowest raster index, cell (1, 2), goes first
    assert int(rank.argmin()) == 1 * 6 + 2


def test_keep_count_is_focus_configs_rule_with_counts_clamped():
    # a ratio: vf.wrap's rule (round, halves to even, at least 1)
    assert keep_count(0.25, 48, clamp=True) == 12 == keep_count(0.25, 48)
    assert keep_count(0.125, 20, clamp=True) == 2 == keep_count(0.125, 20)  # round(2.5)
    assert keep_count(0.01, 48, clamp=True) == 1
    # a count: one server-wide count serves every image; a smaller image keeps all its tokens,
    # where vf.wrap (one input, its caller's count) raises
    assert keep_count(100, 48, clamp=True) == 48 and keep_count(30, 48, clamp=True) == 30
    with pytest.raises(ValueError, match="more than the 48 visual tokens"):
        keep_count(100, 48)
    assert plugin.check_request("pool", 64) == 64 and plugin.check_request("pool", 0.5) == 0.5
    with pytest.raises(ValueError, match="keep=1.5"):
        plugin.check_request("pool", 1.5)


@pytest.mark.parametrize(("rows", "cols", "tiles"), [(8, 6, 2), (5, 7, 3), (1, 9, 2), (4, 4, 1)])
def test_regions_are_the_pyramid_pruners_tiles(rows, cols, tiles):
    r, c = torch.arange(rows).repeat_interleave(cols), torch.arange(cols).repeat(rows)
    want = [(i * tiles // rows) * tiles + j * tiles // cols for i, j in zip(r.tolist(), c.tolist())]
    assert tile_index(r, c, rows, cols, tiles).tolist() == want


@pytest.mark.parametrize("sizes", [[48], [48, 16], [16, 60, 48], [3, 1], [7, 7, 7], [1, 5, 2, 9]])
def test_frame_counts_are_the_engines_frame_budget(sizes):
    """The processor's per-image counts equal what vf.wrap's budget="frame" selection keeps of
    each image, whatever the scores (its shares depend on the sizes alone)."""
    from vlm_focus.core.selection import frame_shares, keep_mask

    n = sum(sizes)
    frames = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[None]
    visual = torch.ones(1, n, dtype=torch.bool)
    for total in range(1, n + 1):
        counts = frame_counts(sizes, total)
        assert sum(counts) == total
        for seed in range(3):
            scores = torch.rand(1, n, generator=torch.Generator().manual_seed(seed))
            keep = keep_mask(frame_shares(scores, visual, frames), visual, n - total)
            kept = torch.bincount(frames[keep], minlength=len(sizes)).tolist()
            assert kept == counts, (total, seed)


def test_a_pruner_that_cannot_choose_before_the_llm_or_lacks_its_layer_is_refused():
    with pytest.raises(ValueError, match="pruner 'random' cannot choose before the language"):
        before_llm_pruner(FocusConfig(pruner="random", layer=0))
    fastv = before_llm_pruner(FocusConfig(pruner="fastv", layer=0))
    with pytest.raises(ValueError, match="reads layer 0's attention: pass layer"):
        item_keep(
            fastv,
            item_layout(2, 2),
            2,
            hidden=torch.zeros(1, 4, 8),
            where=torch.arange(4),
            adapter=None,
        )
    pyramid = before_llm_pruner(FocusConfig(pruner="pyramid", layer=0), {"tiles": 3})
    assert (pyramid.options.alpha, pyramid.options.bottom_up, pyramid.options.tiles) == (
        0.0,
        "norm",
        3,
    )
    with pytest.raises(ValueError, match=r"runs before the language model with \{'alpha'"):
        before_llm_pruner(FocusConfig(pruner="pyramid", layer=0), {"alpha": 0.5})
    with pytest.raises(ValueError, match=r"\{'pool': 2\} needs what exists only inside it"):
        before_llm_pruner(FocusConfig(pruner="diverse", layer=0), {"pool": 2})
