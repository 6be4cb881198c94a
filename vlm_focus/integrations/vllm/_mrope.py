"""Pruning before the LLM for vLLM's Qwen-VL classes (M-RoPE), shared by the Qwen2.5-VL and
Qwen3-VL classes; each class mixes :class:`MRopePruningModel` into vLLM's own model class.

- ``embed_multimodal``: runs vLLM's vision tower unchanged on each image and video, keeps the
  tokens the registered pruner keeps at layer 0 (:func:`._layer0.layer0_keep`) and returns
  only those rows, in the item's order, each with its
  ``(t, h, w)`` cell appended as position channels. A row carries all of its token's features,
  so Qwen3-VL's DeepStack features (concatenated after the main ones) follow the kept tokens.
- M-RoPE: an item fills one or more runs of placeholders (:meth:`position_runs`: an image, a
  Qwen2.5-VL video, or each frame of a Qwen3-VL video, which is written after its timestamp).
  ``get_mrope_input_positions`` lays out the pruned prompt with the text positions of the
  unpruned one (a run advances the position by its extent however many of its tokens are kept)
  and gives every token of a run the run's first position; ``embed_input_ids`` strips the cell
  channels off the embeddings it scatters into the batch and keeps them, and ``forward`` adds
  each kept token's cell to its run's position before the LLM runs, which gives it its original
  position. The addition is made in place, in the model runner's persistent positions buffer
  (rewritten by the runner every step): a CUDA-graph replay of the decoder reads that buffer,
  never a copy. ``forward`` itself must run eagerly for prefill batches, so
  ``cudagraph_mode=FULL`` (whole-model graphs for mixed batches) is refused.

vLLM's own hook for this (``SupportsMultiModalPruning.recompute_mrope_positions``, used by EVS)
is only called while its video-pruning switch is on, and vLLM's CPU model runner never calls it;
the position fix above needs neither. ``--video-pruning-rate`` (EVS) is refused, as is pipeline
parallelism (later stages would not see the cells).
"""

from __future__ import annotations

import torch
from vllm.multimodal.utils import copy_mm_embedding_modality

from ...core.before_llm import item_layout
from ._model import PruningModel, require_piecewise_prefill
from ._processor import PruningProcessorMixin

#: Position channels appended to each kept embedding: ``(t, h, w)`` of its cell, each split as
#: ``value // 64, value % 64`` so that they stay exact in bf16 (integers up to 256) for grids of
#: up to 4096 cells a side.
_SPLIT = 64
POSITION_CHANNELS = 6


