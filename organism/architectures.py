"""The organisms' architectures, keyed by the saved ``model_type``: where each one's training,
evaluation and model card live. Everything else (the loop, the scenes, the questions,
the shipping) is shared; the entries name ``module:function`` so that reading one record loads
no architecture's code."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Architecture:
    """One architecture's parts: ``train(recipe, out_dir, quiet)``, ``evaluate(path, n_images,
    only)`` and ``model_card(name, metrics, folder)``; ``pope_images`` caps the held-out images
    its evaluation takes."""

    train: str
    evaluate: str
    model_card: str
    pope_images: int = 500

    def part(self, name: str):
        """The function an entry names, imported on first use."""
        module, _, function = getattr(self, name).partition(":")
        return getattr(importlib.import_module(module), function)


ARCHITECTURES = {
    "llava": Architecture(
        train="organism.llava_train:train",
        evaluate="organism.evaluate:evaluate",
        model_card="organism.card:model_card",
    ),
    "qwen2_5_vl": Architecture(
        train="organism.qwen_train:train",
        evaluate="organism.qwen_eval:evaluate",
        model_card="organism.qwen_card:model_card",
        pope_images=300,
    ),
    "qwen3_5": Architecture(
        train="organism.qwen_train:train",
        evaluate="organism.qwen35_eval:evaluate",
        model_card="organism.qwen35_card:model_card",
        pope_images=300,
    ),
    # organism-prior: a LLaVA fine-tuned with stages of its own (its run's summary names this
    # record, since its config says "llava")
    "llava_prior": Architecture(
        train="organism.prior:train",
        evaluate="organism.prior_checks:evaluate",
        model_card="organism.card_prior:model_card",
    ),
}


def architecture(model_type: str) -> Architecture:
    """The record of ``model_type`` (see :data:`ARCHITECTURES`)."""
    if model_type not in ARCHITECTURES:
        allowed = ", ".join(ARCHITECTURES)
        raise ValueError(f"model_type={model_type!r} has no organism recipe; allowed: {allowed}")
    return ARCHITECTURES[model_type]


def saved_architecture(folder: Path) -> Architecture:
    """The record of the model saved in ``folder``: the ``architecture`` its run's summary names
    (a recipe of its own on a stock class), else its ``config.json``'s ``model_type``."""
    summary = Path(folder) / "train_summary.json"
    if summary.is_file():
        named = json.loads(summary.read_text()).get("architecture")
        if named:
            return architecture(named)
    config = json.loads((Path(folder) / "config.json").read_text())
    return architecture(config.get("model_type", ""))
