"""Small-model-guided pruning (SGL): a small VLM's attention ranks the large VLM's tokens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..config import FocusConfig
from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner
from ..model_adapters import ImageLayout, ModelAdapter, get_adapter
from ..trace import FocusTrace
from ._common import ImageTokens, fill_cellless, image_tokens
from ._math import resample_map


@dataclass
class GuidedOptions:
    guide: Any = option(None, "the small guide VLM (any supported model class)")
    guide_inputs: Any = option(
        None,
        "the guide's processor outputs for the same images and prompt (a dict), or "
        "a callable(large_inputs: dict) -> dict, given the large model's forward inputs for "
        "the prompt (inside generate() without pixel_values: the images are encoded first); "
        "guided_generate() can pass them per call",
    )
    with_answer: bool = option(
        False, "also count the attention of the guide's generated answer tokens"
    )
    answer_tokens: int = option(8, "tokens the guide generates")
    early_exit: float | None = option(
        None,
        "guided_generate() returns the guide's answer when its geometric-mean "
        "token probability is at least this (None: never)",
    )

    def __post_init__(self) -> None:
        if self.guide is None:
            raise ValueError("guided pruning needs guide=<a small VLM of a supported class>")
        if not isinstance(self.guide, nn.Module):
            raise ValueError(f"guide must be a transformers model, got {type(self.guide)}")
        try:
            get_adapter(self.guide)
        except ValueError as err:
            raise ValueError(f"guide: {err}") from err
        if self.guide_inputs is not None and not (
            isinstance(self.guide_inputs, Mapping) or callable(self.guide_inputs)
        ):
            raise ValueError("guide_inputs must be a dict of processor outputs or a callable")
        if not isinstance(self.with_answer, bool):
            raise ValueError(f"with_answer={self.with_answer!r} must be True or False")
        n = self.answer_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"answer_tokens={n!r} must be an int >= 1")
        t = self.early_exit
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1
        ):
            raise ValueError(f"early_exit={t!r} must be None or a probability in (0, 1]")


@dataclass
class GuideResult:
    """One guide pass: ``maps[b][i]`` is image i of row b as ``{view: [rows, cols] map}``;
    ``sequences``/``confidence`` hold its generated answer when it generated one."""

    maps: list[list[dict[int, torch.Tensor]]]
    sequences: torch.Tensor | None = None
    confidence: list[float] | None = None


@dataclass
class GuidedTrace(FocusTrace):
    """A :class:`FocusTrace` that also records the guide: ``early_exit`` is True when the
    guide's answer was returned and the large model never ran (then ``stages`` is empty)."""

    early_exit: bool = False
    confidence: list[float] | None = None
    guide_sequences: torch.Tensor | None = None


@dataclass
class GuidedOutput:
    sequences: torch.Tensor
    early_exit: bool
    confidence: list[float] | None
    output: Any = None  # the large model's generate() output when it ran


def _answer_confidence(
    new_tokens: torch.Tensor, logits: list[torch.Tensor], eos: set[int]
) -> tuple[list[float], torch.Tensor]:
    """Geometric-mean probability of each row's generated tokens up to and including its first
    EOS, and ``[B, n]`` bool of those tokens."""
    logp = torch.stack(
        [
            torch.log_softmax(s.float(), -1).gather(1, t[:, None])[:, 0]
            for s, t in zip(logits, new_tokens.T, strict=True)
        ],
        1,
    )  # [B, n]
    is_eos = torch.zeros_like(new_tokens, dtype=torch.bool)
    for e in eos:
        is_eos |= new_tokens == e
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    valid = ~after
    mean = (logp * valid).sum(1) / valid.sum(1).clamp(min=1)
    return mean.exp().tolist(), valid


