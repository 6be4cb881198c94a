"""LLaVA-OneVision served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). An image
is its base grid, then its anyres crops stitched into one grid (unpadded, downscaled past
``anyres_max_N``) with a newline closing each row; the tokens' layout comes from vlm_focus's own
OneVision adapter (:func:`vlm_focus.model_adapters.llava_onevision.image_cells`). Positions as
for LLaVA-1.5 (:mod:`._positions`): original by default, the transformers reference
``vf.wrap(..., layer=0)``; or ``positions="compact"``.

One image per prompt: vLLM tiles every image of a prompt, while the model (and
``vf.wrap``) shows each image of a several-image prompt as its base grid alone, so there is no
reference for those. Videos are refused with the plugin's own message.
"""

from __future__ import annotations

from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionDummyInputsBuilder,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionMultiModalProcessor,
    LlavaOnevisionProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...model_adapters.llava_onevision import image_cells
from . import MODELS, model_type_of
from ._llava import (
    LlavaFamilyModel,
    LlavaFamilyProcessor,
    WithInstruction,
)
from ._processor import NO_VIDEO, ImagesOnlyInfo


class VlmFocusLlavaOnevisionProcessingInfo(ImagesOnlyInfo, LlavaOnevisionProcessingInfo):
    """Images only: vLLM then neither profiles nor accepts videos for this architecture."""


class VlmFocusLlavaOnevisionMultiModalProcessor(
    LlavaFamilyProcessor, LlavaOnevisionMultiModalProcessor
):
    """vLLM's OneVision processor with each image's kept count of placeholders."""

    one_image_only = MODELS[model_type_of(__name__)].one_image_only


class VlmFocusLlavaOnevisionDummyInputsBuilder(WithInstruction, LlavaOnevisionDummyInputsBuilder):
    """vLLM's OneVision profiling inputs, with an instruction."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaOnevisionMultiModalProcessor,
    info=VlmFocusLlavaOnevisionProcessingInfo,
    dummy_inputs=VlmFocusLlavaOnevisionDummyInputsBuilder,
)
class VlmFocusLlavaOnevisionForConditionalGeneration(
    LlavaFamilyModel, LlavaOnevisionForConditionalGeneration
):
    """vLLM's LLaVA-OneVision whose images reach the LLM pruned (see the module docstring)."""

    def image_layout(self, size):
        return image_cells(self, size)

    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if "video" in inputs:
            raise ValueError(NO_VIDEO)
        return self.embed_images(fields, inputs["image"]) if "image" in inputs else []
