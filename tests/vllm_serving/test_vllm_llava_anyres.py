"""LLaVA-NeXT and LLaVA-OneVision served by vLLM with the plugin equal ``vf.wrap(..., layer=0)``
in transformers, kept tokens at their original positions (see ``test_vllm_plugin.py`` for the
set-up).

On a tiny random-weight model of each class: two images whose anyres layouts differ (64 x 32 px: two
crops; 50 x 38 px: an unpadded, cut grid), ``fastv``, ``text``, ``debiased`` (whose padding fix
reads the original image size and the model adapter's geometry) and ``pool`` set per request, all
through one engine in one batch: greedy tokens and kept tokens equal transformers'. Both sides
read the pixels the vLLM environment's own processor makes (the main environment lacks
torchvision, and anyres resizing differs between image-processor back ends). A video gets the
plugin's own message.
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
from test_vllm_plugin import _offline, _reference_python  # noqa: E402

PROMPT = "<s> user <image> where are the red shapes assistant"
SETTINGS = [  # (pruner, keep, per-request mm_processor_kwargs)
    ("fastv", 0.25, {"vlm_focus_pruner": "fastv", "vlm_focus_keep": 0.25}),
    ("text", 0.5, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.5}),
    ("debiased", 0.25, {"vlm_focus_pruner": "debiased", "vlm_focus_keep": 0.25}),
    ("pool", 0.25, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.25}),
]
IMAGES = ("wide.png", "odd.png")
CLASSES = {
    "llava_next": "VlmFocusLlavaNextForConditionalGeneration",
    "llava_onevision": "VlmFocusLlavaOnevisionForConditionalGeneration",
}


def _main_env(*args: str) -> None:
    command = [_reference_python(), str(HERE / "transformers_next.py"), *args]
    subprocess.run(command, check=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module", params=sorted(CLASSES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    _main_env("build", str(path), family)
    return path


def test_served_anyres_llava_equals_transformers(family, model_dir, tmp_path):
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    cases, keys = [], []
    for name in IMAGES:
        image = Image.open(model_dir / name).convert("RGB")
        inputs = dict(processor(images=image, text=PROMPT, return_tensors="pt"))
        for pruner, keep, _ in SETTINGS:
            cases.append({"inputs": inputs, "pruner": pruner, "keep": keep})
            keys.append((name, pruner, keep))
    torch.save(cases, tmp_path / "inputs.pt")
    _main_env("run", str(model_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "expected.json"))
    expected = json.loads((tmp_path / "expected.json").read_text())
    requests = [
        {"prompt": PROMPT, "image": str(model_dir / name), "request": request}
        for name in IMAGES
        for _, _, request in SETTINGS
    ]
    # a video, which neither class takes: its error, after the batch
    frames = (np.random.default_rng(0).random((4, 32, 48, 3)) * 255).astype(np.uint8)
    np.save(tmp_path / "video.npy", frames)
    requests.append({"prompt": PROMPT, "video": str(tmp_path / "video.npy"), "expect_error": True})
    overrides = {"architectures": [CLASSES[family]], "vlm_focus": {"pruner": "fastv", "keep": 0.25}}
    result = _offline(model_dir, requests, tmp_path, overrides)
    video_error = result["outputs"].pop()["error"]
    assert "prunes images only" in video_error, video_error
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_index"]
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for key, want, output in zip(keys, expected, result["outputs"], strict=True):
        assert output["prompt_token_ids"].count(image_token) == len(want["kept"]), key
        assert (want["n"], tuple(want["kept"])) in recorded, key
        assert output["tokens"] == want["tokens"], key
