"""vlm_focus's registered pruners run on one image or video served by vLLM, at layer 0.

``vf.wrap(model, layer=0, ...)`` scores the visual tokens with layer 0's own input norm, q/k
projections and RoPE, from the prompt's query rows (:class:`~vlm_focus.core.pruner.StageContext`).
Here the same context is built from vLLM's modules for one prompt with one image or video
(:mod:`vlm_focus.core.before_llm`), and the registered pruner itself chooses from it, so the
kept cells are the ones ``vf.wrap`` keeps. For a pruner that ``reads_layer_attention``:

- hidden states: vLLM's token embedding of the unpruned prompt with the item's embeddings in
  its placeholder rows (layer 0's input);
- the layer: layer 0, or the one the model adapter scores layer 0 with
  (``ModelAdapter.scoring_layer_of``: Qwen3.5's first full-attention layer, since its layer 0
  is a Gated DeltaNet, the adapter's ``"next_full"`` rule);
- q/k: vLLM's fused ``qkv_proj`` split into its q and k parts (Qwen3.5's queries come with an
  output gate per head, which is dropped);
- RoPE: rows of vLLM's own ``cos_sin_cache`` at the unpruned prompt's positions (neox layout,
  which is transformers' ``rotate_half``; a partial rotary turns only the first ``rotary_dim``
  dims, as the core's ``apply_rope`` does with narrower tables): ``0..S-1`` for the 1-D RoPE of
  the LLaVA family;
  for the Qwen-VL M-RoPE, the ``(t, h, w)`` positions ``get_rope_index`` gives the prompt (the
  model class's rule, :mod:`._mrope`), each rotary frequency read at its own channel
  (:func:`mrope_channels`);
- Qwen3's per-head q/k norms, when the layer has them.

Under tensor parallelism each rank projects its own heads; they are gathered, so every rank
scores with all heads and keeps the same cells. Only torch, vLLM and vlm_focus's model-free code
run here (no transformers model classes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)

from ...core.before_llm import item_keep
from ...core.pruner import Pruner
from ...geometry import Frame, Size, view_frames


def _own_layer(layers: Sequence[nn.Module], index: int) -> nn.Module:
    return layers[index]


@dataclass(frozen=True)
class VllmLayerAdapter:
    """What :class:`StageContext` asks a model adapter: five things about a decoder layer,
    answered for vLLM's Llama-style layers, and how an image's views sit on it when no processor
    is known (``frames``: the model adapter's ``ModelAdapter.frames``, which ``debiased``'s
    padding fix reads), and which of vLLM's decoder layers scores a stage at a layer
    (``scoring_layer_of``: the model adapter's ``ModelAdapter.scoring_layer_of``)."""

    frames: Callable[..., list[Frame]] = view_frames
    scoring_layer_of: Callable[[Sequence[nn.Module], int], nn.Module] = _own_layer
    attention: ClassVar[str] = "self_attn"
    input_norm: ClassVar[str] = "input_layernorm"
    # the classes the plugin serves attend causally, with no sliding-window layers
    mask_rule: ClassVar[str] = "causal"
    attention_window: ClassVar[str | None] = None

    def project_qk(
        self, attention: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, H, Tq, Dh]`` and k ``[B, Hkv, S, Dh]`` before RoPE (vLLM projects q, k and v
        with one fused matrix; a gated attention's q part holds each head's query followed by
        its output gate, ``attn_output_gate``)."""
        q_size, kv_size, head_dim = attention.q_size, attention.kv_size, attention.head_dim
        gated = getattr(attention, "attn_output_gate", False)
        ranks = get_tensor_model_parallel_world_size()
        if ranks > 1 and getattr(attention, "total_num_kv_heads", ranks) < ranks:
            raise ValueError(
                "vlm_focus scores attention under tensor parallelism only when every rank holds "
                f"its own kv heads ({attention.total_num_kv_heads} kv heads, {ranks} ranks)"
            )

        def project(x: torch.Tensor, start: int, size: int, norm: str) -> torch.Tensor:
            flat = attention.qkv_proj(x.reshape(-1, x.shape[-1]))[0][:, start : start + size]
            if gated and start == 0:  # [T, H * 2 Dh] -> the queries [T, H * Dh]
                flat = flat.reshape(flat.shape[0], -1, 2 * head_dim)[..., :head_dim].flatten(1)
            if ranks > 1:  # each rank projects its own heads: every rank scores with all of them
                flat = tensor_model_parallel_all_gather(flat.contiguous(), dim=-1)
            heads = flat.reshape(*x.shape[:2], -1, head_dim)  # [B, T, H, Dh]
            if hasattr(attention, norm):  # Qwen3's per-head q/k RMSNorm, before RoPE
                heads = getattr(attention, norm)(heads)
            return heads.transpose(1, 2)

        q_width = 2 * q_size if gated else q_size
        return project(q_in, 0, q_width, "q_norm"), project(k_in, q_width, kv_size, "k_norm")


def mrope_channels(rotary: nn.Module, half: int) -> torch.Tensor:
    """``[half]``: the position channel (0 = t, 1 = h, 2 = w) each rotary frequency reads:
    consecutive ``mrope_section`` blocks (Qwen2-VL, Qwen2.5-VL) or, with ``mrope_interleaved``
    (Qwen3-VL), t/h/w in turn over the first ``3 * section`` frequencies, t after."""
    section = getattr(rotary, "mrope_section", None)
    if not section or sum(section) != half:
        raise ValueError(f"M-RoPE sections {section} do not cover {half} rotary frequencies")
    if not getattr(rotary, "mrope_interleaved", False):
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    j = torch.arange(half)
    channel = torch.zeros(half, dtype=torch.long)
    channel[(j % 3 == 1) & (j < 3 * section[1])] = 1
    channel[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return channel


def rope_tables(attention: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[1, S, head_dim]`` float32 at ``positions`` (``[S]``, or ``[3, S]`` for
    M-RoPE) from the layer's own rotary cache, in transformers' layout (each half-table
    repeated; M-RoPE's half-table takes section ``i`` of ``mrope_section`` from channel ``i``):
    ``rotary_dim`` wide, which a partial rotary makes narrower than the head."""
    rotary = attention.rotary_emb
    if not getattr(rotary, "is_neox_style", True) or rotary.rotary_dim > attention.head_dim:
        raise ValueError(
            "vlm_focus scores attention in vLLM only for neox-style RoPE over the head's first "
            f"dims (rotary_dim={rotary.rotary_dim}, head_dim={attention.head_dim})"
        )
    table = rotary.cos_sin_cache
    cache = table[positions.to(table.device)].float()  # [S, rot] or [3, S, rot]
    if positions.dim() == 2:
        half = cache.shape[-1] // 2
        channel = mrope_channels(rotary, half).to(table.device)
        index = torch.arange(half, device=table.device)
        cos = cache[channel, :, index].T  # [S, half]: dim j from its section's channel
        sin = cache[channel, :, index + half].T
    else:
        cos, sin = cache.chunk(2, dim=-1)
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]


