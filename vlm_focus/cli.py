"""``vlm-focus``: run | bench | pruners | organism | eval | demo.

Every pruning option means what it means in ``vf.wrap`` and has the same default (they are
:class:`~vlm_focus.FocusConfig`'s fields); each option's help ends with its default.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

from .asset_paths import CAPTION_PROMPT, sample_scene_paths
from .config import FocusConfig, read_keep
from .core.options import (
    add_command,
    config_of,
    inherit_options,
    option,
    options,
    parse_config,
    pruner_option_field,
)
from .loading import LoadOptions, MissingExtra
from .setting import RunSetting


@dataclass
@inherit_options(FocusConfig, before="pruner_option")
class InputOptions(LoadOptions):
    """One image or video, one prompt and one pruning setting (``vlm-focus run`` and
    ``bench``)."""

    image: str | None = option(None, "image file", default_text="a bundled sample scene")
    video: str | None = option(
        None,
        "video file instead of an image (decoded by OpenCV), for a model that takes "
        "videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision)",
    )
    frames: int = option(8, "video frames taken, at even steps")
    prompt: str | None = option(
        None,
        "question or instruction",
        default_text=f"{CAPTION_PROMPT!r}, the embedded models' caption prompt",
    )
    # FocusConfig's command-line options come here (inherit_options)
    pruner_option: list[str] = pruner_option_field()
    repeats: int = option(5, "timed pairs of alternating unpruned and pruned prefills")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError(
                f"prompt={self.prompt!r} is empty: type a question or an instruction, or leave "
                f"--prompt out for {CAPTION_PROMPT!r}"
            )
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be an int >= 1")
        if self.image is not None and self.video is not None:
            raise ValueError("give --image or --video, not both")
        if isinstance(self.frames, bool) or not isinstance(self.frames, int) or self.frames < 1:
            raise ValueError(f"frames={self.frames!r} must be an int >= 1")
        self.keep = read_keep(self.keep)  # keep's one rule, as the command line gives it
        from .pruners import read_pruner_options

        # an unknown pruner raises here, listing the registered ones
        self.options = read_pruner_options(self.pruner, self.pruner_option)
        for keep in self.keep_values():
            self.focus(keep)  # FocusConfig's checks (one keep per stage of layer, ...)

    def keep_values(self) -> list[float | int | tuple]:
        """The keep values the command runs."""
        return [self.keep]

    def focus(self, keep: Any = None) -> FocusConfig:
        """The :class:`~vlm_focus.FocusConfig` of these options (with another ``keep``)."""
        return config_of(FocusConfig, self, **({} if keep is None else {"keep": keep}))


@dataclass
class RunConfig(InputOptions):
    """``vlm-focus run``: answer one prompt about one image or video, unpruned and pruned."""

    max_new_tokens: int = option(16, "new tokens per answer")
    json: bool = option(False, "print one JSON object")


@dataclass
class BenchConfig(InputOptions):
    """``vlm-focus bench``: prefill time pruned against unpruned on one input, per keep."""

    keeps: str = option(
        "1.0,0.5,0.25,0.11",
        "keep values to time, a comma list (each read as --keep is); with a "
        "multi-stage --layer each is a colon list (--layer 2:8 --keeps 0.5:0.25,0.25:0.11)",
    )

    def keep_values(self) -> list[float | int | tuple]:
        values = [read_keep(k) for k in self.keeps.split(",") if k.strip()]
        if not values:
            raise ValueError(f"keeps={self.keeps!r} names no keep value")
        return values


COMMANDS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "run": (RunConfig, "answer one prompt about one image or video, pruned and unpruned", ()),
    "bench": (BenchConfig, "prefill time pruned vs unpruned on one input", ("keep",)),
}
_DELEGATES = {
    "organism": ("organism.cli", "retrain the embedded models (a clone only: python -m organism)"),
    "eval": ("vlm_focus.eval.cli", "POPE, COCO grounding and CHAIR evaluation"),
    "demo": ("vlm_focus.demo.app", "Gradio grounding demo"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-focus", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (config_cls, help_text, exclude) in COMMANDS.items():
        add_command(sub, name, config_cls, help_text, exclude=exclude)
    sub.add_parser("pruners", help="the registered pruners and their options")
    sub.add_parser("mitigations", help="the registered mitigations and their options")
    for name, (_, help_text) in _DELEGATES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def parse(argv: list[str]) -> RunConfig | BenchConfig:
    """The typed config of a ``run`` or ``bench`` command line."""
    args = parser().parse_args(argv)
    if args.command not in COMMANDS:
        raise ValueError(f"{args.command!r} has no config of its own")
    return parse_config(COMMANDS[args.command][0], args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:
        import importlib

        try:
            module = importlib.import_module(_DELEGATES[argv[0]][0])
        except ModuleNotFoundError as err:
            print(f"vlm-focus {argv[0]}: not available in this install ({err})", file=sys.stderr)
            return 2
        return int(module.main(argv[1:]) or 0)
    args = parser().parse_args(argv)
    if args.command == "pruners":
        print(pruners_table(), end="")
        return 0
    if args.command == "mitigations":
        print(mitigations_table(), end="")
        return 0
    try:
        config = parse_config(COMMANDS[args.command][0], args)
        return _run(config) if args.command == "run" else _bench(config)
    except (ValueError, TypeError, OSError, MissingExtra) as err:
        # bad input, a missing file or model, a missing or broken torchvision
        print(f"vlm-focus {args.command}: error: {err}", file=sys.stderr)
        return 2


def pruners_table() -> str:
    """What ``vlm-focus pruners`` prints: every pruner, what it scores, and its options."""
    import vlm_focus as vf

    shared = ", ".join(o.name for o in options(FocusConfig, cli_only=True))
    lines = [
        f"Every pruner takes {shared} (vlm-focus run --help); its own options are keywords of "
        "vf.wrap(model, pruner=NAME, ...):",
        "",
    ]
    for name in vf.pruners():
        lines += _options_block(name, vf.pruners.get_pruner(name).summary, vf.pruner_options(name))
    return "\n".join(lines)


def mitigations_table() -> str:
    """What ``vlm-focus mitigations`` prints: every mitigation, what it does, and its options
    (from the same option tables as ``vlm-focus pruners``)."""
    import vlm_focus as vf

    lines = [
        "Each mitigation's options are keywords of hallucination.mitigate(model, NAME, ...) "
        "and of RunSetting(mitigation=NAME, mitigation_options={...}); --mitigate NAME runs "
        "it with its defaults:",
        "",
    ]
    for name in vf.hallucination.mitigations():
        mitigation = vf.hallucination.get_mitigation(name)
        block = _options_block(name, mitigation.summary, vf.mitigation_options(name))
        if mitigation.generate_args:
            given = ", ".join(f"{k}={v}" for k, v in mitigation.generate_args.items())
            block.insert(-1, f"    and generate() with {given}")
        if mitigation.generic_prompt is not None:
            block.insert(-1, f"    and a second prompt per request: {mitigation.generic_prompt!r}")
        lines += block
    return "\n".join(lines)


def _options_block(name: str, summary: str, infos: list[Any]) -> list[str]:
    """One registered entry's lines: its name and summary, then one line per option."""
    lines = [f"{name}: {summary}" if summary else name]
    if not infos:
        lines.append("    (no options of its own)")
    width = max((len(i.name) for i in infos), default=0)
    for info in infos:
        lines.append(f"    {info.name:<{width}}  {info.type} = {info.default_text}  {info.help}")
    return [*lines, ""]


