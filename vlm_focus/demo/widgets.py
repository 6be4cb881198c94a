"""The page's pruning widgets, drawn from :class:`~vlm_focus.FocusConfig`'s option table: one
widget per command-line option (``core.options``), with its default, its choices and its help
from the field itself, so that a new option of ``FocusConfig`` reaches the page as it reaches
every command line.

Three options have a widget of the page's own (:data:`PAGE_WIDGETS`): the pruner (a dropdown
of the registry), the keep ratio and the layer (sliders, the layer's bounded by the model).
Every other option is a dropdown of its declared ``choices`` (of the registry for
``video_pruner``, :data:`REGISTRY_CHOICES`; a checkbox for a flag) under
"More pruning options"; an option with neither needs a widget in :data:`PAGE_WIDGETS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import gradio as gr

import vlm_focus as vf

from ..config import VIDEO_AUTO, FocusConfig
from ..core.options import default_of


def _pruner(f: dataclasses.Field, default: Any, n_layers: int) -> Any:
    return gr.Dropdown(choices=vf.pruners(), value=default, label="Pruner", elem_id=f.name)


def _keep(f: dataclasses.Field, default: Any, n_layers: int) -> Any:
    return gr.Slider(0.05, 1.0, value=default, step=0.05, label="Keep ratio", elem_id=f.name)


def _layer_props(default: Any, n_layers: int) -> dict[str, Any]:
    top = max(n_layers - 1, 0)  # a model shallower than the default prunes at its last layer
    return {"maximum": top, "value": min(default, top)}


def _layer(f: dataclasses.Field, default: Any, n_layers: int) -> Any:
    props = _layer_props(default, n_layers)
    return gr.Slider(minimum=0, step=1, label="Prune at layer", elem_id=f.name, **props)


#: The page's own widget for an option: ``build(field, default, n_layers)``.
PAGE_WIDGETS: dict[str, Callable[[dataclasses.Field, Any, int], Any]] = {
    "pruner": _pruner,
    "keep": _keep,
    "layer": _layer,
}


#: Options under "More pruning options" whose choices come from the registry rather than from
#: the option's declaration (``"none"`` is read as ``None`` by the option's own reader).
REGISTRY_CHOICES: dict[str, Callable[[], list[str]]] = {
    "video_pruner": lambda: [VIDEO_AUTO, "none", *vf.pruners()],
}


#: What a page widget takes from the served model (its number of decoder layers), refreshed
#: when the page loads another model: ``props(default, n_layers)``.
MODEL_PROPS: dict[str, Callable[[Any, int], dict[str, Any]]] = {"layer": _layer_props}


def focus_fields() -> list[dataclasses.Field]:
    """``FocusConfig``'s command-line options, in field order."""
    return [f for f in dataclasses.fields(FocusConfig) if f.metadata.get("cli", True)]


def page_widgets(n_layers: int) -> dict[str, Any]:
    """The widgets of :data:`PAGE_WIDGETS`, in ``FocusConfig``'s field order, each at the
    field's default (create them inside the page's layout)."""
    return {
        f.name: PAGE_WIDGETS[f.name](f, default_of(FocusConfig, f.name), n_layers)
        for f in focus_fields()
        if f.name in PAGE_WIDGETS
    }


def model_updates(n_layers: int) -> dict[str, Any]:
    """``gr.update``s of the page widgets that depend on the model, for one of ``n_layers``
    decoder layers."""
    return {
        name: gr.update(**props(default_of(FocusConfig, name), n_layers))
        for name, props in MODEL_PROPS.items()
    }


def more_widgets() -> dict[str, Any]:
    """A widget for every other command-line option of ``FocusConfig``: a dropdown of its
    ``choices`` (a checkbox for a flag), labelled with its name, its help underneath."""
    out = {}
    for f in focus_fields():
        if f.name in PAGE_WIDGETS:
            continue
        default, help_text = default_of(FocusConfig, f.name), f.metadata.get("help", "")
        common = {"value": default, "label": f.name, "info": help_text, "elem_id": f.name}
        if f.name in REGISTRY_CHOICES:
            out[f.name] = gr.Dropdown(choices=REGISTRY_CHOICES[f.name](), **common)
        elif "choices" in f.metadata:
            out[f.name] = gr.Dropdown(choices=list(f.metadata["choices"]), **common)
        elif isinstance(default, bool):
            out[f.name] = gr.Checkbox(**common)
        else:
            raise TypeError(
                f"FocusConfig.{f.name} has no choices and is no flag: give it a widget in "
                "vlm_focus.demo.widgets.PAGE_WIDGETS"
            )
    return out


__all__ = [
    "MODEL_PROPS",
    "PAGE_WIDGETS",
    "REGISTRY_CHOICES",
    "model_updates",
    "focus_fields",
    "more_widgets",
    "page_widgets",
]
