"""Attention maps from query tokens to each image's grid, in grid cells and in image pixels (TAG):
the pieces :class:`~vlm_focus.grounding.GroundingPass` is built from.

One teacher-forced forward pass computes everything: the prompt (plus, for generated tokens, the
answer appended to it) runs once through the unmodified model, and an attention probe recomputes
the query rows at the chosen layers from each layer's own q/k (SDPA, eager and flash all fine).
A generated answer is read this way rather than during ``generate()``: the rows are exactly those
the decode steps computed (same tokens, same causal prefix), and one batched pass serves every
phrase of the answer.

Where each view's grid sits in the original image is :mod:`vlm_focus.geometry`'s job
(:func:`~vlm_focus.model_adapters.model_frames`). The pixel map is the attention *density* (mass per
pixel), bilinearly interpolated between cell centres and summed over views, so it integrates to
the mass the grid cells hold.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.probe import AttentionProbe, Prefill, Rows, check_layers
from ..geometry import (
    RULES,
    Frame,
    Size,
    coverage,
    seen_region,
    unknown_size_message,
    upsample,
)
from ..model_adapters import ImageLayout, get_adapter

GENERIC_PROMPT = "Write a general description of the image."
GEOMETRIES = RULES  # the placement rules ``geometry=`` accepts (vlm_focus.geometry.RULES)

HeadSpec = Any  # LocalizationHeads | Mapping[int, Sequence[int]] | None
Query = str | Sequence[int] | torch.Tensor | None


@dataclass
class HeatMap:
    """One image's attention map.

    Attributes:
        grid: ``[rows, cols]`` mass per cell of the finest view (LLaVA-NeXT: the unpadded
            anyres composite; Qwen: the merged grid, summed over frames of a video).
        views: every view's ``[rows, cols]`` map (LLaVA-NeXT: base grid, then anyres grid; a
            video: one per frame, see :attr:`frame_maps`).
        size: the original image's :class:`~vlm_focus.geometry.Size` ``(width, height)``, or
            ``None`` when it is unknown (then only the grid maps are available).
        frames: per view, the :class:`~vlm_focus.geometry.Frame` its grid spans in original
            pixels (``None`` with the size).
        other: mass on the image's tokens without a cell (newline, CLS tokens).
        row, image: batch row and image index within the row.
        pixels: ``[height, width]`` attention density in original image pixels (computed on
            first use; raises when the size is unknown).
    """

    grid: torch.Tensor
    views: list[torch.Tensor]
    size: Size | None
    frames: list[Frame] | None
    other: float = 0.0
    row: int = 0
    image: int = 0
    layout: ImageLayout | None = field(default=None, repr=False)
    model_type: str | None = field(default=None, repr=False)
    _pixels: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def mass(self) -> float:
        """Total attention mass on the image's grid cells."""
        return float(sum(v.sum() for v in self.views))

    def require_pixels(self) -> tuple[Size, list[Frame]]:
        """``(size, frames)``; ``ValueError`` saying what to pass when the size is unknown."""
        if self.size is None or self.frames is None:
            raise ValueError(unknown_size_message(self.model_type, self.row, self.image))
        return self.size, self.frames

    @property
    def pixels(self) -> torch.Tensor:
        if self._pixels is None:
            size, frames = self.require_pixels()
            pixels = torch.zeros(size.height, size.width)
            for grid, frame in zip(self.views, frames, strict=True):
                pixels += upsample(grid, size, frame)
            self._pixels = pixels
        return self._pixels

    @property
    def support(self) -> torch.Tensor:
        """``[height, width]`` bool: the pixels some view's grid covers (the encoder saw)."""
        size, frames = self.require_pixels()
        return coverage(size, frames)

    @property
    def seen(self) -> Frame:
        """The part of the image the model saw, in image pixels: the bounding rectangle of
        :attr:`support` (:func:`vlm_focus.geometry.seen_region`). Outside it the map is 0 and
        no box can reach: a CLIP-style centre crop of a wide photo leaves its sides out."""
        size, frames = self.require_pixels()
        return seen_region(size, frames)[0]

    @property
    def seen_share(self) -> float:
        """Share of the image's pixels the model saw (1.0 for the whole image)."""
        size, frames = self.require_pixels()
        return seen_region(size, frames)[1]

    @property
    def image_size(self) -> tuple[int, int]:
        """Deprecated: ``(height, width)``; use :attr:`size` (``Size(width, height)``)."""
        warnings.warn(
            "HeatMap.image_size (height, width) is deprecated: use HeatMap.size, a "
            "Size(width, height)",
            DeprecationWarning,
            stacklevel=2,
        )
        size, _ = self.require_pixels()
        return size.height, size.width

    @property
    def frame_maps(self) -> list[HeatMap]:
        """A video's map as one :class:`HeatMap` per frame, in frame order (each frame's view,
        upsampled on its own); an image gives ``[self]``."""
        if self.layout is None or self.layout.kind != "video":
            return [self]
        frames = self.frames or [None] * len(self.views)
        return [
            HeatMap(
                view,
                [view],
                self.size,
                None if frame is None else [frame],
                0.0,
                self.row,
                self.image,
                self.layout,
                self.model_type,
            )
            for view, frame in zip(self.views, frames, strict=True)
        ]


