"""Gathering a layer's inputs down to the tokens it holds: sequence gathers, mask slices and the
key masks of a batch whose rows keep different shares. Pure tensor functions, shared by the
prefill and both decode modes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def gather_seq(
    x: torch.Tensor, index: torch.Tensor, dim: int, batch_dim: int | None = None
) -> torch.Tensor:
    """Pick ``index [B, T]`` along sequence dim ``dim`` of ``x``; the batch dim is ``batch_dim``
    (default ``dim - 1``) and a batch of 1 is broadcast first."""
    dim = dim % x.dim()
    batch_dim = dim - 1 if batch_dim is None else batch_dim
    batch = index.shape[0]
    shape = list(x.shape)
    shape[batch_dim] = batch
    x = x.expand(shape)
    view = [1] * x.dim()
    view[batch_dim], view[dim] = batch, index.shape[1]
    full = list(x.shape)
    full[dim] = index.shape[1]
    return x.gather(dim, index.view(view).expand(full))


def execution_device(module: nn.Module, default: torch.device) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when it dispatched the model
    (weights may be offloaded), else the device of its first parameter."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)
    param = next(module.parameters(), None)
    return param.device if param is not None else default


def on_device_of(index: torch.Tensor, x: Any) -> torch.Tensor:
    """``index`` on the device of ``x`` (a layer's inputs follow the layer under a device map)."""
    return index.to(x.device) if isinstance(x, torch.Tensor) else index


def slice_mask(mask: Any, rows: torch.Tensor | None, cols: torch.Tensor) -> Any:
    """Slice a 4-D ``[B, H, Sq, Sk]`` or 2-D ``[B, Sk]`` mask; other mask kinds are rejected."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"vlm_focus cannot slice an attention mask of type {type(mask).__name__}; "
            "use attn_implementation='sdpa', 'eager' or 'flash_attention_2'"
        )
    if mask.dim() == 4:
        if rows is not None:
            mask = gather_seq(mask, rows, 2, batch_dim=0)
        return gather_seq(mask, cols, 3, batch_dim=0)
    if mask.dim() == 2:
        return gather_seq(mask, cols, 1)
    raise ValueError(f"unexpected attention mask with shape {list(mask.shape)}")


def mask_keys(mask: Any, masked: torch.Tensor, n_queries: int, width: int) -> torch.Tensor:
    """``mask`` (4-D ``[B, 1, q, width]``, additive or bool, or ``None`` for plain causal
    attention) with the prompt keys ``masked [B, S']`` (its first ``S'`` columns) masked out."""
    batch, held = masked.shape
    cols = torch.zeros(batch, width, dtype=torch.bool, device=masked.device)
    cols[:, :held] = masked
    cols = cols[:, None, None, :]
    if mask is None:  # causal: query j (the last n_queries of width keys) sees keys <= itself
        keys = torch.arange(width, device=masked.device)
        queries = torch.arange(width - n_queries, width, device=masked.device)
        return (keys[None, :] <= queries[:, None])[None, None] & ~cols
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(
            "vlm_focus: a batch whose rows keep different shares masks keys, which needs a 4-D "
            f"attention mask or none, got {type(mask).__name__}"
        )
    cols = cols.to(mask.device)
    if mask.dtype == torch.bool:
        return mask & ~cols
    return mask.masked_fill(cols, torch.finfo(mask.dtype).min)


def decode_columns(kept: torch.Tensor, full_len: int, width: int) -> torch.Tensor:
    """Columns of a full-width decode mask that a layer holding ``kept`` still has."""
    tail = torch.arange(full_len, width, device=kept.device).expand(kept.shape[0], -1)
    return torch.cat([kept, tail], dim=1)
