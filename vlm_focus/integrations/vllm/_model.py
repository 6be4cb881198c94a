"""What every pruning model class shares: its set-up checks, the per-image fields its processor
sends, and which cells each image keeps."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import torch

from ...config import keep_count
from ...core.before_llm import before_llm_pruner
from ...geometry import Size
from . import BUDGETS, adapter_of, model_type_of, served_positions, served_pruners
from ._layer0 import VllmLayerAdapter, layer0_keep
from ._request import item_fields, per_item, serve_options

#: What one image or video asks for: ``(pruner, kept count, prompt ids, budget)``.
Request = tuple[str, int, torch.Tensor, str]


def require_piecewise_prefill(vllm_config, what: str, otherwise: str = "") -> None:
    """Refuse ``cudagraph_mode`` FULL: a full graph of a prefill batch replays without
    ``forward()``'s position fix, which ``what`` needs. ``otherwise`` names a setting that
    does without it."""
    graphs = vllm_config.compilation_config.cudagraph_mode
    if graphs is not None and graphs.mixed_mode() == graphs.FULL:
        raise ValueError(
            f"{what} needs piecewise CUDA graphs for prefill: use cudagraph_mode "
            "FULL_AND_PIECEWISE (vLLM's default), PIECEWISE or FULL_DECODE_ONLY, not FULL"
            + (f", or serve {otherwise}" if otherwise else "")
        )


class PruningModel:
    """Mixed in before a vLLM model class of the module that :data:`MODELS` names for a
    ``model_type``: what it serves (``pruners``, default first; ``served_positions``) follows
    from that entry, the model's adapter and the pruner registry, and ``layer_adapter`` carries
    the adapter's ``frames`` (for ``debiased``) and its rule for the layer that scores
    (``scoring_layer_of``). The class sets ``image_token_id``.

    ``last_kept`` holds, for the most recent images and videos encoded in this process (newest
    last), the pair ``(n_tokens, kept)`` with ``kept`` the kept token indices in the item's
    order (raster order; a video's frame by frame).
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        model_type = model_type_of(type(self).__module__)
        self.pruners = served_pruners(model_type)
        self.served_positions = served_positions(model_type)
        adapter = adapter_of(model_type)
        self.layer_adapter = VllmLayerAdapter(adapter.frames, adapter.scoring_layer_of)
        self.vlm_focus = serve_options(self.config, self.pruners, self.served_positions)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            # later stages would not see what the first one kept
            raise ValueError(
                "vlm_focus's pruning architecture does not run with pipeline parallelism"
            )
        self.last_kept: deque[tuple[int, torch.Tensor]] = deque(maxlen=256)
        # the server's pruner with its options; a request's other choice with its defaults
        focus = self.vlm_focus
        self._pruners = {
            name: before_llm_pruner(
                replace(focus, pruner=name, options={}),
                focus.options if name == focus.pruner else {},
            )
            for name in self.pruners
        }

    @staticmethod
    def pop_fields(kwargs: dict) -> dict[str, tuple]:
        """The processor's per-item fields of each modality, taken out of
        ``embed_multimodal``'s kwargs."""
        return {
            modality: tuple(kwargs.pop(name, None) for name in item_fields(modality))
            for modality in ("image", "video")
        }

    def item_requests(self, fields: tuple, sizes: list[int]) -> list[Request]:
        """``(pruner, kept count, prompt ids, budget)`` per item of ``sizes`` tokens; inputs
        the processor did not make get the server's setting, per item."""
        keeps, codes, budgets, prompts, _ = fields
        n = len(sizes)
        if keeps is None or codes is None:
            keeps = [keep_count(self.vlm_focus.keep, size, clamp=True) for size in sizes]
            codes = [self.pruners.index(self.vlm_focus.pruner)] * n
        if budgets is None:
            budgets = [BUDGETS.index(self.vlm_focus.budget)] * n
        keeps, codes, budgets = per_item(keeps, n), per_item(codes, n), per_item(budgets, n)
        if prompts is None:
            prompts = [torch.empty(0, dtype=torch.long)] * n
        return [
            (self.pruners[code], n_keep, torch.as_tensor(prompt), BUDGETS[budget])
            for code, n_keep, prompt, budget in zip(codes, keeps, prompts, budgets, strict=True)
        ]

    def keep_cells(
        self,
        request: Request,
        scored: torch.Tensor,
        layout: tuple[torch.Tensor, list[tuple[int, int]]],
        image_size: Size | None = None,
        *,
        kind: str = "image",
        token: int | None = None,
        positions=None,
    ) -> torch.Tensor:
        """Kept token indices (the item's order) of one image or video (``kind``) whose
        LLM-input embeddings are ``scored [n, D]``, its tokens at ``layout`` (``(cells,
        grids)``), the original image ``image_size`` when the inputs carry it, its placeholder
        ``token`` (default: the image token) and ``positions``, the class's RoPE positions of a
        prompt holding it (``None``: 1-D); recorded in ``last_kept``. The registered pruner
        chooses as in ``vf.wrap`` (:func:`._layer0.layer0_keep`)."""
        pruner, n_keep, prompt, budget = request
        chosen = self._pruners[pruner]
        attention = chosen.reads_layer_attention
        kept = layer0_keep(
            chosen,
            scored,
            layout,
            n_keep,
            language_model=self.language_model.model if attention else None,
            prompt_ids=prompt if attention else None,
            token=self.image_token_id if token is None else token,
            positions=positions,
            kind=kind,
            budget=budget,
            image_size=image_size,
            adapter=self.layer_adapter,
        )
        self.last_kept.append((layout[0].shape[0], kept))
        return kept
