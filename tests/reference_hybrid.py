"""Independent reference for pruning a hybrid decoder (Qwen3.5: Gated DeltaNet layers beside
full-attention layers), where :mod:`reference`'s masked reference is undefined: a linear layer
reads every token it is given, in order, so a token cannot be masked out of it.

Pruning at layer ``K`` means the tokens it drops never reach layers ``>= K``. This module runs
exactly that, layer by layer, with the unpruned model's own modules and none of vlm_focus's hooks:
the decoder's inputs (embeddings with the image features, M-RoPE position ids, the 2-D padding
mask) are taken from the model at its text decoder's door, then every decoder layer is called
directly on the rows it holds: all of them before the first stage, the kept rows (by their
original positions) from each stage on, each with the cos/sin of its original positions, a
causal 4-D mask over its rows and their padding (full-attention layers) or their 2-D padding mask
(linear layers). Cached decode continues on one cache whose layers hold what they held in the
prompt (the full prompt before ``K``, the kept prompt after), each step positioned as the model
positions a step (the mask's count plus ``rope_deltas``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class _AtTheDoor(Exception):
    """Raised by the hook that took the decoder's inputs: the forward need go no further."""


def decoder_inputs(model, inputs: dict) -> dict:
    """The keyword arguments the model hands its text decoder for ``inputs`` (``inputs_embeds``
    with the visual features in place, ``position_ids`` ``[3, B, S]``, ``attention_mask``); the
    model's ``rope_deltas`` are set on the way, as in any prefill."""
    decoder = model.model.language_model
    seen: dict = {}

    def take(module, args, kwargs):
        seen.update(kwargs)
        raise _AtTheDoor

    handle = decoder.register_forward_pre_hook(take, with_kwargs=True)
    try:
        model(**inputs, use_cache=False)
    except _AtTheDoor:
        pass
    finally:
        handle.remove()
    return seen


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Tq, L]`` bool -> ``[B, 1, Tq, L]`` additive mask."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class HybridReference:
    """The pruned forward by hand. ``stages`` maps a stage layer to ``[B, S']``: the original
    positions each row keeps from that layer on (text, padding and kept visual tokens, sorted);
    an empty ``stages`` keeps everything (the unpruned model)."""

    def __init__(self, model, inputs: dict, stages: dict[int, torch.Tensor]) -> None:
        self.model = model
        self.text = model.model.language_model
        self.types = self.text.config.layer_types
        self.stages = stages
        self.inputs = inputs
        self.cache = DynamicCache(config=self.text.config)
        self.held: dict[int, torch.Tensor] = {}  # layer -> original positions of its prompt rows

    def _layer(self, index: int, hidden, cos, sin, mask) -> torch.Tensor:
        return self.text.layers[index](
            hidden,
            position_embeddings=(cos, sin),
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
        )

    def prefill(self) -> torch.Tensor:
        """Logits ``[B, S_last, V]`` of the rows the last layer holds."""
        seen = decoder_inputs(self.model, self.inputs)
        hidden = seen["inputs_embeds"]
        batch, seq, width = hidden.shape
        mask2d = seen.get("attention_mask")
        self.mask2d = torch.ones(batch, seq, dtype=torch.long) if mask2d is None else mask2d
        self.prompt_width = seq
        cos, sin = self.text.rotary_emb(hidden, seen["position_ids"])
        held = torch.arange(seq).expand(batch, seq)
        for index in range(len(self.text.layers)):
            if index in self.stages:
                keep = self.stages[index]
                local = torch.searchsorted(held.contiguous(), keep)
                assert torch.equal(held.gather(1, local), keep), "a stage keeps a dropped row"
                hidden = hidden.gather(1, local[..., None].expand(-1, -1, width))
                held = keep
            self.held[index] = held
            valid = self.mask2d.gather(1, held).bool()
            rows = held.shape[1]
            if self.types[index] == "linear_attention":
                mask = valid.long()
            else:
                causal = torch.ones(rows, rows, dtype=torch.bool).tril()
                mask = _additive(causal[None] & valid[:, None, :], hidden.dtype)
            index_3d = held[..., None].expand(-1, -1, cos.shape[-1])
            hidden = self._layer(
                index, hidden, cos.gather(1, index_3d), sin.gather(1, index_3d), mask
            )
        return self.model.lm_head(self.text.norm(hidden))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of one cached decode step on ``token [B, 1]``."""
        self.mask2d = torch.cat([self.mask2d, torch.ones_like(token)], 1)
        position = self.mask2d.long().cumsum(-1)[:, -1:] - 1 + self.model.model.rope_deltas
        hidden = self.text.embed_tokens(token)
        cos, sin = self.text.rotary_emb(hidden, position[None].expand(3, -1, -1))
        new = self.mask2d.shape[1] - self.prompt_width  # decode tokens so far, this one included
        for index in range(len(self.text.layers)):
            if self.types[index] == "linear_attention":
                mask = None  # one new token: nothing to pad
            else:
                prompt = self.mask2d.gather(1, self.held[index]).bool()
                allowed = torch.cat([prompt, torch.ones(prompt.shape[0], new, dtype=torch.bool)], 1)
                mask = _additive(allowed[:, None, :], hidden.dtype)
            hidden = self._layer(index, hidden, cos, sin, mask)
        return self.model.lm_head(self.text.norm(hidden))

    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill logits ``[B, S_last, V]``, then one decode step per column of ``tokens``:
        their logits ``[B, n, V]``."""
        logits = self.prefill()
        steps = [self.step(tokens[:, t : t + 1]) for t in range(tokens.shape[1])]
        return logits, torch.cat(steps, 1)
