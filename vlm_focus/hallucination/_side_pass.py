"""A contrastive method's second model call, beside the generation it steers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.calls import CallTracker
from ..core.probe import AttentionBias, LayerView
from ..model_adapters import get_adapter


def side_pass(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    blocked: torch.Tensor | None = None,
    same_prompt: bool = True,
    cache: Any = None,
) -> Any:
    """The model's output (``logits`` of the last position only) for one pass over
    ``inputs``, isolated from the generation under way (``tracker.isolated()``). Without
    ``cache`` the pass runs the whole sequence and keeps no cache; with one (a transformers
    ``Cache`` the caller keeps) it fills it, or continues it with ``inputs``' new tokens and
    their full ``attention_mask``.

    ``same_prompt``: the sequence starts with a prompt laid out as the generation's (the same
    tokens, another image). On a pruned model the pass then runs unpruned, with the keys each
    layer of the pruned prompt lacks masked out from that layer on: the same attention as the
    pruned model, over other content. ``blocked`` (``[B, S]`` bool over that prompt) hides more
    keys at every layer. A prompt of another layout (no image) runs unpruned and unmasked."""
    adapter = get_adapter(model)
    if blocked is not None and not same_prompt:
        raise ValueError("blocked keys need the generation's prompt layout")
    tracker = CallTracker.acquire(model, adapter)
    try:
        dropped = tracker.dropped_keys() if same_prompt else {}
        n_layers = len(adapter.decoder_layers(model))
        layers = range(n_layers) if blocked is not None else sorted(dropped)
        # a recurrent (linear-attention) layer reads every token it is given: no mask hides one
        unmaskable = sorted(set(layers) & adapter.recurrent_layers(model))
        if unmaskable:
            raise ValueError(
                f"this contrast hides visual tokens from decoder layers {unmaskable}, which are "
                f"linear-attention layers of this '{adapter.model_type}' model and cannot hide a "
                "token; use a mitigation that reads or biases the full-attention layers only"
            )

        def bias(view: LayerView) -> torch.Tensor | None:
            gone = dropped.get(view.index)
            if blocked is None and gone is None:
                return None
            batch, width = view.hidden.shape[0], view.width
            rows = view.call.input_ids.shape[1]
            device = view.hidden.device
            out = torch.zeros(batch, rows, width, device=device)
            if blocked is not None:
                columns = torch.where(blocked.to(device), float("-inf"), 0.0)
                out[:, :, : blocked.shape[1]] = columns[:, None, :]
            if gone is not None:
                seq = gone.shape[1]
                hide = gone.to(device)[:, None, :].expand(-1, rows, -1).clone()
                # a dropped token still sees itself (its row, if this call computes it)
                positions = view.call.past + torch.arange(rows, device=device)
                own = torch.nonzero(positions < seq).flatten()
                hide[:, own, positions[own]] = False
                out[:, :, :seq] = out[:, :, :seq].masked_fill(hide, float("-inf"))
            return out

        call = {k: v for k, v in inputs.items() if k != "labels"}
        if cache is None:
            call["use_cache"] = False
        else:
            call.update(cache=cache, use_cache=True)
        with torch.no_grad(), tracker.isolated():
            if layers:
                with AttentionBias(model, layers, bias):
                    return model(**call, logits_to_keep=1)
            return model(**call, logits_to_keep=1)
    finally:
        tracker.release()


def side_logits(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    blocked: torch.Tensor | None = None,
    same_prompt: bool = True,
) -> torch.Tensor:
    """Next-token logits ``[B, V]`` of :func:`side_pass` over the whole sequence."""
    return side_pass(model, inputs, blocked=blocked, same_prompt=same_prompt).logits[:, -1]
