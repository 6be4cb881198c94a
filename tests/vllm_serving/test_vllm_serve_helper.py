"""The ``serve`` helper (``python -m vlm_focus.integrations.vllm serve``) as the README runs it
(see ``test_vllm_plugin.py`` for the set-up).

The embedded model starts with nothing sizing the KV cache (no ``VLLM_CPU_KVCACHE_SPACE``, no
cache flag): the helper sizes it, where vLLM's CPU default would reserve 92% of the machine's
memory. After SIGTERM to the helper, every process the server started (API server, engine
core, workers, multiprocessing's resource tracker) is gone within a few seconds.
"""

from __future__ import annotations

import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM environment")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_plugin import _env, _free_port, _start_server, _stop  # noqa: E402

#: Seconds the server's processes get to be gone after the helper exits.
GONE_WITHIN = 5.0


def test_embedded_serve_sizes_its_kv_cache_and_sigterm_takes_every_process_down(tmp_path):
    import psutil

    port = _free_port()
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
        "--enforce-eager",
    ]
    env = _env()
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # as pasted: nothing sizes the KV cache
    log_path = tmp_path / "server.log"
    log = log_path.open("w")
    server = _start_server(command, log, log_path, env)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        started = psutil.Process(server.pid).children(recursive=True)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            _stop(server)
        log.close()
    assert started, "the helper started no server process"
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        left = [p for p in started if _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for process in left:  # leave nothing behind for the next test either
        process.kill()
    assert not left, [" ".join(p.cmdline()) for p in left]
    assert server.returncode == 0


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
