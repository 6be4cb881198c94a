"""Grounding an image seen as pieces: InternVL's tiles plus thumbnail and Gemma 3's
pan-and-scan crops plus global view, through the real processors (``tiny_processors.py``).

For images of several sizes (so the tile and crop counts differ): each view's frame is the
processor's own; attention planted on one cell of one piece lands in that cell's rectangle of
the original image (pixel map, point, box, the one grid over the whole image, region score);
the thumbnail's and global view's cells land on the whole image. The public calls
(``vf.ground``, ``heatmap``, ``region_score``, ``GroundingPass``) run end to end on both
classes, and bad input raises naming the problem.
"""

from __future__ import annotations

import pytest
import tiny_processors
import torch
from tiny_processors import noise_image, ramp_image, tiny_processor

import vlm_focus as vf
import vlm_focus.core.layer_view as layer_view_module
from vlm_focus import geometry as geo
from vlm_focus import grounding as G
from vlm_focus.geometry import Frame, Size
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import tiny_model

SIDE = 4  # both tiny models: a 4 x 4 grid per tile, crop or image block
PAN_AND_SCAN = dict(
    do_pan_and_scan=True,
    pan_and_scan_min_crop_size=8,
    pan_and_scan_max_num_crops=4,
    pan_and_scan_min_ratio_to_activate=1.2,
)
#: (width, height) -> InternVL's (rows, cols) of tiles: 3x1, 1x2, 2x3 and one tile (no pieces)
TILED = {Size(100, 40): (1, 3), Size(40, 90): (2, 1), Size(45, 30): (2, 3), Size(30, 30): (1, 1)}
#: (width, height) -> Gemma 3's pan-and-scan crops: 3 wide, 3 tall, 4 (the last one shorter),
#: none for a square image
CROPPED = {Size(60, 20): 3, Size(20, 50): 3, Size(70, 20): 4, Size(30, 30): 0}
_CACHE: dict = {}


def _model_and_processor(kind: str):
    if kind not in _CACHE:
        model = tiny_model(kind)
        words = tiny_processors.WORDS
        # the words of vf.ground's presence question and its yes/no answer, at free ids of the
        # tiny vocabulary
        tiny_processors.WORDS = [*words, "yes", "no", "Is", "there", "a"]
        try:
            processor = tiny_processor(model)
        finally:
            tiny_processors.WORDS = words
        _CACHE[kind] = model, processor
    return _CACHE[kind]


def _inputs(kind: str, images: list, processor) -> dict:
    """One image per row, ``describe the image`` after it; Gemma 3 with pan-and-scan on."""
    if kind == "internvl":
        texts = ["<IMG_CONTEXT>\ndescribe the image"] * len(images)
        return dict(processor(images=images, text=texts, padding=True, return_tensors="pt"))
    texts = ["describe <start_of_image> the image"] * len(images)
    return dict(
        processor(
            images=[[i] for i in images],
            text=texts,
            padding=True,
            return_tensors="pt",
            **PAN_AND_SCAN,
        )
    )


def _expected_frames(kind: str, size: Size, processor) -> list[Frame]:
    """The views' frames by the processors' own settings, as the call used them."""
    whole = Frame(0.0, 0.0, float(size.width), float(size.height))
    if kind == "internvl":
        rows, cols = TILED[size]
        assert geo.tile_grid(size, processor.image_processor) == (rows, cols)
        return geo.tile_frames(size, (rows, cols), 1 if rows * cols == 1 else rows * cols + 1)
    crops = geo.pan_and_scan_frames(size, processor.image_processor, **PAN_AND_SCAN)
    assert len(crops) == CROPPED[size]
    return [whole, *crops]


def _plant(monkeypatch, targets: list[int]) -> None:
    """Every query row of row ``b`` puts all its attention on key ``targets[b]``."""

    def fake(q, k, scaling, allowed):
        probs = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for b, target in enumerate(targets):
            probs[b, :, :, target] = 1.0
        return probs

    monkeypatch.setattr(layer_view_module, "attention_probs", fake)


def _position(model, inputs: dict, view: int, row: int, col: int) -> int:
    """The sequence position of cell ``(row, col)`` of ``view`` of row 0's image, read from
    the adapter's own layout (Gemma 3: one block per view, the image's first)."""
    (blocks,) = get_adapter(model).layout(model, inputs["input_ids"], inputs)[:1]
    layout = blocks[0] if len(blocks) == 1 else blocks[view]
    view = view if len(blocks) == 1 else 0
    hit = (layout.cells == torch.tensor([view, row, col])).all(1)
    return int(layout.positions[torch.nonzero(hit).flatten()[0]])


CASES = [("internvl", s) for s in TILED] + [("gemma3", s) for s in CROPPED]


