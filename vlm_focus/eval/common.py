"""What the evaluation commands share: their typed options, the check of the modules they import
late, loading the model (and the guide), result folder names and atomic JSON writes. The
runners import this; the command line (:mod:`vlm_focus.eval.cli`) sits on top of the runners."""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..asset_paths import is_embedded
from ..config import FocusConfig, keeps_everything, read_keep
from ..core.options import (
    config_of,
    default_of,
    inherit,
    inherit_options,
    option,
    options,
    pruner_option_field,
    show,
)
from ..core.registry import get_pruner, pruners_with, read_pruner_options
from ..hallucination import mitigation_choices, mitigation_name
from ..loading import LoadOptions, MissingExtra
from ..setting import RunSetting

ON_MISSING = ("skip", "stop")
#: What installs the modules of the ``eval`` extra (pycocotools, matplotlib).
EVAL_EXTRA = "pip install 'vlm-focus[eval]'"
#: The pruning options of the evaluations besides the pruner, each as FocusConfig defines it.
PRUNE_FIELDS = tuple(o.name for o in options(FocusConfig, cli_only=True) if o.name != "pruner")


def _focus(name: str) -> Any:
    """``FocusConfig``'s option ``name`` with default ``None``, which stands for its default
    (so that an option given without ``--pruner`` can be told from one left out)."""
    return inherit(
        FocusConfig, name, default=None, default_text=show(default_of(FocusConfig, name))
    )