def build_map(
    values: torch.Tensor,
    layout: ImageLayout,
    size: Size | None,
    frames: Sequence[Frame] | None,
    row: int = 0,
    image: int = 0,
    model_type: str | None = None,
) -> HeatMap:
    """Scatter per-token values ``[n]`` of one image onto its views (grid cells); the pixel map
    follows from ``size`` and the views' ``frames`` (:mod:`vlm_focus.geometry`)."""
    values = values.detach().float().cpu()
    cells = layout.cells.cpu()
    views = []
    has_cell = cells[:, 1] >= 0
    for v, (rows, cols) in enumerate(layout.grids):
        grid = torch.zeros(rows, cols)
        sel = has_cell & (cells[:, 0] == v)
        grid.index_put_((cells[sel, 1], cells[sel, 2]), values[sel], accumulate=True)
        views.append(grid)
    if frames is not None and len(frames) != len(views):
        raise ValueError(f"{len(frames)} frames for {len(views)} views")
    shapes = {tuple(g.shape) for g in views}
    if len(shapes) == 1:
        finest = torch.stack(views).sum(0)  # frames of a video share one grid
    else:
        finest = max(views, key=lambda g: g.numel())
    other = float(values[~has_cell].sum())
    frames = None if frames is None or size is None else list(frames)
    return HeatMap(finest, views, size if frames else None, frames, other, row, image, layout,
                   model_type)  # fmt: skip


# --- inputs, answers and query rows ---------------------------------------------------------
def tokenizer_of(processor: Any) -> Any:
    """The tokenizer inside a processor (or the tokenizer itself)."""
    return getattr(processor, "tokenizer", processor)


def processor_argument(processor: Any, tokenizer: Any, owner: str) -> Any:
    """``processor``, or the deprecated ``tokenizer=`` in its place (with a warning)."""
    if tokenizer is not None:
        warnings.warn(
            f"{owner}(tokenizer=...) is deprecated: pass processor= (the processor, which also "
            "gives the image geometry)",
            DeprecationWarning,
            stacklevel=3,
        )
        if processor is None:
            return tokenizer
    return processor


