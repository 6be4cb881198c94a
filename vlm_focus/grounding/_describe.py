"""Describe an image, then ground every object word of the description."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..generation import greedy_generate
from ._boxes import Box, boxes
from ._heatmap import HeatMap
from ._pass import GroundingPass
from ._region import box_share


@dataclass
class GroundedPhrase:
    """One object mention of an answer: its text, token positions, map, best box and score."""

    text: str
    positions: list[int]
    map: HeatMap
    box: Box | None
    score: float  # MTLA share of the phrase's image attention inside `box`


@dataclass
class Described:
    """One row's answer and its grounded object mentions."""

    answer: str
    answer_ids: torch.Tensor
    phrases: list[GroundedPhrase] = field(default_factory=list)


def describe_and_ground(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    processor: Any = None,
    objects: Iterable[str] | None = None,
    max_new_tokens: int = 32,
    image: int = 0,
    threshold: float | str = "otsu",
    generate_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> list[Described]:
    """Generate an answer (greedy), then give each object mention a map, a box and a score.

    Mentions are :meth:`GroundingPass.mentions` of the answer: the ``objects`` names found in
    it (token spans), or, without a vocabulary, every answer token that decodes to a content
    word. One :class:`GroundingPass` over prompt + answer reads them all: a mention's map
    averages its tokens' rows (TAG), its box is the best box of :func:`boxes`, and its score is
    the MTLA share of its image attention inside that box (:func:`region_score`). The answer is
    trimmed at its first end-of-sequence or padding token. ``options`` are the pass's keyword
    arguments (``layers``, ``heads``, ``images``, ``sizes``, ``geometry``, ...). Pixels need the
    images' sizes (``images=`` or ``sizes=``) unless the inputs carry them (LLaVA-NeXT,
    LLaVA-OneVision).
    """
    if processor is None:
        raise ValueError("describe_and_ground needs processor= (to decode the answer)")
    sequences, _ = greedy_generate(
        model, inputs, max_new_tokens=max_new_tokens, **(generate_kwargs or {})
    )
    answer = sequences[:, inputs["input_ids"].shape[1] :]
    gp = GroundingPass(model, inputs, processor=processor, answer=answer, rows=None, **options)
    objects = list(objects) if objects is not None else None
    results = []
    for b, row_mentions in enumerate(gp.mentions(source="answer", objects=objects)):
        described = Described(gp.answer_text(b), gp.answer_ids(b))
        for mention in row_mentions:
            heat = gp.map(mention, image=image)
            found = boxes(heat, threshold=threshold, max_boxes=1)
            box = found[0] if found else None
            score = box_share(heat, box) if box is not None else 0.0
            described.phrases.append(
                GroundedPhrase(mention.text, list(mention.positions), heat, box, score)
            )
        results.append(described)
    return results
