"""What every pruning class's processor and model share: the server's settings, a request's
choice, and the per-image fields the processor hands the model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import CONFIG_KEY, REQUEST_KEYS, ServeOptions, check_request

#: The ``mm_processor_kwargs`` keys: a request's own pruner and keep (:data:`REQUEST_KEYS`), and
#: the prompt's token ids, which the processor adds for an attention pruner so that they are part
#: of the image's cache identity. The per-image fields the processor hands the model carry the
#: same names: the pruner's index in the class's list, the kept count, and the prompt.
PRUNER_FIELD, KEEP_FIELD = REQUEST_KEYS
PROMPT_FIELD = "vlm_focus_prompt"


def serve_options(hf_config: Any, pruners: Sequence[str]) -> ServeOptions:
    """The server's settings from the model's HF config, its pruner checked against the
    class's ``pruners`` (``None``: the class's first, its default)."""
    options = ServeOptions.from_config(getattr(hf_config, CONFIG_KEY, None))
    if options.pruner is None:
        options.pruner = pruners[0]
    check_request(options.pruner, options.keep, pruners)
    return options


def split_request(kwargs: Mapping[str, object], defaults: ServeOptions, pruners: Sequence[str]):
    """``(pruner, keep, rest)``: the request's choice (or the server's), checked against the
    class's ``pruners``, and the kwargs meant for the Hugging Face processor."""
    pruner = kwargs.get(PRUNER_FIELD, defaults.pruner)
    keep = check_request(pruner, kwargs.get(KEEP_FIELD, defaults.keep), pruners)
    ours = (PRUNER_FIELD, KEEP_FIELD, PROMPT_FIELD)
    rest = {k: v for k, v in kwargs.items() if k not in ours}
    return pruner, keep, rest


def per_item(value: object, n: int) -> list[int]:
    """A batched per-image field as ``n`` host ints."""
    if isinstance(value, (list, tuple)):
        value = torch.stack([torch.as_tensor(v).reshape(()) for v in value])
    out = torch.as_tensor(value).reshape(-1).tolist()
    if len(out) != n:
        raise ValueError(f"{len(out)} vlm_focus entries for {n} images")
    return [int(v) for v in out]
