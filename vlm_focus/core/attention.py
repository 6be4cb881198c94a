"""The attention math every reader of a decoder's attention shares.

The pruners' scoring, the kernel's torch twin, the fixation step and the attention probes all
recompute a layer's attention rows from its own norm, q/k projections and RoPE tables rather
than asking the model for ``output_attentions``. This module is the one home of that math:

* :func:`apply_rope`: RoPE as the decoders apply it (M-RoPE arrives folded into ``cos``/``sin``);
* :func:`layer_qk`: q for chosen rows and k for every token of one layer's input;
* :func:`allowed_keys`: the model's mask rule (:data:`MASK_RULES`) + padding, by original
  positions;
* :func:`attention_logits`: ``q k^T * scaling``, GQA heads grouped onto their kv head instead
  of repeating the keys; :func:`attention_probs`: their softmax over allowed keys;
* :func:`text_after_image`: the instruction, i.e. the valid tokens after each row's last visual
  token;
* :func:`instruction_relevance`: the attention the instruction rows pay each key, averaged over
  heads and rows.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the decoder applies it: ``x * cos + rotate_half(x) * sin``; M-RoPE arrives
    already folded into ``cos``/``sin`` (``[B, T, D]``), so one formula serves both. Tables
    narrower than the head (partial rotary, Qwen3.5) turn its first ``D`` dims and pass the
    rest through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        head, rest = x[..., :turned], x[..., turned:]
        return torch.cat([head * cos + rotate_half(head) * sin, rest], dim=-1)
    return x * cos + rotate_half(x) * sin


def layer_qk(
    adapter,
    layer: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, H, Tq, D]`` of the rows ``rows [B, Tq]`` (indices into ``hidden``) and k
    ``[B, Hkv, T, D]`` of every token, after RoPE, from the layer's own input norm and
    projections; ``cos``/``sin`` are the ``[B or 1, T, D]`` tables of ``hidden``'s tokens. A
    stand-in layer with its own ``query_key`` (an adapter's
    :meth:`~vlm_focus.model_adapters.ModelAdapter.scoring_layer`) computes them itself."""
    own = getattr(layer, "query_key", None)
    if own is not None:
        return own(hidden, cos, sin, rows)
    attention = getattr(layer, adapter.attention)
    norm = getattr(layer, adapter.input_norm)
    batch, _, width = hidden.shape
    cos = cos.expand(batch, -1, -1)
    sin = sin.expand(batch, -1, -1)
    normed = norm(hidden)  # [B, T, D]
    q_in = normed.gather(1, rows[..., None].expand(-1, -1, width))  # [B, Tq, D]
    q, k = adapter.project_qk(attention, q_in, normed)
    index = rows[..., None].expand(-1, -1, cos.shape[-1])
    q = apply_rope(q, cos.gather(1, index), sin.gather(1, index))
    k = apply_rope(k, cos, sin)
    return q, k


#: The attention-mask rules the core understands, as a model adapter declares its model's
#: (``ModelAdapter.mask_rule``): ``"causal"``, a query sees every key at or before it;
#: ``"image_blocks"`` (Gemma 3), causal, and a visual token also sees every token of its own
#: image block (a run of consecutive visual tokens), before or after it; ``"window_image_blocks"``
#: (Gemma 4), ``"image_blocks"`` on sliding-window layers and ``"causal"`` on the others. A
#: layer's sliding window (its attention module's, see ``ModelAdapter.attention_window``) narrows
#: every rule. :func:`allowed_keys` is the one place a rule becomes a mask.
MASK_RULES = ("causal", "image_blocks", "window_image_blocks")


def check_mask_rule(rule: object) -> str:
    """``rule`` if it is one of :data:`MASK_RULES`, else ``ValueError`` listing them."""
    if rule not in MASK_RULES:
        raise ValueError(f"mask_rule={rule!r}; allowed: {MASK_RULES}")
    return rule


