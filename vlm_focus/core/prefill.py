"""A pruned prefill: plan the stages of a prompt with images, then score, select and slice.

The decoder computes RoPE ``(cos, sin)``, the mask and ``position_ids`` once at full length and
hands the same objects to every layer. So a pre-hook on every layer ``>= K`` slices
``hidden_states`` (only at a stage layer), cos/sin, the 4-D (or 2-D) mask and ``position_ids``
down to the tokens it keeps, once per stage. Kept tokens keep their ORIGINAL positions, so RoPE
sees exactly what the unpruned model would; with ``positions="compact"`` (one stage at layer 0,
1-D RoPE) they are renumbered as the prompt without its pruned tokens would be.

Batches: every row drops the same number of visual tokens (the smallest number any row asks to
drop), so all rows keep one common length and no row keeps fewer tokens than ``keep`` asks;
where it can, each row masks the rest of its own share as keys in the slots it keeps.

Counts come from the host, the kept set is chosen on the device, and each stage scores on its
layer's execution device (``device_map`` splits), so nothing here waits for the device.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ..config import keep_count
from ..model_adapters import ImageLayout
from ..trace import FocusTrace, StageTrace
from .calls import CACHE_KEYS, CallTracker, is_static
from .fixation import StepFixation
from .prune_state import EngineSetup, LayerCall, PruneState
from .pruned_loss import has_labels, take_labels
from .pruner import Pruner, Selection, StageContext
from .selection import frame_shares, keep_mask, kept_columns, lowest_visual, selected_keep
from .slicing import execution_device, gather_seq, mask_keys, on_device_of, slice_mask
from .static_decode import StaticBuffers


def frame_ids(layout: list[list[ImageLayout]], shape: tuple[int, int], device) -> torch.Tensor:
    """``[B, S]`` id of the image, or of the video frame, each original position belongs to
    (-1 off the visual span): the units of ``budget="frame"``."""
    frames = torch.full(shape, -1, dtype=torch.long)
    for b, images in enumerate(layout):
        next_id = 0
        for image in images:
            if image.kind == "video":
                frames[b, image.positions] = next_id + image.cells[:, 0].clamp(min=0)
                next_id += len(image.grids)
            else:
                frames[b, image.positions] = next_id
                next_id += 1
    return frames.to(device)


class PrefillPass:
    """The hooks' work in a prefill: :meth:`start` at the top model, :meth:`layer` at every
    hooked layer. ``states`` files each prefill under the cache it fills."""

    def __init__(
        self, setup: EngineSetup, static: StaticBuffers, states: weakref.WeakKeyDictionary
    ) -> None:
        self.setup = setup
        self.static = static
        self.states = states
        self._warned_uneven = False

    # --- the plan, at the top model -------------------------------------------------------------
    def start(self, tracker: CallTracker, cache: Any, kwargs: dict) -> tuple[PruneState, dict]:
        """Lay out a prompt with images and plan its stages; returns its state and the call's
        kwargs (without ``labels`` when the loss is taken over the kept positions, see
        :mod:`vlm_focus.core.pruned_loss`)."""
        setup, pruner = self.setup, self.setup.pruner
        prefill = tracker.prefill  # the tracker read this call's ids, padding and inputs
        input_ids, visual = prefill.input_ids, prefill.visual
        n_visual = visual.sum(1).tolist()
        # a text-only row has nothing to drop or score, so such a batch keeps the common rule
        per_row = self._per_row_shares(cache) and 0 not in n_visual
        if 0 in n_visual and any(n_visual):
            warnings.warn(
                "vlm_focus: this batch mixes rows without visual tokens and rows with images; "
                "rows keep one common length and a text-only row has nothing to drop, so the "
                "batch runs unpruned (batch text-only prompts separately to prune the others)",
                stacklevel=2,
            )
        drops, extras, counts = [], [], []
        remaining, attended = list(n_visual), list(n_visual)  # in the row's slots / unmasked
        for _, keep in setup.config.stages:
            keep = pruner.prefill_keep(keep)
            target = [min(a, keep_count(keep, n)) for a, n in zip(attended, n_visual)]
            want = [r - t for r, t in zip(remaining, target)]
            drop = min(want)
            extra = [w - drop for w in want] if per_row else [0] * len(want)
            drops.append(drop)
            extras.append(extra)
            counts.append(remaining)
            remaining = [r - drop for r in remaining]
            attended = [r - e for r, e in zip(remaining, extra)]
        if any(drops) and not per_row:
            self._warn_uneven_rows(n_visual, remaining)
        # Nothing to drop (keep=1.0): the prompt runs as the model runs it, so no input the
        # layout needs is asked for and no layout is built.
        layout: list[list[ImageLayout]] = [[] for _ in n_visual]
        prunes = any(drops) or any(map(any, extras))
        if prunes or pruner.decode_time:
            for name in setup.adapter.required_with_images:
                if prefill.inputs.get(name) is None:
                    raise ValueError(
                        f"'{setup.adapter.model_type}' needs `{name}` (from the processor) with "
                        "images to prune them"
                    )
            layout = prefill.layout(setup.model, setup.adapter)
        batch, seq = input_ids.shape
        if is_static(cache):  # sized when the first pruned layer runs (see StaticBuffers.fit)
            if not setup.adapter.static_cache:
                raise ValueError(
                    f"vlm_focus does not prune '{setup.adapter.model_type}' on a static cache "
                    "(cache_implementation='static'); use the default dynamic cache"
                )
            self.static.plan(cache, seq, drops)
        # each row's pruner: a row with a video takes the video pruner (read from the layout,
        # which exists whenever something is chosen; else nothing is, and pruner stands)
        row_pruners = setup.row_pruners(layout)
        trace = FocusTrace(n_visual=n_visual, visual=visual, pruners=[p.name for p in row_pruners])
        # the prompt without its cache: the state is filed under the cache, weakly
        prompt = dataclasses.replace(
            prefill, inputs={k: v for k, v in prefill.inputs.items() if k not in CACHE_KEYS}
        )
        state = PruneState(
            prompt=prompt,
            layout=layout,
            drops=drops,
            extras=extras,
            visual_counts=counts,
            trace=trace,
            pruners=row_pruners,
            current=torch.arange(seq, device=input_ids.device).expand(batch, seq),
            prompt_end=tracker.prompt_end,  # set for the whole forward of a grounding pass
            frames=(
                frame_ids(layout, (batch, seq), input_ids.device)
                if setup.config.budget == "frame"
                else None
            ),
            dropped=(
                torch.full((), sum(drops), dtype=torch.long, device=input_ids.device)
                if setup.config.positions == "compact"
                else None
            ),
        )
        if prunes and has_labels(kwargs):
            kwargs = take_labels(state, kwargs)
        if pruner.decode_time:
            reuse = pruner.step_reuse()
            state.fixation = StepFixation(
                setup.adapter,
                layout,
                visual,
                n_visual,
                remaining,
                setup.config.stages[0][1],
                setup.config.reduce,
                reuse.refresh,
                reuse.radius,
            )
            trace.fixation = state.fixation
        return state, kwargs

    def _per_row_shares(self, cache: Any) -> bool:
        """Rows of a batch keep their own share of visual tokens: each drops what the row with
        the fewest drops, and masks the rest of its share as keys in the slots it keeps (the
        batch keeps one length, so this costs what the longest row costs). A static cache
        (fixed masks per slot), flash attention (no key masks), a hybrid decoder's recurrent
        layers (which read every token they hold), compact positions (which count every kept
        slot) and decode-time selection keep the common rule instead."""
        return not (
            is_static(cache)
            or self.setup.recurrent
            or self.setup.flash
            or self.setup.config.positions == "compact"
            or self.setup.pruner.decode_time
        )

    def _warn_uneven_rows(self, n_visual: list[int], kept: list[int]) -> None:
        """Under the common rule a row with more visual tokens than the others keeps more than
        its own share; say so, with the numbers, once per handle."""
        alone = list(n_visual)
        for _, keep in self.setup.config.stages:
            keep = self.setup.pruner.prefill_keep(keep)
            alone = [min(r, keep_count(keep, n)) for r, n in zip(alone, n_visual)]
        if self._warned_uneven or all(k <= 1.25 * a + 2 for k, a in zip(kept, alone)):
            return
        self._warned_uneven = True
        warnings.warn(
            f"vlm_focus: rows with {n_visual} visual tokens keep {kept} of them, where each "
            f"alone would keep {alone}: a batch keeps one common length, so each row drops "
            "what the row with the fewest visual tokens drops. Batch images of similar token "
            "counts together (or one image per call) to keep each row's own share",
            stacklevel=3,
        )

    # --- every hooked layer -------------------------------------------------------------------
    def layer(self, state: PruneState, call: LayerCall) -> tuple[torch.Tensor, dict]:
        """A hooked layer's hidden states and kwargs in the prefill: a stage layer scores and
        selects first; every layer gets cos/sin, mask and positions of the tokens it holds."""
        index, hidden, kwargs, cache = call.index, call.hidden, call.kwargs, call.cache
        cos, sin = kwargs["position_embeddings"]
        replay = index in state.per_layer  # recomputed (gradient checkpointing): same slices
        if replay:
            current = state.per_layer[index]
            if index in state.stage_rows:
                hidden = gather_seq(hidden, state.stage_rows[index].to(hidden.device), 1)
        else:
            if hidden.shape[1] != state.current.shape[1] and (
                index in self.setup.stages or not self._last_rows(state, index, hidden)
            ):
                raise RuntimeError(
                    f"layer {index} got {hidden.shape[1]} tokens, expected {state.current.shape[1]}"
                )
            if cache is not None and state.cache is None:
                state.cache = weakref.ref(cache)
                state.static = is_static(cache)
                self.states[cache] = state
                if state.static:
                    self.static.fit(cache)
            if index in self.setup.stages:
                local = self._run_stage(state, index, call.module, hidden, cos, sin)
                state.stage_rows[index] = local
                hidden = gather_seq(hidden, local.to(hidden.device), 1)
                state.current = state.current.gather(1, local.to(state.current.device))
            current = state.current
            state.per_layer[index] = current
        kwargs = dict(kwargs)
        # The decoder hands every layer the same full-length cos/sin, mask and position ids (one
        # set per layer type where it has several, e.g. sliding-window and full layers), and the
        # kept set changes only at a stage: slice each once per stage and type (on its device).
        kind = f":{id(cos)}"
        rows = current  # the original positions of the layer's queries
        if hidden.shape[1] < current.shape[1]:
            # the decoder kept only the last rows (and their cos/sin and mask rows) itself
            rows = current[:, current.shape[1] - hidden.shape[1] :]
        else:
            kwargs["position_embeddings"] = (
                state.once("cos" + kind, cos, current, lambda: self._kept_positions(cos, rows, 1)),
                state.once("sin" + kind, sin, current, lambda: self._kept_positions(sin, rows, 1)),
            )
        mask = kwargs.get("attention_mask")
        # the rows of the mask to keep: none where the decoder sliced them with the hidden states
        mask_rows = (
            rows if isinstance(mask, torch.Tensor) and mask.shape[-2] > rows.shape[1] else None
        )
        if state.static and index not in self.setup.linear_layers:
            # a KV-shared layer attends to its source layer's buffer
            slots = cache.layers[self.setup.key_sources.get(index, index)].max_cache_len
            kwargs["attention_mask"] = state.once(
                f"mask{slots}:{rows.shape[1]}",
                mask,
                current,
                lambda: self.static.prefill_mask(state, mask, mask_rows, current, slots),
            )
        else:
            kwargs["attention_mask"] = state.once(
                f"mask{kind}:{rows.shape[1]}",
                mask,
                current,
                lambda: slice_mask(
                    mask,
                    None if mask_rows is None else on_device_of(mask_rows, mask),
                    on_device_of(current, mask),
                ),
            )
        if state.masked is not None:
            masked = state.once(
                "masked",
                state.masked,
                current,
                lambda: gather_seq(state.masked, on_device_of(current, state.masked), 1),
            )
            state.masked_at[index] = masked
            mask = kwargs["attention_mask"]
            kwargs["attention_mask"] = state.once(
                "masked_mask" + kind,
                mask,
                current,
                lambda: mask_keys(mask, masked, hidden.shape[1], masked.shape[1]),
            )
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and self.setup.flash:
            # Kept ids have gaps, which flash-attention at batch 1 reads as packed sequences
            # (a host read per layer); RoPE already sits in cos/sin, so the layers need none.
            kwargs["position_ids"] = None
        elif isinstance(position_ids, torch.Tensor):
            kwargs["position_ids"] = state.once(
                f"position_ids:{rows.shape[1]}",
                position_ids,
                current,
                lambda: self._kept_positions(position_ids, rows, position_ids.dim() - 1),
            )
        if index == self.setup.last_layer and not replay:
            state.trace.sequence = current
            if state.fixation is not None:  # its focal layer's cache holds the kept prompt
                state.fixation.hold(state.per_layer[self.setup.first_layer], state.valid)
            if state.static:
                self.static.build_columns(state, cache)
                if state.fixation is not None:
                    state.fixation.record_into(self.static.room(cache) - state.full_len)
        return hidden, kwargs

    @staticmethod
    def _last_rows(state: PruneState, index: int, hidden: torch.Tensor) -> bool:
        """The decoder handed layer ``index`` only the last rows of the tokens it holds (before
        layers that reuse earlier layers' keys, when only the last logits are needed), with
        their cos/sin and mask rows in original positions; the layer still attends to every
        kept key. ``RuntimeError`` when those rows are not the last original positions (a
        pruned token at the end of the prompt)."""
        n, current = hidden.shape[1], state.current
        if n >= current.shape[1]:
            return False
        tail = current[:, current.shape[1] - n :]
        expected = torch.arange(state.full_len - n, state.full_len, device=tail.device)
        # one host read per prefill, not one per layer
        kept = state.once(
            f"last_rows:{n}", current, current, lambda: bool((tail == expected).all())
        )
        if not kept:
            raise RuntimeError(
                f"layer {index} got the last {n} rows of the prompt, but pruning removed "
                "some of them"
            )
        return True

    def _kept_positions(self, x: torch.Tensor, current: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` (cos, sin or position ids along ``dim``) for the tokens a layer holding
        ``current`` keeps: theirs (``positions="original"``), or, compact, the first ``S'``: the
        j-th kept token takes what the unpruned row gives its j-th token. Padding comes first
        and is never pruned, so this is the numbering of the prompt without its pruned tokens
        (``generate()`` counts from each row's first token, a plain forward from column 0)."""
        if self.setup.config.positions == "compact":
            return x.narrow(dim, 0, current.shape[1])
        return gather_seq(x, on_device_of(current, x), dim)

    def _run_stage(
        self,
        state: PruneState,
        index: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Score and select at a stage layer; returns the local indices ``[B, S'']`` to keep.

        Counts are known on the host, so nothing here waits for the device: every row drops
        ``drop`` visual tokens, chosen on the device, and the trace reads them back lazily."""
        setup = self.setup
        stage_index = len(state.trace.stages)
        # Score where the layer's weights are (under a device map its input may still be on
        # the previous layer's device: accelerate moves it only inside forward).
        device = execution_device(layer, hidden.device)
        hidden = hidden.to(device)
        current = state.current.to(device)
        batch, seq = current.shape
        visual = state.visual.to(device).gather(1, current)
        drop = state.drops[stage_index]
        extra = state.extras[stage_index]
        if drop == 0 and not any(extra):  # nothing to drop (keep=1.0, or a text-only row)
            keep = torch.ones_like(visual)
            zeros = torch.zeros(visual.shape, device=visual.device)
            state.trace.stages.append(StageTrace(index, current, visual, keep, zeros))
            return torch.arange(seq, device=device).expand(batch, seq)
        counts = state.visual_counts[stage_index]  # host: visual tokens per row at this stage
        n_keep = min(counts) - drop
        ctx = StageContext(
            model=setup.model,
            adapter=setup.adapter,
            config=setup.config,
            layer_index=index,
            stage_index=stage_index,
            decoder_layer=setup.adapter.scoring_layer(setup.model, index),
            hidden=hidden,
            cos=gather_seq(cos.to(device), current, 1),
            sin=gather_seq(sin.to(device), current, 1),
            positions=current,
            visual=visual,
            valid=state.valid.to(device).gather(1, current),
            layout=state.layout,
            inputs=state.prompt.inputs,
            visual_counts=counts,
            prompt_end=state.prompt_end,
        )
        watch = state.trace.stopwatch
        start = watch.start(device)
        with torch.no_grad():
            selection = _select(state.pruners, ctx, n_keep)
        ranking = selection.scores
        if setup.config.budget == "frame":
            frames = state.frames.to(device).gather(1, current)
            ranking = frame_shares(ranking, visual, frames)
        before = None if state.masked is None else state.masked.to(device).gather(1, current)
        masked = None
        if any(extra) or before is not None:
            if before is not None:  # what an earlier stage masked goes first
                floor = torch.finfo(torch.float32).min
                ranking = ranking.float().masked_fill(before, floor)
            keep = keep_mask(ranking, visual, drop)
            share = torch.tensor(extra, device=device) + drop
            masked = lowest_visual(ranking, visual, share) & keep
            state.masked = torch.zeros_like(state.visual).scatter(
                1, current.to(state.visual.device), masked.to(state.visual.device)
            )
        elif setup.config.budget == "frame":
            keep = keep_mask(ranking, visual, drop)
        else:  # the pruner's own top n_keep when every row keeps the same count
            kept = selection.kept if len(set(counts)) == 1 else None
            keep = selected_keep(selection.scores, kept, visual, drop)
        watch.stop(start, device)
        local = kept_columns(keep, seq - drop)
        state.trace.stages.append(
            StageTrace(index, current, visual, keep, selection.scores, masked=masked)
        )
        return local


def _select(row_pruners: list[Pruner], ctx: StageContext, n_keep: int) -> Selection:
    """The selection of one stage when each row names its pruner: the pruner's own, or, in a
    batch that mixes pruners (video and image rows), every row's scores from its own pruner.
    Each pruner then scores the whole batch, and every row keeps its own pruner's top
    ``n_keep`` (:func:`~vlm_focus.core.selection.keep_mask`), as it would alone."""
    distinct = list(dict.fromkeys(row_pruners))
    if len(distinct) == 1:
        return distinct[0].select(ctx, n_keep)
    device = ctx.hidden.device
    scores = [p.select(ctx, n_keep).scores.float().to(device) for p in distinct]
    which = torch.tensor([distinct.index(p) for p in row_pruners], device=device)
    merged = torch.stack(scores).gather(0, which[None, :, None].expand(1, *scores[0].shape))[0]
    return Selection(scores=merged)
