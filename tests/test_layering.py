"""Layering: no import cycle inside ``vlm_focus`` and no import from a higher floor (read from
the source, so a function-level import counts too); the core and the evaluations reach the
shipped assets without the organism package, the eval runners sit below the eval command line,
and the mitigations have one registry (one set of names and defaults) that the evaluations use."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_focus import hallucination as hal
from vlm_focus.asset_paths import (
    CAPTION_PROMPT,
    default_model_path,
    guide_model_path,
    heldout_path,
    sample_scene_paths,
)
from vlm_focus.eval.scenes import write_heldout_set

PACKAGE = Path(__file__).resolve().parents[1] / "vlm_focus"

#: The floors, bottom first (docs/architecture.md). A module may import its own floor or lower.
FLOORS = (
    ("core", "geometry", "model_adapters", "kernels", "config", "trace", "timing"),
    ("pruners", "api"),
    ("grounding", "hallucination", "zoom", "generation", "loading", "asset_paths"),
    ("eval", "demo", "cli", "setting"),
    ("integrations",),
)
#: ``import vlm_focus`` reaches every feature (``vf.ground`` loads grounding), so only the
#: command lines and above may import the public package itself.
PUBLIC_PACKAGE_FLOOR = 3


def _module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``vlm_focus`` modules that ``name`` imports anywhere in its source: ``from .x
    import y`` counts as importing ``x.y`` where that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            named = (f"{base}.{a.name}" for a in node.names)
            targets = [n if n in modules else base for n in named]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return PUBLIC_PACKAGE_FLOOR
    for floor, names in enumerate(FLOORS):
        if parts[1] in names:
            return floor
    raise AssertionError(f"{module} is on no floor: add {parts[1]!r} to FLOORS")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_inside_the_package():
    assert _cycles(_graph()) == []


def test_no_module_imports_from_a_higher_floor():
    upward = [
        f"{module} (floor {_floor(module)}) imports {target} (floor {_floor(target)})"
        for module, targets in sorted(_graph().items())
        if module != "vlm_focus"  # the public package gathers every floor
        for target in sorted(targets)
        if _floor(target) > _floor(module)
    ]
    assert upward == []


def test_the_layering_checks_find_what_they_look_for():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "vlm_focus.core.pruner" in graph["vlm_focus.pruners.fastv"]
    assert "vlm_focus.core.registry" in graph["vlm_focus.pruners.debiased"]
    assert not any(t.startswith("vlm_focus.pruners") for t in graph["vlm_focus.core.engine"])
    assert _floor("vlm_focus.core.engine") == 0 and _floor("vlm_focus.integrations.lmms_eval") == 4


#: The per-integration tables: facts about a model class that only one integration needs, one
#: dict keyed by ``model_type`` (and beside it, the supported classes it leaves out, with the
#: reason): module -> the dicts' names. Everywhere else a model class is asked of its adapter,
#: never named.
INTEGRATION_TABLES = {
    "vlm_focus/integrations/lmms_eval.py": ("DELEGATES",),
    "vlm_focus/integrations/vllm/__init__.py": ("MODELS", "NOT_SERVED"),
}


def _strings(node: ast.AST) -> list[str]:
    """The strings of a string constant, or of a tuple/list/set of them (else ``[]``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return [e.value for e in node.elts]
    return []


def _table_keys(tree: ast.Module, names: tuple[str, ...]) -> set[int]:
    """``id`` of each key node of the module-level dict literals assigned to ``names``."""
    keys = set()
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in names and isinstance(node.value, ast.Dict):
            keys |= {id(k) for k in node.value.keys if k is not None}
    return keys


def model_type_strings(source: str, relative: str, model_types: set[str]) -> list[str]:
    """Where ``source`` (the module at package-relative path ``relative``) names a model
    class outside ``model_adapters/`` and its integration's table."""
    if relative.startswith("vlm_focus/model_adapters/"):
        return []
    tree = ast.parse(source)
    allowed = _table_keys(tree, INTEGRATION_TABLES.get(relative, ()))
    return [
        f"{relative}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in model_types and id(node) not in allowed
    ]


def pruner_name_checks(source: str, relative: str, names: set[str]) -> list[str]:
    """Where ``source`` compares a pruner's name (``pruner == "pyramid"``, ``x.pruner in
    (...)``) outside that pruner's own module, or keeps a module-level list of pruner names:
    the pruner class says what it is and needs."""
    own = Path(relative).stem if relative.startswith("vlm_focus/pruners/") else None
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            named = {s for side in (node.left, *node.comparators) for s in _strings(side)}
            named &= names
            if named - {own} and "pruner" in ast.unparse(node).lower():
                found.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        listed = _strings(value) if value is not None else []
        if len(listed) >= 2 and set(listed) <= names and own is None:
            found.append(f"{relative}:{node.lineno} a list of pruner names {listed}")
    return found


def _sources() -> list[tuple[str, str]]:
    root = PACKAGE.parent
    return [(p.read_text(), p.relative_to(root).as_posix()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_model_class_is_named_outside_its_adapter_and_the_integration_tables():
    from vlm_focus.model_adapters import supported_models

    types = set(supported_models())
    assert [f for s, rel in _sources() for f in model_type_strings(s, rel, types)] == []


def test_no_pruner_name_is_compared_outside_its_own_module():
    from vlm_focus.core.registry import pruners

    names = set(pruners())
    assert [f for s, rel in _sources() for f in pruner_name_checks(s, rel, names)] == []


def test_the_name_checks_find_what_they_look_for():
    types, names = {"llava", "qwen2_vl"}, {"fastv", "pyramid", "text"}
    code = (
        'TABLE = {"llava": 1}\nif model_type == "llava": pass\n'
        'if config.pruner == "pyramid": pass\nif query_rows == "text": pass\n'
        'PRUNERS = ("fastv", "pyramid")\n'
    )
    assert model_type_strings(code, "vlm_focus/x.py", types) == [
        "vlm_focus/x.py:1 'llava'",
        "vlm_focus/x.py:2 'llava'",
    ]
    assert model_type_strings(code, "vlm_focus/model_adapters/llava.py", types) == []
    INTEGRATION_TABLES["vlm_focus/y.py"] = ("TABLE",)
    try:
        assert model_type_strings(code, "vlm_focus/y.py", types) == ["vlm_focus/y.py:2 'llava'"]
    finally:
        del INTEGRATION_TABLES["vlm_focus/y.py"]
    assert pruner_name_checks(code, "vlm_focus/x.py", names) == [
        "vlm_focus/x.py:3 config.pruner == 'pyramid'",
        "vlm_focus/x.py:5 a list of pruner names ['fastv', 'pyramid']",
    ]
    assert pruner_name_checks(code, "vlm_focus/pruners/pyramid.py", names) == []


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_core_and_eval_never_import_the_organism_package():
    loaded = _modules_after(
        "import vlm_focus, vlm_focus.loading, vlm_focus.cli, vlm_focus.asset_paths\n"
        "import vlm_focus.eval.cli, vlm_focus.eval.data, vlm_focus.eval.generation\n"
        "from vlm_focus.loading import resolve_model_path; resolve_model_path(None)"
    )
    assert "vlm_focus.eval.chair_run" in loaded  # the runners did load
    assert not [m for m in loaded if m.split(".")[0] == "organism"]


def test_eval_runners_do_not_import_the_eval_command_line():
    loaded = _modules_after(
        "import vlm_focus.eval.pope_run, vlm_focus.eval.coco_run, vlm_focus.eval.chair_run"
    )
    assert "vlm_focus.eval.common" in loaded and "vlm_focus.eval.cli" not in loaded


def test_organism_re_exports_the_asset_functions():
    import organism
    from organism.vocab import CAPTION_PROMPT as organism_prompt

    assert organism.default_model_path() == default_model_path()
    assert organism.guide_model_path() == guide_model_path()
    assert organism.sample_scene_paths() == sample_scene_paths() and sample_scene_paths()
    assert organism_prompt == CAPTION_PROMPT
    assert (default_model_path() / "config.json").is_file()


def test_written_heldout_set_equals_the_organism_scenes(tmp_path):
    from organism.scenes import caption, coco_instances, heldout_scenes

    path = write_heldout_set(tmp_path, n_images=3)
    scenes = heldout_scenes(3, min_objects=3)
    assert json.loads(path.read_text()) == coco_instances(scenes)
    captions = json.loads((tmp_path / "captions.json").read_text())
    assert captions == [{"image_id": s.seed, "caption": caption(s)} for s in scenes]
    for scene in scenes:
        with Image.open(tmp_path / f"scene_{scene.seed}.png") as png:
            assert np.array_equal(np.asarray(png), scene.image())
    assert len(json.loads(heldout_path("instances.json").read_text())["images"]) == 500
    with pytest.raises(ValueError, match="the held-out set has 500 images"):
        write_heldout_set(tmp_path, n_images=501)
    with pytest.raises(ValueError, match="not a held-out file; allowed: instances.json"):
        heldout_path("train.json")


def test_one_registry_of_mitigations_with_one_set_of_defaults():
    assert hal.mitigations() == [
        "attention_reweight",
        "content_free",
        "instruction_contrast",
        "visual_beam",
        "visual_contrast",
    ]
    assert hal.mitigation_choices()[0] == "none"
    beam = hal.get_mitigation("visual_beam")
    assert beam is hal.VisualBeam and beam.generate_args == {"num_beams": 3}
    assert hal.get_mitigation("attention_reweight").parameters() == {
        "strength": 1.0,
        "layers": None,
        "ratio": 0.25,
        "placement": "relevant",
        "skip": 2,
        "suppress": 0.0,
        "heads": 1.0,
    }
    contrast = hal.get_mitigation("instruction_contrast")
    from transformers import LogitsProcessor

    from vlm_focus.grounding import GENERIC_PROMPT

    assert contrast.generic_prompt == GENERIC_PROMPT and issubclass(contrast, LogitsProcessor)
    for old in ("reweight", "beam", "contrast"):  # the names before 0.1.0 are gone
        with pytest.raises(ValueError, match=f"unknown mitigation '{old}'; allowed: none"):
            hal.mitigation_name(old)
    with pytest.raises(ValueError, match="unknown mitigation 'vcd'; allowed: none, attention_"):
        hal.mitigation_name("vcd")
    with pytest.raises(ValueError, match="unknown parameter 'width' for mitigation 'visual_beam'"):
        beam.parameters(width=4)
    with pytest.raises(ValueError, match="already registered"):
        hal.register_mitigation(beam)
    with pytest.raises(ValueError, match="reserved"):
        hal.register_mitigation(type("OldBeam", (hal.VisualBeam,), {"name": "beam"}))


def test_the_run_setting_records_the_registry_defaults():
    from vlm_focus import FocusConfig
    from vlm_focus.setting import RunSetting

    beam = RunSetting(mitigation="visual_beam")
    assert beam.tag == "unpruned-visual_beam"
    described = beam.describe()
    assert described["mitigation_parameters"] == {"weight": 1.0, "layers": None, "num_beams": 3}
    assert described["decoding"].startswith("beam search, num_beams=3")
    stronger = RunSetting(mitigation="attention_reweight", mitigation_options={"strength": 2.0})
    assert stronger.tag == "unpruned-attention_reweight-strength_2.0"
    guided = RunSetting(focus=FocusConfig(pruner="guided", keep=0.25), guide="embedded")
    assert guided.tag == "guided-k0.25-l2" and guided.describe()["guide"] == "embedded"
    for pruner in ("guided", "fixation"):  # each drives decoding itself
        with pytest.raises(ValueError, match=f"does not combine with pruner '{pruner}'"):
            RunSetting(focus=FocusConfig(pruner=pruner), mitigation="visual_beam")
    with pytest.raises(
        ValueError, match=r"a guide is an option of the pruners that take one \(guided\)"
    ):
        RunSetting(focus=FocusConfig(pruner="fastv"), guide="embedded")


def test_mitigate_runs_the_registered_method_with_generate():
    from tiny_models import make_inputs, make_model

    model = make_model("llava")
    inputs = make_inputs("llava", model)
    gen = dict(max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        with hal.mitigate(model, "visual_beam", inputs) as active:
            assert isinstance(active.handle, hal.VisualBeam)
            kwargs = active.generate_kwargs()
            assert kwargs["num_beams"] == 3 and kwargs["logits_processor"] == [active.handle]
            by_name = model.generate(**inputs, **kwargs, **gen)
        with hal.visual_beam(model, weight=1.0) as proc:
            direct = model.generate(**inputs, num_beams=3, logits_processor=[proc], **gen)
        with hal.mitigate(model, "none") as active:
            assert active.generate_kwargs() == {}
    assert torch.equal(by_name, direct)
    with pytest.raises(ValueError, match="needs inputs and generic_inputs"):
        with hal.mitigate(model, "instruction_contrast", inputs):
            pass
