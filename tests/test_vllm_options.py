"""The vLLM plugin's settings and its ``serve`` command line (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlm_focus.integrations import vllm as plugin
from vlm_focus.integrations.vllm.__main__ import serve_command


def test_hf_overrides_pick_the_pruning_architecture_and_carry_the_settings():
    overrides = plugin.hf_overrides("qwen2_5_vl", pruner="pool", keep=0.5)
    assert overrides == {
        "architectures": ["VlmFocusQwen2_5_VLForConditionalGeneration"],
        "vlm_focus": {
            "pruner": "pool",
            "keep": 0.5,
            "layer": 0,
            "query_rows": "text",
            "reduce": "max",
            "budget": "frame",
            "positions": "original",
            "video_pruner": None,
            "warm_kernels": True,
            "options": {},
        },
    }
    assert plugin.ServeOptions.from_config(overrides["vlm_focus"]).keep == 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pruner": "sparsevlm"}, "not one of"),
        ({"keep": 0.0}, "ratio"),
        ({"keep": 0}, "count"),
        ({"pruner": "pyramid", "options": {"tiles": 0}}, "tiles"),
        ({"pruner": "pyramid", "options": {"width": 2}}, "it takes: \\['alpha'"),
        ({"layer": 2}, "at layer 0 only"),
        ({"budget": "frames"}, "budget='frames' is not one of"),
        ({"positions": "compact"}, "positions='compact' is not one of \\('original',\\)"),
        ({"positions": "shifted"}, "positions='shifted' is not one of"),
        ({"video_pruner": "diverse"}, "one pruner for images and videos"),
    ],
)
def test_bad_settings_name_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        plugin.hf_overrides("qwen2_5_vl", **options)


def test_unknown_model_type_and_missing_or_unknown_config_entries_raise():
    supported = (
        "'internvl', 'llava', 'llava_next', 'llava_onevision', 'qwen2_5_vl', 'qwen2_vl', "
        "'qwen3_5', 'qwen3_5_moe', 'qwen3_vl', 'qwen3_vl_moe'"
    )
    with pytest.raises(ValueError, match=f"supported: \\[{supported}\\]"):
        plugin.hf_overrides("gemma3")
    with pytest.raises(ValueError, match="--hf-overrides"):
        plugin.ServeOptions.from_config(None)
    with pytest.raises(ValueError, match="unknown vlm_focus setting"):
        plugin.ServeOptions.from_config({"ratio": 0.5})


def test_serve_command_reads_the_model_type_and_passes_other_arguments_on(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    command = serve_command([str(tmp_path), "--keep", "0.5", "--port", "8001", "--print"])
    assert command[:4] == ["--print", "vllm", "serve", str(tmp_path)]
    assert json.loads(command[command.index("--hf-overrides") + 1]) == plugin.hf_overrides(
        "qwen2_5_vl", keep=0.5
    )
    assert command[-4:] == ["--host", "127.0.0.1", "--port", "8001"]  # local unless --host
    counted = serve_command([str(tmp_path), "--keep", "64"])
    assert json.loads(counted[counted.index("--hf-overrides") + 1])["vlm_focus"]["keep"] == 64


def test_serve_help_states_keeps_one_rule(capsys):
    from vlm_focus.config import KEEP_RULE

    with pytest.raises(SystemExit):
        serve_command(["--help"])
    assert " ".join(capsys.readouterr().out.split()).count("int count >= 2") == 1
    assert KEEP_RULE in plugin.ServeOptions.__dataclass_fields__["keep"].metadata["help"]
    with pytest.raises(ValueError, match="keep=1 is ambiguous"):
        plugin.ServeOptions(keep=1)


def test_a_server_count_is_read_once_by_keeps_rule_and_serves_any_image():
    options = plugin.ServeOptions(keep=np.int64(4096))  # above most images' token counts
    assert options.keep == 4096 and type(options.keep) is int
    assert plugin.hf_overrides("qwen2_5_vl", keep=4096)["vlm_focus"]["keep"] == 4096
    assert type(plugin.ServeOptions(keep=np.float32(0.5)).keep) is float


def test_llava_classes_serve_original_positions_by_default_and_compact_on_request():
    for model_type in ("llava", "llava_next", "llava_onevision"):
        assert plugin.hf_overrides(model_type)["vlm_focus"]["positions"] == "original"
        chosen = plugin.hf_overrides(model_type, positions="compact")["vlm_focus"]
        assert chosen["positions"] == "compact"
    assert plugin.ServeOptions.from_config({"positions": "compact"}).positions == "compact"
    with pytest.raises(ValueError, match="positions='shifted' is not one of"):
        plugin.hf_overrides("llava", positions="shifted")
    command = serve_command(["embedded", "--positions", "compact"])
    overrides = json.loads(command[command.index("--hf-overrides") + 1])
    assert overrides["vlm_focus"]["positions"] == "compact"


def test_each_class_serves_its_own_pruners_with_its_default_first():
    llava = plugin.hf_overrides("llava", keep=0.11)["vlm_focus"]
    assert llava["pruner"] == "fastv" and llava["keep"] == 0.11
    assert plugin.hf_overrides("qwen2_5_vl")["vlm_focus"]["pruner"] == "fastv"
    assert plugin.hf_overrides("llava", pruner="text")["vlm_focus"]["pruner"] == "text"
    with pytest.raises(ValueError, match="'pyramid' is not one of"):
        plugin.hf_overrides("llava", pruner="pyramid")
    with pytest.raises(ValueError, match="not one of"):
        plugin.ServeOptions(pruner="sparse")


def test_serve_embedded_serves_the_embedded_model_on_a_chosen_host():
    from vlm_focus.asset_paths import default_model_path

    command = serve_command(["embedded", "--host", "0.0.0.0", "--api-key", "k"])
    assert command[2] == str(default_model_path())
    overrides = json.loads(command[command.index("--hf-overrides") + 1])
    assert overrides["architectures"] == ["VlmFocusLlavaForConditionalGeneration"]
    assert command[-4:] == ["--host", "0.0.0.0", "--api-key", "k"]


def test_serve_embedded_sizes_the_kv_cache_unless_the_user_does():
    from vlm_focus.integrations.vllm.__main__ import EMBEDDED_KV_CACHE_BYTES

    flag = ["--kv-cache-memory-bytes", str(EMBEDDED_KV_CACHE_BYTES)]
    command = serve_command(["embedded", "--port", "8000"], environ={})
    at = command.index(flag[0])
    assert command[at : at + 2] == flag  # not vLLM's default: 92% of a CPU machine's memory
    assert command[-4:] == ["--host", "127.0.0.1", "--port", "8000"]
    for user in (
        ["--kv-cache-memory-bytes", "123"],
        ["--kv_cache_memory_bytes=123"],
        ["--gpu-memory-utilization", "0.5"],
    ):
        command = serve_command(["embedded", *user], environ={})
        assert flag[0] not in command[: -len(user)], user
    assert flag[0] not in serve_command(["embedded"], environ={"VLLM_CPU_KVCACHE_SPACE": "2"})


def _run_supervised(args: list[str], grace: float, stop_after: float | None) -> tuple[int, float]:
    """``supervise`` on ``python -c *args``; SIGTERM to this process ``stop_after`` seconds in
    (its handler forwards it). Returns the exit code and the seconds it took."""
    import os
    import signal
    import sys
    import threading
    import time

    from vlm_focus.integrations.vllm.__main__ import supervise

    timer = None
    if stop_after is not None:
        timer = threading.Timer(stop_after, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
    start = time.monotonic()
    try:
        code = supervise([sys.executable, "-c", *args], grace=grace)
    finally:
        if timer is not None:
            timer.cancel()
    return code, time.monotonic() - start


#: A server stand-in: starts a grandchild that outlives it (as multiprocessing's resource tracker
#: can), writes its pid to argv[1], then exits with code 3 or, with argv[2] == "stubborn",
#: ignores SIGTERM and runs on (as vLLM's API server does while its engine starts).
SERVER = """
import signal, subprocess, sys, time
pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid
open(sys.argv[1], "w").write(str(pid))
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
sys.exit(3)
"""


@pytest.mark.parametrize(("kind", "code"), [("exits", 3), ("stubborn", 128 + 9)])
def test_serve_helper_takes_the_servers_processes_down(tmp_path, kind, code):
    import os
    import time

    pid_file = tmp_path / "grandchild.pid"
    got, seconds = _run_supervised([SERVER, str(pid_file), kind], grace=1.0, stop_after=2.0)
    assert got == code
    assert seconds < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{grandchild}/stat").read_text().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the server's child outlived the helper")


def test_the_served_pruners_and_positions_come_from_the_registries():
    """Each class serves the registered pruners that declare they choose before the LLM (and
    can for its model), FocusConfig's default first; compact positions where the model's
    adapter numbers a prompt with one 1-D count."""
    import vlm_focus as vf
    from vlm_focus.pruners import get_pruner

    before_llm = [n for n in vf.pruners() if get_pruner(n).before_llm]
    assert sorted(before_llm) == ["debiased", "diverse", "fastv", "pool", "pyramid", "text"]
    for model_type in plugin.MODELS:
        served = plugin.served_pruners(model_type)
        assert served[0] == vf.FocusConfig().pruner and set(served) <= set(before_llm)
        adapter = plugin.adapter_of(model_type)
        assert ("pyramid" in served) == (adapter.vision_layers is None)  # no [CLS] to read
        compact = ("original", "compact") if adapter.consecutive_positions else ("original",)
        assert plugin.served_positions(model_type) == compact
    assert plugin.served_pruners("qwen2_5_vl") == (
        "fastv",
        "debiased",
        "diverse",
        "pool",
        "pyramid",
        "text",
    )
    assert plugin.served_pruners("llava") == ("fastv", "debiased", "diverse", "pool", "text")
    assert plugin.video_pruners(plugin.served_pruners("qwen3_vl")) == (
        "fastv",
        "debiased",
        "diverse",
        "pool",
        "text",
    )


def test_the_vllm_models_cover_the_supported_models_or_say_why_not():
    import vlm_focus as vf

    assert set(plugin.MODELS) | set(plugin.NOT_SERVED) == set(vf.supported_models())
    assert not set(plugin.MODELS) & set(plugin.NOT_SERVED)
    assert all(reason.strip() for reason in plugin.NOT_SERVED.values())
    for model_type, model in plugin.MODELS.items():
        assert plugin.model_type_of(model.class_path.partition(":")[0]) == model_type
        assert model.pruning_architecture == "VlmFocus" + model.architecture
        assert not model.video_budgets or plugin.adapter_of(model_type).video  # declared there
    with pytest.raises(ValueError, match="gemma3.*ignores Gemma 3's image blocks"):
        plugin.hf_overrides("gemma3")
    table = plugin.support_markdown().splitlines()
    assert [row.split("|")[1].strip(" `") for row in table[2:]] == vf.supported_models()
    assert "| `qwen2_5_vl` | `VlmFocusQwen2_5_VLForConditionalGeneration` | fastv, debiased, " in (
        plugin.support_markdown()
    )
    assert "| `qwen3_5` | `VlmFocusQwen3_5ForConditionalGeneration` | fastv, debiased, " in (
        plugin.support_markdown()
    )


def test_the_serve_parser_is_built_from_the_option_tables(tmp_path):
    from vlm_focus.integrations.vllm.__main__ import serve_parser

    flags = {a.dest for a in serve_parser()._actions}
    assert {"pruner", "keep", "budget", "positions", "query_rows", "reduce"} <= flags
    assert "layer" not in flags  # the plugin prunes at layer 0 only
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    command = serve_command(
        [str(tmp_path), "--pruner", "pyramid", "--pruner-option", "tiles=3", "--reduce", "mean"]
    )
    settings = json.loads(command[command.index("--hf-overrides") + 1])["vlm_focus"]
    assert settings["options"] == {"tiles": 3} and settings["reduce"] == "mean"
    with pytest.raises(ValueError, match="pruner 'fastv' has no option 'tiles'"):
        serve_command([str(tmp_path), "--pruner-option", "tiles=3"])


def test_the_plugin_names_no_pruner_in_a_comparison_and_no_model_type_outside_its_dicts():
    """What the plugin serves is read from the pruner classes and the MODELS dict: its source
    compares with no pruner name and spells a model type only as a key of MODELS/NOT_SERVED."""
    import ast

    import vlm_focus as vf

    names, model_types = set(vf.pruners()), set(vf.supported_models())
    found = []
    for path in sorted(Path(plugin.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        keys = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                if {getattr(t, "id", None) for t in node.targets} & {"MODELS", "NOT_SERVED"}:
                    keys |= {id(k) for k in node.value.keys}
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                parts += [e for p in parts if isinstance(p, (ast.Tuple, ast.List)) for e in p.elts]
                found += [
                    f"{path.name}:{node.lineno} compares with pruner {p.value!r}"
                    for p in parts
                    if isinstance(p, ast.Constant) and p.value in names
                ]
            if (
                isinstance(node, ast.Constant)
                and node.value in model_types
                and id(node) not in keys
            ):
                found.append(f"{path.name}:{node.lineno} names model type {node.value!r}")
    assert found == []
