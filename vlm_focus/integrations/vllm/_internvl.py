"""InternVL (Hugging Face format, ``InternVLForConditionalGeneration``) served by vLLM with each
image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). vLLM 0.32
serves this architecture with its InternS1 class (``models/interns1.py``), whose processor runs
the Hugging Face InternVL processor on each image: the image becomes its tiles (row-major on
the canvas closest to its aspect ratio) and, when there are several, a thumbnail, and its
placeholder becomes ``<img>`` + ``image_seq_length`` tokens per tile + ``</img>``. Each tile is
a ``side x side`` grid after the pixel shuffle; the layout is vlm_focus's own InternVL adapter's
(:func:`vlm_focus.model_adapters.internvl.image_cells`), on the tile count vLLM's processing
gave the image.

The plugin changes, as for LLaVA-1.5 (:mod:`._llava`): the placeholder keeps ``<img>`` and
``</img>`` around the image's kept count of tokens; ``embed_multimodal`` keeps the cells
``vf.wrap(model, pruner=..., keep=..., layer=0)`` keeps (the attention pruners read layer 0 of
vLLM's Qwen2 decoder over the unpruned prompt, ``<img>`` and ``</img>`` included); positions are
the original ones by default (``</img>`` and the text after it where the unpruned prompt had
them), or ``positions="compact"``. Videos are refused with the plugin's own message.
"""

from __future__ import annotations

from vllm.model_executor.models.interns1 import (
    InternS1DummyInputsBuilder,
    InternS1ForConditionalGeneration,
    InternS1MultiModalProcessor,
    InternS1ProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptUpdateDetails

from ...model_adapters.internvl import image_cells, tile_side
from ._llava import OriginalPositionsModel, WithInstruction
from ._model import PruningModel
from ._processor import NO_VIDEO, ImagesOnlyInfo, PruningProcessorMixin, replace_once


class VlmFocusInternVLProcessingInfo(ImagesOnlyInfo, InternS1ProcessingInfo):
    """Images only, and a video gets the plugin's own message."""


class VlmFocusInternVLMultiModalProcessor(PruningProcessorMixin, InternS1MultiModalProcessor):
    """vLLM's InternVL processor with each image's kept count of tokens inside its
    ``<img>`` ... ``</img>`` block."""

    def _image_token(self) -> int:
        return self.info.get_hf_processor().image_token_id

    def _block(self) -> tuple[int, int]:
        """The ids of ``<img>`` and ``</img>``."""
        processor = self.info.get_hf_processor()
        return processor.start_image_token_id, processor.end_image_token_id

    def _image_sizes(self, data) -> list[int]:
        per_tile = self.info.get_hf_processor().image_seq_length
        return [int(tiles) * per_tile for tiles in data["image_num_patches"].tolist()]

    def _image_prompts(self, prompt, sizes):
        """A prompt's one image is scored inside its block, as the model sees it: its
        placeholder becomes ``<img>`` + its unpruned tokens + ``</img>``."""
        token = self._image_token()
        if len(sizes) != 1 or prompt.count(token) != 1:
            return super()._image_prompts(prompt, sizes)
        start, end = self._block()
        return [replace_once(prompt, [token], [start, *[token] * sizes[0], end])]

    def _kept_image(self, count: int):
        start, end = self._block()
        token = self._image_token()
        return PromptUpdateDetails.select_token_id([start, *[token] * count, end], token)


class VlmFocusInternVLDummyInputsBuilder(WithInstruction, InternS1DummyInputsBuilder):
    """vLLM's InternVL profiling inputs, with an instruction."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusInternVLMultiModalProcessor,
    info=VlmFocusInternVLProcessingInfo,
    dummy_inputs=VlmFocusInternVLDummyInputsBuilder,
)
class VlmFocusInternVLForConditionalGeneration(
    OriginalPositionsModel, PruningModel, InternS1ForConditionalGeneration
):
    """vLLM's InternVL whose images reach the LLM pruned (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if getattr(self.config, "vision_feature_select_strategy", "default") != "default":
            raise ValueError(
                "vlm_focus's InternVL class needs vision_feature_select_strategy='default': "
                "vLLM's InternVL drops the tower's CLS token whatever the config says"
            )
        self.setup_positions(vllm_config)
        self.side = tile_side(self)

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if inputs.get("videos") is not None:
            raise ValueError(NO_VIDEO)
        if inputs.get("images") is None:
            return []
        embeds = self._process_vision_input(inputs["images"])  # per image: [tiles * side^2, D]
        requests = self.item_requests(fields["image"], [emb.shape[0] for emb in embeds])
        per_tile, out = self.side * self.side, []
        for emb, request in zip(embeds, requests, strict=True):
            layout = image_cells(self.side, emb.shape[0] // per_tile)
            kept = self.keep_cells(request, emb, layout)
            out.append(self.with_offsets(emb[kept.to(emb.device)], kept))
        return tuple(out)
