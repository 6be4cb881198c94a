"""The one selection rule: which visual tokens a row keeps, given scores and a drop count."""

from __future__ import annotations

import torch


def keep_mask(scores: torch.Tensor, visual: torch.Tensor, drop: int) -> torch.Tensor:
    """``[B, S]`` bool: every row keeps all non-visual tokens and drops its ``drop``
    lowest-scoring visual tokens; ties keep the lower position, as in the kernel."""
    ranked = scores.float().masked_fill(~visual, float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices  # visual first
    last = visual.sum(1, keepdim=True) - drop  # [B, 1]: rank of each row's first dropped token
    dropped = order.gather(1, last + torch.arange(drop, device=scores.device))  # [B, drop]
    return torch.ones_like(visual).scatter(1, dropped, False)


def lowest_visual(scores: torch.Tensor, visual: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: row ``b``'s ``counts[b]`` lowest-scoring visual tokens (the rule of
    :func:`keep_mask`, with a count per row)."""
    ranked = scores.float().masked_fill(~visual, float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices  # visual first
    steps = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, steps)
    first = visual.sum(1, keepdim=True) - counts.to(visual.device)[:, None]
    return visual & (rank >= first)


def selected_keep(
    scores: torch.Tensor, kept: torch.Tensor | None, visual: torch.Tensor, drop: int
) -> torch.Tensor:
    """``[B, S]`` bool for a pruner's selection: its own top ``kept [B, n_keep]`` when it gives
    them (only when every row keeps the same count), else :func:`keep_mask` on its scores."""
    if kept is not None:
        return (~visual).scatter(1, kept.to(visual.device), True)
    return keep_mask(scores.to(visual.device), visual, drop)


def kept_columns(keep: torch.Tensor, n_kept: int) -> torch.Tensor:
    """``[B, n_kept]`` indices of the kept entries of ``keep [B, S]``, ascending (every row
    keeps ``n_kept``): a stable sort puts the kept (key 0) first, in their order."""
    return torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :n_kept]


def frame_shares(scores: torch.Tensor, visual: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Scores whose top ``n`` over a row take the same share of every frame: each visual token
    scores ``-(rank in its frame + 0.5) / frame size`` (rank 0 = its frame's best). Batched on
    the device: sort by score, then stably by frame, and count ranks from each frame's start."""
    batch, seq = scores.shape
    n_frames = seq + 1  # frame ids lie in [0, seq); text and padding form one last block
    frame = torch.where(visual, frames, seq)
    by_score = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices
    by_frame = torch.sort(frame.gather(1, by_score), dim=1, stable=True).indices
    order = by_score.gather(1, by_frame)  # frame by frame, best first within each
    sorted_frame = frame.gather(1, order)
    sizes = torch.zeros(batch, n_frames, dtype=torch.long, device=scores.device)
    sizes.scatter_add_(1, frame, torch.ones_like(frame))
    starts = sizes.cumsum(1) - sizes
    rank = torch.arange(seq, device=scores.device) - starts.gather(1, sorted_frame)
    share = -(rank.float() + 0.5) / sizes.gather(1, sorted_frame).float()
    out = torch.empty_like(share).scatter(1, order, share)
    return out.masked_fill(~visual, float("-inf"))
