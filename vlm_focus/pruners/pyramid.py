"""Pyramid token pruning (PTP): region budgets from bottom-up saliency, token ranks from
vision-encoder attention fused with top-down instruction relevance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner
from ..kernels import score_and_select
from ..model_adapters import ModelAdapter
from ._common import ImageTokens, fill_cellless, image_tokens, rank_scores, row_counts
from ._math import split_budget, tile_index

BOTTOM_UP = ("auto", "encoder", "norm")


@dataclass
class PyramidOptions:
    alpha: float = option(0.5, "weight of top-down (LLM) relevance vs bottom-up, [0, 1]")
    min_per_region: int = option(1, "tokens every region keeps")
    tiles: int = option(2, "regions per side on grids without crops (tiles x tiles)")
    bottom_up: str = option(
        "auto", "'encoder' [CLS] attention, 'norm' proxy, or 'auto' (encoder if any)"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha!r} must lie in [0, 1]")
        for name, low in (("min_per_region", 0), ("tiles", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if self.bottom_up not in BOTTOM_UP:
            raise ValueError(f"bottom_up={self.bottom_up!r} is not one of {BOTTOM_UP}")


def cls_attention(layer: nn.Module, hidden: torch.Tensor, adapter: ModelAdapter) -> torch.Tensor:
    """``[N, T-1]``: the head-mean attention of the [CLS] token (index 0) to every patch in a
    vision encoder layer, from that layer's own norm and q/k (no eager attention needed),
    through the score-and-select dispatch."""
    attn = getattr(layer, adapter.vision_attention)
    normed = getattr(layer, adapter.vision_norm)(hidden)  # [N, T, C]
    n, tokens, _ = normed.shape
    heads, dim = attn.num_heads, attn.head_dim
    q = attn.q_proj(normed[:, :1]).view(n, 1, heads, dim).transpose(1, 2)  # [N, H, 1, Dh]
    k = attn.k_proj(normed).view(n, tokens, heads, dim).transpose(1, 2)  # [N, H, T, Dh]
    patches = torch.ones(n, tokens, dtype=torch.bool, device=hidden.device)
    patches[:, 0] = False
    scores, _ = score_and_select(
        q,
        k,
        patches,
        1,
        scaling=attn.scale,
        query_pos=torch.full((n, 1), tokens - 1, device=hidden.device),
        reduce="mean",
    )
    return scores[:, 1:].float()


class _EncoderCapture:
    """A pre-hook on the vision layer whose output the LLM reads; keeps its latest CLS map."""

    def __init__(self) -> None:
        self.maps: torch.Tensor | None = None  # [crops, patches]

    def attach(self, model: nn.Module, adapter: ModelAdapter) -> list[Any]:
        layers = adapter.vision_encoder_layers(model)
        if layers is None:
            return []
        feature = getattr(model.config, adapter.feature_layer_attr, -1)
        if isinstance(feature, (list, tuple)):
            feature = feature[-1]
        # hidden_states[i] is the output of layer i - 1: the layer that produced the features.
        index = max(0, feature % (len(layers) + 1) - 1)
        layer = layers[index]

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                self.maps = cls_attention(layer, hidden, adapter).cpu()

        return [layer.register_forward_pre_hook(hook, with_kwargs=True)]


def bottom_up_saliency(
    ctx: StageContext, maps: torch.Tensor | None, mode: str
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor | None]]]:
    """Per row and image: token saliency ``b`` of the present tokens, and the base-image map
    (``[rows, cols]``, or None) for images made of several crops."""
    images = [img for row in ctx.layout for img in row]
    offsets = [0]
    for img in images:
        offsets.append(offsets[-1] + img.n_crops)
    usable = (
        mode != "norm"
        and maps is not None
        and maps.shape[0] == offsets[-1]
        and all(img.patches is not None for img in images)
    )
    if mode == "encoder" and not usable:
        raise ValueError(
            "bottom_up='encoder' needs a vision encoder with a [CLS] token declared by the "
            f"'{ctx.adapter.model_type}' adapter; use bottom_up='norm' or 'auto'"
        )
    norms = ctx.hidden.detach().float().norm(dim=-1).cpu()  # [B, S] norm proxy
    saliency, bases = [], []
    for row in image_tokens(ctx):
        row_sal, row_base = [], []
        for tokens in row:
            if usable:
                patches = tokens.layout.patches[tokens.member]
                has = patches[:, 1] >= 0
                values = torch.zeros(patches.shape[0])
                crop = offsets[tokens.image] + patches[has, 0]
                values[has] = maps[crop, patches[has, 1]]
                values = fill_cellless(values, torch.where(has[:, None], tokens.cells, -1))
                base = None
                if tokens.layout.n_crops > 1:
                    rows, cols = tokens.layout.grids[0]
                    base = maps[offsets[tokens.image]].view(rows, cols)
            else:
                values = norms[tokens.row, tokens.local]
                base = None
            row_sal.append(values)
            row_base.append(base)
        saliency.append(row_sal)
        bases.append(row_base)
    return saliency, bases


def region_ids(tokens: ImageTokens, tiles: int) -> torch.Tensor:
    """Region of each present token: its encoder crop when the image has several (LLaVA-NeXT
    base image and anyres crops), else a ``tiles x tiles`` tile of its view's grid (one set of
    tiles per view / frame). Cell-less tokens join the region of the token before them."""
    cells = tokens.cells
    patches = tokens.layout.patches
    if tokens.layout.n_crops > 1 and patches is not None:
        crop = patches[tokens.member, 0].double()
        return fill_cellless(crop, cells).long()
    grids = torch.tensor(tokens.layout.grids)  # [views, 2]
    view = cells[:, 0].clamp(min=0)
    size = grids[view]  # [n, 2] (rows, cols) of each token's view
    tile = tile_index(
        cells[:, 1].clamp(min=0), cells[:, 2].clamp(min=0), size[:, 0], size[:, 1], tiles
    )
    ids = view * tiles**2 + tile  # one set of tiles per view
    return fill_cellless(ids.double(), cells).long()


def global_saliency(
    tokens: ImageTokens, values: torch.Tensor, base: torch.Tensor | None
) -> torch.Tensor:
    """Saliency comparable across an image's regions. Crops of the hi-res view read the base
    image's map at their location, scaled by the cell-area ratio (each crop's own CLS map sums
    to ~1 and says nothing about the crop's share of the picture). Tokens without a cell
    (newlines, CLS) add nothing to a region's mass."""
    cells = tokens.cells
    if base is None:
        return values.masked_fill(cells[:, 1] < 0, 0.0)
    out = values.clone()
    grids = tokens.layout.grids
    for view in range(1, len(grids)):
        here = (cells[:, 0] == view) & (cells[:, 1] >= 0)
        if not here.any():
            continue
        rows, cols = grids[view]
        y = torch.div(cells[here, 1] * base.shape[0], rows, rounding_mode="floor")
        x = torch.div(cells[here, 2] * base.shape[1], cols, rounding_mode="floor")
        out[here] = base[y, x] * (base.numel() / (rows * cols))
    return out.masked_fill(cells[:, 1] < 0, 0.0)


