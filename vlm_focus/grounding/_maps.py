"""Attention maps from query tokens to each image's grid, in grid cells and in image pixels (TAG).

One teacher-forced forward pass computes everything: the prompt (plus, for generated tokens, the
answer appended to it) runs once through the unmodified model, and an attention probe recomputes
the query rows at the chosen layers from each layer's own q/k (SDPA, eager and flash all fine).
A generated answer is read this way rather than during ``generate()``: the rows are exactly those
the decode steps computed (same tokens, same causal prefix), and one batched pass serves every
phrase of the answer.

Geometry. A view's grid spans a *frame* of the original image (``y0, x0, height, width`` in
pixels) that depends on the preprocessing (``geometry``):

* ``"resize"``: the image was resized (squashed) to the grid: the frame is the whole image
  (LLaVA-NeXT's base view and unpadded anyres view, Qwen's merged dynamic grid);
* ``"crop"``: shortest side resized, then a centred square crop (CLIP's image processor and
  transformers' ``LlavaImageProcessor`` with ``do_pad=False``): the frame is the central
  ``min(H, W)`` square;
* ``"pad"``: padded to a square first (LLaVA-1.5's reference ``expand2square``; the views an
  adapter lists in ``square_padded_views``): the frame is the centred ``max(H, W)`` square,
  partly outside the image.

The default is per view from the adapter (``"pad"`` for ``square_padded_views``, ``"resize"``
otherwise); pass ``geometry=`` to match the processor actually used. Square images (the
organism's 192 x 192 scenes) are unaffected.

Cell ``(r, c)`` of a ``rows x cols`` view covers ``[y0 + r*height/rows, y0 + (r+1)*height/rows)``
by ``[x0 + c*width/cols, ...)``. The pixel map is the attention *density* (mass per pixel),
bilinearly interpolated between cell centres and summed over views, so it integrates to the
mass the grid cells hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._probe import AttentionProbe, Prefill, Rows, check_layers
from ..model_adapters import ImageLayout, get_adapter

GEOMETRIES = ("resize", "crop", "pad")
GENERIC_PROMPT = "Write a general description of the image."

HeadSpec = Any  # LocalizationHeads | Mapping[int, Sequence[int]] | None
Query = str | Sequence[int] | torch.Tensor | None


@dataclass
class HeatMap:
    """One image's attention map.

    Attributes:
        grid: ``[rows, cols]`` mass per cell of the finest view (LLaVA-NeXT: the unpadded
            anyres composite; Qwen: the merged grid, summed over frames of a video).
        views: every view's ``[rows, cols]`` map (LLaVA-NeXT: base grid, then anyres grid; a
            video: one per frame, see :attr:`frame_maps`).
        pixels: ``[H, W]`` attention density in original image pixels.
        image_size: ``(H, W)`` of ``pixels``.
        frames: per view, the ``(y0, x0, height, width)`` pixel frame its grid spans.
        other: mass on the image's tokens without a cell (newline, CLS tokens).
        row, image: batch row and image index within the row.
    """

    grid: torch.Tensor
    views: list[torch.Tensor]
    pixels: torch.Tensor
    image_size: tuple[int, int]
    frames: list[tuple[float, float, float, float]]
    other: float = 0.0
    row: int = 0
    image: int = 0
    layout: ImageLayout | None = field(default=None, repr=False)

    @property
    def mass(self) -> float:
        """Total attention mass on the image's grid cells."""
        return float(sum(v.sum() for v in self.views))

    @property
    def frame_maps(self) -> list[HeatMap]:
        """A video's map as one :class:`HeatMap` per frame, in frame order (each frame's view,
        upsampled on its own); an image gives ``[self]``."""
        if self.layout is None or self.layout.kind != "video":
            return [self]
        return [
            HeatMap(
                view,
                [view],
                upsample(view, self.image_size, frame),
                self.image_size,
                [frame],
                0.0,
                self.row,
                self.image,
                self.layout,
            )
            for view, frame in zip(self.views, self.frames, strict=True)
        ]


# --- inputs and query rows ------------------------------------------------------------------
def _tokenizer_of(tokenizer: Any) -> Any:
    return getattr(tokenizer, "tokenizer", tokenizer)