@pytest.mark.parametrize("kind,size", CASES, ids=[f"{k}-{s.width}x{s.height}" for k, s in CASES])
@pytest.mark.parametrize("piece", [True, False], ids=["piece", "whole"])
def test_a_planted_cell_lands_on_its_original_pixels(monkeypatch, kind, size, piece):
    """Attention planted on cell (1, 2) of the last piece (last tile, last crop), or of the
    whole-image view (thumbnail, global view), lands in that cell's rectangle of the original
    image: pixel map peak, point, box, the grid over the whole image, region score."""
    model, processor = _model_and_processor(kind)
    image = ramp_image(*size)
    inputs = _inputs(kind, [image], processor)
    frames = _expected_frames(kind, size, processor)
    whole_view = len(frames) - 1 if kind == "internvl" else 0
    pieces = [v for v in range(len(frames)) if v != whole_view]
    view = pieces[-1] if piece and pieces else whole_view
    _plant(monkeypatch, [_position(model, inputs, view, 1, 2)])
    gp = G.GroundingPass(model, inputs, processor=processor, images=[image])
    ((layout,),) = gp.layouts
    assert layout.grids == [(SIDE, SIDE)] * len(frames)
    assert gp.frames[0][0] == frames  # the processor's frames; crops placed from their count
    heat = gp.map("image")
    assert heat.size == size and heat.pixels.shape == (size.height, size.width)
    assert heat.mass == pytest.approx(1.0, abs=1e-5)
    x_lo, y_lo, x_hi, y_hi = frames[view].cells((SIDE, SIDE))[1, 2].tolist()
    f = frames[view]  # the known cell's rectangle, by hand
    assert (x_lo, x_hi) == (f.x0 + 2 * f.width / SIDE, f.x0 + 3 * f.width / SIDE)
    assert (y_lo, y_hi) == (f.y0 + f.height / SIDE, f.y0 + 2 * f.height / SIDE)
    y, x = divmod(int(heat.pixels.argmax()), size.width)
    assert x_lo <= x + 0.5 <= x_hi and y_lo <= y + 0.5 <= y_hi
    px, py = gp.point("image", sigma=0)
    assert x_lo <= px <= x_hi and y_lo <= py <= y_hi
    box = gp.boxes("image", threshold=0.5, sigma=0)[0]
    assert G.iou(box, [x_lo, y_lo, x_hi - x_lo, y_hi - y_lo]) >= 0.5
    assert float(heat.pixels.sum()) == pytest.approx(1.0, abs=2e-2)  # a density of mass 1
    cell = [x_lo, y_lo, x_hi - x_lo, y_hi - y_lo]
    assert float(gp.region_score("image", cell)[0]) == pytest.approx(1.0, abs=1e-6)
    # one grid over the whole image at the pieces' pitch; a tile's cell is one of its cells
    rows, cols = heat.grid.shape
    if pieces and kind == "internvl":
        tile_rows, tile_cols = TILED[size]
        assert (rows, cols) == (tile_rows * SIDE, tile_cols * SIDE)
    elif pieces:
        n = CROPPED[size]
        assert (rows, cols) == ((SIDE, n * SIDE) if size.width > size.height else (n * SIDE, SIDE))
    else:
        assert (rows, cols) == (SIDE, SIDE)
    assert float(heat.grid.sum()) == pytest.approx(1.0, abs=1e-5)
    r, c = divmod(int(heat.grid.argmax()), cols)
    cx, cy = (c + 0.5) * size.width / cols, (r + 0.5) * size.height / rows
    assert x_lo <= cx <= x_hi and y_lo <= cy <= y_hi
    if pieces and piece and kind == "internvl":  # tiles align with the grid: all of it there
        assert float(heat.grid.max()) == pytest.approx(1.0, abs=1e-5)


def test_the_grid_over_the_image_moves_each_views_mass_by_area():
    """:func:`geometry.regrid` keeps mass and splits a cell by area; :func:`piece_grid` finds
    pieces only where views tile the image (not a base and an anyres view, not one view)."""
    size = Size(60, 20)
    whole = Frame(0.0, 0.0, 60.0, 20.0)
    crop = Frame(40.0, 0.0, 20.0, 20.0)
    one = torch.zeros(4, 4)
    one[1, 2] = 1.0
    out = geo.regrid(one, crop, whole, (4, 12))  # 5-pixel cells: the crop's own
    assert out[1, 8 + 2] == 1.0 and float(out.sum()) == 1.0
    out = geo.regrid(one, whole, whole, (4, 12))  # a 15-pixel cell over three 5-pixel ones
    assert torch.allclose(out[1, 6:9], torch.full((3,), 1 / 3))
    crops = geo.pan_and_scan_crops(size, 3)
    assert geo.piece_grid(size, [whole, *crops], [(4, 4)] * 4) == (4, 12)
    assert geo.piece_grid(size, [whole], [(4, 4)]) is None
    nearly = Frame(0.0, 0.5, 60.0, 19.0)  # LLaVA-NeXT: base view, then the composite twice
    assert geo.piece_grid(size, [whole, nearly, nearly], [(4, 4), (4, 8), (4, 8)]) is None
    with pytest.raises(ValueError, match="1 pan-and-scan crops cannot come from a 60x20 image"):
        geo.pan_and_scan_crops(size, 1)
    with pytest.raises(ValueError, match="cuts it into 2 to 3 crops"):
        geo.pan_and_scan_crops(size, 4)


