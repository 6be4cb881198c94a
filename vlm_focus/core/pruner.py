"""The pruner interface and the per-stage context a pruner scores from.

A pruner sees one :class:`StageContext` per pruning stage and returns a :class:`Selection`:
a score per token of the current sequence (higher is kept; only visual tokens are candidates).
The engine turns scores into kept sets, so every pruner gets batching, padding, ragged visual
counts and multi-stage schedules for free.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..kernels import score_and_select
from .attention import (  # noqa: F401 (apply_rope, text_after_image re-exported)
    allowed_keys,
    apply_rope,
    image_blocks,
    layer_qk,
    layer_window,
    text_after_image,
)

if TYPE_CHECKING:
    from ..config import FocusConfig
    from ..model_adapters import ImageLayout, ModelAdapter


@dataclass
class NoOptions:
    """A pruner without options of its own."""


@dataclass(frozen=True)
class StepReuse:
    """How a decode-time pruner's steps reuse the last fixation: every visual token competes
    every ``refresh`` steps; in between only the last fixation and its grid neighbours within
    ``radius`` cells (Chebyshev) do."""

    refresh: int = 1
    radius: int = 0


@dataclass
class Selection:
    """``scores [B, S]`` over the current sequence (non-visual entries are ignored) and,
    optionally, ``kept [B, n_keep]`` local indices when the pruner already selected them."""

    scores: torch.Tensor
    kept: torch.Tensor | None = None


@dataclass
class StageContext:
    """Everything a pruner may read at one stage, for the CURRENT (possibly already pruned) rows.

    Attributes:
        layer_index: the decoder layer whose input is being pruned.
        hidden: ``[B, S, D]`` that layer's input hidden states.
        cos, sin: ``[B, S, head_dim]`` rotary tables of the current tokens.
        positions: ``[B, S]`` original sequence position of each current token.
        visual: ``[B, S]`` bool, current visual tokens (the candidates).
        valid: ``[B, S]`` bool, False on padding.
        layout: per row, the images' :class:`ImageLayout` in original positions.
        inputs: the prefill's forward inputs (``pixel_values``, grids, ...), for pre-LLM sources.
        visual_counts: per row, ``visual.sum(1)`` as host ints (the engine knows them).
    """

    model: nn.Module
    adapter: ModelAdapter
    config: FocusConfig
    layer_index: int
    stage_index: int
    decoder_layer: nn.Module
    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    visual: torch.Tensor
    valid: torch.Tensor
    layout: list[list[ImageLayout]]
    inputs: dict[str, Any]
    #: per row, the number of current visual tokens, known on the host (``None``: count them)
    visual_counts: list[int] | None = None
    #: original positions from here on are a teacher-forced continuation of the prompt (an
    #: answer), never scoring rows; ``None``: the sequence is the prompt
    prompt_end: int | None = None

    @property
    def attention(self) -> nn.Module:
        return getattr(self.decoder_layer, self.adapter.attention)

    def prompt_inputs(self) -> dict[str, Any]:
        """The prefill's forward inputs without the teacher-forced continuation: every
        ``[B, S]`` integer input (ids, mask, token types) cut at ``prompt_end``."""
        inputs = dict(self.inputs)
        ids = inputs.get("input_ids")
        if self.prompt_end is None or not isinstance(ids, torch.Tensor):
            return inputs
        for key, value in inputs.items():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == ids.shape
                and not value.is_floating_point()
            ):
                inputs[key] = value[:, : self.prompt_end]
        return inputs

    def query_rows(
        self, query: str | None = None, *, strict: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local indices ``[B, Tq]`` of the scoring rows and their weights ``[B, Tq]``.

        ``last``: the final prompt token. ``text``: every valid prompt token after the row's
        last visual token, equally weighted (rows with fewer such tokens get zero-weight
        filler); a row whose prompt ends with its image scores with its last token, unless
        ``strict`` (a pruner that needs the instruction) makes that an error. Tokens from
        ``prompt_end`` on are never scoring rows.
        """
        query = query or self.config.query_rows
        batch, seq = self.visual.shape
        device = self.hidden.device
        valid = self.valid
        if self.prompt_end is None:
            stop = torch.full((batch, 1), seq, device=device)
        else:  # the prompt's current tokens come first: positions ascend in every row
            in_prompt = self.positions.to(device) < self.prompt_end
            stop = in_prompt.sum(1, keepdim=True)
            valid = valid & in_prompt
        if query == "last":
            return stop - 1, torch.ones(batch, 1, device=device)
        is_text = text_after_image(self.visual, valid)
        n_text = is_text.sum(1)
        fewest, tq = torch.stack([n_text.min(), n_text.max()]).tolist()  # one host read
        if fewest == 0 and not strict:  # a prompt that ends with its image: its last token
            last = torch.zeros_like(is_text).scatter(1, (stop - 1).clamp(min=0), True)
            is_text = is_text | (last & (n_text == 0)[:, None])
            n_text, tq = is_text.sum(1), max(tq, 1)
        elif fewest == 0:
            raise ValueError(
                "query_rows='text' scores visual tokens with the instruction after the image, but "
                "a prompt has no text after its image; add an instruction, or use "
                "query_rows='last'"
            )
        rows = stop - tq + torch.arange(tq, device=device)  # [B, tq]: the prompt's last tq
        selected = is_text.gather(1, rows)
        weights = selected.float() / n_text.clamp(min=1)[:, None]
        return rows, weights

    def query_key(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, H, Tq, D]`` for the given rows and k ``[B, Hkv, S, D]``, after RoPE, computed
        with this layer's own norm and projections (never the full ``S x S`` attention)."""
        return layer_qk(self.adapter, self.decoder_layer, self.hidden, self.cos, self.sin, rows)

    def allowed(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``[B, Tq, S]`` bool: the current keys the query ``rows [B, Tq]`` (local indices) see
        under this layer's own mask (:func:`vlm_focus.core.attention.allowed_keys`, by original
        positions: the model's mask rule, the layer's sliding window, padding), or ``None``
        where that mask is plain causal + padding, which every scorer applies itself."""
        window = layer_window(self.adapter, self.decoder_layer)
        if self.adapter.mask_rule == "causal" and window is None:
            return None
        blocks = image_blocks(self.visual)
        query_pos = self.positions.gather(1, rows)
        return allowed_keys(
            self.valid,
            query_pos,
            self.positions,
            rule=self.adapter.mask_rule,
            window=window,
            blocks=(blocks.gather(1, rows), blocks),
        )

    def attention_scores(
        self,
        n_keep: int,
        *,
        query: str | None = None,
        reduce: str | None = None,
        query_weights: torch.Tensor | None = None,
        debias: torch.Tensor | None = None,
    ) -> Selection:
        """Attention mass from the query rows to each visual token, via the kernel dispatch."""
        rows, weights = self.query_rows(query)
        if query_weights is not None:
            weights = query_weights
        q, k = self.query_key(rows)
        scores, kept = score_and_select(
            q,
            k,
            self.visual,
            n_keep,
            scaling=self.attention.scaling,
            key_mask=self.valid,
            query_pos=rows,
            query_weights=weights,
            reduce=reduce or self.config.reduce,
            debias=debias,
            n_visual=None if self.visual_counts is None else min(self.visual_counts),
            allowed=self.allowed(rows),
        )
        return Selection(scores=scores, kept=kept)


class Pruner:
    """Base class. Subclasses set ``name`` and ``Options`` (a dataclass checked in
    ``__post_init__``) and implement :meth:`select`."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: One line for the README table: what the pruner scores.
    summary: ClassVar[str] = ""
    #: True when the scores are LLM attention from :meth:`StageContext.attention_scores`
    #: (such pruners can be wrapped by ``debiased``).
    attention_based: ClassVar[bool] = False
    #: True for a decode-time pruner: the engine selects per decoding step (``fixation``);
    #: the prompt keeps :meth:`prefill_keep` of the visual tokens, chosen by :meth:`select`.
    decode_time: ClassVar[bool] = False
    #: True when the pruner scores from a small guide model: callers hand it the guide, and
    #: it runs ``generate()`` itself (:func:`vlm_focus.pruners.guided_generate`).
    needs_guide: ClassVar[bool] = False
    #: True when the pruner drives decoding itself (through its guide, or by picking new
    #: visual keys at every step), so no mitigation or zoom can steer the same calls.
    drives_decoding: ClassVar[bool] = False
    #: True when the pruner can choose at layer 0 from what exists before the language model
    #: (an item's LLM-input embeddings, and layer 0's q/k over the prompt where it reads
    #: attention), so a backend that prunes before the LLM serves it (:mod:`.before_llm`).
    before_llm: ClassVar[bool] = False
    #: The options it runs with there (the parts of its score that exist before the LLM).
    before_llm_options: ClassVar[dict[str, Any]] = {}
    #: True when, before the LLM, it reads layer 0's attention over the prompt (so a backend
    #: hands it the decoder layer and the unpruned prompt), not the embeddings alone.
    reads_layer_attention: ClassVar[bool] = False
    #: True when its choice for one image depends on the prompt's other images (their
    #: attention, or one budget split over all of them): a backend that encodes each image
    #: alone serves it one image or video per prompt.
    reads_whole_prompt: ClassVar[bool] = False
    #: True when its before-LLM choice covers a video's frames.
    serves_video: ClassVar[bool] = False
    #: True when it scores with the instruction after the image, so a prompt must have one.
    needs_instruction: ClassVar[bool] = False

    def __init__(self, config: FocusConfig, options: Any) -> None:
        self.config = config
        self.options = options

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls.Options)]

    @classmethod
    def scores_before_llm(cls, adapter: ModelAdapter) -> bool:
        """Whether it chooses before the LLM for a model of ``adapter`` (``before_llm``,
        unless some part of its score comes from inside that model's encoder)."""
        return cls.before_llm

    def attach(self, model: nn.Module, adapter: ModelAdapter) -> list[Any]:
        """Called once by ``wrap()``: register any hooks the pruner needs outside the decoder
        (e.g. on the vision tower) and return their handles; ``remove()`` removes them."""
        return []

    def prefill_keep(self, keep: float | int) -> float | int:
        """What the prompt keeps at a stage whose ``keep`` is given (a decode-time pruner's
        ``keep`` is per decoding step, and its prompt keeps its own share)."""
        return keep

    def step_reuse(self) -> StepReuse:
        """For a ``decode_time`` pruner: how its decoding steps reuse the last fixation (by
        default every step re-scores every visual token)."""
        return StepReuse()

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        raise NotImplementedError