def extend_with_answer(
    inputs: Mapping[str, Any], answer: torch.Tensor, answer_mask: torch.Tensor | None = None
) -> tuple[dict[str, Any], torch.Tensor]:
    """Append generated tokens ``answer [B, T]`` to a prompt for one teacher-forced pass.

    Returns the new inputs (``input_ids``, ``attention_mask`` and every other ``[B, S]`` integer
    input, such as ``mm_token_type_ids``, extended; answer positions padded with 0 except the
    attention mask, which is ``answer_mask``) and the ``[B, S + T]`` bool mask of answer tokens.
    """
    input_ids = inputs["input_ids"]
    if not isinstance(answer, torch.Tensor) or answer.dim() != 2:
        raise TypeError(
            f"answer must be a [batch, T] LongTensor, got {getattr(answer, 'shape', answer)}"
        )
    batch, seq = input_ids.shape
    if answer.shape[0] != batch:
        raise ValueError(f"answer has {answer.shape[0]} rows, the prompt has {batch}")
    answer = answer.to(input_ids.device)
    if answer_mask is None:
        answer_mask = torch.ones_like(answer, dtype=torch.bool)
    answer_mask = answer_mask.to(input_ids.device).bool()
    out = dict(inputs)
    for key, value in inputs.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim() == 2
            and tuple(value.shape) == (batch, seq)
            and not value.is_floating_point()
        ):
            pad = torch.zeros_like(answer, dtype=value.dtype)
            if key == "attention_mask":
                pad = answer_mask.to(value.dtype)
            out[key] = torch.cat([value, pad], dim=1)
    out["input_ids"] = torch.cat([input_ids, answer], dim=1)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.cat(
            [torch.ones_like(input_ids), answer_mask.to(input_ids.dtype)], dim=1
        )
    is_answer = torch.cat([torch.zeros_like(input_ids, dtype=torch.bool), answer_mask], dim=1)
    return out, is_answer


def _find_span(row: list[int], span: list[int], allowed: list[bool]) -> int | None:
    """Start of the last occurrence of ``span`` in ``row`` lying wholly on allowed positions."""
    n = len(span)
    for start in range(len(row) - n, -1, -1):
        if row[start : start + n] == span and all(allowed[start : start + n]):
            return start
    return None


def query_mask(
    input_ids: torch.Tensor,
    query: Query,
    *,
    where: torch.Tensor,
    tokenizer: Any = None,
) -> torch.Tensor:
    """``[B, S]`` bool: the query tokens of each row.

    ``query`` is a phrase (``str``, tokenised with ``tokenizer``), a token-id span, a ``[B, S]``
    bool mask or ``[B, Tq]`` positions. Phrases and spans are searched in ``where`` (the prompt's
    text, or the answer), last occurrence first; a row without it raises ``ValueError``.
    """
    batch, seq = input_ids.shape
    if isinstance(query, torch.Tensor):
        if query.dtype == torch.bool:
            if tuple(query.shape) != (batch, seq):
                raise ValueError(
                    f"query mask has shape {list(query.shape)}, expected [{batch}, {seq}]"
                )
            mask = query.to(input_ids.device)
        else:
            if query.dim() != 2 or query.shape[0] != batch:
                raise ValueError(f"query positions must be [{batch}, Tq], got {list(query.shape)}")
            if bool(((query < 0) | (query >= seq)).any()):
                raise ValueError(f"query positions must lie in [0, {seq})")
            mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
            mask.scatter_(1, query.to(input_ids.device).long(), True)
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("every row needs at least one query token")
        return mask
    if isinstance(query, str):
        if not query.strip():
            raise ValueError("query phrase is empty")
        if tokenizer is None:
            raise ValueError("a phrase query needs tokenizer= (the processor or its tokenizer)")
        tok = _tokenizer_of(tokenizer)
        candidates = []
        for text in (query, " " + query):
            ids = list(tok.encode(text, add_special_tokens=False))
            if ids and ids not in candidates:
                candidates.append(ids)
    elif isinstance(query, Sequence) and query and all(isinstance(t, int) for t in query):
        candidates = [list(query)]
    else:
        raise TypeError(
            "query must be a phrase (str), a list of token ids, a [B, S] bool mask or [B, Tq] "
            f"positions, got {query!r}"
        )
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
    ids = input_ids.tolist()
    allowed = where.tolist()
    for b in range(batch):
        for span in candidates:
            start = _find_span(ids[b], span, allowed[b])
            if start is not None:
                mask[b, start : start + len(span)] = True
                break
        else:
            raise ValueError(
                f"query {query!r} (tokens {candidates}) not found in row {b} of the "
                f"{'answer' if bool(where[b].any()) else 'prompt'}"
            )
    return mask


