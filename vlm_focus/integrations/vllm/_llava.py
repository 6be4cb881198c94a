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

from collections import deque

import torch
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...config import FocusConfig, keep_count
from . import SERVED
from ._layer0 import ATTENTION_PRUNERS, attention_keep, build_pruner
from ._processor import PruningProcessorMixin
from ._request import (
    KEEP_FIELD,
    PROMPT_FIELD,
    PRUNER_FIELD,
    per_item,
    serve_options,
)
from ._scores import pool_keep

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


class VlmFocusLlavaMultiModalProcessor(PruningProcessorMixin, LlavaMultiModalProcessor):
    """vLLM's LLaVA processor with each image's kept count of placeholders
    (:class:`._processor.PruningProcessorMixin`)."""

    pruners = PRUNERS

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_index

    def _image_sizes(self, data) -> list[int]:
        rows, cols = _grid(self.info.get_hf_config())
        return [rows * cols] * len(data["pixel_values"])


class VlmFocusLlavaDummyInputsBuilder(LlavaDummyInputsBuilder):
    """Profiling prompts with a word after the images, so that ``text`` has an instruction."""

    def get_dummy_text(self, mm_counts):
        return super().get_dummy_text(mm_counts) + "\n?"


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaMultiModalProcessor,
    info=LlavaProcessingInfo,
    dummy_inputs=VlmFocusLlavaDummyInputsBuilder,
)
class VlmFocusLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 whose images reach the LLM pruned (see the module docstring).

    ``last_kept`` holds, for the most recent images encoded in this process (newest last), the
    pair ``(n_cells, kept)`` with ``kept`` the kept cell indices in raster order.
    """

    # checkpoints saved by transformers 5 name the CLIP tower without its `vision_model.` level
    hf_to_vllm_mapper = LlavaForConditionalGeneration.hf_to_vllm_mapper | WeightsMapper(
        orig_to_new_prefix={
            f"vision_tower.{part}.": f"vision_tower.vision_model.{part}."
            for part in ("embeddings", "encoder", "pre_layrnorm", "post_layernorm")
        }
    )

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vlm_focus = serve_options(self.config, PRUNERS)
        self.grid = _grid(self.config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("vlm_focus's LLaVA class does not run with pipeline parallelism")
        self.last_kept: deque[tuple[int, torch.Tensor]] = deque(maxlen=256)
        self._pruners = {
            name: build_pruner(FocusConfig(pruner=name, layer=0)) for name in ATTENTION_PRUNERS
        }

    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(KEEP_FIELD, None)
        codes = kwargs.pop(PRUNER_FIELD, None)
        prompts = kwargs.pop(PROMPT_FIELD, None)
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        embeds = self._process_image_input(image_input)  # [n_images, rows * cols, D] or tuple
        n_images = len(embeds)
        rows, cols = self.grid
        if keeps is None or codes is None:  # inputs not made by the processor: server defaults
            keeps = [keep_count(self.vlm_focus.keep, rows * cols, clamp=True)] * n_images
            codes = [PRUNERS.index(self.vlm_focus.pruner)] * n_images
        keeps, codes = per_item(keeps, n_images), per_item(codes, n_images)
        if prompts is None:
            prompts = [torch.empty(0, dtype=torch.long)] * n_images
        out = []
        for emb, n_keep, code, prompt in zip(embeds, keeps, codes, prompts, strict=True):
            pruner = PRUNERS[code]
            if emb.shape[0] != rows * cols:
                raise ValueError(f"{emb.shape[0]} image embeddings for a {rows}x{cols} grid")
            if n_keep >= rows * cols:
                kept = torch.arange(rows * cols)
            elif pruner == "pool":
                kept = pool_keep(rows, cols, n_keep)
            else:
                kept = attention_keep(
                    self._pruners[pruner],
                    self.language_model.model,
                    torch.as_tensor(prompt),
                    self.config.image_token_index,
                    emb,
                    rows,
                    cols,
                    n_keep,
                )
            self.last_kept.append((emb.shape[0], kept))
            out.append(emb[kept.to(emb.device)])
        return tuple(out)
