"""Batched greedy generation for the evaluations under one
:class:`~vlm_focus.setting.RunSetting` (pruning, a mitigation or an attention-guided zoom),
with per-batch timing of prefill and decoding."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LogitsProcessor

from .. import zoom as zm
from ..config import keep_count
from ..generation import new_token_counts
from ..loading import build_inputs, decode_new_tokens, load_image, to_model
from ..model_adapters import get_adapter
from ..setting import RunSetting

ZOOMS = zm.ROUTES  # "never" is no zoom


class _PrefillClock(LogitsProcessor):
    """Notes when ``generate()`` first asks for the next token: the end of prefill."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        if self.first is None:
            self.sync()
            self.first = time.perf_counter()
        return scores


class Generator:
    """Answers ``(image, prompt)`` rows with one model under one :class:`RunSetting`.

    ``guide``/``guide_processor`` are the small model for the ``guided`` pruner.
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
        self.adapter = get_adapter(model)
        self.guide, self.guide_processor = guide, guide_processor
        if setting.needs_guide and guide is None:
            raise ValueError(f"pruner {setting.focus.pruner!r} needs a guide model (--guide PATH)")
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def inputs(self, images: list, prompts: list[str], processor: Any = None) -> dict:
        processor = processor or self.processor
        try:
            inputs = build_inputs(processor, [load_image(i) for i in images], prompts)
        except (TypeError, AttributeError) as err:
            raise ValueError(
                f"the processor could not build image inputs ({err}); the evaluations need a "
                "vision-language model whose processor takes images"
            ) from err
        return to_model(self.model, inputs)

    def visual_counts(self, inputs: dict) -> list[int]:
        """Visual tokens per row; ``ValueError`` when a row has none (no image in the inputs)."""
        visual = self.adapter.visual_mask(self.model, inputs["input_ids"])
        mask = inputs.get("attention_mask")
        if mask is not None:
            visual = visual & mask.bool()
        counts = visual.sum(1).tolist()
        if min(counts) == 0:
            raise ValueError(
                "the model's inputs hold no image tokens (check that the processor inserts the "
                "image placeholder: a vision-language model and its own processor are needed)"
            )
        return counts

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
        s = self.setting
        inputs = self.inputs(images, prompts)
        n_visual = self.visual_counts(inputs)
        clock = _PrefillClock(self.sync)
        gen: dict[str, Any] = dict(logits_processor=[clock])
        with torch.no_grad(), s.wrapped(self.model, guide=self.guide) as handle:
            self.sync()
            start = time.perf_counter()
            if s.zoom is not None:
                found = self._zoom(images, prompts, focus, clock)
            else:
                sequences = self._generate(inputs, images, prompts, gen, handle)
            self.sync()
            total = time.perf_counter() - start
        if s.zoom is not None:
            return self._zoom_rows(found, n_visual, clock, start, total)
        texts = decode_new_tokens(self.processor, inputs, sequences)
        kept = handle.last_trace.n_kept if handle is not None else n_visual
        prefill = (clock.first or start + total) - start
        new_tokens = new_token_counts(self.model, inputs, sequences)
        batch = len(texts)
        rows = [
            {
                "visual_kept": int(kept[b]),
                "visual_total": int(n_visual[b]),
                "new_tokens": int(new_tokens[b]),
                "prefill_s": prefill / batch,
                "generate_s": total / batch,
            }
            for b in range(batch)
        ]
        return texts, rows

    def _zoom(self, images, prompts, focus, clock) -> list:
        """:func:`vlm_focus.zoom.look_closer` on the batch (inside the pruning handle, if any:
        both passes then run pruned)."""
        found = zm.look_closer(
            self.model,
            self.processor,
            [load_image(i) for i in images],
            list(prompts),
            focus=focus,
            config=self.setting.zoom,
            generate_kwargs={"logits_processor": [clock]},
        )
        return found

    def _zoom_rows(self, found, n_visual, clock, start, total) -> tuple[list[str], list[dict]]:
        s = self.setting
        kept = [keep_count(s.focus.keep, n) if s.pruned else n for n in n_visual]
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        batch = len(found)
        prefill = (clock.first or start + total) - start
        texts, rows = [], []
        for b, f in enumerate(found):
            texts.append(f.answer.strip())
            record = f.to_json()
            rows.append(
                {
                    # the plain view's visual tokens by keep's rule (a crop adds its own)
                    "visual_kept": kept[b],
                    "visual_total": int(n_visual[b]),
                    # the answer's tokens (the zoomed passes' sequences are not kept)
                    "new_tokens": len(tokenizer(f.answer, add_special_tokens=False).input_ids),
                    "prefill_s": prefill / batch,
                    "generate_s": total / batch,
                    "routed": f.routed,
                    "zoomed": f.zoomed,
                    "confidence": f.confidence,
                    "plain_answer": f.plain_answer,
                    "zoom_mode": f.mode,
                    "crops": record["crops"],
                    "zoom_s": record["seconds"],
                }
            )
        return texts, rows

    def _generate(self, inputs, images, prompts, gen, handle) -> torch.Tensor:
        s = self.setting
        guide_inputs = generic = None
        if s.needs_guide:
            guide_inputs = self.inputs(images, prompts, self.guide_processor)
        if s.generic_prompt is not None:
            generic = self.inputs(images, [s.generic_prompt] * len(prompts))
        return s.generate(
            self.model,
            inputs,
            handle=handle,
            guide_inputs=guide_inputs,
            generic_inputs=generic,
            **gen,
        )
