"""The one greedy ``generate()`` call that every answering path goes through (the evaluations,
the demo and lmms-eval through :meth:`vlm_focus.setting.RunSetting.generate`, the zoom's
passes directly), and what is read off its output."""

from __future__ import annotations

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


__all__ = ["greedy_generate", "new_token_counts"]
