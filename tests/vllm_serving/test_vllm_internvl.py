"""InternVL (Hugging Face format) served by vLLM with the plugin equals ``vf.wrap(...,
layer=0, budget="frame")`` in transformers, kept tokens at their original positions (see
``test_vllm_plugin.py`` for the set-up).

On a tiny random-weight InternVL: three images whose tile counts differ (64 x 32 px: 2 tiles and
a thumbnail; 50 x 38 px: 3 x 2 tiles and a thumbnail; 32 x 32 px: one tile) under ``fastv`` (the
server's default), ``text``, ``debiased``, ``pyramid`` and ``pool`` (score-free), and a prompt
with two images under ``pool``, all through one engine in one batch, in prefill chunks of 16
tokens (an image's block spans several): greedy tokens and their logprobs, the pruned prompt's
ids (``<img>`` and ``</img>`` around each image's kept tokens) and the kept tokens equal
transformers'. Both sides read the pixels the vLLM environment's own processor makes. A video
gets the plugin's own message. A second engine, with ``positions="compact"``, equals
``vf.wrap(..., positions="compact")`` on ``fastv`` and ``pool``.
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

PROMPT = "<s> user <IMG_CONTEXT> where are the red shapes assistant"
TWO_IMAGES = "<s> user <IMG_CONTEXT> and <IMG_CONTEXT> where are the red shapes assistant"
SETTINGS = [  # (pruner, keep, per-request mm_processor_kwargs or None for the server default)
    ("fastv", 0.25, None),
    ("text", 0.11, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.11}),
    ("debiased", 0.25, {"vlm_focus_pruner": "debiased", "vlm_focus_keep": 0.25}),
    ("pool", 0.25, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.25}),
    ("pyramid", 0.25, {"vlm_focus_pruner": "pyramid", "vlm_focus_keep": 0.25}),
    ("diverse", 0.25, {"vlm_focus_pruner": "diverse", "vlm_focus_keep": 0.25}),
]
IMAGES = ("wide.png", "odd.png", "square.png")
#: the two-image prompt's images and its setting (a score-free pruner: the attention pruners
#: score one image per prompt)
PAIR = (("wide.png", "odd.png"), ("pool", 0.25, {"vlm_focus_pruner": "pool"}))
#: (image, setting) served by a second engine with positions="compact"
COMPACT = [("wide.png", SETTINGS[0]), ("odd.png", SETTINGS[3])]
OVERRIDES = {
    "architectures": ["VlmFocusInternVLForConditionalGeneration"],
    "vlm_focus": {"pruner": "fastv", "keep": 0.25},
}
#: Prefill chunks of this many tokens. vLLM sizes its encoder cache from the profiling image at
#: the server's keep, so no request here keeps more than 0.25.
CHUNK = 16


def _main_env(*args: str) -> None:
    command = [_reference_python(), str(HERE / "transformers_internvl.py"), *args]
    subprocess.run(command, check=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_internvl")
    _main_env("build", str(path))
    return path


def _processed(model_dir: Path, names: tuple[str, ...], prompt: str) -> dict:
    """The vLLM environment's own processor outputs for ``names`` under ``prompt``."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    images = [Image.open(model_dir / name).convert("RGB") for name in names]
    return dict(processor(images=images, text=prompt, return_tensors="pt"))


def _assert_equal(cases: list[dict], expected: list[dict], result: dict) -> None:
    """vLLM's tokens, logprobs, pruned prompt and kept tokens are vf.wrap's, case by case."""
    import torch

    assert result["plugin_loaded"]
    recorded = [(r["n"], tuple(r["kept"])) for r in result["kept"]]
    for case, want, output in zip(cases, expected, result["outputs"], strict=True):
        key = (case["pruner"], case["keep"], want["n"], case.get("positions"))
        assert output["prompt_token_ids"] == want["pruned_ids"], key
        assert output["tokens"] == want["tokens"], key
        assert output["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), key
        if len(want["sizes"]) == 1:  # vLLM records each image's kept tokens
            assert (want["n"], tuple(want["kept"])) in recorded, key
        else:
            first, second = want["sizes"]
            kept = torch.tensor(want["kept"])
            assert (first, tuple(kept[kept < first].tolist())) in recorded, key
            assert (second, tuple((kept[kept >= first] - first).tolist())) in recorded, key


def _cases(model_dir: Path) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per engine ("original", "compact"): the transformers cases and the vLLM requests."""
    out = {"original": ([], []), "compact": ([], [])}
    cases, requests = out["original"]
    for name in IMAGES:
        inputs = _processed(model_dir, (name,), PROMPT)
        for pruner, keep, request in SETTINGS:
            cases.append({"inputs": inputs, "pruner": pruner, "keep": keep})
            requests.append({"prompt": PROMPT, "image": str(model_dir / name), "request": request})
    names, (pruner, keep, request) = PAIR
    cases.append(
        {"inputs": _processed(model_dir, names, TWO_IMAGES), "pruner": pruner, "keep": keep}
    )
    paths = [str(model_dir / name) for name in names]
    requests.append({"prompt": TWO_IMAGES, "images": paths, "request": request})
    cases, requests = out["compact"]
    for name, (pruner, keep, request) in COMPACT:
        inputs = _processed(model_dir, (name,), PROMPT)
        cases.append({"inputs": inputs, "pruner": pruner, "keep": keep, "positions": "compact"})
        requests.append({"prompt": PROMPT, "image": str(model_dir / name), "request": request})
    return out


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict[str, tuple[list, list, list[dict]]]:
    """Per engine: its cases, its requests and vf.wrap's outputs (one transformers run)."""
    import torch

    work = tmp_path_factory.mktemp("reference")
    cases = _cases(model_dir)
    everything = [case for kind in cases.values() for case in kind[0]]
    torch.save(everything, work / "inputs.pt")
    _main_env("run", str(model_dir), str(work / "inputs.pt"), str(work / "expected.json"))
    expected = iter(json.loads((work / "expected.json").read_text()))
    return {
        kind: (these, requests, [next(expected) for _ in these])
        for kind, (these, requests) in cases.items()
    }


def test_served_internvl_equals_transformers(model_dir, reference, tmp_path):
    import numpy as np

    cases, requests, expected = reference["original"]
    assert {want["n"] for want in expected[:-1]} == {48, 112, 16}  # 3, 7 and 1 tile views
    # a video, which the class does not take: its error, after the batch
    frames = (np.random.default_rng(0).random((4, 32, 32, 3)) * 255).astype(np.uint8)
    np.save(tmp_path / "video.npy", frames)
    video = {"prompt": "<s> user <video> where assistant", "video": str(tmp_path / "video.npy")}
    requests = [*requests, {**video, "expect_error": True}]
    result = _offline(model_dir, requests, tmp_path, OVERRIDES, {"max_num_batched_tokens": CHUNK})
    video_error = result["outputs"].pop()["error"]
    assert "prunes images only" in video_error, video_error
    _assert_equal(cases, expected, result)


def test_served_internvl_at_compact_positions_equals_transformers(model_dir, reference, tmp_path):
    """A server with positions="compact": vLLM's own consecutive numbering of the pruned
    prompt is ``vf.wrap(..., positions="compact")``'s."""
    cases, requests, expected = reference["compact"]
    overrides = {**OVERRIDES, "vlm_focus": {**OVERRIDES["vlm_focus"], "positions": "compact"}}
    _assert_equal(cases, expected, _offline(model_dir, requests, tmp_path, overrides))
