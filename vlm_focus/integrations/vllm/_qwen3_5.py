"""Qwen3.5 served by vLLM with each image and video pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). vLLM's
Qwen3.5 class is its Qwen3-VL class (same processor, vision tower without DeepStack, interleaved
M-RoPE) over a hybrid decoder, so the pruning pieces are Qwen3-VL's (:mod:`._qwen3_vl`): the
processor places each image's and video frame's kept count of placeholders, and the model gives
the kept tokens their original M-RoPE positions (:class:`._mrope.MRopePruningModel`). The
decoder, Gated DeltaNet layers included, then runs on the pruned prompt as on any prompt.

Attention pruners score with the layer the model adapter names for layer 0
(``ModelAdapter.scoring_layer_of``): layer 0 is a Gated DeltaNet, so by the adapter's
``"next_full"`` rule its first full-attention layer (input norm, gated q and k projections, q/k
norms, partial M-RoPE) reads layer 0's input, as ``vf.wrap(model, layer=0)`` scores it.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5ProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopePruningModel
from ._qwen3_vl import VlmFocusQwen3VLMultiModalProcessor


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen3VLMultiModalProcessor,
    info=Qwen3_5ProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VlmFocusQwen3_5ForConditionalGeneration(MRopePruningModel, Qwen3_5ForConditionalGeneration):
    """vLLM's Qwen3.5 whose images and videos reach the LLM pruned."""

    frames_apart = True  # a timestamp before every frame, as Qwen3-VL
