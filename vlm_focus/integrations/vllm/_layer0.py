"""vlm_focus's registered pruners run on one image or video served by vLLM, at layer 0.

``vf.wrap(model, layer=0, ...)`` scores the visual tokens with layer 0's own input norm, q/k
projections and RoPE, from the prompt's query rows (:class:`~vlm_focus.core.pruner.StageContext`).
Here the same :class:`StageContext` is built from vLLM's modules for one prompt with one image
or video, and the registered pruner itself chooses from it, so the kept cells are the ones
``vf.wrap`` keeps. For the attention pruners (``fastv``, ``text``, ``debiased``):

- hidden states: vLLM's token embedding of the unpruned prompt with the item's embeddings in
  its placeholder rows (layer 0's input);
- q/k: vLLM's fused ``qkv_proj`` split into its q and k parts;
- RoPE: rows of vLLM's own ``cos_sin_cache`` at the unpruned prompt's positions (neox layout,
  which is transformers' ``rotate_half``): ``0..S-1`` for the 1-D RoPE of the LLaVA family;
  for the Qwen-VL M-RoPE, the ``(t, h, w)`` positions ``get_rope_index`` gives the prompt (the
  model class's rule, :mod:`._mrope`), each rotary frequency read at its own channel
  (:func:`mrope_channels`);
- Qwen3's per-head q/k norms, when the layer has them.

Under tensor parallelism each rank projects its own heads; they are gathered, so every rank
scores with all heads and keeps the same cells. Only torch, vLLM and vlm_focus's model-free code
run here (no transformers model classes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)

from ...config import FocusConfig
from ...core.pruner import StageContext
from ...core.selection import frame_shares, keep_mask, selected_keep
from ...geometry import Frame, Size, view_frames
from ...model_adapters import ImageLayout
from ...model_adapters.base import grid_cells
from ...pruners import get_pruner

#: Pruners scored from the LLM's own layer-0 attention to the image.
ATTENTION_PRUNERS = ("fastv", "text", "debiased")


@dataclass(frozen=True)
class VllmLayerAdapter:
    """What :class:`StageContext` asks a model adapter: three things about a decoder layer,
    answered for vLLM's Llama-style layers, and how an image's views sit on it when no processor
    is known (``frames``: the model adapter's ``ModelAdapter.frames``, which ``debiased``'s
    padding fix reads)."""

    frames: Callable[..., list[Frame]] = view_frames
    attention: ClassVar[str] = "self_attn"
    input_norm: ClassVar[str] = "input_layernorm"

    def project_qk(
        self, attention: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, H, Tq, Dh]`` and k ``[B, Hkv, S, Dh]`` before RoPE (vLLM projects q, k and v
        with one fused matrix)."""
        q_size, kv_size, head_dim = attention.q_size, attention.kv_size, attention.head_dim
        ranks = get_tensor_model_parallel_world_size()
        if ranks > 1 and getattr(attention, "total_num_kv_heads", ranks) < ranks:
            raise ValueError(
                "vlm_focus scores attention under tensor parallelism only when every rank holds "
                f"its own kv heads ({attention.total_num_kv_heads} kv heads, {ranks} ranks)"
            )

        def project(x: torch.Tensor, start: int, size: int, norm: str) -> torch.Tensor:
            flat = attention.qkv_proj(x.reshape(-1, x.shape[-1]))[0][:, start : start + size]
            if ranks > 1:  # each rank projects its own heads: every rank scores with all of them
                flat = tensor_model_parallel_all_gather(flat.contiguous(), dim=-1)
            heads = flat.reshape(*x.shape[:2], -1, head_dim)  # [B, T, H, Dh]
            if hasattr(attention, norm):  # Qwen3's per-head q/k RMSNorm, before RoPE
                heads = getattr(attention, norm)(heads)
            return heads.transpose(1, 2)

        return project(q_in, 0, q_size, "q_norm"), project(k_in, q_size, kv_size, "k_norm")


