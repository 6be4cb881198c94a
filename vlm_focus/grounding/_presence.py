"""Is the phrase in the image at all? The model's own yes/no answer as a presence score.

An attention map always has a peak, so a point or a box says nothing about whether the object is
there. The presence score asks the model: for the question
``PRESENCE_PROMPT.format(phrase=...)`` in its chat template, the next-token probabilities
``p`` give::

    presence = sum_{t in YES} p_t / (sum_{t in YES} p_t + sum_{t in NO} p_t)

``YES`` and ``NO`` are the first tokens of ``yes``/``Yes`` and ``no``/``No`` (with and without a
leading space) in the model's tokenizer. On the organisms this separates present from absent
objects far better than any attention statistic (``benchmarks/results/grounding_presence.md``).
A phrase the tokenizer cannot spell (it encodes to the unknown token) scores 0: the model never
read it, so its answer is not about the phrase.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._token_masks import tokenizer_of, unknown_phrase

#: The question the presence score asks (and ``vf.ground``'s default prompt).
PRESENCE_PROMPT = "Is there a {phrase} in the image?"
_YES = ("yes", "Yes", " yes", " Yes")
_NO = ("no", "No", " no", " No")


def answer_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The token ids that begin a yes and a no answer (sorted; the unknown token excluded)."""
    tok = tokenizer_of(tokenizer)
    unk = getattr(tok, "unk_token_id", None)
    found = []
    for words in (_YES, _NO):
        ids = set()
        for word in words:
            encoded = list(tok.encode(word, add_special_tokens=False))
            if encoded and encoded[0] != unk:
                ids.add(int(encoded[0]))
        found.append(sorted(ids))
    yes, no = found
    if not yes or not no or set(yes) & set(no):
        raise ValueError(
            f"the tokenizer gives no clean yes/no tokens (yes {yes}, no {no}): the presence "
            "score needs a model that answers yes or no"
        )
    return yes, no


def presence_from_logits(logits: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """``[B]`` presence scores from next-token ``logits [B, V]`` (module docstring)."""
    yes, no = answer_ids(tokenizer)
    probs = torch.softmax(logits.float(), dim=-1)
    p_yes, p_no = probs[:, yes].sum(-1), probs[:, no].sum(-1)
    return (p_yes / (p_yes + p_no).clamp(min=1e-30)).cpu()


def presence(model: nn.Module, processor: Any, image: Any, phrases: Sequence[str]) -> list[float]:
    """The presence score of each phrase in one image (one batched forward pass of the
    presence questions; a phrase the tokenizer cannot spell scores 0 without a pass)."""
    from ..loading import build_inputs, to_model  # the processor's chat format

    phrases = list(phrases)
    for phrase in phrases:
        if not isinstance(phrase, str) or not phrase.strip():
            raise ValueError(f"phrases must be non-empty strings, got {phrase!r}")
    scores = [0.0] * len(phrases)
    known = [i for i, p in enumerate(phrases) if not unknown_phrase(p, processor)]
    if not known:
        return scores
    questions = [PRESENCE_PROMPT.format(phrase=phrases[i]) for i in known]
    inputs = to_model(model, build_inputs(processor, [image] * len(known), questions))
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[:, -1]  # [B, V], left-padded rows
    for i, score in zip(known, presence_from_logits(logits, processor).tolist(), strict=True):
        scores[i] = float(score)
    return scores
