"""End-to-end smoke runs of `vlm-focus eval pope|coco|chair` on a tiny random-weight LLaVA with
the organism tokenizer/processor and a few generated scenes: file formats, resume, sweeps,
and the clear errors."""

import csv
import json
import sys

import pytest
import torch

from organism.scenes import CATEGORIES, heldout_scenes, write_dataset
from vlm_focus.eval.chair import SHIPPED_IDS, ObjectWords, extract_objects
from vlm_focus.eval.cli import main
from vlm_focus.eval.metrics import pope_metrics
from vlm_focus.eval.runner import read_jsonl, shard_paths


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    from organism.vocab import SPECS, build_config, build_processor

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    model.save_pretrained(root / "model")
    build_processor(SPECS["tiny"]).save_pretrained(root / "model")
    write_dataset(heldout_scenes(4, min_objects=3), root / "data")
    data = ["--images", str(root / "data"), "--instances", str(root / "data" / "instances.json")]
    return root, ["--model", str(root / "model"), *data, "--threads", "1"]


def test_pope_run_files_and_resume(setup, tmp_path):
    root, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "6"]
    args += ["--batch-size", "4", "--max-new-tokens", "3"]
    assert main(args) == 0
    folder = tmp_path / "pope" / "eval0--model" / "random"
    records = read_jsonl(folder / "unpruned.jsonl")
    assert [r["question_id"] for r in records] == list(range(1, 7))
    fields = {"question_id", "image", "question", "label", "answer", "pred", "parseable"}
    fields |= {"visual_kept", "visual_total", "new_tokens", "prefill_s", "generate_s"}
    assert set(records[0]) == fields
    assert all(r["visual_kept"] == r["visual_total"] == 16 for r in records)  # 4 x 4 grid
    summary = json.loads((folder / "unpruned.json").read_text())
    assert summary["n"] == 6 and summary["unparseable"] == sum(not r["parseable"] for r in records)
    assert summary["prompt_suffix"] == "\nAnswer the question using a single word or phrase."
    assert summary["yes_ratio"] == sum(r["pred"] == "yes" for r in records) / 6
    assert "greedy" in summary["decoding"] and "first '.'" in summary["parse_rule"]
    questions = read_jsonl(
        tmp_path / "pope" / "questions" / "instances-n500-seed0" / "pope_random.jsonl"
    )
    assert len(questions) == 24
    # a re-run with a larger limit keeps the first six answers and adds the rest
    assert main([*args[:-4], "--limit", "12", "--max-new-tokens", "3"]) == 0
    again = read_jsonl(folder / "unpruned.jsonl")
    assert (
        again[:6] == records and len(again) == 12 and shard_paths(folder / "unpruned.jsonl") == []
    )
    table = list(csv.DictReader(open(tmp_path / "pope" / "eval0--model" / "table.csv")))
    assert table[0]["setting"] == "unpruned" and table[0]["n"] == "12"


def test_pope_sweep_table_and_plot(setup, tmp_path):
    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "adversarial", "--limit", "4"]
    args += ["--sweep", "keep=1.0,0.5,0.25", "--pruners", "fastv,random", "--layer", "1"]
    assert main([*args, "--max-new-tokens", "2"]) == 0
    root = tmp_path / "pope" / "eval0--model"
    rows = list(csv.DictReader(open(root / "table.csv")))
    assert [r["setting"] for r in rows] == [
        "unpruned",
        "fastv-k0.5-l1",
        "fastv-k0.25-l1",
        "random-k0.5-l1",
        "random-k0.25-l1",
    ]
    assert [float(r["visual_kept"]) for r in rows] == [16, 8, 4, 8, 4]
    assert (root / "table.md").read_text().startswith("| split | setting |")
    assert (root / "retention.png").read_bytes()[:4] == b"\x89PNG"