@pytest.mark.parametrize("kind", ["internvl", "gemma3"])
def test_public_calls_end_to_end_in_original_pixels(kind):
    """``vf.ground``, ``heatmap``, ``region_score`` and a ``GroundingPass`` over a padded batch
    of two images of different piece counts (and ``relative_to``): maps in each image's own
    pixels, the wrappers equal the pass, the whole image scores 1. Layer 1 is a full-attention
    layer of both tiny models (Gemma 3's sliding window of 8 keeps the question's words at
    layer 0 from the image)."""
    model, processor = _model_and_processor(kind)
    images = [noise_image(60, 20, seed=0), noise_image(20, 50, seed=1)]
    inputs = _inputs(kind, images, processor)
    options = dict(processor=processor, images=images, layers=[1])
    gp = G.GroundingPass(model, inputs, **options)
    for b, image in enumerate(images):
        size = Size(*image.size)
        heat = gp.map("image", row=b)
        assert len(gp.layouts[b]) == 1 and len(heat.views) > 1  # pieces joined to one image
        assert heat.size == size and heat.pixels.shape == (size.height, size.width)
        assert heat.seen == Frame(0, 0, size.width, size.height) and heat.seen_share == 1.0
        x, y = G.point(heat)
        assert 0 <= x <= size.width and 0 <= y <= size.height
        assert heat.mass > 0 and G.boxes(heat)
        assert all(Frame(0, 0, *size).covers(box) for box in G.boxes(heat))
    whole = [[0, 0, 60, 20], [0, 0, 20, 50]]
    torch.testing.assert_close(gp.region_score("image", whole), torch.ones(2))
    maps = G.heatmap(model, inputs, "image", **options)
    for b in range(2):
        torch.testing.assert_close(maps[b][0].pixels, gp.maps("image")[b][0].pixels)
    score = G.region_score(model, inputs, [0, 0, 10, 10], "image", **options)
    torch.testing.assert_close(score, gp.region_score("image", [0, 0, 10, 10]))
    relative = G.GroundingPass(model, inputs, relative_to=inputs, **options).maps("image")
    assert [len(row[0].views) for row in relative] == [len(m[0].views) for m in maps]
    found = vf.ground(model, processor, images[0], "image", layers=[1], presence_threshold=0)
    assert found.map.size == Size(60, 20) and found.map.pixels.shape == (20, 60)
    assert found.present and found.point is not None and found.boxes
    assert 0 <= found.point[0] <= 60 and 0 <= found.point[1] <= 20
    if kind == "internvl":  # the processor tiles it by itself: 3 tiles and the thumbnail
        assert len(found.map.views) == 4 and tuple(found.map.grid.shape) == (4, 12)


def test_bad_input_raises_naming_the_problem():
    """Several images in a pan-and-scan row, a size that cannot have the crop or tile count,
    and a box outside the image."""
    model, processor = _model_and_processor("gemma3")
    wide, square = ramp_image(60, 20), ramp_image(30, 30)
    inputs = processor(
        images=[[wide, square]],
        text=["describe <start_of_image> and <start_of_image> ?"],
        return_tensors="pt",
        **PAN_AND_SCAN,
    )
    with pytest.raises(ValueError, match=r"row 0: 2 images given for 5 image blocks.*one image"):
        G.GroundingPass(model, inputs, processor=processor, images=[[wide, square]])
    assert len(G.GroundingPass(model, inputs, processor=processor).layouts[0]) == 5  # no sizes
    with pytest.raises(ValueError, match=r"sizes per row \[6\] do not match the images per row"):
        G.GroundingPass(model, inputs, processor=processor, images=[[wide] * 6])
    inputs = _inputs("gemma3", [wide], processor)
    with pytest.raises(ValueError, match="3 pan-and-scan crops cannot come from a 30x30 image"):
        G.GroundingPass(model, inputs, processor=processor, images=[square])
    gp = G.GroundingPass(model, inputs, processor=processor, images=[wide])
    with pytest.raises(ValueError, match=r"lies outside the 60x20 \(W x H\) image"):
        gp.region_score("image", [50, 0, 20, 20])
    internvl, internvl_processor = _model_and_processor("internvl")
    inputs = _inputs("internvl", [wide], internvl_processor)
    with pytest.raises(ValueError, match=r"row 0, image 0: size .* cuts it into 1x1 tiles"):
        G.GroundingPass(internvl, inputs, processor=internvl_processor, images=[square])
    heat = G.GroundingPass(internvl, inputs, processor=internvl_processor).map("image")
    assert len(heat.views) == 4  # the grid maps need no size
    with pytest.raises(ValueError, match="original size of image 0 in row 0 is unknown"):
        heat.pixels  # noqa: B018