def image_blocks(visual: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` id of the image block each token belongs to (-1 off the visual tokens): a
    block is a run of consecutive visual tokens. Pruning removes only visual tokens, so runs
    in a pruned sequence are still the blocks of the original one."""
    starts = visual & ~torch.nn.functional.pad(visual, (1, 0))[:, :-1]
    return torch.where(visual, starts.long().cumsum(1) - 1, -1)


def allowed_keys(
    key_valid: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor | None = None,
    *,
    rule: str = "causal",
    window: int | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, Tq, S]`` bool: key ``s`` is valid and the mask ``rule`` (one of
    :data:`MASK_RULES`) lets query ``t`` see it, comparing original positions
    (``query_pos [B, Tq]``, ``key_pos [B, S]``, default ``0..S-1``) so pruned sequences keep
    the unpruned model's semantics:

    * ``"causal"``: ``key_pos <= query_pos``;
    * ``"image_blocks"``: causal, or query and key in the same image block; ``blocks`` is
      ``(query_block [B, Tq], key_block [B, S])`` (:func:`image_blocks`, -1 off images),
      required with this rule;
    * ``"window_image_blocks"``: ``"image_blocks"`` when ``window`` is set, else ``"causal"``;
    * ``window`` (a sliding-window layer): additionally ``key_pos > query_pos - window``.
    """
    if key_pos is None:
        key_pos = torch.arange(key_valid.shape[1], device=key_valid.device)[None]
    rule = check_mask_rule(rule)
    seen = key_pos[:, None, :] <= query_pos[:, :, None]  # [B, Tq, S]
    if rule == "image_blocks" or (rule == "window_image_blocks" and window is not None):
        if blocks is None:
            raise ValueError(
                f"mask_rule={rule!r} needs blocks=(query_block, key_block): the image "
                "block of each query and key (vlm_focus.core.attention.image_blocks)"
            )
        query_block, key_block = blocks
        same = query_block[:, :, None] == key_block[:, None, :]
        seen = seen | (same & (query_block[:, :, None] >= 0))
    if window is not None:
        seen = seen & (key_pos[:, None, :] > query_pos[:, :, None] - window)
    return key_valid[:, None, :] & seen


def layer_window(adapter, layer: nn.Module) -> int | None:
    """The sliding window of decoder ``layer``'s attention (keys more than ``window - 1``
    positions back are not seen), or ``None`` for full attention."""
    if adapter.attention_window is None:
        return None
    return getattr(getattr(layer, adapter.attention), adapter.attention_window, None)


def attention_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """``q k^T * scaling`` as ``[B, Hkv, G, Tq, S]`` float32 (``G = H / Hkv`` query heads per
    kv head): q ``[B, H, Tq, D]``, k ``[B, Hkv, S, D]``, head ``h`` reads kv head ``h // G``;
    GQA heads are grouped onto their kv head instead of repeating the keys."""
    batch, n_heads, n_query, dim = q.shape
    n_kv, seq = k.shape[1], k.shape[2]
    groups = n_heads // n_kv
    grouped = q.float().reshape(batch, n_kv, groups * n_query, dim)
    logits = torch.matmul(grouped, k.float().transpose(-1, -2)) * scaling  # [B, Hkv, G*Tq, S]
    return logits.view(batch, n_kv, groups, n_query, seq)


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, scaling: float, allowed: torch.Tensor
) -> torch.Tensor:
    """``softmax(q k^T * scaling)`` over allowed keys: q ``[B, H, Tq, D]``, k ``[B, Hkv, S, D]``
    (head ``h`` reads kv head ``h // (H / Hkv)``), allowed ``[B, Tq, S]`` -> ``[B, H, Tq, S]``
    float32; a row with no allowed key is 0. The largest intermediate is this slab."""
    batch, n_heads, n_query, _ = q.shape
    logits = attention_logits(q, k, scaling)
    logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.view(batch, n_heads, n_query, k.shape[2])


def text_after_image(visual: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the valid tokens after each row's last visual token (the instruction);
    all False in a row without visual tokens."""
    batch, seq = visual.shape
    index = torch.arange(seq, device=visual.device).expand(batch, seq)
    last = torch.where(visual, index, -1).amax(dim=1, keepdim=True)
    return valid & (index > last) & (last >= 0)


def instruction_relevance(probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: the attention the query rows ``T`` (the instruction) pay each key ``s``,
    averaged over heads and rows::

        r[b, s] = 1/(H |T_b|) sum_h sum_{t in T_b} probs[b, h, t, s]

    ``probs [B, H, Tq, S]`` are attention rows (:func:`attention_probs`), ``rows [B, Tq]`` bool
    marks the rows of ``T`` among them (False: padding of a shorter row); a batch row without
    any row of ``T`` scores 0 everywhere."""
    weights = rows.to(probs.dtype) / rows.sum(1, keepdim=True).clamp(min=1)  # [B, Tq]
    return torch.einsum("bhts,bt->bs", probs, weights) / probs.shape[1]