# --- running the probe ----------------------------------------------------------------------
@dataclass
class _Probed:
    """Attention rows of one forward pass and what is needed to read them."""

    records: list[Rows]
    prefill: Prefill
    layout: list[list[ImageLayout]]
    layers: list[int]
    n_heads: int


def probe_forward(
    model: nn.Module,
    inputs: Mapping[str, Any],
    rows: torch.Tensor,
    layers: Sequence[int] | None,
) -> _Probed:
    """One forward pass recording the attention rows ``rows [B, S]`` at ``layers``."""
    adapter = get_adapter(model)
    n_layers = len(adapter.decoder_layers(model))
    layers = list(range(n_layers)) if layers is None else check_layers(layers, n_layers)
    inputs = dict(inputs)
    inputs.pop("labels", None)
    with torch.no_grad(), AttentionProbe(model, layers, rows=rows) as probe:
        model(**inputs, use_cache=False)
        prefill = probe.prefill
    layout = prefill.layout(model, adapter)
    attn = getattr(adapter.decoder_layers(model)[layers[0]], adapter.attention)
    n_heads = probe.records[0].probs.shape[1] if probe.records else attn.config.num_attention_heads
    return _Probed(probe.records, prefill, layout, layers, n_heads)


def head_weights(heads: HeadSpec, layers: list[int], n_heads: int) -> torch.Tensor:
    """``[len(layers), n_heads]`` weights that average over the selected (layer, head) pairs."""
    weights = torch.zeros(len(layers), n_heads)
    if heads is None:
        weights[:] = 1.0
    else:
        pairs = getattr(heads, "heads", heads)
        if isinstance(pairs, Mapping):
            pairs = [(layer, h) for layer, hs in pairs.items() for h in hs]
        for layer, head in pairs:
            if layer not in layers:
                raise ValueError(f"head ({layer}, {head}): layer {layer} was not probed ({layers})")
            if not 0 <= head < n_heads:
                raise ValueError(f"head ({layer}, {head}) is outside [0, {n_heads})")
            weights[layers.index(layer), head] = 1.0
        if weights.sum() == 0:
            raise ValueError("no heads selected")
    return weights / weights.sum()


def token_attention(
    probed: _Probed, row_weights: torch.Tensor, *, per_head: bool = False
) -> list[list[torch.Tensor]]:
    """Per row and image, the attention each of the image's tokens receives.

    ``row_weights [B, Tq]`` weights the recorded query rows (e.g. ``1/n`` on a phrase's tokens).
    Returns ``[L, H, n]`` per image (layers in ``probed.layers`` order) when ``per_head``, else
    the mean over layers and heads kept as ``[1, 1, n]``.
    """
    by_layer = {r.layer: r for r in probed.records}
    out: list[list[torch.Tensor]] = []
    for b, images in enumerate(probed.layout):
        row_images = []
        for image in images:
            positions = image.positions.to(row_weights.device)
            stack = []
            for layer in probed.layers:
                rec = by_layer[layer]
                w = (row_weights[b] * rec.mask[b].float())[None, :, None]  # [1, Tq, 1]
                probs = rec.probs[b][:, :, positions]  # [H, Tq, n]
                stack.append((probs * w).sum(1))  # [H, n]
            per = torch.stack(stack)  # [L, H, n]
            row_images.append(per if per_head else per.mean((0, 1), keepdim=True))
        out.append(row_images)
    return out


