"""The mitigations by name: one registry, one set of default parameters, one way to run them.

The evaluations, the demo and the integrations choose a mitigation by its name here and run it
with :func:`mitigate`, so that every entry point runs the same method with the same settings::

    from vlm_focus import hallucination as hal

    with hal.mitigate(model, "visual_beam", inputs) as active:
        model.generate(**inputs, **active.generate_kwargs(), max_new_tokens=32)

Each :class:`Mitigation` records the public function that builds it, its default parameters
(the only defaults the entry points use), the ``generate()`` arguments the method needs
(``visual_beam``'s beam width) and whether it contrasts against a generic prompt
(``instruction_contrast``).

Defaults (the settings of ``benchmarks/results/grounding_quality.md``):

- ``attention_reweight``: ``strength=1.0``, every layer, the top ``ratio=0.25`` of visual tokens;
- ``visual_beam``: ``weight=1.0``, every layer, ``num_beams=3``;
- ``instruction_contrast``: ``alpha=1.0``, ``beta=0.1``, ``ratio=0.5``, every layer, against
  :data:`vlm_focus.grounding.GENERIC_PROMPT`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._beam import visual_beam
from ._contrast import instruction_contrast
from ._reweight import attention_reweight

NONE = "none"
#: Names the mitigations had before 0.1.0, never given to another method: an older run's record
#: that names one cannot be read as a different mitigation.
RETIRED = ("reweight", "beam", "contrast")


@dataclass(frozen=True)
class Mitigation:
    """A registered mitigation.

    Attributes:
        name: the registry name (a lowercase identifier).
        build: the public function that returns its context manager, called as
            ``build(model, **params)`` or, with ``generic_prompt``, as
            ``build(model, inputs, generic_inputs, **params)``.
        defaults: its parameters and their defaults, the one set every entry point uses.
        generate: ``generate()`` arguments the method needs (e.g. ``num_beams``).
        processor: True when the context manager is a ``LogitsProcessor`` for ``generate()``.
        generic_prompt: for a contrast against a generic prompt: that prompt (the caller builds
            ``generic_inputs`` from the same images with it).
        summary: one line on what it does.
    """

    name: str
    build: Callable[..., Any]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    generate: Mapping[str, Any] = field(default_factory=dict)
    processor: bool = False
    generic_prompt: str | None = None
    summary: str = ""

    def parameters(self, **overrides: Any) -> dict[str, Any]:
        """The defaults with ``overrides``; an unknown parameter raises ``ValueError``."""
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown parameter {', '.join(map(repr, unknown))} for mitigation "
                f"{self.name!r}; it takes: {', '.join(self.defaults) or 'none'}"
            )
        return {**self.defaults, **overrides}

    def describe(self, **overrides: Any) -> dict[str, Any]:
        """What a run records: the name, the parameters and the ``generate()`` arguments."""
        return {"mitigation": self.name, **self.parameters(**overrides), **self.generate}


_MITIGATIONS: dict[str, Mitigation] = {}


def register_mitigation(mitigation: Mitigation, *, replace: bool = False) -> Mitigation:
    """Register ``mitigation`` under its name (a lowercase identifier, neither ``"none"`` nor
    a :data:`RETIRED` name)."""
    if not isinstance(mitigation, Mitigation):
        raise TypeError(f"register_mitigation expects a Mitigation, got {mitigation!r}")
    name = mitigation.name
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"mitigation name {name!r} must be a lowercase identifier")
    if name == NONE or name in RETIRED:
        raise ValueError(f"mitigation name {name!r} is reserved")
    if name in _MITIGATIONS and not replace:
        raise ValueError(f"a mitigation named {name!r} is already registered (replace=True)")
    if not callable(mitigation.build):
        raise TypeError(f"mitigation {name!r}: build must be callable")
    _MITIGATIONS[name] = mitigation
    return mitigation


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


def get_mitigation(name: str) -> Mitigation:
    """The registered :class:`Mitigation`; an unknown name raises ``ValueError``."""
    canonical = mitigation_name(name)
    if canonical == NONE:
        raise ValueError("'none' is no mitigation; call mitigate(model, 'none') or skip it")
    return _MITIGATIONS[canonical]


class Active:
    """What :func:`mitigate` yields: the running method and the ``generate()`` arguments it
    needs."""

    def __init__(self, mitigation: Mitigation | None, handle: Any = None) -> None:
        self.mitigation = mitigation
        self.handle = handle  # the method's context manager (a LogitsProcessor or hooks)

    @property
    def name(self) -> str:
        return NONE if self.mitigation is None else self.mitigation.name

    def generate_kwargs(self, logits_processor: Sequence[Any] = ()) -> dict[str, Any]:
        """Arguments for ``generate()``: the method's own (``num_beams``) and
        ``logits_processor`` = the given processors followed by the method's."""
        out: dict[str, Any] = dict(self.mitigation.generate) if self.mitigation else {}
        processors = list(logits_processor)
        if self.mitigation is not None and self.mitigation.processor:
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
    """Run the mitigation ``name`` (with its default parameters, ``params`` overriding) while
    the block runs; yields an :class:`Active` whose :meth:`~Active.generate_kwargs` go to
    ``generate()``. ``"none"`` (or ``None``) runs nothing.

    ``instruction_contrast`` needs the prompt's ``inputs`` and ``generic_inputs``: the same
    images under the mitigation's ``generic_prompt``."""
    canonical = mitigation_name(name)
    if canonical == NONE:
        yield Active(None)
        return
    mitigation = _MITIGATIONS[canonical]
    kwargs = mitigation.parameters(**params)
    if mitigation.generic_prompt is not None:
        if inputs is None or generic_inputs is None:
            raise ValueError(
                f"mitigation {canonical!r} needs inputs and generic_inputs (the same images "
                f"under the prompt {mitigation.generic_prompt!r})"
            )
        handle = mitigation.build(model, inputs, generic_inputs, **kwargs)
    else:
        handle = mitigation.build(model, **kwargs)
    with handle:
        yield Active(mitigation, handle)


def _generic_prompt() -> str:
    from ..grounding import GENERIC_PROMPT

    return GENERIC_PROMPT


for _mitigation in (
    Mitigation(
        "attention_reweight",
        attention_reweight,
        defaults={"strength": 1.0, "layers": None, "ratio": 0.25},
        summary="raise the attention logits of the instruction-relevant visual tokens",
    ),
    Mitigation(
        "visual_beam",
        visual_beam,
        defaults={"weight": 1.0, "layers": None},
        generate={"num_beams": 3},
        processor=True,
        summary="beam search re-ranked by the visual attention of each candidate's tokens",
    ),
    Mitigation(
        "instruction_contrast",
        instruction_contrast,
        defaults={"alpha": 1.0, "beta": 0.1, "ratio": 0.5, "layers": None},
        processor=True,
        generic_prompt=_generic_prompt(),
        summary="contrast against a run that sees only the instruction-irrelevant visual tokens",
    ),
):
    register_mitigation(_mitigation)
