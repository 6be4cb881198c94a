"""Original positions for the classes of 1-D RoPE (the LLaVA family): kept tokens where they sat
in the unpruned prompt, as ``vf.wrap``'s default.

vLLM numbers a 1-D RoPE prompt's tokens consecutively, and none of its hooks changes that. Its
M-RoPE path can: the model runner asks the model once for each request's prompt positions
(``get_mrope_input_positions``), takes every prefill chunk's share of them and continues
decoding from the delta it returned. So a class served with ``positions="original"`` is marked
as an M-RoPE model in its config (:class:`OriginalPositionsConfig`, vLLM's per-architecture
config hook, which :func:`vlm_focus.integrations.vllm.register` fills in; vLLM calls its
``verify_and_update_config``), and the model (:class:`._llava.OriginalPositionsModel`):

- lays out the pruned prompt with the unpruned prompt's positions: text keeps its position, and
  every kept token of an image gets the image's first position (an image moves the position on
  by its unpruned token count, a per-item field from the processor); decoding goes on from the
  unpruned length;
- appends to each kept embedding its index among the image's unpruned tokens (position channels,
  as the Qwen-VL classes carry cells: :func:`._mrope.encode_cells`), takes them off before the
  embeddings are scattered into the batch, and adds them to the kept tokens' positions in
  ``forward``, in place in the runner's persistent positions buffer (rewritten every step; a
  CUDA-graph replay reads it);
- hands the language model the first of the three equal M-RoPE rows, a view of that buffer.
"""

from __future__ import annotations

from typing import Any

#: Key of the plugin's settings inside the model's Hugging Face config (``--hf-overrides``).
#: Its home is here, not in the package, so that :func:`vlm_focus.integrations.vllm.register`
#: can import this module, which imports neither the package nor vLLM.
CONFIG_KEY = "vlm_focus"

#: What marks a config as M-RoPE for vLLM (``rope_parameters`` of the top-level config, which
#: the 1-D language model never reads: it reads its text config's).
MROPE_MARK = {"rope_type": "default", "mrope_section": [1, 1, 1]}


def original_positions(options: Any) -> bool:
    """Whether a 1-D RoPE class serves ``options`` (its ``ServeOptions``) at original positions
    (its default)."""
    return (options.positions or "original") == "original"


def _entry(value: Any) -> dict:
    """The plugin's config entry as a dict (vLLM may hand it as an object)."""
    if isinstance(value, dict):
        return value
    return value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))


class OriginalPositionsConfig:
    """vLLM's config hook for a 1-D RoPE pruning architecture: with ``positions="original"``
    the model config says M-RoPE, so that the model runner and scheduler take the positions
    :meth:`._llava.OriginalPositionsModel.get_mrope_input_positions` gives."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        """vLLM calls this hook first, with the model config alone: nothing to do there."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        hf_config = vllm_config.model_config.hf_config
        entry = getattr(hf_config, CONFIG_KEY, None)
        if entry is None or _entry(entry).get("positions", "original") != "original":
            return  # no settings (the model says so when it is built), or compact ones
        rope = getattr(hf_config, "rope_parameters", None)
        hf_config.rope_parameters = {**(rope if isinstance(rope, dict) else {}), **MROPE_MARK}
