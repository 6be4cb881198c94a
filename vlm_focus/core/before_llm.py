"""Pruning before the language model: one image's or video's kept tokens at layer 0.

``vf.wrap(model, layer=0, ...)`` prunes the LLM's input: the registered pruner scores the
visual tokens from a :class:`~vlm_focus.core.pruner.StageContext` of layer 0, and the engine's
selection rules (:mod:`.selection`) turn the scores into a kept set. A backend that prunes each
item before the LLM (the vLLM plugin) builds the same context for one item and calls
:func:`item_keep`, so the pruner's own ``select`` makes the choice there too; it asks the
pruner class what it needs (``before_llm``, ``reads_layer_attention``, ...). Nothing here
imports a backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import FocusConfig
from ..geometry import Size
from ..model_adapters import ImageLayout
from ..model_adapters.base import grid_cells
from .pruner import Pruner, StageContext
from .registry import get_pruner, pruners_with
from .selection import frame_shares, keep_mask, selected_keep


def before_llm_pruner(config: FocusConfig, options: dict[str, Any] | None = None) -> Pruner:
    """The registered pruner ``config.pruner`` as it runs before the LLM: its class's
    ``before_llm_options`` over its defaults, then ``options``. ``ValueError`` for a pruner
    that cannot choose there, or ``options`` that change one of its ``before_llm_options``."""
    cls = get_pruner(config.pruner)
    if not cls.before_llm:
        raise ValueError(
            f"pruner {config.pruner!r} cannot choose before the language model; those that "
            f"can: {before_llm_pruners()}"
        )
    fixed = {
        key: value
        for key, value in (options or {}).items()
        if key in cls.before_llm_options and value != cls.before_llm_options[key]
    }
    if fixed:
        raise ValueError(
            f"pruner {config.pruner!r} runs before the language model with "
            f"{cls.before_llm_options}: {fixed} needs what exists only inside it"
        )
    try:
        chosen = cls.Options(**{**cls.before_llm_options, **(options or {})})
    except TypeError:
        raise ValueError(
            f"options={options!r} do not fit pruner {config.pruner!r}; it takes: "
            f"{cls.option_names() or 'no options of its own'}"
        ) from None
    return cls(config, chosen)


def before_llm_pruners() -> list[str]:
    """The registered pruners that can choose before the LLM."""
    return pruners_with("before_llm")


def item_layout(rows: int, cols: int, frames: int = 1) -> tuple[torch.Tensor, list]:
    """``(cells [n, 3], grids)`` of an image that is one ``rows x cols`` grid, or of a video of
    ``frames`` such grids (frame by frame, raster order in each; a frame is one view)."""
    cells = torch.cat([grid_cells(rows, cols, view=f) for f in range(frames)])
    return cells, [(rows, cols)] * frames


def item_keep(
    pruner: Pruner,
    layout: tuple[torch.Tensor, list[tuple[int, int]]],
    n_keep: int,
    *,
    hidden: torch.Tensor,
    where: torch.Tensor,
    adapter: Any,
    layer: nn.Module | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    kind: str = "image",
    budget: str = "span",
    image_size: Size | None = None,
) -> torch.Tensor:
    """Kept token indices (sorted, the item's own order) of one image or video (``kind``) whose
    tokens sit at ``layout = (cells [n, 3] (view, row, col), grids)``, chosen by ``pruner`` at
    layer 0 by the engine's rule: its own top ``n_keep``, or for a video with
    ``budget="frame"`` the same share of every frame.

    ``hidden [1, S, D]`` is layer 0's input: the item's ``n`` LLM-input embeddings at
    positions ``where [n]`` (the item alone: ``S = n``; or inside its unpruned prompt, for a
    pruner that ``reads_layer_attention``, with that decoder ``layer`` and the RoPE tables
    ``cos, sin [1, S, head_dim]`` at the prompt's positions). ``adapter`` answers what the
    context asks of a model adapter (the layer's attribute names, q/k projection, fallback
    geometry); ``image_size`` is the original image's, when known."""
    cells, grids = layout
    n, seq = cells.shape[0], hidden.shape[1]
    if where.numel() != n:
        raise ValueError(f"where has {where.numel()} positions for an item of {n} tokens")
    if n_keep >= n:
        return torch.arange(n)
    if pruner.reads_layer_attention and layer is None:
        raise ValueError(f"pruner {pruner.name!r} reads layer 0's attention: pass layer")
    device = hidden.device
    at_item = where.to(device)
    visual = torch.zeros(1, seq, dtype=torch.bool, device=device)
    visual[0, at_item] = True
    if cos is None or sin is None:  # a pruner that reads no attention
        cos = sin = torch.zeros(1, seq, 1, device=device)
    image = ImageLayout(
        positions=where.cpu(), cells=cells, grids=grids, image_size=image_size, kind=kind
    )
    ctx = StageContext(
        model=None,
        adapter=adapter,
        config=pruner.config,
        layer_index=0,
        stage_index=0,
        decoder_layer=layer,
        hidden=hidden,
        cos=cos.to(device),
        sin=sin.to(device),
        positions=torch.arange(seq, device=device)[None],
        visual=visual,
        valid=torch.ones_like(visual),
        layout=[[image]],
        inputs={},
        visual_counts=[n],
    )
    selection = pruner.select(ctx, n_keep)
    if kind == "video" and budget == "frame":  # the engine's rules
        frames = torch.zeros(1, seq, dtype=torch.long, device=device)
        frames[0, at_item] = cells[:, 0].to(device)
        keep = keep_mask(frame_shares(selection.scores, visual, frames), visual, n - n_keep)
    else:
        keep = selected_keep(selection.scores, selection.kept, visual, n - n_keep)
    return torch.nonzero(keep[0, at_item]).flatten().cpu()


def frame_counts(sizes: list[int], total: int) -> list[int]:
    """Tokens each image of one prompt keeps when the prompt keeps ``total`` of its
    ``sum(sizes)``: ``vf.wrap(..., budget="frame")``'s rule. Every token of an image of ``n``
    tokens is worth its share ``-(rank + 0.5) / n`` (rank 0: the image's best) and the prompt
    keeps its ``total`` largest shares, ties to the earlier image; so the counts depend on the
    sizes alone, never on the scores. One image keeps ``total``."""
    shares = torch.cat(
        [-(torch.arange(n, dtype=torch.float32) + 0.5) / float(n) for n in sizes]
    )  # float32, as the engine computes them
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    order = torch.sort(shares, descending=True, stable=True).indices[:total]
    return torch.bincount(owner[order], minlength=len(sizes)).tolist()
