"""The organisms' one training loop and their place beside the package: both architectures'
stages run through `loop.run_stage`, each architecture is one record, and the recipe stays out of
the wheel while the runtime never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from setuptools import find_packages
from setuptools.config.pyprojecttoml import read_configuration

from organism import llava_train, qwen_train
from organism.architectures import ARCHITECTURES, architecture, saved_architecture
from organism.loop import learning_rate, run_stage, stage_done
from organism.recipe import QwenRecipe, Recipe, StageConfig, default_recipe
from vlm_focus.asset_paths import default_model_path, qwen_model_path

ROOT = Path(__file__).resolve().parents[1]


class FrozenClock:
    def wall(self) -> float:
        return 0.0


def test_run_stage_descends_logs_and_probes_on_its_cadence():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    stage = StageConfig("toy", steps=5, minutes=1e4, lr=0.1, warmup=2)
    logged, probes = [], []  # probes: the weights each probe saw
    batches = iter(torch.tensor([float(i)]) for i in range(100))

    def step(batch):
        loss = ((weight - batch) ** 2).sum()
        return loss, {"loss": loss.item()}

    def probe():
        probes.append(weight.detach().clone())
        return {"probe": float(len(probes))}

    run_stage(
        stage, [weight], batches, step, lambda *row: logged.append(row), probe, every=2, log_every=3
    )
    # probes at steps 2 and 4 and at the end (5); a plain log at step 3
    assert [(name, n) for name, n, _, _ in logged] == [
        ("toy", 2),
        ("toy", 3),
        ("toy", 4),
        ("toy", 5),
    ]
    assert [r.get("probe") for *_, r in logged] == [1.0, None, 2.0, 3.0]
    assert all(r["loss"] >= 0 for *_, r in logged) and not torch.equal(probes[0], probes[1])
    # the same five steps by hand: AdamW on the cosine schedule, gradients clipped to norm 1
    torch.manual_seed(0)
    again = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([again], lr=stage.lr, weight_decay=0.01)
    clock = FrozenClock()
    for n in range(5):
        opt.param_groups[0]["lr"] = learning_rate(stage, n, clock)
        opt.zero_grad()
        ((again - float(n)) ** 2).sum().backward()
        torch.nn.utils.clip_grad_norm_([again], 1.0)
        opt.step()
    # the loop's clock ticks (its share of the 1e4-minute budget moves the rate by ~1e-14)
    torch.testing.assert_close(weight.detach(), again.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(again.detach(), torch.tensor([1.0, -2.0]))
    assert stage_done(stage, 5, clock) and not stage_done(stage, 4, clock)


def test_each_architecture_is_one_record_and_its_recipe_names_it():
    assert set(ARCHITECTURES) == {"llava", "qwen2_5_vl", "llava_prior", "qwen3_5"}
    assert isinstance(default_recipe("default"), Recipe) and Recipe.model_type == "llava"
    assert isinstance(default_recipe("qwen"), QwenRecipe) and QwenRecipe.model_type == "qwen2_5_vl"
    assert architecture(Recipe.model_type).part("train") is llava_train.train
    assert architecture(QwenRecipe.model_type).part("train") is qwen_train.train
    assert default_recipe("qwen35").model_type == "qwen3_5"
    assert architecture("qwen3_5").part("train") is qwen_train.train
    assert saved_architecture(default_model_path()) is ARCHITECTURES["llava"]
    assert saved_architecture(qwen_model_path()).pope_images == 300
    from organism.prior import PriorRecipe, train
    from vlm_focus.asset_paths import prior_model_path

    assert isinstance(default_recipe("prior"), PriorRecipe)
    assert architecture(PriorRecipe.model_type).part("train") is train
    assert saved_architecture(prior_model_path()) is ARCHITECTURES["llava_prior"]
    with pytest.raises(
        ValueError, match="model_type='gemma3' has no organism recipe; allowed: llava"
    ):
        architecture("gemma3")


def test_the_recipe_lives_beside_the_package_and_the_runtime_never_imports_it():
    config = read_configuration(ROOT / "pyproject.toml", expand=False)
    shipped = find_packages(str(ROOT), **config["tool"]["setuptools"]["packages"]["find"])
    assert "vlm_focus" in shipped and "vlm_focus.model_adapters" in shipped
    assert not [p for p in shipped if p.split(".")[0] == "organism"]
    importers = []
    for path in (ROOT / "vlm_focus").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.split(".")[0] == "organism" for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []
