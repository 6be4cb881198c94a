"""The demo's answers: the pruned model's (alone, under the mitigation, and looking closer)
next to the unpruned model's, and the prefill time of both measured in the same request
(:meth:`~vlm_focus.setting.RunSetting.prefill_timing`: alternating pairs, reported as the
command lines report them). Each runs as a :class:`~vlm_focus.setting.RunSetting`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn

from .. import zoom as zm
from ..config import FocusConfig
from ..setting import RunAnswer, RunSetting
from ..timing import PairedTiming
from .inputs import DecodedVideo


@dataclass
class DemoSettings:
    """The settings one request runs, checked before anything runs: the pruning alone, the
    pruning under the mitigation (``None`` without one) and the pruning looking closer
    (:func:`vlm_focus.zoom.look_closer`, ``route="always"``; ``None`` without the zoom). The
    mitigation and the zoom each get their own run: a setting takes one of them."""

    pruned: RunSetting
    mitigated: RunSetting | None = None
    zoomed: RunSetting | None = None

    @classmethod
    def of(
        cls, focus: FocusConfig, mitigation: str, zoom: bool, max_new_tokens: int
    ) -> DemoSettings:
        pruned = RunSetting(focus=focus, max_new_tokens=max_new_tokens)
        return cls(
            pruned,
            None if mitigation == "none" else dataclasses.replace(pruned, mitigation=mitigation),
            dataclasses.replace(pruned, zoom=zm.ZoomOptions(route="always")) if zoom else None,
        )

    @property
    def mitigation(self) -> str:
        return "none" if self.mitigated is None else self.mitigated.mitigation


@dataclass
class Answers:
    """What :func:`answer` returns: the three answers, the pruned run (its tokens, trace and
    counts), its timing, and the zoom's answer (``None`` without one)."""

    unpruned: str
    mitigated: str
    mitigation: str
    pruned: RunAnswer
    timing: PairedTiming | None
    zoom: zm.ZoomAnswer | None = None

    @property
    def written(self) -> torch.Tensor:
        """The pruned answer's tokens ``[1, T]``."""
        return self.pruned.sequences[:1, self.pruned.inputs["input_ids"].shape[1] :]

    def result_fields(self) -> dict[str, Any]:
        """The :class:`~vlm_focus.demo.result.DemoResult` fields an image and a video share."""
        return {
            "answer": self.pruned.texts[0],
            "answer_unpruned": self.unpruned,
            "answer_mitigated": self.mitigated,
            "mitigation": self.mitigation,
            "timing": self.timing,
            "n_kept": int(self.pruned.visual_kept[0]),
            "n_visual": int(self.pruned.visual_total[0]),
        }


def answer(
    model: nn.Module,
    processor: Any,
    source: Image.Image | DecodedVideo,
    prompt: str,
    settings: DemoSettings,
    repeats: int,
) -> Answers:
    """The request's answers: the unpruned model's, then ``settings``' (the mitigation and the
    zoom on the pruned model, each on its own), and the prefill timing of the pruned run
    against the unpruned one in ``repeats`` pairs."""
    media = source if isinstance(source, DecodedVideo) else [source]
    prompts = [prompt]
    with torch.inference_mode():
        unpruned = settings.pruned.plain().answer(model, processor, media, prompts)
        inputs = unpruned.inputs
        mitigated = ""
        if settings.mitigated is not None:  # mitigations read and steer the pruned attention
            run = settings.mitigated.answer(model, processor, media, prompts, inputs=inputs)
            mitigated = run.texts[0]
        pruned = settings.pruned.answer(model, processor, media, prompts, inputs=inputs)
        found = None
        if settings.zoomed is not None:  # the full view pruned, the crop on a second pass
            found = settings.zoomed.answer(model, processor, media, prompts, inputs=inputs).zoom[0]
    timing = settings.pruned.prefill_timing(model, inputs, repeats=max(1, repeats), answer=pruned)
    return Answers(unpruned.texts[0], mitigated, settings.mitigation, pruned, timing.timing, found)


__all__ = ["Answers", "DemoSettings", "answer"]
