"""Debiased pruning: remove the positional (recency) trend and suppress sink and padding
tokens in the scores of any attention-based pruner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import get_pruner, pruners_with, register_pruner
from ..geometry import Frame, Size, as_size, content_fraction, view_frames
from ..model_adapters import ModelAdapter
from ._common import ImageTokens, fill_cellless, image_tokens
from ._math import TRENDS, fit_trend, ratio_outliers

AXES = ("sequence", "row")
SINK_SOURCES = ("activation", "attention", "both")


def _attention_pruners() -> list[str]:
    return [n for n in pruners_with("attention_based") if n != "debiased"]


@dataclass
class DebiasedOptions:
    base: str = option("fastv", "the attention-based pruner to debias")
    base_options: dict = field(
        default_factory=dict, metadata={"help": "options of the base pruner"}
    )
    positional: bool = option(True, "divide out the positional trend")
    trend: str = option("exp", "trend family: 'exp' or 'monotone'")
    axis: str = option(
        "sequence", "trend against the 1-D token order ('sequence') or image row ('row')"
    )
    padding: bool = option(True, "scale pad-to-square padding patches by their content")
    pad_to_square: bool | None = option(
        None,
        "whether images were padded to a square (None: the adapter's fallback "
        "geometry; LLaVA's is a centre crop, which pads nothing)",
    )
    image_sizes: list | tuple | None = option(
        None,
        "original size per image in batch order when the layout lacks it: PIL "
        "images, Size(width, height) or {'width', 'height'}",
    )
    sinks: bool = option(True, "down-weight sink tokens")
    sink_by: str = option(
        "activation", "find sinks by 'activation' (massive), 'attention' (mass) or 'both'"
    )
    sink_ratio: float = option(20.0, "a sink stands this many times above the median")
    sink_weight: float = option(0.0, "multiplier on sink scores, [0, 1]")

    def __post_init__(self) -> None:
        allowed = _attention_pruners()
        if self.base not in allowed:
            raise ValueError(f"base={self.base!r} must be an attention-based pruner: {allowed}")
        if not isinstance(self.base_options, dict):
            raise ValueError(f"base_options={self.base_options!r} must be a dict")
        for name in ("positional", "padding", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.pad_to_square not in (None, True, False):
            raise ValueError(f"pad_to_square={self.pad_to_square!r} must be None, True or False")
        if self.trend not in TRENDS:
            raise ValueError(f"trend={self.trend!r} is not one of {TRENDS}")
        if self.axis not in AXES:
            raise ValueError(f"axis={self.axis!r} is not one of {AXES}")
        if self.sink_by not in SINK_SOURCES:
            raise ValueError(f"sink_by={self.sink_by!r} is not one of {SINK_SOURCES}")
        if not isinstance(self.sink_ratio, (int, float)) or self.sink_ratio <= 1:
            raise ValueError(f"sink_ratio={self.sink_ratio!r} must be a number > 1")
        if not isinstance(self.sink_weight, (int, float)) or not 0 <= self.sink_weight <= 1:
            raise ValueError(f"sink_weight={self.sink_weight!r} must lie in [0, 1]")
        if self.image_sizes is not None:
            self.image_sizes = _sizes(self.image_sizes)


def _sizes(values: Any) -> list[dict[str, int]]:
    """``{"width", "height"}`` per image (serialisable, unambiguous) from images, sizes or
    mappings; a bare pair is refused as ambiguous (:func:`vlm_focus.geometry.as_size`)."""
    if not isinstance(values, list | tuple) or isinstance(values, Size):
        raise ValueError(f"image_sizes={values!r} must list one size per image")
    return [as_size(v, name=f"image_sizes[{i}]")._asdict() for i, v in enumerate(values)]


def trend_positions(tokens: ImageTokens, axis: str) -> torch.Tensor:
    """x for the trend fit: the token's index in the image's 1-D order, or its image row
    offset by view (so views never share a level; cell-less tokens take the previous row)."""
    if axis == "sequence":
        return tokens.member.double()
    rows = fill_cellless(tokens.cells[:, 1].double(), tokens.cells)
    offsets = torch.tensor([0] + [r for r, _ in tokens.layout.grids], dtype=torch.float64)
    return rows + offsets.cumsum(0)[tokens.cells[:, 0].clamp(min=0)]


def padding_weights(tokens: ImageTokens, size: Size, frames: list[Frame]) -> torch.Tensor:
    """Per token, the share of its cell's area that the ``size`` image covers, its view's grid
    spanning ``frames[view]`` (:func:`vlm_focus.geometry.content_fraction`): 0 for pure
    padding, 1 inside the image and for tokens without a cell."""
    weights = torch.ones(tokens.cells.shape[0])
    for view, frame in enumerate(frames):
        fraction = content_fraction(frame, tokens.layout.grids[view], size)
        here = (tokens.cells[:, 0] == view) & (tokens.cells[:, 1] >= 0)
        weights[here] = fraction[tokens.cells[here, 1], tokens.cells[here, 2]]
    return weights


def _frames(layout: Any, size: Size, pad: bool | None, adapter: ModelAdapter) -> list[Frame]:
    """The views' frames: the base view padded to a square (``pad``), the whole image (not
    padded), or the adapter's fallback geometry (``None``)."""
    if pad is None:
        return adapter.frames(layout, size)
    return view_frames(layout, size, fallback=("pad", "resize") if pad else ("resize",))


