"""Gemma 4 (``gemma4``): one block of variable size per image, grid read from the patch positions.

The vision tower takes each image at its own aspect ratio (patches with 2-D positions, a 2-D
RoPE) and average-pools ``pooling_kernel_size`` x ``pooling_kernel_size`` patches into one
token, so each image gives its own ``rows x cols`` grid, in row-major order. The processor's
``image_position_ids`` (``[n_images, max_patches, 2]``, ``(x, y)`` per patch, ``-1`` for
padding) give the grid: ``cols = (max x + 1) / k``, ``rows = (max y + 1) / k``. The prompt holds
each image as ``<boi>`` + its tokens + ``<eoi>``.

What differs from Gemma 3, and where the core reads it:

* the prefill mask (``use_bidirectional_attention="vision"``, with ``mm_token_type_ids``) lets an
  image block's tokens see each other both ways on the sliding-window layers only; the
  full-attention layers stay causal: ``mask_rule="window_image_blocks"``;
* per-head q/k norms (``q_norm``, ``k_norm``) and an attention scale of 1 (the module's own
  ``scaling``); full-attention layers have their own head size and a partial ("proportional")
  RoPE, both carried by the module and the cos/sin the decoder hands it;
* per-layer embeddings (``hidden_size_per_layer_input``, E2B/E4B): each layer adds a per-token
  input of its own, laid out on the full prompt; :func:`per_layer_input_hooks` gathers the rows
  of the tokens the layer holds;
* KV-shared layers (``num_kv_shared_layers``, E2B/E4B): from ``num_hidden_layers -
  num_kv_shared_layers`` on, a layer attends to the keys and values that the last earlier layer
  of its type (sliding or full) computed in the same call, and holds no cache
  (:meth:`Gemma4Adapter.key_source`). Pruning is exact when that source layer holds the kept
  set, that is when every stage is at or before the first source layer; a stage after it
  would leave the shared layers reading keys the masked reference drops, so it is refused
  (:meth:`Gemma4Adapter.check`). Before its shared layers the decoder keeps only the rows
  ``generate()`` needs (the last), which the core follows.

A video is ``<timestamp> <boi>`` + one frame's tokens + ``<eoi>`` per frame, each frame a block
of its own (both ways on the sliding-window layers, as an image block): one layout per video,
a view per frame, grids from ``video_position_ids`` split by ``num_frames_per_video``.

Configurations the adapter refuses: ``use_bidirectional_attention`` other than ``"vision"``
(``"all"`` makes text bidirectional too, ``None`` keeps images causal; the released checkpoints
set ``"vision"``), as the mask rule above would not describe them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import ImageLayout, ModelAdapter, grid_cells, has_video, rows_per_prompt, runs


@dataclass(frozen=True)
class Gemma4Adapter(ModelAdapter):
    """A decoder whose last layers may reuse an earlier layer's keys and values."""

    def key_source(self, model: nn.Module, index: int) -> int:
        text = model.config.get_text_config()
        first_shared = text.num_hidden_layers - text.num_kv_shared_layers
        if index < first_shared:
            return index
        kind = text.layer_types[index]
        # the last layer of the same type before the shared ones (the model's "store" layer)
        return max(i for i in range(first_shared) if text.layer_types[i] == kind)

    def source_layers(self, model: nn.Module) -> list[int]:
        """The layers whose keys and values the KV-shared layers reuse (empty without any)."""
        n_layers = model.config.get_text_config().num_hidden_layers
        sources = (self.key_source(model, i) for i in range(n_layers))
        return sorted({j for i, j in enumerate(sources) if j != i})

    def check(self, model: nn.Module, stages: Sequence[int]) -> None:
        text = model.config.get_text_config()
        mode = getattr(text, "use_bidirectional_attention", None)
        if mode != "vision":
            raise ValueError(
                f"gemma4 with use_bidirectional_attention={mode!r}: vlm_focus reads the mask "
                "rule of 'vision' (image blocks both ways on the sliding-window layers, causal "
                "elsewhere), as the released checkpoints set it"
            )
        sources = self.source_layers(model)
        late = [k for k in stages if sources and k > sources[0]]
        if late:
            raise ValueError(
                f"layer={late[0]}: this Gemma 4 reuses the keys and values of layers {sources} "
                f"in its last {text.num_kv_shared_layers} layers, so a pruning stage must be at "
                f"or before layer {sources[0]} (the shared layers then read only kept keys)"
            )


