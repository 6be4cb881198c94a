"""organism-qwen (a trained Qwen2.5-VL, shipped in ``vlm_focus/assets``) served by vLLM with the
plugin equals ``vf.wrap(..., layer=0)`` in transformers, and answers its questions.

Runs in the vLLM environment (see ``test_vllm_plugin.py``); the transformers side
(``transformers_side.py run``) and the held-out images (two crops of different sizes and aspect
ratios, which the processor keeps at their own size) come from the main environment. Two images
x two presence questions (one yes, one no) x the unpruned run and four pruned settings (the server's
default and three per-request ones) go through one engine in one batch: greedy tokens, the
pruned prompt's length and the kept cells equal transformers', and the unpruned answers are the
held-out truth (presence: the organism's relations are at chance, see its card).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from test_vllm_plugin import _offline, _reference_python, _transformers_run  # noqa: E402

from vlm_focus.asset_paths import qwen_model_path  # noqa: E402

SEEDS = (9_300_002, 9_300_005)  # held-out crops: 140 x 252 (tall) and 252 x 168 px (wide)
SETTINGS = [  # (pruner, keep, per-request mm_processor_kwargs or None for the server default)
    (None, 1.0, {"vlm_focus_keep": 1.0}),
    ("fastv", 0.25, None),
    ("text", 0.25, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.25}),
    ("debiased", 0.5, {"vlm_focus_pruner": "debiased", "vlm_focus_keep": 0.5}),
    ("pool", 0.25, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.25}),
]
OVERRIDES = {
    "architectures": ["VlmFocusQwen2_5_VLForConditionalGeneration"],
    "vlm_focus": {"pruner": "fastv", "keep": 0.25},
}
# writes each held-out crop as a PNG and its questions with their answers, in the main environment
_WRITE = """
import json, sys
import numpy as np
from PIL import Image
from organism import qwen_data as q
out, rows = sys.argv[1], []
rng = np.random.default_rng(0)
for seed in map(int, sys.argv[2:]):
    crop = q.cropped_scene(seed)
    Image.fromarray(crop.image()).save(f"{out}/crop_{seed}.png")
    qas = q.presence_pair(crop, rng)
    rows += [{"image": f"crop_{seed}.png", "question": a.question, "answer": a.answer} for a in qas]
open(f"{out}/questions.json", "w").write(json.dumps(rows))
"""


def prompt(question: str) -> str:
    """The organism's chat template for one image and ``question``."""
    return (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        f"{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A copy of the shipped organism-qwen with the held-out crops and questions beside it."""
    path = tmp_path_factory.mktemp("organism_qwen") / "model"
    shutil.copytree(qwen_model_path(), path)
    command = [_reference_python(), "-c", _WRITE, str(path), *map(str, SEEDS)]
    subprocess.run(command, check=True, cwd=REPO, timeout=300)
    return path


@pytest.fixture(scope="module")
def questions(model_dir) -> list[dict]:
    rows = json.loads((model_dir / "questions.json").read_text())
    assert len(rows) == 4 and all(r["answer"] in ("yes", "no") for r in rows)
    return rows


@pytest.fixture(scope="module")
def reference(model_dir, questions, tmp_path_factory) -> dict:
    cases = [
        {"prompt": prompt(r["question"]), "images": [r["image"]], "pruner": p, "keep": k}
        for r in questions
        for p, k, _ in SETTINGS
    ]
    out = _transformers_run(model_dir, cases, tmp_path_factory.mktemp("reference"))
    return {(c["images"][0], c["prompt"], c["pruner"], c["keep"]): c for c in out}


@pytest.fixture(scope="module")
def served(model_dir, questions, tmp_path_factory) -> tuple[list[tuple], dict]:
    keys, cases = [], []
    for r in questions:
        for pruner, keep, request in SETTINGS:
            keys.append((r["image"], prompt(r["question"]), pruner, keep))
            cases.append(
                {
                    "prompt": prompt(r["question"]),
                    "images": [str(model_dir / r["image"])],
                    "request": request,
                }
            )
    return keys, _offline(model_dir, cases, tmp_path_factory.mktemp("served"), OVERRIDES)


def test_served_organism_equals_transformers(served, reference, model_dir):
    keys, result = served
    assert result["plugin_loaded"]
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for key, output in zip(keys, result["outputs"], strict=True):
        expected = reference[key]
        assert output["prompt_token_ids"].count(image_token) == len(expected["kept"]), key
        assert output["tokens"] == expected["tokens"], key
        if key[2] is not None:
            assert (expected["n"], tuple(expected["kept"])) in recorded, key


def test_served_organism_answers_its_held_out_questions(served, questions, model_dir):
    from transformers import AutoTokenizer

    keys, result = served
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    truth = {(r["image"], prompt(r["question"])): r["answer"] for r in questions}
    unpruned = [
        (key, output) for key, output in zip(keys, result["outputs"], strict=True) if key[2] is None
    ]
    assert len(unpruned) == len(questions)
    for key, output in unpruned:
        first = tokenizer.decode(output["tokens"][:1]).strip()
        assert first == truth[key[:2]], key
