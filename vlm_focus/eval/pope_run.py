"""``vlm-focus eval pope``: answer POPE questions under one setting or a pruning sweep.

The runner of :mod:`vlm_focus.eval.pope` (the protocol and its metrics), with a typed
:class:`PopeConfig`. Every call rebuilds ``table.md``, ``table.csv`` and ``retention.png`` from
every setting whose results lie in the model's folder; within a split every row is scored on
the questions that all of its settings answered, so that rows share their questions and ``n``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..config import keeps_everything, read_keep
from ..core.options import option
from ..setting import RunSetting
from ..zoom import ZoomOptions
from .common import PruneOptions, check_extras, on_shared_items, read_summaries, write_json
from .data import resolve_set, split_missing
from .generation import ZOOMS
from .metrics import PARSE_RULE
from .pope import (
    LLAVA_SUFFIX,
    SPLITS,
    build_questions,
    evaluate,
    read_questions,
    running_metric,
    summarise,
    write_questions,
)
from .runner import process_state
from .tables import write_table

TABLE_COLUMNS = (
    "split", "setting", "pruner", "keep", "mitigate", "zoom", "routed", "n", "accuracy",
    "precision", "recall", "f1", "yes_ratio", "unparseable", "visual_kept", "visual_total",
    "prefill_ms", "tokens_per_s",
)  # fmt: skip


@dataclass
class PopeConfig(PruneOptions):
    """``vlm-focus eval pope``: POPE yes/no questions under one setting or a pruning sweep."""

    command: ClassVar[str] = "pope"
    plots: ClassVar[tuple[str, ...]] = ("retention.png",)

    split: str = option("all", "POPE split to run", choices=("all", *SPLITS))
    questions: list[Path] | None = option(
        None,
        "existing POPE jsonl files (each file's split is the random/popular/"
        "adversarial part of its name)",
        default_text="built from the instances by the POPE rules",
        parse=Path,
        nargs="+",
    )
    n_images: int = option(500, "POPE images to sample")
    suffix: str | None = option(
        None, "text appended to every question", default_text=f"LLaVA's {LLAVA_SUFFIX!r}"
    )
    max_new_tokens: int = option(16, "new tokens per answer")
    sweep: str | None = option(
        None, "a keep sweep, e.g. keep=1.0,0.5,0.25,0.11", default_text="none"
    )
    pruners: str | None = option(
        None, "pruners of the --sweep: a comma list or 'all'", default_text="--pruner, else fastv"
    )

    zoom: str = option(
        "never",
        "look closer (vlm_focus.zoom.look_closer): never, always, or adaptive "
        "(only when the plain answer's first-token confidence is below --zoom-threshold)",
        choices=ZOOMS,
    )
    zoom_threshold: float | None = option(
        None,
        "--zoom adaptive: zoom when the confidence is below it, in [0, 1]",
        default_text="from --zoom-calibration",
    )
    zoom_calibration: Path | None = option(
        None,
        "--zoom adaptive: a zoom.Calibration JSON (python -m vlm_focus.zoom "
        "calibrate --out PATH) whose threshold to use",
        default_text="none",
    )
    zoom_layers: list[int] | None = option(
        None,
        "decoder layers whose attention map picks the crop",
        default_text="all",
        parse=int,
        nargs="+",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_zoom()
        if self.questions is not None:
            self.questions = [Path(q) for q in self.questions]
        if self.n_images < 1:
            raise ValueError(f"n_images={self.n_images} must be >= 1")
        if self.pruners is not None and self.sweep is None:
            raise ValueError("pruners only apply with a sweep (--sweep keep=...)")

    def _sweeps(self) -> bool:
        return self.sweep is not None

    def _check_zoom(self) -> None:
        from ..zoom import Calibration

        if self.zoom not in ZOOMS:
            raise ValueError(f"zoom={self.zoom!r}; allowed: {', '.join(ZOOMS)}")
        if self.zoom_calibration is not None:
            self.zoom_calibration = Path(self.zoom_calibration)
        if self.zoom != "adaptive":
            given = [n for n in ("zoom_threshold", "zoom_calibration") if getattr(self, n)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply with zoom='adaptive' (--zoom adaptive), "
                    f"not zoom={self.zoom!r}"
                )
        if self.zoom == "never" and self.zoom_layers is not None:
            raise ValueError("zoom_layers only applies with a zoom (--zoom always|adaptive)")
        if self.zoom_layers is not None:
            if not self.zoom_layers or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.zoom_layers
            ):
                raise ValueError(f"zoom_layers={self.zoom_layers!r} must be ints >= 0")
        if self.zoom != "adaptive":
            return
        if (self.zoom_threshold is None) == (self.zoom_calibration is None):
            raise ValueError(
                "zoom='adaptive' needs exactly one of zoom_threshold (--zoom-threshold, a number "
                "in [0, 1]) and zoom_calibration (--zoom-calibration PATH, from python -m "
                "vlm_focus.zoom calibrate)"
            )
        if self.zoom_calibration is not None:
            if not self.zoom_calibration.is_file():
                raise FileNotFoundError(f"zoom_calibration file not found: {self.zoom_calibration}")
            try:
                self.zoom_threshold = float(Calibration.load(self.zoom_calibration).threshold)
            except (ValueError, TypeError, KeyError) as err:
                raise ValueError(
                    f"zoom_calibration={str(self.zoom_calibration)!r} is not a zoom.Calibration "
                    f"JSON ({err})"
                ) from err
        t = self.zoom_threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t <= 1.0:
            raise ValueError(f"zoom_threshold={t!r} must be a number in [0, 1]")
        self.zoom_threshold = float(t)


def parse_sweep(config: PopeConfig) -> list[RunSetting]:
    """The settings of a run: one, or unpruned + every (pruner, keep < 1) of a sweep."""
    import vlm_focus as vf

    from ..zoom import Calibration

    zoom = None
    if config.zoom != "never":
        # a calibrated threshold holds only for the statistic it was calibrated on
        routed_by = {}
        if config.zoom_calibration is not None:
            routed_by["statistic"] = Calibration.load(config.zoom_calibration).statistic
        zoom = ZoomOptions(
            route=config.zoom,
            threshold=config.zoom_threshold,
            layers=config.zoom_layers,
            **routed_by,
        )
    calibration = None if config.zoom_calibration is None else str(config.zoom_calibration)
    common = dict(max_new_tokens=config.max_new_tokens, zoom=zoom, zoom_calibration=calibration)
    if config.sweep is None:
        return [config.setting(**common)]
    name, _, values = config.sweep.partition("=")
    if name.strip() != "keep" or not values:
        raise ValueError(
            f"sweep={config.sweep!r}: expected keep=v1,v2,... (e.g. keep=1.0,0.5,0.25)"
        )
    keeps = [read_keep(v) for v in values.split(",") if v.strip()]
    if config.pruners in (None, ""):
        names = [config.pruner or "fastv"]
    elif config.pruners == "all":
        names = vf.pruners()
    else:
        names = [n.strip() for n in config.pruners.split(",") if n.strip()]
    known = set(vf.pruners())
    for n in names:
        if n not in known:
            raise ValueError(f"unknown pruner {n!r}; registered: {', '.join(sorted(known))}")
    unpruned = dataclasses.replace(config.setting(**common), focus=None, guide=None)
    return [unpruned] + [
        config.setting(pruner=n, keep=k, **common)
        for n in names
        for k in keeps
        if not keeps_everything(k)
    ]


def question_sets(config: PopeConfig, state: Any) -> tuple[Path, dict[str, list[dict]], str]:
    """(image folder, questions per split, description of their source)."""
    if config.questions:
        if config.images is None:
            images_dir = resolve_set(config, state).images_dir
        else:
            images_dir = config.images
            if not Path(images_dir).is_dir():
                raise FileNotFoundError(f"image directory not found: {images_dir}")
        sets = {}
        for path in config.questions:
            split = next((s for s in SPLITS if s in path.stem), path.stem)
            sets[split] = read_questions(path)
        return Path(images_dir), sets, "files: " + ", ".join(str(p) for p in config.questions)
    cocoset = resolve_set(config, state)
    splits = SPLITS if config.split == "all" else (config.split,)
    sets = {}
    folder = (
        config.out / "pope" / "questions" / f"{cocoset.name}-n{config.n_images}-seed{config.seed}"
    )
    for split in splits:
        rows = build_questions(cocoset.instances, split, n_images=config.n_images, seed=config.seed)
        if state.is_main_process:
            write_questions(rows, folder / f"pope_{split}.jsonl")
        sets[split] = rows
    source = (
        f"built from {cocoset.instances_path} by the POPE rules (n_images={config.n_images}, "
        f"3 positive + 3 negative per image, seed={config.seed}); copies in {folder}"
    )
    return cocoset.images_dir, sets, source


def run_pope(config: PopeConfig) -> list[dict]:
    """Run every (setting, split); returns this call's summary rows (also written as json),
    and rebuilds the folder's table and retention plot from every setting run so far."""
    if not isinstance(config, PopeConfig):
        raise TypeError(f"run_pope expects a PopeConfig, got {type(config).__name__}")
    draws = check_extras(config)
    state = process_state()
    settings = parse_sweep(config)
    images_dir, splits, source = question_sets(config, state)
    suffix = LLAVA_SUFFIX if config.suffix is None else config.suffix
    sets = {"_images": images_dir, "_suffix": suffix, "_source": source, "splits": splits}
    model, processor = config.load(config.device_of(state))
    guide = (None, None)
    root = config.results
    summaries: list[dict] = []
    failed: list[str] = []
    for setting in settings:
        try:
            if setting.needs_guide and guide[0] is None:
                guide = setting.load_guide(config.device_of(state))
            summaries += _run_setting(config, state, model, processor, guide, setting, sets, root)
        except (ValueError, FileNotFoundError, RuntimeError) as err:
            if not config.sweep:
                raise
            failed.append(setting.tag)  # one pruner's failure does not stop a sweep
            print(f"pope {setting.tag}: skipped: {err}", file=sys.stderr)
    if state.is_main_process and summaries:
        every = table_rows(root, all_summaries(root))
        write_table(every, TABLE_COLUMNS, root / "table")
        if draws and any(s["pruner"] is not None for s in every):
            from .plots import retention_plot

            retention_plot(every, root / "retention.png", metric="f1")
        if failed:
            write_json(root / "failed.json", failed)
        print(f"results in {root} (table: {len(every)} rows)", file=sys.stderr)
    return summaries


