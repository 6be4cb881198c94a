"""Decode-time dynamic visual fixation (FastOCR's focal-guided selection and fixation reuse).

Nothing is evicted from the cache while decoding. At every decoding step the step's query at
layer K (the focal layer, ``layer=K``) scores the cached visual keys with that layer's own q/k;
layers ``>= K`` then attend to all text and generated tokens plus the step's ``keep`` share of
visual tokens, gathered from the cache (so their attention really shrinks). Between refreshes
(``refresh > 1``) only the previous fixation and its grid neighbours within ``radius`` cells
compete, warm-starting each step from the last.

By default the prompt keeps every token. With ``prefill_keep`` below 1.0 the prompt first
prunes at layer K as ``fastv`` does (layers ``>= K`` hold only that share in their cache), and
each step picks its ``keep`` among those.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import KEEP_RULE, parse_keep
from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext, StepReuse
from ..core.registry import register_pruner


@dataclass
class FixationOptions:
    refresh: int = option(
        1,
        "every visual token competes every `refresh` decode steps; in between, "
        "only the previous fixation and its grid neighbourhood (1 = re-score all each step)",
    )
    radius: int = option(1, "grid cells around each fixated token that compete in between")
    prefill_keep: float | int = option(
        1.0,
        "visual tokens the prompt keeps at layer K, scored like fastv; each step "
        f"picks its `keep` among them ({KEEP_RULE}; 1.0 keeps all)",
        parse=str,
    )

    def __post_init__(self) -> None:
        self.prefill_keep = parse_keep(self.prefill_keep)
        for name, low in (("refresh", 1), ("radius", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")


@register_pruner
class FixationPruner(Pruner):
    """Dynamic visual fixation (FastOCR): per decoding step, the current query's attention at
    layer K (head mean or max of ``softmax(q k^T * scaling)`` over the cached keys) picks the
    visual keys that layers ``>= K`` attend to in that step; the cache keeps every token."""

    name = "fixation"
    drives_decoding = True
    Options = FixationOptions
    summary = "decode time: each step's query at layer K picks the visual keys layers >= K read"
    decode_time = True

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        keep, prompt = config.stages[0][1], options.prefill_keep
        if type(keep) is type(prompt) and keep > prompt:  # two ratios or two counts
            raise ValueError(
                f"pruner='fixation': keep={keep!r} per step exceeds prefill_keep={prompt!r}, "
                "what the prompt keeps; each step picks among those (keep <= prefill_keep)"
            )

    def prefill_keep(self, keep: float | int) -> float | int:
        return self.options.prefill_keep

    def step_reuse(self) -> StepReuse:
        return StepReuse(self.options.refresh, self.options.radius)

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        return ctx.attention_scores(n_keep)  # the prompt's share, as fastv keeps it
