"""vLLM serving with the vlm_focus plugin equals ``vf.wrap(..., layer=0)`` in transformers.

Runs in the vLLM environment (``bash tests/vllm_serving/make_venv.sh DIR``; ``.ci/run`` builds
it) and is skipped where vLLM is not installed. The transformers side
(``tests/vllm_serving/transformers_side.py``) runs in the main environment, whose interpreter
``VLM_FOCUS_REFERENCE_PYTHON`` names: vLLM pins an older transformers than vlm_focus supports,
so the two never share a process.

On a tiny random-weight Qwen2.5-VL saved to disk (one 48 x 64 px image = 48 merged cells):
greedy tokens and kept cells through vLLM equal transformers' for ``pyramid`` and ``pool`` at
keep 0.25 and 0.5, two prompts each, all in one batch; the plugin comes in through its entry
point; without the override vLLM runs its own, unpruned model; ``vllm serve`` started by the
documented command answers a pruned chat request on 127.0.0.1.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from transformers_side import prompt_text  # noqa: E402

QUESTIONS = ("describe the picture", "where are the red shapes")
SETTINGS = [  # (pruner, keep, per-request mm_processor_kwargs or None for the server default)
    ("pyramid", 0.25, None),
    ("pyramid", 0.5, {"vlm_focus_pruner": "pyramid", "vlm_focus_keep": 0.5}),
    ("pool", 0.25, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.25}),
    ("pool", 0.5, {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.5}),
    ("pyramid", 1.0, {"vlm_focus_keep": 1.0}),
    ("fastv", 0.25, {"vlm_focus_pruner": "fastv", "vlm_focus_keep": 0.25}),
    ("text", 0.5, {"vlm_focus_pruner": "text", "vlm_focus_keep": 0.5}),
    ("debiased", 0.25, {"vlm_focus_pruner": "debiased", "vlm_focus_keep": 0.25}),
]
ARCH = "VlmFocusQwen2_5_VLForConditionalGeneration"
OVERRIDES = {"architectures": [ARCH], "vlm_focus": {"pruner": "pyramid", "keep": 0.25}}
ENGINE_TIMEOUT = 420  # seconds for one engine: start-up, one batch, shut-down


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model() sends a function
    env.pop("VLLM_PLUGINS", None)
    return env


def _reference_python() -> str:
    python = os.environ.get("VLM_FOCUS_REFERENCE_PYTHON")
    if not python:
        pytest.fail(
            "set VLM_FOCUS_REFERENCE_PYTHON to the main environment's python (the one with "
            "vlm_focus's supported transformers); .ci/run does"
        )
    return python


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    subprocess.run(
        [_reference_python(), str(HERE / "transformers_side.py"), "build", str(path)],
        check=True,
        cwd=REPO,
        timeout=300,
    )
    return path


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict:
    """transformers outputs keyed by (question, pruner, keep); pruner None = unpruned."""
    work = tmp_path_factory.mktemp("reference")
    cases = [{"prompt": prompt_text(q), "pruner": None, "keep": 1.0} for q in QUESTIONS]
    cases += [
        {"prompt": prompt_text(q), "pruner": pruner, "keep": keep}
        for q in QUESTIONS
        for pruner, keep, _ in SETTINGS
    ]
    out = _transformers_run(model_dir, cases, work)
    return {(c["prompt"], c["pruner"], c["keep"]): c for c in out}


def _transformers_run(model_dir: Path, cases: list[dict], work: Path) -> list[dict]:
    """``transformers_side.py run`` on ``cases``, in the main environment."""
    (work / "cases.json").write_text(json.dumps(cases))
    subprocess.run(
        [
            _reference_python(),
            str(HERE / "transformers_side.py"),
            "run",
            str(model_dir),
            str(work / "cases.json"),
            str(work / "out.json"),
        ],
        check=True,
        cwd=REPO,
        timeout=600,
    )
    return json.loads((work / "out.json").read_text())


def _offline(
    model_dir: Path,
    cases: list[dict],
    work: Path,
    overrides: dict | None,
    engine: dict | None = None,
    env: dict | None = None,
) -> dict:
    (work / "cases.json").write_text(json.dumps(cases))
    command = [
        sys.executable,
        str(HERE / "vllm_offline.py"),
        str(model_dir),
        str(work / "cases.json"),
        str(work / "out.json"),
    ]
    if overrides is not None or engine is not None:
        command.append(json.dumps(overrides))
    if engine is not None:
        command.append(json.dumps(engine))
    environment = {**_env(), **(env or {})}
    subprocess.run(command, check=True, cwd=work, env=environment, timeout=ENGINE_TIMEOUT)
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def pruned(model_dir, tmp_path_factory) -> tuple[list[tuple], dict]:
    """Every (question, setting) through one plugin engine, in one generate() batch."""
    keys, cases = [], []
    for question in QUESTIONS:
        for pruner, keep, request in SETTINGS:
            keys.append((prompt_text(question), pruner, keep))
            cases.append({"prompt": prompt_text(question), "request": request})
    work = tmp_path_factory.mktemp("pruned")
    return keys, _offline(model_dir, cases, work, OVERRIDES)


def test_pruned_outputs_and_kept_sets_equal_transformers(pruned, reference, model_dir):
    keys, result = pruned
    assert result[
        "plugin_loaded"
    ]  # found through the entry point; vllm_offline.py never imports it
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    for key, output in zip(keys, result["outputs"], strict=True):
        expected = reference[key]
        # the prompt vLLM ran holds exactly the kept number of image placeholders
        assert output["prompt_token_ids"].count(image_token) == len(expected["kept"]), key
        assert output["tokens"] == expected["tokens"], key
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for key in keys:
        expected = reference[key]
        assert (expected["n"], tuple(expected["kept"])) in recorded, key


def test_pruning_changes_the_output_and_keep_one_is_unpruned(pruned, reference):
    keys, result = pruned
    for key, output in zip(keys, result["outputs"], strict=True):
        unpruned = reference[(key[0], None, 1.0)]["tokens"]
        if key[2] == 1.0:
            assert output["tokens"] == unpruned, key
    # the tiny model is sensitive enough that dropping tokens shows in its answer
    assert any(
        o["tokens"] != reference[(k[0], None, 1.0)]["tokens"]
        for k, o in zip(keys, result["outputs"], strict=True)
        if k[2] < 1.0
    )


def test_without_the_override_vllm_runs_its_own_unpruned_model(model_dir, reference, tmp_path):
    cases = [{"prompt": prompt_text(q), "request": None} for q in QUESTIONS]
    result = _offline(model_dir, cases, tmp_path, None)
    assert result["plugin_loaded"] and result["kept"] == []  # loaded, but not in use
    for question, output in zip(QUESTIONS, result["outputs"], strict=True):
        assert output["tokens"] == reference[(prompt_text(question), None, 1.0)]["tokens"]


def _start_server(
    command: list[str], log, log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a server from ``command`` (its ``--port``) in ``env`` (default: :func:`_env`) and
    wait until ``/health`` answers."""
    server = subprocess.Popen(
        command,
        env=_env() if env is None else env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    port = command[command.index("--port") + 1]
    deadline = time.monotonic() + ENGINE_TIMEOUT
    while True:
        if server.poll() is not None:
            log.close()
            raise AssertionError(log_path.read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            _stop(server)
            raise AssertionError("server did not come up in time")
        time.sleep(2)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)  # the server and the engine it started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_documented_serve_command_answers_a_pruned_chat_request(model_dir, reference, tmp_path):
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_focus.integrations.vllm",
        "serve",
        str(model_dir),
        "--pruner",
        "pyramid",
        "--keep",
        "0.25",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--trust-request-mm-kwargs",  # lets a request choose its own pruner and keep
    ]
    log = (tmp_path / "server.log").open("w")
    server = _start_server(command, log, tmp_path / "server.log")
    base = f"http://127.0.0.1:{port}"
    try:
        image = base64.b64encode((model_dir / "image.png").read_bytes()).decode()
        answers = [_chat(base, model_dir, image, None), _chat(base, model_dir, image, POOL_HALF)]
        # two images under the server's pyramid: refused by the plugin, which keeps serving
        two = _chat_body(model_dir, image, None)
        two["messages"][0]["content"].insert(0, two["messages"][0]["content"][0])
        refused, error = _post(f"{base}/v1/chat/completions", two, None)
        after = _chat(base, model_dir, image, None)
    finally:
        _stop(server)
        log.close()
    assert refused == 400 and "pyramid" in json.dumps(error), error
    assert after["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"]
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    for answer, setting in zip(answers, (("pyramid", 0.25), ("pool", 0.5)), strict=True):
        expected = reference[(prompt_text(QUESTIONS[0]), *setting)]
        assert answer["prompt_token_ids"].count(image_token) == len(expected["kept"]), setting
        assert answer["choices"][0]["token_ids"] == expected["tokens"], setting


