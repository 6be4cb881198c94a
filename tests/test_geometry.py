"""Geometry against ground truth: a bright square planted at a known pixel of a wide or tall
image goes through the real transformers image processor (built offline from its settings);
the grid cell that holds it in the processed pixels, mapped back through
``vlm_focus.geometry``, lands on the planted pixel within one cell. Plus sizes, swaps and the
frames' own arithmetic."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    LlavaImageProcessor,
    LlavaNextImageProcessor,
    LlavaOnevisionImageProcessor,
    Qwen2VLImageProcessor,
)
from transformers.image_processing_utils import select_best_resolution

from vlm_focus import geometry as geo
from vlm_focus.geometry import Frame, Size
from vlm_focus.model_adapters import ImageLayout
from vlm_focus.model_adapters.base import grid_cells
from vlm_focus.model_adapters.llava import LLAVA
from vlm_focus.model_adapters.llava_next import LLAVA_NEXT, anyres_canvas, image_cells
from vlm_focus.model_adapters.llava_onevision import LLAVA_ONEVISION, _anyres_tokens
from vlm_focus.model_adapters.qwen2_vl import QWEN2_VL

PATCH = 8  # encoder pixels per token side (anyres and dynamic resolution)
FINE = 4  # single-view processors: 4-pixel cells, fine enough to tell the rules apart
SIDE = 4  # tokens per side of a 32-pixel crop
SIZES = {"wide": Size(150, 100), "tall": Size(100, 150)}
# planted points, as shares of the width and height: near the corners, and (for centre crops)
# inside the central square of either image
POINTS = [(0.15, 0.15), (0.85, 0.85), (0.5, 0.5), (0.2, 0.8)]
CENTRAL = [(0.32, 0.3), (0.68, 0.7), (0.5, 0.5), (0.35, 0.66)]
PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
OV_PINPOINTS = [[32 * i, 32 * j] for i in range(1, 4) for j in range(1, 4)]


def _image(size: Size, x: int, y: int) -> Image.Image:
    """A 5x5 white square centred on pixel (x, y) on a background of the processors' padding
    colour (CLIP's mean), so padding never outshines it."""
    a = np.empty((size.height, size.width, 3), np.uint8)
    a[:] = (122, 116, 104)
    a[max(0, y - 2) : y + 3, max(0, x - 2) : x + 3] = 255
    return Image.fromarray(a)


def _peak(canvas: np.ndarray, rows: int, cols: int) -> tuple[int, int]:
    """(row, col) of the brightest cell of a [C, H, W] canvas cut into rows x cols cells."""
    c, h, w = canvas.shape
    cells = canvas.mean(0).reshape(rows, h // rows, cols, w // cols).mean((1, 3))
    r, col = np.unravel_index(int(cells.argmax()), cells.shape)
    return int(r), int(col)


def _composite_cell(pixels: np.ndarray, size: Size, model, grid) -> tuple[int, int]:
    """The brightest cell of the anyres crops in the composite ``grid``: the crops stitched
    row-major on the resolution transformers' own ``select_best_resolution`` picks, minus the
    rows or columns the model's ``unpad_image`` drops (the adapter's ``anyres_canvas``), scaled
    to ``grid`` (LLaVA-OneVision's downscale)."""
    best_h, best_w = select_best_resolution(
        (size.height, size.width), model.config.image_grid_pinpoints
    )
    ch, cw = best_h // 32, best_w // 32
    crops = pixels[1 : 1 + ch * cw].reshape(ch, cw, 3, 32, 32)
    canvas = crops.transpose(2, 0, 3, 1, 4).reshape(3, ch * 32, cw * 32)
    r, c = _peak(canvas, ch * SIDE, cw * SIDE)
    kept = anyres_canvas(model, [size.height, size.width])[0]  # [2, h, w] padded-grid (row, col)
    top, left = int(kept[0].min()), int(kept[1].min())
    h, w = kept.shape[1:]
    rows, cols = grid
    return int((r - top) * rows / h), int((c - left) * cols / w)


def _single(rows: int, cols: int) -> ImageLayout:
    return ImageLayout(torch.arange(rows * cols), grid_cells(rows, cols), [(rows, cols)])


def _assert_within_a_cell(frame: Frame, grid, cell, x: float, y: float) -> None:
    rows, cols = grid
    cx, cy = frame.cell_centre(*cell, grid)
    cw, ch = frame.width / cols, frame.height / rows
    assert abs(cx - x) <= cw and abs(cy - y) <= ch, (frame, cell, (cx, cy), (x, y))


def _make(cls, **settings):
    return cls(**settings)  # the PIL backend here (no torchvision), as AutoProcessor picks


def _points(size: Size, shares=POINTS):
    return [(round(fx * size.width), round(fy * size.height)) for fx, fy in shares]


SINGLE_VIEW = {
    # CLIP-style: shortest edge to 64, then the central 48 x 48 (not the whole short side)
    "clip_crop": dict(
        cls=CLIPImageProcessor, size={"shortest_edge": 64}, crop_size={"height": 48, "width": 48}
    ),
    "pad_to_square": dict(
        cls=LlavaImageProcessor,
        do_pad=True,
        size={"shortest_edge": 48},
        crop_size={"height": 48, "width": 48},
    ),
    "plain_resize": dict(
        cls=CLIPImageProcessor, size={"height": 40, "width": 56}, do_center_crop=False
    ),
}


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("kind", SINGLE_VIEW)
def test_single_view_processors_place_the_planted_peak(kind, shape):
    settings = dict(SINGLE_VIEW[kind])
    ip = _make(settings.pop("cls"), **settings)
    size = SIZES[shape]
    for x, y in _points(size, CENTRAL if kind == "clip_crop" else POINTS):
        pixels = ip(images=_image(size, x, y), return_tensors="np")["pixel_values"][0]
        grid = (pixels.shape[1] // FINE, pixels.shape[2] // FINE)
        cell = _peak(pixels, *grid)
        (frame,) = LLAVA.frames(_single(*grid), size, processor=ip)
        _assert_within_a_cell(frame, grid, cell, x, y)
    if kind == "clip_crop":  # the central region of side crop / scale
        scale = 64 / min(size)
        assert min(frame.width, frame.height) == pytest.approx(48 / scale, abs=0.5)
    if kind == "pad_to_square":  # the frame reaches outside the image
        assert max(frame.width, frame.height) == max(size)
        assert min(frame.x0, frame.y0) < 0


@pytest.mark.parametrize("shape", SIZES)
def test_llava_next_anyres_base_and_composite_views(shape):
    ip = _make(
        LlavaNextImageProcessor,
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=PINPOINTS,
    )
    model = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(image_size=32, patch_size=PATCH),
            image_grid_pinpoints=PINPOINTS,
        )
    )
    size = SIZES[shape]
    for x, y in _points(size):
        pixels = ip(images=_image(size, x, y), return_tensors="np")["pixel_values"][0]
        cells, grids = image_cells(model, [size.height, size.width], anyres=True)
        layout = ImageLayout(torch.arange(cells.shape[0]), cells, grids, image_size=size)
        frames = LLAVA_NEXT.frames(layout, size, processor=ip)
        # base view: patch 0
        _assert_within_a_cell(frames[0], grids[0], _peak(pixels[0], SIDE, SIDE), x, y)
        _assert_within_a_cell(
            frames[1], grids[1], _composite_cell(pixels, size, model, grids[1]), x, y
        )


@pytest.mark.parametrize("shape", SIZES)
def test_llava_onevision_anyres_and_untiled_views(shape):
    ip = _make(
        LlavaOnevisionImageProcessor,
        size={"height": 32, "width": 32},
        image_grid_pinpoints=OV_PINPOINTS,
    )
    model = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(image_size=32, patch_size=PATCH),
            image_grid_pinpoints=OV_PINPOINTS,
            vision_aspect_ratio="anyres_max_2",  # small: the composite is downscaled
        )
    )
    size = SIZES[shape]
    for x, y in _points(size):
        pixels = ip(images=_image(size, x, y), return_tensors="np")["pixel_values"][0]
        cells, _, grids, _ = _anyres_tokens(model, [size.height, size.width])
        layout = ImageLayout(torch.arange(cells.shape[0]), cells, grids, image_size=size)
        frames = LLAVA_ONEVISION.frames(layout, size, processor=ip)
        _assert_within_a_cell(frames[0], grids[0], _peak(pixels[0], SIDE, SIDE), x, y)
        out_h, out_w = grids[1]
        kept = anyres_canvas(model, [size.height, size.width])[0]
        assert out_h * out_w < kept.shape[1] * kept.shape[2]  # downscaled
        _assert_within_a_cell(
            frames[1], grids[1], _composite_cell(pixels, size, model, grids[1]), x, y
        )
        # a prompt with several images: not tiled, padded to a square, one view
        untiled = ip(images=[[_image(size, x, y), _image(size, x, y)]], return_tensors="np")
        single = untiled["pixel_values"][0, 0]
        (frame,) = LLAVA_ONEVISION.frames(_single(SIDE, SIDE), size, processor=ip)
        assert max(frame.width, frame.height) == max(size)
        _assert_within_a_cell(frame, (SIDE, SIDE), _peak(single, SIDE, SIDE), x, y)


