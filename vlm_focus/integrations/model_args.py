"""vlm_focus's own options inside an evaluation harness's flat ``key=value`` model arguments.

Harnesses such as lmms-eval hand a model every ``--model_args`` item as one keyword. This module
takes out the ones that belong to vlm_focus and checks them, before any weights load:

- :class:`vlm_focus.FocusConfig` fields: ``pruner``, ``keep``, ``layer``, ``query_rows``,
  ``reduce``, ``budget``, ``positions``, ``video_pruner`` (``video_pruner=none`` runs
  ``pruner`` on videos too);
  ``layer`` and ``keep`` take multi-stage schedules as colon lists (``layer=2:8:16,
  keep=0.5:0.25:0.125``), since the harness splits its arguments on commas;
- the chosen pruner's own options (``base``, ``alpha``, ``seed``, ...), checked by that pruner's
  options dataclass; ``guide=PATH`` (or ``guide=embedded``) names the small model of a pruner
  that takes one (``guided``);
- a mitigation from :mod:`vlm_focus.hallucination` that runs inside a harness
  (``mitigate=attention_reweight``) with its options, read by their declared types
  (:func:`vlm_focus.hallucination.mitigation_options`): ``strength``, ``mitigate_layers`` (a
  colon list) and ``mitigate_ratio``. An option whose name a flat list would read as pruning's
  (``layers``, ``ratio``, or a name that pruning uses) takes the ``mitigate_`` prefix.

Any of the pruning options turns pruning on (with :class:`~vlm_focus.FocusConfig`'s defaults
for the rest); without them the model runs unpruned.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import LogitsProcessor

from ..config import FocusConfig, read_keep, read_layer, read_video_pruner
from ..core.options import OptionInfo
from ..hallucination import (
    Mitigation,
    get_mitigation,
    mitigation_name,
    mitigation_options,
    mitigations,
)
from ..pruners import get_pruner, pruners, pruners_with, video_pruner_class
from ..setting import RunSetting

FOCUS_FIELDS = tuple(f.name for f in dataclasses.fields(FocusConfig) if f.name != "options")
#: the command lines' readers of the options that take a multi-stage schedule
_READERS = {"layer": read_layer, "keep": read_keep, "video_pruner": read_video_pruner}
#: mitigation options that a flat list of model arguments would read as pruning's (``layer``,
#: keep's ratio), so they take the ``mitigate_`` prefix
_READ_AS_PRUNING = ("layers", "ratio")


def harness_limit(mitigation: type[Mitigation]) -> str | None:
    """Why ``mitigation`` cannot run inside a harness's model class, or ``None``: the harness
    calls ``generate()`` itself, so a method that needs its own ``generate()`` arguments (a
    logits processor, a beam width) or a second prompt per request cannot run through it."""
    if mitigation.generic_prompt is not None:
        return "it needs a second, generic prompt per request"
    if issubclass(mitigation, LogitsProcessor) or mitigation.generate_args:
        extra = "".join(f"{k} and " for k in mitigation.generate_args)
        return f"it needs {extra}its logits processor in generate()"
    return None


def harness_mitigations() -> list[str]:
    """The registered mitigations a harness's model class can run."""
    return [n for n in mitigations() if harness_limit(get_mitigation(n)) is None]


def pruner_option_names() -> dict[str, list[str]]:
    """Each registered pruner's own option names."""
    return {name: get_pruner(name).option_names() for name in pruners()}


def mitigation_arguments() -> dict[str, str]:
    """The model argument of each option of the mitigations a harness runs, to that option:
    its own name, or ``mitigate_NAME`` where pruning would claim the name."""
    pruning = set(FOCUS_FIELDS).union(*pruner_option_names().values(), _READ_AS_PRUNING)
    out = {}
    for name in harness_mitigations():
        for option in get_mitigation(name).option_names():
            out[f"mitigate_{option}" if option in pruning else option] = option
    return out


def focus_option_names() -> list[str]:
    """Every model argument vlm_focus takes (config fields, all pruners' options, mitigation)."""
    names = set(FOCUS_FIELDS) | {"mitigate", *mitigation_arguments()}
    for options in pruner_option_names().values():
        names.update(options)
    return sorted(names)


