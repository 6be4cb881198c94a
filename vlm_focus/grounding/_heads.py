"""Localization heads: the few attention heads whose maps point at the queried object.

Selection follows the localization-head recipe: rank every (layer, head) by the attention mass
its query rows put on the image, averaged over a calibration set; cut the ranking at its elbow
(the point farthest below the chord from the largest to the smallest mass); among the heads
above the cut keep the ``top_k`` with the lowest spatial entropy (sharpest maps). Select once,
save with :func:`save_heads`, load per model with :func:`load_heads`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.probe import attention_layers
from ..model_adapters import get_adapter
from ._image_attention import probe_forward, query_row_weights, token_attention
from ._token_masks import Query, query_tokens


@dataclass
class LocalizationHeads:
    """Selected heads of one model: ``heads`` as ``(layer, head)`` pairs, best first."""

    model_type: str
    n_layers: int
    n_heads: int
    heads: list[tuple[int, int]]
    mass: list[list[float]] = field(default_factory=list)  # [L, H] mean image mass
    entropy: list[list[float]] = field(default_factory=list)  # [L, H] mean spatial entropy
    elbow: int = 0  # heads ranked before the cut (by mass)

    def by_layer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, head in self.heads:
            out.setdefault(layer, []).append(head)
        return out


def entropy(grid: torch.Tensor) -> float:
    """Shannon entropy (nats) of a non-negative map normalised to sum 1."""
    p = grid.flatten().double().clamp(min=0)
    total = p.sum()
    if total <= 0:
        return math.log(max(p.numel(), 1))
    p = p / total
    return float(-(p * p.clamp(min=1e-30).log()).sum())


def elbow_index(values: Sequence[float]) -> int:
    """Number of items to keep from a descending sequence: the items before its elbow.

    The elbow is the point with the largest distance below the chord joining the first and last
    values (kneedle), i.e. the first point of the flat tail; a sequence of fewer than three
    values, or one without an elbow, keeps everything.
    """
    v = torch.as_tensor(list(values), dtype=torch.float64)
    n = v.numel()
    if n < 3:
        return n
    x = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    span = v[0] - v[-1]
    if span <= 0:
        return n
    y = (v - v[-1]) / span  # 1 -> 0
    chord = 1.0 - x
    gap = chord - y
    return max(1, int(torch.argmax(gap))) if bool(gap.max() > 0) else n


def rank_heads(mass: torch.Tensor, spread: torch.Tensor, top_k: int) -> tuple[list, int]:
    """Heads ``[(layer, head)]`` chosen from ``mass [L, H]`` and entropy ``spread [L, H]``."""
    n_layers, n_heads = mass.shape
    order = torch.argsort(mass.flatten(), descending=True, stable=True)
    keep = elbow_index(mass.flatten()[order].tolist())
    candidates = order[:keep]
    by_entropy = candidates[torch.argsort(spread.flatten()[candidates], stable=True)]
    chosen = by_entropy[:top_k].tolist()
    return [(i // n_heads, i % n_heads) for i in chosen], keep


def select_localization_heads(
    model: nn.Module,
    calibration: Iterable[Mapping[str, Any] | tuple[Mapping[str, Any], Query]],
    *,
    top_k: int = 3,
    processor: Any = None,
    layers: Sequence[int] | None = None,
) -> LocalizationHeads:
    """Pick localization heads on a calibration set.

    Args:
        calibration: processor outputs, or ``(inputs, query)`` pairs (query as in
            :func:`heatmap`; default the instruction tokens).
        top_k: heads to keep after the elbow cut, lowest spatial entropy first.
        processor: the processor (or its tokenizer) for phrase queries.

    For head ``(l, h)``, image mass ``m = mean_samples sum_{v visual} a_{l,h}(v)`` (query rows
    averaged) and spatial entropy ``H = mean_samples -sum_c p_c log p_c`` of its map normalised
    to ``p``. Heads are ranked by ``m``, cut at the elbow, and sorted by ``H``.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    adapter = get_adapter(model)
    n_layers = len(adapter.decoder_layers(model))
    mass_sum = spread_sum = None
    count = 0
    for item in calibration:
        inputs, query = item if isinstance(item, tuple) else (item, None)
        full, queried = query_tokens(model, inputs, query, processor)
        probed = probe_forward(model, full, queried, layers)
        per_head = token_attention(probed, query_row_weights(probed, queried), per_head=True)
        for row in per_head:
            for x in row:  # [L, H, n]
                mass = x.sum(-1).cpu().double()
                spread = torch.tensor(
                    [[entropy(x[i, j]) for j in range(x.shape[1])] for i in range(x.shape[0])],
                    dtype=torch.float64,
                )
                mass_sum = mass if mass_sum is None else mass_sum + mass
                spread_sum = spread if spread_sum is None else spread_sum + spread
                count += 1
    if count == 0:
        raise ValueError("the calibration set is empty")
    mass = mass_sum / count
    spread = spread_sum / count
    chosen, keep = rank_heads(mass, spread, top_k)
    probed_layers = probed.layers
    heads = [(probed_layers[layer], head) for layer, head in chosen]
    full_mass = torch.full((n_layers, mass.shape[1]), float("nan"), dtype=torch.float64)
    full_spread = full_mass.clone()
    full_mass[probed_layers] = mass
    full_spread[probed_layers] = spread
    return LocalizationHeads(
        model_type=adapter.model_type,
        n_layers=n_layers,
        n_heads=int(mass.shape[1]),
        heads=heads,
        mass=full_mass.tolist(),
        entropy=full_spread.tolist(),
        elbow=keep,
    )


def save_heads(heads: LocalizationHeads, path: str | Path) -> Path:
    """Write selected heads as JSON (``model_type``, shape, heads, per-head statistics)."""
    if not isinstance(heads, LocalizationHeads):
        raise TypeError(f"expected LocalizationHeads, got {type(heads).__name__}")
    path = Path(path)
    data = asdict(heads)
    data["heads"] = [list(p) for p in heads.heads]
    data["mass"] = [[None if v != v else v for v in row] for row in heads.mass]
    data["entropy"] = [[None if v != v else v for v in row] for row in heads.entropy]
    path.write_text(json.dumps(data, indent=1))
    return path


def load_heads(path: str | Path, model: nn.Module | None = None) -> LocalizationHeads:
    """Read heads saved by :func:`save_heads`; with ``model``, check they fit it."""
    data = json.loads(Path(path).read_text())
    nan = float("nan")
    heads = LocalizationHeads(
        model_type=data["model_type"],
        n_layers=int(data["n_layers"]),
        n_heads=int(data["n_heads"]),
        heads=[(int(a), int(b)) for a, b in data["heads"]],
        mass=[[nan if v is None else v for v in row] for row in data.get("mass", [])],
        entropy=[[nan if v is None else v for v in row] for row in data.get("entropy", [])],
        elbow=int(data.get("elbow", 0)),
    )
    if model is not None:
        adapter = get_adapter(model)
        layers = adapter.decoder_layers(model)
        first = attention_layers(model)[0]  # a hybrid's layer 0 may have no attention
        n_heads = getattr(layers[first], adapter.attention).config.num_attention_heads
        if (heads.model_type, heads.n_layers, heads.n_heads) != (
            adapter.model_type,
            len(layers),
            n_heads,
        ):
            raise ValueError(
                f"{path}: heads for {heads.model_type} ({heads.n_layers} layers x "
                f"{heads.n_heads} heads) do not fit this {adapter.model_type} "
                f"({len(layers)} x {n_heads})"
            )
    return heads
