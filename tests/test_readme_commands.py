"""The README's pruning commands prune where their claim is measured: on the embedded organism
at layer 0 (it reads the image there; at vf.wrap's default layer 2 every pruner, random
included, keeps its POPE answers), and a video with budget "frame" at layer 0 (the budget that
answers more there; "span" answers more at layer 2: benchmarks/results/qwen_organism.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from vlm_focus import FocusConfig
from vlm_focus.cli import parser as run_parser
from vlm_focus.eval.cli import parser as eval_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def commands(program: str) -> list[list[str]]:
    """Every ``vlm-focus <program> ...`` command of the README, from bash blocks and inline
    code, as argv after ``vlm-focus``."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(f"vlm-focus {program} "):
                found.append(line)
    for span in re.findall(r"`(vlm-focus [^`]+)`", README):
        span = " ".join(span.split())
        if span.startswith(f"vlm-focus {program} "):
            found.append(span)
    return [shlex.split(c)[1:] for c in found]


def test_the_readme_pruning_evaluations_of_the_embedded_model_prune_at_layer_0():
    checked = []
    for argv in commands("eval"):
        try:
            args = eval_parser().parse_args(argv[1:])
        except SystemExit:  # a placeholder such as pope|coco|chair
            continue
        prunes = getattr(args, "sweep", None) or getattr(args, "pruner", None)
        if not prunes or getattr(args, "model", None) is not None:
            continue
        layer = getattr(args, "layer", FocusConfig().layer)  # only given options are set
        assert layer == 0, " ".join(argv)
        checked.append(argv)
    assert any("--sweep" in argv for argv in checked)


def test_the_readme_video_examples_use_the_budget_measured_best_at_their_layer():
    checked = []
    for argv in commands("run") + commands("bench"):
        if "--video" not in argv or argv[-1] == "--video":  # the option named, not a command
            continue
        args = run_parser().parse_args(argv)
        layer = getattr(args, "layer", FocusConfig().layer)  # only given options are set
        best = "frame" if layer == 0 else "span"
        assert getattr(args, "budget", FocusConfig().budget) == best, " ".join(argv)
        checked.append(argv)
    assert checked