# --- geometry -------------------------------------------------------------------------------
def view_frame(image_size: tuple[int, int], geometry: str) -> tuple[float, float, float, float]:
    """``(y0, x0, height, width)``: the pixel region of the original image a view's grid spans."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry={geometry!r}; allowed: {GEOMETRIES}")
    height, width = image_size
    if geometry == "resize":
        return 0.0, 0.0, float(height), float(width)
    side = float(min(height, width) if geometry == "crop" else max(height, width))
    return (height - side) / 2, (width - side) / 2, side, side


def cell_rectangles(
    grid: tuple[int, int], frame: tuple[float, float, float, float]
) -> torch.Tensor:
    """``[rows, cols, 4]`` pixel rectangles ``(y_lo, x_lo, y_hi, x_hi)`` of a view's cells."""
    rows, cols = grid
    y0, x0, height, width = frame
    ys = y0 + torch.arange(rows + 1, dtype=torch.float64) * height / rows
    xs = x0 + torch.arange(cols + 1, dtype=torch.float64) * width / cols
    lo_y, hi_y = ys[:-1, None].expand(rows, cols), ys[1:, None].expand(rows, cols)
    lo_x, hi_x = xs[None, :-1].expand(rows, cols), xs[None, 1:].expand(rows, cols)
    return torch.stack([lo_y, lo_x, hi_y, hi_x], dim=-1)


def upsample(
    grid_map: torch.Tensor, image_size: tuple[int, int], frame: tuple[float, float, float, float]
) -> torch.Tensor:
    """Density ``[H, W]`` of a ``[rows, cols]`` mass map: bilinear between cell centres (edge
    cells held constant to the frame border), divided by the cell area, 0 outside the frame."""
    height, width = image_size
    rows, cols = grid_map.shape
    y0, x0, fh, fw = frame
    ys = (torch.arange(height, dtype=torch.float32) + 0.5 - y0) / fh  # frame units in [0, 1]
    xs = (torch.arange(width, dtype=torch.float32) + 0.5 - x0) / fw
    sample_at = torch.empty(1, height, width, 2)
    sample_at[..., 0] = (xs * 2 - 1)[None, :]  # x in [-1, 1]
    sample_at[..., 1] = (ys * 2 - 1)[:, None]  # y in [-1, 1]
    src = grid_map.float()[None, None]
    values = F.grid_sample(
        src, sample_at, mode="bilinear", padding_mode="border", align_corners=False
    )[0, 0]
    values = values / ((fh / rows) * (fw / cols))
    y_in = (ys >= 0) & (ys <= 1)
    x_in = (xs >= 0) & (xs <= 1)
    if not (bool(y_in.all()) and bool(x_in.all())):
        values = values * (y_in[:, None] & x_in[None, :])
    return values


def _geometry(model: nn.Module, geometry: str | None) -> str | None:
    """A checked explicit geometry, or None: per view from the adapter (its
    ``square_padded_views`` are ``"pad"``, the others ``"resize"``)."""
    if geometry is not None and geometry not in GEOMETRIES:
        raise ValueError(f"geometry={geometry!r}; allowed: {GEOMETRIES}")
    return geometry


def view_geometries(model: nn.Module, n_views: int, geometry: str | None) -> list[str]:
    if geometry is not None:
        return [geometry] * n_views
    padded = getattr(get_adapter(model), "square_padded_views", ())
    return ["pad" if v in padded else "resize" for v in range(n_views)]


def _image_size(
    model: nn.Module, layout: ImageLayout, image_size: Any, row: int, image: int
) -> tuple[int, int]:
    """The original size of one image: the layout's when known, else the caller's, else the
    processed size (grid cells x the vision tower's pixels per cell)."""
    if layout.image_size is not None:
        return int(layout.image_size[0]), int(layout.image_size[1])
    if image_size is not None:
        size = image_size
        if isinstance(size, Sequence) and size and isinstance(size[0], Sequence):
            size = size[row] if isinstance(size[row][0], int) else size[row][image]
        if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
            raise ValueError(f"image_size must be (height, width) in pixels, got {image_size!r}")
        return int(size[0]), int(size[1])
    vision = model.config.vision_config
    per_cell = int(vision.patch_size) * int(getattr(vision, "spatial_merge_size", 1) or 1)
    rows, cols = max(layout.grids, key=lambda g: g[0] * g[1])
    return rows * per_cell, cols * per_cell


