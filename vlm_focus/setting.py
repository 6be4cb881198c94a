"""One run setting: what a run does to the model, its tag, its description, and the one place
that runs it.

A :class:`RunSetting` holds a :class:`~vlm_focus.FocusConfig` (or ``None``: unpruned), a
mitigation from :mod:`vlm_focus.hallucination`, an optional :class:`~vlm_focus.zoom.ZoomOptions`
and where the guide model came from. The commands, the evaluations, the demo and the lmms-eval
plugin build one and call :meth:`RunSetting.answer` (or, to keep the pruning on a model that
someone else drives, :meth:`RunSetting.wrapped` and :meth:`RunSetting.mitigated`): it attaches
the pruning, builds the guide model's and the mitigation's inputs, applies the mitigation or
the zoom, and counts and times what it did. A setting therefore means the same everywhere and
is written the same way in file names and logs (:attr:`RunSetting.tag`,
:meth:`RunSetting.describe`).

Which combinations run is read from the pruner's class, not its name: a pruner that
``needs_guide`` generates through its guide, and one that ``drives_decoding`` (it drives
``generate()`` itself, or picks new visual keys at every step) combines with no mitigation and
no zoom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from . import hallucination as hal
from . import zoom as zm
from .api import FocusHandle, wrap
from .asset_paths import guide_model_path
from .config import FocusConfig, keep_count, keeps_everything
from .core.pruner import Pruner
from .core.registry import get_pruner, pruners_with
from .generation import greedy_generate
from .loading import (
    decode_new_tokens,
    is_video,
    load_image,
    load_model,
    model_inputs,
    visual_counts,
)
from .pruners import guided_generate
from .timing import PairedTiming, PrefillClock, prefill_fn, pruned_prefill_timing, sync_of
from .trace import FocusTrace
from .zoom import ZoomOptions

#: FocusConfig's options that a tag writes, with their letter, when away from their defaults.
_TAG_LETTERS = tuple(
    (f.name, f.metadata["tag"]) for f in dataclasses.fields(FocusConfig) if "tag" in f.metadata
)
#: FocusConfig's options that a run's record holds only away from their defaults (earlier
#: logs, which resume, lack them); the record holds every other command-line option.
_RECORDED_WHEN_SET = tuple(
    f.name for f in dataclasses.fields(FocusConfig) if f.metadata.get("recorded") == "when_set"
)
_RECORDED = tuple(
    f.name
    for f in dataclasses.fields(FocusConfig)
    if f.metadata.get("cli", True) and f.name not in _RECORDED_WHEN_SET
)


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
            for name, value in self.mitigation_options.items():
                if not _recordable(value):
                    raise ValueError(
                        f"mitigation option {name}={type(value).__name__} cannot be recorded "
                        "with a run (a number, a string, a list of them or None); give a "
                        "tensor as the path of its torch.save file"
                    )
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
        for name in _RECORDED_WHEN_SET:
            if f and getattr(f, name) != getattr(FocusConfig, name):
                extra[name] = getattr(f, name)
        if self.guide is not None:
            extra["guide"] = self.guide
        if self.zoom is not None:
            extra |= {
                "zoom": self.zoom.route,
                "zoom_options": self.zoom.to_json(),
                "zoom_calibration": self.zoom_calibration,
            }
        recorded = {name: getattr(f, name) if f else None for name in _RECORDED}
        if f is None:
            recorded["keep"] = 1.0  # unpruned keeps every visual token
        return {
            **recorded,
            "mitigate": self.mitigation,
            "mitigation_parameters": mitigation,
            "decoding": f"{'beam search' if beams > 1 else 'greedy'}, num_beams={beams}, "
            f"do_sample=False, max_new_tokens={self.max_new_tokens}",
            **extra,
        }

    # --- running it -------------------------------------------------------------------------
    def plain(self) -> RunSetting:
        """The unpruned, unmitigated setting with this one's answer length (the baseline a
        pruned answer is compared with)."""
        return RunSetting(max_new_tokens=self.max_new_tokens)

    def answer(
        self,
        model: nn.Module,
        processor: Any,
        media: Sequence[Any] | Any,
        prompts: Sequence[str],
        *,
        inputs: dict[str, Any] | None = None,
        guide: Guide | None = None,
        zoom_focus: Sequence[str | None] | None = None,
        **generate_kwargs: Any,
    ) -> RunAnswer:
        """Answer ``prompts`` about ``media`` under this setting, greedily: the pruning attached
        for the call, then the mitigation, the zoom (:func:`vlm_focus.zoom.look_closer`) or
        the guide (a pruner that ``needs_guide``: ``guide`` is its model and processor, see
        :meth:`load_guide`).

        ``media`` is one image per prompt (PIL images or paths), or one video (an object
        with ``frames`` and ``metadata``, as :func:`~vlm_focus.loading.load_video` gives them)
        for one prompt. ``inputs``: the model's inputs of these rows when the caller already
        built them (else built here). ``zoom_focus``: each row's phrase whose attention picks
        the zoom's crop (default the prompt's content words). ``generate_kwargs`` go to every
        ``generate()`` call."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if inputs is None:
            inputs = model_inputs(model, processor, media, prompts)
        total = visual_counts(model, inputs)
        sync = sync_of(model)
        clock = PrefillClock(sync)
        processors = [clock, *generate_kwargs.pop("logits_processor", ())]
        kwargs = {"logits_processor": processors, **generate_kwargs}
        sequences, found = None, None
        with torch.no_grad(), self.wrapped(model, guide=guide) as handle:
            sync()
            start = time.perf_counter()
            if self.zoom is not None:
                if is_video(media):
                    raise ValueError("the zoom looks closer at images, not at a video")
                found = zm.look_closer(
                    model,
                    processor,
                    [load_image(i) for i in media],
                    prompts,
                    focus=zoom_focus,
                    config=self.zoom,
                    generate_kwargs=kwargs,
                )
            else:
                guide_inputs = generic = None
                if self.needs_guide:
                    guide_inputs = model_inputs(guide.model, guide.processor, media, prompts)
                if self.generic_prompt is not None:
                    mitigation = hal.get_mitigation(self.mitigation)
                    generic = model_inputs(
                        model, processor, media, mitigation.generic_prompts(prompts)
                    )
                sequences = self.generate(
                    model,
                    inputs,
                    handle=handle,
                    guide_inputs=guide_inputs,
                    generic_inputs=generic,
                    **kwargs,
                )
            sync()
            seconds = time.perf_counter() - start
        trace = handle.last_trace if handle is not None else None
        if found is not None:
            texts = [f.answer.strip() for f in found]
            # the plain view's visual tokens by keep's rule (a crop adds its own)
            kept = [keep_count(self.focus.keep, n) if self.pruned else n for n in total]
        else:
            texts = decode_new_tokens(processor, inputs, sequences)
            kept = [int(k) for k in trace.n_kept] if trace is not None else list(total)
        return RunAnswer(
            texts=texts,
            inputs=inputs,
            sequences=sequences,
            trace=trace,
            visual_kept=kept,
            visual_total=total,
            zoom=found,
            prefill_s=(clock.first or start + seconds) - start,
            seconds=seconds,
        )

    def prefill_timing(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        *,
        repeats: int = 5,
        answer: RunAnswer | None = None,
    ) -> PrefillTiming:
        """The first row's visual tokens kept and the prefill timed unpruned against pruned in
        ``repeats`` alternating pairs (:func:`vlm_focus.timing.pruned_prefill_timing`;
        ``None`` when nothing is pruned). The counts come from ``answer`` (this setting's
        :meth:`answer` of ``inputs``), else from one pruned prefill run here."""
        if answer is None:
            with self.wrapped(model) as handle:
                prefill_fn(model, inputs)()
            trace = handle.last_trace if handle is not None else None
            total = visual_counts(model, inputs)[0]
            kept = int(trace.n_kept[0]) if trace is not None else total
        else:
            trace, kept, total = answer.trace, answer.visual_kept[0], answer.visual_total[0]
        timing = pruned_prefill_timing(
            model, inputs, lambda: self.wrapped(model), kept, total, repeats
        )
        return PrefillTiming(kept, total, timing, trace)

    def load_guide(self, device: str) -> Guide | None:
        """The guide model and processor of a pruner that ``needs_guide``, from
        :attr:`guide` (``"embedded"``: the embedded guide model); ``None`` for any other
        setting."""
        if not self.needs_guide:
            return None
        if self.guide is None:
            raise ValueError(
                f"pruner {self.focus.pruner!r} needs guide=PATH_OR_HUB_ID (--guide, a small VLM)"
            )
        path = str(guide_model_path()) if self.guide == "embedded" else self.guide
        return Guide(*load_model(path, device=device))

    @contextlib.contextmanager
    def wrapped(
        self,
        model: nn.Module,
        *,
        guide: Guide | None = None,
        guide_rows: Callable[[], tuple[Sequence[Any], Sequence[str]]] | None = None,
    ) -> Iterator[FocusHandle | None]:
        """The setting's pruning attached to ``model`` while the block runs, for a caller whose
        ``generate()`` someone else drives (lmms-eval); yields the
        :class:`~vlm_focus.FocusHandle` (``None`` unpruned). ``guide`` is the guide model of
        a pruner that ``needs_guide``; ``guide_rows()``, when given, returns the images and
        prompts of the batch being prefilled, from which the guide's inputs are built."""
        if not self.pruned:
            yield None
            return
        options = dict(self.focus.options)
        if self.needs_guide:
            if guide is None:
                raise ValueError(
                    f"pruner {self.focus.pruner!r} needs a guide model (a small VLM; the "
                    "command lines take --guide PATH or embedded)"
                )
            options["guide"] = guide.model
            if guide_rows is not None:
                options["guide_inputs"] = lambda _inputs: model_inputs(
                    guide.model, guide.processor, *guide_rows()
                )
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
        with the mitigation's ``generic_prompt``). :meth:`answer` builds these itself."""
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
        """The prompt the mitigation contrasts against, if it does (:meth:`answer` builds its
        inputs from the same images)."""
        if self.mitigation == "none":
            return None
        return hal.get_mitigation(self.mitigation).generic_prompt


