"""The mitigations by name: one registry, one set of typed options, one way to run them.

A mitigation registers the way a pruner does: a :class:`Mitigation` subclass that sets
``name``, ``summary`` and ``Options`` (a dataclass whose fields carry their ``help`` and whose
``__post_init__`` checks the values), under the checking decorator :func:`register_mitigation`
in its own module. The evaluations, the demo and the integrations choose one by its name and run
it with :func:`mitigate`, so every entry point runs the same method with the same defaults::

    from vlm_focus import hallucination as hal

    hal.mitigation_options("visual_beam")   # each option's name, type, default and help
    with hal.mitigate(model, "visual_beam", inputs) as active:
        model.generate(**inputs, **active.generate_kwargs(), max_new_tokens=32)

Defaults (the settings of ``benchmarks/results/grounding_quality.md``), as the options
dataclasses declare them:

- ``attention_reweight``: ``strength=1.0``, every layer, the top ``ratio=0.25`` of visual tokens;
- ``visual_beam``: ``weight=1.0``, every layer, ``num_beams=3``;
- ``instruction_contrast``: ``alpha=1.0``, ``beta=0.1``, ``ratio=0.5``, every layer, against
  :data:`vlm_focus.grounding.GENERIC_PROMPT`;
- ``visual_contrast``: ``branch="noise"`` at ``noise_step=500``, ``weight=1.0``, ``growth=0.0``,
  ``beta=0.1``, no centring.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from torch import nn
from transformers import LogitsProcessor

from ..core.options import OptionInfo, options, options_markdown
from ..core.pruner import NoOptions  # the options of a method without options of its own

NONE = "none"
#: Names the mitigations had before 0.1.0, never given to another method: an older run's record
#: that names one cannot be read as a different mitigation.
RETIRED = ("reweight", "beam", "contrast")

_M = TypeVar("_M", bound="Mitigation")


class Mitigation:
    """Base class of a mitigation: a context manager that steers ``generate()`` while active
    (hooks, or a ``LogitsProcessor`` handed to ``generate()``) and is exactly undone on exit.

    A subclass sets the class attributes below, implements :meth:`attach` and :meth:`remove`,
    and is built as ``cls(model, options)``; with ``reads_inputs`` as
    ``cls(model, inputs, options)``, with ``generic_prompt`` as
    ``cls(model, inputs, generic_inputs, options)``, ``options`` an instance of ``Options``.
    A subclass that is a ``LogitsProcessor`` goes into ``generate()``'s ``logits_processor``.
    """

    #: The registry name (a lowercase identifier).
    name: ClassVar[str] = ""
    #: Its options: a dataclass with ``help`` metadata, checked in ``__post_init__``.
    Options: ClassVar[type] = NoOptions
    #: One line for ``vlm-focus mitigations``: what it does.
    summary: ClassVar[str] = ""
    #: ``generate()`` arguments the method needs (e.g. ``num_beams``).
    generate_args: ClassVar[Mapping[str, Any]] = {}
    #: For a contrast against a generic prompt: that prompt (the caller builds
    #: ``generic_inputs`` from the same images with it).
    generic_prompt: ClassVar[str | None] = None
    #: The method reads the prompt's ``inputs`` (the processor's output of the rows that
    #: ``generate()`` runs), e.g. to run the same prompt with another image.
    reads_inputs: ClassVar[bool] = False

    def attach(self) -> None:
        """Start steering (install hooks)."""

    def remove(self) -> None:
        """Stop steering: the model is exactly as before."""

    def __enter__(self: _M) -> _M:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @classmethod
    def generic_prompts(cls, prompts: Sequence[str]) -> list[str]:
        """The ``generic_prompt`` for each of ``prompts`` (the same one unless a method keeps
        part of each prompt)."""
        return [cls.generic_prompt] * len(prompts)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls.Options)]

    @classmethod
    def options(cls, **overrides: Any) -> Any:
        """The ``Options`` with ``overrides`` over the defaults, checked by the dataclass; an
        unknown parameter raises ``ValueError`` naming what the mitigation takes."""
        unknown = sorted(set(overrides) - set(cls.option_names()))
        if unknown:
            raise ValueError(
                f"unknown parameter {', '.join(map(repr, unknown))} for mitigation "
                f"{cls.name!r}; it takes: {', '.join(cls.option_names()) or 'none'}"
            )
        return cls.Options(**overrides)

    @classmethod
    def parameters(cls, **overrides: Any) -> dict[str, Any]:
        """Every option's value, the defaults with ``overrides`` (checked), in field order."""
        chosen = cls.options(**overrides)
        return {f.name: getattr(chosen, f.name) for f in dataclasses.fields(chosen)}

    @classmethod
    def describe(cls, **overrides: Any) -> dict[str, Any]:
        """What a run records: the name, the parameters and the ``generate()`` arguments."""
        return {"mitigation": cls.name, **cls.parameters(**overrides), **cls.generate_args}


_MITIGATIONS: dict[str, type[Mitigation]] = {}


