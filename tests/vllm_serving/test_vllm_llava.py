"""The embedded default model (LLaVA-1.5 architecture) served by vLLM with the plugin equals
``vf.wrap(..., layer=0)`` in transformers: kept tokens at their original positions, and with
``positions="compact"`` ``vf.wrap(..., layer=0, positions="compact")``.

Runs in the vLLM environment (see ``test_vllm_plugin.py``); the transformers side
(``transformers_llava.py``) runs in the main environment. Two sample scenes x two questions x
``fastv``, ``text``, ``debiased`` and ``pool`` at keeps 0.25 and 0.11 go through one engine in one
batch, in prefill chunks of a few tokens (so that an image is split between steps): greedy
tokens, the pruned prompt's ids and the kept cells equal transformers'. The README's caption
(its sample scene, "Describe the image.") is the one of original positions, which differs from
the compact one; a server with ``positions="compact"`` gives the compact ones. A video gets the
plugin's own message. The same
image under two questions keeps different cells (the prompt is part of its cache identity). The
served model behind ``--api-key`` refuses a request without the key, answers one with it as
transformers does, answers a bad setting with a 400 that names it, and under 32 requests at once
(24 good, 8 bad) answers every good one as transformers does and every bad one with its 400,
then stays healthy.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from test_vllm_plugin import (  # noqa: E402
    _free_port,
    _offline,
    _post,
    _reference_python,
    _start_server,
    _stop,
)

from vlm_focus.asset_paths import default_model_path  # noqa: E402

MODEL = default_model_path()
IMAGES = sorted(str(p) for p in (MODEL.parent / "samples").glob("*.png"))[:2]
QUESTIONS = ("Is there a red_circle in the image?", "Describe the image.")
SETTINGS = [  # (pruner, keep, per-request mm_processor_kwargs or None for the server default)
    ("fastv", 0.25, None),
    ("fastv", 0.11, {"vlm_focus_keep": 0.11}),
    ("text", 0.25, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.25}),
    ("text", 0.11, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.11}),
    ("debiased", 0.25, {"vlm_focus_pruner": "debiased", "vlm_focus_keep": 0.25}),
    ("pool", 0.11, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.11}),
    ("diverse", 0.11, {"vlm_focus_pruner": "diverse", "vlm_focus_keep": 0.11}),
]
TEXT = {"mm_processor_kwargs": {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.11}}
POOL = {"mm_processor_kwargs": {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.11}}
#: good requests: (their key in the reference, extra body)
GOOD = [(("fastv", 0.25), {}), (("text", 0.11), TEXT), (("pool", 0.11), POOL)]
#: bad requests: (what their 400 must name, extra body)
BAD = [
    (name, {"mm_processor_kwargs": request})
    for name, request in [
        ("pyramid", {"vlm_focus_pruner": "pyramid"}),
        ("keep=0", {"vlm_focus_keep": 0}),
        ("keep=1 is ambiguous", {"vlm_focus_keep": 1}),
        ("keep=1.5", {"vlm_focus_keep": 1.5}),
        ("keep='half'", {"vlm_focus_keep": "half"}),
        ("sparsevlm", {"vlm_focus_pruner": "sparsevlm"}),
        ("pyramid", {"vlm_focus_pruner": "pyramid", "vlm_focus_keep": 0.5}),
        ("keep=-3", {"vlm_focus_keep": -3}),
    ]
]
#: 32 requests sent at once, three good to one bad, interleaved
LOAD = [request for bad in BAD for request in (*GOOD, bad)]
OVERRIDES = {
    "architectures": ["VlmFocusLlavaForConditionalGeneration"],
    "vlm_focus": {"pruner": "fastv", "keep": 0.25},
}
#: Settings also run with positions="compact", on a server of its own.
COMPACT = [s for s in SETTINGS if s[:2] in (("fastv", 0.25), ("pool", 0.11))]
#: Prefill chunks of this many tokens: an image's kept placeholders span several.
CHUNK = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """transformers outputs keyed by (image, question, pruner, keep) at original positions
    (pruner None = unpruned), and by (image, question, pruner, keep, "compact")."""
    work = tmp_path_factory.mktemp("reference")
    cases = [
        {"image": image, "question": q, "pruner": pruner, "keep": keep}
        for image in IMAGES
        for q in QUESTIONS
        for pruner, keep in [(None, 1.0)] + [s[:2] for s in SETTINGS]
    ]
    cases += [
        {"image": image, "question": q, "pruner": pruner, "keep": keep, "positions": "compact"}
        for image in IMAGES
        for q in QUESTIONS
        for pruner, keep, _ in COMPACT
    ]
    (work / "cases.json").write_text(json.dumps(cases))
    subprocess.run(
        [
            _reference_python(),
            str(HERE / "transformers_llava.py"),
            str(work / "cases.json"),
            str(work / "out.json"),
        ],
        check=True,
        cwd=REPO,
        timeout=600,
    )
    out = json.loads((work / "out.json").read_text())

    def key(case: dict) -> tuple:
        setting = (case["image"], case["question"], case["pruner"], case["keep"])
        return (*setting, case["positions"]) if "positions" in case else setting

    return {key(c): c for c in out}


@pytest.fixture(scope="module")
def pruned(reference, tmp_path_factory) -> tuple[list[tuple], dict]:
    keys, cases = [], []
    for image in IMAGES:
        for question in QUESTIONS:
            prompt_ids = reference[(image, question, None, 1.0)]["prompt_ids"]
            for pruner, keep, request in SETTINGS:
                keys.append((image, question, pruner, keep))
                cases.append({"prompt_token_ids": prompt_ids, "image": image, "request": request})
    work = tmp_path_factory.mktemp("pruned")
    # a video, which the LLaVA class does not take: its error, after the batch
    cases.append({"prompt_token_ids": prompt_ids, "video": _video(work), "expect_error": True})
    result = _offline(MODEL, cases, work, OVERRIDES, {"max_num_batched_tokens": CHUNK})
    result["video_error"] = result["outputs"].pop()["error"]
    return keys, result


@pytest.fixture(scope="module")
def compact(reference, tmp_path_factory) -> tuple[list[tuple], dict]:
    """The COMPACT settings through a server with positions="compact"."""
    keys, cases = [], []
    for image in IMAGES:
        for question in QUESTIONS:
            prompt_ids = reference[(image, question, None, 1.0)]["prompt_ids"]
            for pruner, keep, request in COMPACT:
                keys.append((image, question, pruner, keep, "compact"))
                cases.append({"prompt_token_ids": prompt_ids, "image": image, "request": request})
    overrides = {**OVERRIDES, "vlm_focus": {**OVERRIDES["vlm_focus"], "positions": "compact"}}
    return keys, _offline(MODEL, cases, tmp_path_factory.mktemp("compact"), overrides)


def _video(work: Path) -> str:
    """A ``.npy`` of four random 32 x 48 px frames."""
    import numpy as np

    frames = (np.random.default_rng(0).random((4, 32, 48, 3)) * 255).astype(np.uint8)
    np.save(work / "video.npy", frames)
    return str(work / "video.npy")


def test_a_video_gets_the_plugins_own_message(pruned):
    _, result = pruned
    assert "prunes images only" in result["video_error"], result["video_error"]


@pytest.mark.parametrize("served", ["pruned", "compact"])
def test_served_embedded_model_equals_transformers(served, request, reference):
    keys, result = request.getfixturevalue(served)
    assert result["plugin_loaded"]
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for key, output in zip(keys, result["outputs"], strict=True):
        expected = reference[key]
        assert output["prompt_token_ids"] == expected["pruned_ids"], key
        assert output["tokens"] == expected["tokens"], key
        assert (expected["n"], tuple(expected["kept"])) in recorded, key


def test_the_readme_caption_is_served_at_original_positions(pruned, reference):
    """The README's sample scene and caption prompt, fastv 0.25 (the server's default): the
    served caption is vf.wrap's at original positions, which differs from the compact one."""
    keys, result = pruned
    setting = (str(MODEL.parent / "samples" / "scene_9000001.png"), QUESTIONS[1], "fastv", 0.25)
    served = result["outputs"][keys.index(setting)]["tokens"]
    assert served == reference[setting]["tokens"]
    assert served != reference[(*setting, "compact")]["tokens"]