def test_pope_table_rows_share_their_questions(setup, tmp_path, capsys):
    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--max-new-tokens", "2"]
    fastv = ["--pruner", "fastv", "--keep", "0.5", "--layer", "1"]
    assert main([*args, *fastv, "--limit", "6"]) == 0
    capsys.readouterr()
    assert main([*args, "--limit", "3"]) == 0  # unpruned on fewer questions
    root = tmp_path / "pope" / "eval0--model"
    rows = {r["setting"]: r for r in csv.DictReader(open(root / "table.csv"))}
    assert [rows[s]["n"] for s in ("unpruned", "fastv-k0.5-l1")] == ["3", "3"]
    first3 = read_jsonl(root / "random" / "fastv-k0.5-l1.jsonl")[:3]
    expected = pope_metrics([r["label"] for r in first3], [r["pred"] for r in first3])
    assert float(rows["fastv-k0.5-l1"]["accuracy"]) == pytest.approx(expected["accuracy"], abs=1e-4)
    assert json.loads((root / "random" / "fastv-k0.5-l1.json").read_text())["n"] == 6
    assert (
        "table (random): every row is scored on the 3 questions all 2 settings answered "
        "(answered: fastv-k0.5-l1 6)" in capsys.readouterr().err
    )
    assert main([*args, "--limit", "6"]) == 0  # the unpruned run catches up: the table grows
    rows = list(csv.DictReader(open(root / "table.csv")))
    assert [r["n"] for r in rows] == ["6", "6"]
    assert "every row is scored" not in capsys.readouterr().err


def test_chair_table_rows_share_their_images(setup, tmp_path, capsys):
    _, common = setup
    args = ["chair", *common, "--out", str(tmp_path), "--max-new-tokens", "3"]
    assert main([*args, "--limit", "3"]) == 0
    assert main([*args, "--limit", "2", "--pruner", "random", "--keep", "0.5", "--layer", "1"]) == 0
    root = tmp_path / "chair" / "eval0--model"
    rows = list(csv.DictReader(open(root / "table.csv")))
    assert [(r["setting"], r["n"]) for r in rows] == [("unpruned", "2"), ("random-k0.5-l1", "2")]
    assert "on the 2 images all 2 settings answered (answered: unpruned 3)" in (
        capsys.readouterr().err
    )


def test_coco_grounding_files(setup, tmp_path):
    _, common = setup
    assert main(["coco", *common, "--out", str(tmp_path), "--limit", "2", "--absent", "2"]) == 0
    root = tmp_path / "coco" / "eval0--model"
    folder = root / "default-layers"  # the map setting: the model's grounding default
    queries = read_jsonl(folder / "queries.jsonl")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["n_images"] == 2 and summary["n_queries"] == len(queries)
    assert sum(not q["present"] for q in queries) == 4
    for q in queries:
        assert 0 <= q["point"][0] <= 192 and 0 <= q["point"][1] <= 192
        assert (q["hit"] is None) == (not q["present"])
        assert all(0.0 <= b["score"] <= 1.0 for b in q["boxes"])
    dets = json.loads((folder / "detections.json").read_text())
    assert all(set(d) == {"image_id", "category_id", "bbox", "score"} for d in dets)
    assert 0.0 <= summary["AP"] <= summary["AP50"] <= 1.0 and 0.0 <= summary["auroc"] <= 1.0
    assert (folder / "examples.png").read_bytes()[:4] == b"\x89PNG"
    assert (root / "table.md").read_text().startswith("| setting | model | layers | heads |")


def test_coco_without_matplotlib_finishes_and_says_so_once(setup, tmp_path, capsys, monkeypatch):
    _, common = setup
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["coco", *common, "--out", str(tmp_path), "--limit", "1", "--absent", "1"]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "is not installed" in line]
    assert notices == [
        "vlm-focus eval coco: skipping examples.png: matplotlib is not installed; "
        "pip install 'vlm-focus[eval]' (or matplotlib)"
    ]
    folder = tmp_path / "coco" / "eval0--model" / "default-layers"
    assert (folder / "summary.json").is_file() and not (folder / "examples.png").exists()


def test_chair_files(setup, tmp_path, capsys):
    _, common = setup
    args = ["chair", *common, "--out", str(tmp_path), "--limit", "3", "--max-new-tokens", "5"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([123]))
    assert main([*args, "--image-ids", str(ids)]) == 2
    assert "not in the set" in capsys.readouterr().err
    assert main(args) == 0  # a seeded sample of the set's images (all 4 here), first 3
    root = tmp_path / "chair" / "eval0--model"
    expected = sorted(s.seed for s in heldout_scenes(4, min_objects=3))[:3]
    records = read_jsonl(root / "unpruned.jsonl")
    assert [r["image_id"] for r in records] == expected
    table = ObjectWords.for_categories(CATEGORIES)
    assert all(r["new_tokens"] <= 5 for r in records)
    assert all(r["objects"] == extract_objects(r["caption"], table) for r in records)
    summary = json.loads((root / "unpruned.json").read_text())
    assert summary["n"] == 3 and summary["prompt"] == "Please describe this image in detail."
    assert summary["decoding"].endswith("max_new_tokens=5")
    assert json.loads((root / "image_ids.json").read_text()) == expected


