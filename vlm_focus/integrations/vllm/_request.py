"""What every pruning class's processor and model share: the server's settings, a request's
choice, and the per-image fields the processor hands the model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import (
    BUDGETS,
    CONFIG_KEY,
    REQUEST_KEYS,
    ServeOptions,
    check_budget,
    check_positions,
    check_pruner,
    check_request,
)

#: The ``mm_processor_kwargs`` keys: a request's own pruner, keep and budget
#: (:data:`REQUEST_KEYS`), and the prompt's token ids, which the processor adds for an attention
#: pruner so that they are part of each item's cache identity.
PRUNER_FIELD, KEEP_FIELD, BUDGET_FIELD = REQUEST_KEYS
PROMPT_FIELD = "vlm_focus_prompt"
#: The per-item field of an item's unpruned token count (what it moves the position on by).
TOKENS_FIELD = "vlm_focus_tokens"


def item_fields(modality: str) -> tuple[str, str, str, str, str]:
    """Names of the per-item fields the processor hands the model for ``modality``: the kept
    count, the pruner's index in the class's list, the budget's index in :data:`BUDGETS`, the
    prompt (an image's: as the request wrote it; a video's: with the video's unpruned tokens in
    place) and the unpruned token count. A field belongs to one modality, so a video's carry a
    suffix."""
    names = (KEEP_FIELD, PRUNER_FIELD, BUDGET_FIELD, PROMPT_FIELD, TOKENS_FIELD)
    return names if modality == "image" else tuple(f"{name}_{modality}" for name in names)


def serve_options(
    hf_config: Any, pruners: Sequence[str], positions: Sequence[str] | None = None
) -> ServeOptions:
    """The server's settings from the model's HF config, its pruner checked against the
    class's ``pruners`` and, when given, its positions against the class's ``positions``."""
    options = ServeOptions.from_config(getattr(hf_config, CONFIG_KEY, None))
    check_pruner(options.pruner, tuple(pruners))
    if positions is not None:
        check_positions(options.positions, tuple(positions))
    return options


def split_request(kwargs: Mapping[str, object], defaults: ServeOptions, pruners: Sequence[str]):
    """``(pruner, keep, budget, rest)``: the request's choice (or the server's), checked
    against the class's ``pruners``, and the kwargs meant for the Hugging Face processor."""
    pruner = kwargs.get(PRUNER_FIELD, defaults.pruner)
    keep = check_request(pruner, kwargs.get(KEEP_FIELD, defaults.keep), tuple(pruners))
    budget = check_budget(kwargs.get(BUDGET_FIELD, defaults.budget), BUDGETS)
    ours = (*REQUEST_KEYS, PROMPT_FIELD)
    rest = {k: v for k, v in kwargs.items() if k not in ours}
    return pruner, keep, budget, rest


def per_item(value: object, n: int) -> list[int]:
    """A batched per-item field as ``n`` host ints."""
    if isinstance(value, (list, tuple)):
        value = torch.stack([torch.as_tensor(v).reshape(()) for v in value])
    out = torch.as_tensor(value).reshape(-1).tolist()
    if len(out) != n:
        raise ValueError(f"{len(out)} vlm_focus entries for {n} items")
    return [int(v) for v in out]