def all_summaries(root: Path) -> list[dict]:
    """Every summary under ``root/<split>/``: splits in POPE order, then unpruned first, each
    pruner's settings from most to fewest visual tokens kept."""
    rows = read_summaries(root, "*/*.json")
    order = {s: i for i, s in enumerate(SPLITS)}

    def key(s: dict) -> tuple:
        pruned = s.get("pruner") is not None
        return (
            order.get(s["split"], len(order)),
            s["split"],
            pruned,
            s.get("pruner") or "",
            -float(s.get("visual_kept") or 0.0),
            s["setting"],
        )

    return sorted(rows, key=key)


def table_rows(root: Path, summaries: list[dict]) -> list[dict]:
    """The table's rows: within each split, every setting scored on the questions that all of
    them answered (:func:`~vlm_focus.eval.common.on_shared_items`), so that the rows of a split
    share their questions and their ``n``, whatever ``--limit`` each call had."""
    splits: dict[str, list[dict]] = {}
    for s in summaries:
        splits.setdefault(s["split"], []).append(s)
    rows = []
    for split, group in splits.items():
        rows += on_shared_items(
            group,
            lambda s, split=split: root / split / f"{s['setting']}.jsonl",
            _question,
            lambda s, records: {
                **summarise(records),
                **_zoom_summary(s.get("zoom", "never"), records),
            },
        )
    return rows