def guide_attention(
    guide: nn.Module, inputs: Mapping[str, Any], *, answer_tokens: int = 0
) -> GuideResult:
    """Run the guide on its inputs and return its text-to-vision attention per image.

    The attention of every instruction token (and, with ``answer_tokens``, of the guide's
    greedy answer) to every visual token, head mean, summed over ALL decoder layers. Each
    layer's attention comes from its own q/k through the score-and-select dispatch (a
    forward pre-hook per layer), so the guide may run under SDPA or flash attention.
    """
    if getattr(guide, "_vlm_focus_handle", None) is not None:
        raise ValueError("the guide model must not itself be wrapped by vlm_focus")
    adapter = get_adapter(guide)
    inputs = {k: v for k, v in inputs.items() if v is not None}
    sequences = confidence = None
    with torch.no_grad():
        if answer_tokens:
            out = guide.generate(
                **inputs,
                max_new_tokens=answer_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            prompt_len = inputs["input_ids"].shape[1]
            new = out.sequences[:, prompt_len:]
            eos = guide.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
            confidence, keep = _answer_confidence(new, list(out.logits), eos)
            sequences = out.sequences
            inputs = dict(inputs, input_ids=out.sequences)
            mask = inputs.get("attention_mask")
            if mask is not None:
                inputs["attention_mask"] = torch.cat([mask, keep.to(mask.dtype)], 1)
            if "mm_token_type_ids" in inputs:
                types = inputs["mm_token_type_ids"]
                inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros_like(new)], 1)
        input_ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        valid = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        visual = adapter.visual_mask(guide, input_ids) & valid
        layout = adapter.layout(guide, input_ids, inputs)
        config = FocusConfig(query_rows="text", reduce="mean")
        sums: list[torch.Tensor] = []  # per layer [B, S], summed on the guide's device
        layers = adapter.decoder_layers(guide)
        batch, seq = input_ids.shape
        counts = visual.sum(1).tolist()  # one host read for all layers

        def hook_for(index: int) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                cos, sin = kwargs["position_embeddings"]
                ctx = StageContext(
                    model=guide,
                    adapter=adapter,
                    config=config,
                    layer_index=index,
                    stage_index=0,
                    decoder_layer=module,
                    hidden=hidden,
                    cos=cos.expand(batch, -1, -1),
                    sin=sin.expand(batch, -1, -1),
                    positions=torch.arange(seq, device=hidden.device).expand(batch, seq),
                    visual=visual.to(hidden.device),
                    valid=valid.to(hidden.device),
                    layout=layout,
                    inputs=inputs,
                    visual_counts=counts,
                )
                scores = ctx.attention_scores(1).scores.float()
                if sums:  # one running sum, kept on the first layer's device
                    previous = sums.pop()
                    scores = previous + scores.to(previous.device)
                sums.append(scores)

            return hook

        handles = [
            layer.register_forward_pre_hook(hook_for(i), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]
        try:
            guide(**inputs)
        finally:
            for h in handles:
                h.remove()
        total = sums[0].cpu() if sums else torch.zeros(input_ids.shape)
    maps = []
    for b, images in enumerate(layout):
        row = []
        for image in images:
            values = total[b, image.positions]
            views = {}
            for view, (rows, cols) in enumerate(image.grids):
                grid = torch.zeros(rows, cols)
                here = (image.cells[:, 0] == view) & (image.cells[:, 1] >= 0)
                grid[image.cells[here, 1], image.cells[here, 2]] = values[here]
                views[view] = grid
            row.append(views)
        maps.append(row)
    return GuideResult(maps=maps, sequences=sequences, confidence=confidence)


def map_to_tokens(guide_views: dict[int, torch.Tensor], tokens: ImageTokens) -> torch.Tensor:
    """The guide's map of one image on the large model's tokens of that image: every guide
    view is normalised to mean 1, resampled (area) onto each of the large model's view grids
    by 2-D grid coordinates and averaged; cell-less tokens take the token before them."""
    layout: ImageLayout = tokens.layout
    cells = tokens.cells
    out = torch.zeros(cells.shape[0])
    sources = [m / m.mean().clamp(min=1e-12) for m in guide_views.values()]
    for view, shape in enumerate(layout.grids):
        here = (cells[:, 0] == view) & (cells[:, 1] >= 0)
        if not here.any():
            continue
        target = torch.stack([resample_map(m, shape) for m in sources]).mean(0)
        out[here] = target[cells[here, 1], cells[here, 2]]
    return fill_cellless(out, cells)


@register_pruner
class GuidedPruner(Pruner):
    """Small-model guidance (SGL, Zhao et al., 2025, "A Stitch in Time Saves Nine").

    ``score[s] = G_i(cell(s))`` where ``G_i = resample(sum_l sum_t mean_h A_l[t, v])`` is the
    guide VLM's attention from its instruction tokens ``t`` (and optionally its own answer)
    to image i's visual tokens ``v``, summed over ALL its layers ``l``, resampled by area onto
    the large model's grid of the same image (per view, by 2-D cell). The large model is
    pruned at the configured stage (``layer=0``: before its LLM; ``layer=K``: at layer K).
    With ``early_exit=p``, :func:`guided_generate` returns the guide's own answer when its
    geometric-mean token probability is ``>= p`` and the large model never runs.

    Example::

        handle = vf.wrap(large, pruner="guided", guide=small, keep=0.25, layer=0)
        out = guided_generate(handle, large_inputs, small_inputs, max_new_tokens=8)
        out.sequences, out.early_exit, handle.last_trace

    ``guide_inputs`` may instead be set at wrap time, as a dict or a callable that builds the
    guide's inputs from the large model's prefill inputs (``input_ids``, ``attention_mask``).
    """

    name = "guided"
    needs_guide = drives_decoding = True
    Options = GuidedOptions
    summary = "small guide VLM's all-layer text-to-image attention, resampled to the grid"

    def __init__(self, config: Any, options: GuidedOptions) -> None:
        super().__init__(config, options)
        self._pending: GuideResult | None = None
        self._current: GuideResult | None = None
        self.last_guide: GuideResult | None = None

    def attach(self, model: nn.Module, adapter: ModelAdapter) -> list[Any]:
        if self.options.guide is model:
            raise ValueError("guide must be a different (smaller) model than the wrapped one")
        return []

    def run_guide(self, guide_inputs: Mapping[str, Any], answer_tokens: int = 0) -> GuideResult:
        n = answer_tokens or (self.options.answer_tokens if self.options.with_answer else 0)
        result = guide_attention(self.options.guide, guide_inputs, answer_tokens=n)
        self.last_guide = result
        return result

    def _guide_for(self, ctx: StageContext) -> GuideResult:
        if ctx.stage_index > 0 and self._current is not None:
            return self._current
        if self._pending is not None:
            result, self._pending = self._pending, None
        else:
            source = self.options.guide_inputs
            if source is None:
                raise ValueError(
                    "guided pruning has no guide inputs: pass guide_inputs= to wrap() or use "
                    "guided_generate(handle, inputs, guide_inputs)"
                )
            # a pass over prompt + answer (grounding) hands the guide the prompt, as generate() did
            inputs = source(ctx.prompt_inputs()) if callable(source) else source
            result = self.run_guide(inputs)
        self._current = result
        return result

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        result = self._guide_for(ctx)
        scores = torch.zeros(ctx.visual.shape)
        rows = image_tokens(ctx)
        if len(result.maps) != len(rows) or any(
            len(g) != len(r) for g, r in zip(result.maps, rows, strict=True)
        ):
            raise ValueError(
                "the guide's inputs must hold the same images, in the same rows, as the large "
                f"model's: guide {[len(g) for g in result.maps]}, model {[len(r) for r in rows]}"
            )
        for guide_row, row in zip(result.maps, rows, strict=True):
            for views, tokens in zip(guide_row, row, strict=True):
                values = map_to_tokens(views, tokens)
                scores[tokens.row, tokens.local] = values
        return Selection(scores=scores.to(ctx.hidden.device))


def guided_generate(
    handle: Any, inputs: Mapping[str, Any], guide_inputs: Mapping[str, Any], **generate_kwargs
) -> GuidedOutput:
    """Generate with the large model pruned by its guide, or return the guide's answer.

    ``handle`` comes from ``wrap(model, pruner="guided", ...)``. With ``early_exit`` set, the
    guide answers first (``max_new_tokens`` tokens); when every row's geometric-mean token
    probability reaches the threshold, its sequences are returned, the large model is skipped
    and ``handle.last_trace`` is a :class:`GuidedTrace` with ``early_exit=True``. Otherwise the
    guide's map (from the same pass) prunes the large model's ``generate()``.
    """
    engine = getattr(handle, "_engine", None)
    pruner = getattr(engine, "pruner", None)
    if not isinstance(pruner, GuidedPruner):
        raise ValueError("guided_generate needs an active handle from wrap(pruner='guided')")
    threshold = pruner.options.early_exit
    n_answer = 0
    if threshold is not None:
        n_answer = int(generate_kwargs.get("max_new_tokens", pruner.options.answer_tokens))
    result = pruner.run_guide(guide_inputs, n_answer)
    model = handle.model
    input_ids = inputs["input_ids"]
    if threshold is not None and min(result.confidence) >= threshold:
        adapter = engine.adapter
        mask = inputs.get("attention_mask")
        visual = adapter.visual_mask(model, input_ids)
        if mask is not None:
            visual &= mask.bool()
        engine.last_trace = GuidedTrace(
            n_visual=visual.sum(1).tolist(),
            visual=visual,
            early_exit=True,
            confidence=result.confidence,
            guide_sequences=result.sequences,
        )
        return GuidedOutput(result.sequences, True, result.confidence)
    pruner._pending = result
    try:
        output = model.generate(**inputs, **generate_kwargs)
    finally:
        pruner._pending = None
    trace = engine.last_trace
    if trace is not None:
        engine.last_trace = GuidedTrace(
            **{f.name: getattr(trace, f.name) for f in fields(FocusTrace)},
            confidence=result.confidence,
            guide_sequences=result.sequences,
        )
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    return GuidedOutput(sequences, False, result.confidence, output)
