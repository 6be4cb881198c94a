"""The demo app without a browser: safe launch defaults, start-up errors, page outputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import LlavaForConditionalGeneration

from organism.vocab import SPECS, build_config, build_processor
from vlm_focus.config import FocusConfig
from vlm_focus.demo import app
from vlm_focus.demo.result import DemoResult, FrameMap, GroundedMap
from vlm_focus.demo.served import Served
from vlm_focus.grounding import Box
from vlm_focus.timing import PairedTiming


class FakeBlocks:
    def __init__(self):
        self.calls = {}

    def queue(self, **kwargs):
        self.calls["queue"] = kwargs
        return self

    def launch(self, **kwargs):
        self.calls["launch"] = kwargs


def test_defaults_bind_localhost_without_share_and_with_a_bounded_queue():
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    args = app._parser().parse_args([])
    assert (args.host, args.port, args.share, args.trust_remote_code) == (
        "127.0.0.1",
        7860,
        False,
        False,
    )
    demo = FakeBlocks()
    app.launch(demo, args)
    assert demo.calls["queue"] == {"default_concurrency_limit": 2, "max_size": 16}
    launch = demo.calls["launch"]
    assert launch["server_name"] == "127.0.0.1" and launch["server_port"] == 7860
    assert launch["share"] is False and launch["inbrowser"] is False
    assert launch["max_file_size"] == 64 * 1024 * 1024
    assert launch["ssr_mode"] is False


def test_opt_ins_reach_launch():
    args = app._parser().parse_args(
        ["--host", "0.0.0.0", "--port", "8123", "--share", "--concurrency", "3"]
    )
    demo = FakeBlocks()
    app.launch(demo, args)
    assert demo.calls["queue"]["default_concurrency_limit"] == 3
    launch = demo.calls["launch"]
    assert (launch["server_name"], launch["server_port"], launch["share"]) == (
        "0.0.0.0",
        8123,
        True,
    )


def test_the_command_line_says_how_to_share_in_its_own_words(capsys):
    """``vlm-focus demo`` takes ``--share``: its banner says so, and gradio's own, which tells
    a script to set ``share=True`` in ``launch()``, stays quiet."""
    demo = FakeBlocks()
    app.launch(demo, app._parser().parse_args([]))
    assert capsys.readouterr().out == (
        "vlm-focus demo: serving on http://127.0.0.1:7860; no public link (start with --share "
        "to make one)\n"
    )
    assert demo.calls["launch"]["quiet"] is True
    app.launch(FakeBlocks(), app._parser().parse_args(["--share", "--port", "8123"]))
    assert capsys.readouterr().out == (
        "vlm-focus demo: serving on http://127.0.0.1:8123; a public gradio link follows (--share)\n"
    )


def test_theme_uses_local_fonts_only():
    args = app._parser().parse_args([])
    demo = FakeBlocks()
    app.launch(demo, args)
    theme = demo.calls["launch"]["theme"]
    assert theme._font + theme._font_mono == app.LOCAL_FONTS + app.LOCAL_MONO  # system fonts
    assert theme._stylesheets == []  # no web font stylesheet to fetch


def test_unsupported_model_is_refused_before_loading_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert app.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlm-focus demo: cannot load the model: unsupported model type 'bert'")
    assert "Traceback" not in err


def test_missing_model_is_a_message(tmp_path, capsys):
    assert app.main(["--model", str(tmp_path / "nothing-here")]) == 2
    assert capsys.readouterr().err.startswith("vlm-focus demo: cannot load the model:")


def test_bad_queue_options(capsys):
    assert app.main(["--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err


def test_outputs_of_a_failure_and_a_success():
    failed = app.outputs_of(DemoResult(ok=False, message="No image."))
    assert failed == (
        "**Could not answer.** No image.",
        "",
        "",
        "",
        "",
        None,
        None,
        [],
        [],
        None,
        "",
        None,
        [],
    )
    image = np.zeros((8, 8, 3), np.uint8)
    m = GroundedMap("red_circle", image + 1, [Box(1, 2, 3, 4, 0.5)], [0.75])
    ok = DemoResult(
        ok=True,
        notices=["Downscaled."],
        image=image,
        answer="yes",
        answer_unpruned="no",
        prompt_map=m,
        object_maps=[m],
        kept_overlay=image + 2,
        n_kept=36,
        n_visual=144,
        timing=PairedTiming([0.020, 0.021, 0.019], [0.010, 0.010, 0.010]),
        seconds=1.25,
    )
    outputs = app.outputs_of(ok)
    status, answer, unpruned, mitigated, stats, heat, kept, gallery, table, fixation = outputs[:10]
    assert fixation is None  # a prefill pruner: no per-step fixation
    assert outputs[10:] == ("", None, [])  # no zoom asked for, no video
    assert status == "Done in 1.2 s. Downscaled."
    assert (answer, unpruned, mitigated) == ("yes", "no", "")
    assert stats == (
        "**36 / 144 visual tokens kept (25%)**  \n"
        "prefill 20.0 ms unpruned -> 10.0 ms pruned: 2.00x (median of 3 alternating pairs, "
        "min-max 1.90-2.10)"
    )
    assert (heat == 1).all() and (kept == 2).all()
    assert [caption for _, caption in gallery] == ["red_circle: 0.75"]
    assert table == [["red_circle", 1, 2, 3, 4, 0.75, ""], ["red_circle", 1, 2, 3, 4, 0.75, ""]]
    absent = GroundedMap("blue_square", image, [], [], presence=0.012, present=False)
    ok.object_maps = [absent]
    _, _, _, _, _, _, _, gallery, table, *_ = app.outputs_of(ok)
    assert [caption for _, caption in gallery] == ["blue_square: not found"]
    assert table[1] == ["blue_square", None, None, None, None, None, "not found (0.012)"]


def test_build_app_serves_the_model_and_names_the_endpoint():
    import gradio as gr

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    demo = app.build_app(model, build_processor(SPECS["tiny"]))
    assert isinstance(demo, gr.Blocks)
    config = demo.get_config_file()
    names = [d.get("api_name") for d in config["dependencies"]]
    assert "answer" in names
    layer = next(c for c in config["components"] if c["props"].get("label") == "Prune at layer")
    assert (layer["props"]["minimum"], layer["props"]["maximum"]) == (0, 1)  # 2 decoder layers
    sample = next(c for c in config["components"] if c["props"].get("elem_id") == "sample")
    assert len(sample["props"]["choices"]) >= 1


def test_every_input_of_the_answer_endpoint_may_be_left_out():
    """An API call about a video sends no image: no parameter of /answer is required, and
    each defaults to the page's own value."""
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    demo = app.build_app(model, build_processor(SPECS["tiny"]))
    parameters = demo.get_api_info()["named_endpoints"]["/answer"]["parameters"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in parameters}
    assert all(p["parameter_has_default"] for p in parameters), parameters
    focus = FocusConfig()
    assert defaults == {
        "image_value": None,
        "prompt_value": app.DEFAULT_QUESTION,
        "pruner_value": focus.pruner,
        "keep_value": focus.keep,
        "layer_value": 1,  # the default layer, on a model of 2 decoder layers
        "mit_value": "none",
        "zoom_value": False,
        "options_value": "",
        "video_value": None,
        # FocusConfig's other command-line options, after the first API's inputs
        "query_rows_value": focus.query_rows,
        "reduce_value": focus.reduce,
        "budget_value": focus.budget,
        "positions_value": focus.positions,
        "video_pruner_value": focus.video_pruner,
    }


