"""Visual-attention-aware beam search: re-rank candidates by the image attention of their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LogitsProcessor

from ..core.options import option
from ..core.probe import AttentionProbe, Rows
from ._vas import visual_share
from .registry import Mitigation, check_numbers, register_mitigation


@dataclass
class VisualBeamOptions:
    """The options of :func:`visual_beam`."""

    weight: float = option(1.0, "added to a candidate's score per unit of its tokens' visual share")
    layers: list[int] | None = option(
        None, "decoder layers whose attention is read (none: every layer)"
    )

    def __post_init__(self) -> None:
        check_numbers(self, "weight")


@register_mitigation
class VisualBeam(Mitigation, LogitsProcessor):
    """A ``LogitsProcessor`` and context manager; see :func:`visual_beam`."""

    name = "visual_beam"
    Options = VisualBeamOptions
    summary = "beam search re-ranked by the visual attention of each candidate's tokens"
    generate_args = {"num_beams": 3}

    def __init__(self, model: nn.Module, options: VisualBeamOptions) -> None:
        self.model = model
        self.weight = float(options.weight)
        self._probe = AttentionProbe(
            model, options.layers, rows="last", decode=True, on_rows=self._on_rows, keep=False
        )
        self.layers = self._probe.layers
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._step = -1
        self.current: torch.Tensor | None = None  # [B'] visual share of the latest rows
        self.history: list[torch.Tensor] = []

    def attach(self) -> None:
        self._probe.attach()

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
    model: nn.Module,
    *,
    weight: float = VisualBeamOptions.weight,
    layers: Sequence[int] | None = VisualBeamOptions.layers,
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
    return VisualBeam(model, VisualBeamOptions(weight=weight, layers=layers))