@pytest.mark.parametrize("shape", SIZES)
def test_qwen_dynamic_resolution(shape):
    ip = _make(
        Qwen2VLImageProcessor,
        patch_size=PATCH,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 40},
    )
    size = SIZES[shape]
    for x, y in _points(size):
        out = ip(images=_image(size, x, y), return_tensors="np")
        _, gh, gw = out["image_grid_thw"][0].tolist()
        rows, cols = gh // 2, gw // 2
        assert (rows, cols) == geo.smart_resize_grid(size, ip)
        patches = out["pixel_values"].reshape(rows, cols, 2, 2, -1).mean((2, 3, 4))
        cell = np.unravel_index(int(patches.argmax()), patches.shape)
        layout = _single(rows, cols)
        (frame,) = QWEN2_VL.frames(layout, size, processor=ip)
        assert frame == Frame(0.0, 0.0, size.width, size.height)
        _assert_within_a_cell(frame, (rows, cols), cell, x, y)
        geo.check_size(layout, size, image_processor=ip, processor_rule="dynamic")
    with pytest.raises(ValueError, match="swapped"):
        geo.check_size(
            layout, Size(size.height, size.width), image_processor=ip, processor_rule="dynamic"
        )
    with pytest.raises(ValueError, match="swapped"):  # from the grid's aspect alone
        geo.check_size(layout, Size(size.height, size.width), aspect=True)


