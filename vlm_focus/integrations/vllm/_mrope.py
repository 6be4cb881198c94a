"""Pruning before the LLM for vLLM's Qwen-VL classes (M-RoPE), shared by the Qwen2.5-VL and
Qwen3-VL classes; each class mixes :class:`MRopePruningModel` into vLLM's own model class.

- ``embed_multimodal``: runs vLLM's vision tower unchanged, selects the kept cells from the
  embeddings (``pool``/``pyramid``: :func:`._scores.select`; the attention pruners: layer 0 of
  vLLM's own decoder, :func:`._layer0.attention_keep`) and returns only those rows, in raster
  order, each with its ``(t, h, w)`` cell appended as position channels. A row carries all of
  its token's features, so Qwen3-VL's DeepStack features (concatenated after the main ones)
  follow the kept tokens.
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
their frame times), as are ``--video-pruning-rate`` (EVS) and pipeline parallelism (later
stages would not see the cells).
"""

from __future__ import annotations

import torch
from vllm.multimodal.utils import copy_mm_embedding_modality

from ._layer0 import grid_layout
from ._model import PruningModel
from ._processor import NO_VIDEO, PruningProcessorMixin

#: Position channels appended to each kept embedding: ``(t, h, w)`` of its cell, each split as
#: ``value // 64, value % 64`` so that they stay exact in bf16 (integers up to 256) for grids of
#: up to 4096 cells a side.
_SPLIT = 64
POSITION_CHANNELS = 6


class MRopeImageProcessor(PruningProcessorMixin):
    """The Qwen-VL processors' share of :class:`._processor.PruningProcessorMixin`: the image
    token, and an image's tokens from its grid."""

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_id

    def _image_sizes(self, data) -> list[int]:
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        return (data["image_grid_thw"].prod(-1) // merge**2).tolist()


def encode_cells(cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 3]`` integer ``(t, h, w)`` -> ``[n, 6]`` channels in ``dtype``."""
    hi = torch.div(cells, _SPLIT, rounding_mode="floor")
    lo = cells - hi * _SPLIT
    return torch.stack([hi, lo], dim=-1).flatten(1).to(dtype)  # [n, (t_hi t_lo h_hi ...)]


def decode_cells(channels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_cells`: ``[n, 6]`` -> ``[n, 3]`` long."""
    pairs = channels.float().round().long().view(-1, 3, 2)
    return pairs[..., 0] * _SPLIT + pairs[..., 1]


class MRopePruningModel(PruningModel):
    """Mixed in before vLLM's Qwen-VL model class (see the module docstring).
    ``scored_width`` is how many leading features of an image row the LLM's first layer
    receives (all of them, unless the class packs more after them)."""

    mrope = True
    scored_width: int | None = None

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.multimodal_config.is_multimodal_pruning_enabled():
            raise ValueError(
                "--video-pruning-rate (EVS) cannot be combined with vlm_focus's pruning "
                "architecture; " + NO_VIDEO
            )
        graphs = vllm_config.compilation_config.cudagraph_mode
        if graphs is not None and graphs.mixed_mode() == graphs.FULL:
            # a full graph of a prefill batch would replay without forward()'s position fix
            raise ValueError(
                "vlm_focus's pruning architecture needs piecewise CUDA graphs for prefill: use "
                "cudagraph_mode FULL_AND_PIECEWISE (vLLM's default), PIECEWISE or "
                "FULL_DECODE_ONLY, not FULL"
            )
        # (flattened token indices, [n, 3] cells) of the image tokens of the step being run
        self._step_cells: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    # --- the LLM's input: kept embeddings with their cells -----------------------------------
    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if "video" in inputs:
            raise ValueError(NO_VIDEO)
        if "image" not in inputs:
            return []
        image_input = inputs["image"]
        embeds = self._process_image_input(image_input)  # per image: [rows * cols, D (+ D')]
        grids = image_input["image_grid_thw"].tolist()
        merge = self.visual.spatial_merge_size
        sizes = [t * h * w // merge**2 for t, h, w in grids]
        out = []
        for emb, (t, h, w), request in zip(
            embeds, grids, self.image_requests(fields, sizes), strict=True
        ):
            if t != 1:
                raise ValueError(f"an image has one frame, got image_grid_thw={[t, h, w]}")
            layout = grid_layout(h // merge, w // merge)
            # the score reads what the LLM's first layer receives
            kept = self.keep_cells(request, emb[:, : self.scored_width], layout)
            cells = layout[0][kept]  # [n_keep, 3] (t, h, w): an image is frame 0 of its grid
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
                raise ValueError(NO_VIDEO)
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
