"""One meaning per option: the API, `vlm-focus run|bench`, `vlm-focus eval pope|coco|chair` and
the demo read each option from one dataclass definition (same default, same parsing, help
generated from it); `keep` has one rule; pruner options are discoverable; timing is paired and
says its spread; eval tables accumulate; bad input gets a clear error."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import vlm_focus as vf
from vlm_focus import cli
from vlm_focus.config import FocusConfig, parse_keep, read_keep
from vlm_focus.core.options import default_of, flag, help_text, options
from vlm_focus.eval import cli as eval_cli
from vlm_focus.eval.chair_run import ChairConfig
from vlm_focus.eval.coco_run import CocoConfig
from vlm_focus.eval.common import model_tag
from vlm_focus.eval.pope_run import PopeConfig
from vlm_focus.eval.runner import read_jsonl
from vlm_focus.loading import LoadOptions
from vlm_focus.model_adapters import get_adapter
from vlm_focus.timing import NOTHING_PRUNED

README = Path(__file__).resolve().parent.parent / "docs" / "pruners.md"
FOCUS = [
    o.name for o in options(FocusConfig, cli_only=True)
]  # pruner, keep, layer, query_rows, reduce, budget
LOAD = [
    o.name for o in options(LoadOptions, cli_only=True)
]  # model, device, attn, trust_remote_code


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    from organism.scenes import heldout_scenes, write_dataset
    from organism.vocab import SPECS, build_config, build_processor

    root = tmp_path_factory.mktemp("options")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()  # 2 layers
    model.save_pretrained(root / "model")
    build_processor(SPECS["tiny"]).save_pretrained(root / "model")
    scenes = heldout_scenes(4, min_objects=3)
    write_dataset(scenes, root / "data")
    data = ["--images", str(root / "data"), "--instances", str(root / "data" / "instances.json")]
    image = root / "data" / f"scene_{scenes[0].seed}.png"
    return root, ["--model", str(root / "model"), *data, "--threads", "1"], image


# --- one definition of each option, read by every entry point -----------------------------------
def _demo_load_options(argv):
    from vlm_focus.core.options import parse_config
    from vlm_focus.demo import app

    return parse_config(LoadOptions, app._parser().parse_args(argv))


ENTRY_POINTS = {
    "run": (lambda argv: cli.parse(["run", *argv]), FOCUS + LOAD),
    "bench": (lambda argv: cli.parse(["bench", *argv]), [n for n in FOCUS if n != "keep"] + LOAD),
    "eval pope": (lambda argv: eval_cli.parse(["pope", *argv]), FOCUS + LOAD),
    "eval coco": (lambda argv: eval_cli.parse(["coco", *argv]), LOAD),
    "eval chair": (lambda argv: eval_cli.parse(["chair", *argv]), FOCUS + LOAD),
    "demo": (_demo_load_options, LOAD),
}


def _sample(cls, name):
    """A value other than the default, from the field's own definition, as text."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = default_of(cls, name)
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    if isinstance(default, bool):
        return True
    if name == "pruner":
        return next(p for p in vf.pruners() if p != default)
    if name == "keep":
        return "0.5"
    if isinstance(default, int):
        return str(default - 1)
    return "some/where"


@pytest.mark.parametrize("name", FOCUS + LOAD)
def test_each_option_has_one_default_and_one_parsing_across_entry_points(name):
    cls = FocusConfig if name in FOCUS else LoadOptions
    sample = _sample(cls, name)
    # eval's pruning options apply with a pruner (without one they stay None: unpruned)
    base = ["--pruner", "fastv"] if name in FOCUS and name != "pruner" else []
    argv = [*base, flag(name)] if sample is True else [*base, flag(name), str(sample)]
    parsed = {}
    for entry, (parse, names) in ENTRY_POINTS.items():
        if name not in names:
            continue
        default = getattr(parse(base), name)
        if entry.startswith("eval") and name == "pruner":
            assert default is None  # eval measures the unpruned model unless asked
        else:
            assert default == default_of(cls, name), entry
        parsed[entry] = getattr(parse(argv), name)
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    typed = sample if sample is True else f.metadata.get("parse", str)(sample)
    if name == "keep":
        typed = read_keep(typed)  # the API takes numbers; command lines read text
    api = getattr(cls(**{name: typed}), name)
    assert len(parsed) >= 2 and set(map(repr, parsed.values())) == {repr(api)}, parsed


