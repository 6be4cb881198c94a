"""The demo's answers: the pruned model's (and under the mitigation, and looking closer) next
to the unpruned model's, and the prefill time of both, measured in the same request
(:func:`vlm_focus.timing.pruned_prefill_timing`: alternating pairs, reported as the command
lines report them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import vlm_focus as vf

from .. import zoom as zm
from ..loading import decode_new_tokens
from ..setting import RunSetting
from ..timing import PairedTiming, pruned_prefill_timing
from ..trace import FocusTrace


@dataclass
class Answers:
    """What :func:`answer` returns: the three answers, the pruned run's tokens and trace, its
    timing, and the zoom's answer (``None`` without one)."""

    unpruned: str
    pruned: str
    mitigated: str
    mitigation: str
    pruned_seq: torch.Tensor  # [1, prompt + new tokens]
    trace: FocusTrace
    timing: PairedTiming | None
    zoom: zm.ZoomAnswer | None = None

    def result_fields(self) -> dict[str, Any]:
        """The :class:`~vlm_focus.demo.result.DemoResult` fields an image and a video share."""
        return {
            "answer": self.pruned,
            "answer_unpruned": self.unpruned,
            "answer_mitigated": self.mitigated,
            "mitigation": self.mitigation,
            "timing": self.timing,
        }


def answer(
    model: nn.Module,
    processor: Any,
    inputs: dict[str, Any],
    setting: RunSetting,
    repeats: int,
    *,
    generic: dict[str, Any] | None = None,
    look_closer: Callable[[], zm.ZoomAnswer] | None = None,
) -> Answers:
    """The request's answers under ``setting`` (its pruning, then its mitigation on the
    pruned model, with ``generic``: the mitigation's generic prompt's inputs), against the
    unpruned model's, and the prefill timing of both. ``look_closer()`` runs under the same
    wrap as the pruned answer."""
    plain = RunSetting(max_new_tokens=setting.max_new_tokens)
    with torch.inference_mode():
        full_seq = plain.generate(model, inputs)
    answer_unpruned = decode_new_tokens(processor, inputs, full_seq)[0]
    answer_mitigated = ""
    with torch.inference_mode(), vf.wrap(model, config=setting.focus) as handle:
        if setting.mitigation != "none":  # mitigations read and steer the pruned attention
            mitigated = setting.generate(model, inputs, handle=handle, generic_inputs=generic)
            answer_mitigated = decode_new_tokens(processor, inputs, mitigated)[0]
        pruned_seq = plain.generate(model, inputs)
        trace = handle.last_trace
        found = None if look_closer is None else look_closer()
    timing = pruned_prefill_timing(
        model,
        inputs,
        lambda: vf.wrap(model, config=setting.focus),
        trace.n_kept[0],
        trace.n_visual[0],
        max(1, repeats),
    )
    answer_pruned = decode_new_tokens(processor, inputs, pruned_seq)[0]
    return Answers(
        answer_unpruned,
        answer_pruned,
        answer_mitigated,
        setting.mitigation,
        pruned_seq,
        trace,
        timing,
        found,
    )


__all__ = ["Answers", "answer"]
