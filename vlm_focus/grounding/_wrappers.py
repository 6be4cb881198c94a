"""One call, one :class:`GroundingPass`: :func:`heatmap`, :func:`region_score` and
:func:`ground`, the image's pixels in and out.

The wrappers take :class:`GroundingPass`'s keyword arguments as they are (``answer``,
``processor``, ``images``, ``sizes``, ``layers``, ``heads``, ``relative_to``, ``geometry``), so
the pass's options have one home: its signature and docstring.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..geometry import Frame
from ._boxes import Box, boxes, point
from ._defaults import presence_threshold as default_threshold
from ._heatmap import HeatMap
from ._image import as_picture
from ._image_attention import HeadSpec
from ._pass import GroundingPass, MentionQuery
from ._presence import PRESENCE_PROMPT, presence, presence_from_logits
from ._region import box_share
from ._token_masks import Query, tokenizer_of, unknown_words


class UnknownWordWarning(UserWarning):
    """Grounding a phrase with words the model's tokenizer cannot spell (they encode to its
    unknown token): the model never reads them, and the phrase scores presence 0."""


def heatmap(
    model: nn.Module,
    inputs: Mapping[str, Any],
    query: Query | MentionQuery = None,
    **options: Any,
) -> list[list[HeatMap]]:
    """Attention maps of a query over each image (TAG): ``GroundingPass(model, inputs,
    rows=query, **options).maps(query)``, recording only the query's rows. ``options`` are
    :class:`GroundingPass`'s keyword arguments; ``query`` as in :meth:`GroundingPass.maps`.

    Returns:
        per batch row, one :class:`HeatMap` per image.
    """
    return GroundingPass(model, inputs, rows=query, **options).maps(query)


def region_score(
    model: nn.Module,
    inputs: Mapping[str, Any],
    box: Any,
    query: Query | MentionQuery = None,
    *,
    image: int = 0,
    **options: Any,
) -> torch.Tensor:
    """Grounding confidence of a box: the share of a prediction's image attention inside it
    (MTLA), :meth:`GroundingPass.region_score` of ``GroundingPass(model, inputs, rows=query,
    **options)`` (``options`` are its keyword arguments).

    The prediction's tokens ``T`` (all of them, summed; not one token) are ``query`` (as in
    :func:`heatmap`; default the whole ``answer``, or the instruction). The score lies in
    ``[0, 1]``, does not depend on the order of the tokens, and compares boxes the model writes
    in text as well as boxes from :func:`boxes`. ``box`` is a
    :class:`~vlm_focus.geometry.Frame` (a :class:`Box` is one) or ``[x, y, w, h]`` in original
    image pixels (one for all rows, or one per row); ``image`` is which image of each row it
    refers to.

    Returns:
        ``[B]`` float scores.
    """
    gp = GroundingPass(model, inputs, rows=query, **options)
    return gp.region_score(query, box, image=image)


@dataclass
class Grounding:
    """:func:`ground`'s answer, in the image's pixels.

    Attributes:
        phrase: what was grounded.
        map: the phrase's attention map (:class:`HeatMap`), also when the phrase is absent.
        point: the map's peak ``(x, y)``; ``None`` when the phrase is not :attr:`present`
            (the raw peak stays available as ``grounding.point(found.map)``).
        boxes: boxes around the map's blobs, best first; empty when not :attr:`present`.
        scores: region score (MTLA share of the map inside each box), one per box.
        present: ``presence > threshold`` (:func:`presence_threshold`, chosen on calibration
            scenes for the embedded models).
        presence: the model's own ``P(yes)`` that the phrase is in the image (``_presence``);
            0 for a phrase with :attr:`unknown_words`.
        seen: the part of the image the model saw (:attr:`HeatMap.seen`); a photo the processor
            centre-crops loses its sides, and :func:`ground` warns
            (:class:`UnseenRegionWarning`).
        threshold: the presence threshold used.
        unknown_words: the phrase's words the model's tokenizer cannot spell (they encode to
            its unknown token, :func:`unknown_words`), once each; :func:`ground` warns
            (:class:`UnknownWordWarning`). Empty when the model reads every word.
    """

    phrase: str
    map: HeatMap
    point: tuple[float, float] | None
    boxes: list[Box]
    scores: list[float]
    present: bool
    presence: float
    seen: Frame
    threshold: float
    unknown_words: list[str] = field(default_factory=list)


def ground(
    model: nn.Module,
    processor: Any,
    image: Any,
    phrase: str,
    *,
    prompt: str | None = None,
    layers: Sequence[int] | None = None,
    heads: HeadSpec = None,
    max_boxes: int | None = None,
    threshold: float | str = "otsu",
    presence_threshold: float | None = None,
) -> Grounding:
    """Where ``phrase`` is in ``image``, and whether it is there at all: the attention map of
    its tokens, its peak and boxes, all in ``image``'s own pixels, with a presence score.

    The image (a PIL image, a path, or a numpy array or torch tensor: ``[H, W]``,
    ``[H, W, C]`` or ``[C, H, W]``, uint8 or floats in ``[0, 1]`` or ``[0, 255]``) and
    ``prompt`` (default :data:`PRESENCE_PROMPT`, ``"Is there a {phrase} in the image?"``; it
    must contain ``phrase``) go through the model's chat template and ``processor``; one
    :class:`GroundingPass` reads the phrase's rows, with the processor's geometry and the
    image's size. ``layers`` defaults to :func:`default_layers` (the model's measured choice,
    else the first quarter of its layers); ``threshold`` is :func:`boxes`' threshold.

    Presence: ``presence = P(yes) / (P(yes) + P(no))`` for the presence question (read from the
    same pass when ``prompt`` is that question, else from one more forward pass); the phrase is
    present when ``presence > presence_threshold`` (default :func:`presence_threshold` of the
    model). An absent phrase keeps its map but gets no point and no boxes. A phrase with words
    the tokenizer cannot spell (its unknown token) scores 0, since the model never read them;
    ``Grounding.unknown_words`` names them and an :class:`UnknownWordWarning` says so.
    """
    from ..loading import build_inputs  # the processor's chat format

    if not isinstance(phrase, str) or not phrase.strip():
        raise ValueError(f"phrase must be a non-empty string, got {phrase!r}")
    question = PRESENCE_PROMPT.format(phrase=phrase)
    prompt = question if prompt is None else prompt
    if phrase not in prompt:
        raise ValueError(f"prompt {prompt!r} does not contain the phrase {phrase!r}")
    limit = default_threshold(model) if presence_threshold is None else presence_threshold
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit < 1:
        raise ValueError(f"presence_threshold={presence_threshold!r} must be a number in [0, 1)")
    picture = as_picture(image)
    inputs = build_inputs(processor, picture, prompt)
    gp = GroundingPass(
        model,
        inputs,
        processor=processor,
        images=[picture],
        layers=layers,
        heads=heads,
        rows=phrase,
    )
    heat = gp.map(phrase, source="prompt")
    unknown = unknown_words(phrase, processor)
    if unknown:
        tok = tokenizer_of(processor)
        warnings.warn(
            f"the model's tokenizer does not know {', '.join(map(repr, unknown))} (they encode "
            f"to its unknown token {getattr(tok, 'unk_token', None)!r}): the model cannot read "
            f"them, so {phrase!r} scores presence 0; use words the tokenizer knows",
            UnknownWordWarning,
            stacklevel=2,
        )
        score = 0.0  # the model never read the phrase: its answer is not about it
    elif prompt == question and gp.next_logits is not None:
        score = float(presence_from_logits(gp.next_logits, processor)[0])
    else:
        score = presence(model, processor, picture, [phrase])[0]
    present = score > limit
    found = boxes(heat, threshold=threshold, max_boxes=max_boxes) if present else []
    return Grounding(
        phrase,
        heat,
        point(heat) if present else None,
        found,
        [box_share(heat, b) for b in found],
        present,
        score,
        heat.seen,
        float(limit),
        unknown,
    )
