"""``FocusTrace``: what the last pruned prefill did, in ORIGINAL sequence positions.

The engine records device tensors and CUDA events only; the per-row lists and the scoring time
are built when they are first read, so recording never makes the host wait for the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class StageTrace:
    """One pruning stage, recorded as ``[B, S]`` tensors over the sequence the stage saw.

    ``kept[b]``: original positions of row b's visual tokens that survive this stage (sorted);
    ``scores[b]``: the stage's score of each visual token it saw; ``candidates[b]``: the
    original positions it chose from (aligned with ``scores[b]``).
    """

    layer: int
    positions: torch.Tensor  # [B, S] original positions of the tokens the stage saw
    visual: torch.Tensor  # [B, S] bool: its candidates
    keep: torch.Tensor  # [B, S] bool: what it kept (text and padding included)
    score_values: torch.Tensor  # [B, S] scores (non-visual entries meaningless)
    # [B, S] bool: kept in the row's slots but masked as keys (a batch row that keeps its own
    # share while the batch keeps one length), or None
    masked: torch.Tensor | None = None

    @cached_property
    def _host(self) -> tuple[torch.Tensor, ...]:
        keep = self.keep if self.masked is None else self.keep & ~self.masked
        return tuple(
            t.detach().cpu() for t in (self.positions, self.visual, keep, self.score_values)
        )

    @cached_property
    def kept(self) -> list[torch.Tensor]:
        positions, visual, keep, _ = self._host
        return [positions[b][visual[b] & keep[b]].sort().values for b in range(visual.shape[0])]

    @cached_property
    def scores(self) -> list[torch.Tensor]:
        _, visual, _, scores = self._host
        return [scores[b][visual[b]].float() for b in range(visual.shape[0])]

    @cached_property
    def candidates(self) -> list[torch.Tensor]:
        positions, visual, _, _ = self._host
        return [positions[b][visual[b]] for b in range(visual.shape[0])]


class Stopwatch:
    """Wall time of the scoring steps: CUDA events on a GPU (read lazily), else the host clock."""

    def __init__(self) -> None:
        self._spans: list[tuple[object, object]] = []

    def start(self, device: torch.device) -> object:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def stop(self, start: object, device: torch.device) -> None:
        self._spans.append((start, self.start(device)))

    @property
    def seconds(self) -> float:
        total = 0.0
        for begin, end in self._spans:
            if isinstance(begin, float):
                total += end - begin
            else:
                end.synchronize()
                total += begin.elapsed_time(end) / 1e3
        return total


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
        pruners: per row, the name of the pruner that chose its kept set: ``video_pruner``'s
            for a row with a video, else ``pruner``'s
            (:attr:`~vlm_focus.FocusConfig.pruner_for_video`; ``pruner``'s where nothing was
            pruned).
    """

    n_visual: list[int]
    visual: torch.Tensor  # [B, S] bool, the input's visual tokens
    stages: list[StageTrace] = field(default_factory=list)
    pruners: list[str] = field(default_factory=list)
    sequence: torch.Tensor | None = None
    stopwatch: Stopwatch = field(default_factory=Stopwatch, repr=False)
    fixation: object | None = field(default=None, repr=False)  # decode-time selection state

    @property
    def fixations(self) -> list[list[torch.Tensor]]:
        """Decode-time fixation (``pruner="fixation"``): per decoding step, per row, the
        original positions of the visual tokens that step attended to; ``[]`` otherwise."""
        if self.fixation is None:
            return []
        return self.fixation.fixated_positions()

    @property
    def n_fixated(self) -> list[int]:
        """Decode-time fixation: per row, the most visual tokens one decoding step attended
        to (what the decode steps keep, where :attr:`n_kept` is what the prompt keeps); ``[]``
        without fixation or before any decoding step."""
        steps = self.fixations
        if not steps:
            return []
        return [max(int(step[row].numel()) for step in steps) for row in range(len(steps[0]))]

    @cached_property
    def visual_positions(self) -> list[torch.Tensor]:
        visual = self.visual.cpu()
        return [torch.nonzero(row).flatten() for row in visual]

    @property
    def seconds(self) -> float:
        return self.stopwatch.seconds

    @property
    def kept(self) -> list[torch.Tensor]:
        if not self.stages:
            return list(self.visual_positions)
        return self.stages[-1].kept

    @property
    def scores(self) -> list[torch.Tensor]:
        return self.stages[0].scores if self.stages else []

    def positions_at(self, layer: int) -> torch.Tensor | None:
        """``[B, S']`` original positions of the tokens decoder layer ``layer`` reads and
        outputs, or ``None`` when it holds every token (before the first stage). With
        ``output_hidden_states=True``, ``hidden_states[layer + 1]`` lines up with it; with
        ``output_attentions=True``, the rows and columns of ``attentions[layer]``."""
        held = None
        for stage in self.stages:
            if stage.layer <= layer:
                held = stage.positions.masked_select(stage.keep).view(stage.keep.shape[0], -1)
        return held

    @property
    def n_kept(self) -> list[int]:
        return [int(k.numel()) for k in self.kept]