class _Loaded(NamedTuple):
    """What ``run`` and ``bench`` read: the model, its inputs and where they came from."""

    model: Any
    processor: Any
    inputs: dict[str, Any]
    media: Any  # what the inputs were built from: [the image], or the decoded video
    source: str  # the image or video file
    prompt: str
    device: str
    frames: int | None  # the video frames taken (None for an image)


def _load(config: InputOptions) -> _Loaded:
    from .loading import load_image, load_video, model_inputs, resolve_device

    device = resolve_device(config.device)
    model, processor = config.load(device)
    prompt = CAPTION_PROMPT if config.prompt is None else config.prompt
    if config.video is not None:
        video = load_video(config.video, config.frames)
        inputs = model_inputs(model, processor, video, [prompt])
        frames = len(video.frames)
        return _Loaded(model, processor, inputs, video, config.video, prompt, device, frames)
    image_path = config.image
    if image_path is None:
        scenes = sample_scene_paths()
        if not scenes:
            raise ValueError("no --image given and no bundled sample scene found")
        image_path = scenes[0]
    media = [load_image(image_path)]
    inputs = model_inputs(model, processor, media, [prompt])
    return _Loaded(model, processor, inputs, media, str(image_path), prompt, device, None)


def _frames_warning(config: InputOptions, loaded: _Loaded) -> str | None:
    """What to say when the video had fewer frames than ``--frames`` asked (all are taken)."""
    if loaded.frames is None or loaded.frames >= config.frames:
        return None
    return (
        f"--frames {config.frames} asked, but the video has {loaded.frames} frames: all "
        f"{loaded.frames} used"
    )


