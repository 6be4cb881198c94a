"""Adaptive routing: zoom only where the first answer is uncertain (LazyMCoT-style).

One forward pass answers every question plainly; its first answer token's distribution
``p = softmax(logits)`` gives a confidence ``c`` per question:

    top1   c = p_(1)              (the probability of the greedy first token)
    margin c = p_(1) - p_(2)      (its lead over the runner-up)

A question is routed to the zoom when ``c < threshold``; ``threshold = 0`` routes nothing and
``threshold = 1`` routes everything (a confidence of exactly 1 included).

The threshold comes from a held-out calibration set (:func:`calibrate`). Its *hard* cases are
the questions the plain pass gets wrong, and their confidences ``s_1 <= ... <= s_n`` are the
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

STATISTICS = ("top1", "margin")


def first_token_confidence(logits: torch.Tensor, statistic: str = "top1") -> torch.Tensor:
    """``[B]`` float64 confidence of the first answer token from its logits ``[B, V]``:
    ``top1 = p_(1)`` or ``margin = p_(1) - p_(2)`` of ``softmax(logits)``."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}; allowed: {STATISTICS}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(
            f"logits must be [batch, vocab] with vocab >= 2, got {getattr(logits, 'shape', None)}"
        )
    probs = logits.detach().double().softmax(-1)
    top = probs.topk(2, dim=-1).values  # [B, 2]
    return top[:, 0] if statistic == "top1" else top[:, 0] - top[:, 1]


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
        statistic: ``top1`` or ``margin``.
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
    confidences ``s``, threshold = the next float above ``q`` (capped at 1).

    ``confidence``: the plain pass's first-token statistic of every calibration question;
    ``hard``: whether each is a hard case (by default, in :func:`calibrate_model`, the plain
    answer is wrong).
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}; allowed: {STATISTICS}")
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
