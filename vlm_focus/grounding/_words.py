"""Which tokens name something: the content-word rule and object-vocabulary spans."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._token_masks import phrase_spans, tokenizer_of

#: Words that never name an object (used when no object vocabulary is given): function words,
#: question words, the words of the prompts and places (``top``, ``center``).
STOP_WORDS = frozenset(
    "a an the is are was were be been there here this that these those it its of in on at to "
    "and or with by for from as image picture photo shows showing show has have there's "
    "yes no not left right top bottom above below next near some one two three four many "
    "middle center centre upper lower "
    "what where which who how does do can "
    "describe answer question single word phrase using video frame appears first last".split()
)


def content_word(tokenizer: Any, token: int) -> str | None:
    """The word a token decodes to (stripped, lower case) when it can name something: longer
    than two characters, letters (and ``_``) only, and not made of :data:`STOP_WORDS` words
    alone (``top_right``, one token in some vocabularies, is a place, not an object)."""
    word = tokenizer_of(tokenizer).decode([token]).strip().lower()
    if len(word) > 2 and word.replace("_", "").isalpha():
        if not all(part in STOP_WORDS for part in word.split("_") if part):
            return word
    return None


def find_mentions(
    tokens: list[int], tokenizer: Any, objects: Sequence[str] | None
) -> list[tuple[str, list[int]]]:
    """``(text, indices into tokens)`` of each mention, in order: each ``objects`` name's
    non-overlapping spans, or, without a vocabulary, every token that is a content word."""
    found: list[tuple[str, list[int]]] = []
    if objects is not None:
        for name in objects:
            taken: set[int] = set()  # a name's own spans do not overlap
            for span in phrase_spans(name, tokenizer):
                n = len(span)
                for start in range(len(tokens) - n + 1):
                    idx = list(range(start, start + n))
                    if tokens[start : start + n] == span and not taken & set(idx):
                        found.append((name, idx))
                        taken |= set(idx)
        return sorted(found, key=lambda m: m[1][0])
    for i, t in enumerate(tokens):
        word = content_word(tokenizer, t)
        if word is not None:
            found.append((word, [i]))
    return found