class MRopeImageProcessor(PruningProcessorMixin):
    """The Qwen-VL processors' share of :class:`._processor.PruningProcessorMixin`: the image
    and video tokens, an image's tokens and a video's frames from their grids. The class sets
    ``video_budgets`` and implements ``_unpruned_video(data, i)``."""

    def _image_token(self) -> int:
        return self.info.get_hf_config().image_token_id

    def _video_token(self) -> int:
        return self.info.get_hf_config().video_token_id

    def _image_sizes(self, data) -> list[int]:
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        return (data["image_grid_thw"].prod(-1) // merge**2).tolist()

    def _video_frames(self, data) -> list[tuple[int, int]]:
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        return [(t, h * w // merge**2) for t, h, w in data["video_grid_thw"].tolist()]


class OneRunVideoProcessor(MRopeImageProcessor):
    """:class:`MRopeImageProcessor` for the classes that write a video as one run of
    placeholders, its frames' tokens back to back (Qwen2-VL, Qwen2.5-VL)."""

    def _unpruned_video(self, data, i: int) -> tuple[list[int], list[int]]:
        token = self._video_token()
        t, n = self._video_frames(data)[i]
        return [token], [token] * (t * n)


def walk_positions(
    ids: list[int], token: int, runs: list[tuple[int, torch.Tensor | None]], start: int = 0
) -> tuple[torch.Tensor, int]:
    """``([3, len(ids)] positions, next position)`` of a piece of prompt: text counts up from
    ``start`` in all three sections; the ``i``-th run of ``token`` starts at the running
    position ``p`` (each of its tokens at ``p``, plus its cell from ``runs[i][1] [n, 3]`` when
    given) and moves it to ``p + runs[i][0]``."""
    out = torch.empty(3, len(ids), dtype=torch.long)
    p, run, i = start, 0, 0
    while i < len(ids):
        if ids[i] != token:
            out[:, i] = p
            p, i = p + 1, i + 1
            continue
        end = i
        while end < len(ids) and ids[end] == token:
            end += 1
        if run >= len(runs):
            raise ValueError(f"more runs of token {token} than the {len(runs)} the items give")
        extent, cells = runs[run]
        out[:, i:end] = p
        if cells is not None:
            if cells.shape[0] != end - i:
                raise ValueError(f"a run of {end - i} tokens for {cells.shape[0]} cells")
            out[:, i:end] += cells.T
        p, run, i = p + extent, run + 1, end
    if run != len(runs):
        raise ValueError(f"{run} runs of token {token} for the {len(runs)} the items give")
    return out, p


def encode_cells(cells: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, 3]`` integer ``(t, h, w)`` -> ``[n, 6]`` channels in ``dtype``."""
    hi = torch.div(cells, _SPLIT, rounding_mode="floor")
    lo = cells - hi * _SPLIT
    return torch.stack([hi, lo], dim=-1).flatten(1).to(dtype)  # [n, (t_hi t_lo h_hi ...)]


def decode_cells(channels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_cells`: ``[n, 6]`` -> ``[n, 3]`` long."""
    pairs = channels.float().round().long().view(-1, 3, 2)
    return pairs[..., 0] * _SPLIT + pairs[..., 1]


def take_position_channels(multimodal_embeddings, is_multimodal, decode) -> tuple:
    """Split one step's visual embeddings into their position channels and the rest:
    ``((where, values), embeddings)``, where ``where`` are the flat slots of the visual tokens,
    ``values`` are ``decode(channels)`` in placeholder order and ``embeddings`` lack the
    channels; ``(None, multimodal_embeddings)`` when the step carries none."""
    if multimodal_embeddings is None or not len(multimodal_embeddings):
        return None, multimodal_embeddings
    values = torch.cat([decode(mm[:, -POSITION_CHANNELS:]) for mm in multimodal_embeddings])
    where = torch.nonzero(is_multimodal).flatten()
    if where.numel() != values.shape[0]:
        raise RuntimeError(f"{values.shape[0]} visual embeddings for {where.numel()} slots")
    stripped = [
        copy_mm_embedding_modality(mm, mm[:, :-POSITION_CHANNELS]) for mm in multimodal_embeddings
    ]
    return (where, values.to(where.device)), stripped


class MRopePruningModel(PruningModel):
    """Mixed in before vLLM's Qwen-VL model class (see the module docstring).
    ``scored_width`` is how many leading features of an item's row the LLM's first layer
    receives (all of them, unless the class packs more after them); ``frames_apart`` says
    whether the class positions each video frame as an image of its own, after its timestamp
    (Qwen3-VL), rather than the whole video as one grid whose time axis is scaled
    (:meth:`frame_times`, Qwen2.5-VL)."""

    scored_width: int | None = None
    frames_apart: bool = False

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.multimodal_config.is_multimodal_pruning_enabled():
            raise ValueError(
                "--video-pruning-rate (EVS) cannot be combined with vlm_focus's pruning "
                "architecture, which prunes videos by its own pruner and budget: use one or "
                "the other"
            )
        require_piecewise_prefill(vllm_config, "vlm_focus's pruning architecture")
        # (flattened token indices, [n, 3] cells) of the visual tokens of the step being run
        self._step_cells: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    # --- where an item's tokens sit ----------------------------------------------------------
    def frame_times(self, frames: int, seconds: float | None) -> torch.Tensor:
        """``[frames]`` time position of each frame of a video whose frames lie ``seconds``
        apart: the frame index scaled by ``seconds * tokens_per_second``, rounded down, as
        Qwen2.5-VL's ``get_rope_index`` does."""
        per_second = getattr(self.config.vision_config, "tokens_per_second", 1.0)
        scale = (1.0 if seconds is None else float(seconds)) * per_second
        return (torch.arange(frames, dtype=torch.float64) * scale).long()

    def position_runs(
        self, modality: str, grid_thw: list[int], seconds: float | None = None
    ) -> list[tuple[int, torch.Tensor]]:
        """The runs of placeholders one item fills in the unpruned prompt, each ``(extent,
        cells [n, 3])``: the positions it moves the prompt on by, and each token's ``(t, h,
        w)`` offset from the run's first position. An image, or a video on Qwen2.5-VL, is one
        run; a video whose frames sit apart is one run per frame."""
        t, h, w = grid_thw
        merge = self.config.vision_config.spatial_merge_size
        rows, cols = h // merge, w // merge
        cells = item_layout(rows, cols, t)[0].clone()  # (frame, row, col)
        if modality == "video" and self.frames_apart:
            cells[:, 0] = 0
            return list(zip([max(rows, cols)] * t, cells.split(rows * cols), strict=True))
        if modality == "image" and t != 1:
            raise ValueError(f"an image has one frame, got image_grid_thw={grid_thw}")
        times = self.frame_times(t, seconds) if modality == "video" else torch.zeros(1).long()
        cells[:, 0] = times[cells[:, 0]]
        return [(int(max(times[-1], rows - 1, cols - 1)) + 1, cells)]

    # --- the LLM's input: kept embeddings with their cells -----------------------------------
    def embed_multimodal(self, **kwargs: object):
        fields = self.pop_fields(kwargs)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        out = []
        for modality, item_input in inputs.items():  # in the order vLLM gives them
            if modality == "image":
                embeds = self._process_image_input(item_input)  # per image: [n, D (+ D')]
                grids = item_input["image_grid_thw"].tolist()
                seconds = [None] * len(grids)
            else:
                embeds = self._process_video_input(item_input)
                grids = item_input["video_grid_thw"].tolist()
                given = item_input.get("second_per_grid_ts")
                seconds = [None] * len(grids) if given is None else given.tolist()
            requests = self.item_requests(fields[modality], [e.shape[0] for e in embeds])
            for emb, grid, second, request in zip(embeds, grids, seconds, requests, strict=True):
                out.append(self._kept_item(modality, emb, grid, second, request))
        return tuple(out)

    def _kept_item(self, modality, emb, grid, seconds, request) -> torch.Tensor:
        """One item's kept rows, each with its ``(t, h, w)`` cell appended."""
        t, h, w = grid
        merge = self.visual.spatial_merge_size
        layout = item_layout(h // merge, w // merge, t)
        runs = self.position_runs(modality, grid, seconds)
        token = self.image_token_id if modality == "image" else self.config.video_token_id

        def positions(ids: torch.Tensor) -> torch.Tensor:
            return walk_positions(ids.tolist(), token, runs)[0]

        # the score reads what the LLM's first layer receives
        kept = self.keep_cells(
            request,
            emb[:, : self.scored_width],
            layout,
            kind=modality,
            token=token,
            positions=positions,
        )
        cells = torch.cat([c for _, c in runs])[kept]  # [n_keep, 3] offsets from their runs
        kept_dev = kept.to(emb.device)
        return torch.cat([emb[kept_dev], encode_cells(cells, emb.dtype).to(emb.device)], dim=-1)

    # --- M-RoPE --------------------------------------------------------------------------------
    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Positions ``[3, N]`` of the pruned prompt and the decode delta: text keeps the
        positions of the unpruned prompt; every kept token of a run (an image, a video, or one
        frame of it) gets the run's first position in all three sections, to which
        :meth:`forward` adds the token's cell."""
        pieces, start, next_pos = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            offset, length = feature.mm_position.offset, feature.mm_position.length
            modality = feature.modality
            data = feature.data
            seconds = data.get("second_per_grid_ts") if modality == "video" else None
            runs = self.position_runs(
                modality,
                data[f"{modality}_grid_thw"].data.tolist(),
                None if seconds is None else seconds.data.item(),
            )
            text = offset - start
            pieces.append(torch.arange(text).expand(3, text) + next_pos)
            token = self.image_token_id if modality == "image" else self.config.video_token_id
            ids = list(input_tokens[offset : offset + length])
            bare = [(extent, None) for extent, _ in runs]
            placed, next_pos = walk_positions(ids, token, bare, next_pos + text)
            pieces.append(placed)
            start = offset + length
        tail = len(input_tokens) - start
        pieces.append(torch.arange(tail).expand(3, tail) + next_pos)
        positions = torch.cat(pieces, dim=1).long()
        end = next_pos + tail
        return positions, end - len(input_tokens)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        """vLLM's embedding merge, after taking the cell channels off the visual embeddings
        (kept for :meth:`forward`, which runs next on the same flattened batch)."""
        self._step_cells, multimodal_embeddings = take_position_channels(
            multimodal_embeddings, is_multimodal, decode_cells
        )  # cells [n_mm, 3], in placeholder order
        return super().embed_input_ids(
            input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        """vLLM's forward, with each kept visual token at its original M-RoPE position: its
        run's first position (from :meth:`get_mrope_input_positions`) plus its cell."""
        if self._step_cells is not None:
            where, cells = self._step_cells
            self._step_cells = None
            # In place: `positions` is the runner's persistent buffer, which a CUDA-graph replay
            # of the decoder reads (a copy would be ignored); the runner rewrites it every step.
            positions[:, where] += cells.T.to(positions.dtype)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