def check_numbers(options: Any, *names: str) -> None:
    """``TypeError`` naming the first of the ``names`` fields of ``options`` that is not a
    number (a bool is not one)."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {value!r}")


def register_mitigation(cls: type[_M], *, replace: bool = False) -> type[_M]:
    """Register a :class:`Mitigation` subclass under ``cls.name`` (a lowercase identifier,
    neither ``"none"`` nor a :data:`RETIRED` name); ``@register_mitigation`` on the class."""
    if not (isinstance(cls, type) and issubclass(cls, Mitigation)):
        raise TypeError(f"register_mitigation expects a Mitigation subclass, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"mitigation name {name!r} must be a lowercase identifier")
    if name == NONE or name in RETIRED:
        raise ValueError(f"mitigation name {name!r} is reserved")
    if name in _MITIGATIONS and not replace:
        raise ValueError(f"a mitigation named {name!r} is already registered (replace=True)")
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"mitigation {name!r}: Options must be a dataclass, got {cls.Options!r}")
    _MITIGATIONS[name] = cls
    return cls


def mitigations() -> list[str]:
    """Names of the registered mitigations."""
    return sorted(_MITIGATIONS)


def mitigation_choices() -> tuple[str, ...]:
    """``"none"`` and every registered name: the values a ``--mitigate`` option takes."""
    return (NONE, *mitigations())


def mitigation_name(name: str | None) -> str:
    """The registry name for ``name``: ``"none"`` for ``None``/``"none"``; an unknown name
    raises ``ValueError`` listing the allowed ones."""
    if name is None or name == NONE:
        return NONE
    if not isinstance(name, str) or name not in _MITIGATIONS:
        raise ValueError(f"unknown mitigation {name!r}; allowed: {', '.join(mitigation_choices())}")
    return name


def get_mitigation(name: str) -> type[Mitigation]:
    """The registered :class:`Mitigation` class; an unknown name raises ``ValueError``."""
    canonical = mitigation_name(name)
    if canonical == NONE:
        raise ValueError("'none' is no mitigation; call mitigate(model, 'none') or skip it")
    return _MITIGATIONS[canonical]


def mitigation_options(name: str) -> list[OptionInfo]:
    """The options of mitigation ``name`` (its ``Options`` dataclass), each with its name,
    type, default and help, in field order: the keywords of its public function, of
    :func:`mitigate` and of ``RunSetting(mitigation_options=...)``."""
    return options(get_mitigation(name).Options)


def mitigation_options_markdown() -> str:
    """A table of every option of every registered mitigation, as the docs print it."""
    rows = [(name, info) for name in mitigations() for info in mitigation_options(name)]
    return options_markdown(rows, first="mitigation")


class Active:
    """What :func:`mitigate` yields: the running method and the ``generate()`` arguments it
    needs."""

    def __init__(self, mitigation: type[Mitigation] | None, handle: Any = None) -> None:
        self.mitigation = mitigation
        self.handle = handle  # the running Mitigation (a LogitsProcessor or hooks)

    @property
    def name(self) -> str:
        return NONE if self.mitigation is None else self.mitigation.name

    def generate_kwargs(self, logits_processor: Sequence[Any] = ()) -> dict[str, Any]:
        """Arguments for ``generate()``: the method's own (``num_beams``) and
        ``logits_processor`` = the given processors followed by the method's."""
        out: dict[str, Any] = dict(self.mitigation.generate_args) if self.mitigation else {}
        processors = list(logits_processor)
        if isinstance(self.handle, LogitsProcessor):
            processors.append(self.handle)
        if processors:
            out["logits_processor"] = processors
        return out


@contextmanager
def mitigate(
    model: nn.Module,
    name: str | None,
    inputs: Mapping[str, Any] | None = None,
    *,
    generic_inputs: Mapping[str, Any] | None = None,
    **params: Any,
) -> Iterator[Active]:
    """Run the mitigation ``name`` (with its default options, ``params`` overriding) while
    the block runs; yields an :class:`Active` whose :meth:`~Active.generate_kwargs` go to
    ``generate()``. ``"none"`` (or ``None``) runs nothing.

    A method that ``reads_inputs`` (``visual_contrast``) needs the prompt's ``inputs``, one
    with a ``generic_prompt`` (``instruction_contrast``) ``inputs`` and ``generic_inputs``: the
    same images under that prompt."""
    canonical = mitigation_name(name)
    if canonical == NONE:
        yield Active(None)
        return
    mitigation = _MITIGATIONS[canonical]
    chosen = mitigation.options(**params)
    if mitigation.generic_prompt is not None:
        if inputs is None or generic_inputs is None:
            raise ValueError(
                f"mitigation {canonical!r} needs inputs and generic_inputs (the same images "
                f"under the prompt {mitigation.generic_prompt!r})"
            )
        handle = mitigation(model, inputs, generic_inputs, chosen)
    elif mitigation.reads_inputs:
        if inputs is None:
            raise ValueError(
                f"mitigation {canonical!r} needs the prompt's inputs (the processor's output "
                "for the rows that generate() runs): mitigate(model, name, inputs)"
            )
        handle = mitigation(model, inputs, chosen)
    else:
        handle = mitigation(model, chosen)
    with handle:
        yield Active(mitigation, handle)
