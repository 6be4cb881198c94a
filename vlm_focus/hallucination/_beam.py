"""Visual-attention-aware beam search: re-rank candidates by the image attention of their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessor

from ..core.probe import AttentionProbe, Rows
from ._vas import visual_share


class VisualBeam(LogitsProcessor):
    """A ``LogitsProcessor`` and context manager; see :func:`visual_beam`."""

    def __init__(self, model: nn.Module, weight: float, layers: Sequence[int] | None) -> None:
        if not isinstance(weight, int | float) or isinstance(weight, bool):
            raise TypeError(f"weight must be a number, got {weight!r}")
        self.model = model
        self.weight = float(weight)
        self._probe = AttentionProbe(
            model, layers, rows="last", decode=True, on_rows=self._on_rows, keep=False
        )
        self.layers = self._probe.layers
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._step = -1
        self.current: torch.Tensor | None = None  # [B'] visual share of the latest rows
        self.history: list[torch.Tensor] = []

    def __enter__(self) -> VisualBeam:
        self._probe.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the probe's hooks: the model is exactly as before."""
        self._probe.remove()

    def _on_rows(self, rows: Rows) -> None:
        if rows.step != self._step:
            self._step, self._sum, self._count = rows.step, None, 0
            if rows.step == 0:
                self.history = []
        share = visual_share(rows.probs, self._probe.prefill.visual, rows.mask).mean(-1)  # [B']
        self._sum = share if self._sum is None else self._sum + share
        self._count += 1
        if self._count == len(self.layers):
            self.current = self._sum / self._count
            self.history.append(self.current)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._probe.tracker is None:
            raise RuntimeError("use visual_beam(...) as a context manager around generate()")
        if self.current is None or self.current.shape[0] != scores.shape[0]:
            raise RuntimeError("no visual attention recorded for this step")
        return scores + self.weight * self.current.to(scores.dtype)[:, None]


def visual_beam(
    model: nn.Module, *, weight: float = 1.0, layers: Sequence[int] | None = None
) -> VisualBeam:
    """Beam search re-ranked by visual attention.

    Each step adds ``weight * m_t`` to every candidate extending a beam, where ``m_t`` is the
    visual attention share (VAS, mean over ``layers`` and heads) of the beam's latest token,
    computed from the cache at decode time. Beam scores are cumulative, so a finished candidate
    ``y`` is ranked by::

        sum_t log p(y_t | y_<t)  +  weight * sum_t m_t(y)

    the log-likelihood plus the image attention mass its tokens paid. Usage::

        with visual_beam(model, weight=2.0) as proc:
            model.generate(**inputs, num_beams=3, logits_processor=[proc])
    """
    return VisualBeam(model, weight, layers)