def test_clear_errors(setup, tmp_path, capsys):
    root, common = setup
    base = ["pope", "--model", str(root / "model"), "--out", str(tmp_path), "--limit", "2"]
    assert main([*base, "--images", str(tmp_path / "nope"), "--instances", "x.json"]) == 2
    assert "image directory not found" in capsys.readouterr().err
    bad = tmp_path / "pope_random.jsonl"
    bad.write_text('{"question_id": 1, "image": "a.png"}\n')
    assert main([*base, "--images", str(root / "data"), "--questions", str(bad)]) == 2
    assert "pope_random.jsonl:1" in capsys.readouterr().err
    row = {"question_id": 1, "image": "gone.png", "text": "Is there a red_circle?", "label": "no"}
    ok = json.loads(json.dumps(row))
    ok.update(question_id=2, image=f"scene_{heldout_scenes(1, min_objects=3)[0].seed}.png")
    bad.write_text(json.dumps(row) + "\n" + json.dumps(ok) + "\n")
    args = [*base, "--images", str(root / "data"), "--questions", str(bad), "--threads", "1"]
    assert main([*args, "--on-missing", "stop"]) == 2
    assert "gone.png" in capsys.readouterr().err
    assert main([*args, "--on-missing", "skip", "--max-new-tokens", "2"]) == 0
    summary = json.loads(
        (tmp_path / "pope" / "eval0--model" / "random" / "unpruned.json").read_text()
    )
    assert summary["n"] == 1 and summary["n_missing_images"] == 1


def test_inputs_without_images_are_refused(setup):
    from vlm_focus.eval.generation import Generator
    from vlm_focus.loading import load_model
    from vlm_focus.setting import RunSetting

    root, _ = setup
    model, processor = load_model(str(root / "model"))
    generator = Generator(model, processor, RunSetting())
    inputs = dict(processor.tokenizer(["Is there a red_circle in the image?"], return_tensors="pt"))
    with pytest.raises(ValueError, match="no image tokens"):
        generator.visual_counts(inputs)


def test_box_share_equals_region_score(setup):
    from vlm_focus import grounding
    from vlm_focus.loading import build_inputs, load_image, load_model

    root, _ = setup
    model, processor = load_model(str(root / "model"))
    scene = heldout_scenes(1, min_objects=3)[0]
    image = load_image(root / "data" / f"scene_{scene.seed}.png")
    inputs = build_inputs(processor, [image], ["Is there a red_circle in the image?"])
    heat = grounding.heatmap(model, inputs, "red_circle", processor=processor, images=[image])
    heat = heat[0][0]
    box = [20.0, 30.0, 70.0, 50.0]
    direct = grounding.region_score(
        model, inputs, box, "red_circle", processor=processor, images=[image]
    )
    assert grounding.box_share(heat, box) == pytest.approx(float(direct[0]), abs=1e-6)


def test_shipped_chair_ids_are_the_organism_heldout_set():
    ids = json.loads(SHIPPED_IDS.read_text())
    assert len(ids) == len(set(ids)) == 500 and ids == sorted(ids)
    assert ids[:12] == [s.seed for s in heldout_scenes(12, min_objects=3)]


def test_pope_with_a_mitigation_and_its_limits(setup, tmp_path, capsys):
    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    assert main([*args, "--mitigate", "attention_reweight", "--max-new-tokens", "2"]) == 0
    folder = tmp_path / "pope" / "eval0--model" / "random"
    summary = json.loads((folder / "unpruned-attention_reweight.json").read_text())
    assert summary["mitigate"] == "attention_reweight" and summary["n"] == 2
    assert summary["mitigation_parameters"] == {
        "strength": 1.0,
        "layers": None,
        "ratio": 0.25,
        "placement": "relevant",
        "skip": 2,
        "suppress": 0.0,
        "heads": 1.0,
    }
    assert main([*args, "--mitigate", "reweight", "--max-new-tokens", "2"]) == 2  # gone
    # mitigations run on a pruned model too; only guided and fixation pruning refuse them
    pruned = [*args, "--mitigate", "attention_reweight", "--pruner", "fastv"]
    pruned += ["--keep", "0.5", "--layer", "1"]
    assert main([*pruned, "--max-new-tokens", "2"]) == 0
    summary = json.loads((folder / "fastv-k0.5-l1-attention_reweight.json").read_text())
    assert summary["mitigate"] == "attention_reweight" and summary["n"] == 2
    assert main([*args, "--mitigate", "visual_beam", "--pruner", "fixation", "--layer", "1"]) == 2
    assert "does not combine with pruner 'fixation'" in capsys.readouterr().err


