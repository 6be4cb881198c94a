"""The zoom's passes over a batch: plain answers (and their first-token logits), and the
question maps with the crops they give; the routing statistics of a batch read from both."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.probe import attention_layers
from ..generation import greedy_generate
from ..geometry import Frame, as_size
from ..grounding import Box, GroundingPass, HeatMap, Mention
from ..loading import build_inputs, decode_new_tokens, load_image, to_model
from ._options import ZoomOptions, merged
from ._reask import multi_image_inputs, resolve_mode
from ._regions import can_crop, choose_crops
from ._routing import (
    MAP_STATISTICS,
    STATISTICS,
    TOKEN_STATISTICS,
    check_statistic,
    first_token_confidence,
    map_statistic,
)


def picture(image: Any) -> Any:
    """A PIL image from a PIL image, a path or an ``[H, W, 3]`` uint8 array."""
    if hasattr(image, "ndim") and hasattr(image, "shape") and not hasattr(image, "crop"):
        from PIL import Image

        image = Image.fromarray(image)
    return load_image(image)


def clock(model: nn.Module) -> Callable[[], float]:
    """A wall clock that first waits for the model's device, so a phase's time holds its work."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    return now


def _inputs(processor: Any, image_rows: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict:
    if all(len(row) == 1 for row in image_rows):
        return build_inputs(processor, [row[0] for row in image_rows], list(questions))
    return multi_image_inputs(processor, image_rows, questions)


def generate_answers(
    model: nn.Module,
    processor: Any,
    image_rows: Sequence[Sequence[Any]],
    questions: Sequence[str],
    max_new_tokens: int,
    generate_kwargs: dict[str, Any] | None,
    logits: bool,
) -> tuple[list[str], torch.Tensor | None]:
    """Answers (and the first answer token's logits ``[B, V]``) for rows of images."""
    inputs = to_model(model, _inputs(processor, image_rows, questions))
    sequences, first = greedy_generate(
        model,
        inputs,
        max_new_tokens=max_new_tokens,
        first_logits=logits,
        **(generate_kwargs or {}),
    )
    return decode_new_tokens(processor, inputs, sequences), first


def map_rows(
    model: nn.Module,
    processor: Any,
    pictures: Sequence[Any],
    questions: Sequence[str],
    focuses: Sequence[str | None],
    rows: Sequence[int],
    options: ZoomOptions,
    mode: str,
) -> dict[int, tuple[HeatMap, list[Box], list[Frame]]]:
    """One :class:`GroundingPass` over ``rows``: each row's question map, its boxes and crops."""
    if not rows:
        return {}
    inputs = to_model(
        model, build_inputs(processor, [pictures[b] for b in rows], [questions[b] for b in rows])
    )
    layers = options.layers
    if layers is None and options.heads is None:
        # every layer: the zoom's measured best map on small objects (zoom_quality.md),
        # unlike grounding's default layers, which point best at native size (a hybrid
        # decoder's full-attention layers: its linear ones have no attention rows)
        layers = attention_layers(model)
    gp = GroundingPass(
        model,
        inputs,
        processor=processor,
        images=[pictures[b] for b in rows],
        layers=layers,
        heads=options.heads,
    )
    out = {}
    for j, b in enumerate(rows):
        heat = _focus_map(gp, j, focuses[b], questions[b])
        found, crops = choose_crops(heat, options, processor=processor, mode=mode)
        out[b] = (heat, found, crops)
    return out


def routing_statistics(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    questions: Sequence[str],
    *,
    statistics: Sequence[str] = STATISTICS,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[list[str], dict[str, list[float | None]]]:
    """The plain answers of one batch and every requested routing statistic of each question
    (:mod:`._routing`): first-token ones from the plain pass's logits, attention-map ones from
    one map pass over the questions the zoom can crop, exactly as :func:`look_closer` reads
    them (``focus``, ``config`` and keyword ``options`` as there: layers, heads, crop rules,
    ``max_new_tokens``). A map statistic is ``None`` for an image the zoom cannot crop."""
    opts = merged(config, options)
    wanted = [check_statistic(name) for name in statistics]
    questions = list(questions)
    if len(images) != len(questions):
        raise ValueError(f"{len(images)} images but {len(questions)} questions")
    focuses = per_row(focus, len(questions), "focus", False)
    pictures = [picture(i) for i in images]
    texts, logits = generate_answers(
        model,
        processor,
        [[p] for p in pictures],
        questions,
        opts.max_new_tokens,
        generate_kwargs,
        logits=True,
    )
    values: dict[str, list[float | None]] = {}
    for name in wanted:
        if name in TOKEN_STATISTICS:
            values[name] = first_token_confidence(logits, name).tolist()
    if any(name in MAP_STATISTICS for name in wanted):
        mode = resolve_mode(model, opts.mode)
        rows = [b for b, p in enumerate(pictures) if can_crop(opts, as_size(p), processor)]
        mapped = map_rows(model, processor, pictures, questions, focuses, rows, opts, mode)
        for name in wanted:
            if name in MAP_STATISTICS:
                values[name] = [
                    map_statistic(mapped[b][0], name, mapped[b][2]) if b in mapped else None
                    for b in range(len(questions))
                ]
    return texts, {name: values[name] for name in wanted}


def first_pass(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    questions: Sequence[str],
    *,
    statistic: str = "top1",
    max_new_tokens: int = 16,
    generate_kwargs: dict[str, Any] | None = None,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    **options: Any,
) -> tuple[list[str], list[float | None]]:
    """The plain answers of one batch and their routing scores (:mod:`._routing`): the
    first-token confidence, or an attention-map statistic (``None`` for an image the zoom
    cannot crop; map settings as in :func:`routing_statistics`)."""
    texts, values = routing_statistics(
        model,
        processor,
        images,
        questions,
        statistics=[statistic],
        focus=focus,
        config=config,
        generate_kwargs=generate_kwargs,
        **{**options, "max_new_tokens": max_new_tokens},
    )
    return texts, values[statistic]


def _focus_map(gp: GroundingPass, row: int, focus: str | None, question: str) -> HeatMap:
    """The map of ``focus`` in the row's prompt, else of the question's content words
    (:meth:`GroundingPass.mentions` within the question), else of the whole instruction."""
    if focus is not None:
        return gp.map(focus, row=row, source="prompt")
    found: list[Mention] = gp.mentions(source="prompt", within=question)[row]
    if found:
        return gp.map(found)
    return gp.map(None, row=row, source="prompt")


def per_row(value: Any, n: int, name: str, single: bool) -> list[Any]:
    if value is None or isinstance(value, str):
        return [value] * n
    if single:
        raise TypeError(f"{name} must be a str or None for one question, got {value!r}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} questions")
    return value