def test_the_demo_page_takes_its_pruning_defaults_from_focus_config():
    from vlm_focus.demo.widgets import page_widgets

    widgets = {name: w.value for name, w in page_widgets(n_layers=99).items()}
    assert (
        widgets
        == {"pruner": "fastv", "keep": 0.25, "layer": 2}
        == {name: getattr(FocusConfig(), name) for name in widgets}
    )


@pytest.mark.parametrize(
    "command",
    [["run"], ["bench"], ["pruners"], ["eval", "pope"], ["eval", "coco"], ["eval", "chair"]],
)
def test_help_prints_every_default_generated_from_the_dataclass(command, capsys):
    configs = {
        "run": cli.RunConfig,
        "bench": cli.BenchConfig,
        "pope": PopeConfig,
        "coco": CocoConfig,
        "chair": ChairConfig,
    }
    main = eval_cli.main if command[0] == "eval" else cli.main
    with pytest.raises(SystemExit):
        main([*command[1:], "--help"] if command[0] == "eval" else [*command, "--help"])
    text = re.sub(r"\s+", "", capsys.readouterr().out)
    cls = configs.get(command[-1])
    if cls is None:
        return
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True) and not (cls is cli.BenchConfig and f.name == "keep"):
            assert re.sub(r"\s+", "", help_text(f)) in text, f.name


def test_help_texts_say_what_runs():
    chair = {f.name: help_text(f) for f in dataclasses.fields(ChairConfig)}
    assert "(default: 512, the protocol's; 64 on the embedded model)" in chair["max_new_tokens"]
    assert "see --help" not in chair["prompt"]
    assert "'Please describe this image in detail.'" in chair["prompt"]
    assert ChairConfig().new_tokens == 64 and ChairConfig(model="x/y").new_tokens == 512
    coco = {f.name: help_text(f) for f in dataclasses.fields(CocoConfig)}
    assert "{question} is the POPE question" in coco["prompt"] and "'{question}" in coco["prompt"]
    run = {f.name: help_text(f) for f in dataclasses.fields(cli.RunConfig)}
    assert run["layer"].endswith("(default: 2)") and run["query_rows"].endswith("(default: text)")


def test_the_earlier_query_name_is_refused():
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments (no abbreviations)
        cli.parse(["run", "--query", "text"])
    with pytest.raises(TypeError, match="query"):
        FocusConfig(query="text")
    with pytest.raises(ValueError, match="query"):
        vf.wrap(_tiny(), keep=0.5, layer=1, query="text")


# --- keep: one rule, one parser ---------------------------------------------------------------
KEEP_CASES = [
    (1, None, "keep=1 is ambiguous: pass 1.0 to keep every visual token, or a count >= 2"),
    (1.0, 1.0, None),
    (2.5, None, "keep=2.5: a ratio must lie in (0, 1]; a count is an int >= 2"),
    (0, None, "keep=0: a count must be >= 2 (a ratio is a float in (0, 1])"),
    (-1, None, "keep=-1: a count must be >= 2"),
    (np.float32(0.5), 0.5, None),
    (np.int64(8), 8, None),
    (17, 17, None),  # a count: checked against the input's visual tokens when it runs
]


def _outcome(fn):
    try:
        return fn(), None
    except ValueError as err:
        return None, str(err)


@pytest.mark.parametrize("value, expected, message", KEEP_CASES)
def test_keep_reads_the_same_in_the_api_and_every_command_line(value, expected, message):
    text = str(value)
    outcomes = {
        "parse_keep": _outcome(lambda: parse_keep(value)),
        "FocusConfig": _outcome(lambda: FocusConfig(keep=value).keep),
        "run": _outcome(lambda: cli.parse(["run", "--keep", text]).keep),
        "bench": _outcome(lambda: cli.parse(["bench", "--keeps", text]).keep_values()[0]),
        "eval pope": _outcome(
            lambda: eval_cli.parse(["pope", "--pruner", "fastv", "--keep", text]).keep
        ),
        "eval chair": _outcome(
            lambda: eval_cli.parse(["chair", "--pruner", "text", "--keep", text]).keep
        ),
    }
    for where, (got, error) in outcomes.items():
        if message is None:
            assert error is None and got == expected and type(got) is type(expected), where
        else:
            assert got is None and error.startswith(message), (where, error)


