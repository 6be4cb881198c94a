"""Qwen2-VL served by vLLM with each image and video pruned before the LLM: vLLM's Qwen2-VL
processor writes a video as one run of placeholders, as its Qwen2.5-VL one does, and its time
axis counts temporal groups unscaled (no ``second_per_grid_ts``, so
:meth:`._mrope.MRopePruningModel.frame_times` steps by one), so it takes the pieces Qwen2.5-VL
takes (:class:`._mrope.OneRunVideoProcessor`, :class:`._mrope.MRopePruningModel`) over vLLM's
``Qwen2VLForConditionalGeneration``."""

from __future__ import annotations

from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopePruningModel, OneRunVideoProcessor


class VlmFocusQwen2VLMultiModalProcessor(OneRunVideoProcessor, Qwen2VLMultiModalProcessor):
    """vLLM's Qwen2-VL processor with each image's and video's kept count of placeholders (a
    video is one run of them)."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen2VLMultiModalProcessor,
    info=Qwen2VLProcessingInfo,
    dummy_inputs=Qwen2VLDummyInputsBuilder,
)
class VlmFocusQwen2VLForConditionalGeneration(MRopePruningModel, Qwen2VLForConditionalGeneration):
    """vLLM's Qwen2-VL whose images and videos reach the LLM pruned."""

    def _parse_and_validate_multimodal_inputs(self, **kwargs: object) -> dict:
        # vLLM's Qwen2-VL names its modalities in the plural, the later Qwen classes (and
        # MRopePruningModel.embed_multimodal) in the singular
        inputs = super()._parse_and_validate_multimodal_inputs(**kwargs)
        return {_SINGULAR.get(name, name): item for name, item in inputs.items()}


_SINGULAR = {"images": "image", "videos": "video"}
