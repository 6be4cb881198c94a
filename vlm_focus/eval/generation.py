"""Batched greedy generation for the evaluations under one
:class:`~vlm_focus.setting.RunSetting` (:meth:`~vlm_focus.setting.RunSetting.answer`: pruning,
a mitigation or an attention-guided zoom), recorded per row with the batch's timing of prefill
and decoding."""

from __future__ import annotations

from typing import Any

import torch

from .. import hallucination as hal
from ..generation import new_token_counts
from ..loading import model_inputs, visual_counts
from ..setting import Guide, RunSetting

MITIGATIONS = hal.mitigation_choices()  # "none" and the registry's names
ZOOMS = ("never", "always", "adaptive")


class Generator:
    """Answers ``(image, prompt)`` rows with one model under one :class:`RunSetting`
    (:meth:`RunSetting.answer`), as the evaluations record them.

    ``guide``/``guide_processor`` are the small model for a pruner that ``needs_guide``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        setting: RunSetting,
        *,
        guide: torch.nn.Module | None = None,
        guide_processor: Any = None,
    ) -> None:
        self.model, self.processor, self.setting = model, processor, setting
        self.guide = None if guide is None else Guide(guide, guide_processor)
        if setting.needs_guide and guide is None:
            raise ValueError(f"pruner {setting.focus.pruner!r} needs a guide model (--guide PATH)")

    def inputs(self, images: list, prompts: list[str]) -> dict:
        try:
            return model_inputs(self.model, self.processor, images, prompts)
        except (TypeError, AttributeError) as err:
            raise ValueError(
                f"the processor could not build image inputs ({err}); the evaluations need a "
                "vision-language model whose processor takes images"
            ) from err

    def visual_counts(self, inputs: dict) -> list[int]:
        """Visual tokens per row; ``ValueError`` when a row has none (no image in the inputs)."""
        return visual_counts(self.model, inputs)

    def __call__(
        self, images: list, prompts: list[str], focus: list[str | None] | None = None
    ) -> tuple[list[str], list[dict]]:
        """Answers and per-row facts: visual tokens kept/total, new tokens, and the batch's
        prefill and generate seconds divided evenly over its rows.

        With a zoom, ``focus`` is each row's phrase whose attention picks the crop (POPE: the
        queried category; default the question's content words), and each row also records
        ``routed``, ``zoomed``, ``confidence``, ``plain_answer``, ``crops`` (``[x, y, w, h]``
        in the image's pixels) and ``zoom_s`` (the seconds of each phase); ``prefill_s`` is
        then the first ``generate()`` call's prefill and ``generate_s`` the row's share of
        every pass."""
        inputs = self.inputs(images, prompts)
        done = self.setting.answer(
            self.model,
            self.processor,
            images,
            prompts,
            inputs=inputs,
            guide=self.guide,
            zoom_focus=focus,
        )
        batch = len(done.texts)
        if done.zoom is None:
            new_tokens = new_token_counts(self.model, inputs, done.sequences)
        else:  # the answer's tokens (the zoomed passes' sequences are not kept)
            tokenizer = getattr(self.processor, "tokenizer", self.processor)
            new_tokens = [
                len(tokenizer(f.answer, add_special_tokens=False).input_ids) for f in done.zoom
            ]
        rows = []
        for b in range(batch):
            row = {
                "visual_kept": int(done.visual_kept[b]),
                "visual_total": int(done.visual_total[b]),
                "new_tokens": int(new_tokens[b]),
                "prefill_s": done.prefill_s / batch,
                "generate_s": done.seconds / batch,
            }
            if done.zoom is not None:
                f = done.zoom[b]
                record = f.to_json()
                row |= {
                    "routed": f.routed,
                    "zoomed": f.zoomed,
                    "confidence": f.confidence,
                    "plain_answer": f.plain_answer,
                    "zoom_mode": f.mode,
                    "crops": record["crops"],
                    "zoom_s": record["seconds"],
                }
            rows.append(row)
        return done.texts, rows