def _kept_line(kept: int, total: int, trace: Any) -> str:
    """The visual tokens kept, and what each decode step reads where the pruner picks them
    per step (fixation: the prompt may keep every token)."""
    line = f"visual tokens kept {kept}/{total}"
    if trace is not None and trace.n_fixated:
        line += (
            f" by the prompt; each of {len(trace.fixations)} decode steps reads "
            f"{trace.n_fixated[0]}/{total}"
        )
    return line


def _run(config: RunConfig) -> int:
    import torch

    from .timing import prefill_report

    model, processor, inputs, media, source, prompt, device, frames = loaded = _load(config)
    focus = config.focus()
    setting = RunSetting(focus=focus, max_new_tokens=config.max_new_tokens)
    with torch.inference_mode():
        unpruned = setting.plain().answer(model, processor, media, [prompt], inputs=inputs)
        pruned = setting.answer(model, processor, media, [prompt], inputs=inputs)
        kept, total, timing, trace = setting.prefill_timing(
            model, inputs, repeats=config.repeats, answer=pruned
        )
    fixated = trace is not None and trace.n_fixated
    # the pruner that chose (a video's may be video_pruner's, FocusConfig.pruner_for_video)
    pruned_by = trace.pruners[0] if trace is not None and trace.pruners else focus.pruner
    report = {
        "model": model.config.model_type,
        "video" if config.video is not None else "image": source,
        **({} if frames is None else {"frames": frames, "frames_asked": config.frames}),
        "prompt": prompt,
        "answer_unpruned": unpruned.texts[0],
        "answer_pruned": pruned.texts[0],
        **{k: v for k, v in focus.to_dict().items() if k != "warm_kernels"},
        "pruned_by": pruned_by,
        "visual_kept": kept,
        "visual_total": total,
        **({"visual_per_decode_step": trace.n_fixated[0]} if fixated else {}),
        "pruned": timing is not None,
        "device": device,
    }
    if timing is not None:
        report.update(
            prefill_ms_unpruned=round(timing.base_seconds * 1e3, 2),
            prefill_ms_pruned=round(timing.other_seconds * 1e3, 2),
            prefill_speedup=round(timing.ratio, 2),
            prefill_speedup_min=round(timing.low, 2),
            prefill_speedup_max=round(timing.high, 2),
            timing_pairs=timing.runs,
            timing_trusted=timing.trusted,
        )
    if config.json:
        print(json.dumps(report))
        return 0
    shown = source if frames is None else f"{source} ({frames} frames)"
    print(f"model     {report['model']}   {'video' if config.video else 'image'} {shown}")
    print(f"prompt    {prompt}")
    print(f"unpruned  {unpruned.texts[0]}")
    by = "" if pruned_by == focus.pruner else f", pruned by {pruned_by}"
    print(f"pruned    {pruned.texts[0]}   ({RunSetting(focus=focus).tag}{by})")
    print(_kept_line(kept, total, trace))
    timed = prefill_report(timing, kept, total)
    if timing is None and fixated:  # the prompt kept all: the decode steps prune
        timed = "prefill unpruned, nothing to time there (benchmarks/decode.py times decoding)"
    print(f"timing    {timed}, {device}")
    for warning in (_frames_warning(config, loaded), timing and timing.warning()):
        if warning:
            print(f"warning   {warning}")
    return 0


def _bench(config: BenchConfig) -> int:
    from .timing import prefill_report

    loaded = _load(config)
    model, inputs, device = loaded.model, loaded.inputs, loaded.device
    print(
        f"prefill, {RunSetting(focus=config.focus()).tag}, {device}: each keep timed in "
        f"{config.repeats} pairs alternating with the unpruned model; the times shown are the "
        "median pair's, and the speed-up is their ratio (min-max over all pairs)"
    )
    if _frames_warning(config, loaded):
        print(f"warning: {_frames_warning(config, loaded)}")
    doubtful = []
    for keep in config.keep_values():
        setting = RunSetting(focus=config.focus(keep))
        kept, total, timing, _ = setting.prefill_timing(model, inputs, repeats=config.repeats)
        print(f"keep={keep!s:<5} kept {kept:>4}/{total:<4} {prefill_report(timing, kept, total)}")
        if timing is not None and not timing.trusted:
            doubtful.append((keep, timing.warning()))
    for keep, why in doubtful:
        print(f"warning: keep={keep}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
