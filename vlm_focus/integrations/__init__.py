"""vlm_focus inside evaluation harnesses.

- :mod:`vlm_focus.integrations.lmms_eval`: ``lmms-eval --model vlm_focus`` (registered through
  the ``lmms_eval.models`` entry point; needs ``pip install "vlm-focus[lmms-eval]"``);
- :mod:`vlm_focus.integrations.lmms_eval_tasks`: lmms-eval tasks shipped with vlm_focus (the
  organism's held-out POPE splits, offline; POPE with the yes-ratio of the predictions), for
  ``--include_path $(python -m vlm_focus.integrations.lmms_eval_tasks)``;
- :mod:`vlm_focus.integrations.model_args`: vlm_focus's options inside a harness's flat
  ``key=value`` model arguments, checked before any weights load;
- :func:`support_matrix`: what each model class runs, from the adapters and the integrations'
  tables (the README's matrix).
"""

from . import vllm  # model-free: the plugin's tables, for the docs
from .model_args import FocusArgs, focus_option_names, split_model_args
from .support import support_matrix


def lmms_eval_manifest():
    """Entry point of group ``lmms_eval.models``: registers ``--model vlm_focus`` (the class in
    :mod:`vlm_focus.integrations.lmms_eval`, imported only when that model is asked for)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="vlm_focus", chat_class_path=f"{__name__}.lmms_eval.VlmFocus")


def lmms_eval_tasks_path() -> str:
    """Folder of the lmms-eval task YAMLs shipped with vlm_focus (for ``--include_path``)."""
    from .lmms_eval_tasks import tasks_path

    return tasks_path()


__all__ = [
    "FocusArgs",
    "focus_option_names",
    "lmms_eval_manifest",
    "lmms_eval_tasks_path",
    "split_model_args",
    "support_matrix",
    "vllm",
]