def scoring_layer(adapter: VllmLayerAdapter, layers: Sequence[nn.Module]) -> nn.Module:
    """The vLLM decoder layer whose input norm and attention score layer 0's input."""
    layer = adapter.scoring_layer_of(layers, 0)
    if hasattr(layer, "query_key"):  # a model adapter's stand-in, which computes its own q/k
        raise ValueError(
            f"the vLLM plugin scores attention with a decoder layer's own {adapter.attention!r}; "
            f"the model adapter's stand-in {type(layer).__name__} reads transformers' modules "
            "(Qwen3.5: serve it with linear_scoring='next_full', the default)"
        )
    return layer


def layer0_keep(
    pruner: Pruner,
    embeddings: torch.Tensor,
    layout: tuple[torch.Tensor, list[tuple[int, int]]],
    n_keep: int,
    *,
    language_model: nn.Module | None = None,
    prompt_ids: torch.Tensor | None = None,
    token: int | None = None,
    positions=None,
    kind: str = "image",
    budget: str = "span",
    image_size: Size | None = None,
    adapter: VllmLayerAdapter | None = None,
) -> torch.Tensor:
    """Kept token indices (sorted, the item's own order) of one image or video (``kind``) whose
    LLM-input embeddings are ``embeddings [n, D]``, chosen by ``pruner`` at layer 0
    (:func:`vlm_focus.core.before_llm.item_keep`, which says what ``layout``, ``n_keep``,
    ``budget`` and ``image_size`` are).

    A pruner that ``reads_layer_attention`` reads layer 0 of ``language_model`` (vLLM's
    decoder: ``embed_input_ids`` and ``layers``) over ``prompt_ids``: the unpruned prompt, whose
    ``n`` tokens ``token`` are the item's (a single ``token`` stands for all ``n``), at
    ``positions(ids)`` (``[S]`` or M-RoPE's ``[3, S]``; ``None``: ``0..S-1``), with the layer
    ``adapter.scoring_layer_of`` gives for layer 0. Other pruners read the item alone.
    ``adapter``: the class's :class:`VllmLayerAdapter`."""
    adapter = adapter or VllmLayerAdapter()
    n = layout[0].shape[0]
    if embeddings.shape[0] != n:
        raise ValueError(f"{embeddings.shape[0]} item embeddings for {n} tokens")
    if n_keep >= n:
        return torch.arange(n)
    device = embeddings.device
    ids = torch.empty(0, dtype=torch.long) if prompt_ids is None else prompt_ids.reshape(-1)
    layer = cos = sin = None
    if not pruner.reads_layer_attention or ids.numel() == 0:  # the item alone
        hidden, where = embeddings[None], torch.arange(n)
    else:
        ids = ids.long().cpu()
        where = torch.nonzero(ids == token).flatten()
        if where.numel() == 1 and n > 1:  # the prompt as written: one placeholder
            start = int(where[0])
            ids = torch.cat([ids[:start], torch.full((n,), token), ids[start + 1 :]])
            where = torch.arange(start, start + n)
        if where.numel() != n:
            raise ValueError(
                f"attention scores need one item per prompt ({where.numel()} placeholders for "
                f"{n} tokens)"
            )
        hidden = language_model.embed_input_ids(ids.to(device)).clone()  # [S, D]
        hidden[where.to(device)] = embeddings.to(hidden.dtype)  # layer 0's input
        hidden, layer = hidden[None], scoring_layer(adapter, language_model.layers)
        at = torch.arange(ids.shape[0]) if positions is None else positions(ids)
        cos, sin = rope_tables(layer.self_attn, at)
    return item_keep(
        pruner,
        layout,
        n_keep,
        hidden=hidden,
        where=where,
        adapter=adapter,
        layer=layer,
        cos=cos,
        sin=sin,
        kind=kind,
        budget=budget,
        image_size=image_size,
    )