@dataclass
class FocusArgs:
    """vlm_focus's part of a harness's model arguments, checked.

    ``wrap`` holds the keywords for :func:`vlm_focus.wrap` (empty: unpruned) without ``guide``;
    ``guide`` is the guide model's path for the ``guided`` pruner; ``mitigate`` and
    ``mitigate_options`` name a :mod:`vlm_focus.hallucination` context manager and its keywords.
    """

    wrap: dict[str, Any] = field(default_factory=dict)
    guide: str | None = None
    mitigate: str | None = None
    mitigate_options: dict[str, Any] = field(default_factory=dict)

    @property
    def pruned(self) -> bool:
        return bool(self.wrap)

    def config(self) -> FocusConfig | None:
        """The :class:`~vlm_focus.FocusConfig` that ``wrap`` builds (``None`` when unpruned)."""
        if not self.wrap:
            return None
        return _focus_config(self.wrap)

    def setting(self) -> RunSetting:
        """The :class:`~vlm_focus.setting.RunSetting` these arguments stand for."""
        return RunSetting(
            focus=self.config(),
            mitigation=self.mitigate or "none",
            mitigation_options=self.mitigate_options,
            guide=self.guide,
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-ready record of what the model does: pruning config and mitigation."""
        config = self.config()
        out: dict[str, Any] = {"pruned": self.pruned}
        if config is not None:
            out.update(config.to_dict())
        if self.guide is not None:
            out["guide"] = self.guide
        out["mitigate"] = self.mitigate
        if self.mitigate_options:
            out["mitigate_options"] = dict(self.mitigate_options)
        return out

    def tag(self) -> str:
        """The setting's tag, as every command writes it (:attr:`RunSetting.tag`)."""
        return self.setting().tag


def split_model_args(
    kwargs: dict[str, Any], *, other: list[str] | tuple[str, ...] | None = None
) -> tuple[FocusArgs, dict[str, Any]]:
    """``(vlm_focus's checked options, the remaining arguments)``.

    ``other`` lists the argument names the harness's own model class accepts; when given, any
    argument that is neither vlm_focus's nor in ``other`` raises ``ValueError`` naming it. Bad
    values (``keep=0``, an unknown pruner, an option the chosen pruner does not have, an
    unknown mitigation) raise ``ValueError`` naming the option and what is allowed.
    """
    ours = set(focus_option_names())
    mine = {k: v for k, v in kwargs.items() if k in ours}
    rest = {k: v for k, v in kwargs.items() if k not in ours}
    if other is not None:
        unknown = sorted(k for k in rest if k not in other)
        if unknown:
            raise ValueError(_unknown_message(unknown, sorted(ours), sorted(other)))
    return parse_focus_args(mine), rest


def parse_focus_args(options: dict[str, Any]) -> FocusArgs:
    """Check vlm_focus's options (see the module docstring) and build :class:`FocusArgs`."""
    options = dict(options)
    mitigate = _mitigation(options.pop("mitigate", None))
    mitigate_options = _mitigation_options(mitigate, options)
    guide = options.pop("guide", None)
    wrap: dict[str, Any] = {}
    for key, value in options.items():
        if key in _READERS:  # a colon list is a multi-stage schedule: layer=2:8:16
            value = _READERS[key](value)
        wrap[key] = value
    if guide is not None and "pruner" not in wrap:
        takes = pruners_with("needs_guide")
        if len(takes) != 1:
            raise ValueError(f"guide={guide!r} needs pruner= (one of {', '.join(takes)})")
        wrap["pruner"] = takes[0]
    if wrap:
        config = _focus_config(wrap)
        pruner_cls = get_pruner(config.pruner)
        allowed = pruner_cls.option_names()
        extra = dict(config.options)
        if guide is not None:
            if not pruner_cls.needs_guide:
                raise ValueError(
                    f"guide={guide!r} is not an option of pruner {config.pruner!r}, which "
                    "takes no guide model"
                )
            guide = _guide_path(guide)
        for key in extra:
            if key not in allowed:
                owners = [n for n, opts in pruner_option_names().items() if key in opts]
                raise ValueError(
                    f"option {key!r} is not an option of pruner {config.pruner!r} (it belongs "
                    f"to {', '.join(owners)}); {config.pruner!r} takes: "
                    f"{', '.join(list(FOCUS_FIELDS) + allowed)}"
                )
        if pruner_cls.needs_guide:
            if guide is None:
                raise ValueError(
                    f"pruner {config.pruner!r} needs guide=PATH (a small VLM) or guide=embedded"
                )
        else:
            try:
                pruner_cls.Options(**extra)  # the pruner's own value checks
            except (TypeError, ValueError) as err:
                raise ValueError(f"pruner {config.pruner!r}: {err}") from err
    args = FocusArgs(wrap=wrap, guide=guide, mitigate=mitigate, mitigate_options=mitigate_options)
    args.setting()  # the one check of what combines (a pruner that drives decoding, ...)
    return args


def _focus_config(wrap: dict[str, Any]) -> FocusConfig:
    fields = {k: v for k, v in wrap.items() if k in FOCUS_FIELDS}
    extra = {k: v for k, v in wrap.items() if k not in FOCUS_FIELDS}
    if "pruner" in fields:
        get_pruner(fields["pruner"])  # ValueError listing the registered pruners
    config = FocusConfig(**fields, options=extra)
    video_pruner_class(config)  # the video pruner's name and what it combines with
    return config


def _mitigation(value: Any) -> str | None:
    """The registry name ``mitigate=`` names, or ``None`` for ``none``; an unknown name (a
    removed one such as ``reweight`` included) raises ``ValueError`` listing the registered
    ones."""
    if value is None:
        return None
    try:
        name = mitigation_name(value)
    except ValueError as error:
        raise ValueError(f"mitigate={value!r}: {error}") from None
    if name == "none":
        return None
    why = harness_limit(get_mitigation(name))
    if why is not None:
        raise ValueError(
            f"mitigate={value!r} cannot run inside a harness's model class: {why}; allowed "
            f"here: {', '.join(harness_mitigations())}"
        )
    return name


def _mitigation_options(mitigate: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``mitigate`` that ``options`` gives (taken out of it), read by their
    declared types and checked by the mitigation's options dataclass."""
    arguments = mitigation_arguments()
    given = {arg: options.pop(arg) for arg in arguments if arg in options}
    if given and mitigate is None:
        takers = [
            name
            for name in harness_mitigations()
            if {arguments[arg] for arg in given} & set(get_mitigation(name).option_names())
        ]
        raise ValueError(
            f"{', '.join(sorted(given))} set without mitigate=; pass mitigate="
            + " or mitigate=".join(takers)
        )
    if not given:
        return {}
    infos = {info.name: info for info in mitigation_options(mitigate)}
    out: dict[str, Any] = {}
    for arg, value in given.items():
        option = arguments[arg]
        if option not in infos:
            takes = ", ".join(a for a, o in arguments.items() if o in infos) or "no options"
            raise ValueError(f"{arg} is not an option of mitigate={mitigate!r}; it takes: {takes}")
        out[option] = _read_option(arg, value, infos[option])
    try:
        get_mitigation(mitigate).options(**out)
    except (TypeError, ValueError) as err:
        raise ValueError(f"mitigate={mitigate!r}: {err}") from None
    return out


def _read_option(arg: str, value: Any, info: OptionInfo) -> Any:
    """A mitigation option's value as a harness gives it, by the option's declared type: a
    number, or layer indices as a colon list (the harness splits its arguments on commas)."""
    kinds = {kind.strip() for kind in info.type.split("|")}
    if "None" in kinds and (value is None or str(value).lower() == "none"):
        return None
    if "list[int]" in kinds:
        layers = read_layer(value, arg)
        layers = list(layers) if isinstance(layers, tuple | list) else [layers]
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError(f"{arg}={value!r} must be layer indices >= 0 (a colon list, e.g. 0:1)")
        return layers
    for kind, cast in (("int", int), ("float", float)):
        if kind in kinds:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError(f"{arg}={value!r} must be a number")
            try:
                return cast(value)
            except ValueError:
                raise ValueError(f"{arg}={value!r} must be a number") from None
    return value


def _guide_path(guide: Any) -> str:
    if not isinstance(guide, str) or not guide:
        raise ValueError(f"guide={guide!r} must be a model path, a hub id or 'embedded'")
    if guide == "embedded":
        from ..asset_paths import guide_model_path

        return str(guide_model_path())
    looks_local = guide.startswith((".", "/", "~")) or guide.count("/") != 1
    if looks_local and not (Path(guide).expanduser() / "config.json").is_file():
        raise ValueError(f"guide={guide!r}: no model folder (config.json) there")
    return guide


def _unknown_message(unknown: list[str], ours: list[str], other: list[str]) -> str:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, ours + other, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"unknown model argument {', '.join(hints)}; vlm_focus takes: {', '.join(ours)}; "
        f"the model class takes: {', '.join(other)}"
    )