def build_map(
    values: torch.Tensor,
    layout: ImageLayout,
    image_size: tuple[int, int],
    geometry: str | Sequence[str],
    row: int = 0,
    image: int = 0,
) -> HeatMap:
    """Scatter per-token values ``[n]`` of one image onto its views and into pixels
    (``geometry``: one for every view, or one per view)."""
    values = values.detach().float().cpu()
    cells = layout.cells
    views = []
    has_cell = cells[:, 1] >= 0
    for v, (rows, cols) in enumerate(layout.grids):
        grid = torch.zeros(rows, cols)
        sel = has_cell & (cells[:, 0] == v)
        grid.index_put_((cells[sel, 1], cells[sel, 2]), values[sel], accumulate=True)
        views.append(grid)
    geometries = [geometry] * len(views) if isinstance(geometry, str) else list(geometry)
    frames = [view_frame(image_size, g) for g in geometries]
    pixels = torch.zeros(image_size)
    for grid, frame in zip(views, frames, strict=True):
        pixels += upsample(grid, image_size, frame)
    shapes = {tuple(g.shape) for g in views}
    if len(shapes) == 1:
        finest = torch.stack(views).sum(0)  # frames of a video share one grid
    else:
        finest = max(views, key=lambda g: g.numel())
    other = float(values[~has_cell].sum())
    return HeatMap(finest, views, pixels, image_size, frames, other, row, image, layout)


# --- public --------------------------------------------------------------------------------
def _rows_and_weights(
    model: nn.Module,
    inputs: Mapping[str, Any],
    query: Query,
    answer: torch.Tensor | None,
    tokenizer: Any,
) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward inputs (answer appended) and ``[B, S]`` bool query tokens."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be the processor's output mapping with input_ids")
    adapter = get_adapter(model)
    if answer is not None:
        pad = getattr(model.config, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(model.config, "text_config", None), "pad_token_id", None)
        answer_mask = None if pad is None else answer != pad
        inputs, where = extend_with_answer(inputs, answer, answer_mask)
    else:
        input_ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        where = valid & ~adapter.visual_mask(model, input_ids)
        inputs = dict(inputs)
    if query is None:
        if answer is not None:
            return inputs, where
        query = _instruction(model, inputs)
    return inputs, query_mask(inputs["input_ids"], query, where=where, tokenizer=tokenizer)


def _instruction(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, S]`` bool: the valid text tokens after each row's last visual token."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    prefill = Prefill(
        input_ids, valid, get_adapter(model).visual_mask(model, input_ids) & valid, {}
    )
    out = prefill.text_after_image()
    if bool((out.sum(1) == 0).any()):
        raise ValueError("a row has no text after its image to use as the query")
    return out


def _weights(probed: _Probed, query: torch.Tensor) -> torch.Tensor:
    """Per recorded query row, ``1 / n`` on the row's query tokens (mean over the query)."""
    rec = probed.records[0]
    picked = query.gather(1, rec.positions) & rec.mask
    return picked.float() / picked.sum(1, keepdim=True).clamp(min=1)


