"""The one greedy ``generate()`` call that every answering path goes through (the commands,
the evaluations and the demo through :meth:`vlm_focus.setting.RunSetting.answer`, the zoom's
passes directly), what is read off its output, and a generated answer appended to its prompt
for one teacher-forced pass (grounding an answer, contrasting instructions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def greedy_generate(
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    max_new_tokens: int,
    first_logits: bool = False,
    **generate_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sequences, logits)``: greedy ``generate()`` of ``inputs`` (``generate_kwargs`` may
    set beams or logits processors), and with ``first_logits`` the first generated token's
    logits ``[B, V]`` (the first beam's per row), else ``None``."""
    kwargs = {"do_sample": False, **generate_kwargs}
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_logits=first_logits,
            **kwargs,
        )
    if not first_logits:
        return out.sequences, None
    first = out.logits[0]
    batch = inputs["input_ids"].shape[0]
    if first.shape[0] != batch:  # beams or several sequences per prompt: the first of each
        first = first.view(batch, -1, first.shape[-1])[:, 0]
    return out.sequences, first


def new_token_counts(
    model: nn.Module, inputs: dict[str, Any], sequences: torch.Tensor
) -> list[int]:
    """Generated tokens per row, up to and including the first end-of-sequence token."""
    new = sequences[:, inputs["input_ids"].shape[1] :].tolist()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    counts = []
    for row in new:
        ends = [i + 1 for i, token in enumerate(row) if token in eos]
        counts.append(ends[0] if ends else len(row))
    return counts


def extend_with_answer(
    inputs: Mapping[str, Any], answer: torch.Tensor, answer_mask: torch.Tensor | None = None
) -> tuple[dict[str, Any], torch.Tensor]:
    """Append generated tokens ``answer [B, T]`` to a prompt for one teacher-forced pass.

    Returns the new inputs (``input_ids``, ``attention_mask`` and every other ``[B, S]`` integer
    input, such as ``mm_token_type_ids``, extended; answer positions padded with 0 except the
    attention mask, which is ``answer_mask``) and the ``[B, S + T]`` bool mask of answer tokens.
    """
    input_ids = inputs["input_ids"]
    if not isinstance(answer, torch.Tensor) or answer.dim() != 2:
        raise TypeError(
            f"answer must be a [batch, T] LongTensor, got {getattr(answer, 'shape', answer)}"
        )
    batch, seq = input_ids.shape
    if answer.shape[0] != batch:
        raise ValueError(f"answer has {answer.shape[0]} rows, the prompt has {batch}")
    answer = answer.to(input_ids.device)
    if answer_mask is None:
        answer_mask = torch.ones_like(answer, dtype=torch.bool)
    answer_mask = answer_mask.to(input_ids.device).bool()
    out = dict(inputs)
    for key, value in inputs.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim() == 2
            and tuple(value.shape) == (batch, seq)
            and not value.is_floating_point()
        ):
            pad = torch.zeros_like(answer, dtype=value.dtype)
            if key == "attention_mask":
                pad = answer_mask.to(value.dtype)
            out[key] = torch.cat([value, pad], dim=1)
    out["input_ids"] = torch.cat([input_ids, answer], dim=1)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.cat(
            [torch.ones_like(input_ids), answer_mask.to(input_ids.dtype)], dim=1
        )
    is_answer = torch.cat([torch.zeros_like(input_ids, dtype=torch.bool), answer_mask], dim=1)
    return out, is_answer


__all__ = ["extend_with_answer", "greedy_generate", "new_token_counts"]
