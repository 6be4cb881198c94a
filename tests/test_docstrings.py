"""Docstrings name what exists: the fields, capabilities and behaviour they describe are the
ones the code has (a rename changes the text with it)."""

from __future__ import annotations

import re

import pytest

import vlm_focus as vf
from vlm_focus import setting
from vlm_focus.config import FocusConfig
from vlm_focus.core.options import options
from vlm_focus.core.pruner import Pruner
from vlm_focus.integrations import model_args


def _quoted(text: str) -> list[str]:
    return re.findall(r"``(\w+)``", text)


def test_wrap_lists_focus_config_fields_by_their_names():
    listed = re.search(r"are :class:`FocusConfig` fields \((.*?)\)", vf.wrap.__doc__, re.S)
    assert _quoted(listed.group(1)) == [o.name for o in options(FocusConfig, cli_only=True)]


def test_the_run_setting_names_capabilities_pruners_have():
    paragraph = setting.__doc__[setting.__doc__.index("Which combinations run") :]
    names = _quoted(paragraph)
    assert names == ["needs_guide", "drives_decoding"]
    assert all(isinstance(getattr(Pruner, n), bool) for n in names)


def test_a_removed_mitigation_name_raises_as_the_docstring_says():
    doc = model_args._mitigation.__doc__
    assert "raises ``ValueError``" in doc and "warn" not in doc
    with pytest.raises(ValueError, match="unknown mitigation 'reweight'; allowed: none"):
        model_args.parse_focus_args({"mitigate": "reweight"})
