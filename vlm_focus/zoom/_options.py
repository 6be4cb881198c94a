"""The zoom's options: one dataclass, whose fields (their help, choices and checks) are the
zoom's table of routes and settings; every entry point reads them from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.options import OptionInfo, option, options
from ._reask import MODES
from ._routing import STATISTICS, check_statistic, check_threshold

ROUTES = ("never", "always", "adaptive")
ANCHORS = ("box", "peak")
ASPECTS = ("view", "image", "box")


@dataclass
class ZoomOptions:
    """How :func:`look_closer` picks regions and when it zooms (serialisable; the evaluations
    record it with their results)."""

    route: str = option(
        "always",
        "always zoom, zoom when the routing statistic (the plain answer's "
        "first-token confidence or the question's attention map) is below threshold "
        "(adaptive), or never",
        choices=ROUTES,
    )
    threshold: float | None = option(
        None,
        "adaptive routing: zoom when the statistic is below it (0: never, 1: "
        "every question the zoom can crop); from zoom.calibrate",
    )
    statistic: str = option(
        "top1",
        "routing statistic, in [0, 1], low = zoom: the first answer token's top-1 "
        "probability (top1) or top-1 minus top-2 (margin), or the question's attention "
        "map's 1 - peak cell share (peak), normalised entropy (entropy) or share of mass "
        "outside the zoom's crop (outside); top1 measured best on the organism "
        "(zoom_quality.md)",
        choices=STATISTICS,
    )
    mode: str | None = option(
        None,
        "re-ask with the image and its crops (both) or the crops alone (crop)",
        choices=MODES,
        default_text="the model type's default (zoom.default_mode)",
    )
    regions: int = option(1, "crops per question (with mode crop, several are merged into one)")
    margin: float = option(0.25, "share of the attention box's side added on each side")
    min_size: str | int | float = option(
        "view",
        "smallest crop side: 'view' (the encoder's input side, so a crop reaches it "
        "at no more than 1:1), pixels (int) or a share of the image's short side (float "
        "in (0, 1])",
    )
    aspect: str | float = option(
        "view",
        "crop shape: 'view' (the model's view of the image: square for a centre "
        "crop or a pad), 'image', 'box' (the box's own) or a width/height ratio",
    )
    anchor: str = option("box", "crop around the map's top boxes or its peak", choices=ANCHORS)
    box_threshold: float | str = option("otsu", "threshold of grounding.boxes on the map")
    layers: list[int] | None = option(
        None, "decoder layers whose attention makes the map", default_text="all"
    )
    heads: Any = option(
        None, "localization heads (grounding.select_localization_heads) or {layer: [heads]}"
    )
    max_new_tokens: int = option(16, "new tokens per answer")

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r}; allowed: {ROUTES}")
        if self.route == "adaptive" and self.threshold is None:
            raise ValueError(
                "route='adaptive' needs threshold= (a number in [0, 1], e.g. from "
                "zoom.calibrate(...).threshold)"
            )
        if self.threshold is not None:
            self.threshold = check_threshold(self.threshold)
        check_statistic(self.statistic)
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; allowed: {MODES} or None")
        if isinstance(self.regions, bool) or not isinstance(self.regions, int) or self.regions < 1:
            raise ValueError(f"regions={self.regions!r} must be an int >= 1")
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor={self.anchor!r}; allowed: {ANCHORS}")
        if self.anchor == "peak" and self.regions != 1:
            raise ValueError("anchor='peak' gives one region: use regions=1")
        if (
            isinstance(self.margin, bool)
            or not isinstance(self.margin, int | float)
            or (self.margin < 0)
        ):
            raise ValueError(f"margin={self.margin!r} must be a number >= 0")
        m = self.min_size
        if isinstance(m, str):
            if m != "view":
                raise ValueError(f"min_size={m!r}; allowed: 'view', pixels (int), share (float)")
        elif isinstance(m, bool) or not isinstance(m, int | float):
            raise ValueError(f"min_size={m!r}; allowed: 'view', pixels (int), share (float)")
        elif isinstance(m, float) and not 0 < m <= 1:
            raise ValueError(f"min_size={m!r}: a share of the short side lies in (0, 1]")
        elif isinstance(m, int) and m < 0:
            raise ValueError(f"min_size={m!r} pixels must be >= 0")
        a = self.aspect
        if isinstance(a, str):
            if a not in ASPECTS:
                raise ValueError(f"aspect={a!r}; allowed: {ASPECTS} or a ratio > 0")
        elif isinstance(a, bool) or not isinstance(a, int | float) or a <= 0:
            raise ValueError(f"aspect={a!r}; allowed: {ASPECTS} or a ratio > 0")
        if self.layers is not None:
            self.layers = [int(v) for v in self.layers]
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or (self.max_new_tokens < 1)
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")

    def to_json(self) -> dict:
        return asdict(self)


def merged(config: ZoomOptions | None, overrides: dict[str, Any]) -> ZoomOptions:
    """``config`` (default :class:`ZoomOptions`) with keyword ``overrides``; an unknown one
    raises ``ValueError`` naming the allowed ones."""
    if config is not None and not isinstance(config, ZoomOptions):
        raise TypeError(f"config must be a ZoomOptions, got {type(config).__name__}")
    if not overrides:
        return config or ZoomOptions()
    known = set(ZoomOptions.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown zoom option(s) {unknown}; allowed: {sorted(known)}")
    base = asdict(config) if config is not None else {}
    if config is not None:
        base["heads"] = config.heads  # keep the object, not its dict
    return ZoomOptions(**{**base, **overrides})


def zoom_options() -> list[OptionInfo]:
    """The zoom's options (:class:`ZoomOptions`), each with its name, type, default and help,
    in field order: the keywords of :func:`~vlm_focus.zoom.look_closer`."""
    return options(ZoomOptions)