def answer_mask(model: nn.Module, answer: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the generated tokens of each row before its first end-of-sequence or
    padding token (the generation config's ``eos_token_id`` and ``pad_token_id``, the model
    config's ``pad_token_id``). The one rule for trimming an answer."""
    generation = getattr(model, "generation_config", None)
    config = getattr(model, "config", None)
    stop: set[int] = set()
    for value in (
        getattr(generation, "eos_token_id", None),
        getattr(generation, "pad_token_id", None),
        getattr(config, "pad_token_id", None),
        getattr(getattr(config, "text_config", None), "pad_token_id", None),
    ):
        if isinstance(value, int):
            stop.add(value)
        elif isinstance(value, Sequence):
            stop.update(int(v) for v in value)
    if not stop:
        return torch.ones_like(answer, dtype=torch.bool)
    hit = torch.isin(answer, torch.tensor(sorted(stop), device=answer.device))
    return hit.long().cumsum(1) == 0


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


def _find_span(row: list[int], span: list[int], allowed: list[bool]) -> int | None:
    """Start of the last occurrence of ``span`` in ``row`` lying wholly on allowed positions."""
    n = len(span)
    for start in range(len(row) - n, -1, -1):
        if row[start : start + n] == span and all(allowed[start : start + n]):
            return start
    return None


def phrase_spans(phrase: str, tokenizer: Any) -> list[list[int]]:
    """The token-id spans a phrase may appear as (as written, and after a space)."""
    tok = tokenizer_of(tokenizer)
    spans: list[list[int]] = []
    for text in (phrase, " " + phrase):
        ids = list(tok.encode(text, add_special_tokens=False))
        if ids and ids not in spans:
            spans.append(ids)
    return spans


def query_mask(
    input_ids: torch.Tensor,
    query: Query,
    *,
    where: torch.Tensor,
    tokenizer: Any = None,
    source: str = "prompt",
) -> torch.Tensor:
    """``[B, S]`` bool: the query tokens of each row.

    ``query`` is a phrase (``str``, tokenised with ``tokenizer``), a token-id span, a ``[B, S]``
    bool mask or ``[B, Tq]`` positions. Phrases and spans are searched in ``where`` (``source``
    names it in messages: the prompt's text, or the answer), last occurrence first; a row
    without it raises ``ValueError``.
    """
    batch, seq = input_ids.shape
    if isinstance(query, torch.Tensor):
        if query.dtype == torch.bool:
            if tuple(query.shape) != (batch, seq):
                raise ValueError(
                    f"query mask has shape {list(query.shape)}, expected [{batch}, {seq}]"
                )
            mask = query.to(input_ids.device)
        else:
            if query.dim() != 2 or query.shape[0] != batch:
                raise ValueError(f"query positions must be [{batch}, Tq], got {list(query.shape)}")
            if bool(((query < 0) | (query >= seq)).any()):
                raise ValueError(f"query positions must lie in [0, {seq})")
            mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
            mask.scatter_(1, query.to(input_ids.device).long(), True)
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("every row needs at least one query token")
        return mask
    if isinstance(query, str):
        if not query.strip():
            raise ValueError("query phrase is empty")
        if tokenizer is None:
            raise ValueError("a phrase query needs processor= (the processor or its tokenizer)")
        candidates = phrase_spans(query, tokenizer)
    elif isinstance(query, Sequence) and query and all(isinstance(t, int) for t in query):
        candidates = [list(query)]
    else:
        raise TypeError(
            "query must be a phrase (str), a list of token ids, a [B, S] bool mask or [B, Tq] "
            f"positions, got {query!r}"
        )
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
    ids = input_ids.tolist()
    allowed = where.tolist()
    for b in range(batch):
        for span in candidates:
            start = _find_span(ids[b], span, allowed[b])
            if start is not None:
                mask[b, start : start + len(span)] = True
                break
        else:
            raise ValueError(_not_found(query, candidates, b, source, tokenizer))
    return mask


def _not_found(query: Any, candidates: list[list[int]], row: int, source: str, tok: Any) -> str:
    unk = getattr(tokenizer_of(tok), "unk_token_id", None) if tok is not None else None
    if unk is not None and all(unk in span for span in candidates):
        name = getattr(tokenizer_of(tok), "unk_token", "<unk>")
        return (
            f"query {query!r} tokenises to the unknown token {name!r} (id {unk}): the "
            f"tokenizer does not know (part of) it, so it cannot be found in the {source}; "
            "use the words the prompt spells (the tokens the model saw)"
        )
    return f"query {query!r} (tokens {candidates}) not found in row {row} of the {source}"


def text_tokens(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, S]`` bool: valid tokens that are not visual."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    return valid & ~get_adapter(model).visual_mask(model, input_ids)


def instruction(
    model: nn.Module, inputs: Mapping[str, Any], *, require: bool = True
) -> torch.Tensor:
    """``[B, S]`` bool: the valid text tokens after each row's last visual token (``require``:
    a row without any raises)."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    visual = get_adapter(model).visual_mask(model, input_ids) & valid
    out = Prefill(input_ids, valid, visual, {}).text_after_image()
    if require and bool((out.sum(1) == 0).any()):
        raise ValueError("a row has no text after its image to use as the query")
    return out


def _rows_and_weights(
    model: nn.Module, inputs: Mapping[str, Any], query: Query, answer: Any, tokenizer: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward inputs and ``[B, S]`` bool query tokens of a prompt (default: the
    instruction); used by localization-head selection."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be the processor's output mapping with input_ids")
    inputs = dict(inputs)
    if query is None:
        return inputs, instruction(model, inputs)
    where = text_tokens(model, inputs)
    return inputs, query_mask(inputs["input_ids"], query, where=where, tokenizer=tokenizer)


# --- running the probe ----------------------------------------------------------------------
@dataclass
class _Probed:
    """Attention rows of one forward pass and what is needed to read them."""

    records: list[Rows]
    prefill: Prefill
    layout: list[list[ImageLayout]]
    layers: list[int]
    n_heads: int
    logits: torch.Tensor | None = None  # [B, V] next-token logits after the last input token


def probe_forward(
    model: nn.Module,
    inputs: Mapping[str, Any],
    rows: torch.Tensor,
    layers: Sequence[int] | None,
    prompt_end: int | None = None,
) -> _Probed:
    """One forward pass recording the attention rows ``rows [B, S]`` at ``layers``.

    ``prompt_end``: the inputs are a prompt of that many tokens plus a teacher-forced answer;
    on a pruned model the pruner then scores with the prompt's rows, as generation did.
    """
    adapter = get_adapter(model)
    n_layers = len(adapter.decoder_layers(model))
    layers = list(range(n_layers)) if layers is None else check_layers(layers, n_layers)
    inputs = dict(inputs)
    inputs.pop("labels", None)
    with torch.no_grad(), AttentionProbe(model, layers, rows=rows) as probe:
        scoring = probe.tracker.scoring_prompt(prompt_end) if prompt_end else nullcontext()
        with scoring:
            out = model(**inputs, use_cache=False)
        prefill = probe.prefill
    logits = getattr(out, "logits", None)
    logits = None if logits is None else logits[:, -1]  # on the device: read only if needed
    layout = prefill.layout(model, adapter)
    attn = getattr(adapter.decoder_layers(model)[layers[0]], adapter.attention)
    n_heads = probe.records[0].probs.shape[1] if probe.records else attn.config.num_attention_heads
    return _Probed(probe.records, prefill, layout, layers, n_heads, logits)


def head_pairs(heads: HeadSpec) -> list[tuple[int, int]]:
    """``(layer, head)`` pairs of localization heads or a ``{layer: [heads]}`` mapping."""
    pairs = getattr(heads, "heads", heads)
    if isinstance(pairs, Mapping):
        return [(int(layer), int(h)) for layer, hs in pairs.items() for h in hs]
    return [(int(layer), int(h)) for layer, h in pairs]


def head_weights(heads: HeadSpec, layers: list[int], n_heads: int) -> torch.Tensor:
    """``[len(layers), n_heads]`` weights that average over the selected (layer, head) pairs."""
    weights = torch.zeros(len(layers), n_heads)
    if heads is None:
        weights[:] = 1.0
    else:
        for layer, head in head_pairs(heads):
            if layer not in layers:
                raise ValueError(f"head ({layer}, {head}): layer {layer} was not probed ({layers})")
            if not 0 <= head < n_heads:
                raise ValueError(f"head ({layer}, {head}) is outside [0, {n_heads})")
            weights[layers.index(layer), head] = 1.0
        if weights.sum() == 0:
            raise ValueError("no heads selected")
    return weights / weights.sum()


def _weights(probed: _Probed, query: torch.Tensor) -> torch.Tensor:
    """Per recorded query row, ``1 / n`` on the row's query tokens (mean over the query)."""
    rec = probed.records[0]
    picked = query.gather(1, rec.positions) & rec.mask
    return picked.float() / picked.sum(1, keepdim=True).clamp(min=1)


def token_attention(
    probed: _Probed, row_weights: torch.Tensor, *, per_head: bool = False
) -> list[list[torch.Tensor]]:
    """Per row and image, the attention each of the image's tokens receives.

    ``row_weights [B, Tq]`` weights the recorded query rows (e.g. ``1/n`` on a phrase's tokens).
    Returns ``[L, H, n]`` per image (layers in ``probed.layers`` order) when ``per_head``, else
    the mean over layers and heads kept as ``[1, 1, n]``.
    """
    by_layer = {r.layer: r for r in probed.records}
    out: list[list[torch.Tensor]] = []
    for b, images in enumerate(probed.layout):
        row_images = []
        for image in images:
            positions = image.positions.to(row_weights.device)
            stack = []
            for layer in probed.layers:
                rec = by_layer[layer]
                w = (row_weights[b] * rec.mask[b].float())[None, :, None]  # [1, Tq, 1]
                probs = rec.probs[b][:, :, positions]  # [H, Tq, n]
                stack.append((probs * w).sum(1))  # [H, n]
            per = torch.stack(stack)  # [L, H, n]
            row_images.append(per if per_head else per.mean((0, 1), keepdim=True))
        out.append(row_images)
    return out


def image_rows(probed: _Probed, weights: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per row and image, ``[Tq, n]``: each recorded query row's attention to the image's
    tokens, averaged over the (layer, head) pairs with ``weights [L, H]``."""
    by_layer = {r.layer: r for r in probed.records}
    out: list[list[torch.Tensor]] = []
    for b, images in enumerate(probed.layout):
        row_images = []
        for image in images:
            total = None
            for li, layer in enumerate(probed.layers):
                probs = by_layer[layer].probs[b]  # [H, Tq, L]
                positions = image.positions.to(probs.device)
                w = weights[li].to(probs.device, probs.dtype)  # [H]
                part = torch.einsum("h,htn->tn", w, probs[:, :, positions].float())  # [Tq, n]
                total = part if total is None else total + part
            row_images.append(total.cpu())
        out.append(row_images)
    return out


def entropy(grid: torch.Tensor) -> float:
    """Shannon entropy (nats) of a non-negative map normalised to sum 1."""
    p = grid.flatten().double().clamp(min=0)
    total = p.sum()
    if total <= 0:
        return math.log(max(p.numel(), 1))
    p = p / total
    return float(-(p * p.clamp(min=1e-30).log()).sum())