def test_an_images_attention_selection_follows_its_prompt(reference):
    # the same image keeps different cells under different questions, and vLLM kept both
    # (previous test): its cache entry is specific to the prompt
    for image in IMAGES:
        kept = {tuple(reference[(image, q, "text", 0.11)]["kept"]) for q in QUESTIONS}
        assert len(kept) == 2, image


def test_embedded_server_with_api_key(reference, tmp_path):
    port, key = _free_port(), "vf-test-key"
    command = [
        sys.executable,
        "-m",
        "vlm_focus.integrations.vllm",
        "serve",
        "embedded",
        "--keep",
        "0.25",
        "--port",
        str(port),
        "--api-key",
        key,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--limit-mm-per-prompt",
        '{"image": 1}',
        "--enforce-eager",
        "--trust-request-mm-kwargs",
    ]
    log = (tmp_path / "server.log").open("w")
    server = _start_server(command, log, tmp_path / "server.log")
    base = f"http://127.0.0.1:{port}"
    image, question = IMAGES[0], QUESTIONS[0]
    data = base64.b64encode(Path(image).read_bytes()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": question},
    ]
    body = {
        "model": str(MODEL),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        url = f"{base}/v1/chat/completions"
        refused, _ = _post(url, body, None)
        answered, answer = _post(url, body, key)
        bad, error = _post(
            url, {**body, "mm_processor_kwargs": {"vlm_focus_pruner": "pyramid"}}, key
        )
        again, answer_again = _post(url, body, key)
        # under load: 32 at once, good and bad mixed; every one answered, none lost
        with ThreadPoolExecutor(max_workers=32) as pool:
            load = list(pool.map(lambda r: _post(url, {**body, **r[1]}, key), LOAD))
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            healthy = r.status == 200
    finally:
        _stop(server)
        log.close()
    assert refused == 401
    assert answered == 200 and again == 200
    expected = reference[(image, question, "fastv", 0.25)]
    assert answer["choices"][0]["token_ids"] == expected["tokens"]
    assert answer_again["choices"][0]["token_ids"] == expected["tokens"]
    assert bad == 400 and "pyramid" in json.dumps(error), error
    for (expect, request), (status, reply) in zip(LOAD, load, strict=True):
        if isinstance(expect, str):  # a bad setting: a 400 that names it
            assert status == 400 and expect in json.dumps(reply), (request, reply)
        else:
            assert status == 200, (request, reply)
            want = reference[(image, question, *expect)]["tokens"]
            assert reply["choices"][0]["token_ids"] == want, request
    assert healthy
