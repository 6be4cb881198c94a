"""Adaptive routing: zoom only where a cheap first look says the question needs it (LazyMCoT-style).

Every routing statistic is a score ``c`` in ``[0, 1]``; a question is routed to the zoom when
``c < threshold``, so ``threshold = 0`` routes nothing and ``threshold = 1`` routes everything (a
score of exactly 1 included). Two families:

*First-token confidence* (:data:`TOKEN_STATISTICS`): one plain forward pass answers every
question, and its first answer token's distribution ``p = softmax(logits)`` gives

    top1   c = p_(1)              (the probability of the greedy first token)
    margin c = p_(1) - p_(2)      (its lead over the runner-up)

*Attention-map statistics* (:data:`MAP_STATISTICS`), read from the question's attention map
(the :class:`~vlm_focus.grounding.HeatMap` the zoom crops from), with ``p_i`` the share of the
map's mass on grid cell ``i`` of ``n`` (every view's cells) and ``P`` its pixel density:

    peak    c = 1 - max_i p_i                           (a map with a dominant cell is routed)
    entropy c = H(p) / log n,  H(p) = -sum_i p_i log p_i (a concentrated map is routed)
    outside c = 1 - sum_{crops} P / sum P               (the share of the mass outside the crop
                                                         the zoom would take, a region of the
                                                         encoder's input side: a map that the
                                                         zoom's view holds is routed)

A map without mass scores 1 (nothing points anywhere: routed only at ``threshold = 1``). The
map statistics exist only where the zoom can crop: an image that the smallest allowed crop
already covers is never mapped, never routed, and left out of a calibration.

The threshold comes from a held-out calibration set (:func:`calibrate`). Its *hard* cases are
the questions the plain pass gets wrong, and their scores ``s_1 <= ... <= s_n`` are the
calibration scores. For a target recall ``r`` of hard cases, the split-conformal quantile is

    q = s_(k),   k = ceil((n + 1) r)

(``k > n``: every question is routed), and the threshold is the next float above ``q``, so every
calibration hard case with ``s <= q`` is routed. For a new hard case exchangeable with the
calibration ones, ``P(c <= q) >= r``: at least a share ``r`` of the hard cases is zoomed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..geometry import Frame
from ..grounding import HeatMap

#: Statistics of the plain answer's first token (one plain pass answers every question).
TOKEN_STATISTICS = ("top1", "margin")
#: Statistics of the question's attention map (one map pass over every question the zoom can crop).
MAP_STATISTICS = ("peak", "entropy", "outside")
STATISTICS = TOKEN_STATISTICS + MAP_STATISTICS


def first_token_confidence(logits: torch.Tensor, statistic: str = "top1") -> torch.Tensor:
    """``[B]`` float64 confidence of the first answer token from its logits ``[B, V]``:
    ``top1 = p_(1)`` or ``margin = p_(1) - p_(2)`` of ``softmax(logits)``."""
    if statistic in MAP_STATISTICS:
        raise ValueError(
            f"statistic={statistic!r} is read from the attention map (zoom.map_statistic); "
            f"the first token gives {TOKEN_STATISTICS}"
        )
    if statistic not in TOKEN_STATISTICS:
        raise ValueError(f"statistic={statistic!r}; allowed: {TOKEN_STATISTICS}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(
            f"logits must be [batch, vocab] with vocab >= 2, got {getattr(logits, 'shape', None)}"
        )
    probs = logits.detach().double().softmax(-1)
    top = probs.topk(2, dim=-1).values  # [B, 2]
    return top[:, 0] if statistic == "top1" else top[:, 0] - top[:, 1]


def check_statistic(statistic: str) -> str:
    if statistic not in STATISTICS:
        raise ValueError(
            f"statistic={statistic!r}; allowed: {STATISTICS} (first token: {TOKEN_STATISTICS}, "
            f"attention map: {MAP_STATISTICS})"
        )
    return statistic


def cell_statistic(cells: torch.Tensor, statistic: str) -> float:
    """``peak = 1 - max_i p_i`` or ``entropy = H(p) / log n`` of the cell masses ``cells``
    (any shape, ``n`` values >= 0), ``p = cells / cells.sum()``; 1 for a map without mass
    (and ``entropy`` 0 for a single cell)."""
    if statistic not in ("peak", "entropy"):
        raise ValueError(f"statistic={statistic!r}; cell statistics: ('peak', 'entropy')")
    values = cells.detach().double().flatten()
    if values.numel() == 0:
        raise ValueError("the map has no cells")
    if not torch.isfinite(values).all() or (values < 0).any():
        raise ValueError("cell masses must be finite and >= 0")
    total = float(values.sum())
    if total <= 0:
        return 1.0
    p = values / total
    if statistic == "peak":
        return float(1.0 - p.max())
    if values.numel() == 1:
        return 0.0
    nonzero = p[p > 0]
    return float(-(nonzero * nonzero.log()).sum() / math.log(values.numel()))


def outside_share(pixels: torch.Tensor, crops: Sequence[Frame]) -> float:
    """``1 - sum_{crops} P / sum P``: the share of the pixel density ``pixels`` ``[H, W]`` that
    lies outside every crop (whole-pixel :class:`~vlm_focus.geometry.Frame` values, their union
    counted once); 1 for a map without mass."""
    if pixels.dim() != 2:
        raise ValueError(f"pixels must be [height, width], got {tuple(pixels.shape)}")
    if not crops:
        raise ValueError("outside_share needs at least one crop")
    density = pixels.detach().double().clamp_min(0)
    total = float(density.sum())
    if total <= 0:
        return 1.0
    inside = torch.zeros_like(density, dtype=torch.bool)
    for crop in crops:
        x0, y0, x1, y1 = (int(round(v)) for v in crop.xyxy)
        inside[max(y0, 0) : max(y1, 0), max(x0, 0) : max(x1, 0)] = True
    return float(min(max(1.0 - float(density[inside].sum()) / total, 0.0), 1.0))


def map_statistic(heat: HeatMap, statistic: str, crops: Sequence[Frame] | None = None) -> float:
    """The routing score of a question's attention map ``heat`` (:data:`MAP_STATISTICS`, see
    the module's formulas): ``peak`` and ``entropy`` over every view's grid cells, ``outside``
    over the pixel map and the zoom's ``crops`` of that map (:func:`~vlm_focus.zoom.choose_crops`).
    """
    if statistic not in MAP_STATISTICS:
        raise ValueError(f"statistic={statistic!r}; attention-map statistics: {MAP_STATISTICS}")
    if statistic == "outside":
        if crops is None:
            raise ValueError("statistic='outside' needs the zoom's crops of the map (crops=)")
        return outside_share(heat.pixels, crops)
    return cell_statistic(torch.cat([v.flatten() for v in heat.views]), statistic)


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise TypeError(f"threshold={threshold!r} must be a number in [0, 1]")
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold={threshold!r} must lie in [0, 1]")
    return float(threshold)


def route(confidence: Sequence[float] | torch.Tensor, threshold: float) -> list[bool]:
    """Which questions go to the zoom: ``confidence < threshold``; every one at ``threshold=1``."""
    threshold = check_threshold(threshold)
    values = [float(c) for c in confidence]
    if threshold >= 1.0:
        return [True] * len(values)
    return [c < threshold for c in values]


@dataclass
class Calibration:
    """A calibrated routing threshold.

    Attributes:
        threshold: route when the confidence is below it (the float just above ``quantile``,
            at most 1).
        quantile: the conformal quantile ``s_(k)`` of the hard cases' confidences (``inf``
            when ``k > n_hard``: everything is routed).
        recall: the target share of hard cases to route.
        statistic: the routing statistic (:data:`STATISTICS`) the scores came from.
        n, n_hard, k: calibration questions, hard ones among them, and the order statistic used.
        routed: share of all calibration questions the threshold routes.
        hard_routed: share of the calibration hard cases it routes.
    """

    threshold: float
    quantile: float
    recall: float
    statistic: str
    n: int
    n_hard: int
    k: int
    routed: float
    hard_routed: float

    def to_json(self) -> dict:
        out = asdict(self)
        if math.isinf(self.quantile):
            out["quantile"] = "inf"
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        if data.get("quantile") == "inf":
            data["quantile"] = math.inf
        return cls(**data)


def calibrate(
    confidence: Sequence[float] | torch.Tensor,
    hard: Sequence[bool],
    *,
    recall: float = 0.9,
    statistic: str = "top1",
) -> Calibration:
    """The conformal routing threshold that routes at least a share ``recall`` of hard cases
    (LazyMCoT): ``q = s_(k)``, ``k = ceil((n_hard + 1) recall)`` over the hard cases' sorted
    scores ``s``, threshold = the next float above ``q`` (capped at 1).

    ``confidence``: the routing score (``statistic``, one of :data:`STATISTICS`) of every
    calibration question; ``hard``: whether each is a hard case (by default, in
    :func:`calibrate_model`, the plain answer is wrong).
    """
    check_statistic(statistic)
    if isinstance(recall, bool) or not isinstance(recall, int | float) or not 0 < recall < 1:
        raise ValueError(f"recall={recall!r} must lie in (0, 1)")
    scores = np.asarray([float(c) for c in confidence], dtype=np.float64)
    flags = np.asarray([bool(h) for h in hard], dtype=bool)
    if scores.shape != flags.shape:
        raise ValueError(f"{scores.size} confidences but {flags.size} hard flags")
    if not np.isfinite(scores).all():
        raise ValueError("confidences must be finite")
    n_hard = int(flags.sum())
    if n_hard == 0:
        raise ValueError(
            "the calibration set has no hard case (every plain answer is right): nothing to "
            "calibrate on; use more or harder questions, or set the threshold yourself"
        )
    hard_scores = np.sort(scores[flags])
    k = math.ceil((n_hard + 1) * float(recall))
    if k > n_hard:
        quantile, threshold = math.inf, 1.0
    else:
        quantile = float(hard_scores[k - 1])
        threshold = min(float(np.nextafter(quantile, np.inf)), 1.0)
    routed = np.asarray(route(scores.tolist(), threshold), dtype=bool)
    return Calibration(
        threshold=threshold,
        quantile=quantile,
        recall=float(recall),
        statistic=statistic,
        n=int(scores.size),
        n_hard=n_hard,
        k=int(k),
        routed=float(routed.mean()) if routed.size else 0.0,
        hard_routed=float(routed[flags].mean()),
    )
