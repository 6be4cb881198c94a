"""Region scores: the attention a prediction's tokens put inside the box it claims (MTLA)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._boxes import Box
from ._maps import (
    HeadSpec,
    HeatMap,
    Query,
    _geometry,
    _pairs,
    _reduce,
    _rows_and_weights,
    _weights,
    cell_rectangles,
    head_weights,
    maps_from_values,
    probe_forward,
    token_attention,
)


def _check_box(box: Any, image_size: tuple[int, int]) -> list[float]:
    if isinstance(box, Box):
        box = box.xywh
    if isinstance(box, torch.Tensor):
        box = box.tolist()
    if not isinstance(box, Sequence) or len(box) != 4:
        raise TypeError(f"a box is [x, y, w, h] in image pixels, got {box!r}")
    x, y, w, h = (float(v) for v in box)
    height, width = image_size
    if w <= 0 or h <= 0:
        raise ValueError(f"box {box} has a non-positive width or height")
    tol = 1e-6 * max(height, width)
    if x < -tol or y < -tol or x + w > width + tol or y + h > height + tol:
        raise ValueError(f"box {box} lies outside the {width}x{height} (W x H) image")
    return [x, y, w, h]


def box_share(heat: HeatMap, box: Any) -> float:
    """Share of the map's grid mass inside ``box`` (cells weighted by their covered area).

    ``share = sum_v sum_c a_c * |cell_c & box| / |cell_c|  /  sum_v sum_c a_c``
    """
    x, y, w, h = _check_box(box, heat.image_size)
    inside = total = 0.0
    for grid, frame in zip(heat.views, heat.frames, strict=True):
        rect = cell_rectangles(tuple(grid.shape), frame)  # [rows, cols, 4] y_lo x_lo y_hi x_hi
        dy = (rect[..., 2].clamp(max=y + h) - rect[..., 0].clamp(min=y)).clamp(min=0)
        dx = (rect[..., 3].clamp(max=x + w) - rect[..., 1].clamp(min=x)).clamp(min=0)
        area = (rect[..., 2] - rect[..., 0]) * (rect[..., 3] - rect[..., 1])
        cover = dy * dx / area
        inside += float((grid.double() * cover).sum())
        total += float(grid.double().sum())
    return inside / total if total > 0 else 0.0


def region_score(
    model: nn.Module,
    inputs: Mapping[str, Any],
    box: Any,
    tokens: Query = None,
    *,
    answer: torch.Tensor | None = None,
    tokenizer: Any = None,
    image: int = 0,
    layers: Sequence[int] | None = None,
    heads: HeadSpec = None,
    image_size: Any = None,
    geometry: str | None = None,
) -> torch.Tensor:
    """Grounding confidence of a box: the share of a prediction's image attention inside it (MTLA).

    For the prediction's tokens ``T`` (all of them, summed; not one token), an image's cells
    ``c`` with attention ``a_t(c)`` (averaged over the chosen layers and heads) and the fraction
    ``w_c`` of cell ``c``'s pixel area that ``box`` covers::

        score = sum_{t in T} sum_c w_c a_t(c)  /  sum_{t in T} sum_c a_t(c)

    It lies in ``[0, 1]``, does not depend on the order of the tokens, and compares boxes the model
    writes in text as well as boxes from :func:`boxes`.

    Args:
        box: ``[x, y, w, h]`` in original image pixels (one for all rows, or one per row).
        tokens: the prediction's tokens: a phrase, a token-id span, a ``[B, S]`` bool mask or
            ``[B, Tq]`` positions; default: the whole ``answer`` (or the instruction).
        answer: generated tokens ``[B, T]``, appended and read teacher-forced.
        image: which image of each row the box refers to.
        Other arguments as in :func:`heatmap`.

    Returns:
        ``[B]`` float scores.
    """
    geometry = _geometry(model, geometry)
    if heads is not None and layers is None:
        layers = sorted({layer for layer, _ in _pairs(heads)})
    full, query_tokens = _rows_and_weights(model, inputs, tokens, answer, tokenizer)
    probed = probe_forward(model, full, query_tokens, layers)
    weights = head_weights(heads, probed.layers, probed.n_heads)
    values = _reduce(
        token_attention(probed, _weights(probed, query_tokens), per_head=True), weights
    )
    maps = maps_from_values(model, probed, values, image_size, geometry)
    batch = len(maps)
    per_row = (
        isinstance(box, torch.Tensor)
        and box.dim() == 2
        or (isinstance(box, Sequence) and len(box) > 0 and isinstance(box[0], Sequence | Box))
    )
    if per_row and len(box) != batch:
        raise ValueError(f"got {len(box)} boxes for {batch} rows")
    scores = []
    for b, row in enumerate(maps):
        if not 0 <= image < len(row):
            raise ValueError(f"image={image}, but row {b} holds {len(row)} image(s)")
        scores.append(box_share(row[image], box[b] if per_row else box))
    return torch.tensor(scores)