def per_layer_input_hooks(
    model: nn.Module, tokens_after: Callable[[int], torch.Tensor | None]
) -> list:
    """Pre-hooks (after the engine's) that gather each decoder layer's per-layer input
    (``[B, S, P]``, its second argument) to the rows of the tokens the layer holds."""
    if not model.config.get_text_config().hidden_size_per_layer_input:
        return []

    def follow(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            hidden = args[0] if args else kwargs["hidden_states"]
            if len(args) > 1:
                extra = args[1]
            else:
                extra = kwargs.get("per_layer_input")
            if extra is None or extra.shape[1] == hidden.shape[1]:
                return None  # every token, one decode step, or the decoder's own last rows
            positions = tokens_after(index)
            if positions is None:
                return None
            positions = positions.to(extra.device)
            extra = extra.expand(positions.shape[0], -1, -1)
            extra = extra.gather(1, positions[..., None].expand(-1, -1, extra.shape[-1]))
            if len(args) > 1:
                return (args[0], extra, *args[2:]), kwargs
            return args, {**kwargs, "per_layer_input": extra}

        return hook

    layers = GEMMA4.decoder_layers(model)
    return [
        layer.register_forward_pre_hook(follow(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]


def _grids(model: nn.Module, positions: Any) -> list[tuple[int, int]]:
    """``(rows, cols)`` of each image's (or video frame's) pooled grid, from its patch positions
    (``[n, max_patches, 2]``, ``(x, y)`` per patch, ``-1`` for padding)."""
    k = model.config.vision_config.pooling_kernel_size
    grids = []
    for xy in torch.as_tensor(positions).cpu():  # [max_patches, 2], (x, y)
        xy = xy[(xy != -1).all(-1)]
        cols, rows = ((xy.max(0).values + 1) // k).tolist()
        grids.append((rows, cols))
    return grids


def _videos(model: nn.Module, inputs: Mapping[str, Any]) -> list[list[tuple[int, int]]]:
    """Each video's frame grids, from ``video_position_ids`` (every video's frames
    concatenated) split by ``num_frames_per_video``."""
    positions, frames = inputs.get("video_position_ids"), inputs.get("num_frames_per_video")
    if positions is None or frames is None:
        raise ValueError(
            "gemma4 needs video_position_ids and num_frames_per_video with a video (pass the "
            "processor's output)"
        )
    grids = _grids(model, positions)
    counts = [int(n) for n in torch.as_tensor(frames).reshape(-1).tolist()]
    if sum(counts) != len(grids):
        raise ValueError(
            f"gemma4: num_frames_per_video sums to {sum(counts)} frames but "
            f"video_position_ids holds {len(grids)}"
        )
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [grids[s : s + n] for s, n in zip(starts, counts, strict=True)]


def _block_grids(kind: str, blocks: list[torch.Tensor], grids: list) -> list[ImageLayout]:
    """One layout per image (``grids``: one grid per block) or per video (``grids``: a list of
    frame grids per video, each frame its own block), checked against the blocks' sizes."""
    if kind == "image":
        grids = [[g] for g in grids]
    sizes = [[r * c for r, c in frames] for frames in grids]
    if [n.numel() for n in blocks] != [n for frames in sizes for n in frames]:
        raise ValueError(
            f"{kind} blocks of {[n.numel() for n in blocks]} tokens, but the {kind} position ids "
            f"give grids of {sizes}; input_ids and the {kind} inputs disagree"
        )
    layouts, next_block = [], 0
    for frames in grids:
        own = blocks[next_block : next_block + len(frames)]
        next_block += len(frames)
        cells = [grid_cells(r, c, view=v) for v, (r, c) in enumerate(frames)]
        layouts.append(ImageLayout(torch.cat(own), torch.cat(cells), list(frames), kind=kind))
    return layouts


def gemma4_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    """Each row's image blocks take the grids of ``image_position_ids`` in order, across the
    batch, and its video frames (a block each) those of ``video_position_ids``, video by video
    (``generate()``'s repeated rows share their prompt's grids)."""
    image_id, video_id = GEMMA4.token_ids(model)
    ids = input_ids.cpu()  # one copy to the host for all rows
    reads_video = has_video(inputs)
    videos = _videos(model, inputs) if reads_video and bool((ids == video_id).any()) else []
    images = []
    if bool((ids == image_id).any()):
        if inputs.get("image_position_ids") is None:
            raise ValueError("gemma4 needs image_position_ids (pass the processor's output)")
        images = _grids(model, inputs["image_position_ids"])
    described = sum(r * c for r, c in images) + sum(r * c for v in videos for r, c in v)
    visual = GEMMA4.visual_mask(model, ids, inputs)
    batch = visual.shape[0]
    repeat = rows_per_prompt(
        int(visual.sum()), described, batch, "visual tokens", "image and video position ids"
    )
    layouts: list[list[ImageLayout]] = []
    next_image = next_video = 0
    for b in range(batch):
        if b % repeat:
            layouts.append(layouts[-1])
            continue
        image_blocks = runs(torch.nonzero(ids[b] == image_id).flatten())
        row_images = images[next_image : next_image + len(image_blocks)]
        next_image += len(image_blocks)
        frame_blocks = runs(torch.nonzero(visual[b] & (ids[b] == video_id)).flatten())
        row_videos, n_frames = [], 0
        while n_frames < len(frame_blocks) and next_video < len(videos):
            row_videos.append(videos[next_video])
            n_frames += len(videos[next_video])
            next_video += 1
        try:
            if len(row_images) != len(image_blocks):
                raise ValueError(f"{len(image_blocks)} image blocks, {len(row_images)} grids")
            row = _block_grids("image", image_blocks, row_images)
            row += _block_grids("video", frame_blocks, row_videos)
        except ValueError as error:
            raise ValueError(f"gemma4 row {b}: {error}") from None
        layouts.append(sorted(row, key=lambda layout: int(layout.positions[0])))
    return layouts


GEMMA4 = Gemma4Adapter(
    model_type="gemma4",
    layout=gemma4_layout,
    image_token_attrs=("image_token_id",),
    video=True,
    video_token_attrs=("video_token_id",),
    pixel_inputs=("pixel_values", "pixel_values_videos"),
    # without them the model's own prefill mask is causal over the image blocks
    required_with_images=("mm_token_type_ids",),
    # generate() hands the patch positions to the image and video encoders, not to forward
    layout_inputs=("image_position_ids", "video_position_ids", "num_frames_per_video"),
    encoders=("get_image_features", "get_video_features"),
    vision_layers=None,  # no CLS token
    fallback_geometry={0: ("resize",)},  # an aspect-preserving resize, no crop or pad
    mask_rule="window_image_blocks",
    attention_window="sliding_window",
    qk_norms=("q_norm", "k_norm"),
    sequence_hooks=per_layer_input_hooks,
    visual_marker_attrs=("boi_token_id", "eoi_token_id"),
    multi_image_views=True,
    # its windows and image blocks are masked by original positions (positions="compact" is
    # refused)
    consecutive_positions=False,
    static_cache=True,
)
