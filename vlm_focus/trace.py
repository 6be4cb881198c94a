"""``FocusTrace``: what the last pruned prefill did, in ORIGINAL sequence positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StageTrace:
    """One pruning stage: ``kept[b]`` are the original positions of row b's visual tokens
    that survive this stage (sorted); ``scores[b]`` scores the visual tokens the stage saw."""

    layer: int
    kept: list[torch.Tensor]
    scores: list[torch.Tensor]
    candidates: list[torch.Tensor]  # [b]: original positions the stage chose from


@dataclass
class FocusTrace:
    """Record of the last prefill.

    Attributes:
        kept: per row, original positions of the visual tokens kept after the last stage.
        stages: one :class:`StageTrace` per stage.
        n_visual: per row, the number of visual tokens in the input.
        visual_positions: per row, original positions of all visual tokens.
        scores: per row, the first stage's score of each visual token (aligned with
            ``visual_positions``).
        sequence: ``[B, S']`` original positions of every token the last layers still see
            (text, padding and kept visual tokens); logits of a pruned forward line up with it.
        seconds: wall time spent scoring and selecting.
    """

    n_visual: list[int]
    visual_positions: list[torch.Tensor]
    stages: list[StageTrace] = field(default_factory=list)
    sequence: torch.Tensor | None = None
    seconds: float = 0.0

    @property
    def kept(self) -> list[torch.Tensor]:
        if not self.stages:
            return list(self.visual_positions)
        return self.stages[-1].kept

    @property
    def scores(self) -> list[torch.Tensor]:
        return self.stages[0].scores if self.stages else []

    @property
    def n_kept(self) -> list[int]:
        return [int(k.numel()) for k in self.kept]
