"""Qwen3.5 served by vLLM with the plugin equals ``vf.wrap(..., layer=0, budget="frame")`` in
transformers (see ``test_vllm_plugin.py`` for the set-up).

On a tiny random-weight Qwen3.5 (Gated DeltaNet layers 0, 2, 3 around full-attention layer 1:
gated queries, q/k norms, partial interleaved M-RoPE), prompts with one and two images and a
video of 4 frames (``budget="frame"``; a timestamp before each temporal group, as Qwen3-VL)
through one engine in one batch: greedy tokens, the pruned prompt's placeholder count and the
kept cells equal transformers', for every pruner the class serves. Layer 0 is linear, so the
attention pruners (``fastv``, ``text``, ``debiased``) score with layer 1 on both sides (the
adapter's ``"next_full"`` rule); ``pyramid``, ``pool`` and ``diverse`` read no attention. The
unpruned image and video (keep 1.0) pin the rest: vLLM's hybrid decoder on the plugin's positions
equals transformers' unpruned run. vLLM's CPU Gated DeltaNet runs in bfloat16 only (it asserts so),
so the engine runs in bfloat16 against the float32 reference: the kept cells are equal, and the
greedy tokens equal step by step up to the first step where the reference's two best logits lie
within bfloat16's error (``TIE``); a continuation may part there, never before.

Qwen3.5's mixture-of-experts model (``qwen3_5_moe``: the same class with mixture-of-experts
MLPs) runs an unpruned image, ``fastv`` and ``pool`` through its own engine.
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
from test_vllm_plugin import _offline, _reference_python, _transformers_run  # noqa: E402
from test_vllm_video import FRAMES, HEIGHT, PROMPT, WIDTH  # noqa: E402
from transformers_side import prompt_text  # noqa: E402
from vllm_offline import video_item  # noqa: E402

QUESTION = "where are the red shapes"
UNPRUNED = (["image.png"], None, 1.0, {"vlm_focus_keep": 1.0})
CASES = {  # family -> [(images, pruner, keep, per-request mm_processor_kwargs or None)]
    "qwen3_5": [
        UNPRUNED,
        (["image.png"], "fastv", 0.25, None),  # None: the server's setting
        (["image.png"], "text", 0.5, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.5}),
        (["wide.png"], "debiased", 0.25, {"vlm_focus_pruner": "debiased"}),
        (["image.png"], "pyramid", 0.25, {"vlm_focus_pruner": "pyramid"}),
        (["image.png"], "pool", 0.25, {"vlm_focus_pruner": "pool"}),
        (["wide.png"], "diverse", 0.25, {"vlm_focus_pruner": "diverse"}),
        (
            ["image.png", "square.png"],
            "pool",
            0.5,
            {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.5},
        ),
    ],
    # the same class with mixture-of-experts MLPs: its own engine, so the fewest cases
    "qwen3_5_moe": [
        UNPRUNED,
        (["image.png"], "fastv", 0.25, None),
        (["image.png"], "pool", 0.25, {"vlm_focus_pruner": "pool"}),
    ],
}
VIDEO = {  # family -> [(pruner, keep)], by frame; the first (keep 1.0) is the unpruned video
    "qwen3_5": [(None, 1.0), ("fastv", 0.25), ("pool", 0.5), ("diverse", 0.25)],
    "qwen3_5_moe": [],
}
CLASSES = {
    "qwen3_5": "VlmFocusQwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "VlmFocusQwen3_5MoeForConditionalGeneration",
}
ENGINE = {"dtype": "bfloat16"}  # vLLM's CPU Gated DeltaNet asserts bfloat16
#: Logit gap under which bfloat16 may pick the other of the reference's two best tokens (the
#: tiny model's gaps run 0.0004 to 0.2; a gap of 0.009 was still followed).
TIE = 0.02


@pytest.fixture(scope="module", params=sorted(CLASSES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> Path:
    import numpy as np

    path = tmp_path_factory.mktemp(f"tiny_{family}")
    subprocess.run(
        [_reference_python(), str(HERE / "transformers_side.py"), "build", str(path), family],
        check=True,
        cwd=REPO,
        timeout=300,
    )
    rng = np.random.default_rng(1)
    frames = (rng.random((FRAMES, HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
    np.save(path / "video.npy", frames)
    return path


@pytest.fixture(scope="module")
def reference(family, model_dir, tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("reference")
    cases = [
        {"prompt": prompt_text(QUESTION, len(images)), "images": images, "pruner": p, "keep": k}
        for images, p, k, _ in CASES[family]
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


def _assert_same_greedy(got: list[int], want: dict, setting) -> None:
    """vLLM's greedy tokens ``got`` equal the reference's up to the first step where the
    reference was within ``TIE`` of choosing otherwise."""
    for step, (token, expected, gap) in enumerate(
        zip(got, want["tokens"], want["margins"], strict=True)
    ):
        if token != expected:
            assert gap < TIE, (setting, step, got, want["tokens"], gap)
            return


def _video_reference(
    model_dir: Path, prompt_ids: list[int], settings: list[tuple], work: Path
) -> list[dict]:
    """``transformers_side.py run-inputs`` on the video's pixels, as the vLLM environment's
    video processor makes them, in vLLM's unpruned prompt ``prompt_ids``."""
    import torch
    from transformers import AutoVideoProcessor

    frames, _ = video_item(str(model_dir / "video.npy"))
    processor = AutoVideoProcessor.from_pretrained(model_dir)
    pixels = processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    inputs = {"input_ids": torch.tensor([prompt_ids]), **pixels}
    cases = [
        {"inputs": inputs, "pruner": pruner, "keep": keep, "budget": "frame"}
        for pruner, keep in settings
    ]
    torch.save(cases, work / "inputs.pt")
    command = [
        _reference_python(),
        str(HERE / "transformers_side.py"),
        "run-inputs",
        str(model_dir),
        str(work / "inputs.pt"),
        str(work / "expected.json"),
    ]
    subprocess.run(command, check=True, cwd=REPO, timeout=600)
    return json.loads((work / "expected.json").read_text())


