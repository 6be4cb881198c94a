"""Qwen3.5's mixture-of-experts model served by vLLM with each image and video pruned before
the LLM: vLLM's class is its Qwen3.5 class with mixture-of-experts MLPs, so the pruning pieces
are the Qwen3.5 ones (:mod:`._qwen3_5`), over vLLM's ``Qwen3_5MoeForConditionalGeneration``."""

from __future__ import annotations

from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopePruningModel
from ._qwen3_vl import VlmFocusQwen3VLMultiModalProcessor


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen3VLMultiModalProcessor,
    info=Qwen3_5MoeProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VlmFocusQwen3_5MoeForConditionalGeneration(
    MRopePruningModel, Qwen3_5MoeForConditionalGeneration
):
    """vLLM's Qwen3.5 mixture-of-experts model whose images and videos reach the LLM pruned."""

    frames_apart = True  # a timestamp before every frame, as Qwen3-VL
