"""Which tokens a query names: phrases and token spans found in the prompt or the answer, the
instruction after the image, and a generated answer appended to its prompt for one
teacher-forced pass. Every mask here is ``[B, S]`` bool over the pass's input.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..core.probe import Prefill
from ..model_adapters import get_adapter

Query = str | Sequence[int] | torch.Tensor | None


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer inside a processor (or the tokenizer itself)."""
    return getattr(processor, "tokenizer", processor)


def answer_mask(model: nn.Module, answer: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the generated tokens of each row before its first end-of-sequence or
    padding token (the generation config's ``eos_token_id`` and ``pad_token_id``, the model
    config's ``pad_token_id``). The one rule for trimming an answer."""
    generation = getattr(model, "generation_config", None)
    config = getattr(model, "config", None)
    stop: set[int] = set()
    for value in (
        getattr(generation, "eos_token_id", None),
        getattr(generation, "pad_token_id", None),
        getattr(config, "pad_token_id", None),
        getattr(getattr(config, "text_config", None), "pad_token_id", None),
    ):
        if isinstance(value, int):
            stop.add(value)
        elif isinstance(value, Sequence):
            stop.update(int(v) for v in value)
    if not stop:
        return torch.ones_like(answer, dtype=torch.bool)
    hit = torch.isin(answer, torch.tensor(sorted(stop), device=answer.device))
    return hit.long().cumsum(1) == 0


def _find_span(row: list[int], span: list[int], allowed: list[bool]) -> int | None:
    """Start of the last occurrence of ``span`` in ``row`` lying wholly on allowed positions."""
    n = len(span)
    for start in range(len(row) - n, -1, -1):
        if row[start : start + n] == span and all(allowed[start : start + n]):
            return start
    return None


def phrase_spans(phrase: str, tokenizer: Any) -> list[list[int]]:
    """The token-id spans a phrase may appear as (as written, and after a space)."""
    tok = tokenizer_of(tokenizer)
    spans: list[list[int]] = []
    for text in (phrase, " " + phrase):
        ids = list(tok.encode(text, add_special_tokens=False))
        if ids and ids not in spans:
            spans.append(ids)
    return spans


def unknown_phrase(phrase: str, tokenizer: Any) -> bool:
    """Whether every way the tokenizer spells ``phrase`` holds its unknown token (a tokenizer
    without one, such as a byte-level BPE, spells everything)."""
    unk = getattr(tokenizer_of(tokenizer), "unk_token_id", None)
    if unk is None:
        return False
    return all(unk in span for span in phrase_spans(phrase, tokenizer))


#: Punctuation stripped from either end of a word before it is looked up (``_`` joins words).
_EDGES = string.punctuation.replace("_", "")


def unknown_words(text: str, tokenizer: Any) -> list[str]:
    """The words of ``text`` (split at white space, punctuation stripped from their ends) that
    the tokenizer cannot spell (:func:`unknown_phrase`: every spelling holds its unknown
    token), once each, in order. The model never reads them: it sees the unknown token."""
    found: list[str] = []
    for word in text.split():
        word = word.strip(_EDGES)
        if word and word not in found and unknown_phrase(word, tokenizer):
            found.append(word)
    return found


def query_mask(
    input_ids: torch.Tensor,
    query: Query,
    *,
    where: torch.Tensor,
    tokenizer: Any = None,
    source: str = "prompt",
) -> torch.Tensor:
    """``[B, S]`` bool: the query tokens of each row.

    ``query`` is a phrase (``str``, tokenised with ``tokenizer``), a token-id span, a ``[B, S]``
    bool mask or ``[B, Tq]`` positions. Phrases and spans are searched in ``where`` (``source``
    names it in messages: the prompt's text, or the answer), last occurrence first; a row
    without it raises ``ValueError``.
    """
    batch, seq = input_ids.shape
    if isinstance(query, torch.Tensor):
        if query.dtype == torch.bool:
            if tuple(query.shape) != (batch, seq):
                raise ValueError(
                    f"query mask has shape {list(query.shape)}, expected [{batch}, {seq}]"
                )
            mask = query.to(input_ids.device)
        else:
            if query.dim() != 2 or query.shape[0] != batch:
                raise ValueError(f"query positions must be [{batch}, Tq], got {list(query.shape)}")
            if bool(((query < 0) | (query >= seq)).any()):
                raise ValueError(f"query positions must lie in [0, {seq})")
            mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
            mask.scatter_(1, query.to(input_ids.device).long(), True)
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("every row needs at least one query token")
        return mask
    if isinstance(query, str):
        if not query.strip():
            raise ValueError("query phrase is empty")
        if tokenizer is None:
            raise ValueError("a phrase query needs processor= (the processor or its tokenizer)")
        candidates = phrase_spans(query, tokenizer)
    elif isinstance(query, Sequence) and query and all(isinstance(t, int) for t in query):
        candidates = [list(query)]
    else:
        raise TypeError(
            "query must be a phrase (str), a list of token ids, a [B, S] bool mask or [B, Tq] "
            f"positions, got {query!r}"
        )
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
    ids = input_ids.tolist()
    allowed = where.tolist()
    for b in range(batch):
        for span in candidates:
            start = _find_span(ids[b], span, allowed[b])
            if start is not None:
                mask[b, start : start + len(span)] = True
                break
        else:
            raise ValueError(_not_found(query, candidates, b, source, tokenizer))
    return mask


def _not_found(query: Any, candidates: list[list[int]], row: int, source: str, tok: Any) -> str:
    unk = getattr(tokenizer_of(tok), "unk_token_id", None) if tok is not None else None
    if unk is not None and all(unk in span for span in candidates):
        name = getattr(tokenizer_of(tok), "unk_token", "<unk>")
        return (
            f"query {query!r} tokenises to the unknown token {name!r} (id {unk}): the "
            f"tokenizer does not know (part of) it, so it cannot be found in the {source}; "
            "use the words the prompt spells (the tokens the model saw)"
        )
    return f"query {query!r} (tokens {candidates}) not found in row {row} of the {source}"


def text_tokens(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, S]`` bool: valid tokens that are not visual."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    return valid & ~get_adapter(model).visual_mask(model, input_ids)


def instruction(
    model: nn.Module, inputs: Mapping[str, Any], *, require: bool = True
) -> torch.Tensor:
    """``[B, S]`` bool: the valid text tokens after each row's last visual token (``require``:
    a row without any raises)."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    visual = get_adapter(model).visual_mask(model, input_ids) & valid
    out = Prefill(input_ids, valid, visual, {}).text_after_image()
    if require and bool((out.sum(1) == 0).any()):
        raise ValueError("a row has no text after its image to use as the query")
    return out


def query_tokens(
    model: nn.Module, inputs: Mapping[str, Any], query: Query, tokenizer: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward inputs and ``[B, S]`` bool query tokens of a prompt: ``query`` searched in
    its text, or the instruction when ``query`` is ``None``."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be the processor's output mapping with input_ids")
    inputs = dict(inputs)
    if query is None:
        return inputs, instruction(model, inputs)
    where = text_tokens(model, inputs)
    return inputs, query_mask(inputs["input_ids"], query, where=where, tokenizer=tokenizer)
