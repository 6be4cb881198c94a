"""Qwen3-VL's mixture-of-experts model served by vLLM with each image and video pruned before
the LLM: vLLM's class is its Qwen3-VL class with mixture-of-experts MLPs and the Qwen3-VL
processor, so the pruning pieces are the Qwen3-VL ones (:mod:`._qwen3_vl`), over vLLM's
``Qwen3VLMoeForConditionalGeneration``."""

from __future__ import annotations

from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder
from vllm.model_executor.models.qwen3_vl_moe import (
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopePruningModel
from ._qwen3_vl import VlmFocusQwen3VLMultiModalProcessor


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen3VLMultiModalProcessor,
    info=Qwen3VLMoeProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VlmFocusQwen3VLMoeForConditionalGeneration(
    MRopePruningModel, Qwen3VLMoeForConditionalGeneration
):
    """vLLM's Qwen3-VL mixture-of-experts model whose images and videos reach the LLM pruned."""

    frames_apart = True  # a timestamp before every frame, as Qwen3-VL

    @property
    def scored_width(self) -> int | None:
        return self.visual_dim if self.use_deepstack else None
