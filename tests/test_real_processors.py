"""The real transformers processors (``tiny_processors.py``) feed the tiny model of every
supported class: images of several sizes and aspect ratios, several images in one prompt (also
back to back, as a prompt written by hand may put them), videos of several frame counts
(Qwen3-VL's split into per-frame runs by the timestamps its processor writes), an image and a
video together, all in left-padded batches of 2, most built by ``apply_chat_template``.

For each input, the adapter's layout matches the processor's placeholders (one layout per image
or video, as many tokens as the processor wrote for it), and a pruned run equals the unpruned
model with the pruned visual keys masked out (``reference.py``), in prefill and cached decode,
pruning before the first layer and after two (SDPA; eager on two classes).

Then the geometry: on a picture whose colours encode its own pixel coordinates, every grid cell
placed by ``vlm_focus.geometry.view_frames`` reads the pixels the processor put there, and the
geometry's own arithmetic (``smart_resize_grid``, ``best_resolution``, ``check_size``) gives
what the processors did.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from reference import assert_pruned_equals_masked
from tiny_processors import (
    KINDS,
    PLACEHOLDERS,
    VIDEO_KINDS,
    noise_image,
    noise_video,
    ramp_image,
    ramp_video,
    tiny_processor,
)
from transformers.image_processing_utils import select_best_resolution

from vlm_focus import geometry as geo
from vlm_focus.geometry import Size
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.base import runs
from vlm_focus.model_adapters.llava_next import anyres_canvas
from vlm_focus.model_adapters.tiny import IMAGE, VIDEO, VISION_END, VISION_START, tiny_model

STEPS = 4  # cached decode steps after the prefill
# wide and tall pick different anyres crop grids; large tiles LLaVA-OneVision 4 x 4 (its grid is
# downscaled) and sends Qwen past its pixel budget; small sends Qwen below it
SIZES = {
    "wide": Size(45, 30),
    "tall": Size(30, 61),
    "large": Size(120, 128),
    "small": Size(17, 12),
}
FRAME = Size(60, 44)  # a video frame
#: frames per row of the video cases; LLaVA-OneVision's processor stacks a batch's videos, so
#: its rows share a count
VIDEO_FRAMES = {
    "llava_onevision": [(2, 2), (3, 3)],
    "qwen2_vl": [(2, 3)],
    "qwen2_5_vl": [(4, 2)],
    "qwen3_vl": [(4, 7)],
}
VIDEO_FPS = 2.0


# --- prompts through the processor ------------------------------------------------------------
def _message(items: list) -> list[dict]:
    """One user turn: PIL images, ``[T, H, W, 3]`` videos and text, in order."""
    content = []
    for item in items:
        if isinstance(item, str):
            content.append({"type": "text", "text": item})
        elif isinstance(item, np.ndarray):
            content.append({"type": "video", "video": item})
        else:
            content.append({"type": "image", "image": item})
    return [{"role": "user", "content": content}]


def _split_offsets(out) -> tuple[dict, list[list[dict]]]:
    inputs = dict(out)
    return inputs, inputs.pop("text_replacement_offsets")


def _apply(processor, rows: list[list]) -> tuple[dict, list[list[dict]]]:
    """The processor's model inputs for a batch of one-turn chats (left-padded), and per row
    the placeholders it expanded, in order (``type`` and ``replacement`` text)."""
    videos = [item for row in rows for item in row if isinstance(item, np.ndarray)]
    # the videos' sampling rate: the frames' timestamps (Qwen3-VL) and time steps come from it
    metadata = [{"total_num_frames": len(v), "fps": VIDEO_FPS} for v in videos]
    out = processor.apply_chat_template(
        [_message(row) for row in rows],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs=dict(
            padding=True,
            return_text_replacement_offsets=True,
            **({"video_metadata": metadata} if videos else {}),
        ),
    )
    return _split_offsets(out)


def _back_to_back(processor, kind, images: list[list]) -> tuple[dict, list[list[dict]]]:
    """As :func:`_apply`, for prompts written by hand with each row's images back to back, no
    text between them (Qwen's each in its own vision block)."""
    placeholder = PLACEHOLDERS[kind][0]
    texts = [placeholder * len(row) + " describe" for row in images]
    out = processor(
        text=texts,
        images=images,
        padding=True,
        return_tensors="pt",
        return_text_replacement_offsets=True,
    )
    return _split_offsets(out)


def _case_inputs(processor, kind: str, case: str, frames: tuple[int, ...] | None):
    image = {name: noise_image(*size, seed=i) for i, (name, size) in enumerate(SIZES.items())}
    if case == "images":
        rows = [[image["wide"], "describe the image"], [image["tall"], "what is in this image ?"]]
    elif case == "two_images":
        rows = [
            [image["large"], image["wide"], "compare these two"],
            [image["tall"], "describe the image"],
        ]
    elif case == "back_to_back":
        return _back_to_back(processor, kind, [[image["wide"], image["tall"]], [image["small"]]])
    elif case == "video":
        video = [noise_video(n, *FRAME, seed=10 + i) for i, n in enumerate(frames)]
        rows = [[video[0], "describe the video"], [video[1], "what is in this video ?"]]
    elif case == "image_and_video":
        video = [noise_video(n, *FRAME, seed=10 + i) for i, n in enumerate(frames)]
        rows = [
            [image["wide"], video[0], "compare these two"],
            [video[1], image["small"], "what is in this video ?"],
        ]
    else:
        raise ValueError(f"no case {case!r}")
    return _apply(processor, rows)


def _cases():
    for kind in KINDS:
        yield kind, "images", None
        yield kind, "two_images", None
        yield kind, "back_to_back", None
    for kind in VIDEO_KINDS:
        for frames in VIDEO_FRAMES[kind]:
            yield kind, "video", frames
        yield kind, "image_and_video", VIDEO_FRAMES[kind][0]


def _case_id(case) -> str:
    kind, name, frames = case
    return f"{kind}-{name}" + ("" if frames is None else "-" + "+".join(map(str, frames)))


CASES = list(_cases())


# --- what the processor wrote ------------------------------------------------------------------
def _placeholder_tokens(processor, replacement: dict) -> tuple[str, int]:
    """(kind, visual tokens) of one expanded placeholder."""
    kind = replacement["type"]
    # the tiny vocabulary's visual token (Gemma 3's processor names its <start_of_image>
    # marker `image_token`, and expands it to soft tokens)
    token = processor.tokenizer.convert_ids_to_tokens(IMAGE if kind == "image" else VIDEO)
    return kind, replacement["replacement"].count(token)


def _assert_layout_matches_processor(model, processor, inputs, replacements) -> None:
    """One layout per placeholder, in prompt order, of the processor's kind and token count;
    together they hold exactly the row's visual tokens."""
    layouts = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    visual = (inputs["input_ids"] == IMAGE) | (inputs["input_ids"] == VIDEO)
    for b, (row, wrote) in enumerate(zip(layouts, replacements, strict=True)):
        got = [(layout.kind, layout.positions.numel()) for layout in row]
        assert got == [_placeholder_tokens(processor, r) for r in wrote], f"row {b}"
        positions = torch.cat([layout.positions for layout in row])
        assert torch.equal(positions.sort().values, torch.nonzero(visual[b]).flatten())


_TIMESTAMP = re.compile(r"<\s*(\d+)\s*\.\s*(\d)\s*seconds\s*>\s*$")


def _assert_timestamped_frames(processor, inputs) -> None:
    """Qwen3-VL: each row's video tokens come in one run per temporal group, each run right
    between ``<vision_start>`` and ``<vision_end>`` with a ``<t seconds>`` timestamp before it,
    the times rising."""
    merge = processor.video_processor.merge_size
    ids = inputs["input_ids"]
    for b, (t, h, w) in enumerate(inputs["video_grid_thw"].tolist()):  # one video per row
        video_runs = runs(torch.nonzero(ids[b] == VIDEO).flatten())
        assert [r.numel() for r in video_runs] == [h * w // merge**2] * t
        times, after_last = [], 0
        for run in video_runs:
            start, end = int(run[0]), int(run[-1])
            assert ids[b, start - 1] == VISION_START and ids[b, end + 1] == VISION_END
            before = processor.tokenizer.decode(ids[b, after_last : start - 1])
            stamp = _TIMESTAMP.search(before)
            assert stamp is not None, before
            times.append(float(f"{stamp[1]}.{stamp[2]}"))
            after_last = end + 2
        assert times == sorted(set(times)), times


# --- the pruned run against the masked reference -----------------------------------------------
def _assert_pruned_equals_masked(model, inputs, layer: int, keep: float = 0.5) -> None:
    trace = assert_pruned_equals_masked(
        model, inputs, STEPS, pruner="fastv", keep=keep, layer=layer, video_pruner=None
    )
    assert [s.layer for s in trace.stages] == [layer]


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_processor_inputs_prune_as_the_masked_reference(case, layer):
    kind, name, frames = case
    model = tiny_model(kind)
    processor = tiny_processor(model)
    inputs, replacements = _case_inputs(processor, kind, name, frames)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # left padding
    _assert_layout_matches_processor(model, processor, inputs, replacements)
    if kind == "qwen3_vl" and "video" in name:
        _assert_timestamped_frames(processor, inputs)
    _assert_pruned_equals_masked(model, inputs, layer)


@pytest.mark.parametrize("kind", ["llava_next", "qwen3_vl"])
def test_processor_inputs_prune_as_the_masked_reference_eager(kind):
    model = tiny_model(kind, attn="eager")
    processor = tiny_processor(model)
    name, frames = ("video", VIDEO_FRAMES[kind][0]) if kind in VIDEO_KINDS else ("images", None)
    inputs, _ = _case_inputs(processor, kind, name, frames)
    _assert_pruned_equals_masked(model, inputs, 2)


# --- geometry against the processors' pixels ---------------------------------------------------
def _to_255(values: torch.Tensor, part) -> torch.Tensor:
    """``[..., C]`` values the processor normalised, back to the picture's 0..255 scale."""
    return (values * torch.tensor(part.image_std) + torch.tensor(part.image_mean)) * 255


def _block(pixels: torch.Tensor, rows: int, cols: int, row: int, col: int) -> torch.Tensor:
    """``[C]`` mean of cell ``(row, col)`` of a ``[C, H, W]`` picture cut into rows x cols."""
    height, width = pixels.shape[-2:]
    ys = slice(row * height // rows, (row + 1) * height // rows)
    xs = slice(col * width // cols, (col + 1) * width // cols)
    return pixels[:, ys, xs].mean((1, 2))


def _crop_colours(model, crops: torch.Tensor, layout) -> torch.Tensor:
    """LLaVA family: ``[n, C]`` mean of the encoder patch each token reads (its ``(crop,
    patch)``) in the ``[crops, C, H, W]`` pixels; NaN for tokens with no patch (newlines)."""
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    colours = torch.full((layout.positions.numel(), crops.shape[1]), float("nan"))
    for i, (crop, patch) in enumerate(layout.patches.tolist()):
        if crop >= 0:
            colours[i] = _block(crops[crop], side, side, *divmod(patch, side))
    return colours


def _frame_colours(frames: torch.Tensor, layout) -> torch.Tensor:
    """LLaVA-OneVision video: ``[n, C]`` mean of the part of its frame each pooled cell
    covers, the ``[frames, C, H, W]`` frame cut evenly into the view's grid."""
    colours = torch.full((layout.positions.numel(), frames.shape[1]), float("nan"))
    for i, (view, row, col) in enumerate(layout.cells.tolist()):
        if row >= 0:
            colours[i] = _block(frames[view], *layout.grids[view], row, col)
    return colours


def _merged_colours(model, patches: torch.Tensor) -> torch.Tensor:
    """Qwen: ``[n, C]`` mean of each merged token's patches. The processor lays the flattened
    ``(C, T, p, p)`` patches out merge block by merge block, in the model's token order."""
    vision = model.config.vision_config
    per_channel = patches.shape[1] // vision.in_channels  # T * p * p
    blocks = patches.reshape(-1, vision.spatial_merge_size**2, vision.in_channels, per_channel)
    return blocks.mean((1, 3))  # [tokens, C]


def _item_colours(model, processor, inputs, layouts) -> list[torch.Tensor]:
    """Per layout of a one-row batch, ``[n, C]``: the 0..255 colour of the pixels each of its
    tokens reads, taking the processor's images and videos in order."""
    taken = {"image": 0, "video": 0}  # items (LLaVA family) or merged tokens (Qwen) so far
    out = []
    for layout in layouts:
        video = layout.kind == "video"
        part = processor.video_processor if video else processor.image_processor
        pixels = inputs["pixel_values_videos" if video else "pixel_values"]
        n = layout.positions.numel()
        if pixels.dim() == 2:  # Qwen: [patches, C * T * p * p]
            first = taken[layout.kind]
            colours = _merged_colours(model, pixels)[first : first + n]
            taken[layout.kind] += n
        elif model.config.model_type == "internvl":  # [tiles, C, H, W], every image's tiles
            first = taken[layout.kind]
            colours = _frame_colours(pixels[first : first + len(layout.grids)], layout)
            taken[layout.kind] += len(layout.grids)
        else:
            item = pixels[taken[layout.kind]]  # [crops or frames, C, H, W]; LLaVA: [C, H, W]
            taken[layout.kind] += 1
            if video:
                colours = _frame_colours(item, layout)
            elif layout.patches is None:  # pooled tokens (Gemma 3): each reads its grid cell
                colours = _frame_colours(item[None], layout)
            else:
                colours = _crop_colours(model, item if item.dim() == 4 else item[None], layout)
        out.append(_to_255(colours, part))
    return out


def _resampled(model, layout, view: int, size: Size) -> bool:
    """Whether the view's grid is resampled from the encoder's patches (LLaVA-OneVision's
    downscaled anyres grid), so that a cell reads the patch under its centre."""
    if layout.kind != "image" or view == 0 or not hasattr(model.config, "image_grid_pinpoints"):
        return False
    canvas, _, _ = anyres_canvas(model, [size.height, size.width])
    return tuple(canvas.shape[1:]) != tuple(layout.grids[view])


def _assert_cells_read_their_pixels(model, processor, layout, size: Size, colours) -> None:
    """Every cell inside the image reads pixels whose ramp colour decodes to a point in that
    cell, at its centre (to 5% of a cell) unless the view is resampled."""
    frames = get_adapter(model).frames(layout, size, processor=processor)
    x = colours[:, 0] / 255 * size.width  # the ramp's red: the original x, in pixels
    y = colours[:, 1] / 255 * size.height
    for view, (frame, grid) in enumerate(zip(frames, layout.grids, strict=True)):
        inside = geo.content_fraction(frame, grid, size) == 1
        exact = not _resampled(model, layout, view, size)
        cell_w, cell_h = frame.width / grid[1], frame.height / grid[0]
        checked = 0
        for i in torch.nonzero(layout.cells[:, 0] == view).flatten().tolist():
            _, row, col = layout.cells[i].tolist()
            if row < 0 or not inside[row, col]:
                continue
            where = f"{layout.kind} view {view} cell {(row, col)} of {grid} on {size}: {frame}"
            assert frame.cell_at(float(x[i]), float(y[i]), grid) == (row, col), where
            if exact:
                cx, cy = frame.cell_centre(row, col, grid)
                assert abs(x[i] - cx) <= 0.05 * cell_w and abs(y[i] - cy) <= 0.05 * cell_h, where
            checked += 1
        assert 0 < checked == int(inside.sum()), f"view {view}: {checked} cells checked"


def _geometry_prompts(kind: str) -> list[list]:
    """One image of every size; two in one prompt (LLaVA-OneVision then pads each to a square
    instead of tiling it); a video where the class takes one."""
    prompts = [[ramp_image(*size)] for size in SIZES.values()]
    prompts.append([ramp_image(*SIZES["wide"]), ramp_image(*SIZES["tall"])])
    if kind in VIDEO_KINDS:
        prompts.append([ramp_video(3, *FRAME)])
    return prompts


def _item_size(item) -> Size:
    return Size(item.shape[2], item.shape[1]) if isinstance(item, np.ndarray) else geo.as_size(item)


@pytest.mark.parametrize("kind", KINDS)
def test_view_frames_sit_where_the_processor_put_the_pixels(kind):
    model = tiny_model(kind)
    processor = tiny_processor(model)
    for items in _geometry_prompts(kind):
        inputs, _ = _apply(processor, [[*items, "describe"]])
        (layouts,) = get_adapter(model).layout(model, inputs["input_ids"], inputs)
        colours = _item_colours(model, processor, inputs, layouts)
        for layout, item, item_colours in zip(layouts, items, colours, strict=True):
            _assert_cells_read_their_pixels(
                model, processor, layout, _item_size(item), item_colours
            )


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_smart_resize_grid_is_the_processors(kind):
    model = tiny_model(kind)
    processor = tiny_processor(model)
    image_processor = processor.image_processor
    merge = image_processor.merge_size
    for size in SIZES.values():  # rounding only, above the budget (large), below it (small)
        inputs = processor(
            images=[ramp_image(*size)], text=[PLACEHOLDERS[kind][0]], return_tensors="pt"
        )
        _, rows, cols = (inputs["image_grid_thw"][0] // torch.tensor([1, merge, merge])).tolist()
        assert geo.smart_resize_grid(size, image_processor) == (rows, cols), size
        ((layout,),) = get_adapter(model).layout(model, inputs["input_ids"], inputs)
        geo.check_size(layout, size, image_processor=image_processor, processor_rule="dynamic")
        if rows != cols:
            with pytest.raises(ValueError, match="swapped"):
                geo.check_size(
                    layout,
                    Size(size.height, size.width),
                    image_processor=image_processor,
                    processor_rule="dynamic",
                )


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_anyres_resolution_and_crops_are_the_processors(kind):
    model = tiny_model(kind)
    processor = tiny_processor(model)
    pinpoints = processor.image_processor.image_grid_pinpoints
    crop = model.config.vision_config.image_size
    for size in SIZES.values():
        inputs, _ = _apply(processor, [[ramp_image(*size), "describe"]])
        best = geo.best_resolution(size, pinpoints)
        assert best == tuple(select_best_resolution((size.height, size.width), pinpoints))
        ((layout,),) = get_adapter(model).layout(model, inputs["input_ids"], inputs)
        crops = 1 + (best[0] // crop) * (best[1] // crop)  # the base image, then the tiles
        assert inputs["pixel_values"].shape[1] == layout.n_crops == crops