# --- the frames' own arithmetic -------------------------------------------------------------
def test_rule_frames_cells_and_content_fraction():
    size = Size(80, 45)
    assert geo.rule_frame(size, "resize") == Frame(0.0, 0.0, 80.0, 45.0)
    assert geo.rule_frame(size, "crop") == Frame(17.5, 0.0, 45.0, 45.0)
    assert geo.rule_frame(size, "pad") == Frame(0.0, -17.0, 80.0, 80.0)  # integer paste
    with pytest.raises(ValueError, match="allowed"):
        geo.rule_frame(size, "stretch")
    frame = Frame(10.0, 20.0, 40.0, 30.0)
    rect = frame.cells((3, 4))
    assert rect[1, 2].tolist() == [30.0, 30.0, 40.0, 40.0]  # x_lo, y_lo, x_hi, y_hi
    assert frame.cell_at(35.0, 31.0, (3, 4)) == (1, 2)
    assert frame.cell_at(5.0, 31.0, (3, 4)) is None
    assert frame.cell_centre(1, 2, (3, 4)) == (35.0, 35.0)
    # pad-to-square of a 300 x 90 image: top = 105 px, so row 1 ([75, 150)) is 45/75 covered
    wide = Size(300, 90)
    fraction = geo.content_fraction(geo.rule_frame(wide, "pad"), (4, 4), wide)
    torch.testing.assert_close(fraction[:, 0], torch.tensor([0.0, 0.6, 0.6, 0.0]))
    cover = geo.box_cover(frame, (3, 4), [30, 30, 5, 10])
    assert float(cover[1, 2]) == pytest.approx(0.5) and float(cover.sum()) == pytest.approx(0.5)


