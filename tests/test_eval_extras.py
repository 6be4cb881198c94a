"""The modules of the ``eval`` extra are checked before an evaluation command starts its work:
a missing one the command needs stops it at once with one line naming it and the extra; a
missing matplotlib is announced in one line and the command runs on without its plots."""

import sys

import pytest

from vlm_focus.eval import data, pope_run
from vlm_focus.eval.cli import main


def _without(monkeypatch, package):
    """Make ``package`` (and its submodules) fail to import, as when it is not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.fixture
def work(monkeypatch):
    """Stand-in for the first piece of work of every command (reading or writing the set):
    it says so on stderr and stops the command."""

    def started(*args, **kwargs):
        print("work started", file=sys.stderr)
        raise ValueError("stopped after the start of the work")

    monkeypatch.setattr(data, "resolve_set", started)
    monkeypatch.setattr(pope_run, "resolve_set", started)


def test_coco_without_pycocotools_stops_before_any_work(monkeypatch, tmp_path, capsys, work):
    _without(monkeypatch, "pycocotools")
    out = tmp_path / "out"
    assert main(["coco", "--out", str(out), "--limit", "10"]) == 2
    err = capsys.readouterr().err
    assert err == "vlm-focus eval coco needs pycocotools: pip install 'vlm-focus[eval]'\n"
    assert not out.exists()  # not even the held-out scenes were written


@pytest.mark.parametrize(
    ("command", "plots"), [("pope", "retention.png"), ("coco", "examples.png"), ("chair", None)]
)
def test_without_matplotlib_the_skipped_plot_is_named_before_the_work(
    monkeypatch, tmp_path, capsys, work, command, plots
):
    _without(monkeypatch, "matplotlib")
    assert main([command, "--out", str(tmp_path), "--limit", "1"]) == 2  # stopped by `work`
    lines = capsys.readouterr().err.splitlines()
    expected = (
        []
        if plots is None
        else [
            f"vlm-focus eval {command}: skipping {plots}: matplotlib is not installed; "
            "pip install 'vlm-focus[eval]' (or matplotlib)"
        ]
    )
    assert lines == [
        *expected,
        "work started",
        f"vlm-focus eval {command}: error: stopped after the start of the work",
    ]


@pytest.mark.parametrize("command", ["pope", "chair"])
def test_pope_and_chair_need_no_pycocotools(monkeypatch, tmp_path, capsys, work, command):
    _without(monkeypatch, "pycocotools")
    assert main([command, "--out", str(tmp_path), "--limit", "1"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == "work started"
