"""The pruner registry: names to :class:`~vlm_focus.core.pruner.Pruner` classes.

The engine never imports a pruner; the built-ins in :mod:`vlm_focus.pruners` register
themselves when the public package imports them, and a user's pruner registers the same way.
"""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any

from .options import OptionInfo, options, options_markdown
from .pruner import Pruner

if TYPE_CHECKING:
    from ..config import FocusConfig

_PRUNERS: dict[str, type[Pruner]] = {}


def register_pruner(cls: type[Pruner], *, replace: bool = False) -> type[Pruner]:
    """Register a :class:`Pruner` subclass under ``cls.name`` (a lowercase identifier)."""
    if not (isinstance(cls, type) and issubclass(cls, Pruner)):
        raise TypeError(f"register_pruner expects a Pruner subclass, got {cls!r}")
    if not isinstance(cls.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", cls.name):
        raise ValueError(f"pruner name {cls.name!r} must be a lowercase identifier")
    if cls.name in _PRUNERS and not replace:
        raise ValueError(f"a pruner named '{cls.name}' is already registered (replace=True)")
    _PRUNERS[cls.name] = cls
    return cls


class _PrunerNames:
    """``pruners()``: the names of the registered pruners. Because ``vf.pruners`` is this
    callable rather than the module, attribute access reaches the module's names:
    ``vf.pruners.get_pruner("debiased")``, ``vf.pruners.pruner_options("text")``."""

    def __call__(self) -> list[str]:
        return sorted(_PRUNERS)

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(sys.modules["vlm_focus.pruners"], name)
        except AttributeError:
            raise AttributeError(
                f"vlm_focus.pruners has no {name!r}; it has: {', '.join(dir(self))}"
            ) from None

    def __dir__(self) -> list[str]:
        return list(sys.modules["vlm_focus.pruners"].__all__)

    def __repr__(self) -> str:
        return "<vlm_focus.pruners(): names of the registered pruners>"


pruners = _PrunerNames()


def get_pruner(name: str) -> type[Pruner]:
    """The registered :class:`Pruner` class of ``name``."""
    if not isinstance(name, str) or name not in _PRUNERS:
        raise ValueError(f"unknown pruner {name!r}; registered: {', '.join(pruners())}")
    return _PRUNERS[name]


def video_pruner_class(config: FocusConfig) -> type[Pruner] | None:
    """The class of the pruner that ``config`` runs on prompts that carry a video
    (:attr:`~vlm_focus.FocusConfig.pruner_for_video`, with its default options), or ``None``
    when that is ``config.pruner`` itself. Both choose in the prefill: a pruner that selects
    per decoding step or drives generation through a guide runs every prompt, so it can be
    neither the video pruner nor beside one (``ValueError`` naming the option)."""
    name = config.pruner_for_video
    if name == config.pruner:
        return None
    try:
        video_cls = get_pruner(name)
    except ValueError as err:
        raise ValueError(f"video_pruner={name!r}: {err}") from None
    if _drives_decoding(video_cls):
        raise ValueError(
            f"video_pruner={name!r} chooses per decoding step or through a guide model; "
            "video_pruner takes a pruner that chooses in the prefill (pass it as pruner to run "
            "it on every prompt)"
        )
    if _drives_decoding(get_pruner(config.pruner)):
        raise ValueError(
            f"pruner={config.pruner!r} chooses per decoding step or through a guide model, so "
            f"video_pruner={name!r} cannot run beside it; pass video_pruner=None to run "
            f"{config.pruner!r} on every prompt"
        )
    return video_cls


def _drives_decoding(cls: type[Pruner]) -> bool:
    return cls.decode_time or cls.needs_guide or cls.drives_decoding


def pruners_with(capability: str) -> list[str]:
    """The registered pruners whose class sets ``capability`` (a class attribute of
    :class:`Pruner`, e.g. ``"needs_guide"`` or ``"attention_based"``)."""
    return [name for name in pruners() if getattr(_PRUNERS[name], capability)]


def pruner_options(name: str) -> list[OptionInfo]:
    """The options of pruner ``name`` (its ``Options`` dataclass), each with its name, type,
    default and help, in field order; pass them to ``vf.wrap`` as keywords. The options every
    pruner takes (``keep``, ``layer``, ...) are :class:`~vlm_focus.FocusConfig`'s."""
    return options(get_pruner(name).Options)


def read_pruner_options(name: str, texts: Any) -> dict[str, Any]:
    """Pruner ``name``'s own options from ``NAME=VALUE`` texts, as a command line or a form
    gives them (``["base=text", "positional=false"]``; one string may hold several, split at
    commas outside brackets). Each value is read by the option's declared type
    (:func:`pruner_options`): ``true``/``false`` for a bool, a number for an int or float,
    ``none`` where ``None`` is allowed, JSON for a dict or list; text otherwise. An unknown
    option, a malformed pair or a value of the wrong type raises ``ValueError`` naming it and
    what ``name`` takes; the pruner's options dataclass checks the values' ranges when
    ``vf.wrap`` builds it."""
    if isinstance(texts, str):
        texts = [texts]
    infos = {info.name: info for info in pruner_options(name)}
    out: dict[str, Any] = {}
    for pair in (p.strip() for text in texts for p in _split_pairs(text)):
        if not pair:
            continue
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"pruner option {pair!r} is not NAME=VALUE (e.g. base=text)")
        if key not in infos:
            takes = ", ".join(infos) or "no options of its own"
            raise ValueError(f"pruner {name!r} has no option {key!r}; it takes: {takes}")
        if infos[key].type == "Any":
            raise ValueError(
                f"pruner option {key!r} of {name!r} takes a Python object, which text cannot "
                "give: pass it to vf.wrap (the command lines load a guide model with --guide)"
            )
        out[key] = _read_value(key, raw.strip(), infos[key].type)
    return out


def _split_pairs(text: str) -> list[str]:
    """``"a=1, b={"x": 1, "y": 2}"`` -> ``["a=1", ' b={"x": 1, "y": 2}']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _read_value(key: str, raw: str, type_name: str) -> Any:
    kinds = {k.strip() for k in type_name.split("|")}
    if "None" in kinds and raw.lower() in ("none", "null"):
        return None
    if "bool" in kinds:
        words = {"true": True, "1": True, "yes": True, "on": True}
        words.update({"false": False, "0": False, "no": False, "off": False})
        if raw.lower() in words:
            return words[raw.lower()]
        raise ValueError(f"pruner option {key}={raw!r} must be true or false")
    for kind, cast in (("int", int), ("float", float)):
        if kind in kinds:
            try:
                return cast(raw)
            except ValueError:
                if kinds - {kind, "None"}:
                    continue
                raise ValueError(f"pruner option {key}={raw!r} must be {kind}") from None
    if kinds & {"dict", "list", "tuple"}:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            if "str" not in kinds:
                raise ValueError(
                    f"pruner option {key}={raw!r} must be JSON ({type_name})"
                ) from None
    return raw


def pruner_options_markdown() -> str:
    """The pruner-options table of docs/pruners.md: a row per option of every registered pruner."""
    rows = [(name, info) for name in pruners() for info in pruner_options(name)]
    return options_markdown(rows, first="pruner")
