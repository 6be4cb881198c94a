"""LLaVA-NeXT served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). An image
is a base grid, then its anyres crops stitched into one grid unpadded to the image's aspect
ratio, with a newline token closing each row; its tokens' layout comes from vlm_focus's own
LLaVA-NeXT adapter (:func:`vlm_focus.model_adapters.llava_next.image_cells`), so ``pool`` and
the attention pruners choose from the layout ``vf.wrap`` sees. Positions as for LLaVA-1.5
(:mod:`._positions`): original by default, the transformers reference ``vf.wrap(...,
layer=0)``; or ``positions="compact"``.
"""

from __future__ import annotations

from vllm.model_executor.models.llava import LlavaDummyInputsBuilder
from vllm.model_executor.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...model_adapters.llava_next import image_cells
from ._llava import (
    LlavaFamilyModel,
    LlavaFamilyProcessor,
    WithInstruction,
)
from ._processor import ImagesOnlyInfo


class VlmFocusLlavaNextProcessingInfo(ImagesOnlyInfo, LlavaNextProcessingInfo):
    """Images only, and a video gets the plugin's own message."""


class VlmFocusLlavaNextMultiModalProcessor(LlavaFamilyProcessor, LlavaNextMultiModalProcessor):
    """vLLM's LLaVA-NeXT processor with each image's kept count of placeholders."""


class VlmFocusLlavaNextDummyInputsBuilder(WithInstruction, LlavaDummyInputsBuilder):
    """vLLM's LLaVA-NeXT profiling inputs, with an instruction."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaNextMultiModalProcessor,
    info=VlmFocusLlavaNextProcessingInfo,
    dummy_inputs=VlmFocusLlavaNextDummyInputsBuilder,
)
class VlmFocusLlavaNextForConditionalGeneration(
    LlavaFamilyModel, LlavaNextForConditionalGeneration
):
    """vLLM's LLaVA-NeXT whose images reach the LLM pruned (see the module docstring)."""

    def image_layout(self, size):
        return image_cells(self, size, anyres=True)
