"""What the pruning engine knows: the setting it was attached with (:class:`EngineSetup`), one
hooked layer's call (:class:`LayerCall`), the state of one pruned prompt and the decode steps
that follow it (:class:`PruneState`), and the
one object it shares with the call tracker (:class:`PrunedLayers`): what each decoder layer
holds in the call under way, which the probes and biases read through the tracker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import FocusConfig
from ..model_adapters import ImageLayout, ModelAdapter
from ..trace import FocusTrace
from .calls import Prefill
from .fixation import StepFixation
from .pruner import Pruner


@dataclass(frozen=True)
class EngineSetup:
    """The model, its adapter, the setting and the pruners that one engine serves: ``pruner``,
    and ``video_pruner`` for prompts that carry a video (``None``: ``pruner`` for every prompt,
    see :attr:`~vlm_focus.FocusConfig.pruner_for_video`)."""

    model: nn.Module
    adapter: ModelAdapter
    config: FocusConfig
    pruner: Pruner
    layers: Any  # the decoder layers (an nn.ModuleList)
    stages: dict[int, float | int]  # stage layer -> keep
    first_layer: int  # K: the first stage layer; layers >= K are hooked
    flash: bool  # flash attention: no key masks, and no position ids in pruned layers
    #: a pruned layer keeps a recurrent state (a hybrid decoder's linear attention): it reads
    #: every token it holds, so no key can be masked in it
    recurrent: bool = False
    #: every linear-attention layer (pruned or not): it holds fixed-size states, no keys
    linear_layers: frozenset[int] = frozenset()
    video_pruner: Pruner | None = None
    #: each KV-shared layer to the layer whose keys and values it reuses
    #: (:meth:`~vlm_focus.model_adapters.ModelAdapter.key_source`); it holds no cache
    key_sources: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        adapter: ModelAdapter,
        config: FocusConfig,
        pruner: Pruner,
        video_pruner: Pruner | None = None,
    ) -> EngineSetup:
        stages = dict(config.stages)
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
        linear = adapter.recurrent_layers(model)
        layers = adapter.decoder_layers(model)
        sources = {i: adapter.key_source(model, i) for i in range(len(layers))}
        return cls(
            model=model,
            adapter=adapter,
            config=config,
            pruner=pruner,
            layers=layers,
            stages=stages,
            first_layer=min(stages),
            flash=attn.startswith("flash"),
            recurrent=any(i >= min(stages) for i in linear),
            linear_layers=linear,
            video_pruner=video_pruner,
            key_sources={i: j for i, j in sources.items() if i != j},
        )

    @property
    def last_layer(self) -> int:
        return len(self.layers) - 1

    @property
    def all_pruners(self) -> list[Pruner]:
        """``pruner``, then ``video_pruner`` when there is one."""
        return [self.pruner] + ([self.video_pruner] if self.video_pruner is not None else [])

    def row_pruners(self, layout: list[list[ImageLayout]]) -> list[Pruner]:
        """Per batch row, the pruner that chooses its kept set: ``video_pruner`` for a row
        with a video in ``layout``, else ``pruner`` (so a batch that mixes video and image rows
        prunes each row as it would alone)."""
        video = self.video_pruner
        return [
            video if video is not None and any(i.kind == "video" for i in row) else self.pruner
            for row in layout
        ]


@dataclass(slots=True)
class LayerCall:
    """One hooked decoder layer's call: its index and module, its input hidden states
    (``[B, T, D]``), its keyword arguments and the cache they carry."""

    index: int
    module: nn.Module
    hidden: torch.Tensor
    kwargs: dict
    cache: Any


@dataclass
class PruneState:
    """State of one pruned prompt and the decode steps that follow it."""

    prompt: Prefill  # the prompt without its cache; its pixel inputs are let go at decode
    layout: list[list[ImageLayout]]  # the prompt's, or empty rows when nothing is pruned
    drops: list[int]  # visual tokens every row drops at each stage
    # per stage, per row: visual tokens it keeps in its slots but masks as keys, so that each
    # row keeps its own share while the batch keeps one length (host; all 0 without this rule)
    extras: list[list[int]]
    visual_counts: list[list[int]]  # per stage, per row: visual tokens before it (host)
    trace: FocusTrace
    current: torch.Tensor  # [B, S'] original positions still present
    prompt_end: int | None = None  # rows a pruner scores with (a teacher-forced pass), or all
    per_layer: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: Any = None  # weakref to the cache this prefill filled
    frames: torch.Tensor | None = None  # [B, S] image / frame id (budget="frame")
    memo: dict = field(default_factory=dict)  # slices reused across the layers of a stage
    fixation: StepFixation | None = None  # decode-time selection (a decode_time pruner)
    pruners: list[Pruner] = field(default_factory=list)  # per row, the one that chooses
    # A static cache: every attention layer writes at its own length into a buffer as wide as
    # the cache, and every full-attention mask is that wide. Per attention layer, the mask
    # column each buffer slot reads in decode (built once, at the end of the prompt: a
    # compiled step then only gathers).
    static: bool = False
    static_cols: dict[int, torch.Tensor] = field(default_factory=dict)
    # with sliding windows, static_cols holds each slot's original position instead, and this
    # per layer whether the slot holds a key ([B, slots]) and how many prompt tokens it holds
    static_keys: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    prefilling: bool = True  # the prompt's own call (False from the first decode step on)
    # per stage layer, the local indices its stage kept (a recomputed layer, e.g. under
    # gradient checkpointing, slices the same tokens again instead of scoring twice)
    stage_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # in a decode step, the mask each layer a KV-shared layer reads from was given: the
    # shared layer attends to the same keys
    step_masks: dict[int, Any] = field(default_factory=dict)
    # labels: the next-token target of every original position ([B, S]) and the loss kwargs;
    # the loss is taken over the positions the last layer holds (see core.pruned_loss)
    targets: torch.Tensor | None = None
    masked: torch.Tensor | None = None  # [B, S] original positions masked as keys (extras)
    masked_at: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, [B, S'] local
    loss_kwargs: dict = field(default_factory=dict)
    # positions="compact": the visual tokens every row dropped, on the device (a tensor, so a
    # compiled decode step does not specialise on the count)
    dropped: torch.Tensor | None = None

    @property
    def visual(self) -> torch.Tensor:
        return self.prompt.visual  # [B, S] bool, original positions

    @property
    def valid(self) -> torch.Tensor:
        return self.prompt.valid  # [B, S] bool, original positions

    @property
    def full_len(self) -> int:
        return self.prompt.input_ids.shape[1]

    def once(self, name: str, source: Any, current: torch.Tensor, make: Callable[[], Any]) -> Any:
        """``make()``, computed once and reused while ``source`` and ``current`` stay the same
        objects (they do across the layers of a stage, or of one decode step)."""
        hit = self.memo.get(name)
        if hit is not None and hit[0] is source and hit[1] is current:
            return hit[2]
        value = make()
        self.memo[name] = (source, current, value)
        return value


class PrunedLayers:
    """What each decoder layer of a pruned model holds in the call under way: the engine sets
    :attr:`state` (the prompt the call belongs to), the call tracker answers the probes and
    biases from it."""

    def __init__(self, first_layer: int) -> None:
        self.first_layer = first_layer
        self.state: PruneState | None = None

    def prompt_positions(self, index: int) -> torch.Tensor | None:
        """``[B, S']`` original positions of the prompt tokens layer ``index`` holds (and
        outputs) in the current prefill, or ``None`` when it holds them all (before the first
        stage, or no pruned prefill is current)."""
        state = self.state
        if state is None or index < self.first_layer:
            return None
        return state.per_layer.get(index)

    def fixating(self) -> bool:
        """True while a decode-time pruner chooses the keys of each decoding step."""
        return self.state is not None and self.state.fixation is not None

    def dropped_keys(self) -> dict[int, torch.Tensor]:
        """Per layer holding fewer prompt tokens, ``[B, S]`` bool: the visual tokens it lacks."""
        state = self.state
        if state is None:
            return {}
        out = {}
        for index, held in state.per_layer.items():
            masked = state.masked_at.get(index)
            if held.shape[1] == state.full_len and masked is None:
                continue
            held = held.to(state.visual.device)
            has = torch.zeros_like(state.visual).scatter(1, held, True)
            if masked is not None:
                has = has.scatter(1, held, ~masked.to(has.device))
            out[index] = state.visual & ~has
        return out
