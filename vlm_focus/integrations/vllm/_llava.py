"""LLaVA-1.5 served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). Each piece
subclasses vLLM's own LLaVA class and changes one thing:

- processor: each image gets its kept count of placeholders
  (:class:`._processor.PruningProcessorMixin`). For a pruner that reads layer 0's attention
  (``Pruner.reads_layer_attention``) the prompt's token ids join the request's
  ``mm_processor_kwargs`` before vLLM hashes the image, so an image's cache entry (processor and
  encoder caches) is specific to the prompt its selection read; they travel to the model as a
  per-image field;
- ``embed_multimodal``: runs vLLM's vision tower and projector unchanged, then keeps the cells
  ``vf.wrap(model, pruner=..., keep=..., layer=0)`` keeps: ``pool`` from the grid alone, the
  attention pruners from layer 0 of vLLM's own decoder (:mod:`._layer0`) over the unpruned
  prompt. It returns only the kept embeddings, in raster order;
- positions (:mod:`._positions`): by default each kept token sits where it sat in the unpruned
  prompt, and so does every later token, as in ``vf.wrap(..., layer=0)``; with
  ``positions="compact"`` vLLM numbers the pruned prompt consecutively, as in
  ``vf.wrap(..., layer=0, positions="compact")``.

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

from ...core.before_llm import item_layout
from ...geometry import Size
from ._model import PruningModel, require_piecewise_prefill
from ._mrope import decode_cells, encode_cells, take_position_channels
from ._positions import original_positions
from ._processor import ImagesOnlyInfo, PruningProcessorMixin
from ._request import TOKENS_FIELD

#: Checkpoints saved by transformers 5 name the CLIP tower without its ``vision_model.`` level.
CLIP_WITHOUT_VISION_MODEL = WeightsMapper(
    orig_to_new_prefix={
        f"vision_tower.{part}.": f"vision_tower.vision_model.{part}."
        for part in ("embeddings", "encoder", "pre_layrnorm", "post_layernorm")
    }
)


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


#: An offset is written as three base-4096 digits, each as :func:`._mrope.encode_cells` writes
#: a cell coordinate (exact in bf16): up to 4096**3 tokens an image.
_DIGIT = 4096


def encode_offsets(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n]`` integer offsets -> ``[n, POSITION_CHANNELS]`` channels in ``dtype``."""
    digits = torch.stack([offsets // _DIGIT**2, offsets // _DIGIT % _DIGIT, offsets % _DIGIT], -1)
    return encode_cells(digits, dtype)


def decode_offsets(channels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_offsets`: ``[n, POSITION_CHANNELS]`` -> ``[n]`` long."""
    digits = decode_cells(channels)
    return (digits[:, 0] * _DIGIT + digits[:, 1]) * _DIGIT + digits[:, 2]


class OriginalPositionsModel:
    """Mixed in before a 1-D RoPE pruning model (see the module docstring); ``self.vlm_focus``
    holds its settings."""

    #: vLLM's M-RoPE interface (``SupportsMRoPE``), used at original positions
    supports_mrope = True

    def setup_positions(self, vllm_config) -> None:
        """Checks at construction: the config hook ran (the plugin is loaded in every vLLM
        process) and CUDA graphs leave ``forward`` eager for prefill."""
        self.original_positions = original_positions(self.vlm_focus)
        self._step_offsets: tuple[torch.Tensor, torch.Tensor] | None = None
        if not self.original_positions:
            return
        if not vllm_config.model_config.uses_mrope:
            raise ValueError(
                "vlm_focus positions='original' needs the plugin's config hook, which did not "
                "run: load the vlm_focus plugin in every vLLM process (VLLM_PLUGINS), or serve "
                "positions='compact'"
            )
        require_piecewise_prefill(
            vllm_config, "vlm_focus positions='original'", otherwise="positions='compact'"
        )

    def with_offsets(self, kept_embeds: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """An image's kept rows ``[k, D]`` with each one's index among the image's unpruned
        tokens (``kept [k]``) appended, at original positions; unchanged at compact ones."""
        if not self.original_positions:
            return kept_embeds
        channels = encode_offsets(kept.long(), kept_embeds.dtype).to(kept_embeds.device)
        return torch.cat([kept_embeds, channels], dim=-1)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Positions ``[3, N]`` (three equal rows) of the pruned prompt and the decode delta:
        the unpruned prompt's positions for its text (an image's own text, such as InternVL's
        ``<img>`` and ``</img>``, included); an image's first token position for each of its
        kept tokens, to which :meth:`forward` adds the token's offset."""
        pieces, start, position = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            place = feature.mm_position
            first, kept = 0, place.length  # the whole placeholder is the image's tokens
            if place.is_embed is not None:  # or only the run is_embed marks
                embed = torch.nonzero(place.is_embed.cpu()).flatten()
                first, kept = int(embed[0]), embed.numel()
                if int(embed[-1]) - first + 1 != kept:
                    raise ValueError("an image's kept tokens must form one run in its placeholder")
            before = place.offset - start + first  # text, then the image's own leading text
            after = place.length - first - kept  # the image's own trailing text
            position += before
            pieces += [torch.arange(before) + position - before, torch.full((kept,), position)]
            position += int(feature.data[TOKENS_FIELD].data)
            pieces.append(torch.arange(after) + position)
            position += after
            start = place.offset + place.length
        tail = len(input_tokens) - start
        pieces.append(torch.arange(tail) + position)
        positions = torch.cat(pieces).long().expand(3, -1).contiguous()
        return positions, position + tail - len(input_tokens)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        """vLLM's embedding merge, after taking the offset channels off the image embeddings
        (kept for :meth:`forward`, which runs next on the same flattened batch)."""
        self._step_offsets = None
        if self.original_positions:
            self._step_offsets, multimodal_embeddings = take_position_channels(
                multimodal_embeddings, is_multimodal, decode_offsets
            )  # offsets [n_mm], in placeholder order
        return super().embed_input_ids(
            input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        """vLLM's forward; at original positions (M-RoPE rows ``[3, N]``) each kept image token
        first gets its offset, then the language model reads the first row."""
        if positions.dim() == 2:
            if self._step_offsets is not None:
                where, offsets = self._step_offsets
                self._step_offsets = None
                # in place: the runner's persistent buffer, which a CUDA-graph replay reads
                positions[:, where] += offsets.to(positions.dtype)
            positions = positions[0]
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)


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


class LlavaFamilyModel(OriginalPositionsModel, PruningModel):
    """The LLaVA model classes' share: the image token, kept rows chosen on each image's
    layout (:meth:`image_layout`, the class's), and their positions (:mod:`._positions`); the
    checkpoint names of transformers 5 (:data:`CLIP_WITHOUT_VISION_MODEL`) joined to the vLLM
    class's own mapper."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.hf_to_vllm_mapper = cls.hf_to_vllm_mapper | CLIP_WITHOUT_VISION_MODEL

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.setup_positions(vllm_config)

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
            out.append(self.with_offsets(emb[kept.to(emb.device)], kept))
        return tuple(out)

    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        image_input = self._parse_and_validate_image_input(**kwargs)
        return [] if image_input is None else self.embed_images(fields, image_input)


class VlmFocusLlavaProcessingInfo(ImagesOnlyInfo, LlavaProcessingInfo):
    """Images only, and a video gets the plugin's own message."""


class VlmFocusLlavaMultiModalProcessor(LlavaFamilyProcessor, LlavaMultiModalProcessor):
    """vLLM's LLaVA processor with each image's kept count of placeholders."""


class VlmFocusLlavaDummyInputsBuilder(WithInstruction, LlavaDummyInputsBuilder):
    """vLLM's LLaVA profiling inputs, with an instruction."""


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusLlavaMultiModalProcessor,
    info=VlmFocusLlavaProcessingInfo,
    dummy_inputs=VlmFocusLlavaDummyInputsBuilder,
)
class VlmFocusLlavaForConditionalGeneration(LlavaFamilyModel, LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 whose images reach the LLM pruned (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.grid = _grid(self.config)

    def image_layout(self, size):
        return item_layout(*self.grid)
