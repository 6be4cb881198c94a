"""Multi-stage schedules on the command lines: ``--layer 0:2 --keep 0.5:0.25`` (or with commas)
means what ``vf.wrap(layer=(0, 2), keep=(0.5, 0.25))`` means, in ``run``, ``bench`` and
``eval``, read by the parser lmms-eval's ``layer=2:8:16`` goes through."""

from __future__ import annotations

import json

import pytest

from vlm_focus import cli
from vlm_focus.config import FocusConfig
from vlm_focus.eval import cli as eval_cli
from vlm_focus.integrations.model_args import parse_focus_args

SCHEDULE = FocusConfig(layer=(0, 2), keep=(0.5, 0.25))


@pytest.mark.parametrize("layer, keep", [("0:2", "0.5:0.25"), ("0,2", "0.5,0.25")])
def test_every_command_line_reads_a_schedule_as_wrap_takes_it(layer, keep):
    argv = ["--layer", layer, "--keep", keep]
    assert cli.parse(["run", *argv]).focus() == SCHEDULE
    bench = cli.parse(["bench", "--layer", layer, "--keeps", "0.5:0.25,0.25:0.11"])
    assert [bench.focus(k).stages for k in bench.keep_values()] == [
        [(0, 0.5), (2, 0.25)],
        [(0, 0.25), (2, 0.11)],
    ]
    pope = eval_cli.parse(["pope", "--pruner", "fastv", *argv])
    assert (pope.layer, pope.keep) == ((0, 2), (0.5, 0.25))
    harness = parse_focus_args({"layer": layer.replace(",", ":"), "keep": keep.replace(",", ":")})
    assert harness.config() == SCHEDULE


def test_counts_stay_ints_in_a_schedule():
    config = cli.parse(["run", "--layer", "1:3", "--keep", "64:0.25"]).focus()
    assert config.stages == [(1, 64), (3, 0.25)] and type(config.keep[0]) is int


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layer", "0:2", "--keep", "0.5"], "(2 and 1): one keep per layer"),
        (["--layer", "2", "--keep", "0.5:0.25"], "(1 and 2): one keep per layer"),
        (["--layer", "0:2", "--keep", "0.25:0.5"], "each stage must keep less"),
        (["--layer", "0:2", "--keep", "0.5:"], "keep='0.5:' has an empty stage"),
    ],
)
def test_a_schedule_that_does_not_fit_is_one_line_naming_both(argv, message, capsys):
    assert cli.main(["run", *argv]) == 2  # before any model loads
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("vlm-focus run: error: ") and message in err


def test_bench_names_a_keep_without_a_stage_per_layer(capsys):
    assert cli.main(["bench", "--layer", "0:2", "--keeps", "0.5:0.25,0.5"]) == 2
    err = capsys.readouterr().err
    assert "layer=(0, 2) and keep=0.5 must have the same number of stages (2 and 1)" in err


def test_a_layer_that_is_not_a_number_is_named(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["run", "--layer", "0:x"])
    assert "layer='0:x': 'x' is not a layer index" in capsys.readouterr().err


def test_run_prunes_in_two_stages(capsys):
    """The embedded organism (144 visual tokens): layer 0 keeps 72, layer 1 keeps 36 of all."""
    argv = ["run", "--layer", "0:1", "--keep", "0.5:0.25", "--max-new-tokens", "1"]
    assert cli.main([*argv, "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["layer"], report["keep"]) == ([0, 1], [0.5, 0.25])
    assert (report["visual_kept"], report["visual_total"]) == (36, 144)
