"""Qwen2.5-VL served by vLLM with each image pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`), in the
processes that build the model or its processor. Three pieces, each a subclass of vLLM's own
Qwen2.5-VL class that changes one thing:

- processor: an image of ``n`` merged cells gets ``keep_count(keep, n, clamp=True)``
  placeholders (:func:`vlm_focus.config.keep_count`), and two
  per-image fields (``vlm_focus_keep``: that count, ``vlm_focus_pruner``: the score's index in
  ``PRUNERS``) travel with the pixels, so the choice is part of the item's cache identity;
- ``embed_multimodal``: runs vLLM's vision tower unchanged, selects the kept cells from the
  embeddings (:func:`._scores.select`) and returns only those rows, in raster order, each with
  its ``(t, h, w)`` cell appended as position channels;
- M-RoPE: ``get_mrope_input_positions`` lays out the pruned prompt with the text positions of
  the unpruned one (an image advances the position by ``max(t, rows, cols)`` however many of its
  tokens are kept) and gives every image token the image's base position; ``embed_input_ids``
  strips the cell channels off the embeddings it scatters into the batch and keeps them, and
  ``forward`` adds each kept token's ``(t, h, w)`` cell to its base position before the LLM
  runs, which gives it its original position. The addition is made in place, in the model
  runner's persistent positions buffer (rewritten by the runner every step): a CUDA-graph replay
  of the decoder reads that buffer, never a copy. ``forward`` itself must run eagerly for
  prefill batches, so ``cudagraph_mode=FULL`` (whole-model graphs for mixed batches) is refused.

vLLM's own hook for this (``SupportsMultiModalPruning.recompute_mrope_positions``, used by EVS)
is only called while its video-pruning switch is on, and vLLM's CPU model runner never calls it;
the position fix above needs neither. Videos are refused (their tokens would need positions from
``second_per_grid_ts``), as are ``--video-pruning-rate`` (EVS) and pipeline parallelism (later
stages would not see the cells).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement
from vllm.multimodal.utils import copy_mm_embedding_modality

from ...config import FocusConfig, keep_count
from . import SERVED
from ._layer0 import ATTENTION_PRUNERS, attention_keep, build_pruner
from ._processor import PruningProcessorMixin
from ._request import KEEP_FIELD, PROMPT_FIELD, PRUNER_FIELD, per_item, serve_options
from ._scores import select

#: Position channels appended to each kept embedding: ``(t, h, w)`` of its cell, each split as
#: ``value // 64, value % 64`` so that they stay exact in bf16 (integers up to 256) for grids of
#: up to 4096 cells a side.
_SPLIT = 64
POSITION_CHANNELS = 6
#: What this class serves, its default first.
PRUNERS = SERVED["qwen2_5_vl"][0]
_NO_VIDEO = (
    "vlm_focus's vLLM plugin prunes images only; serve videos with vLLM's own "
    "Qwen2_5_VLForConditionalGeneration (no vlm_focus architecture override)"
)


def encode_cells(cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 3]`` integer ``(t, h, w)`` -> ``[n, 6]`` channels in ``dtype``."""
    hi = torch.div(cells, _SPLIT, rounding_mode="floor")
    lo = cells - hi * _SPLIT
    return torch.stack([hi, lo], dim=-1).flatten(1).to(dtype)  # [n, (t_hi t_lo h_hi ...)]


def decode_cells(channels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_cells`: ``[n, 6]`` -> ``[n, 3]`` long."""
    pairs = channels.float().round().long().view(-1, 3, 2)
    return pairs[..., 0] * _SPLIT + pairs[..., 1]


class VlmFocusQwen2_5_VLProcessingInfo(Qwen2_5_VLProcessingInfo):
    """Images only: vLLM then neither profiles nor accepts videos for this architecture."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}


class VlmFocusQwen2_5_VLMultiModalProcessor(PruningProcessorMixin, Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor with each image's kept count of placeholders
    (:class:`._processor.PruningProcessorMixin`)."""

    pruners = PRUNERS

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_id

    def _image_sizes(self, data) -> list[int]:
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        return (data["image_grid_thw"].prod(-1) // merge**2).tolist()

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        if mm_items.get_all_counts().get("video", 0):
            raise ValueError(_NO_VIDEO)
        return super()._apply_hf_processor_main(mm_items, hf_kwargs)

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        _, _, rest = self._split(hf_processor_mm_kwargs)
        updates = super()._get_prompt_updates(mm_items, rest, out_mm_kwargs)
        image_token = self.info.get_hf_config().image_token_id

        def kept_placeholders(item_idx: int) -> list[int]:
            count = out_mm_kwargs["image"][item_idx][KEEP_FIELD].data
            return [image_token] * int(count)

        return [
            PromptReplacement(modality="image", target=[image_token], replacement=kept_placeholders)
            if update.modality == "image"
            else update
            for update in updates
        ]


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen2_5_VLMultiModalProcessor,
    info=VlmFocusQwen2_5_VLProcessingInfo,
    dummy_inputs=Qwen2_5_VLDummyInputsBuilder,
)
class VlmFocusQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL whose images reach the LLM pruned (see the module docstring).

    ``last_kept`` holds, for the most recent images encoded in this process (newest last), the
    pair ``(n_cells, kept)`` with ``kept`` the kept cell indices in raster order.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vlm_focus = serve_options(self.config, PRUNERS)
        if self.multimodal_config.is_multimodal_pruning_enabled():
            raise ValueError(
                "--video-pruning-rate (EVS) cannot be combined with vlm_focus's pruning "
                "architecture; " + _NO_VIDEO
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "vlm_focus's pruning architecture does not run with pipeline parallelism"
            )
        graphs = vllm_config.compilation_config.cudagraph_mode
        if graphs is not None and graphs.mixed_mode() == graphs.FULL:
            # a full graph of a prefill batch would replay without forward()'s position fix
            raise ValueError(
                "vlm_focus's pruning architecture needs piecewise CUDA graphs for prefill: use "
                "cudagraph_mode FULL_AND_PIECEWISE (vLLM's default), PIECEWISE or "
                "FULL_DECODE_ONLY, not FULL"
            )
        self.last_kept: deque[tuple[int, torch.Tensor]] = deque(maxlen=256)
        self._pruners = {
            name: build_pruner(FocusConfig(pruner=name, layer=0)) for name in ATTENTION_PRUNERS
        }
        # (flattened token indices, [n, 3] cells) of the image tokens of the step being run
        self._step_cells: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- the LLM's input: kept embeddings with their cells -----------------------------------
    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(KEEP_FIELD, None)
        codes = kwargs.pop(PRUNER_FIELD, None)
        prompts = kwargs.pop(PROMPT_FIELD, None)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if "video" in inputs:
            raise ValueError(_NO_VIDEO)
        if "image" not in inputs:
            return []
        image_input = inputs["image"]
        embeds = self._process_image_input(image_input)  # per image: [rows * cols, D]
        grids = image_input["image_grid_thw"].tolist()
        merge = self.visual.spatial_merge_size
        if keeps is None or codes is None:  # inputs not made by the processor: server defaults
            keep = self.vlm_focus.keep
            keeps = [keep_count(keep, t * h * w // merge**2, clamp=True) for t, h, w in grids]
            codes = [PRUNERS.index(self.vlm_focus.pruner)] * len(grids)
        keeps, codes = per_item(keeps, len(grids)), per_item(codes, len(grids))
        if prompts is None:
            prompts = [torch.empty(0, dtype=torch.long)] * len(grids)
        out = []
        for emb, (t, h, w), n_keep, code, prompt in zip(
            embeds, grids, keeps, codes, prompts, strict=True
        ):
            if t != 1:
                raise ValueError(f"an image has one frame, got image_grid_thw={[t, h, w]}")
            rows, cols = h // merge, w // merge
            pruner = PRUNERS[code]
            if pruner in ATTENTION_PRUNERS and n_keep < rows * cols:
                kept = attention_keep(
                    self._pruners[pruner],
                    self.language_model.model,
                    torch.as_tensor(prompt),
                    self.config.image_token_id,
                    emb,
                    rows,
                    cols,
                    n_keep,
                    mrope=True,
                )
            else:
                kept = select(
                    pruner,
                    emb,
                    rows,
                    cols,
                    n_keep,
                    tiles=self.vlm_focus.tiles,
                    min_per_region=self.vlm_focus.min_per_region,
                )
            self.last_kept.append((emb.shape[0], kept))
            cells = torch.stack(
                [torch.zeros_like(kept), torch.div(kept, cols, rounding_mode="floor"), kept % cols],
                dim=-1,
            )  # [n_keep, 3] (t, h, w); images have t == 1
            kept_dev = kept.to(emb.device)
            out.append(
                torch.cat([emb[kept_dev], encode_cells(cells, emb.dtype).to(emb.device)], dim=-1)
            )
        return tuple(out)

    # --- M-RoPE --------------------------------------------------------------------------------
    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Positions ``[3, N]`` of the pruned prompt and the decode delta: text keeps the
        positions of the unpruned prompt; every token of an image gets the image's base
        position in all three sections, to which :meth:`forward` adds the token's cell."""
        merge = self.config.vision_config.spatial_merge_size
        pieces, start, next_pos = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality != "image":
                raise ValueError(_NO_VIDEO)
            offset, length = feature.mm_position.offset, feature.mm_position.length
            t, h, w = feature.data["image_grid_thw"].data.tolist()
            text = offset - start
            pieces.append(torch.arange(text).expand(3, text) + next_pos)
            base = next_pos + text
            pieces.append(torch.full((3, length), base, dtype=torch.long))
            next_pos = base + max(t, h // merge, w // merge)
            start = offset + length
        tail = len(input_tokens) - start
        pieces.append(torch.arange(tail).expand(3, tail) + next_pos)
        positions = torch.cat(pieces, dim=1).long()
        end = next_pos + tail
        return positions, end - len(input_tokens)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        """vLLM's embedding merge, after taking the cell channels off the image embeddings
        (kept for :meth:`forward`, which runs next on the same flattened batch)."""
        self._step_cells = None
        if multimodal_embeddings is not None and len(multimodal_embeddings) > 0:
            cells = torch.cat(
                [decode_cells(mm[:, -POSITION_CHANNELS:]) for mm in multimodal_embeddings]
            )  # [n_mm, 3], in placeholder order
            where = torch.nonzero(is_multimodal).flatten()
            if where.numel() != cells.shape[0]:
                raise RuntimeError(f"{cells.shape[0]} image embeddings for {where.numel()} slots")
            self._step_cells = (where, cells.to(where.device))
            multimodal_embeddings = [
                copy_mm_embedding_modality(mm, mm[:, :-POSITION_CHANNELS])
                for mm in multimodal_embeddings
            ]
        return super().embed_input_ids(
            input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        """vLLM's forward, with each kept image token at its original M-RoPE position: its
        image's base position (from :meth:`get_mrope_input_positions`) plus its cell."""
        if self._step_cells is not None:
            where, cells = self._step_cells
            self._step_cells = None
            # In place: `positions` is the runner's persistent buffer, which a CUDA-graph replay
            # of the decoder reads (a copy would be ignored); the runner rewrites it every step.
            positions[:, where] += cells.T.to(positions.dtype)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
