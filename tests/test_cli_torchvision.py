"""Without torchvision, or with one built for another torch, ``vlm-focus run`` on a model that
reads videos stops in one line that names the tested pair, before any weights load; the
``video`` extra installs that pair. Only the video-reading models need torchvision."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_focus import cli
from vlm_focus.asset_paths import qwen_model_path
from vlm_focus.loading import VIDEO_INSTALL

ROOT = Path(__file__).resolve().parents[1]
PAIR = "pip install torch==2.14.1 torchvision==0.29.1"


class _BrokenTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and fails to load it, as a build for another torch does."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, origin="torchvision/__init__.py")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("operator torchvision::nms does not exist")


def _without_torchvision(monkeypatch, how: str) -> None:
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    if how == "missing":
        monkeypatch.setitem(sys.modules, "torchvision", None)  # find_spec: None; import fails
    else:
        monkeypatch.setattr(sys, "meta_path", [_BrokenTorchvision(), *sys.meta_path])


def _loads_no_weights(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the torchvision check")

    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", refuse)


@pytest.mark.parametrize("how", ["missing", "broken"])
@pytest.mark.parametrize("video", [False, True])
def test_run_on_a_video_model_names_the_pair_in_one_line(how, video, monkeypatch, capsys, tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    argv = ["run", "--model", str(qwen_model_path())] + (["--video", str(clip)] if video else [])
    _loads_no_weights(monkeypatch)
    _without_torchvision(monkeypatch, how)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vlm-focus run: error: "), err
    assert err.rstrip().endswith(PAIR)
    if how == "missing":
        assert (
            "the qwen2_5_vl processor reads videos with torchvision, which is not installed" in err
        )
    else:
        assert "does not load with torch" in err and "torchvision::nms does not exist" in err


def test_a_broken_torchvision_is_named_for_an_image_only_model_too(monkeypatch, capsys):
    _loads_no_weights(monkeypatch)
    _without_torchvision(monkeypatch, "broken")
    assert cli.main(["run"]) == 2  # the embedded LLaVA organism
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchvision::nms" in err and err.rstrip().endswith(PAIR)


def test_an_image_only_model_loads_without_torchvision():
    """In a fresh process, so that transformers itself finds no torchvision either."""
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "from vlm_focus.loading import load_model\n"
        "model, processor = load_model()\n"
        "print(model.config.model_type, getattr(processor, 'video_processor', None))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["llava", "None"]


def test_the_video_extra_pins_the_pair_the_message_names():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^video = \[(.*)\]$", pyproject, re.M).group(1)
    assert VIDEO_INSTALL == PAIR == "pip install " + " ".join(re.findall(r'"(.*?)"', extra))
    assert 'pip install -e ".[video]"' in (ROOT / "README.md").read_text()
