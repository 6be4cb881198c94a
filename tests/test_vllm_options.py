"""The vLLM plugin's settings and its ``serve`` command line (no vLLM needed)."""

from __future__ import annotations

import json

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
            "budget": "frame",
            "tiles": 2,
            "min_per_region": 1,
        },
    }
    assert plugin.ServeOptions.from_config(overrides["vlm_focus"]).keep == 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pruner": "sparsevlm"}, "not one of"),
        ({"keep": 0.0}, "ratio"),
        ({"keep": 0}, "count"),
        ({"tiles": 0}, "tiles"),
        ({"budget": "frames"}, "budget='frames' is not one of"),
    ],
)
def test_bad_settings_name_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        plugin.hf_overrides("qwen2_5_vl", **options)


def test_unknown_model_type_and_missing_or_unknown_config_entries_raise():
    supported = "'llava', 'llava_next', 'llava_onevision', 'qwen2_5_vl', 'qwen3_vl'"
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