def test_served_qwen3_5_equals_transformers(family, model_dir, reference, tmp_path):
    cases, video = CASES[family], str(model_dir / "video.npy")
    videos = [
        {
            "prompt": PROMPT,
            "video": video,
            "request": {"vlm_focus_pruner": pruner or "fastv", "vlm_focus_keep": keep},
        }
        for pruner, keep in VIDEO[family]
    ]
    overrides = {
        "architectures": [CLASSES[family]],
        "vlm_focus": {"pruner": "fastv", "keep": 0.25},
    }
    result = _offline(model_dir, _cases(model_dir, cases) + videos, tmp_path, overrides, ENGINE)
    assert result["plugin_loaded"]
    config = json.loads((model_dir / "config.json").read_text())
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    images, served_videos = result["outputs"][: len(cases)], result["outputs"][len(cases) :]
    for setting, want, output in zip(cases, reference, images, strict=True):
        kept = want["kept_per_image"]
        assert output["prompt_token_ids"].count(config["image_token_id"]) == sum(map(len, kept))
        for n, cells in zip(want["n_per_image"], kept, strict=True):
            assert (n, tuple(cells)) in recorded, setting
        _assert_same_greedy(output["tokens"], want, setting)

    if not videos:
        return
    ids = served_videos[0]["prompt_token_ids"]  # the unpruned video's prompt
    expected = _video_reference(model_dir, ids, VIDEO[family], tmp_path)
    token = config["video_token_id"]
    n = expected[0]["n"]
    assert n == served_videos[0]["prompt_token_ids"].count(token) == 48
    for setting, want, output in zip(VIDEO[family], expected, served_videos, strict=True):
        assert output["prompt_token_ids"].count(token) == len(want["kept"]), setting
        assert (want["n"], tuple(want["kept"])) in recorded, setting
        _assert_same_greedy(output["tokens"], want, setting)
        counts = [sum(k // (n // 2) == f for k in want["kept"]) for f in range(2)]
        assert max(counts) - min(counts) <= 1, (setting, counts)  # every frame its share


def test_the_scoring_layer_is_the_adapters_and_a_stand_in_is_refused():
    """vLLM's decoder layers carry the adapter's names (``linear_attn`` on a Gated DeltaNet
    layer, ``self_attn`` on a full one), so the adapter's rule picks among them; its
    ``"delta_qk"`` stand-in reads transformers' DeltaNet modules, which vLLM fuses."""
    import dataclasses

    from torch import nn

    from vlm_focus.integrations.vllm._layer0 import VllmLayerAdapter, scoring_layer
    from vlm_focus.model_adapters.qwen3_5 import QWEN3_5

    def layer(kind: str) -> nn.Module:
        module, mixer = nn.Module(), nn.Module()
        mixer.head_k_dim = 128  # what the stand-in reads of a DeltaNet
        setattr(module, kind, mixer)
        return module

    layers = [layer(k) for k in ("linear_attn", "linear_attn", "self_attn", "linear_attn")]
    assert (
        scoring_layer(VllmLayerAdapter(scoring_layer_of=QWEN3_5.scoring_layer_of), layers)
        is (layers[2])
    )
    delta = dataclasses.replace(QWEN3_5, linear_scoring="delta_qk")
    with pytest.raises(ValueError, match="linear_scoring='next_full'"):
        scoring_layer(VllmLayerAdapter(scoring_layer_of=delta.scoring_layer_of), layers)
