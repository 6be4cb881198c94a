"""Fused attention score-and-select: public op, input checks and backend dispatch.

``score_and_select`` is the only way pruners score visual tokens. It runs the Triton kernel
(:mod:`vlm_focus.kernels._triton`) when the tensors are on CUDA and triton imports, and the
pure-torch twin (:mod:`vlm_focus.kernels.naive`) otherwise. ``VLM_FOCUS_BACKEND=torch|triton``
or ``backend=`` forces one. triton is imported lazily so the package works without it.
"""

from __future__ import annotations

import os

import torch

from .naive import per_query_attention, score_and_select_naive

__all__ = ["per_query_attention", "score_and_select", "triton_available", "warm_up"]

_BACKENDS = ("torch", "triton")


def triton_available() -> bool:
    """True when triton imports and can launch kernels (CUDA, or the CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _pick_backend(backend: str | None, q: torch.Tensor) -> str:
    backend = backend or os.environ.get("VLM_FOCUS_BACKEND") or None
    if backend is None:
        return "triton" if q.is_cuda and triton_available() else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS} (or None for automatic)")
    if backend == "triton" and not triton_available():
        raise ValueError(
            "backend='triton' needs the triton package and a CUDA device "
            "(or TRITON_INTERPRET=1 set before triton is imported); use backend='torch'"
        )
    return backend


def _check_bool(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor of shape {list(shape)}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {list(value.shape)}, expected {list(shape)}")


def score_and_select(
    q: torch.Tensor,
    k: torch.Tensor,
    visual: torch.Tensor,
    n_keep: int,
    *,
    scaling: float,
    key_mask: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    query_weights: torch.Tensor | None = None,
    reduce: str = "mean",
    debias: torch.Tensor | None = None,
    backend: str | None = None,
    n_visual: int | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mass each visual key receives from the query rows, and the top ``n_keep`` keys.

    Args:
        q: query rows after RoPE, ``[B, H, Tq, D]``.
        k: keys after RoPE, ``[B, Hkv, S, D]`` with ``H % Hkv == 0`` (GQA).
        visual: ``[B, S]`` bool, the keys that are visual tokens.
        n_keep: how many visual keys to keep per row, ``1 <= n_keep <= min_b visual[b].sum()``.
        scaling: softmax scale (usually ``head_dim ** -0.5``).
        key_mask: ``[B, S]`` bool, valid keys (False on left padding). Default: all valid.
        query_pos: ``[B, Tq]`` absolute position of each query row; it sees keys ``<= pos``.
            Default: the last ``Tq`` positions.
        query_weights: ``[B, Tq]`` weight per query row. Default: ``1 / Tq``.
        reduce: ``"mean"`` or ``"max"`` over heads.
        debias: ``[B, S]`` multiplier applied to the scores before selection.
        backend: ``None`` (automatic), ``"torch"`` or ``"triton"``.
        n_visual: the fewest valid visual keys of any row, when the caller knows it on the
            host; otherwise it is counted, which makes the host wait for the device.
        allowed: ``[B, Tq, S]`` bool, the keys each query row sees when the layer's mask is
            not plain causal (a sliding window, bidirectional image blocks; see
            :func:`vlm_focus.core.attention.allowed_keys`); it replaces the ``query_pos``
            rule and is combined with ``key_mask``. The Triton kernel reads causal masks
            only, so such a call runs on the torch twin (``backend="triton"`` raises).

    Returns:
        ``scores [B, S]`` float32 (0 where a key is not visual) and ``kept [B, n_keep]`` int64,
        the selected visual positions in ascending order (equal scores at the cut: the lower
        positions are kept, on both backends).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, H, Tq, D] tensor, got {getattr(q, 'shape', type(q))}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [B, Hkv, S, D] tensor, got {getattr(k, 'shape', type(k))}")
    batch, n_heads, n_query, head_dim = q.shape
    _, n_kv, seq, k_dim = k.shape
    if k.shape[0] != batch or k_dim != head_dim:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} disagree on batch or head_dim")
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of kv heads ({n_kv})")
    if n_query == 0:
        raise ValueError("q has no query rows (Tq = 0); pass at least one query row to score with")
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce={reduce!r} is not one of ('mean', 'max')")
    _check_bool("visual", visual, (batch, seq))
    if key_mask is None:
        key_mask = torch.ones(batch, seq, dtype=torch.bool, device=q.device)
    _check_bool("key_mask", key_mask, (batch, seq))
    if n_visual is None:
        n_visual = int((visual & key_mask).sum(-1).min()) if batch else 0
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or not 1 <= n_keep <= n_visual:
        raise ValueError(f"n_keep={n_keep!r} must be an int in [1, {n_visual}] (visual keys/row)")
    if query_pos is None:
        query_pos = torch.arange(seq - n_query, seq, device=q.device).expand(batch, n_query)
    elif tuple(query_pos.shape) != (batch, n_query):
        raise ValueError(
            f"query_pos has shape {list(query_pos.shape)}, expected [{batch}, {n_query}]"
        )
    if query_weights is None:
        query_weights = torch.full((batch, n_query), 1.0 / n_query, device=q.device)
    elif tuple(query_weights.shape) != (batch, n_query):
        raise ValueError(
            f"query_weights has shape {list(query_weights.shape)}, expected [{batch}, {n_query}]"
        )
    if debias is not None and tuple(debias.shape) != (batch, seq):
        raise ValueError(f"debias has shape {list(debias.shape)}, expected [{batch}, {seq}]")
    if allowed is not None:
        _check_bool("allowed", allowed, (batch, n_query, seq))
    visual = visual & key_mask
    args = dict(
        scaling=float(scaling),
        key_mask=key_mask,
        query_pos=query_pos.long(),
        query_weights=query_weights,
        reduce=reduce,
        debias=debias,
    )
    if allowed is not None:
        if backend == "triton":
            raise ValueError(
                "backend='triton' computes causal masks only; a layer with a sliding window or "
                "bidirectional image blocks (allowed=) scores on backend='torch'"
            )
        return score_and_select_naive(q, k, visual, n_keep, allowed=allowed, **args)
    if _pick_backend(backend, q) == "triton":
        from ._triton import score_and_select_triton

        return score_and_select_triton(q, k, visual, n_keep, **args)
    return score_and_select_naive(q, k, visual, n_keep, **args)


def warm_up(
    n_heads: int,
    n_kv: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    reduces: tuple[str, ...] = ("mean",),
    max_seq: int = 16384,
    backend: str | None = None,
) -> int:
    """Compile, ahead of the first request, the kernel variants a model's calls will launch:
    both query-block sizes, every selection tile up to ``max_seq`` keys, with and without a
    debias. Returns the number of warm-up launches (0 where the torch twin serves ``device``).
    The shape integers are not specialised, so these variants cover every batch and length."""
    probe = torch.empty(1, 1, 1, 1, device=device)
    if _pick_backend(backend, probe) != "triton":
        return 0
    launches = 0
    seqs = [s for s in (1024, 2048, 4096, 8192, 16384) if s <= max(1024, max_seq)]
    for reduce in reduces:
        for n_query in (1, 17):  # 16- and 32-row query blocks
            for seq in seqs:
                for with_debias in (False, True):
                    q = torch.zeros(1, n_heads, n_query, head_dim, dtype=dtype, device=device)
                    k = torch.zeros(1, n_kv, seq, head_dim, dtype=dtype, device=device)
                    visual = torch.ones(1, seq, dtype=torch.bool, device=device)
                    debias = torch.ones(1, seq, device=device) if with_debias else None
                    score_and_select(
                        q,
                        k,
                        visual,
                        1,
                        scaling=1.0,
                        reduce=reduce,
                        debias=debias,
                        backend="triton",
                        n_visual=seq,
                    )
                    launches += 1
    return launches