def debias_image(
    scores: torch.Tensor,
    x: torch.Tensor,
    suppress: torch.Tensor,
    *,
    positional: bool,
    trend: str,
) -> torch.Tensor:
    """Scores of one image after the fixes: ``s / t(x) * m`` with ``t`` fitted on the
    unsuppressed tokens (``m = 1``) and rescaled to keep their mass, ``m`` the suppression
    multipliers (padding content share, sink weight)."""
    scores = scores.float()
    out = scores
    fit = suppress >= 1.0
    if positional and int(fit.sum()) >= 2:
        t = fit_trend(scores, x, trend, fit_mask=fit)
        flat = scores / t.clamp(min=1e-12)
        scale = float(scores[fit].sum()) / max(float(flat[fit].sum()), 1e-12)
        out = flat * scale
    return out * suppress


@register_pruner
class DebiasedPruner(Pruner):
    """Debiased attention pruning: a wrapper over any attention-based pruner (``base``).

    ``score'[s] = score[s] / t(x_s) * m_s``. ``t`` is the positional trend fitted per image
    at run time on the current input (``exp``: ``log score = a + b x`` robust least squares;
    ``monotone``: isotonic fit of per-row / per-bin medians), against ``x`` = the token's 1-D
    order in the image or its image row, so recency no longer favours the lower image rows;
    it is rescaled to keep the image's mass. ``m_s`` suppresses sinks: padding patches get the
    share of their cell the original image covers (0 for pure padding; from the image size and
    :mod:`vlm_focus.geometry`: ``pad_to_square``, else the adapter's fallback), and sink
    tokens — peak |activation| or attention score above ``sink_ratio`` times the image
    median — get ``sink_weight``.
    ``positional``, ``padding`` and ``sinks`` switch each fix.

    Example::

        vf.wrap(model, pruner="debiased", base="text", keep=0.25, layer=2, sinks=False)
    """

    name = "debiased"
    Options = DebiasedOptions
    summary = "base attention scores with the positional trend divided out, sinks/padding muted"
    before_llm = reads_layer_attention = reads_whole_prompt = serves_video = True

    def __init__(self, config: Any, options: DebiasedOptions) -> None:
        super().__init__(config, options)
        base_cls = get_pruner(options.base)
        try:
            base_options = base_cls.Options(**options.base_options)
        except TypeError as err:
            raise ValueError(
                f"base_options {sorted(options.base_options)} do not fit pruner "
                f"'{options.base}'; allowed: {base_cls.option_names()}"
            ) from err
        self.base = base_cls(config, base_options)

    def attach(self, model: nn.Module, adapter: ModelAdapter) -> list[Any]:
        return self.base.attach(model, adapter)

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        opts = self.options
        raw = self.base.select(ctx, n_keep).scores.float().cpu()
        out = raw.clone()
        peak = ctx.hidden.detach().abs().amax(-1).float().cpu()  # [B, S] massive activations
        for row in image_tokens(ctx):
            for tokens in row:
                b, local = tokens.row, tokens.local
                if local.numel() == 0:
                    continue
                scores = raw[b, local]
                suppress = torch.ones(local.numel())
                size = tokens.layout.image_size
                if opts.image_sizes is not None:
                    if tokens.image >= len(opts.image_sizes):
                        raise ValueError(
                            f"image_sizes lists {len(opts.image_sizes)} images; the batch has more"
                        )
                    size = Size(**opts.image_sizes[tokens.image])
                if opts.padding and size is not None:
                    frames = _frames(tokens.layout, size, opts.pad_to_square, ctx.adapter)
                    suppress = suppress * padding_weights(tokens, size, frames)
                if opts.sinks:
                    sink = torch.zeros(local.numel(), dtype=torch.bool)
                    if opts.sink_by in ("activation", "both"):
                        sink |= ratio_outliers(peak[b, local], opts.sink_ratio)
                    if opts.sink_by in ("attention", "both"):
                        sink |= ratio_outliers(scores, opts.sink_ratio)
                    suppress[sink] = torch.clamp(suppress[sink], max=opts.sink_weight)
                x = trend_positions(tokens, opts.axis)
                out[b, local] = debias_image(
                    scores, x, suppress, positional=opts.positional, trend=opts.trend
                )
        return Selection(scores=out.to(ctx.hidden.device))