def fuse(bottom: torch.Tensor, top: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1 - alpha) b / sum b + alpha a / sum a`` within one region."""
    b = bottom.float() / bottom.float().sum().clamp(min=1e-12)
    a = top.float() / top.float().sum().clamp(min=1e-12)
    return (1.0 - alpha) * b + alpha * a


@register_pruner
class PyramidPruner(Pruner):
    """Pyramid token pruning (PTP, Liang et al., 2025).

    Region level: the row's budget ``n`` is split over regions ``r`` (LLaVA-NeXT: base image
    and each anyres crop; otherwise ``tiles x tiles`` tiles of each grid or frame) as
    ``n_r = m + (n - R m) S_r / sum S`` (capped at the region size, largest remainders), with
    ``S_r`` the bottom-up saliency mass of the region. Token level, inside each region:
    ``f_s = (1 - alpha) b_s / sum_r b + alpha a_s / sum_r a`` with ``b`` the vision encoder's
    [CLS] attention at the feature layer (from its q/k via a hook; the hidden-state norm where
    the encoder has no CLS) and ``a`` the top-down text-to-vision attention at layer K; the
    top ``n_r`` of ``f`` survive. Multi-stage schedules (``layer=(2, 8, 16)``) re-split the
    remaining tokens at each stage.
    """

    name = "pyramid"
    Options = PyramidOptions
    summary = "region budgets by encoder saliency, then [CLS]/norm fused with LLM attention"
    # Before the LLM only the bottom-up half exists: the norm of the LLM-input embeddings.
    before_llm = reads_whole_prompt = True  # one budget split over all the row's regions
    before_llm_options = {"alpha": 0.0, "bottom_up": "norm"}

    @classmethod
    def scores_before_llm(cls, adapter: ModelAdapter) -> bool:
        """Only where ``bottom_up="auto"`` is the norm: an encoder without a [CLS] token (the
        [CLS] attention is read inside the encoder, which a before-LLM backend does not run)."""
        return adapter.vision_layers is None

    def __init__(self, config: Any, options: PyramidOptions) -> None:
        super().__init__(config, options)
        self._capture = _EncoderCapture()

    def attach(self, model: nn.Module, adapter: ModelAdapter) -> list[Any]:
        if self.options.bottom_up == "norm":
            return []
        return self._capture.attach(model, adapter)

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        opts = self.options
        if opts.alpha == 0.0 and ctx.decoder_layer is None:  # before the LLM: no top-down
            top = torch.zeros(ctx.visual.shape)
        else:
            top = ctx.attention_scores(n_keep).scores.float().cpu()  # [B, S]
        saliency, bases = bottom_up_saliency(ctx, self._capture.maps, opts.bottom_up)
        counts = row_counts(ctx, n_keep)
        chosen = []
        for b, row in enumerate(image_tokens(ctx)):
            local, fused, region, glob = [], [], [], []
            n_regions = 0
            for tokens, values, base in zip(row, saliency[b], bases[b], strict=True):
                if tokens.local.numel() == 0:
                    continue
                ids = region_ids(tokens, opts.tiles)
                _, ids = torch.unique(ids, return_inverse=True)
                g = global_saliency(tokens, values, base)
                a = top[b, tokens.local]
                f = torch.zeros(ids.numel())
                for r in range(int(ids.max()) + 1):
                    here = ids == r
                    f[here] = fuse(values[here], a[here], opts.alpha)
                local.append(tokens.local)
                fused.append(f)
                region.append(ids + n_regions)
                glob.append(g)
                n_regions += int(ids.max()) + 1
            local_t, fused_t = torch.cat(local), torch.cat(fused)
            region_t, glob_t = torch.cat(region), torch.cat(glob)
            sizes = torch.bincount(region_t, minlength=n_regions)
            mass = torch.zeros(n_regions, dtype=torch.float64).index_add_(
                0, region_t, glob_t.double()
            )
            budget = split_budget(mass, sizes, counts[b], opts.min_per_region)
            picks = []
            for r in range(n_regions):
                here = torch.nonzero(region_t == r).flatten()
                ranked = torch.sort(fused_t[here], descending=True, stable=True).indices
                best = ranked[: int(budget[r])]  # ties: the lower position
                picks.append(local_t[here[best]])
            chosen.append(torch.cat(picks))
        return Selection(scores=rank_scores(ctx, chosen, top))
