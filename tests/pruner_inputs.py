"""Constructed StageContexts whose attention is known exactly.

A fake decoder layer with an identity norm, ``q = hidden[..., 0:4]`` and ``k = hidden[..., 4:8]``
(one head, scaling 1) and identity RoPE: the attention of a query row to key ``s`` is
``softmax(q . k_s)``, so a test writes the scores it wants straight into the hidden states.
Dims 8 and 9 carry nothing the attention sees (room for norms and massive activations).
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_focus.config import FocusConfig
from vlm_focus.model_adapters import ImageLayout, get_adapter
from vlm_focus.model_adapters.base import grid_cells
from vlm_focus.model_adapters.llava import LLAVA
from vlm_focus.pruners import StageContext

WIDTH, HEAD = 10, 4


def _selector(start: int) -> nn.Linear:
    linear = nn.Linear(WIDTH, HEAD, bias=False)
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[torch.arange(HEAD), torch.arange(start, start + HEAD)] = 1.0
    return linear


class FakeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = _selector(0), _selector(HEAD)
        self.head_dim, self.scaling = HEAD, 1.0


class FakeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Identity()
        self.self_attn = FakeAttention()
        self.requires_grad_(False)


def make_ctx(
    hidden: torch.Tensor,
    layouts: list[list[ImageLayout]],
    *,
    valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    config: FocusConfig | None = None,
    adapter=LLAVA,
    stage_index: int = 0,
) -> StageContext:
    """A StageContext over ``hidden [B, S, 10]``; ``positions`` (original, default arange)
    lets a test describe an already pruned sequence."""
    batch, seq, _ = hidden.shape
    if positions is None:
        positions = torch.arange(seq).expand(batch, seq)
    visual = torch.zeros(batch, seq, dtype=torch.bool)
    for b, images in enumerate(layouts):
        for image in images:
            visual[b] |= torch.isin(positions[b], image.positions)
    valid = torch.ones(batch, seq, dtype=torch.bool) if valid is None else valid
    return StageContext(
        model=nn.Module(),
        adapter=adapter,
        config=config or FocusConfig(query_rows="last"),  # the tests plant the last row's q
        layer_index=2,
        stage_index=stage_index,
        decoder_layer=FakeLayer(),
        hidden=hidden,
        cos=torch.ones(batch, seq, HEAD),
        sin=torch.zeros(batch, seq, HEAD),
        positions=positions,
        visual=visual & valid,
        valid=valid,
        layout=layouts,
        inputs={},
    )


def grid_layout(start: int, rows: int, cols: int, **kw) -> ImageLayout:
    """One image of ``rows x cols`` tokens at positions ``start, start + 1, ...``."""
    return ImageLayout(
        torch.arange(start, start + rows * cols), grid_cells(rows, cols), [(rows, cols)], **kw
    )


def single_image(log_scores: torch.Tensor, n_before: int = 2, n_after: int = 4):
    """``hidden [1, S, 10]`` for text, one image whose last-token attention is proportional to
    ``exp(log_scores)`` (flattened row-major), then text; the last token's q is ``e_0``."""
    n = log_scores.numel()
    seq = n_before + n + n_after
    hidden = torch.zeros(1, seq, WIDTH)
    hidden[0, n_before : n_before + n, HEAD] = log_scores.flatten()
    hidden[0, -1, 0] = 1.0
    return hidden


def top_cells(scores: torch.Tensor, ctx: StageContext, count: int) -> set[int]:
    """In-image indices (position - image start) of the ``count`` best visual tokens of row 0."""
    ranked = scores[0].float().masked_fill(~ctx.visual[0], float("-inf"))
    start = int(ctx.layout[0][0].positions[0])
    return set((ctx.positions[0, ranked.topk(count).indices] - start).tolist())


def adapter_for(model) -> object:
    return get_adapter(model)
