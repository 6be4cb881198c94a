"""What every pruning model class shares: its set-up checks, the per-image fields its processor
sends, and which cells each image keeps."""

from __future__ import annotations

from collections import deque

import torch

from ...config import FocusConfig, keep_count
from ._layer0 import ATTENTION_PRUNERS, build_pruner, layer0_keep
from ._request import KEEP_FIELD, PROMPT_FIELD, PRUNER_FIELD, per_item, serve_options
from ._scores import select

#: What one image asks for: ``(pruner, kept count, prompt ids)``.
Request = tuple[str, int, torch.Tensor]


class PruningModel:
    """Mixed in before a vLLM model class. The class sets ``pruners`` (what it serves, default
    first), ``image_token_id`` and ``mrope`` (whether its attention scores use M-RoPE).

    ``last_kept`` holds, for the most recent images encoded in this process (newest last), the
    pair ``(n_cells, kept)`` with ``kept`` the kept cell indices in raster order.
    """

    pruners: tuple[str, ...]
    mrope: bool = False

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vlm_focus = serve_options(self.config, self.pruners)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            # later stages would not see what the first one kept
            raise ValueError(
                "vlm_focus's pruning architecture does not run with pipeline parallelism"
            )
        self.last_kept: deque[tuple[int, torch.Tensor]] = deque(maxlen=256)
        self._pruners = {
            name: build_pruner(FocusConfig(pruner=name, layer=0))
            for name in self.pruners
            if name != "pyramid"  # served by its pre-LLM variant (._scores.select)
        }

    @staticmethod
    def pop_fields(kwargs: dict) -> tuple:
        """The processor's per-image fields, taken out of ``embed_multimodal``'s kwargs."""
        return tuple(kwargs.pop(name, None) for name in (KEEP_FIELD, PRUNER_FIELD, PROMPT_FIELD))

    def image_requests(self, fields: tuple, sizes: list[int]) -> list[Request]:
        """``(pruner, kept count, prompt ids)`` per image of ``sizes`` tokens; inputs the
        processor did not make get the server's setting, per image."""
        keeps, codes, prompts = fields
        if keeps is None or codes is None:
            keeps = [keep_count(self.vlm_focus.keep, n, clamp=True) for n in sizes]
            codes = [self.pruners.index(self.vlm_focus.pruner)] * len(sizes)
        keeps, codes = per_item(keeps, len(sizes)), per_item(codes, len(sizes))
        if prompts is None:
            prompts = [torch.empty(0, dtype=torch.long)] * len(sizes)
        return [
            (self.pruners[code], n_keep, torch.as_tensor(prompt))
            for code, n_keep, prompt in zip(codes, keeps, prompts, strict=True)
        ]

    def keep_cells(
        self,
        request: Request,
        scored: torch.Tensor,
        layout: tuple[torch.Tensor, list[tuple[int, int]]],
    ) -> torch.Tensor:
        """Kept token indices (the image's order) of one image whose LLM-input embeddings are
        ``scored [n, D]``, its tokens at ``layout`` (``(cells, grids)``); recorded in
        ``last_kept``. Registered pruners choose as in ``vf.wrap`` (:func:`._layer0.layer0_keep`);
        ``pyramid`` uses its pre-LLM variant on a one-grid image (:func:`._scores.select`)."""
        pruner, n_keep, prompt = request
        cells, grids = layout
        if pruner == "pyramid":
            (rows, cols), options = grids[0], self.vlm_focus
            kept = select(
                pruner,
                scored,
                rows,
                cols,
                n_keep,
                tiles=options.tiles,
                min_per_region=options.min_per_region,
            )
        else:
            attention = pruner in ATTENTION_PRUNERS
            kept = layer0_keep(
                self._pruners[pruner],
                scored,
                layout,
                n_keep,
                language_model=self.language_model.model if attention else None,
                prompt_ids=prompt if attention else None,
                image_token=self.image_token_id,
                mrope=self.mrope,
            )
        self.last_kept.append((cells.shape[0], kept))
        return kept
