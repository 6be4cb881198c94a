"""Decode-time dynamic visual fixation (FastOCR's focal-guided selection and fixation reuse).

Nothing is pruned in prefill and nothing is evicted from the cache. At every decoding step the
step's query at layer K (the focal layer, ``layer=K``) scores the cached visual keys with that
layer's own q/k; layers ``>= K`` then attend to all text and generated tokens plus the step's
``keep`` share of visual tokens, gathered from the cache (so their attention really shrinks).
Between refreshes (``refresh > 1``) only the previous fixation and its grid neighbours within
``radius`` cells compete, warm-starting each step from the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Pruner, Selection, StageContext


@dataclass
class FixationOptions:
    refresh: int = field(
        default=1,
        metadata={
            "help": "every visual token competes every `refresh` decode steps; in between, "
            "only the previous fixation and its grid neighbourhood (1 = re-score all each step)"
        },
    )
    radius: int = field(
        default=1, metadata={"help": "grid cells around each fixated token that compete in between"}
    )

    def __post_init__(self) -> None:
        for name, low in (("refresh", 1), ("radius", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")


class FixationPruner(Pruner):
    """Dynamic visual fixation (FastOCR): per decoding step, the current query's attention at
    layer K (head mean or max of ``softmax(q k^T * scaling)`` over the cached keys) picks the
    visual keys that layers ``>= K`` attend to in that step; the cache keeps every token."""

    name = "fixation"
    Options = FixationOptions
    summary = "decode time: each step's query at layer K picks the visual keys layers >= K read"
    decode_time = True

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        raise RuntimeError("fixation selects while decoding; its prefill keeps every token")
