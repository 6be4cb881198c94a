"""Content-free calibration of the first answer token ("Calibrate Before Use", per image)."""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessor

from ..core.calls import CallTracker
from ..core.options import option
from ..model_adapters import get_adapter
from .registry import Mitigation, check_numbers, register_mitigation

#: POPE's question with the object replaced by "N/A": the same template without its content.
CONTENT_FREE_PROMPT = "Is there a N/A in the image?"
#: Content-free batches kept per model (least recently used first out).
CACHE_SIZE = 32


class ContentFreeCache:
    """The content-free log-probabilities ``[B, V]`` (float32, on the CPU) of recent batches,
    per model and per hash of the generic inputs' tensors: a small LRU of :data:`CACHE_SIZE`
    entries per model. Models are held weakly, so the cache never keeps one alive. The key
    does not see the weights or hooks that change the forward (the pruning engine's aside):
    after changing those, :meth:`clear` it."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._entries: weakref.WeakKeyDictionary[nn.Module, OrderedDict[str, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, model: nn.Module, key: str) -> torch.Tensor | None:
        entries = self._entries.get(model)
        if entries is None or key not in entries:
            return None
        entries.move_to_end(key)
        return entries[key]

    def put(self, model: nn.Module, key: str, value: torch.Tensor) -> None:
        entries = self._entries.setdefault(model, OrderedDict())
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.size:
            entries.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()


#: The one cache every :class:`ContentFree` shares.
CONTENT_FREE_CACHE = ContentFreeCache()


def inputs_key(inputs: Mapping[str, Any]) -> str:
    """A hash of every value of ``inputs`` (tensors by dtype, shape and bytes): equal for the
    same images under the same prompt, padded alike."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        value = inputs[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().contiguous().reshape(-1)
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).cpu().numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def content_free_logprobs(model: nn.Module, generic_inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, V]`` float32 next-token log-probabilities at the end of each row of
    ``generic_inputs`` (left-padded), from one unpruned pass (the pruning engine, if any, stands
    aside and finds its state as it was)."""
    mask = generic_inputs.get("attention_mask")
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError(
            "generic_inputs must be left-padded (every row ends at the last column); "
            "set the tokenizer's padding_side='left'"
        )
    tracker = CallTracker.acquire(model, get_adapter(model))
    try:
        with torch.no_grad(), tracker.isolated():
            logits = model(**generic_inputs, use_cache=False, logits_to_keep=1).logits[:, -1]
    finally:
        tracker.release()
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class ContentFreeOptions:
    """The options of :func:`content_free`."""

    strength: float = option(
        1.0, "weight of the content-free log-probabilities: l - strength * l_cf, >= 0"
    )
    beta: float = option(
        0.01, "plausibility cutoff: tokens below beta * the top probability drop, in [0, 1)"
    )

    def __post_init__(self) -> None:
        check_numbers(self, "strength", "beta")
        if self.strength < 0:
            raise ValueError(f"strength must be >= 0, got {self.strength}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta (plausibility cutoff) must lie in [0, 1), got {self.beta}")


@register_mitigation
class ContentFree(Mitigation, LogitsProcessor):
    """A ``LogitsProcessor`` and context manager; see :func:`content_free`."""

    name = "content_free"
    Options = ContentFreeOptions
    summary = "divide the first token's probabilities by the image's content-free ones"
    generic_prompt = CONTENT_FREE_PROMPT

    @classmethod
    def generic_prompts(cls, prompts: Sequence[str]) -> list[str]:
        """The content-free question with each prompt's answer instruction: what follows the
        prompt's first ``?`` (POPE's "Answer the question using a single word or phrase."), so
        that the calibration sees the same answer format as the question."""
        return [cls.generic_prompt + (p.split("?", 1)[1] if "?" in p else "") for p in prompts]

    def __init__(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        generic_inputs: Mapping[str, Any],
        options: ContentFreeOptions,
    ) -> None:
        for name, value in (("inputs", inputs), ("generic_inputs", generic_inputs)):
            if not isinstance(value, Mapping) or "input_ids" not in value:
                raise TypeError(f"{name} must be the processor's output mapping with input_ids")
        self.strength, self.beta = float(options.strength), float(options.beta)
        self.prompt = inputs["input_ids"]
        generic_ids = generic_inputs["input_ids"]
        adapter = get_adapter(model)
        visual = adapter.visual_mask(model, self.prompt, inputs).sum(1)
        generic_visual = adapter.visual_mask(model, generic_ids, generic_inputs).sum(1)
        if visual.shape != generic_visual.shape or not torch.equal(
            visual.cpu(), generic_visual.cpu()
        ):
            raise ValueError(
                "generic_inputs must hold the same images as inputs, row for row (visual "
                f"tokens per row: {visual.tolist()} against {generic_visual.tolist()})"
            )
        generic = {k: v for k, v in generic_inputs.items() if k != "labels"}
        key = inputs_key(generic)
        cached = CONTENT_FREE_CACHE.get(model, key)
        if cached is None:
            cached = content_free_logprobs(model, generic).cpu()
            CONTENT_FREE_CACHE.put(model, key, cached)
        self.content_free = cached  # [B, V] float32 on the CPU: l_cf of each row's image
        self.active = False

    def attach(self) -> None:
        self.active = True

    def remove(self) -> None:
        self.active = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch, seq = self.prompt.shape
        if not self.active or input_ids.shape[1] != seq:
            return scores  # inactive, or a later token: unchanged
        rows = input_ids.shape[0]
        repeat = rows // batch if rows % batch == 0 else 0
        if not repeat or not torch.equal(
            input_ids, self.prompt.to(input_ids.device).repeat_interleave(repeat, 0)
        ):
            raise ValueError(
                "content_free serves the prompt it was built for (its rows, each repeated "
                "alike for beams)"
            )
        full = torch.log_softmax(scores.float(), dim=-1)
        content_free = self.content_free.to(full.device).repeat_interleave(repeat, 0)
        if content_free.shape[-1] != full.shape[-1]:
            raise ValueError(
                f"scores have {full.shape[-1]} tokens, the content-free pass "
                f"{content_free.shape[-1]}: use the model it was built with"
            )
        out = full - self.strength * content_free
        probs = full.exp()
        implausible = probs < self.beta * probs.amax(-1, keepdim=True)
        return out.masked_fill(implausible, float("-inf")).to(scores.dtype)


def content_free(
    model: nn.Module,
    inputs: Mapping[str, Any],
    generic_inputs: Mapping[str, Any],
    *,
    strength: float = ContentFreeOptions.strength,
    beta: float = ContentFreeOptions.beta,
) -> ContentFree:
    """Content-free calibration of the first answer token (Zhao et al. 2021, "Calibrate Before
    Use"), per image.

    ``generic_inputs`` are the same images, row for row, under :data:`CONTENT_FREE_PROMPT`
    (POPE's question with the object replaced by "N/A"). One pass over them gives each row's
    content-free next-token log-probabilities ``l_cf``. At the first generated token, with
    ``l`` the log-softmax of the scores::

        out = l - strength * l_cf   on {y : p(y) >= beta * max_y' p(y')},  -inf elsewhere

    and later tokens are unchanged. For a yes/no answer this divides each answer's probability
    by its content-free probability (``strength=1``): the diagonal calibration of the paper,
    which removes the image's prior towards "yes" (or "no") but cannot fix a wrong reading of
    the image. ``strength=0`` changes nothing but the cutoff.

    The content-free pass runs once per (model, images, prompt): its result is kept in a small
    LRU (:data:`CACHE_SIZE` entries per model, held weakly) keyed by a hash of the generic
    inputs' tensors, so a run asking several questions about one image runs one extra pass.
    The key is the whole batch: rows of different images reuse it when the same batch comes
    again. On a pruned model (``vf.wrap``) the pass runs unpruned, the pruning engine standing
    aside, so the pruned answer is calibrated against the full image's prior and the
    generation's pruning is untouched.

    Usage (greedy, left-padded batches)::

        with content_free(model, inputs, generic_inputs) as proc:
            model.generate(**inputs, logits_processor=[proc])
    """
    options = ContentFreeOptions(strength=strength, beta=beta)
    return ContentFree(model, inputs, generic_inputs, options)
