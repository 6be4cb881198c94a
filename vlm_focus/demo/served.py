"""The model the demo's page serves (swapped by its "Model" panel) and its sample scenes."""

from __future__ import annotations

from typing import Any

import numpy as np

from .request import MODEL_LOCK

N_SAMPLES = 6


def sample_scenes(n: int = N_SAMPLES) -> dict[str, np.ndarray]:
    """Name -> RGB image of the bundled sample scenes (rendered held-out scenes when the package
    ships none)."""
    from PIL import Image

    from ..asset_paths import sample_scene_paths

    out: dict[str, np.ndarray] = {}
    for path in sample_scene_paths()[:n]:
        with Image.open(path) as opened:
            out[path.stem] = np.asarray(opened.convert("RGB"))
    if not out:
        from ..eval.scenes import heldout_scenes

        for scene in heldout_scenes(n):
            out[f"scene-{scene.seed}"] = scene.image()
    return out


def _n_layers(model: Any) -> int:
    from ..model_adapters import get_adapter

    try:
        return len(get_adapter(model).decoder_layers(model))
    except ValueError:
        return 1


class Served:
    """The model the page serves. :meth:`load` swaps it for another (safetensors only; repository
    code only when the app was started with ``--trust-remote-code``)."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        device: str = "cpu",
        attn: str = "sdpa",
        trust_remote_code: bool = False,
    ) -> None:
        self.pair = (model, processor)  # replaced as one, read as one
        self.device, self.attn, self.trust_remote_code = device, attn, trust_remote_code

    @property
    def model(self) -> Any:
        return self.pair[0]

    @property
    def processor(self) -> Any:
        return self.pair[1]

    @property
    def name(self) -> str:
        """The model's hub id or folder; the embedded models by their own name."""
        from pathlib import Path

        from ..asset_paths import default_model_path, guide_model_path

        config = getattr(self.model, "config", None)
        name = getattr(config, "_name_or_path", "") or type(self.model).__name__
        for embedded in (default_model_path(), guide_model_path()):
            if Path(name).resolve() == embedded.resolve():
                return f"{embedded.name} (embedded)"
        return name

    @property
    def n_layers(self) -> int:
        return _n_layers(self.model)

    def load(self, path: str) -> tuple[bool, str]:
        """Load ``path`` (a local folder or hub id) and serve it; on failure keep the current
        model. Returns ``(ok, message for the user)``."""
        from ..loading import load_model

        path = (path or "").strip()
        if not path:
            return False, "Type a model folder or hub id to load."
        try:
            model, processor = load_model(
                path,
                device=self.device,
                attn_implementation=self.attn,
                trust_remote_code=self.trust_remote_code,
            )
        except Exception as err:  # a bad folder must not take the page down
            return False, f"The model could not be loaded; still serving `{self.name}`. {err}"
        with MODEL_LOCK:  # no request runs while the model changes
            self.pair = (model, processor)
        return True, f"Now serving `{self.name}` ({model.config.model_type})."


__all__ = ["N_SAMPLES", "Served", "sample_scenes"]