def mrope_channels(rotary: nn.Module, half: int) -> torch.Tensor:
    """``[half]``: the position channel (0 = t, 1 = h, 2 = w) each rotary frequency reads:
    consecutive ``mrope_section`` blocks (Qwen2-VL, Qwen2.5-VL) or, with ``mrope_interleaved``
    (Qwen3-VL), t/h/w in turn over the first ``3 * section`` frequencies, t after."""
    section = getattr(rotary, "mrope_section", None)
    if not section or sum(section) != half:
        raise ValueError(f"M-RoPE sections {section} do not cover {half} rotary frequencies")
    if not getattr(rotary, "mrope_interleaved", False):
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    j = torch.arange(half)
    channel = torch.zeros(half, dtype=torch.long)
    channel[(j % 3 == 1) & (j < 3 * section[1])] = 1
    channel[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return channel


def rope_tables(attention: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[1, S, head_dim]`` float32 at ``positions`` (``[S]``, or ``[3, S]`` for
    M-RoPE) from the layer's own rotary cache, in transformers' layout (each half-table
    repeated; M-RoPE's half-table takes section ``i`` of ``mrope_section`` from channel ``i``)."""
    rotary = attention.rotary_emb
    if not getattr(rotary, "is_neox_style", True) or rotary.rotary_dim != attention.head_dim:
        raise ValueError(
            "vlm_focus scores attention in vLLM only for full-width neox-style RoPE "
            f"(rotary_dim={rotary.rotary_dim}, head_dim={attention.head_dim})"
        )
    table = rotary.cos_sin_cache
    cache = table[positions.to(table.device)].float()  # [S, rot] or [3, S, rot]
    if positions.dim() == 2:
        half = cache.shape[-1] // 2
        channel = mrope_channels(rotary, half).to(table.device)
        index = torch.arange(half, device=table.device)
        cos = cache[channel, :, index].T  # [S, half]: dim j from its section's channel
        sin = cache[channel, :, index + half].T
    else:
        cos, sin = cache.chunk(2, dim=-1)
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]


def build_pruner(config: FocusConfig):
    """The registered pruner ``config.pruner`` with its default options."""
    cls = get_pruner(config.pruner)
    return cls(config, cls.Options())


def grid_layout(rows: int, cols: int, frames: int = 1) -> tuple[torch.Tensor, list]:
    """``(cells [n, 3], grids)`` of an image that is one ``rows x cols`` grid, or of a video of
    ``frames`` such grids (frame by frame, raster order in each; a frame is one view)."""
    cells = torch.cat([grid_cells(rows, cols, view=f) for f in range(frames)])
    return cells, [(rows, cols)] * frames


def layer0_keep(
    pruner,
    embeddings: torch.Tensor,
    layout: tuple[torch.Tensor, list[tuple[int, int]]],
    n_keep: int,
    *,
    language_model: nn.Module | None = None,
    prompt_ids: torch.Tensor | None = None,
    token: int | None = None,
    positions=None,
    kind: str = "image",
    budget: str = "span",
    image_size: Size | None = None,
    adapter: VllmLayerAdapter | None = None,
) -> torch.Tensor:
    """Kept token indices (sorted, the item's own order) of one image or video (``kind``) whose
    LLM-input embeddings are ``embeddings [n, D]`` and whose tokens sit at ``layout = (cells
    [n, 3] (view, row, col), grids)``, selected by the registered ``pruner`` at layer 0 by the
    engine's rule: its own top ``n_keep``, or for a video with ``budget="frame"`` the same
    share of every frame (a video's views).

    An attention pruner reads layer 0 of ``language_model`` (vLLM's decoder: ``embed_input_ids``
    and ``layers``) over ``prompt_ids``: the unpruned prompt, whose ``n`` tokens ``token`` are
    the item's (a single ``token`` stands for all ``n``), at ``positions(ids)`` (``[S]`` or
    M-RoPE's ``[3, S]``; ``None``: ``0..S-1``). Other pruners read the layout alone.
    ``image_size`` (the original image's, when the model's inputs carry it) and ``adapter``
    (the class's :class:`VllmLayerAdapter`) are what ``debiased``'s padding fix reads."""
    cells, grids = layout
    n = cells.shape[0]
    if embeddings.shape[0] != n:
        raise ValueError(f"{embeddings.shape[0]} item embeddings for {n} tokens")
    if n_keep >= n:
        return torch.arange(n)
    device = embeddings.device
    ids = torch.empty(0, dtype=torch.long) if prompt_ids is None else prompt_ids.reshape(-1)
    if ids.numel() == 0:  # the item alone: a pruner that reads no attention
        seq, layer, where = n, None, torch.arange(n)
        hidden = embeddings[None]
        cos = sin = torch.zeros(1, n, 1, device=device)
    else:
        ids = ids.long().cpu()
        where = torch.nonzero(ids == token).flatten()
        if where.numel() == 1 and n > 1:  # the prompt as written: one placeholder
            start = int(where[0])
            ids = torch.cat([ids[:start], torch.full((n,), token), ids[start + 1 :]])
            where = torch.arange(start, start + n)
        if where.numel() != n:
            raise ValueError(
                f"attention scores need one item per prompt ({where.numel()} placeholders for "
                f"{n} tokens)"
            )
        hidden = language_model.embed_input_ids(ids.to(device)).clone()  # [S, D]
        hidden[where.to(device)] = embeddings.to(hidden.dtype)  # layer 0's input
        hidden, seq, layer = hidden[None], ids.shape[0], language_model.layers[0]
        at = torch.arange(seq) if positions is None else positions(ids)
        cos, sin = rope_tables(layer.self_attn, at)
    at_item = where.to(device)
    visual = torch.zeros(1, seq, dtype=torch.bool, device=device)
    visual[0, at_item] = True
    image = ImageLayout(positions=where, cells=cells, grids=grids, image_size=image_size, kind=kind)
    ctx = StageContext(
        model=None,
        adapter=adapter or VllmLayerAdapter(),
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
