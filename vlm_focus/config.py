"""``FocusConfig``: what to prune, how much, and where, and the one reading of each of its values
(``keep``'s rule, a multi-stage schedule). Each option is defined once, here: the API, every
command line (``--help`` and the flags are generated from these fields by
:mod:`vlm_focus.core.options`, defaults included) and the demo read these definitions."""

from __future__ import annotations

import numbers
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .core.options import check_choices, default_of, option

QUERY_ROWS = ("last", "text")
REDUCTIONS = ("mean", "max")
BUDGETS = ("span", "frame")
POSITIONS = ("original", "compact")
#: ``video_pruner``'s default: the measured choice for prompts that carry a video
#: (:attr:`FocusConfig.pruner_for_video`), resolved per setting.
VIDEO_AUTO = "auto"
#: what ``video_pruner="auto"`` runs on a video while ``pruner`` is its default: pure max-min
#: diversity keeps "which object comes first" where attention pruners lose it, at K = 2 on
#: organism-qwen and at layer 0 on the hybrid organism-qwen35
#: (benchmarks/results/video_default.md, video_default_qwen35.md)
VIDEO_DEFAULT = "diverse"
KEEP_RULE = "a float ratio in (0, 1] (1.0 keeps every visual token) or an int count >= 2"


def parse_keep(value: Any) -> float | int:
    """The one reading of ``keep``, shared by ``wrap()``, every command line and the evaluations.

    - a float is a ratio in ``(0, 1]``: ``0.25`` keeps a quarter of each row's visual tokens,
      ``1.0`` keeps them all;
    - an int is a count ``>= 2`` of visual tokens kept per row (a count above an input's visual
      tokens raises when that input runs); ``1`` is refused as ambiguous: pass ``1.0`` to keep
      every token;
    - numpy (and other ``numbers``) scalars count as the Python int or float they hold.

    Text is refused here (the API takes numbers); the command lines read theirs with
    :func:`read_keep`. Anything else raises ``ValueError`` naming the value, its type and the
    rule, so the API and the command line give the same message for the same number.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"keep={value!r} has type {type(value).__name__}; keep takes {KEEP_RULE}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    else:
        value = float(value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"keep={value!r}: a ratio must lie in (0, 1]; a count is an int >= 2")
        return value
    if value == 1:
        raise ValueError(
            f"keep={value!r} is ambiguous: pass 1.0 to keep every visual token, or a count >= 2"
        )
    if value < 2:
        raise ValueError(f"keep={value!r}: a count must be >= 2 (a ratio is a float in (0, 1])")
    return value


STAGES_RULE = (
    "one value, or a multi-stage schedule written as a colon or comma list (2:8:16 or 2,8,16)"
)


def read_stages(name: str, value: str, read_one: Any) -> Any:
    """The one reading of a multi-stage option (``layer``, ``keep``) as a command line, a form
    field or a harness's ``key=value`` argument gives it: ``"2"`` is one value, ``"2:8:16"`` or
    ``"2,8,16"`` a schedule (a tuple, one value per stage), each part read by ``read_one``.
    Harnesses that split their arguments on commas (lmms-eval) take the colon form."""
    parts = re.split(r"[:,]", value.strip())
    if len(parts) > 1 and not all(p.strip() for p in parts):
        raise ValueError(f"{name}={value!r} has an empty stage; {name} takes {STAGES_RULE}")
    values = tuple(read_one(p) for p in parts)
    return values if len(values) > 1 else values[0]


def read_keep(value: Any) -> float | int | tuple[float | int, ...]:
    """``keep`` as a command line (or a form field) gives it: text is an int when it is a whole
    number written without a point or exponent (``"64"``), else a float (``"0.25"``,
    ``"1.0"``); then :func:`parse_keep`'s rule. A schedule (``"0.5:0.25"``, one keep per stage
    of ``layer``) is a tuple (:func:`read_stages`). Numbers pass straight to
    :func:`parse_keep`."""
    if not isinstance(value, str):
        return parse_keep(value)
    return read_stages("keep", value, _read_one_keep)


def _read_one_keep(value: str) -> float | int:
    text = value.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return parse_keep(int(text))
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"keep={value!r} is not a number; keep takes {KEEP_RULE}") from None
    return parse_keep(number)


def read_layer(value: Any, name: str = "layer") -> int | tuple[int, ...]:
    """``layer`` (or another option of layer indices, ``name``) as a command line gives it:
    ``"2"`` or a schedule ``"2:8:16"`` (a tuple, :func:`read_stages`); each stage a whole
    number. Whether the layers are ``>= 0`` and increasing, and whether ``keep`` has as many
    stages, is :class:`FocusConfig`'s check. Anything but text is returned unchanged."""
    if not isinstance(value, str):
        return value

    def one(part: str) -> int:
        if not re.fullmatch(r"[+-]?\d+", part.strip()):
            raise ValueError(
                f"{name}={value!r}: {part.strip()!r} is not a layer index; {name} takes "
                f"{STAGES_RULE}"
            )
        return int(part)

    return read_stages(name, value, one)