def test_the_api_refuses_keep_as_text_which_the_command_lines_read():
    for value in ["0.5", "64"]:
        with pytest.raises(ValueError, match=f"keep='{value}' has type str; keep takes"):
            FocusConfig(keep=value)
        with pytest.raises(ValueError, match="has type str"):
            vf.wrap(_tiny(), keep=value)
    assert (read_keep("0.5"), read_keep("64"), read_keep(" 1.0 ")) == (0.5, 64, 1.0)
    assert cli.parse(["run", "--keep", "64"]).keep == 64


def test_a_schedule_whose_keeps_grow_is_refused():
    for keep in [(0.125, 0.25, 0.5), (0.25, 0.25), (16, 32)]:
        with pytest.raises(ValueError, match="each stage must keep less than the stage before"):
            FocusConfig(keep=keep, layer=tuple(range(len(keep))))
    assert FocusConfig(keep=(0.5, 0.25), layer=(1, 2)).keep == (0.5, 0.25)
    assert FocusConfig(keep=(32, 16), layer=(1, 2)).keep == (32, 16)


def test_keep_of_a_wrong_type_names_the_type():
    for value, kind in [(True, "bool"), (torch.tensor(0.5), "Tensor"), (None, "NoneType")]:
        with pytest.raises(ValueError, match=f"has type {kind}; keep takes a float ratio"):
            vf.wrap(_tiny(), keep=value)
    with pytest.raises(ValueError, match="keep='half' is not a number"):
        cli.parse(["run", "--keep", "half"])


def test_a_count_above_the_visual_count_fails_alike_in_the_api_and_run(setup, capsys):
    root, _, image = setup
    from vlm_focus.loading import build_inputs, load_image, load_model

    model, processor = load_model(str(root / "model"))
    inputs = build_inputs(processor, load_image(image), "Describe the image.")
    with vf.wrap(model, keep=17, layer=1), pytest.raises(ValueError) as api:
        model(**inputs)
    argv = ["run", "--model", str(root / "model"), "--image", str(image), "--layer", "1"]
    assert cli.main([*argv, "--keep", "17", "--repeats", "1"]) == 2
    assert f"vlm-focus run: error: {api.value}" in capsys.readouterr().err
    assert str(api.value) == "keep=17 is more than the 16 visual tokens of this input"


def test_eval_pruning_options_without_a_pruner_are_an_error(capsys):
    with pytest.raises(ValueError, match=r"keep=0\.25 only applies with a pruner, and none was"):
        eval_cli.parse(["pope", "--keep", "0.25"])
    with pytest.raises(ValueError, match="pruner_option='base=text' only applies with a pruner"):
        eval_cli.parse(["pope", "--pruner-option", "base=text"])
    with pytest.raises(ValueError, match="layer=1, query_rows='text' only apply with a pruner"):
        PopeConfig(layer=1, query_rows="text")
    assert eval_cli.main(["chair", "--query-rows", "text"]) == 2
    assert "pass pruner (--pruner NAME, e.g. fastv)" in capsys.readouterr().err
    sweep = eval_cli.parse(["pope", "--layer", "1", "--sweep", "keep=1.0,0.5"])
    assert sweep.layer == 1 and sweep.pruner is None  # a sweep brings its own pruners
    unpruned = eval_cli.parse(["pope", "--limit", "3"])
    assert unpruned.keep is None and not unpruned.pruned
    assert dataclasses.replace(unpruned, limit=4).limit == 4  # a config round-trips


def test_empty_prompts_are_refused_everywhere():
    for argv in (["run", "--prompt", ""], ["run", "--prompt", "  "]):
        with pytest.raises(ValueError, match="is empty: type a question"):
            cli.parse(argv)
    for argv in (["chair", "--prompt", ""], ["coco", "--prompt", " "]):
        with pytest.raises(ValueError, match="is empty"):
            eval_cli.parse(argv)
    with pytest.raises(ValueError, match=r"must contain \{question\} .* or \{category\}"):
        eval_cli.parse(["coco", "--prompt", "Is it there?"])


def test_the_text_pruner_without_an_instruction_says_so():
    model = _tiny()
    from tiny_models import make_inputs

    inputs = make_inputs("llava", model, prompt_len=0)
    ids = inputs["input_ids"]
    image = get_adapter(model).visual_mask(model, ids)
    last = int(torch.nonzero(image[0]).max())
    inputs = {
        **inputs,
        "input_ids": ids[:, : last + 1],
        "attention_mask": inputs["attention_mask"][:, : last + 1],
    }
    with vf.wrap(model, pruner="text", keep=0.5, layer=1):
        with pytest.raises(ValueError, match="has no text after its image; add an instruction"):
            model(**inputs)