def heatmap(
    model: nn.Module,
    inputs: Mapping[str, Any],
    query: Query = None,
    *,
    answer: torch.Tensor | None = None,
    tokenizer: Any = None,
    layers: Sequence[int] | None = None,
    heads: HeadSpec = None,
    relative_to: Mapping[str, Any] | None = None,
    image_size: Any = None,
    geometry: str | None = None,
) -> list[list[HeatMap]]:
    """Attention maps of a query span over each image (TAG-style attention grounding).

    For query tokens ``T``, selected (layer, head) pairs ``P`` and an image's visual tokens ``v``::

        map[v] = 1/|P| sum_{(l,h) in P} 1/|T| sum_{t in T} A^{l,h}[t, v]
        A^{l,h}[t, :] = softmax_s(q_t^{l,h} . k_s^{l,h} / sqrt(d))   (causal, padding masked)

    scattered to the token's grid cell. With ``relative_to`` (the same image under a generic
    prompt such as ``"Write a general description of the image."``) the map is divided by the
    generic prompt's map (its instruction tokens as the query), ``map / (generic + eps)`` with
    ``eps = 0.05 * mean(generic)``, which removes prompt-independent sinks.

    Args:
        model: a supported VLM (SDPA, eager or flash).
        inputs: the processor's output (``input_ids``, ``attention_mask``, pixels, grids).
        query: a phrase of the prompt (``str``, needs ``tokenizer``), a token-id span, a
            ``[B, S]`` bool mask or ``[B, Tq]`` positions. Default: the answer's tokens when
            ``answer`` is given, else the instruction (text after the image).
        answer: generated tokens ``[B, T]`` (``generate()`` output after the prompt); they are
            appended and read in one teacher-forced pass; a phrase is then searched in the answer.
        layers: decoder layers to average (default: all; ``heads`` implies its own layers).
        heads: localization heads (:func:`select_localization_heads`) or ``{layer: [heads]}``.
        image_size: ``(H, W)`` or one per row/image, used when the layout does not know it.
        geometry: ``"resize"``, ``"crop"`` or ``"pad"`` for every view; default per view from
            the model adapter (``square_padded_views`` -> ``"pad"``, else ``"resize"``). Pass
            ``"crop"`` for a processor that resizes the short side and centre-crops (CLIP's
            default, ``do_pad=False``).

    Returns:
        per batch row, one :class:`HeatMap` per image.
    """
    geometry = _geometry(model, geometry)
    if heads is not None and layers is None:
        layers = sorted({layer for layer, _ in _pairs(heads)})
    full, query_tokens = _rows_and_weights(model, inputs, query, answer, tokenizer)
    probed = probe_forward(model, full, query_tokens, layers)
    weights = head_weights(heads, probed.layers, probed.n_heads)
    values = _reduce(
        token_attention(probed, _weights(probed, query_tokens), per_head=True), weights
    )
    if relative_to is not None:
        generic = relative_maps(model, relative_to, probed.layers, weights)
        values = _relative(values, generic)
    return maps_from_values(model, probed, values, image_size, geometry)


def _pairs(heads: HeadSpec) -> list[tuple[int, int]]:
    pairs = getattr(heads, "heads", heads)
    if isinstance(pairs, Mapping):
        return [(int(layer), int(h)) for layer, hs in pairs.items() for h in hs]
    return [(int(layer), int(h)) for layer, h in pairs]


def _reduce(per_head: list[list[torch.Tensor]], weights: torch.Tensor) -> list[list[torch.Tensor]]:
    """Weighted sum over (layer, head) of ``[L, H, n]`` -> ``[n]``."""
    return [[(x * weights.to(x.device)[..., None]).sum((0, 1)) for x in row] for row in per_head]


def relative_maps(
    model: nn.Module, generic_inputs: Mapping[str, Any], layers: list[int], weights: torch.Tensor
) -> list[list[torch.Tensor]]:
    """Per-token maps of the generic prompt (its instruction tokens as the query)."""
    full, query_tokens = _rows_and_weights(model, generic_inputs, None, None, None)
    probed = probe_forward(model, full, query_tokens, layers)
    per_head = token_attention(probed, _weights(probed, query_tokens), per_head=True)
    return _reduce(per_head, weights)


def _relative(
    values: list[list[torch.Tensor]], generic: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    if len(values) != len(generic) or any(
        len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True))
        for a, b in zip(values, generic, strict=True)
    ):
        raise ValueError(
            "relative_to must hold the same images (same rows, same visual tokens) as inputs"
        )
    out = []
    for row, grow in zip(values, generic, strict=True):
        out.append([v / (g + 0.05 * g.mean() + 1e-12) for v, g in zip(row, grow, strict=True)])
    return out


def maps_from_values(
    model: nn.Module,
    probed: _Probed,
    values: list[list[torch.Tensor]],
    image_size: Any,
    geometry: str | None,
) -> list[list[HeatMap]]:
    out = []
    for b, (row_values, row_layouts) in enumerate(zip(values, probed.layout, strict=True)):
        row = []
        for i, (v, layout) in enumerate(zip(row_values, row_layouts, strict=True)):
            size = _image_size(model, layout, image_size, b, i)
            geometries = view_geometries(model, len(layout.grids), geometry)
            row.append(build_map(v, layout, size, geometries, b, i))
        out.append(row)
    return out


def entropy(grid: torch.Tensor) -> float:
    """Shannon entropy (nats) of a non-negative map normalised to sum 1."""
    p = grid.flatten().double().clamp(min=0)
    total = p.sum()
    if total <= 0:
        return math.log(max(p.numel(), 1))
    p = p / total
    return float(-(p * p.clamp(min=1e-30).log()).sum())
