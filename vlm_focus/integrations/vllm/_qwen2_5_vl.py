"""Qwen2.5-VL served by vLLM with each image and video pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`), in the
processes that build the model or its processor. Each piece subclasses vLLM's own Qwen2.5-VL
class: the processor places each image's and video's kept count of placeholders
(:class:`._processor.PruningProcessorMixin`), and the model selects the kept cells and gives
them their original M-RoPE positions (:class:`._mrope.MRopePruningModel`).
"""

from __future__ import annotations

from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopePruningModel, OneRunVideoProcessor


class VlmFocusQwen2_5_VLMultiModalProcessor(OneRunVideoProcessor, Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor with each image's and video's kept count of placeholders (a
    video is one run of them)."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen2_5_VLMultiModalProcessor,
    info=Qwen2_5_VLProcessingInfo,
    dummy_inputs=Qwen2_5_VLDummyInputsBuilder,
)
class VlmFocusQwen2_5_VLForConditionalGeneration(
    MRopePruningModel, Qwen2_5_VLForConditionalGeneration
):
    """vLLM's Qwen2.5-VL whose images and videos reach the LLM pruned."""