class Guide(NamedTuple):
    """The guide model of a pruner that ``needs_guide``, and its processor."""

    model: nn.Module
    processor: Any


@dataclass
class RunAnswer:
    """What :meth:`RunSetting.answer` did, per row of the batch.

    ``sequences`` are the prompt and new tokens ``[B, S + T]`` (``None`` with a zoom, whose
    passes keep their own); ``trace`` is the pruned run's (``None`` unpruned); ``visual_kept``
    / ``visual_total`` count each row's visual tokens; ``zoom`` holds the zoom's answers (with
    their crops and timings); ``prefill_s`` and ``seconds`` are the batch's wall seconds up to
    the first new token and in all (the setting's input building included, the pruning's
    attaching not)."""

    texts: list[str]
    inputs: dict[str, Any]
    sequences: torch.Tensor | None
    trace: FocusTrace | None
    visual_kept: list[int]
    visual_total: list[int]
    zoom: list[zm.ZoomAnswer] | None
    prefill_s: float
    seconds: float


class PrefillTiming(NamedTuple):
    """What :meth:`RunSetting.prefill_timing` measured: the first row's visual tokens kept of
    its total, the paired timing (``None``: nothing pruned) and the pruned run's trace."""

    visual_kept: int
    visual_total: int
    timing: PairedTiming | None
    trace: FocusTrace | None


def _recordable(value: Any) -> bool:
    """A value a run's record (JSON) and tag hold as they are."""
    if isinstance(value, list | tuple):
        return all(_recordable(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _how_it_drives(pruner: type[Pruner]) -> str:
    if pruner.needs_guide:
        return "it runs generate() itself, through its guide"
    return "it drives decoding itself, picking new visual keys at every step"


__all__ = [
    "Guide",
    "PrefillTiming",
    "RunAnswer",
    "RunSetting",
]
