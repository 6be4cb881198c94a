"""LLaVA-1.5 served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). Each piece
subclasses vLLM's own LLaVA class and changes one thing:

- processor: each image gets its kept count of placeholders
  (:class:`._processor.PruningProcessorMixin`). For an attention pruner (``fastv``, ``text``,
  ``debiased``) the prompt's token ids join the request's ``mm_processor_kwargs`` before vLLM
  hashes the image, so an image's cache entry (processor and encoder caches) is specific to the
  prompt its selection read; they travel to the model as a per-image field;
- ``embed_multimodal``: runs vLLM's vision tower and projector unchanged, then keeps the cells
  ``vf.wrap(model, pruner=..., keep=..., layer=0)`` keeps: ``pool`` from the grid alone, the
  attention pruners from layer 0 of vLLM's own decoder (:mod:`._layer0`) over the unpruned
  prompt. It returns only the kept embeddings, in raster order.

LLaVA's RoPE is 1-D and vLLM numbers the pruned prompt's tokens consecutively, which is
``vf.wrap(..., positions="compact")`` in transformers.

Attention pruners score one image per prompt (a prompt with several images is refused by the
processor: their layer-0 softmax would need every image's embeddings at once).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...geometry import Size
from . import SERVED
from ._layer0 import grid_layout
from ._model import PruningModel
from ._processor import PruningProcessorMixin

#: Checkpoints saved by transformers 5 name the CLIP tower without its ``vision_model.`` level.
CLIP_WITHOUT_VISION_MODEL = WeightsMapper(
    orig_to_new_prefix={
        f"vision_tower.{part}.": f"vision_tower.vision_model.{part}."
        for part in ("embeddings", "encoder", "pre_layrnorm", "post_layernorm")
    }
)
#: What this class serves, its default first: the attention pruners and ``pool``.
PRUNERS = SERVED["llava"][0]


def _grid(hf_config) -> tuple[int, int]:
    """Rows and columns of LLaVA-1.5's square patch grid (CLS dropped)."""
    vision = hf_config.vision_config
    if hf_config.vision_feature_select_strategy != "default":
        raise ValueError(
            "vlm_focus's LLaVA class needs vision_feature_select_strategy='default' (the grid "
            f"without CLS), got {hf_config.vision_feature_select_strategy!r}"
        )
    side = vision.image_size // vision.patch_size
    return side, side


class LlavaFamilyProcessor(PruningProcessorMixin):
    """The LLaVA processors' share of :class:`._processor.PruningProcessorMixin`: the image
    token, and an image's tokens (vLLM's own count from ``image_sizes`` for anyres classes,
    the fixed grid for LLaVA-1.5)."""

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_index

    def _image_sizes(self, data) -> list[int]:
        if "image_sizes" not in data:
            rows, cols = _grid(self.info.get_hf_config())
            return [rows * cols] * len(data["pixel_values"])
        return [
            self.info.get_num_image_tokens(image_width=int(w), image_height=int(h))
            for h, w in data["image_sizes"].tolist()
        ]


class WithInstruction:
    """Mixed into a dummy-inputs builder: profiling prompts get a word after their images, so
    that ``text`` has an instruction to score with."""

    def get_dummy_text(self, mm_counts):
        return super().get_dummy_text(mm_counts) + "\n?"


class LlavaFamilyModel(PruningModel):
    """The LLaVA model classes' share: the image token, and kept rows chosen on each image's
    layout (:meth:`image_layout`, the class's)."""

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_index

    def image_layout(self, size: list[int] | None) -> tuple[torch.Tensor, list]:
        """``(cells, grids)`` of an image of ``size`` ``[height, width]`` (``None``: unknown)."""
        raise NotImplementedError

    def embed_images(self, fields: tuple, image_input) -> tuple[torch.Tensor, ...]:
        """The kept embeddings of each image of ``image_input``, in the image's token order."""
        embeds = self._process_image_input(image_input)  # per image: [n_i, D], layout order
        sizes = image_input.get("image_sizes")
        sizes = [None] * len(embeds) if sizes is None else [list(map(int, s)) for s in sizes]
        requests = self.item_requests(fields["image"], [emb.shape[0] for emb in embeds])
        out = []
        for emb, size, request in zip(embeds, sizes, requests, strict=True):
            original = None if size is None else Size(width=size[1], height=size[0])
            kept = self.keep_cells(request, emb, self.image_layout(size), original)
            out.append(emb[kept.to(emb.device)])
        return tuple(out)


class VlmFocusLlavaMultiModalProcessor(LlavaFamilyProcessor, LlavaMultiModalProcessor):
    """vLLM's LLaVA processor with each image's kept count of placeholders."""

    pruners = PRUNERS


class VlmFocusLlavaDummyInputsBuilder(WithInstruction, LlavaDummyInputsBuilder):
    """vLLM's LLaVA profiling inputs, with an instruction."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaMultiModalProcessor,
    info=LlavaProcessingInfo,
    dummy_inputs=VlmFocusLlavaDummyInputsBuilder,
)
class VlmFocusLlavaForConditionalGeneration(LlavaFamilyModel, LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 whose images reach the LLM pruned (see the module docstring)."""

    hf_to_vllm_mapper = LlavaForConditionalGeneration.hf_to_vllm_mapper | (
        CLIP_WITHOUT_VISION_MODEL
    )
    pruners = PRUNERS

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.grid = _grid(self.config)

    def image_layout(self, size):
        return grid_layout(*self.grid)

    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        image_input = self._parse_and_validate_image_input(**kwargs)
        return [] if image_input is None else self.embed_images(fields, image_input)