@pytest.mark.parametrize("payload", [None])
def test_unreadable_upload_reaches_the_request_function(payload, tmp_path):
    import gradio as gr
    from gradio.data_classes import ImageData

    image = gr.Image(type="filepath", image_mode=None)
    app._let_unreadable_files_through(image)
    assert image.preprocess(payload) is None
    bad = tmp_path / "bad.png"
    bad.write_text("not a picture")
    assert image.preprocess(ImageData(path=str(bad), orig_name="bad.png")) == str(bad)


def test_model_panel_refuses_an_unsupported_model_and_keeps_serving(tmp_path):
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    processor = build_processor(SPECS["tiny"])
    served = Served(model, processor)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    ok, message = served.load(str(tmp_path))
    assert not ok
    assert message.startswith(
        "The model could not be loaded; still serving `LlavaForConditionalGeneration`. "
        "unsupported model type 'bert'"
    )
    assert served.model is model and served.processor is processor
    assert served.load("  ") == (False, "Type a model folder or hub id to load.")


def test_model_panel_loads_a_supported_model(tmp_path):
    torch.manual_seed(1)
    spec = SPECS["guide"]
    LlavaForConditionalGeneration(build_config(spec)).save_pretrained(tmp_path)
    build_processor(spec).save_pretrained(tmp_path)
    torch.manual_seed(0)
    tiny = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    served = Served(tiny, build_processor(SPECS["tiny"]))
    ok, message = served.load(str(tmp_path))
    assert ok and message == f"Now serving `{tmp_path}` (llava)."
    assert served.n_layers == spec.text_layers == 3
    assert served.model.config.vision_config.patch_size == spec.patch