POOL_HALF = {"vlm_focus_pruner": "pool", "vlm_focus_keep": 0.5}


def _chat(base: str, model_dir: Path, image: str, request: dict | None) -> dict:
    """One chat completion with the image and QUESTIONS[0], greedy, with token ids."""
    status, answer = _post(f"{base}/v1/chat/completions", _chat_body(model_dir, image, request))
    assert status == 200, answer
    return answer


def _chat_body(model_dir: Path, image: str, request: dict | None) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": QUESTIONS[0]},
    ]
    body = {
        "model": str(model_dir),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if request is not None:
        body["mm_processor_kwargs"] = request
    return body


def _post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


MULTI = [  # (images, keep, budget of the transformers reference), all with pruner pool
    (["image.png", "square.png"], 0.25, "frame"),
    (["image.png", "square.png"], 0.25, "span"),
    (["square.png", "wide.png", "image.png"], 23, "frame"),
    (["square.png", "wide.png", "image.png"], 0.11, "span"),
    (["wide.png", "square.png", "image.png"], 0.5, "frame"),
    (["wide.png", "image.png"], 0.11, "frame"),
]


def test_prompts_with_several_images_share_the_prompts_budget_as_vf_wrap(
    model_dir, tmp_path_factory
):
    """Two- and three-image prompts: the prompt keeps keep_count(keep, all its tokens), shared
    out by budget="frame"'s rule (for pool that is also budget="span"'s choice)."""
    question = QUESTIONS[1]
    work = tmp_path_factory.mktemp("multi")
    reference_cases = [
        {
            "prompt": prompt_text(question, len(images)),
            "images": images,
            "pruner": "pool",
            "keep": keep,
            "budget": budget,
        }
        for images, keep, budget in MULTI
    ]
    expected = _transformers_run(model_dir, reference_cases, work)
    cases = [
        {
            "prompt": prompt_text(question, len(images)),
            "images": [str(model_dir / name) for name in images],
            "request": {"vlm_focus_pruner": "pool", "vlm_focus_keep": keep},
        }
        for images, keep, _ in MULTI
    ]
    result = _offline(model_dir, cases, work, OVERRIDES)
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    recorded = {(r["n"], tuple(r["kept"])) for r in result["kept"]}
    for setting, want, output in zip(MULTI, expected, result["outputs"], strict=True):
        kept = want["kept_per_image"]
        assert output["prompt_token_ids"].count(image_token) == sum(map(len, kept)), setting
        assert output["tokens"] == want["tokens"], setting
        for n, cells in zip(want["n_per_image"], kept, strict=True):
            assert (n, tuple(cells)) in recorded, setting


def test_tensor_parallel_two_ranks_give_the_same_tokens_and_cells(model_dir, reference, tmp_path):
    """Two ranks each project half the heads; the attention pruners gather them, so both ranks
    keep the cells one rank keeps, and the tokens equal transformers'."""
    settings = [s for s in SETTINGS if s[0] in ("fastv", "text", "pool") and s[1] < 1.0]
    cases = [{"prompt": prompt_text(QUESTIONS[0]), "request": r} for _, _, r in settings]
    engine = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    # vLLM's CPU workers bind their threads by NUMA node; this machine has one: a core each
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    result = _offline(model_dir, cases, tmp_path, OVERRIDES, engine, bind)
    first, second = result["kept_per_rank"]
    assert first == second  # both ranks kept the same cells for every image
    recorded = {(r["n"], tuple(r["kept"])) for r in first}
    for (pruner, keep, _), output in zip(settings, result["outputs"], strict=True):
        expected = reference[(prompt_text(QUESTIONS[0]), pruner, keep)]
        assert output["tokens"] == expected["tokens"], (pruner, keep)
        assert (expected["n"], tuple(expected["kept"])) in recorded, (pruner, keep)


@pytest.mark.gpu
def test_kept_positions_survive_cuda_graphs(model_dir, reference, tmp_path):
    """On a GPU, with CUDA graphs (vLLM's default when not eager) the decoder replays read the
    runner's positions buffer: the kept tokens' positions, written there in place, must give the
    same tokens as the eager run and as transformers. Run with ``-m gpu`` in the vLLM
    environment of a GPU machine."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    settings = [s for s in SETTINGS if s[1] < 1.0]
    cases = [{"prompt": prompt_text(q), "request": r} for q in QUESTIONS for _, _, r in settings]
    outputs = {}
    for eager in (True, False):
        work = tmp_path / f"eager_{eager}"
        work.mkdir()
        engine = {"enforce_eager": eager, "dtype": "float32"}
        outputs[eager] = _offline(model_dir, cases, work, OVERRIDES, engine)["outputs"]
    keys = [(prompt_text(q), p, k) for q in QUESTIONS for p, k, _ in settings]
    for key, eager, graphs in zip(keys, outputs[True], outputs[False], strict=True):
        assert graphs["tokens"] == eager["tokens"] == reference[key]["tokens"], key