def test_killed_pope_run_resumes_to_the_uninterrupted_result(setup, tmp_path, monkeypatch):
    from vlm_focus.eval import generation

    _, common = setup
    args = ["pope", *common, "--split", "popular", "--limit", "10", "--batch-size", "3"]
    args += ["--max-new-tokens", "2"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    original = generation.Generator.__call__
    calls = []

    def dying(self, images, prompts, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while answering the third batch
        calls.append(len(prompts))
        return original(self, images, prompts, **kwargs)

    monkeypatch.setattr(generation.Generator, "__call__", dying)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "killed")])
    monkeypatch.setattr(generation.Generator, "__call__", original)
    log = tmp_path / "killed" / "pope" / "eval0--model" / "popular" / "unpruned.shard0.jsonl"
    assert len(read_jsonl(log)) == 6
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0

    def answers(root):
        path = root / "pope" / "eval0--model" / "popular" / "unpruned.jsonl"
        timing = {"prefill_s", "generate_s"}
        return [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(path)]

    whole, resumed = answers(tmp_path / "whole"), answers(tmp_path / "killed")
    assert len(whole) == 10 and resumed == whole


def test_pope_zoom_records_its_options_and_keeps_settings_apart(setup, tmp_path):
    from vlm_focus import zoom

    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    args += ["--max-new-tokens", "2"]
    assert main([*args, "--zoom", "always", "--zoom-layers", "0", "1"]) == 0
    assert main(args) == 0
    root = tmp_path / "pope" / "eval0--model"
    folder = root / "random"
    stored = json.loads((folder / "unpruned-zoom_always-zl0.1.config.json").read_text())
    options = zoom.ZoomOptions(route="always", layers=[0, 1], max_new_tokens=2).to_json()
    assert stored["zoom"] == "always" and stored["zoom_options"] == options
    plain = json.loads((folder / "unpruned.config.json").read_text())
    assert not any(k.startswith("zoom") for k in plain)  # earlier unzoomed logs still resume
    records = read_jsonl(folder / "unpruned-zoom_always-zl0.1.jsonl")
    assert len(records) == 2
    for r in records:
        assert r["routed"] is True and r["confidence"] is None
        # a zoomed row is asked zoomed only; a row whose crop is the whole image, plainly
        assert (r["plain_answer"] is None) == r["zoomed"]
        assert {"plain", "map", "reask", "total"} == set(r["zoom_s"])
        assert r["generate_s"] > 0 and isinstance(r["crops"], list)
    summary = json.loads((folder / "unpruned-zoom_always-zl0.1.json").read_text())
    assert summary["zoom"] == "always" and summary["routed"] == 1.0
    table = {r["setting"]: r for r in csv.DictReader(open(root / "table.csv"))}
    assert set(table) == {"unpruned", "unpruned-zoom_always-zl0.1"}
    assert table["unpruned"]["zoom"] == "never" and table["unpruned-zoom_always-zl0.1"]["routed"]
    assert "unpruned-zoom_always-zl0.1" in (root / "table.md").read_text()


def test_pope_zooms_into_the_written_high_resolution_set(tmp_path):
    """The 576-pixel set of `python -m organism.highres write` runs through eval pope,
    and there the embedded model's crops are smaller than the image."""
    from organism.highres import write_highres

    data = write_highres(tmp_path / "hr", n=2)
    args = ["pope", "--images", str(data), "--threads", "1"]
    args += ["--instances", str(data / "instances.json"), "--out", str(tmp_path / "out")]
    args += ["--questions", str(data / "pope_random.jsonl"), "--limit", "2"]
    assert main([*args, "--max-new-tokens", "2", "--zoom", "always"]) == 0
    (folder,) = (tmp_path / "out" / "pope").glob("*/random")
    records = read_jsonl(folder / "unpruned-zoom_always.jsonl")
    assert len(records) == 2
    for r in records:
        (crop,) = r["crops"]
        assert r["zoomed"] and crop[2] < 576 and crop[3] < 576