def test_embedded_models_are_named_as_such():
    from types import SimpleNamespace

    from organism import guide_model_path

    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(guide_model_path())))
    assert Served(model, None).name == "organism-guide (embedded)"
    model.config._name_or_path = "llava-hf/llava-1.5-7b-hf"
    assert Served(model, None).name == "llava-hf/llava-1.5-7b-hf"


def test_outputs_of_a_zoom_come_before_the_frame_maps():
    image = np.zeros((8, 8, 3), np.uint8)
    ok = DemoResult(
        ok=True, image=image, answer="no", answer_zoomed="yes", zoomed=True, zoom_overlay=image + 3
    )
    outputs = app.outputs_of(ok)
    assert len(outputs) == 13 and outputs[1] == "no"
    assert outputs[10] == "yes" and (outputs[11] == 3).all() and outputs[12] == []


# --- a video ----------------------------------------------------------------------------------
def test_outputs_of_a_video_are_the_answers_and_a_captioned_gallery_of_frames():
    frame = np.zeros((4, 6, 3), np.uint8)
    maps = [
        FrameMap([0, 2], [0.0, 0.5], 0.75, frame + 1),
        FrameMap([5], [1.25], 0.25, frame + 2),
    ]
    result = DemoResult(
        ok=True, answer="two frames", video=True, frame_maps=maps, n_kept=24, n_visual=48
    )
    outputs = app.outputs_of(result)
    assert outputs[1] == "two frames" and outputs[4].startswith("**24 / 48 visual tokens kept")
    assert outputs[5] is None and outputs[6] is None and outputs[8] == []  # image-only
    gallery = outputs[12]
    assert [caption for _, caption in gallery] == [
        "frames 0-2 (0.00-0.50 s): 75%",
        "frame 5 (1.25 s): 25%",
    ]
    assert [int(overlay.max()) for overlay, _ in gallery] == [1, 2]


def _answer_function(demo):
    return next(f for f in demo.fns.values() if f.api_name == "answer")


def test_the_video_input_feeds_the_answer_endpoint_and_its_frame_gallery():
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    answer = _answer_function(app.build_app(model, build_processor(SPECS["tiny"])))
    inputs = [c.elem_id for c in answer.inputs]
    assert inputs[0] == "image" and inputs[8] == "video"  # appended: old API calls still fit
    assert inputs[9:] == ["query_rows", "reduce", "budget", "positions", "video_pruner"]
    assert [c.elem_id for c in answer.outputs][-1] == "frame-maps"


def test_the_page_shows_a_videos_frames_and_hides_the_image_outputs(tmp_path):
    from test_demo_request import VIDEO_QUESTION, write_video
    from tiny_models import make_model
    from tiny_processors import tiny_processor

    model = make_model("qwen2_5_vl")
    respond = _answer_function(app.build_app(model, tiny_processor(model))).fn
    clip = write_video(tmp_path / "clip.mp4", frames=4)
    values = respond(None, VIDEO_QUESTION, "fastv", 0.5, 1, "none", False, "", str(clip))
    assert values[0].startswith("Done in"), values[0]
    gallery = values[12]
    assert gallery["visible"] is True
    assert [caption.rsplit(":", 1)[0] for _, caption in gallery["value"]] == [
        "frames 0-1 (0.00-0.25 s)",
        "frames 2-3 (0.50-0.75 s)",
    ]
    assert values[5] is None and values[6] is None and values[8] == []  # image-only outputs
    with pytest.warns(UserWarning, match="Both an image and a video"):
        both = respond(
            np.zeros((32, 48, 3), np.uint8),
            VIDEO_QUESTION,
            "fastv",
            0.5,
            1,
            "none",
            False,
            "",
            str(clip),
        )
    assert both[0] == (
        "**Could not answer.** Both an image and a video were given: clear one of them, the "
        "demo asks about one at a time."
    )
    assert both[12]["visible"] is False


def test_a_video_hides_the_image_only_outputs_until_it_is_cleared():
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    demo = app.build_app(model, build_processor(SPECS["tiny"]))
    toggle = next(f for f in demo.fns.values() if [c.elem_id for c in f.inputs] == ["video"])
    assert [c.elem_id for c in toggle.outputs] == ["heatmap", "kept-mask", "boxes"]
    assert [u["visible"] for u in toggle.fn("clip.mp4")] == [False] * 3
    assert [u["visible"] for u in toggle.fn(None)] == [True] * 3
