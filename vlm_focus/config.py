"""``FocusConfig``: what to prune, how much, and where."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

QUERIES = ("last", "text")
REDUCTIONS = ("mean", "max")
BUDGETS = ("span", "frame")


@dataclass
class FocusConfig:
    """Settings for :func:`vlm_focus.wrap`. Checked on construction; serialisable with ``to_dict``.

    ``layer`` and ``keep`` may be tuples of equal length for a multi-stage schedule, e.g.
    ``layer=(2, 8, 16), keep=(0.5, 0.25, 0.125)``; each stage prunes what the previous one kept.
    """

    pruner: str = field(default="fastv", metadata={"help": "registered pruner name"})
    keep: float | int | tuple = field(
        default=0.25,
        metadata={"help": "visual tokens kept per row: ratio in (0, 1] or a count >= 1"},
    )
    layer: int | tuple = field(
        default=2,
        metadata={"help": "prune after this many decoder layers (0 = before the first layer)"},
    )
    query: str = field(
        default="last",
        metadata={"help": "scoring rows: 'last' prompt token or all 'text' after the image"},
    )
    reduce: str = field(default="mean", metadata={"help": "head aggregation: 'mean' or 'max'"})
    budget: str = field(
        default="span",
        metadata={
            "help": "what keep divides: 'span' = a row's whole visual span (all images and "
            "frames together, the pruner decides where), 'frame' = every image and every video "
            "frame keeps the same share of its own tokens"
        },
    )
    warm_kernels: bool = field(
        default=True,
        metadata={
            "help": "on a GPU, compile the Triton kernels' variants at wrap() so that no "
            "request pays a compile (a few seconds, once per process)"
        },
    )
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "pruner-specific options (see vf.pruners())"}
    )

    def __post_init__(self) -> None:
        layers = self.layer if isinstance(self.layer, (tuple, list)) else (self.layer,)
        keeps = self.keep if isinstance(self.keep, (tuple, list)) else (self.keep,)
        if len(layers) != len(keeps) or not layers:
            raise ValueError(
                f"layer={self.layer!r} and keep={self.keep!r} must have the same number of stages"
            )
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(
                    f"layer={layer!r} must be an int >= 0 (0 = before the first layer)"
                )
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"layer={self.layer!r}: stage layers must be strictly increasing")
        for keep in keeps:
            _check_keep(keep)
        if self.query not in QUERIES:
            raise ValueError(f"query={self.query!r} is not one of {QUERIES}")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce={self.reduce!r} is not one of {REDUCTIONS}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget={self.budget!r} is not one of {BUDGETS}")
        if not isinstance(self.warm_kernels, bool):
            raise TypeError(f"warm_kernels must be True or False, got {self.warm_kernels!r}")
        if not isinstance(self.pruner, str):
            raise TypeError(f"pruner must be a name (str), got {type(self.pruner).__name__}")
        if not isinstance(self.options, dict):
            raise TypeError("options must be a dict of pruner-specific settings")

    @property
    def stages(self) -> list[tuple[int, float | int]]:
        """``[(layer, keep), ...]`` in layer order."""
        layers = self.layer if isinstance(self.layer, (tuple, list)) else (self.layer,)
        keeps = self.keep if isinstance(self.keep, (tuple, list)) else (self.keep,)
        return list(zip(layers, keeps, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_keep(keep: Any) -> None:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise ValueError(f"keep={keep!r} must be a ratio in (0, 1] or an int count >= 1")
    if isinstance(keep, float) and not 0.0 < keep <= 1.0:
        raise ValueError(f"keep={keep!r}: a ratio must lie in (0, 1]; pass an int for a count")
    if isinstance(keep, int) and keep < 1:
        raise ValueError(f"keep={keep!r}: a count must be >= 1")


def keep_count(keep: float | int, n_visual: int) -> int:
    """Visual tokens to keep out of ``n_visual``: ``round(keep * n)`` (at least 1) or the count."""
    if isinstance(keep, float):
        return max(1, min(n_visual, round(keep * n_visual)))
    if keep > n_visual:
        raise ValueError(f"keep={keep} is more than the {n_visual} visual tokens of this input")
    return keep