def test_pope_adaptive_zoom_routes_by_threshold_and_calibration(setup, tmp_path):
    from vlm_focus import zoom

    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    args += ["--max-new-tokens", "2", "--zoom", "adaptive"]
    folder = tmp_path / "pope" / "eval0--model" / "random"
    assert main([*args, "--zoom-threshold", "0"]) == 0  # threshold 0 routes nothing
    nothing = read_jsonl(folder / "unpruned-zoom_adaptive-t0.jsonl")
    assert [r["routed"] for r in nothing] == [False, False]
    assert all(r["answer"] == r["plain_answer"] and 0 < r["confidence"] <= 1 for r in nothing)
    cal = zoom.calibrate([0.2, 0.4, 0.9], [True, True, False], recall=0.5)
    cal.save(tmp_path / "cal.json")
    assert main([*args, "--zoom-calibration", str(tmp_path / "cal.json")]) == 0
    tag = f"unpruned-zoom_adaptive-t{cal.threshold:.6g}"
    stored = json.loads((folder / f"{tag}.config.json").read_text())
    assert stored["zoom_options"]["threshold"] == cal.threshold
    assert stored["zoom_calibration"] == str(tmp_path / "cal.json")
    routed = [r["routed"] for r in read_jsonl(folder / f"{tag}.jsonl")]
    assert routed == [r["confidence"] < cal.threshold for r in read_jsonl(folder / f"{tag}.jsonl")]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--zoom", "adaptive"], "needs exactly one of zoom_threshold"),
        (["--zoom", "adaptive", "--zoom-threshold", "1.5"], "zoom_threshold=1.5 must be"),
        (["--zoom", "adaptive", "--zoom-threshold", "-0.1"], "zoom_threshold=-0.1 must be"),
        (["--zoom", "always", "--zoom-threshold", "0.5"], "zoom_threshold only apply"),
        (["--zoom-layers", "0"], "zoom_layers only applies"),
        (["--zoom", "adaptive", "--zoom-calibration", "missing.json"], "zoom_calibration file"),
        (["--zoom", "always", "--mitigate", "visual_beam"], "does not combine with mitigation"),
        (["--zoom", "always", "--pruner", "guided"], "does not combine with pruner 'guided'"),
    ],
)
def test_pope_zoom_bad_options_are_named(setup, tmp_path, capsys, extra, message):
    _, common = setup
    args = ["pope", *common, "--out", str(tmp_path), "--split", "random", "--limit", "2"]
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err


def test_killed_zoom_run_resumes_to_the_uninterrupted_result(setup, tmp_path, monkeypatch):
    from vlm_focus.eval import generation

    _, common = setup
    args = ["pope", *common, "--split", "popular", "--limit", "4", "--batch-size", "2"]
    args += ["--max-new-tokens", "2", "--zoom", "always"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    original = generation.Generator.__call__

    def dying(self, images, prompts, **kwargs):
        if dying.calls == 1:
            raise KeyboardInterrupt  # killed while answering the second batch
        dying.calls += 1
        return original(self, images, prompts, **kwargs)

    dying.calls = 0
    monkeypatch.setattr(generation.Generator, "__call__", dying)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "killed")])
    monkeypatch.setattr(generation.Generator, "__call__", original)
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0
    # a different zoom setting is not resumed into this log
    with pytest.raises(ValueError, match="another configuration"):
        from vlm_focus.eval.runner import check_config

        path = tmp_path / "killed" / "pope" / "eval0--model" / "popular"
        stored = json.loads((path / "unpruned-zoom_always.config.json").read_text())
        check_config(path / "unpruned-zoom_always.jsonl", {**stored, "zoom": "adaptive"})

    def answers(root):
        path = root / "pope" / "eval0--model" / "popular" / "unpruned-zoom_always.jsonl"
        timing = {"prefill_s", "generate_s", "zoom_s"}
        return [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(path)]

    whole, resumed = answers(tmp_path / "whole"), answers(tmp_path / "killed")
    assert len(whole) == 4 and resumed == whole
