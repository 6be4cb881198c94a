"""LLaVA-NeXT served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). An image
is a base grid, then its anyres crops stitched into one grid unpadded to the image's aspect
ratio, with a newline token closing each row; its tokens' layout comes from vlm_focus's own
LLaVA-NeXT adapter (:func:`vlm_focus.model_adapters.llava_next.image_cells`), so ``pool`` and
the attention pruners choose from the layout ``vf.wrap`` sees. Positions are consecutive, as
for LLaVA-1.5: the transformers reference is ``vf.wrap(..., layer=0, positions="compact")``.
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
from . import SERVED
from ._llava import CLIP_WITHOUT_VISION_MODEL
from ._model import PruningModel
from ._processor import PruningProcessorMixin

#: What this class serves, its default first.
PRUNERS = SERVED["llava_next"][0]


class VlmFocusLlavaNextMultiModalProcessor(PruningProcessorMixin, LlavaNextMultiModalProcessor):
    """vLLM's LLaVA-NeXT processor with each image's kept count of placeholders."""

    pruners = PRUNERS

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_index

    def _image_sizes(self, data) -> list[int]:
        return [
            self.info.get_num_image_tokens(image_width=int(w), image_height=int(h))
            for h, w in data["image_sizes"].tolist()
        ]


class VlmFocusLlavaNextDummyInputsBuilder(LlavaDummyInputsBuilder):
    """Profiling prompts with a word after the images, so that ``text`` has an instruction."""

    def get_dummy_text(self, mm_counts):
        return super().get_dummy_text(mm_counts) + "\n?"


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaNextMultiModalProcessor,
    info=LlavaNextProcessingInfo,
    dummy_inputs=VlmFocusLlavaNextDummyInputsBuilder,
)
class VlmFocusLlavaNextForConditionalGeneration(PruningModel, LlavaNextForConditionalGeneration):
    """vLLM's LLaVA-NeXT whose images reach the LLM pruned (see the module docstring)."""

    hf_to_vllm_mapper = LlavaNextForConditionalGeneration.hf_to_vllm_mapper | (
        CLIP_WITHOUT_VISION_MODEL
    )
    pruners = PRUNERS

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_index

    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        embeds = self._process_image_input(image_input)  # per image: [n_i, D], layout order
        sizes = [[int(v) for v in s] for s in image_input["image_sizes"].tolist()]
        requests = self.image_requests(fields, [emb.shape[0] for emb in embeds])
        out = []
        for emb, size, request in zip(embeds, sizes, requests, strict=True):
            layout = image_cells(self, size, anyres=True)  # [height, width]
            kept = self.keep_cells(request, emb, layout)
            out.append(emb[kept.to(emb.device)])
        return tuple(out)