# --- discoverable options -----------------------------------------------------------------------
def test_pruner_options_list_every_field_with_type_default_and_help():
    for name in vf.pruners():
        cls = vf.pruners.get_pruner(name).Options
        infos = vf.pruner_options(name)
        assert [i.name for i in infos] == [f.name for f in dataclasses.fields(cls)]
        for info, f in zip(infos, dataclasses.fields(cls), strict=True):
            assert info.help and info.help == f.metadata["help"], (name, f.name)
            assert info.default == default_of(cls, f.name)
            assert info.type == (f.type if isinstance(f.type, str) else f.type.__name__)
    (seed,) = vf.pruner_options("random")
    assert (seed.name, seed.type, seed.default) == ("seed", "int", 0)
    assert vf.pruners.get_pruner("debiased") is vf.pruners.get_pruner("debiased")
    with pytest.raises(ValueError, match="unknown pruner 'nope'; registered: debiased"):
        vf.pruner_options("nope")
    with pytest.raises(AttributeError, match="vlm_focus.pruners has no 'get'; it has: "):
        vf.pruners.get  # noqa: B018


def test_the_pruners_command_prints_every_option(capsys):
    assert cli.main(["pruners"]) == 0
    out = capsys.readouterr().out
    for name in vf.pruners():
        assert re.search(rf"^{name}: ", out, re.M)
        for info in vf.pruner_options(name):
            assert f"    {info.name}" in out and info.help in out
    shared = ", ".join(o.name for o in options(FocusConfig, cli_only=True))
    assert shared in out


def test_readme_pruner_options_table_is_the_generated_one():
    text = README.read_text()
    start = text.index("<!-- pruner-options:start")
    start = text.index("\n", start) + 1
    end = text.index("<!-- pruner-options:end -->")
    assert text[start:end] == vf.pruners.pruner_options_markdown()


