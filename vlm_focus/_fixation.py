"""Decode-time fixation: the per-step selection and the cache view that layers ``>= K`` read.

Prefill keeps every token, so every layer's cache holds the whole prompt and a cache column is
an original position. In a decode step the engine calls :meth:`StepFixation.fixate` at the
focal layer K with that layer's input, and hands every layer ``>= K`` a :class:`FixedView` of
the cache: the real cache is updated as usual (nothing is evicted) and the attention gets back
only the kept columns, gathered, with the mask sliced to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._attention import apply_rope
from ._select import keep_mask, kept_columns
from .config import keep_count
from .kernels import per_query_attention
from .model_adapters import ImageLayout, ModelAdapter


@dataclass
class FixationStep:
    """One decoding step: ``keep [B, L]`` over the cached columns, ``visual [B, L]``."""

    keep: torch.Tensor
    visual: torch.Tensor

    @cached_property
    def positions(self) -> list[torch.Tensor]:
        """Per row, the original positions of the visual tokens this step attended to."""
        keep, visual = self.keep.cpu(), self.visual.cpu()
        return [torch.nonzero(k & v).flatten() for k, v in zip(keep, visual, strict=True)]


def _canvas_index(
    layout: list[list[ImageLayout]], shape: tuple[int, int]
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[B, S]`` index of each visual token's cell in a per-row canvas of ``G`` grids of
    ``H x W`` (every view of every image one grid; -1 off the grids), and ``(G, H, W)``."""
    grids = [[g for image in row for g in image.grids] for row in layout]
    n_grids = max((len(g) for g in grids), default=1) or 1
    height = max((h for row in grids for h, _ in row), default=1)
    width = max((w for row in grids for _, w in row), default=1)
    index = torch.full(shape, -1, dtype=torch.long)
    for b, images in enumerate(layout):
        first = 0
        for image in images:
            cells = image.cells
            has = cells[:, 1] >= 0
            grid = first + cells[has, 0]
            index[b, image.positions[has]] = (grid * height + cells[has, 1]) * width + cells[has, 2]
            first += len(image.grids)
    return index, (n_grids, height, width)


class FixedView:
    """The cache as one layer ``>= K`` sees it in a fixated step: ``update`` stores the new
    keys and values in the real cache, then returns only the step's ``columns``."""

    def __init__(self, cache: Any, columns: torch.Tensor) -> None:
        self._cache = cache
        self._columns = columns  # [B, L'] this step's columns, its own token's last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self._cache.update(key_states, value_states, *args, **kwargs)
        index = self._columns.to(keys.device)[:, None, :, None]  # [B, 1, L', 1]
        shape = (keys.shape[0], keys.shape[1], index.shape[2], keys.shape[3])
        return keys.gather(2, index.expand(shape)), values.gather(2, index.expand(shape))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class StepFixation:
    """Per-prefill state: which visual tokens each decoding step attends to."""

    def __init__(
        self,
        adapter: ModelAdapter,
        layout: list[list[ImageLayout]],
        visual: torch.Tensor,
        n_visual: list[int],
        keep: float | int,
        reduce: str,
        refresh: int,
        radius: int,
    ) -> None:
        self.adapter = adapter
        self.visual = visual  # [B, S] prompt visual tokens
        self.drop = min(n - keep_count(keep, n) for n in n_visual) if n_visual else 0
        self.reduce, self.refresh, self.radius = reduce, refresh, radius
        index, self.canvas = _canvas_index(layout, tuple(visual.shape))
        self.canvas_index = index.to(visual.device)
        self.step = -1
        self.previous: torch.Tensor | None = None  # [B, S] last step's kept visual tokens
        self.columns: torch.Tensor | None = None  # [B, L - drop + 1] what this step reads
        self.key_mask: torch.Tensor | None = None  # [B, L + 1] this step's 2-D attention mask
        self.steps: list[FixationStep] = []

    def begin_step(self, key_mask: torch.Tensor | None) -> None:
        self.step += 1
        self.columns, self.key_mask = None, key_mask

    def fixate(
        self, layer: nn.Module, hidden: torch.Tensor, kwargs: dict, keys: torch.Tensor
    ) -> torch.Tensor:
        """Score the cached keys ``[B, Hkv, L, D]`` with this step's (one) query at the focal
        layer; returns the columns every layer ``>= K`` reads this step, ``[B, L - drop + 1]``:
        the kept cached ones (text and generated always), then the step's own token at ``L``."""
        attn = getattr(layer, self.adapter.attention)
        norm = getattr(layer, self.adapter.input_norm)
        batch, length = keys.shape[0], keys.shape[2]
        normed = norm(hidden[:, -1:])  # [B, 1, D]: the step's query token
        q, _ = self.adapter.project_qk(attn, normed, normed)  # one token: k is as cheap
        cos, sin = kwargs["position_embeddings"]
        q = apply_rope(q, cos[:, -1:].expand(batch, -1, -1), sin[:, -1:].expand(batch, -1, -1))
        key_mask = self.key_mask
        if key_mask is None:
            key_mask = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
        scores = per_query_attention(
            q,
            keys,
            scaling=attn.scaling,
            key_mask=key_mask[:, :length].bool().to(keys.device),
            query_pos=torch.full((batch, 1), length - 1, device=keys.device),
            reduce=self.reduce,
        )[:, 0]  # [B, L]
        seq = self.visual.shape[1]
        visual = F.pad(self.visual.to(keys.device), (0, length - seq))  # generated: not visual
        warm = self.refresh > 1 and self.step % self.refresh != 0 and self.previous is not None
        if warm:  # only the last fixation's neighbourhood competes
            allowed = F.pad(self.neighbourhood(self.previous), (0, length - seq))
            scores = scores.masked_fill(visual & ~allowed.to(keys.device), -1.0)
        keep = keep_mask(scores, visual, self.drop)
        self.previous = (keep[:, :seq] & visual[:, :seq]).to(self.visual.device)
        self.steps.append(FixationStep(keep, visual))
        own = torch.full((batch, 1), length, device=keys.device)
        self.columns = torch.cat([kept_columns(keep, length - self.drop), own], dim=1)
        return self.columns

    def neighbourhood(self, kept: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` bool: visual tokens within ``radius`` grid cells (Chebyshev) of a kept
        one, on the same view; tokens without a cell always compete."""
        n_grids, height, width = self.canvas
        batch = kept.shape[0]
        index = self.canvas_index
        on_grid = index >= 0
        canvas = torch.zeros(batch, n_grids * height * width, device=kept.device)
        canvas.scatter_add_(1, index.clamp(min=0), (kept & on_grid).float())
        canvas = canvas.view(batch * n_grids, 1, height, width)
        size = 2 * self.radius + 1
        grown = F.max_pool2d(canvas, size, stride=1, padding=self.radius) > 0
        grown = grown.view(batch, -1).gather(1, index.clamp(min=0))
        return (grown & on_grid) | (self.visual & ~on_grid)
