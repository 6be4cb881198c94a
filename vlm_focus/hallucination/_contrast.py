"""Instruction-aware contrastive decoding (IAVA-style)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessor

from ..config import keep_count
from ..core.attention import instruction_relevance
from ..core.options import option
from ..core.probe import AttentionProbe, attention_layers
from ..generation import extend_with_answer
from ..grounding import GENERIC_PROMPT
from ._side_pass import side_logits
from .registry import Mitigation, check_numbers, register_mitigation


def _instruction_attention(
    model: nn.Module, inputs: Mapping[str, Any], layers: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[B, S]`` visual mask, ``[B, S]`` attention of the instruction rows per visual token,
    mean over layers, heads and rows, normalised to sum 1 over each row's visual tokens)."""
    with torch.no_grad(), AttentionProbe(model, layers, rows="text") as probe:
        model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
        visual = probe.prefill.visual
    total = None
    for rec in probe.records:
        part = instruction_relevance(rec.probs, rec.mask)  # [B, S]
        total = part if total is None else total + part
    attention = total.masked_fill(~visual, 0.0)
    return visual, attention / attention.sum(1, keepdim=True).clamp(min=1e-12)


@dataclass
class InstructionContrastOptions:
    """The options of :func:`instruction_contrast`."""

    alpha: float = option(1.0, "contrast weight: (1 + alpha) l_full - alpha l_irr, >= 0")
    beta: float = option(0.1, "plausibility cutoff: tokens below beta * the top probability drop")
    ratio: float = option(
        0.5, "share of the visual tokens that are instruction-irrelevant, in (0, 1)"
    )
    layers: list[int] | None = option(
        None, "decoder layers whose attention is read (none: every layer with attention rows)"
    )

    def __post_init__(self) -> None:
        check_numbers(self, "alpha", "beta", "ratio")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta (plausibility cutoff) must lie in [0, 1), got {self.beta}")
        if not 0 < self.ratio < 1:
            raise ValueError(f"ratio (irrelevant share) must lie in (0, 1), got {self.ratio}")


@register_mitigation
class InstructionContrast(Mitigation, LogitsProcessor):
    """A ``LogitsProcessor`` and context manager; see :func:`instruction_contrast`."""

    name = "instruction_contrast"
    Options = InstructionContrastOptions
    summary = "contrast against a run that sees only the instruction-irrelevant visual tokens"
    generic_prompt = GENERIC_PROMPT

    def __init__(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        generic_inputs: Mapping[str, Any],
        options: InstructionContrastOptions,
    ) -> None:
        for name, value in (("inputs", inputs), ("generic_inputs", generic_inputs)):
            if not isinstance(value, Mapping) or "input_ids" not in value:
                raise TypeError(f"{name} must be the processor's output mapping with input_ids")
        self.model = model
        self.inputs = dict(inputs)
        self.alpha, self.beta = float(options.alpha), float(options.beta)
        self.ratio = float(options.ratio)
        self.layers = attention_layers(model, options.layers)
        visual, user = _instruction_attention(model, inputs, self.layers)
        g_visual, generic = _instruction_attention(model, generic_inputs, self.layers)
        if visual.shape[0] != g_visual.shape[0] or not torch.equal(visual.sum(1), g_visual.sum(1)):
            raise ValueError("generic_inputs must hold the same images as inputs")
        # align the generic prompt's visual tokens to the user prompt's positions
        aligned = torch.zeros_like(user)
        for b in range(visual.shape[0]):
            aligned[b, visual[b]] = generic[b, g_visual[b]]
        self.visual = visual
        self.relevance = (user - aligned).masked_fill(~visual, float("inf"))  # [B, S]
        self.irrelevant = torch.zeros_like(visual)
        for b in range(visual.shape[0]):
            idx = torch.nonzero(visual[b]).flatten()
            n = keep_count(self.ratio, idx.numel())
            order = torch.sort(self.relevance[b, idx], stable=True).indices[:n]
            self.irrelevant[b, idx[order]] = True
        self.blocked = visual & ~self.irrelevant  # the relevant tokens, hidden in the contrast run
        self.active = False
        self.last_irrelevant_logits: torch.Tensor | None = None

    def attach(self) -> None:
        self.active = True

    def remove(self) -> None:
        self.active = False

    def irrelevant_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, V]`` when only the instruction-irrelevant visual tokens are
        visible (the relevant ones blocked as keys at every layer), for the sequence so far."""
        prompt = self.inputs["input_ids"]
        batch, seq = prompt.shape
        if input_ids.shape[0] != batch or not torch.equal(input_ids[:, :seq], prompt):
            raise ValueError(
                "instruction_contrast serves the prompt it was built for, one sequence per row "
                "(no beams or num_return_sequences)"
            )
        inputs, _ = extend_with_answer(self.inputs, input_ids[:, seq:])
        return side_logits(self.model, inputs, blocked=self.blocked.to(input_ids.device))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.active:
            return scores
        full = scores.float()
        irrelevant = self.irrelevant_logits(input_ids).float()
        self.last_irrelevant_logits = irrelevant
        out = (1 + self.alpha) * full - self.alpha * irrelevant
        probs = torch.softmax(full, dim=-1)
        cutoff = self.beta * probs.amax(-1, keepdim=True)
        return out.masked_fill(probs < cutoff, float("-inf")).to(scores.dtype)


def instruction_contrast(
    model: nn.Module,
    inputs: Mapping[str, Any],
    generic_inputs: Mapping[str, Any],
    *,
    alpha: float = InstructionContrastOptions.alpha,
    beta: float = InstructionContrastOptions.beta,
    ratio: float = InstructionContrastOptions.ratio,
    layers: Sequence[int] | None = InstructionContrastOptions.layers,
) -> InstructionContrast:
    """Instruction-aware visual contrastive decoding (IAVA-style).

    1. Instruction-irrelevant visual tokens: with ``a_u`` and ``a_g`` the attention the
       instruction rows pay each visual token (mean over ``layers``, heads and rows, normalised
       over the image) under the user instruction (``inputs``) and under a generic one
       (``generic_inputs``: same image, e.g. "Write a general description of the image."), the
       ``round(ratio * n_visual)`` tokens (at least 1: :func:`vlm_focus.config.keep_count`)
       with the smallest gain ``a_u - a_g`` are irrelevant.
    2. At each step, ``l_full`` are the model's logits and ``l_irr`` the logits of a run in which
       only the irrelevant visual tokens are visible (the others blocked as keys at every layer).
    3. ``l = (1 + alpha) * l_full - alpha * l_irr`` on plausible tokens
       ``{y : p_full(y) >= beta * max_y' p_full(y')}``, ``-inf`` elsewhere.

    Usage (one sequence per prompt row: greedy or sampling)::

        with instruction_contrast(model, inputs, generic_inputs) as proc:
            model.generate(**inputs, logits_processor=[proc])
    """
    options = InstructionContrastOptions(alpha=alpha, beta=beta, ratio=ratio, layers=layers)
    return InstructionContrast(model, inputs, generic_inputs, options)