# --- honest timing, accumulating tables, eval coco maps -----------------------------------------
def test_bench_prints_paired_ratios_with_their_spread_and_count(setup, capsys):
    root, _, image = setup
    argv = ["bench", "--model", str(root / "model"), "--image", str(image), "--layer", "1"]
    assert cli.main([*argv, "--keeps", "1.0,0.5", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "each keep timed in 3 pairs alternating with the unpruned model" in out
    rows = [line for line in out.splitlines() if line.startswith("keep=")]
    assert len(rows) == 2 and rows[1].startswith("keep=0.5   kept    8/16")
    assert rows[0].endswith(f"kept   16/16   {NOTHING_PRUNED}")
    base, pruned, ratio, low, high = map(
        float,
        re.search(
            r"prefill (\S+) ms unpruned -> (\S+) ms pruned: (\S+)x \(median of 3 alternating "
            r"pairs, min-max (\S+)-(\S+)\)",
            rows[1],
        ).groups(),
    )
    assert low <= ratio <= high
    assert ratio == pytest.approx(base / pruned, abs=0.06)  # the shown times give the ratio


def test_the_timing_shown_is_the_pair_its_ratio_comes_from():
    from vlm_focus.timing import PairedTiming, prefill_report

    # medians of each side taken apart (92.1 ms vs 35.7 ms) would disagree with the pairs
    timing = PairedTiming([0.0921, 0.030, 0.100], [0.0357, 0.040, 0.030])
    assert timing.ratio == pytest.approx(0.0921 / 0.0357)
    assert (timing.base_seconds, timing.other_seconds) == (0.0921, 0.0357)
    assert prefill_report(timing, 36, 144).startswith(
        "prefill 92.1 ms unpruned -> 35.7 ms pruned: 2.58x (median of 3 alternating pairs, "
        "min-max 0.75-3.33)"
    )
    assert prefill_report(timing, 144, 144) == NOTHING_PRUNED


def test_run_with_nothing_pruned_says_so_instead_of_a_speed_up(setup, capsys):
    root, _, image = setup
    argv = ["run", "--model", str(root / "model"), "--image", str(image), "--keep", "1.0"]
    argv += ["--layer", "1"]
    assert cli.main([*argv, "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert f"timing    {NOTHING_PRUNED}" in out and "x (median" not in out


def test_pruner_options_on_the_command_lines(setup, capsys):
    root, _, image = setup
    argv = ["run", "--model", str(root / "model"), "--image", str(image), "--layer", "1"]
    argv += ["--pruner", "debiased", "--pruner-option", "base=text", "--pruner-option"]
    argv += ["positional=false", "--json", "--max-new-tokens", "1", "--repeats", "1"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["options"] == {"base": "text", "positional": False}
    assert cli.main(["run", "--pruner", "debiased", "--pruner-option", "bse=text"]) == 2
    assert "pruner 'debiased' has no option 'bse'; it takes: base," in capsys.readouterr().err
    bench = cli.parse(["bench", "--pruner", "pyramid", "--pruner-option", "alpha=0.3,tiles=3"])
    assert bench.focus().options == {"alpha": 0.3, "tiles": 3}
    pope = eval_cli.parse(["pope", "--pruner", "random", "--pruner-option", "seed=3"])
    setting = pope.setting()
    assert setting.focus.options == {"seed": 3} and setting.tag == "random-k0.25-l2-seed_3"
    with pytest.raises(ValueError, match="positional='maybe' must be true or false"):
        cli.parse(["run", "--pruner", "debiased", "--pruner-option", "positional=maybe"])
    with pytest.raises(ValueError, match="takes a Python object"):
        cli.parse(["run", "--pruner", "guided", "--pruner-option", "guide=x"])


def test_paired_timing_flags_a_wide_spread():
    from vlm_focus.timing import PairedTiming

    steady = PairedTiming([2.0, 2.0, 2.1], [1.0, 1.0, 1.0])
    assert steady.ratio == 2.0 and steady.trusted and steady.warning() is None
    assert steady.summary() == "2.00x (min-max 2.00-2.10 over 3 alternating pairs)"
    noisy = PairedTiming([2.0, 5.8, 2.0], [1.0, 1.0, 1.0])
    assert not noisy.trusted and "spread by 190% of their median" in noisy.warning()
    assert "too few" in PairedTiming([1.0], [1.0]).warning()


def test_run_reports_the_paired_spread(setup, capsys):
    root, _, image = setup
    argv = ["run", "--model", str(root / "model"), "--image", str(image), "--layer", "1"]
    assert cli.main([*argv, "--repeats", "2", "--json", "--max-new-tokens", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["timing_pairs"] == 2 and report["timing_trusted"] is False
    assert (
        report["prefill_speedup_min"] <= report["prefill_speedup"] <= report["prefill_speedup_max"]
    )
    assert (report["keep"], report["layer"], report["query_rows"]) == (0.25, 1, "text")
    assert (report["visual_kept"], report["visual_total"]) == (4, 16)


def test_two_pope_calls_leave_both_rows_in_the_table(setup, tmp_path):
    _, common = setup[:2]
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    args += ["--max-new-tokens", "2"]
    assert eval_cli.main(args) == 0
    assert eval_cli.main([*args, "--pruner", "random", "--keep", "0.5", "--layer", "1"]) == 0
    root = tmp_path / "pope" / model_tag(common[1])
    table = (root / "table.md").read_text()
    assert "| random | unpruned |" in table and "| random | random-k0.5-l1 |" in table
    assert (root / "retention.png").read_bytes()[:4] == b"\x89PNG"
    assert "random-k0.5-l1" in (root / "table.csv").read_text()


def test_chair_query_rows_last_changes_the_recorded_setting_and_the_scores(setup, tmp_path):
    _, common = setup[:2]
    args = ["chair", *common, "--out", str(tmp_path), "--limit", "3", "--max-new-tokens", "6"]
    args += ["--pruner", "fastv", "--keep", "0.25", "--layer", "0", "--reduce", "mean"]
    assert eval_cli.main(args) == 0
    assert eval_cli.main([*args, "--query-rows", "last"]) == 0
    root = tmp_path / "chair" / model_tag(common[1])
    text = json.loads((root / "fastv-k0.25-l0-rmean.json").read_text())
    last = json.loads((root / "fastv-k0.25-l0-qlast-rmean.json").read_text())
    assert (last["query_rows"], text["query_rows"]) == ("last", "text")
    captions = [
        [r["raw"] for r in read_jsonl(root / f"{s['setting']}.jsonl")] for s in (last, text)
    ]
    assert captions[0] != captions[1]
    scores = ("CHAIR_i", "CHAIR_s", "recall", "length", "mentions")
    assert [last[k] for k in scores] != [text[k] for k in scores]
    table = (root / "table.md").read_text()
    assert "fastv-k0.25-l0-rmean |" in table and "fastv-k0.25-l0-qlast-rmean |" in table


def test_coco_maps_from_chosen_layers_and_heads(setup, tmp_path):
    from vlm_focus import grounding
    from vlm_focus.eval.coco import DEFAULT_TEMPLATE, query_prompt
    from vlm_focus.loading import build_inputs, load_image, load_model

    root, common = setup[:2]
    args = ["coco", *common, "--out", str(tmp_path), "--limit", "1", "--absent", "1"]
    assert eval_cli.main([*args, "--layers", "0"]) == 0
    heads = tmp_path / "heads.json"
    grounding.save_heads(grounding.LocalizationHeads("llava", 2, 4, [(1, 0), (1, 3)]), heads)
    assert eval_cli.main([*args, "--heads", str(heads)]) == 0
    assert eval_cli.main([*args, "--heads", "1:0,1:3"]) == 0
    out = tmp_path / "coco" / model_tag(common[1])
    layer0 = read_jsonl(out / "layers0" / "queries.jsonl")
    summary = json.loads((out / "layers0" / "summary.json").read_text())
    assert summary["layers"] == "0" and "0, every head" in summary["map_rule"]
    by_file = read_jsonl(out / "heads-heads" / "queries.jsonl")
    assert [q["point"] for q in by_file] == [
        q["point"] for q in read_jsonl(out / "heads-1.0_1.3" / "queries.jsonl")
    ]
    model, processor = load_model(str(root / "model"))
    q = layer0[0]
    image = load_image(root / "data" / f"scene_{q['image_id']}.png")
    inputs = build_inputs(processor, [image], [query_prompt(DEFAULT_TEMPLATE, q["category"])])
    heat = grounding.heatmap(
        model, inputs, q["category"], processor=processor, images=[image], layers=[0]
    )[0][0]
    assert list(grounding.point(heat)) == q["point"]
    table = (out / "table.md").read_text()
    assert all(f"| {s} |" in table for s in ("layers0", "heads-heads", "heads-1.0_1.3"))
    with pytest.raises(ValueError, match="give layer:head pairs"):
        eval_cli.parse(["coco", "--heads", "1-0"])


def _tiny():
    from tiny_models import make_model

    return make_model("llava")


def test_no_warning_leaks_from_the_defaults():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cli.parse(["run"]), eval_cli.parse(["pope"]), FocusConfig()


# --- a first run: an unreachable hub, a missing plotting library ---------------------------------
def test_an_unreachable_hub_is_one_line(monkeypatch, capsys):
    from huggingface_hub import HfApi

    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    assert cli.main(["run", "--model", "some-org/some-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlm-focus run: error: model 'some-org/some-model' is not a local ")
    assert "the hub cannot be reached" in err and "\n" not in err and "Traceback" not in err
    assert cli.main(["run", "--model", str(Path(__file__).parent)]) == 2
    assert "is a folder without config.json" in capsys.readouterr().err


def test_a_plot_without_matplotlib_is_a_notice_not_a_failure(setup, tmp_path, monkeypatch, capsys):
    import sys

    _, common = setup[:2]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    args += ["--max-new-tokens", "2", "--pruner", "random", "--keep", "0.5", "--layer", "1"]
    assert eval_cli.main(args) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert list((tmp_path / "pope").rglob("table.md"))


def test_a_prompt_that_ends_with_its_image_prunes_with_the_default_rows():
    from tiny_models import make_inputs

    model = _tiny()
    inputs = make_inputs("llava", model, prompt_len=0, batch=2)
    ids = inputs["input_ids"]
    last = int(torch.nonzero(get_adapter(model).visual_mask(model, ids)[0]).max())
    cut = {**inputs, "input_ids": ids[:1, : last + 1]}
    cut["attention_mask"] = inputs["attention_mask"][:1, : last + 1]
    cut["pixel_values"] = inputs["pixel_values"][:1]
    with vf.wrap(model, keep=0.5, layer=1) as text_rows:  # query_rows="text", the default
        expected = model(**cut).logits
    with vf.wrap(model, keep=0.5, layer=1, query_rows="last") as last_row:
        assert torch.equal(model(**cut).logits, expected)
    assert torch.equal(text_rows.last_trace.kept[0], last_row.last_trace.kept[0])