def _question(record: dict) -> tuple:
    """What makes two answer records the same POPE question."""
    return (record["question_id"], record["image"], record["question"], record["label"])


def _run_setting(config, state, model, processor, guide, setting, sets, root) -> list[dict]:
    """Every split of one setting; the main process returns their summaries."""
    images_dir, suffix, source = sets["_images"], sets["_suffix"], sets["_source"]
    summaries = []
    for split, rows in sets["splits"].items():
        rows = rows[: config.limit] if config.limit else rows
        present, missing = split_missing(rows, _Folder(images_dir), config.on_missing)

        def process(batch: list[dict]) -> list[dict]:
            return evaluate(
                model,
                processor,
                batch,
                setting,
                images=images_dir,
                suffix=suffix,
                batch_size=len(batch),
                guide=guide[0],
                guide_processor=guide[1],
            ).records

        records = config.run_items(
            state,
            present,
            process,
            root / split / f"{setting.tag}.jsonl",
            key="question_id",
            desc=f"pope {split} {setting.tag}",
            metric=running_metric,
            record={
                **setting.describe(),
                "prompt_suffix": suffix,
                "questions": source,
            },
        )
        if not state.is_main_process:
            continue
        summary = {
            "split": split,
            "setting": setting.tag,
            **setting.describe(),
            **summarise(records),
            **_zoom_summary(setting.zoom.route if setting.zoom else "never", records),
            "n_missing_images": len(missing),
            "model": config.model_name,
            "prompt_suffix": suffix,
            "parse_rule": PARSE_RULE,
            "questions": source,
            "yes_ratio_of": "predictions",
            "processes": state.num_processes,
        }
        write_json(root / split / f"{setting.tag}.json", summary)
        summaries.append(summary)
        _print(summary)
    return summaries


def _zoom_summary(route: str, records: list[dict]) -> dict[str, Any]:
    """``zoom`` (its route, or ``never``) and, with one, the shares of questions routed and
    zoomed, and the mean seconds per question of every phase."""
    out: dict[str, Any] = {"zoom": route}
    if route == "never" or not records:
        return out
    n = len(records)
    out["routed"] = sum(bool(r["routed"]) for r in records) / n
    out["zoomed"] = sum(bool(r["zoomed"]) for r in records) / n
    phases = records[0]["zoom_s"].keys()
    out["zoom_ms"] = {k: 1e3 * sum(r["zoom_s"][k] for r in records) / n for k in phases}
    return out


class _Folder:
    """Minimal stand-in with ``images_dir`` for :func:`split_missing`."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = Path(images_dir)


def _print(s: dict) -> None:
    print(
        f"pope {s['split']:<11} {s['setting']:<22} acc {s['accuracy']:.4f} f1 {s['f1']:.4f} "
        f"yes {s['yes_ratio']:.3f} unparseable {s['unparseable']} kept "
        f"{s['visual_kept']:.0f}/{s['visual_total']:.0f} prefill {s['prefill_ms']:.1f} ms",
        file=sys.stderr,
    )
