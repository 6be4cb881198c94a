"""The pruning defaults are the measured ones, and every entry point takes them from
``FocusConfig`` instead of typing its own: ``vf.wrap``, ``vlm-focus run|bench``, ``vlm-focus
eval``, the lmms-eval model arguments and the pruner-quality benchmark."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vlm_focus import cli
from vlm_focus.config import FocusConfig
from vlm_focus.core.options import default_of
from vlm_focus.eval import cli as eval_cli
from vlm_focus.eval.pope_run import parse_sweep
from vlm_focus.integrations.model_args import split_model_args

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "pruning_defaults.json"
MEASURED_FIELDS = ("query_rows", "reduce")


@pytest.fixture(scope="module")
def measured() -> dict:
    return json.loads(MEASURED.read_text())


def test_the_defaults_are_the_measured_best(measured):
    best = measured["best"]
    config = FocusConfig()
    assert {name: getattr(config, name) for name in MEASURED_FIELDS} == best
    assert {name: default_of(FocusConfig, name) for name in MEASURED_FIELDS} == best


def test_the_measurement_covers_both_depths_and_every_combination(measured):
    depths = {d["name"]: d for d in measured["depths"]}
    assert {(d["layer"], d["model"]) for d in depths.values()} == {
        (0, "organism-default"),
        (2, "organism-deep"),
    }
    combos = {(r["query_rows"], r["reduce"]) for r in measured["ranking"]}
    assert combos == {(q, r) for q in ("last", "text") for r in ("mean", "max")}
    best = max(measured["ranking"], key=lambda r: r["overall"])
    assert {name: best[name] for name in MEASURED_FIELDS} == measured["best"]
    for depth in depths.values():
        grid = {(s["pruner"], s["query_rows"], s["reduce"], s["keep"]) for s in depth["settings"]}
        assert {
            (p, *c, k) for p in ("fastv", "text", "debiased") for c in combos for k in (0.25, 0.11)
        } <= grid


def test_every_entry_point_inherits_the_defaults():
    config = FocusConfig()
    expected = {name: getattr(config, name) for name in MEASURED_FIELDS}
    run = cli.parse(["run"])
    assert {name: getattr(run, name) for name in MEASURED_FIELDS} == expected
    for argv in (["pope", "--pruner", "fastv"], ["pope", "--sweep", "keep=0.25"]):
        (setting,) = [s for s in parse_sweep(eval_cli.parse(argv)) if s.pruned]
        assert {name: getattr(setting.focus, name) for name in MEASURED_FIELDS} == expected
    chair = eval_cli.parse(["chair", "--pruner", "fastv"]).setting().focus
    assert {name: getattr(chair, name) for name in MEASURED_FIELDS} == expected
    focus, _ = split_model_args({"pruner": "fastv", "keep": 0.25, "layer": 0})
    harness = focus.config()
    assert {name: getattr(harness, name) for name in MEASURED_FIELDS} == expected
    assert focus.tag() == "fastv-k0.25-l0"  # a default is never spelled out in the tag


def test_the_benchmark_defaults_to_focus_config(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "pruner_quality", ROOT / "benchmarks" / "pruner_quality.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pruner_quality", module)  # its dataclass looks it up
    spec.loader.exec_module(module)
    seen = {}
    monkeypatch.setattr(module, "single", lambda args: seen.update(vars(args)))
    monkeypatch.setattr(sys, "argv", ["pruner_quality.py"])
    module.main()
    assert (seen["query"], seen["reduce"]) == ([FocusConfig().query_rows], [FocusConfig().reduce])
