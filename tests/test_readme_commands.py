"""The documentation's pruning commands (README and docs pages) prune where their claim is
measured: on the embedded organism at layer 0 (it reads the image there; at vf.wrap's default
layer 2 every pruner, random included, keeps its POPE answers), and a video with budget "frame"
at layer 0 (the budget that answers more there; "span" answers more at layer 2:
benchmarks/results/qwen_organism.md)."""

from __future__ import annotations

import shlex

from doc_pages import commands

from vlm_focus import FocusConfig
from vlm_focus.cli import parser as run_parser
from vlm_focus.eval.cli import parser as eval_parser


def argv(program: str) -> list[tuple[str, list[str]]]:
    """``(page, argv after vlm-focus)`` of every ``vlm-focus <program>`` command."""
    return [(page, shlex.split(line)[1:]) for page, line in commands(program)]


def test_the_pruning_evaluations_of_the_embedded_model_prune_at_layer_0():
    checked = []
    for page, args_list in argv("eval"):
        try:
            args = eval_parser().parse_args(args_list[1:])
        except SystemExit:  # a placeholder such as pope|coco|chair
            continue
        prunes = getattr(args, "sweep", None) or getattr(args, "pruner", None)
        if not prunes or getattr(args, "model", None) is not None:
            continue
        layer = getattr(args, "layer", FocusConfig().layer)  # only given options are set
        assert layer == 0, f"{page}: {' '.join(args_list)}"
        checked.append(args_list)
    assert any("--sweep" in args_list for args_list in checked)


def test_the_video_examples_use_the_budget_measured_best_at_their_layer():
    checked = []
    for page, args_list in argv("run") + argv("bench"):
        if "--video" not in args_list or args_list[-1] == "--video":  # the option named
            continue
        args = run_parser().parse_args(args_list)
        layer = getattr(args, "layer", FocusConfig().layer)  # only given options are set
        best = "frame" if layer == 0 else "span"
        assert getattr(args, "budget", FocusConfig().budget) == best, f"{page}: {args_list}"
        checked.append(args_list)
    assert checked
