"""Training on a pruned prompt: the loss over the positions the last layer holds.

The forward returns logits for the kept positions only, so the model cannot shift ``labels``
itself. Each original position's next-token target is taken from the call
(:func:`take_labels`) and the loss is computed after the forward over the positions the last
layer holds (:func:`pruned_loss`): the full run's loss with the pruned visual tokens' own
targets left out (they are image tokens, whose labels are ignored).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .prune_state import PruneState


def has_labels(kwargs: dict) -> bool:
    return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None


def take_labels(state: PruneState, kwargs: dict) -> dict:
    """The call's kwargs without ``labels`` / ``shift_labels`` and the loss kwargs, which
    ``state`` keeps as every original position's next-token target."""
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    targets = kwargs.pop("shift_labels", None)
    ignore = kwargs.get("ignore_index", -100)
    if targets is None:
        targets = torch.nn.functional.pad(labels, (0, 1), value=ignore)[:, 1:]
    state.targets = targets
    state.loss_kwargs = {
        k: kwargs.pop(k) for k in ("num_items_in_batch", "ignore_index") if k in kwargs
    }
    return kwargs


def pruned_loss(
    state: PruneState,
    last_layer: int,
    model: nn.Module,
    logits: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """The model's own loss of ``logits`` over the positions layer ``last_layer`` holds."""
    held = state.per_layer[last_layer]  # [B, S'] original positions
    targets = targets.to(held.device)
    ignore = state.loss_kwargs.get("ignore_index", -100)
    vocab = model.config.get_text_config().vocab_size
    if targets.shape[1] != state.full_len:
        if targets.shape[1] != logits.shape[1]:
            raise ValueError(
                f"labels / shift_labels have {targets.shape[1]} positions; pass one per "
                f"prompt token ({state.full_len}, original positions) or, as shift_labels, "
                f"one per returned logit ({logits.shape[1]}, last_trace.sequence)"
            )
        # already aligned with the logits the pruned forward returns
        return model.loss_function(
            logits=logits,
            labels=None,
            shift_labels=targets,
            vocab_size=vocab,
            **state.loss_kwargs,
        )
    masked = state.masked_at.get(last_layer)  # [B, S'] in the held slots
    counted = torch.ones_like(held, dtype=torch.bool) if masked is None else ~masked
    lost = targets.masked_fill(
        torch.zeros_like(targets, dtype=torch.bool).scatter(1, held, counted), ignore
    )
    targets = targets.gather(1, held)
    if masked is not None:
        targets = targets.masked_fill(masked.to(targets.device), ignore)
    targets = targets[:, targets.shape[1] - logits.shape[1] :]  # logits_to_keep
    if bool((lost != ignore).any()):
        warnings.warn(
            "vlm_focus: some pruned visual tokens had a next-token target (a label right "
            "after an image); the loss leaves those positions out. Mask the labels of the "
            "prompt (-100) to train on answers only",
            stacklevel=3,
        )
    return model.loss_function(
        logits=logits, labels=None, shift_labels=targets, vocab_size=vocab, **state.loss_kwargs
    )
