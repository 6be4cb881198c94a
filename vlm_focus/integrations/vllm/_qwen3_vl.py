"""Qwen3-VL served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). Each piece
subclasses vLLM's own Qwen3-VL class: the processor places each image's kept count of
placeholders (:class:`._processor.PruningProcessorMixin`), and the model selects the kept cells
and gives them their original (interleaved) M-RoPE positions
(:class:`._mrope.MRopePruningModel`). vLLM packs each image token's DeepStack features after its
main features in one row, so they follow the kept tokens; the scores read the main features
only, which is what the LLM's first layer receives.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from . import SERVED
from ._mrope import MRopeImageProcessor, MRopePruningModel
from ._processor import ImagesOnlyInfo

#: What this class serves, its default first.
PRUNERS = SERVED["qwen3_vl"][0]


class VlmFocusQwen3VLProcessingInfo(ImagesOnlyInfo, Qwen3VLProcessingInfo):
    """Images only: vLLM then neither profiles nor accepts videos for this architecture."""

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        # Qwen3-VL's own adds video options to a scope that exists only when videos are served
        return super(Qwen3VLProcessingInfo, self).get_supported_mm_processor_kwargs()


class VlmFocusQwen3VLMultiModalProcessor(MRopeImageProcessor, Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor with each image's kept count of placeholders."""

    pruners = PRUNERS


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen3VLMultiModalProcessor,
    info=VlmFocusQwen3VLProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VlmFocusQwen3VLForConditionalGeneration(MRopePruningModel, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL whose images reach the LLM pruned."""

    pruners = PRUNERS

    @property
    def scored_width(self) -> int | None:
        return self.visual_dim if self.use_deepstack else None
