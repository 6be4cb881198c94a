"""Batched greedy generation for the evaluations: optional pruning (``vf.wrap``), an optional
mitigation from ``vlm_focus.hallucination`` or an optional attention-guided zoom
(:func:`vlm_focus.zoom.look_closer`), and per-batch timing of prefill and decoding."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor

from .. import hallucination as hal
from .. import zoom as zm
from ..config import FocusConfig, keep_count, keeps_everything, read_keep
from ..loading import build_inputs, load_image
from ..model_adapters import get_adapter

MITIGATIONS = hal.mitigation_choices()  # "none" and the registry's names
ZOOMS = ("never", "always", "adaptive")


class _PrefillClock(LogitsProcessor):
    """Notes when ``generate()`` first asks for the next token: the end of prefill."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        if self.first is None:
            self.sync()
            self.first = time.perf_counter()
        return scores


@dataclass
class Setting:
    """What one evaluation run does to the model; recorded with its results.

    The pruning fields mean what they mean in :class:`~vlm_focus.FocusConfig` (and default to
    its defaults); ``mitigate`` is a name of :func:`vlm_focus.hallucination.mitigations`, run
    with the registry's default parameters. ``zoom`` (``never``, ``always`` or ``adaptive``
    below ``zoom_threshold``) answers through :func:`vlm_focus.zoom.look_closer`, with the map
    of ``zoom_layers`` (default all); ``zoom_calibration`` only records where the threshold
    came from."""

    pruner: str | None = None
    keep: float | int = FocusConfig.keep
    layer: int = FocusConfig.layer
    query_rows: str = FocusConfig.query_rows
    reduce: str = FocusConfig.reduce
    budget: str = FocusConfig.budget
    options: dict[str, Any] = field(default_factory=dict)  # the pruner's own options
    mitigate: str = "none"
    max_new_tokens: int = 16
    zoom: str = "never"
    zoom_threshold: float | None = None
    zoom_layers: list[int] | None = None
    zoom_calibration: str | None = None

    def __post_init__(self) -> None:
        self.mitigate = hal.mitigation_name(self.mitigate)
        if self.zoom not in ZOOMS:
            raise ValueError(f"zoom={self.zoom!r}; allowed: {', '.join(ZOOMS)}")
        if self.zoom == "never":
            if self.zoom_threshold is not None or self.zoom_layers is not None:
                raise ValueError("zoom_threshold and zoom_layers only apply with a zoom")
        else:
            self.zoom_options()  # ZoomOptions checks the threshold (adaptive needs one, in [0, 1])
            if self.mitigate != "none":
                raise ValueError(
                    f"--zoom {self.zoom} does not combine with --mitigate {self.mitigate}: the "
                    "mitigations steer one generate() call, the zoom makes two; use one of them"
                )
            if self.pruned and self.pruner in ("guided", "fixation"):
                raise ValueError(
                    f"--zoom {self.zoom} does not combine with --pruner {self.pruner} (it drives "
                    "or follows decoding itself); use another pruner, or no zoom"
                )
        if self.pruner is not None:
            self.keep = read_keep(self.keep)
        if self.pruned and self.mitigate != "none" and self.pruner in ("guided", "fixation"):
            # the mitigations run on any pruned model, but guided pruning drives generate()
            # itself and fixation attends to new visual columns at every decoding step
            raise ValueError(
                f"--mitigate {self.mitigate} does not combine with --pruner {self.pruner}; "
                "use another pruner, or no mitigation"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_options(cls, options: Any, **overrides: Any) -> Setting:
        """The setting of a command's options (a :class:`~vlm_focus.eval.common.PruneOptions`)."""
        names = ("pruner", "keep", "layer", "query_rows", "reduce", "budget", "mitigate")
        values = {n: getattr(options, n) for n in names if getattr(options, n) is not None}
        if options.pruner is not None:
            values["options"] = options.pruner_options(options.pruner)
        return cls(**{**values, **overrides})

    @property
    def pruned(self) -> bool:
        """A pruner runs and keeps less than every visual token (``keep=1.0`` is unpruned)."""
        return self.pruner is not None and not keeps_everything(self.keep)

    @property
    def tag(self) -> str:
        """File-name tag, e.g. ``unpruned`` or ``fastv-k0.25-l2-qtext``; options at
        FocusConfig's defaults are left out, and a mitigation is appended."""
        tag = f"{self.pruner}-k{self.keep:g}-l{self.layer}" if self.pruned else "unpruned"
        if self.pruned:
            for name, short in (("query_rows", "q"), ("reduce", "r"), ("budget", "b")):
                value = getattr(self, name)
                if value != getattr(FocusConfig, name):
                    tag += f"-{short}{value}"
            for name, value in sorted(self.options.items()):
                tag += "-" + re.sub(r"[^A-Za-z0-9._]+", "_", f"{name}_{value}").strip("_")
        if self.mitigate != "none":
            tag += f"-{self.mitigate}"
        if self.zoom != "never":
            tag += f"-zoom_{self.zoom}"
            if self.zoom == "adaptive":
                tag += f"-t{self.zoom_threshold:.6g}"
            if self.zoom_layers is not None:
                tag += "-zl" + ".".join(str(v) for v in self.zoom_layers)
        return tag

    @property
    def zooms(self) -> bool:
        return self.zoom != "never"

    def zoom_options(self) -> zm.ZoomOptions:
        """The :class:`~vlm_focus.zoom.ZoomOptions` of this setting (the zoom's defaults
        otherwise)."""
        return zm.ZoomOptions(
            route=self.zoom if self.zoom != "never" else "always",
            threshold=self.zoom_threshold,
            layers=self.zoom_layers,
            max_new_tokens=self.max_new_tokens,
        )

    def describe(self) -> dict[str, Any]:
        if self.mitigate == "none":
            mitigation: dict[str, Any] = {}
            beams = 1
        else:
            mitigation = hal.get_mitigation(self.mitigate).describe()
            mitigation.pop("mitigation")
            beams = mitigation.get("num_beams", 1)
        # an unzoomed setting records no zoom keys (and one without pruner options no options
        # key), so its earlier logs still resume
        extra: dict[str, Any] = {}
        if self.pruned and self.options:
            extra["pruner_options"] = dict(self.options)
        if self.zooms:
            extra |= {
                "zoom": self.zoom,
                "zoom_options": self.zoom_options().to_json(),
                "zoom_calibration": self.zoom_calibration,
            }
        return {
            "pruner": self.pruner if self.pruned else None,
            "keep": self.keep if self.pruned else 1.0,
            "layer": self.layer if self.pruned else None,
            "query_rows": self.query_rows if self.pruned else None,
            "reduce": self.reduce if self.pruned else None,
            "budget": self.budget if self.pruned else None,
            "mitigate": self.mitigate,
            "mitigation_parameters": mitigation,
            "decoding": f"{'beam search' if beams > 1 else 'greedy'}, num_beams={beams}, "
            f"do_sample=False, max_new_tokens={self.max_new_tokens}",
            **extra,
        }


class Generator:
    """Answers ``(image, prompt)`` rows with one model under one :class:`Setting`.

    ``guide``/``guide_processor`` are the small model for the ``guided`` pruner.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        setting: Setting,
        *,
        guide: torch.nn.Module | None = None,
        guide_processor: Any = None,
    ) -> None:
        self.model, self.processor, self.setting = model, processor, setting
        self.adapter = get_adapter(model)
        self.guide, self.guide_processor = guide, guide_processor
        if setting.pruned and setting.pruner == "guided" and guide is None:
            raise ValueError("pruner 'guided' needs a guide model (--guide PATH)")
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def inputs(self, images: list, prompts: list[str], processor: Any = None) -> dict:
        processor = processor or self.processor
        try:
            inputs = build_inputs(processor, [load_image(i) for i in images], prompts)
        except (TypeError, AttributeError) as err:
            raise ValueError(
                f"the processor could not build image inputs ({err}); the evaluations need a "
                "vision-language model whose processor takes images"
            ) from err
        return {k: v.to(self.device) if hasattr(v, "to") else v for k, v in inputs.items()}

    def visual_counts(self, inputs: dict) -> list[int]:
        """Visual tokens per row; ``ValueError`` when a row has none (no image in the inputs)."""
        visual = self.adapter.visual_mask(self.model, inputs["input_ids"])
        mask = inputs.get("attention_mask")
        if mask is not None:
            visual = visual & mask.bool()
        counts = visual.sum(1).tolist()
        if min(counts) == 0:
            raise ValueError(
                "the model's inputs hold no image tokens (check that the processor inserts the "
                "image placeholder: a vision-language model and its own processor are needed)"
            )
        return counts

    def __call__(
        self, images: list, prompts: list[str], focus: list[str | None] | None = None
    ) -> tuple[list[str], list[dict]]:
        """Answers and per-row facts: visual tokens kept/total, new tokens, and the batch's
        prefill and generate seconds divided evenly over its rows.

        With a zoom, ``focus`` is each row's phrase whose attention picks the crop (POPE: the
        queried category; default the question's content words), and each row also records
        ``routed``, ``zoomed``, ``confidence``, ``plain_answer``, ``crops`` (``[x, y, w, h]``
        in the image's pixels) and ``zoom_s`` (the seconds of each phase); ``prefill_s`` is
        then the first ``generate()`` call's prefill and ``generate_s`` the row's share of
        every pass."""
        s = self.setting
        inputs = self.inputs(images, prompts)
        n_visual = self.visual_counts(inputs)
        clock = _PrefillClock(self.sync)
        gen: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens, do_sample=False, logits_processor=[clock]
        )
        handle = None
        with torch.no_grad():
            if s.pruned:
                import vlm_focus as vf

                options = dict(s.options)
                if s.pruner == "guided":
                    options["guide"] = self.guide
                handle = vf.wrap(
                    self.model,
                    pruner=s.pruner,
                    keep=s.keep,
                    layer=s.layer,
                    query_rows=s.query_rows,
                    reduce=s.reduce,
                    budget=s.budget,
                    **options,
                )
            try:
                self.sync()
                start = time.perf_counter()
                if s.zooms:
                    found = self._zoom(images, prompts, focus, clock)
                else:
                    sequences = self._generate(inputs, images, prompts, gen, handle)
                self.sync()
                total = time.perf_counter() - start
            finally:
                if handle is not None:
                    handle.remove()
        if s.zooms:
            return self._zoom_rows(found, n_visual, clock, start, total)
        texts = self.decode(inputs, sequences)
        kept = handle.last_trace.n_kept if handle is not None else n_visual
        prefill = (clock.first or start + total) - start
        new_tokens = self.count_new(inputs, sequences)
        batch = len(texts)
        rows = [
            {
                "visual_kept": int(kept[b]),
                "visual_total": int(n_visual[b]),
                "new_tokens": int(new_tokens[b]),
                "prefill_s": prefill / batch,
                "generate_s": total / batch,
            }
            for b in range(batch)
        ]
        return texts, rows

    def _zoom(self, images, prompts, focus, clock) -> list:
        """:func:`vlm_focus.zoom.look_closer` on the batch (inside the pruning handle, if any:
        both passes then run pruned)."""
        found = zm.look_closer(
            self.model,
            self.processor,
            [load_image(i) for i in images],
            list(prompts),
            focus=focus,
            config=self.setting.zoom_options(),
            generate_kwargs={"logits_processor": [clock]},
        )
        return found

    def _zoom_rows(self, found, n_visual, clock, start, total) -> tuple[list[str], list[dict]]:
        s = self.setting
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        batch = len(found)
        prefill = (clock.first or start + total) - start
        texts, rows = [], []
        for b, f in enumerate(found):
            texts.append(f.answer.strip())
            record = f.to_json()
            rows.append(
                {
                    # the plain view's visual tokens by keep's rule (a crop adds its own)
                    "visual_kept": keep_count(s.keep, n_visual[b]) if s.pruned else n_visual[b],
                    "visual_total": int(n_visual[b]),
                    # the answer's tokens (the zoomed passes' sequences are not kept)
                    "new_tokens": len(tokenizer(f.answer, add_special_tokens=False).input_ids),
                    "prefill_s": prefill / batch,
                    "generate_s": total / batch,
                    "routed": f.routed,
                    "zoomed": f.zoomed,
                    "confidence": f.confidence,
                    "plain_answer": f.plain_answer,
                    "zoom_mode": f.mode,
                    "crops": record["crops"],
                    "zoom_s": record["seconds"],
                }
            )
        return texts, rows

    def _generate(self, inputs, images, prompts, gen, handle) -> torch.Tensor:
        s, model = self.setting, self.model
        if handle is not None and s.pruner == "guided":
            from ..pruners import guided_generate

            guide_inputs = self.inputs(images, prompts, self.guide_processor)
            return guided_generate(handle, inputs, guide_inputs, **gen).sequences
        generic = None
        if s.mitigate != "none":
            prompt = hal.get_mitigation(s.mitigate).generic_prompt
            if prompt is not None:
                generic = self.inputs(images, [prompt] * len(prompts))
        with hal.mitigate(model, s.mitigate, inputs, generic_inputs=generic) as active:
            extra = active.generate_kwargs(logits_processor=gen.pop("logits_processor"))
            return model.generate(**inputs, **gen, **extra)

    def decode(self, inputs: dict, sequences: torch.Tensor) -> list[str]:
        new = sequences[:, inputs["input_ids"].shape[1] :]
        return [t.strip() for t in self.processor.batch_decode(new, skip_special_tokens=True)]

    def count_new(self, inputs: dict, sequences: torch.Tensor) -> list[int]:
        """Generated tokens per row, up to and including the first end-of-sequence token."""
        new = sequences[:, inputs["input_ids"].shape[1] :].tolist()
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        counts = []
        for row in new:
            n = len(row)
            for i, t in enumerate(row):
                if t in eos:
                    n = i + 1
                    break
            counts.append(n)
        return counts