def test_one_rectangle_type_checked_in_one_place():
    from vlm_focus.grounding import Box, iou

    rect = Frame(10, 20, 40, 30)
    assert (rect.x1, rect.y1, rect.area) == (50, 50, 1200)
    assert rect.xywh == [10, 20, 40, 30] and rect.xyxy == (10, 20, 50, 50)
    assert rect.contains(50, 20) and not rect.contains(50.5, 20)
    assert rect.covers([10, 20, 40, 30]) and not rect.covers(Frame(9, 20, 2, 2))
    assert Frame(0, 0, 64, 48).is_whole(Size(64, 48)) and not rect.is_whole(Size(64, 48))
    assert geo.as_frame(torch.tensor([10.0, 20.0, 40.0, 30.0])) == rect
    assert geo.as_frame(np.array([10, 20, 40, 30])) == rect
    # a grounding box is a frame with a score, validated by the frame's own constructor
    box = Box(10, 20, 40, 30, 0.5)
    assert isinstance(box, Frame) and geo.as_frame(box) is box and box.xyxy == rect.xyxy
    assert box != rect and iou(box, [30, 20, 40, 30]) == pytest.approx(600 / 1800)
    with pytest.raises(ValueError, match="width=-1"):
        Frame(0, 0, -1, 2)
    with pytest.raises(ValueError, match="must be >= 0"):
        Box(0, 0, 1, -2, 0.5)
    with pytest.raises(ValueError, match="x0=nan"):
        Frame(float("nan"), 0, 1, 1)
    with pytest.raises(TypeError, match="y0=True"):
        Frame(0, True, 1, 1)
    with pytest.raises(TypeError, match=r"box must be \[x, y, w, h\]"):
        geo.as_frame((1, 2, 3))
    with pytest.raises(ValueError, match=r"crop=\[0, 0, 1, -1\]: .*height=-1"):
        geo.as_frame([0, 0, 1, -1], name="crop")


def test_upsampled_density_sits_on_its_cell():
    size = Size(80, 45)
    for rule in geo.RULES:
        frame = geo.rule_frame(size, rule)
        grid = torch.zeros(3, 4)
        grid[1, 2] = 1.0
        density = geo.upsample(grid, size, frame)
        assert density.shape == (45, 80)
        y, x = divmod(int(density.argmax()), 80)
        assert frame.cell_at(x + 0.5, y + 0.5, (3, 4)) == (1, 2)
        if rule != "pad":  # the frame lies inside the image: the mass is all there
            assert float(density.sum()) == pytest.approx(1.0, rel=0.03)
    crop = geo.upsample(grid, size, geo.rule_frame(size, "crop"))
    assert float(crop[:, :17].abs().sum()) == 0.0 and float(crop[:, 63:].abs().sum()) == 0.0


# --- sizes ----------------------------------------------------------------------------------
def test_sizes_are_named_and_ambiguous_ones_refused():
    image = Image.new("RGB", (64, 48))
    assert geo.as_size(image) == Size(64, 48)
    assert geo.as_size({"width": 64, "height": 48}) == Size(width=64, height=48)
    assert geo.as_size(np.zeros((48, 64, 3), np.uint8)) == Size(64, 48)
    with pytest.raises(TypeError, match=r"\(640, 480\) is ambiguous"):
        geo.as_size((640, 480))
    with pytest.raises(ValueError, match="height=0"):
        geo.as_size({"width": 4, "height": 0})
    with pytest.raises(ValueError, match="exactly 'width' and 'height'"):
        geo.as_size({"w": 4, "h": 3})
    assert not hasattr(geo, "legacy_sizes")
    with pytest.raises(TypeError, match=r"Size\(width, height\)"):
        ImageLayout(torch.arange(4), grid_cells(2, 2), [(2, 2)], image_size=(48, 64))


def test_layout_sizes_check_the_processors_own():
    known = ImageLayout(torch.arange(4), grid_cells(2, 2), [(2, 2)], image_size=Size(70, 40))
    unknown = _single(2, 2)
    layouts = [[known], [unknown]]
    assert geo.layout_sizes(layouts, None) == [[Size(70, 40)], [None]]
    assert geo.layout_sizes(layouts, [Size(70, 40), Size(5, 6)]) == [[Size(70, 40)], [Size(5, 6)]]
    with pytest.raises(ValueError, match="swapped"):
        geo.layout_sizes(layouts, Size(40, 70))
    with pytest.raises(ValueError, match="contradicts"):
        geo.layout_sizes(layouts, Size(41, 70))
    with pytest.raises(ValueError, match="3 image sizes for 2 rows"):
        geo.layout_sizes(layouts, [Size(1, 1)] * 3)


def test_the_fallback_without_a_processor_is_the_adapters():
    size = Size(90, 60)
    fallback = LLAVA.fallback_geometry[0]
    assert geo.view_frames(_single(4, 4), size, fallback=fallback) == [Frame(15.0, 0.0, 60, 60)]
    untiled = LLAVA_ONEVISION.fallback_geometry[1]
    assert geo.view_frames(_single(4, 4), size, fallback=untiled) == [geo.rule_frame(size, "pad")]
    assert math.isclose(geo.rule_frame(size, "pad").y0, -15.0)


