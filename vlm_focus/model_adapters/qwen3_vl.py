"""Qwen3-VL (``qwen3_vl``, and ``qwen3_vl_moe``, which shares its decoder and layout).

Visual tokens sit as in Qwen2-VL (``t*h*w / merge^2`` per image or video, merged grid,
interleaved M-RoPE folded into cos/sin by the model), with two differences:

* a video arrives as one ``<timestamp><vision_start>frame<vision_end>`` block per temporal
  group; the Qwen layout already consumes a video's tokens across blocks;
* **DeepStack**: the decoder adds extra visual features at the image positions after each of its
  first ``len(deepstack_visual_indexes)`` layers, in its own layer loop. Once layers are pruned
  those features no longer line up with the hidden states, so :func:`deepstack_hooks` takes them
  out of the decoder call and adds them after the same layers itself, each kept token getting
  exactly its own features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .qwen2_vl import QWEN2_VL


def deepstack_hooks(
    model: nn.Module, tokens_after: Callable[[int], torch.Tensor | None]
) -> list[Any]:
    """Hooks that apply DeepStack on the instance: a decoder pre-hook that takes
    ``visual_pos_masks`` / ``deepstack_visual_embeds`` out of the call, and a forward hook on
    each of the first layers that adds layer ``i``'s features to the tokens it outputs."""
    decoder = QWEN3_VL.decoder(model)
    layers = QWEN3_VL.decoder_layers(model)
    call: dict[str, Any] = {}

    def take_deepstack(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call.clear()
        embeds = kwargs.get("deepstack_visual_embeds")
        if embeds is None:
            return None
        call["mask"] = kwargs["visual_pos_masks"]  # [B, S] bool, full length
        call["embeds"] = embeds  # per layer [n_visual_total, D], in mask order
        kwargs = dict(kwargs, deepstack_visual_embeds=None, visual_pos_masks=None)
        return args, kwargs

    def add_after(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not call or index >= len(call["embeds"]):
                return None
            hidden = output
            mask = call["mask"].to(hidden.device)
            row_of = (mask.flatten().cumsum(0) - 1).view_as(mask)  # feature row per position
            positions = tokens_after(index)
            if positions is not None:
                positions = positions.to(hidden.device)
                mask, row_of = mask.gather(1, positions), row_of.gather(1, positions)
            features = call["embeds"][index].to(hidden.device, hidden.dtype)
            hidden = hidden.clone()
            hidden[mask, :] = hidden[mask, :] + features[row_of[mask]]
            if index == last:  # the decode steps after this prompt then find nothing held
                call.clear()
            return hidden

        return hook

    handles = [decoder.register_forward_pre_hook(take_deepstack, with_kwargs=True)]
    n_deepstack = len(getattr(model.config.vision_config, "deepstack_visual_indexes", ()) or ())
    last = min(n_deepstack, len(layers)) - 1
    for index in range(last + 1):
        handles.append(layers[index].register_forward_hook(add_after(index)))
    return handles


QWEN3_VL = dataclasses.replace(
    QWEN2_VL,
    model_type="qwen3_vl",
    qk_norms=("q_norm", "k_norm"),
    sequence_hooks=deepstack_hooks,
)
QWEN3_VL_MOE = dataclasses.replace(QWEN3_VL, model_type="qwen3_vl_moe")
