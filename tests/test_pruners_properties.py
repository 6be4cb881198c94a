"""Property tests over shapes, keep counts, batch, padding, already pruned sequences and layouts
(plain grids and LLaVA-NeXT anyres grids with newlines): for every pruner, the engine's kept
counts are exact, kept indices lie inside the visual spans, nothing else is dropped, and
budget-based pruners mark exactly the row's budget."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pruner_inputs import WIDTH, make_ctx
from tiny_models import make_model

from vlm_focus.config import FocusConfig, keep_count
from vlm_focus.core.selection import keep_mask as engine_keep_mask
from vlm_focus.geometry import Size
from vlm_focus.model_adapters import ImageLayout
from vlm_focus.model_adapters.base import grid_cells
from vlm_focus.model_adapters.llava_next import _image_patches, image_cells
from vlm_focus.pruners import get_pruner
from vlm_focus.pruners.guided import GuideResult

_GUIDE = make_model("llava", seed=3)
_NEXT = SimpleNamespace(
    config=SimpleNamespace(
        vision_config=SimpleNamespace(image_size=12, patch_size=4),  # 3 x 3 per crop
        image_grid_pinpoints=[[12, 24], [24, 12], [24, 24]],
    )
)


def _image(draw, start: int) -> ImageLayout:
    if draw(st.booleans()):
        rows, cols = draw(st.integers(2, 6)), draw(st.integers(2, 6))
        positions = torch.arange(start, start + rows * cols)
        return ImageLayout(positions, grid_cells(rows, cols), [(rows, cols)])
    size = [draw(st.integers(8, 40)), draw(st.integers(8, 40))]
    cells, grids = image_cells(_NEXT, size, anyres=True)
    patches, n_crops = _image_patches(_NEXT, size, anyres=True)
    positions = torch.arange(start, start + cells.shape[0])
    return ImageLayout(
        positions, cells, grids, image_size=Size(size[1], size[0]), patches=patches, n_crops=n_crops
    )


@st.composite
def scenes(draw):
    batch = draw(st.integers(1, 3))
    lengths, spans = [], []
    for _ in range(batch):
        before, after = draw(st.integers(0, 3)), draw(st.integers(1, 4))
        layout = _image(draw, 0)
        lengths.append(before + layout.positions.numel() + after)
        spans.append((before, layout))
    width = max(lengths) + draw(st.integers(0, 2))
    full_layouts, valid = [], torch.zeros(batch, width, dtype=torch.bool)
    for b, ((before, layout), length) in enumerate(zip(spans, lengths, strict=True)):
        start = width - length + before
        shifted = ImageLayout(
            layout.positions + start,
            layout.cells,
            layout.grids,
            image_size=layout.image_size,
            patches=layout.patches,
            n_crops=layout.n_crops,
        )
        full_layouts.append([shifted])
        valid[b, width - length :] = True
    n_visual = [lay[0].positions.numel() for lay in full_layouts]
    # An earlier stage may have pruned: every row lost the same number of visual tokens.
    dropped = draw(st.integers(0, min(n_visual) - 2))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    positions = []
    for b, lay in enumerate(full_layouts):
        gone = lay[0].positions[torch.randperm(n_visual[b], generator=gen)[:dropped]]
        keep = ~torch.isin(torch.arange(width), gone)
        positions.append(torch.arange(width)[keep])
    positions = torch.stack(positions)
    hidden = torch.randn(batch, positions.shape[1], WIDTH, generator=gen)
    keep = draw(st.one_of(st.floats(0.05, 1.0), st.integers(1, 4)))
    return full_layouts, positions, valid.gather(1, positions), hidden, keep, seed


def _options(draw_name, data):
    if draw_name == "debiased":
        return dict(
            base=data.draw(st.sampled_from(["fastv", "text"])),
            trend=data.draw(st.sampled_from(["exp", "monotone"])),
            axis=data.draw(st.sampled_from(["sequence", "row"])),
            sinks=data.draw(st.booleans()),
            sink_by=data.draw(st.sampled_from(["activation", "attention", "both"])),
            pad_to_square=data.draw(st.sampled_from([None, True, False])),
        )
    if draw_name == "pyramid":
        return dict(
            alpha=data.draw(st.floats(0.0, 1.0)),
            tiles=data.draw(st.integers(1, 3)),
            min_per_region=data.draw(st.integers(0, 2)),
        )
    if draw_name == "diverse":
        return dict(pool=data.draw(st.floats(1.0, 3.0)))
    if draw_name == "guided":
        return dict(guide=_GUIDE)
    if draw_name == "text":
        return dict(prior=data.draw(st.booleans()))
    return {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scene=scenes(),
    name=st.sampled_from(
        ["fastv", "text", "debiased", "pyramid", "guided", "diverse", "random", "pool"]
    ),
    query=st.sampled_from(["last", "text"]),
    data=st.data(),
)
def test_selection_invariants(scene, name, query, data):
    layouts, positions, valid, hidden, keep, seed = scene
    config = FocusConfig(pruner=name, query_rows=query)
    ctx = make_ctx(hidden, layouts, valid=valid, positions=positions, config=config)
    visual = ctx.visual
    n_now = visual.sum(1).tolist()
    n_orig = [lay[0].positions.numel() for lay in layouts]
    if isinstance(keep, int) and keep > min(n_now):
        keep = min(n_now)
    # the engine's rule: every row drops the same number, the smallest any row asks for
    drop = min(n - min(n, keep_count(keep, o)) for n, o in zip(n_now, n_orig, strict=True))
    counts = visual.sum(1) - drop
    n_keep = int(counts.min())
    cls = get_pruner(name)
    pruner = cls(config, cls.Options(**_options(name, data)))
    if name == "guided":
        maps = []
        for _ in layouts:
            r, c = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 7))
            maps.append([{0: torch.rand(r, c, generator=torch.Generator().manual_seed(seed))}])
        pruner._pending = GuideResult(maps=maps)
    if name == "pyramid" and data.draw(st.booleans()):
        crops = sum(lay[0].n_crops for lay in layouts)
        pixels = max(
            int(lay[0].patches[:, 1].max()) + 1 if lay[0].patches is not None else 1
            for lay in layouts
        )
        pruner._capture.maps = torch.rand(crops, pixels)
    with torch.no_grad():
        selection = pruner.select(ctx, n_keep)
        again = pruner.select(ctx, n_keep) if name not in ("guided",) else selection
    scores = selection.scores
    assert scores.shape == visual.shape
    assert torch.isfinite(scores[visual]).all()
    keep = engine_keep_mask(scores, visual, drop)
    keep_again = engine_keep_mask(again.scores, visual, drop)
    kept = [torch.nonzero(keep[b] & visual[b]).flatten() for b in range(visual.shape[0])]
    kept_again = [torch.nonzero(k & v).flatten() for k, v in zip(keep_again, visual)]
    for b in range(visual.shape[0]):
        assert kept[b].numel() == int(counts[b])  # exact count
        assert visual[b, kept[b]].all()  # only visual tokens are candidates
        keep_mask = ~visual[b].clone()
        keep_mask[kept[b]] = True
        assert keep_mask[~visual[b]].all()  # text and padding always stay
        assert int(keep_mask.sum()) == visual.shape[1] - drop
        assert torch.equal(kept[b], kept_again[b])  # deterministic
        if name in ("pyramid", "diverse"):
            assert int((scores[b][visual[b]] >= 2).sum()) == int(counts[b])  # exact budget