# --- the organism end to end: widened scenes point as the square ones do -------------------
N_SCENES = 20


def _widen(scene, shape: str) -> tuple[np.ndarray, tuple[int, int]]:
    """The scene padded with its background to 1.5:1 ("wide") or 1:1.5 ("tall"), and the
    offset of the original scene inside it."""
    img = scene.image()
    h, w = img.shape[:2]
    if shape == "square":
        return img, (0, 0)
    width, height = (w * 3 // 2, h) if shape == "wide" else (w, h * 3 // 2)
    out = np.empty((height, width, 3), np.uint8)
    out[:] = scene.background
    x0, y0 = (width - w) // 2, (height - h) // 2
    out[y0 : y0 + h, x0 : x0 + w] = img
    return out, (x0, y0)


@pytest.fixture(scope="module")
def organism():
    from vlm_focus.loading import load_model
    from vlm_focus.organism.scenes import heldout_scenes

    model, processor = load_model()  # the embedded organism-default (CLIP-style centre crop)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small forwards: one thread is fastest on a shared machine
    yield model, processor, heldout_scenes(N_SCENES, min_objects=3)
    torch.set_num_threads(threads)


def test_pointing_game_on_widened_scenes_through_ground(organism):
    import vlm_focus as vf

    model, processor, scenes = organism
    rates = {}
    for shape in ("square", "wide", "tall"):
        hits = []
        for scene in scenes:
            image, (x0, y0) = _widen(scene, shape)
            for obj in scene.objects:
                found = vf.ground(model, processor, image, obj.name)
                assert found.map.size == Size(image.shape[1], image.shape[0])
                x, y, w, h = obj.box(scene.size)
                px, py = vf.grounding.point(found.map)  # the pointing game reads the peak
                hits.append(x0 + x <= px <= x0 + x + w and y0 + y <= py <= y0 + y + h)
        rates[shape] = sum(hits) / len(hits)
    print("pointing through vf.ground (layer 0):", rates)
    assert rates["square"] > 0.6  # the organism's layer-0 maps point (0.81 on 100 scenes)
    assert abs(rates["wide"] - rates["square"]) <= 0.05
    assert abs(rates["tall"] - rates["square"]) <= 0.05


def _write_set(scenes, shape: str, folder) -> None:
    import json

    from vlm_focus.organism.scenes import coco_instances

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"scene_{s.seed}.png" for s in scenes]
    instances = coco_instances(scenes, names)
    offsets = {}
    for scene, name, entry in zip(scenes, names, instances["images"], strict=True):
        image, offsets[scene.seed] = _widen(scene, shape)
        Image.fromarray(image).save(folder / name)
        entry["width"], entry["height"] = image.shape[1], image.shape[0]
    for ann in instances["annotations"]:
        x0, y0 = offsets[ann["image_id"]]
        ann["bbox"] = [ann["bbox"][0] + x0, ann["bbox"][1] + y0, *ann["bbox"][2:]]
        ann.pop("segmentation")  # box AP and the pointing game read the boxes
    (folder / "instances.json").write_text(json.dumps(instances))


def test_pointing_game_on_widened_scenes_through_eval_coco(organism, tmp_path):
    import json

    from vlm_focus.eval.cli import main

    _, _, scenes = organism
    summaries = {}
    for shape in ("square", "wide", "tall"):
        data = tmp_path / shape
        _write_set(scenes, shape, data)
        args = ["coco", "--images", str(data), "--instances", str(data / "instances.json")]
        args += ["--out", str(tmp_path / f"out-{shape}"), "--absent", "0", "--layers", "0"]
        assert main([*args, "--threads", "1", "--batch-size", "8"]) == 0
        (path,) = (tmp_path / f"out-{shape}").rglob("summary.json")
        summaries[shape] = json.loads(path.read_text())
    print("eval coco (layer 0):", {k: (v["pointing"], v["AP50"]) for k, v in summaries.items()})
    square = summaries["square"]
    assert square["pointing"] > 0.6 and square["n_images"] == N_SCENES
    for shape in ("wide", "tall"):
        assert abs(summaries[shape]["pointing"] - square["pointing"]) <= 0.05
        assert abs(summaries[shape]["AP50"] - square["AP50"]) <= 0.05
