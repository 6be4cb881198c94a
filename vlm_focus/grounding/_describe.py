"""Describe an image, then ground every object word of the description."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._boxes import Box, boxes
from ._maps import (
    HeadSpec,
    HeatMap,
    _geometry,
    _pairs,
    _reduce,
    _tokenizer_of,
    extend_with_answer,
    head_weights,
    maps_from_values,
    probe_forward,
    token_attention,
)
from ._region import box_share

#: Words that never name an object (used when no object vocabulary is given).
STOP_WORDS = frozenset(
    "a an the is are was were be been there here this that these those it its of in on at to "
    "and or with by for from as image picture photo shows showing show has have there's "
    "yes no not left right top bottom above below next near some one two three four many "
    "describe answer question single word phrase using".split()
)


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


def _mentions(
    tokens: list[int], tok: Any, objects: Sequence[str] | None
) -> list[tuple[str, list[int]]]:
    """(text, answer-relative token indices) of each object mention."""
    found: list[tuple[str, list[int]]] = []
    if objects is not None:
        for name in objects:
            spans = []
            for text in (name, " " + name):
                ids = list(tok.encode(text, add_special_tokens=False))
                if ids and ids not in spans:
                    spans.append(ids)
            taken: set[int] = set()
            for span in spans:
                n = len(span)
                for start in range(len(tokens) - n + 1):
                    idx = list(range(start, start + n))
                    if tokens[start : start + n] == span and not taken & set(idx):
                        found.append((name, idx))
                        taken |= set(idx)
        return sorted(found, key=lambda m: m[1][0])
    for i, t in enumerate(tokens):
        word = tok.decode([t]).strip().lower()
        if len(word) > 2 and word.replace("_", "").isalpha() and word not in STOP_WORDS:
            found.append((word, [i]))
    return found


def describe_and_ground(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    tokenizer: Any,
    objects: Iterable[str] | None = None,
    max_new_tokens: int = 32,
    image: int = 0,
    layers: Sequence[int] | None = None,
    heads: HeadSpec = None,
    image_size: Any = None,
    geometry: str | None = None,
    threshold: float | str = "otsu",
    generate_kwargs: Mapping[str, Any] | None = None,
) -> list[Described]:
    """Generate an answer (greedy), then give each object mention a map, a box and a score.

    Mentions are the ``objects`` names found in the answer (token spans), or, without a
    vocabulary, every answer token that decodes to a word outside :data:`STOP_WORDS`. One
    teacher-forced pass over prompt + answer records the answer rows; a mention's map averages
    its tokens' rows (TAG), its box is the best box of :func:`boxes`, and its score is the MTLA
    share of its image attention inside that box (:func:`region_score`).
    """
    tok = _tokenizer_of(tokenizer)
    geometry = _geometry(model, geometry)
    if heads is not None and layers is None:
        layers = sorted({layer for layer, _ in _pairs(heads)})
    objects = list(objects) if objects is not None else None
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, **(generate_kwargs or {}))
    with torch.no_grad():
        sequences = model.generate(**inputs, **kwargs)
    prompt_len = inputs["input_ids"].shape[1]
    answer = sequences[:, prompt_len:]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    keep = torch.ones_like(answer, dtype=torch.bool)
    for b in range(answer.shape[0]):
        for i, t in enumerate(answer[b].tolist()):
            if t in eos_ids:
                keep[b, i + 1 :] = False
                break
    full, is_answer = extend_with_answer(inputs, answer, keep)
    probed = probe_forward(model, full, is_answer, layers)
    weights = head_weights(heads, probed.layers, probed.n_heads)
    rec = probed.records[0]
    results = []
    for b in range(answer.shape[0]):
        ids = answer[b][keep[b]].tolist()
        text_ids = [t for t in ids if t not in eos_ids]
        results.append(
            Described(tok.decode(text_ids, skip_special_tokens=True), answer[b][keep[b]])
        )
    mentions = [_mentions(answer[b][keep[b]].tolist(), tok, objects) for b in range(len(results))]
    for b, row_mentions in enumerate(mentions):
        for text, idx in row_mentions:
            positions = [prompt_len + i for i in idx]
            row_weights = torch.zeros_like(rec.mask, dtype=torch.float32)
            picked = torch.isin(
                rec.positions[b], torch.tensor(positions, device=rec.positions.device)
            )
            row_weights[b] = picked.float() / picked.sum().clamp(min=1)
            values = _reduce(token_attention(probed, row_weights, per_head=True), weights)
            heat = maps_from_values(model, probed, values, image_size, geometry)[b][image]
            found = boxes(heat, threshold=threshold, max_boxes=1)
            box = found[0] if found else None
            score = box_share(heat, box) if box is not None else 0.0
            results[b].phrases.append(GroundedPhrase(text, positions, heat, box, score))
    return results
