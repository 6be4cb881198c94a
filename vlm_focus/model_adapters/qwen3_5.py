"""Qwen3.5 (``qwen3_5``; ``qwen3_5_moe`` shares its decoder and layout): a hybrid decoder.

Visual tokens sit as in Qwen3-VL (merged ``image_grid_thw`` grids, one block per temporal group
of a video, interleaved M-RoPE folded into cos/sin by the model), without DeepStack. The decoder
mixes two kinds of layer, named by the text config's ``layer_types``:

* ``full_attention``: softmax attention whose ``q_proj`` gives each head's query and an output
  gate side by side, per-head q/k norms, and RoPE over the first ``partial_rotary_factor`` of the
  head dim (the core's :func:`~vlm_focus.core.attention.apply_rope` leaves the rest as it is);
* ``linear_attention``: a Gated DeltaNet, a short causal convolution over neighbouring tokens
  and a fixed-size recurrent state. It has no attention rows to read and cannot mask a key
  out: it sees every token it is given, in order.

Pruning at layer ``K`` therefore means that layers ``>= K`` run on the kept tokens only, so a
linear layer's convolution and state run over the kept sequence (see ``docs/hybrid.md``). A
stage at a linear layer scores with :attr:`HybridAdapter.linear_scoring`:

* ``"next_full"`` (default): the next full-attention layer's input norm, q/k projections, q/k
  norms and RoPE, applied to the stage layer's input hidden states;
* ``"delta_qk"``: the DeltaNet's own queries and keys (projection, causal convolution, SiLU and
  the L2 normalisation its kernel applies), softmax over ``q . k / sqrt(d)`` as a proxy.

Choose the other rule by registering a copy of the adapter::

    import dataclasses, vlm_focus as vf
    from vlm_focus.model_adapters.qwen3_5 import QWEN3_5
    vf.register_adapter(dataclasses.replace(QWEN3_5, linear_scoring="delta_qk"), replace=True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import ModelAdapter
from .qwen2_vl import QWEN2_VL

#: The rules a stage at a linear-attention layer scores by (:attr:`HybridAdapter.linear_scoring`).
LINEAR_SCORING = ("next_full", "delta_qk")


@dataclass(frozen=True)
class HybridAdapter(ModelAdapter):
    """A decoder whose ``layer_types`` mix ``linear_attention`` layers (token mixer
    :attr:`linear_attention`, no attention rows) with ``full_attention`` ones.

    Attributes:
        linear_attention: attribute name of a linear layer's token mixer.
        linear_scoring: how a stage at a linear layer scores, one of :data:`LINEAR_SCORING`.
        gated_queries: ``q_proj`` outputs, per head, the query followed by an output gate of the
            same width (only the query scores).
    """

    linear_attention: str = "linear_attn"
    linear_scoring: str = "next_full"
    gated_queries: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_scoring not in LINEAR_SCORING:
            raise ValueError(
                f"linear_scoring={self.linear_scoring!r} for '{self.model_type}'; allowed: "
                f"{LINEAR_SCORING}"
            )

    def layer_types(self, model: nn.Module) -> list[str]:
        """Per decoder layer, ``"linear_attention"`` or ``"full_attention"``."""
        return self.types_of(self.decoder_layers(model))

    def types_of(self, layers: Sequence[nn.Module]) -> list[str]:
        """:meth:`layer_types` of the decoder ``layers`` themselves."""
        return [
            "linear_attention" if hasattr(layer, self.linear_attention) else "full_attention"
            for layer in layers
        ]

    def recurrent_layers(self, model: nn.Module) -> frozenset[int]:
        return frozenset(
            i for i, kind in enumerate(self.layer_types(model)) if kind == "linear_attention"
        )

    def scoring_layer_of(self, layers: Sequence[nn.Module], index: int) -> nn.Module:
        kinds = self.types_of(layers)
        if kinds[index] == "full_attention":
            return layers[index]
        if self.linear_scoring == "delta_qk":
            return DeltaNetScorer(self, layers[index])
        full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        if not full:
            raise ValueError(
                f"'{self.model_type}' has no full-attention layer to score with; use "
                "linear_scoring='delta_qk'"
            )
        # the next full layer, or the last one before the stage when none follows it
        after = [i for i in full if i > index]
        return layers[after[0] if after else full[-1]]

    def project_qk(
        self, attention: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.gated_queries:
            return super().project_qk(attention, q_in, k_in)
        head_dim = attention.head_dim
        both = attention.q_proj(q_in).view(*q_in.shape[:2], -1, 2 * head_dim)
        q = both[..., :head_dim]  # [B, Tq, H, Dh]; the gate is the other half
        k = attention.k_proj(k_in).view(*k_in.shape[:2], -1, head_dim)
        q_norm, k_norm = (getattr(attention, name) for name in self.qk_norms)
        return q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to unit L2 norm over its last dim, as the DeltaNet's kernel does (float32)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class _Scaling:
    """What the scorers read of an attention module: its logit scale."""

    def __init__(self, scaling: float) -> None:
        self.scaling = scaling


class DeltaNetScorer:
    """A linear layer standing in for an attention layer at a pruning stage (``"delta_qk"``):
    its DeltaNet's queries and keys as softmax attention would use them, with scale
    ``1/sqrt(d)``. The core asks it for q/k through :meth:`query_key`; it holds no weights of
    its own and is never part of the model."""

    def __init__(self, adapter: HybridAdapter, layer: nn.Module) -> None:
        self.layer = layer
        self.adapter = adapter
        mixer = getattr(layer, adapter.linear_attention)
        setattr(self, adapter.attention, _Scaling(mixer.head_k_dim**-0.5))

    def query_key(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hk, Tq, dk]`` of ``rows [B, Tq]`` and k ``[B, Hk, T, dk]`` of every token of
        ``hidden [B, T, D]``, as the DeltaNet computes them before its recurrence (no RoPE:
        ``cos``/``sin`` are unused). Padding is not zeroed first: it reaches only the first
        ``kernel - 1`` tokens after it through the convolution, never a visual token that
        follows the prompt's opening text."""
        mixer = getattr(self.layer, self.adapter.linear_attention)
        normed = getattr(self.layer, self.adapter.input_norm)(hidden)
        batch, seq, _ = normed.shape
        mixed = mixer.in_proj_qkv(normed).transpose(1, 2)  # [B, C, T]
        weight = mixer.conv1d.weight  # [C, 1, kernel]: depthwise, causal with left padding
        conv = F.conv1d(
            F.pad(mixed, (weight.shape[-1] - 1, 0)),
            weight,
            mixer.conv1d.bias,
            groups=weight.shape[0],
        )
        mixed = F.silu(conv).transpose(1, 2)  # [B, T, C]
        q, k = mixed[..., : mixer.key_dim], mixed[..., mixer.key_dim : 2 * mixer.key_dim]
        q, k = (_unit(x.reshape(batch, seq, -1, mixer.head_k_dim)) for x in (q, k))
        index = rows[..., None, None].expand(-1, -1, *q.shape[2:])
        q = q.gather(1, index)
        return q.transpose(1, 2).to(hidden.dtype), k.transpose(1, 2).to(hidden.dtype)


QWEN3_5 = HybridAdapter(
    **{f.name: getattr(QWEN2_VL, f.name) for f in dataclasses.fields(QWEN2_VL)}
    | {"model_type": "qwen3_5", "qk_norms": ("q_norm", "k_norm")}
)
QWEN3_5_MOE = dataclasses.replace(QWEN3_5, model_type="qwen3_5_moe")
