"""Decode-time fixation: the per-step selection and the cache view that layers ``>= K`` read.

Prefill keeps every token, so every layer's cache holds the whole prompt and a cache column is
an original position. In a decode step the engine calls :meth:`StepFixation.fixate` at the
focal layer K with that layer's input, and hands every layer ``>= K`` a :class:`FixedView` of
the cache: the real cache is updated as usual (nothing is evicted) and the attention gets back
only the kept columns, gathered, with the mask sliced to match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import keep_count
from ..kernels import per_query_attention
from ..model_adapters import ImageLayout, ModelAdapter
from .attention import apply_rope
from .selection import keep_mask, kept_columns


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
        columns = self._columns.to(keys.device)  # [B, L']
        rows = torch.arange(columns.shape[0], device=keys.device)[:, None]
        # whole head_dim rows per index ([B, L', H, D], then heads first): a CPU gather over an
        # index expanded to every element is several times slower
        return keys[rows, :, columns].transpose(1, 2), values[rows, :, columns].transpose(1, 2)

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
        held: list[int],
        keep: float | int,
        reduce: str,
        refresh: int,
        radius: int,
    ) -> None:
        """``n_visual``: each row's visual tokens; ``held``: how many of them the prompt kept
        (all, unless ``prefill_keep`` pruned it); each step keeps ``keep`` of ``n_visual``."""
        self.adapter = adapter
        self.visual = visual  # [B, S] prompt visual tokens, in the focal layer's cache columns
        drops = [h - keep_count(keep, n) for n, h in zip(n_visual, held, strict=True)]
        if drops and min(drops) < 0:
            raise ValueError(
                f"pruner='fixation': keep={keep!r} asks for more visual tokens per step than "
                f"the prompt keeps ({min(held)} of {max(n_visual)}); keep <= prefill_keep"
            )
        self.drop = min(drops) if drops else 0
        self.reduce, self.refresh, self.radius = reduce, refresh, radius
        index, self.canvas = _canvas_index(layout, tuple(visual.shape))
        self.canvas_index = index.to(visual.device)
        self.held: torch.Tensor | None = None  # [B, S'] original position of each column
        self.prompt_len = visual.shape[1]
        self.pruned_prompt = False
        # The step count and the last fixation live on the device: a compiled step would
        # otherwise specialise on the count, and recompile, at every step.
        self.step = torch.full((), -1, dtype=torch.long, device=visual.device)
        torch._dynamo.mark_static_address(self.step)  # mutated in place: CUDA graphs keep it
        self.previous = torch.zeros_like(visual)  # [B, S] last step's kept visual tokens
        self.columns: torch.Tensor | None = None  # [B, L - drop + 1] what this step reads
        self.key_mask: torch.Tensor | None = None  # [B, L + 1] this step's 2-D attention mask
        self._kept: list[torch.Tensor] = []  # per step, its kept visual tokens [B, S]
        self._record: torch.Tensor | None = None  # a static cache's [steps, B, S] instead

    def hold(self, held: torch.Tensor, valid: torch.Tensor) -> None:
        """The prompt is in: the focal layer's cache holds the original positions ``held``
        ``[B, S']`` (all of them unless the prompt was pruned) of a prompt whose non-padding
        tokens are ``valid [B, S]``; work in its columns."""
        self.held = held.to(self.visual.device)
        self.pruned_prompt = held.shape[1] != self.prompt_len
        self.prompt_valid = valid.to(self.visual.device)  # [B, S'] once pruned, below
        if self.pruned_prompt:
            self.visual = self.visual.gather(1, self.held)
            self.canvas_index = self.canvas_index.gather(1, self.held)
            self.prompt_valid = self.prompt_valid.gather(1, self.held)
            self.previous = torch.zeros_like(self.visual)

    def record_into(self, steps: int) -> None:
        """Record the kept tokens of up to ``steps`` decoding steps in one preallocated
        buffer (a static cache: a list that grows would recompile a compiled step)."""
        self._record = torch.zeros((steps, *self.visual.shape), dtype=torch.bool)
        self._record = self._record.to(self.visual.device)
        torch._dynamo.mark_static_address(self._record)

    def kept_steps(self) -> list[torch.Tensor]:
        """Per decoding step so far, ``[B, S']`` bool over the prompt the focal layer holds:
        the visual tokens it attended to."""
        if self._record is None:
            return list(self._kept)
        return list(self._record[: int(self.step) + 1])

    def fixated_positions(self) -> list[list[torch.Tensor]]:
        """Per decoding step, per row: the original positions of the visual tokens it read."""
        held = None if self.held is None else self.held.cpu()
        out = []
        for step in self.kept_steps():
            rows = [torch.nonzero(row).flatten() for row in step.cpu()]
            out.append(rows if held is None else [h[r] for h, r in zip(held, rows, strict=True)])
        return out

    def begin_step(self, key_mask: torch.Tensor | None) -> None:
        """A decoding step starts; ``key_mask`` (``[B, S + t]`` in original positions, or None:
        a static cache's step reads the prompt's, from :meth:`hold`) says which keys are
        padding."""
        self.step.add_(1)
        self.columns = None
        if key_mask is not None and self.pruned_prompt:  # to the focal layer's columns
            held = self.held.to(key_mask.device)
            tail = torch.arange(self.prompt_len, key_mask.shape[1], device=key_mask.device)
            key_mask = key_mask.gather(1, torch.cat([held, tail.expand(held.shape[0], -1)], 1))
        self.key_mask = key_mask

    def fixate(
        self, layer: nn.Module, hidden: torch.Tensor, kwargs: dict, keys: torch.Tensor
    ) -> torch.Tensor:
        """Score the cached keys ``[B, Hkv, L, D]`` with this step's (one) query at the focal
        layer; returns the columns every layer ``>= K`` reads this step, ``[B, L - drop + 1]``:
        the kept cached ones (text and generated always), then the step's own token at ``L``."""
        batch, length = keys.shape[0], keys.shape[2]
        key_mask = self.key_mask
        if key_mask is None:
            key_mask = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
        keep = self._select(layer, hidden, kwargs, keys, key_mask[:, :length].bool())
        own = torch.full((batch, 1), length, device=keys.device)
        self.columns = torch.cat([kept_columns(keep, length - self.drop), own], dim=1)
        return self.columns

    def fixate_static(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        kwargs: dict,
        keys: torch.Tensor,
        length: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`fixate` on a static cache's whole buffer ``[B, Hkv, W, D]``, of which the
        first ``length`` slots (a 0-d device tensor) are written: shapes stay fixed from step
        to step, and nothing is read to the host. The step's own token goes to slot
        ``length``; like every slot that is not visual it stays among the ``[B, W - drop]``
        columns returned (the step's mask hides the empty ones)."""
        width = keys.shape[2]
        written = torch.arange(width, device=keys.device) < length.to(keys.device)
        valid = self.prompt_valid.to(keys.device)  # generated slots are never padding
        prompt = F.pad(valid, (0, width - valid.shape[1]), value=True)
        keep = self._select(layer, hidden, kwargs, keys, prompt & written)
        self.columns = kept_columns(keep, width - self.drop)
        return self.columns

    def _select(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        kwargs: dict,
        keys: torch.Tensor,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, L]`` bool: the columns this step keeps, every one but the ``drop`` visual
        tokens its query attends to least (``key_mask`` names the keys it may attend to)."""
        attn = getattr(layer, self.adapter.attention)
        norm = getattr(layer, self.adapter.input_norm)
        batch, length = keys.shape[0], keys.shape[2]
        normed = norm(hidden[:, -1:])  # [B, 1, D]: the step's query token
        q, _ = self.adapter.project_qk(attn, normed, normed)  # one token: k is as cheap
        cos, sin = kwargs["position_embeddings"]
        q = apply_rope(q, cos[:, -1:].expand(batch, -1, -1), sin[:, -1:].expand(batch, -1, -1))
        scores = per_query_attention(
            q,
            keys,
            scaling=attn.scaling,
            key_mask=key_mask.to(keys.device),
            query_pos=torch.full((batch, 1), length, device=keys.device),
            reduce=self.reduce,
        )[:, 0]  # [B, L]
        seq = self.visual.shape[1]
        visual = F.pad(self.visual.to(keys.device), (0, length - seq))  # generated: not visual
        if self.refresh > 1:  # between refreshes only the last fixation's neighbourhood competes
            warm = (self.step % self.refresh != 0).to(keys.device)  # step 0 always refreshes
            allowed = F.pad(self.neighbourhood(self.previous), (0, length - seq))
            scores = scores.masked_fill(warm & visual & ~allowed.to(keys.device), -1.0)
        keep = keep_mask(scores, visual, self.drop)
        self.previous = (keep[:, :seq] & visual[:, :seq]).to(self.visual.device)
        if self._record is None:
            self._kept.append(self.previous)
        else:
            self._record.index_copy_(0, self.step.view(1), self.previous[None])
        return keep

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
