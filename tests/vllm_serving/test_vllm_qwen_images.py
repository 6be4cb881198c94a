"""Qwen2-VL, Qwen3-VL and Qwen3-VL's mixture-of-experts model served by vLLM with the plugin
equal ``vf.wrap(..., layer=0, budget="frame")`` in transformers (see ``test_vllm_plugin.py`` for
the set-up, which tests Qwen2.5-VL the same way).

On a tiny random-weight model of each class (Qwen3-VL's: interleaved M-RoPE, per-head q/k
norms, DeepStack after layers 0 and 1; its MoE model the same with 4 experts), every pruner the
class serves, prompts with one, two and three images of different shapes (``pool``), all
through one engine in one batch: greedy tokens, the pruned prompt's placeholder count and the
kept cells equal transformers'. The unpruned reference is checked against vLLM's own class
first, so a difference can only come from the plugin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_plugin import _offline, _transformers_run  # noqa: E402
from test_vllm_video import _build  # noqa: E402
from transformers_side import prompt_text  # noqa: E402

QUESTION = "where are the red shapes"
CASES = [  # (images, pruner, keep, per-request mm_processor_kwargs or None: the server's)
    (["image.png"], "fastv", 0.25, None),
    (["image.png"], "text", 0.5, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.5}),
    (["wide.png"], "debiased", 0.25, {"vlm_focus_pruner": "debiased"}),
    (["image.png"], "pyramid", 0.25, {"vlm_focus_pruner": "pyramid"}),
    (["square.png"], "pool", 0.5, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.5}),
    (["wide.png"], "diverse", 0.25, {"vlm_focus_pruner": "diverse"}),
    (["image.png", "square.png"], "pool", 0.25, {"vlm_focus_pruner": "pool"}),
    (
        ["wide.png", "square.png", "image.png"],
        "pool",
        19,
        {"vlm_focus_pruner": "pool", "vlm_focus_keep": 19},
    ),
]
CLASSES = {
    "qwen2_vl": "VlmFocusQwen2VLForConditionalGeneration",
    "qwen3_vl": "VlmFocusQwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "VlmFocusQwen3VLMoeForConditionalGeneration",
}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> Path:
    return _build(family, tmp_path_factory.mktemp(f"tiny_{family}"))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("reference")
    cases = [
        {"prompt": prompt_text(QUESTION, len(images)), "images": images, "pruner": p, "keep": k}
        for images, p, k, _ in [(["image.png"], None, 1.0, None), *CASES]
    ]
    return _transformers_run(model_dir, cases, work)


def _cases(model_dir: Path, settings) -> list[dict]:
    return [
        {
            "prompt": prompt_text(QUESTION, len(images)),
            "images": [str(model_dir / name) for name in images],
            "request": request,
        }
        for images, _, _, request in settings
    ]


def test_vllms_own_class_equals_transformers_unpruned(model_dir, reference, tmp_path):
    result = _offline(
        model_dir, _cases(model_dir, [(["image.png"], None, 1.0, None)]), tmp_path, None
    )
    assert result["outputs"][0]["tokens"] == reference[0]["tokens"]


def test_served_images_equal_transformers(family, model_dir, reference, tmp_path):
    overrides = {
        "architectures": [CLASSES[family]],
        "vlm_focus": {"pruner": "fastv", "keep": 0.25},
    }
    result = _offline(model_dir, _cases(model_dir, CASES), tmp_path, overrides)
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for setting, want, output in zip(CASES, reference[1:], result["outputs"], strict=True):
        kept = want["kept_per_image"]
        assert output["prompt_token_ids"].count(image_token) == sum(map(len, kept)), setting
        for n, cells in zip(want["n_per_image"], kept, strict=True):
            assert (n, tuple(cells)) in recorded, setting
        assert output["tokens"] == want["tokens"], setting


def test_a_video_to_onevision_gets_the_plugins_own_message():
    from vlm_focus.integrations.vllm._llava_onevision import VlmFocusLlavaOnevisionProcessingInfo

    info = object.__new__(VlmFocusLlavaOnevisionProcessingInfo)  # the check reads no model
    with pytest.raises(ValueError, match="prunes images only"):
        info.validate_num_items("video", 1)
    assert info.get_supported_mm_limits() == {"image": None}