def read_video_pruner(value: Any) -> Any:
    """``video_pruner`` as a command line (or a harness's ``key=value``) gives it: ``none`` is
    ``None`` (``pruner`` for every prompt), other text a name (checked by
    :func:`vlm_focus.wrap`); anything but text is returned unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    return None if text.lower() == "none" else text


def keeps_everything(keep: Any) -> bool:
    """True for the ratio ``1.0``: every stage keeps every visual token (no pruning)."""
    keeps = keep if isinstance(keep, (tuple, list)) else (keep,)
    return all(isinstance(k, float) and k == 1.0 for k in keeps)


@dataclass
class FocusConfig:
    """Settings for :func:`vlm_focus.wrap`. Checked on construction; serialisable with ``to_dict``.

    ``layer`` and ``keep`` may be tuples of equal length for a multi-stage schedule, e.g.
    ``layer=(2, 8, 16), keep=(0.5, 0.25, 0.125)``; each stage prunes what the previous one kept.
    """

    pruner: str = option(
        "fastv", "registered pruner (`vlm-focus pruners` lists them with their options)"
    )
    keep: float | int | tuple = option(
        0.25,
        f"visual tokens kept per row: {KEEP_RULE}; one per stage of --layer (0.5:0.25)",
        parse=str,
    )
    layer: int | tuple = option(
        2,
        "prune after this many decoder layers (0 = before the first layer); a "
        "multi-stage schedule is a colon or comma list with one keep per stage (--layer 2:8 "
        "--keep 0.5:0.25)",
        parse=read_layer,
    )
    query_rows: str = option(
        "text",
        "the rows whose attention scores the visual tokens: every 'text' token after "
        "the image (measured best, benchmarks/results/pruning_defaults.md) or the 'last' "
        "prompt token",
        choices=QUERY_ROWS,
        tag="q",
    )
    reduce: str = option(
        "max",
        "how the heads' attention is combined: their 'max' (measured best, "
        "benchmarks/results/pruning_defaults.md) or 'mean'",
        choices=REDUCTIONS,
        tag="r",
    )
    budget: str = option(
        "span",
        "what keep divides: 'span' = a row's whole visual span (all images and "
        "frames together, the pruner decides where), 'frame' = every image and every video "
        "frame keeps the same share of its own tokens",
        choices=BUDGETS,
        tag="b",
    )
    positions: str = option(
        "original",
        "RoPE positions of the kept tokens: 'original' = where the unpruned prompt "
        "had them, 'compact' = renumbered consecutively as if the pruned visual tokens had "
        "never been in the prompt, as vLLM and VisionZip position a pruned LLaVA prompt "
        "(one stage at layer 0, 1-D RoPE models only)",
        choices=POSITIONS,
        tag="p",
        recorded="when_set",
    )
    video_pruner: str | None = option(
        VIDEO_AUTO,
        "the pruner of a prompt that carries a video: 'auto' = 'diverse' (pure max-min; it "
        "keeps which object comes first where fastv loses it, "
        "benchmarks/results/video_default.md) while pruner is the default 'fastv', else "
        "pruner; a registered name = that pruner, with its "
        "default options, for every prompt with a video; none = pruner for every prompt",
        parse=read_video_pruner,
        tag="v",
        recorded="when_set",
    )
    warm_kernels: bool = option(
        True,
        "on a GPU, compile the Triton kernels' variants at wrap() so that no "
        "request pays a compile (a few seconds, once per process)",
        cli=False,
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the pruner's own options (vf.pruner_options(name) lists them)",
            "cli": False,
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.options, dict):
            raise TypeError("options must be a dict of pruner-specific settings")
        self.options = dict(self.options)
        staged = isinstance(self.layer, (tuple, list))
        layers = tuple(self.layer) if staged else (self.layer,)
        layers = tuple(_whole(x) for x in layers)
        self.layer = layers if staged else layers[0]
        keeps = self.keep if isinstance(self.keep, (tuple, list)) else (self.keep,)
        if len(layers) != len(keeps) or not layers:
            raise ValueError(
                f"layer={self.layer!r} and keep={self.keep!r} must have the same number of stages "
                f"({len(layers)} and {len(keeps)}): one keep per layer, e.g. layer=(2, 8), "
                "keep=(0.5, 0.25) (on a command line --layer 2:8 --keep 0.5:0.25)"
            )
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(
                    f"layer={layer!r} must be an int >= 0 (0 = before the first layer)"
                )
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"layer={self.layer!r}: stage layers must be strictly increasing")
        keeps = tuple(parse_keep(k) for k in keeps)
        _check_schedule(keeps)
        self.keep = keeps if isinstance(self.keep, (tuple, list)) else keeps[0]
        check_choices(self, FocusConfig)  # every option that has choices
        if not isinstance(self.warm_kernels, bool):
            raise TypeError(f"warm_kernels must be True or False, got {self.warm_kernels!r}")
        if not isinstance(self.pruner, str):
            raise TypeError(f"pruner must be a name (str), got {type(self.pruner).__name__}")
        if self.video_pruner is not None and not isinstance(self.video_pruner, str):
            raise TypeError(
                f"video_pruner must be a pruner name (str), 'auto' or None, got "
                f"{type(self.video_pruner).__name__}"
            )
        if isinstance(self.video_pruner, str) and not self.video_pruner.strip():
            raise ValueError(
                "video_pruner='' is empty: pass a registered pruner name, 'auto' (the measured "
                "video default) or None (pruner for every prompt)"
            )

    @property
    def stages(self) -> list[tuple[int, float | int]]:
        """``[(layer, keep), ...]`` in layer order."""
        layers = self.layer if isinstance(self.layer, (tuple, list)) else (self.layer,)
        keeps = self.keep if isinstance(self.keep, (tuple, list)) else (self.keep,)
        return list(zip(layers, keeps, strict=True))

    @property
    def pruner_for_video(self) -> str:
        """The pruner that runs on a prompt whose visual tokens include a video:

        - ``video_pruner=None``: ``pruner``, as for every prompt;
        - ``"auto"`` (the default): ``"diverse"`` (:data:`VIDEO_DEFAULT`, with its default
          ``pool=1``) while ``pruner`` is its default ``"fastv"``, at any layer: measured on
          both Qwen organisms' clip questions (at K = 2 the best on organism-qwen, within
          noise of the best on organism-qwen35; at layer 0 within 2 points of fastv on
          organism-qwen and 24 above it on organism-qwen35); ``pruner`` otherwise: a pruner
          the caller names applies to videos unchanged;
        - a name: that pruner, whatever ``pruner`` is.
        """
        if self.video_pruner is None:
            return self.pruner
        if self.video_pruner != VIDEO_AUTO:
            return self.video_pruner
        if self.pruner == default_of(FocusConfig, "pruner"):
            return VIDEO_DEFAULT
        return self.pruner

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_schedule(keeps: tuple[float | int, ...]) -> None:
    """Each stage prunes what the one before kept, so its keep must be smaller: a stage that
    keeps as much or more would silently do nothing. Ratios compare with ratios and counts with
    counts here (how a ratio compares with a count depends on the input)."""
    for before, after in zip(keeps, keeps[1:]):
        if isinstance(before, float) == isinstance(after, float) and after >= before:
            raise ValueError(
                f"keep={keeps!r}: each stage must keep less than the stage before it "
                f"({after!r} after {before!r}); a later stage prunes what the earlier one kept"
            )


def _whole(value: Any) -> Any:
    """A numpy integer as a Python int (other values unchanged, for the checks to name)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def keep_count(keep: float | int, n_visual: int, *, clamp: bool = False) -> int:
    """The one rule that turns ``keep`` (as :func:`parse_keep` reads it) into a number of tokens
    kept out of ``n_visual``.

    - a ratio keeps ``round(keep * n_visual)`` tokens (Python's ``round``: halves go to the even
      neighbour), at least 1 and at most ``n_visual``;
    - a count keeps itself; a count above ``n_visual`` raises ``ValueError``, or with
      ``clamp=True`` keeps all ``n_visual``. ``vf.wrap`` raises, since its caller chose the count
      for the input at hand; the vLLM plugin clamps, since one server-wide count serves images of
      every size and an image smaller than the count keeps all its tokens.
    """
    if isinstance(keep, float):
        return max(1, min(n_visual, round(keep * n_visual)))
    if keep > n_visual:
        if clamp:
            return n_visual
        raise ValueError(f"keep={keep} is more than the {n_visual} visual tokens of this input")
    return keep
