"""Videos served by vLLM with the plugin equal ``vf.wrap(..., layer=0, budget=...)`` in
transformers (see ``test_vllm_plugin.py`` for the set-up).

On a tiny random-weight Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one video of 4 frames (two temporal
groups of a 4 x 6 merged grid, 48 tokens; Qwen3-VL writes a timestamp before each group), the
attention pruners and ``pool`` set per request, by frame and, on Qwen2-VL and Qwen2.5-VL, by
span, all through one
engine in one batch: greedy tokens, the pruned prompt and the kept tokens equal transformers'.
The unpruned video (keep 1.0) pins the rest: vLLM's prompt, which the reference reads, and its
tokens equal transformers' unpruned run. Both sides read the pixels the vLLM environment's own
video processor makes (the main environment has no torchvision). Requests the plugin cannot
serve get its own message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from test_vllm_plugin import ENGINE_TIMEOUT, _env, _offline, _reference_python  # noqa: E402
from vllm_offline import video_item  # noqa: E402

PROMPT = (
    "<|im_start|>user <|vision_start|><|video_pad|><|vision_end|>where are the red shapes"
    "<|im_end|><|im_start|>assistant "
)
FRAMES, HEIGHT, WIDTH = 4, 32, 48  # px: patches of 4, merged 2 x 2, two frames a group
CLASSES = {
    "qwen2_vl": "VlmFocusQwen2VLForConditionalGeneration",
    "qwen2_5_vl": "VlmFocusQwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "VlmFocusQwen3VLForConditionalGeneration",
}
SETTINGS = {  # family -> [(pruner, keep, budget)]; (None, 1.0, None) is the unpruned video
    "qwen2_vl": [
        (None, 1.0, None),
        ("fastv", 0.25, "frame"),
        ("text", 0.5, "span"),
        ("pool", 0.5, "span"),
    ],
    "qwen2_5_vl": [
        (None, 1.0, None),
        ("fastv", 0.25, "frame"),
        ("fastv", 0.25, "span"),
        ("text", 0.5, "frame"),
        ("debiased", 0.25, "span"),
        ("pool", 0.25, "frame"),
        ("pool", 0.5, "span"),
        ("diverse", 0.25, "span"),
    ],
    "qwen3_vl": [
        (None, 1.0, None),
        ("fastv", 0.25, "frame"),
        ("diverse", 0.25, "frame"),
        ("text", 0.5, "frame"),
        ("debiased", 0.25, "frame"),
        ("pool", 0.25, "frame"),
    ],
}
BAD = {  # family -> [(request, words its error must hold)]
    "qwen2_vl": [({"vlm_focus_budget": "all"}, ["budget", "all"])],
    "qwen2_5_vl": [({"vlm_focus_pruner": "pyramid"}, ["pyramid", "does not prune videos"])],
    "qwen3_vl": [({"vlm_focus_budget": "span"}, ["budget='span'", "frame"])],
}


def _request(pruner, keep, budget) -> dict:
    if pruner is None:
        return {"vlm_focus_keep": 1.0}
    return {"vlm_focus_pruner": pruner, "vlm_focus_keep": keep, "vlm_focus_budget": budget}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def family(request) -> str:
    return request.param


def _build(family: str, path: Path) -> Path:
    command = [_reference_python(), str(HERE / "transformers_side.py"), "build", str(path), family]
    subprocess.run(command, check=True, cwd=REPO, timeout=300)
    return path


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> Path:
    import numpy as np

    path = _build(family, tmp_path_factory.mktemp(f"tiny_{family}"))
    rng = np.random.default_rng(1)
    frames = (rng.random((FRAMES, HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
    np.save(path / "video.npy", frames)
    return path


def test_served_video_equals_transformers(family, model_dir, tmp_path):
    import torch
    from transformers import AutoVideoProcessor

    video = str(model_dir / "video.npy")
    settings = SETTINGS[family]
    cases = [{"prompt": PROMPT, "video": video, "request": _request(*s)} for s in settings]
    cases += [
        {"prompt": PROMPT, "video": video, "request": request, "expect_error": True}
        for request, _ in BAD[family]
    ]
    overrides = {"architectures": [CLASSES[family]], "vlm_focus": {"pruner": "fastv"}}
    result = _offline(model_dir, cases, tmp_path, overrides)
    outputs = result["outputs"]

    frames, _ = video_item(video)
    processor = AutoVideoProcessor.from_pretrained(model_dir)
    pixels = processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    full_ids = torch.tensor([outputs[0]["prompt_token_ids"]])  # the unpruned video's prompt
    inputs = {"input_ids": full_ids, **pixels}
    if family == "qwen2_5_vl":  # its time axis: frames a temporal group apart, in seconds
        inputs["second_per_grid_ts"] = torch.tensor([2 / video_item(video)[1]["fps"]])
    reference = [
        {"inputs": inputs, "pruner": pruner, "keep": keep, "budget": budget}
        for pruner, keep, budget in settings
    ]
    torch.save(reference, tmp_path / "inputs.pt")
    command = [
        _reference_python(),
        str(HERE / "transformers_side.py"),
        "run-inputs",
        str(model_dir),
        str(tmp_path / "inputs.pt"),
        str(tmp_path / "expected.json"),
    ]
    subprocess.run(command, check=True, cwd=REPO, timeout=600)
    expected = json.loads((tmp_path / "expected.json").read_text())

    config = json.loads((model_dir / "config.json").read_text())
    token = config["video_token_id"]
    grid = pixels["video_grid_thw"][0].tolist()
    n = grid[0] * grid[1] * grid[2] // 4
    assert expected[0]["n"] == n == outputs[0]["prompt_token_ids"].count(token)
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    per_frame = n // grid[0]
    for setting, want, output in zip(settings, expected, outputs, strict=False):
        assert output["prompt_token_ids"].count(token) == len(want["kept"]), setting
        assert (want["n"], tuple(want["kept"])) in recorded, setting
        assert output["tokens"] == want["tokens"], setting
        if setting[2] == "frame":  # every frame its share
            counts = [sum(k // per_frame == f for k in want["kept"]) for f in range(grid[0])]
            assert max(counts) - min(counts) <= 1, (setting, counts)
    for (request, words), output in zip(BAD[family], outputs[len(settings) :], strict=True):
        assert output["error"] is not None, request
        for word in words:
            assert word in output["error"], (request, output["error"])


def test_evs_is_refused_with_the_plugins_own_message(tmp_path):
    """vLLM's own video pruning (``--video-pruning-rate``) would prune the video twice (the
    refusal is the Qwen-VL classes' shared one, shown on Qwen2.5-VL)."""
    family = "qwen2_5_vl"
    model_dir = _build(family, tmp_path / "model")
    (tmp_path / "cases.json").write_text(json.dumps([{"prompt": PROMPT, "video": "unused"}]))
    overrides = {"architectures": [CLASSES[family]], "vlm_focus": {"pruner": "fastv"}}
    command = [
        sys.executable,
        str(HERE / "vllm_offline.py"),
        str(model_dir),
        str(tmp_path / "cases.json"),
        str(tmp_path / "out.json"),
        json.dumps(overrides),
        json.dumps({"video_pruning_rate": 0.5}),
    ]
    run = subprocess.run(
        command, cwd=tmp_path, env=_env(), timeout=ENGINE_TIMEOUT, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "--video-pruning-rate (EVS) cannot be combined" in run.stdout + run.stderr