@dataclass
class EvalOptions(LoadOptions):
    """Options of every ``vlm-focus eval`` command: the model, the data and the run."""

    #: The command's name (``vlm-focus eval <command>``).
    command: ClassVar[str] = ""
    #: Modules the command imports only when it gets there; :func:`check_extras` imports them
    #: before any work.
    requires: ClassVar[tuple[str, ...]] = ()
    #: The plots the command draws (with matplotlib, when it is installed).
    plots: ClassVar[tuple[str, ...]] = ()

    out: Path = option(
        Path("vlm_focus_eval"),
        "output folder: results, tables, plots and the embedded held-out scenes",
        default_text="vlm_focus_eval/ in the current folder",
    )
    images: Path | None = option(
        None,
        "image folder of a COCO-format set (e.g. COCO val2014)",
        default_text="the embedded held-out scenes, written under --out",
    )
    instances: Path | None = option(
        None, "COCO instances json of that set", default_text="the embedded held-out set's"
    )
    limit: int | None = option(
        None,
        "quick check: only the first N questions per split (pope) or N images (coco, chair)",
        default_text="all",
        metavar="N",
    )
    batch_size: int = option(8, "rows per generate() call")
    on_missing: str = option(
        "skip",
        "an item whose image file is missing: skip and count it, or stop",
        choices=ON_MISSING,
    )
    seed: int = option(0, "seed of every sampled choice")
    threads: int | None = option(
        None, "torch CPU threads per process", default_text="torch's default"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.out = Path(self.out)
        self.images = None if self.images is None else Path(self.images)
        self.instances = None if self.instances is None else Path(self.instances)
        for name in ("limit", "batch_size", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"on_missing={self.on_missing!r}; allowed: {', '.join(ON_MISSING)}")

    @property
    def model_name(self) -> str:
        return "embedded" if is_embedded(self.model) else str(self.model)

    @property
    def results(self) -> Path:
        """The command's results folder for this model: ``out/<command>/<model tag>``."""
        return self.out / self.command / model_tag(self.model)

    def device_of(self, state: Any) -> str:
        """The device this process runs on: ``device``, else the process's own."""
        return self.device or str(state.device)

    def run_items(
        self,
        state: Any,
        items: Sequence[dict],
        process: Callable[[list[dict]], list[dict]],
        log: Path,
        *,
        key: str,
        desc: str,
        metric: Callable[[list[dict]], str],
        record: dict[str, Any],
    ) -> list[dict]:
        """:func:`~vlm_focus.eval.runner.run_items` of ``items`` into the resumable ``log``, in
        batches of these options' size; the log's run config is the model and ``record``
        (the run's choices)."""
        from .runner import run_items

        return run_items(
            items,
            process,
            log,
            key=key,
            batch_size=self.batch_size,
            state=state,
            desc=desc,
            metric=metric,
            config={"model": self.model_name, **record},
        )


@dataclass
@inherit_options(FocusConfig, before="pruner_option", make_field=_focus)
class PruneOptions(EvalOptions):
    """An evaluation that generates: optional pruning (the :class:`~vlm_focus.FocusConfig`
    options, with its defaults) and an optional mitigation from the registry.

    Without a pruner (or a sweep) the pruning options stay ``None``: the model runs unpruned,
    and giving one of them is an error instead of being ignored."""

    pruner: str | None = option(
        None,
        "registered pruner (`vlm-focus pruners` lists them); the pruning options "
        "below only apply with it",
        default_text="none, the model runs unpruned",
    )
    # FocusConfig's other command-line options come here, default None (inherit_options)
    pruner_option: list[str] = pruner_option_field()
    mitigate: str = option(
        "none",
        "mitigation from vlm_focus.hallucination, with its registered defaults: "
        + ", ".join(mitigation_choices()),
    )
    guide: str | None = option(
        None,
        "guide model (folder or hub id) for --pruner guided",
        default_text="the embedded guide model when the embedded model runs",
        metavar="PATH_OR_ID",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep is not None:
            self.keep = read_keep(self.keep)
        given = [f"{n}={getattr(self, n)!r}" for n in PRUNE_FIELDS if getattr(self, n) is not None]
        given += [f"pruner_option={o!r}" for o in self.pruner_option]
        if given and self.pruner is None and not self._sweeps():
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{', '.join(given)} only {verb} with a pruner, and none was chosen (without one "
                "the model runs unpruned): pass pruner (--pruner NAME, e.g. fastv) or leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        if self.pruner is not None or self._sweeps():  # unpruned: the options stay None
            defaults = FocusConfig()
            for name in PRUNE_FIELDS:
                if getattr(self, name) is None:
                    setattr(self, name, getattr(defaults, name))
        self.mitigate = mitigation_name(self.mitigate)
        if self.pruner is not None:
            get_pruner(self.pruner)  # an unknown name raises, listing the registered ones
            self.options = self.pruner_options(self.pruner)
            # the one check of every pruning option (keep's rule, choices, layer >= 0)
            self.keep = config_of(FocusConfig, self).keep
        if self.guide is not None and not self._sweeps():
            if self.pruner is None or not get_pruner(self.pruner).needs_guide:
                takes = pruners_with("needs_guide")
                raise ValueError(
                    f"guide={self.guide!r} only applies with a pruner that takes a guide "
                    f"({', '.join(takes)})"
                )

    def _sweeps(self) -> bool:
        return False

    def pruner_options(self, pruner: str) -> dict[str, Any]:
        """``pruner``'s own options from ``--pruner-option NAME=VALUE``."""
        return read_pruner_options(pruner, self.pruner_option)

    @property
    def pruned(self) -> bool:
        return self.pruner is not None and not keeps_everything(self.keep)

    def setting(
        self, pruner: str | None = None, keep: float | int | None = None, **overrides: Any
    ) -> RunSetting:
        """The :class:`~vlm_focus.setting.RunSetting` of these options: their pruner (or
        ``pruner``, at ``keep``: one point of a sweep) and mitigation; ``overrides`` are
        further RunSetting fields (``max_new_tokens``, ``zoom``, ...)."""
        pruner = pruner or self.pruner
        focus = None
        if pruner is not None:
            given = {"keep": keep} if keep is not None else {}
            own = self.pruner_options(pruner)
            focus = config_of(FocusConfig, self, pruner=pruner, options=own, **given)
        guide = None
        if focus is not None and get_pruner(pruner).needs_guide:
            guide = self.guide or ("embedded" if is_embedded(self.model) else None)
        return RunSetting(focus=focus, mitigation=self.mitigate, guide=guide, **overrides)


def check_extras(options: EvalOptions) -> bool:
    """Check, before any work, the modules ``options``' command imports later on.

    A missing module of ``options.requires`` raises :class:`MissingExtra` (e.g. ``vlm-focus eval
    coco needs pycocotools: pip install 'vlm-focus[eval]'``), so that no command fails after
    its work is done. Without matplotlib the command still runs: one line on stderr names the
    plots it will skip. Returns whether the plots can be drawn."""
    from .plots import PLOT_EXTRA, available

    name = f"vlm-focus eval {options.command}"
    for module in options.requires:
        package = module.partition(".")[0]
        try:
            importlib.import_module(module)
        except ImportError as err:
            broken = "" if err.name in (package, module) else f" ({err})"
            raise MissingExtra(
                f"{name} needs {package}{broken}: {EVAL_EXTRA}", name=package
            ) from err
    if not options.plots or available():
        return bool(options.plots)
    print(
        f"{name}: skipping {', '.join(options.plots)}: matplotlib is not installed; {PLOT_EXTRA}",
        file=sys.stderr,
    )
    return False


def model_tag(model: str | None) -> str:
    """A folder name for a model: ``embedded`` or the path/hub id's last parts, sanitised."""
    if is_embedded(model):
        return "embedded"
    parts = [x for x in re.split(r"[\\/]+", str(model)) if x][-2:]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "--".join(parts))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON through a temporary file (atomic replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def on_shared_items(
    summaries: Sequence[dict],
    log: Callable[[dict], Path],
    identity: Callable[[dict], Hashable],
    score: Callable[[dict, list[dict]], dict],
    items: str = "questions",
) -> list[dict]:
    """Table rows that share their items: each summary re-scored on the items that every
    summary's answer log holds.

    ``log(summary)`` is the summary's JSONL log (every answer of that setting, whatever
    ``--limit`` each call had), ``identity(record)`` what makes two records the same item (its
    id and content, so that another question file's question 1 is another item), and
    ``score(summary, records)`` the scores of the shared records. A row's ``n`` is then the
    same for every row. When a setting has answered more items than are shared, one line on
    stderr says so (the row is scored on fewer items than its own summary file)."""
    logs = [_read_log(log(s)) for s in summaries]
    if not logs:
        return []
    shared = set.intersection(*({identity(r) for r in records} for records in logs))
    rows = []
    for summary, records in zip(summaries, logs, strict=True):
        kept = [r for r in records if identity(r) in shared]
        rows.append({**summary, **score(summary, kept)})
    more = [(s["setting"], len(records)) for s, records in zip(summaries, logs, strict=True)]
    more = [(tag, n) for tag, n in more if n > len(shared)]
    if more:
        where = f" ({summaries[0]['split']})" if "split" in summaries[0] else ""
        answered = ", ".join(f"{tag} {n}" for tag, n in more[:3]) + (", ..." if more[3:] else "")
        print(
            f"table{where}: every row is scored on the {len(shared)} {items} all "
            f"{len(summaries)} settings answered (answered: {answered}); re-run the others "
            "with a larger --limit to compare on more",
            file=sys.stderr,
        )
    return rows


def _read_log(path: Path) -> list[dict]:
    from .runner import read_jsonl

    return read_jsonl(path, repair=False)


def read_summaries(folder: Path, pattern: str) -> list[dict]:
    """Every summary JSON under ``folder`` matching ``pattern`` (run configs excluded)."""
    out = []
    for path in sorted(Path(folder).glob(pattern)):
        if path.name.endswith(".config.json"):
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "setting" in data:
            out.append(data)
    return out
