"""One run setting: what a run does to the model, its tag, its description, and the one place
that applies it around ``generate()``.

A :class:`RunSetting` holds a :class:`~vlm_focus.FocusConfig` (or ``None``: unpruned), a
mitigation from :mod:`vlm_focus.hallucination`, an optional :class:`~vlm_focus.zoom.ZoomOptions`
and where the guide model came from. The evaluations, the demo and the lmms-eval plugin build
one and call :meth:`RunSetting.generate` (or :meth:`RunSetting.wrapped` around their own
``generate()``), so a setting means the same everywhere and is written the same way in file
names and logs (:attr:`RunSetting.tag`, :meth:`RunSetting.describe`).

Which combinations run is read from the pruner's class, not its name: a pruner that
``needs_guide`` generates through its guide, and one that ``drives_decoding`` (it drives
``generate()`` itself, or picks new visual keys at every step) combines with no mitigation and
no zoom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import hallucination as hal
from .api import FocusHandle, wrap
from .config import FocusConfig, keeps_everything
from .core.pruner import Pruner
from .core.registry import get_pruner, pruners_with
from .generation import greedy_generate
from .pruners import guided_generate
from .zoom import ZoomOptions

#: What a tag writes for FocusConfig's fields away from their defaults.
_TAG_LETTERS = (("query_rows", "q"), ("reduce", "r"), ("budget", "b"), ("positions", "p"))


def _tag_word(name: str, value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", f"{name}_{value}").strip("_")


@dataclass
class RunSetting:
    """What one run does to the model; recorded with its results.

    Args:
        focus: the pruning (``None``, or a config that keeps every visual token: unpruned).
            Its ``options`` are the pruner's own; a guide model is handed over at run time.
        mitigation: a name of :func:`vlm_focus.hallucination.mitigations` or ``"none"``.
        mitigation_options: parameters of the mitigation, over the registry's defaults.
        zoom: answer through :func:`vlm_focus.zoom.look_closer` with these options
            (``None``: no zoom). Its ``max_new_tokens`` is this setting's.
        guide: where the guide model came from (a path, or ``"embedded"``), for a pruner
            that ``needs_guide``; recorded by :meth:`describe`.
        max_new_tokens: per answer, greedy.
        zoom_calibration: where an adaptive zoom's threshold came from (recorded only).
    """

    focus: FocusConfig | None = None
    mitigation: str = "none"
    mitigation_options: dict[str, Any] = field(default_factory=dict)
    zoom: ZoomOptions | None = None
    guide: str | None = None
    max_new_tokens: int = 16
    zoom_calibration: str | None = None

    def __post_init__(self) -> None:
        if self.focus is not None and not isinstance(self.focus, FocusConfig):
            raise TypeError(f"focus must be a FocusConfig or None, got {type(self.focus)}")
        self.mitigation = hal.mitigation_name(self.mitigation)
        if self.mitigation == "none" and self.mitigation_options:
            raise ValueError("mitigation_options need a mitigation")
        if self.mitigation != "none":
            hal.get_mitigation(self.mitigation).parameters(**self.mitigation_options)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.zoom is not None:
            if not isinstance(self.zoom, ZoomOptions):
                raise TypeError(f"zoom must be ZoomOptions or None, got {type(self.zoom)}")
            if self.zoom.route == "never":
                raise ValueError("zoom route 'never' is no zoom: pass zoom=None")
            self.zoom = dataclasses.replace(self.zoom, max_new_tokens=self.max_new_tokens)
            if self.mitigation != "none":
                raise ValueError(
                    f"zoom {self.zoom.route!r} does not combine with mitigation "
                    f"{self.mitigation!r}: a mitigation steers one generate() call, the zoom "
                    "makes two; use one of them"
                )
        pruner = self.pruner_class
        if pruner is not None and pruner.drives_decoding:
            if self.mitigation != "none":
                raise ValueError(
                    f"mitigation {self.mitigation!r} does not combine with pruner "
                    f"{pruner.name!r} ({_how_it_drives(pruner)}); use another "
                    "pruner, or no mitigation"
                )
            if self.zoom is not None:
                raise ValueError(
                    f"zoom {self.zoom.route!r} does not combine with pruner {pruner.name!r} "
                    f"({_how_it_drives(pruner)}); use another pruner, or no zoom"
                )
        takes_guide = self.focus is not None and get_pruner(self.focus.pruner).needs_guide
        if self.guide is not None and not takes_guide:
            guided = ", ".join(pruners_with("needs_guide")) or "none"
            raise ValueError(f"a guide is an option of the pruners that take one ({guided})")

    # --- what the setting is ---------------------------------------------------------------
    @property
    def pruned(self) -> bool:
        """A pruner runs and keeps less than every visual token (``keep=1.0`` is unpruned)."""
        return self.focus is not None and not keeps_everything(self.focus.keep)

    @property
    def pruner_class(self) -> type[Pruner] | None:
        return get_pruner(self.focus.pruner) if self.pruned else None

    @property
    def needs_guide(self) -> bool:
        """The run prunes with a pruner that scores from a guide model (hand it one)."""
        return self.pruned and self.pruner_class.needs_guide

    @property
    def tag(self) -> str:
        """File-name tag, e.g. ``unpruned`` or ``fastv-k0.25-l2-qtext``: FocusConfig's
        options away from their defaults, the pruner's own options, then the mitigation (with
        the parameters given over the registry's) and the zoom."""
        tag = "unpruned"
        if self.pruned:
            f = self.focus
            keep = (
                ":".join(f"{k:g}" for k in f.keep) if isinstance(f.keep, tuple) else f"{f.keep:g}"
            )
            layer = ":".join(map(str, f.layer)) if isinstance(f.layer, tuple) else f.layer
            tag = f"{f.pruner}-k{keep}-l{layer}"
            for name, letter in _TAG_LETTERS:
                if getattr(f, name) != getattr(FocusConfig, name):
                    tag += f"-{letter}{getattr(f, name)}"
            for name, value in sorted(f.options.items()):
                if name != "guide":  # a model, recorded by describe() (a path is no tag)
                    tag += "-" + _tag_word(name, value)
        if self.mitigation != "none":
            tag += f"-{self.mitigation}"
            for name, value in sorted(self.mitigation_options.items()):
                tag += "-" + _tag_word(name, value)
        if self.zoom is not None:
            tag += f"-zoom_{self.zoom.route}"
            if self.zoom.route == "adaptive":
                tag += f"-t{self.zoom.threshold:.6g}"
            if self.zoom.layers is not None:
                tag += "-zl" + ".".join(str(v) for v in self.zoom.layers)
        return tag

    def describe(self) -> dict[str, Any]:
        """What a run records with its results (the keys an earlier run's log holds, so that
        it resumes)."""
        beams = 1
        mitigation: dict[str, Any] = {}
        if self.mitigation != "none":
            mitigation = hal.get_mitigation(self.mitigation).describe(**self.mitigation_options)
            mitigation.pop("mitigation")
            beams = mitigation.get("num_beams", 1)
        f = self.focus if self.pruned else None
        extra: dict[str, Any] = {}
        options = {k: v for k, v in f.options.items() if k != "guide"} if f else {}
        if options:
            extra["pruner_options"] = options
        if f and f.positions != FocusConfig.positions:  # earlier logs, which resume, lack it
            extra["positions"] = f.positions
        if self.guide is not None:
            extra["guide"] = self.guide
        if self.zoom is not None:
            extra |= {
                "zoom": self.zoom.route,
                "zoom_options": self.zoom.to_json(),
                "zoom_calibration": self.zoom_calibration,
            }
        return {
            "pruner": f.pruner if f else None,
            "keep": f.keep if f else 1.0,
            "layer": f.layer if f else None,
            "query_rows": f.query_rows if f else None,
            "reduce": f.reduce if f else None,
            "budget": f.budget if f else None,
            "mitigate": self.mitigation,
            "mitigation_parameters": mitigation,
            "decoding": f"{'beam search' if beams > 1 else 'greedy'}, num_beams={beams}, "
            f"do_sample=False, max_new_tokens={self.max_new_tokens}",
            **extra,
        }

    # --- running it -------------------------------------------------------------------------
    @contextlib.contextmanager
    def wrapped(
        self, model: nn.Module, *, guide: nn.Module | None = None, **run_options: Any
    ) -> Iterator[Any]:
        """The setting's pruning attached to ``model`` while the block runs; yields the
        :class:`~vlm_focus.FocusHandle` (``None`` unpruned). ``guide`` is the guide model of
        a pruner that ``needs_guide``; ``run_options`` are pruner options that only exist at
        run time (e.g. ``guided``'s ``guide_inputs`` callback)."""
        if not self.pruned:
            yield None
            return
        options = {**self.focus.options, **run_options}
        if self.needs_guide:
            if guide is None:
                raise ValueError(
                    f"pruner {self.focus.pruner!r} needs a guide model (a small VLM; the "
                    "command lines take --guide PATH or embedded)"
                )
            options["guide"] = guide
        config = dataclasses.replace(self.focus, options=options)
        handle = wrap(model, config=config)
        try:
            yield handle
        finally:
            handle.remove()

    def generate(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        *,
        handle: FocusHandle | None = None,
        guide_inputs: dict[str, Any] | None = None,
        generic_inputs: dict[str, Any] | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """Greedy ``generate()`` of ``inputs`` under this setting's mitigation, inside the
        block of :meth:`wrapped` (``handle``); returns the sequences. A pruner that
        ``needs_guide`` generates through its guide (``guide_inputs``: the same rows built by
        the guide's processor); ``instruction_contrast`` needs ``generic_inputs`` (the rows
        with the mitigation's ``generic_prompt``)."""
        kwargs = {"max_new_tokens": self.max_new_tokens, **generate_kwargs}
        if self.needs_guide:
            if handle is None or guide_inputs is None:
                raise ValueError(f"pruner {self.focus.pruner!r} needs the handle and guide_inputs")
            return guided_generate(
                handle, inputs, guide_inputs, do_sample=False, **kwargs
            ).sequences
        with self.mitigated(model, inputs, generic_inputs=generic_inputs) as active:
            kwargs.update(active.generate_kwargs(kwargs.pop("logits_processor", ())))
            return greedy_generate(model, inputs, **kwargs)[0]

    def mitigated(
        self,
        model: nn.Module,
        inputs: dict[str, Any] | None = None,
        *,
        generic_inputs: dict[str, Any] | None = None,
    ) -> contextlib.AbstractContextManager[hal.Active]:
        """The setting's mitigation on ``model`` while the block runs (its parameters over
        the registry's defaults); yields what :func:`vlm_focus.hallucination.mitigate` does."""
        return hal.mitigate(
            model,
            self.mitigation,
            inputs,
            generic_inputs=generic_inputs,
            **self.mitigation_options,
        )

    @property
    def generic_prompt(self) -> str | None:
        """The prompt the mitigation contrasts against, if it does (build its inputs from the
        same images for :meth:`generate`'s ``generic_inputs``)."""
        if self.mitigation == "none":
            return None
        return hal.get_mitigation(self.mitigation).generic_prompt


def focus_config(source: Any, **overrides: Any) -> FocusConfig:
    """The :class:`~vlm_focus.FocusConfig` of an options object that inherits its fields (a
    command's options: ``pruner``, ``keep``, ..., ``options``), with ``overrides``."""
    names = [f.name for f in dataclasses.fields(FocusConfig) if hasattr(source, f.name)]
    return FocusConfig(**{**{n: getattr(source, n) for n in names}, **overrides})


def _how_it_drives(pruner: type[Pruner]) -> str:
    if pruner.needs_guide:
        return "it runs generate() itself, through its guide"
    return "it drives decoding itself, picking new visual keys at every step"


__all__ = ["RunSetting", "focus_config"]
