"""Independent reference for pruning: the UNPRUNED model, with the pruned visual keys masked out
of attention at every layer >= the stage that pruned them. With the same kept set, a pruned run
must produce the same logits for every kept token, in prefill and in cached decode."""

from __future__ import annotations

import contextlib

import torch

import vlm_focus as vf
from vlm_focus.core.attention import layer_window
from vlm_focus.model_adapters import get_adapter

ATOL = 2e-5  # fp32: only summation order differs between a pruned run and its reference


@contextlib.contextmanager
def _masking(model, layers, dropped):
    """Run ``model`` with, at each layer, the keys ``dropped(index, call)`` names (per row, a set
    of original positions, or ``None`` for none) masked out for that layer's queries; a token
    still sees itself, so no attention row is empty. ``call`` holds this forward's 2-D mask and
    its decode step (-1 in prefill)."""
    call = {"step": -1}

    def on_model(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        ids = kwargs["input_ids"]
        mask2d = kwargs.get("attention_mask")
        if mask2d is None:  # generate() drops an all-ones mask
            mask2d = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long)
        call["mask2d"] = mask2d
        call["step"] = call["step"] + 1 if past > 0 else -1

    adapter = get_adapter(model)

    def on_layer(index):
        def hook(module, args, kwargs):
            sets = dropped(index, call)
            if sets is None:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            batch, n_new = hidden.shape[:2]
            mask2d = call["mask2d"]
            width = mask2d.shape[1]
            queries = torch.arange(width - n_new, width)
            if adapter.mask_rule == "causal" and layer_window(adapter, module) is None:
                keys = torch.arange(width)  # causal + padding, built from scratch
                allowed = (keys[None, :] <= queries[:, None]).expand(batch, n_new, width).clone()
                allowed &= mask2d.bool()[:, None, :]
            else:  # the model's own rule: the mask the decoder handed this layer
                keys, allowed = _model_mask(module, kwargs, index, batch, queries, mask2d)
            for b in range(batch):
                if sets[b]:
                    allowed[b] &= ~torch.isin(keys, torch.tensor(sorted(sets[b])))[None, :]
            allowed |= keys[None, None, :] == queries[None, :, None]  # keep the diagonal
            dtype = hidden.dtype
            mask = torch.zeros(batch, 1, n_new, keys.shape[0], dtype=dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook

    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(on_layer(i), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _model_mask(module, kwargs, index, batch, queries, mask2d):
    """The keys (original positions, ``[L]``) a layer of the unpruned model attends to in this
    call and its own mask over them, ``[B, T, L]`` bool. Its keys are the newest ``L``
    positions: all of them, or a sliding-window cache's last ones. Without a materialised mask
    (SDPA's causal shortcut) the mask is causal + padding over those keys."""
    mask = kwargs.get("attention_mask")
    width = mask2d.shape[1]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        n_keys = mask.shape[-1]
        allowed = (
            mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
        )
        allowed = allowed.expand(batch, -1, -1).clone()
    else:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = cache.layers[index] if cache is not None else None
        held = layer.keys.shape[-2] if layer is not None and layer.is_initialized else 0
        n_keys = held + queries.shape[0]
        keys = torch.arange(width - n_keys, width)
        allowed = (keys[None, :] <= queries[:, None]).expand(batch, -1, -1).clone()
        allowed &= mask2d.bool()[:, None, width - n_keys :]
    return torch.arange(width - n_keys, width), allowed


def masked_reference(model, layers, trace):
    """Within the block, ``model`` behaves like the pruned model described by ``trace``.

    ``trace.stages[i].layer`` and ``.kept[b]`` give, per stage, the original positions of the
    visual tokens row b still has; everything visual not kept is masked as a KEY from that layer
    on, in prefill and every decode step.
    """
    visual = [set(v.tolist()) for v in trace.visual_positions]
    pruned_from = [
        (stage.layer, [visual[b] - set(k.tolist()) for b, k in enumerate(stage.kept)])
        for stage in trace.stages
    ]

    def dropped(index, call):
        sets = None
        for layer, stage_sets in pruned_from:
            if index >= layer:
                sets = stage_sets
        return sets

    return _masking(model, layers, dropped)


def fixation_reference(model, layers, first_layer, trace):
    """The unpruned model where, at decode step ``t``, every layer ``>= first_layer`` masks the
    visual keys that ``trace.fixations[t]`` did not attend to (for that step only); in the
    prompt, those layers mask what the prompt's stage dropped (``prefill_keep``), if any."""
    visual = [set(v.tolist()) for v in trace.visual_positions]
    prompt = [visual[b] - set(k.tolist()) for b, k in enumerate(trace.stages[0].kept)]

    def dropped(index, call):
        if index < first_layer:
            return None
        if call["step"] < 0:
            return prompt
        fixed = trace.fixations[call["step"]]
        return [visual[b] - set(f.tolist()) for b, f in enumerate(fixed)]

    return _masking(model, layers, dropped)


def greedy_generate(model, inputs, steps, **kwargs):
    """Greedy ``generate()`` (``kwargs``: e.g. ``cache_implementation="static"``) returning the
    sequences and each step's logits ``[B, steps, V]``."""
    out = model.generate(
        **inputs,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)


def greedy_out(model, inputs, steps, min_new_tokens=None, **kwargs):
    """Greedy ``generate()`` of ``steps`` tokens (at least ``min_new_tokens``, default all of
    them), its output with every step's scores (after the logits processors) and logits."""
    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=steps,
            min_new_tokens=steps if min_new_tokens is None else min_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
            **kwargs,
        )


def greedy_scores(model, inputs, steps, **kwargs):
    """The sequences and the scores ``[B, steps, V]`` of :func:`greedy_out` (the ``-inf`` of
    ``min_new_tokens`` set to 0)."""
    out = greedy_out(model, inputs, steps, **kwargs)
    scores = torch.stack(out.scores, 1)
    return out.sequences, scores.masked_fill(torch.isinf(scores), 0.0)


def manual_decode(model, inputs, steps, cache=None):
    """Greedy decoding without ``generate()``: one prefill forward, then ``steps - 1`` forwards
    of one token each with the 2-D mask and positions built by hand, on ``cache`` (default: the
    one the prefill returns). Returns the ``[B, steps]`` tokens."""
    out = model(**inputs, use_cache=True, **({} if cache is None else {"cache": cache}))
    cache = out.past_key_values if cache is None else cache
    mask = inputs["attention_mask"]
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    positions = mask.long().cumsum(-1)[:, -1:] - 1
    for _ in range(steps - 1):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        positions = positions + 1
        step = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        token = step.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, 1)


def assert_pruned_equals_masked(model, inputs, steps: int = 8, **wrap):
    """``vf.wrap(model, **wrap)`` against :func:`masked_reference` on ``inputs``: the prefill's
    last logits, ``steps`` cached greedy tokens and each step's logits agree, ``generate()``'s
    own prefill keeps the forward's set, and every row keeps fewer visual tokens than it has.
    Returns the pruned forward's trace."""
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), vf.wrap(model, **wrap) as handle:
        logits = model(**inputs).logits[:, -1]
        trace = handle.last_trace
        sequences, step_logits = greedy_generate(model, inputs, steps)
        for a, b in zip(trace.kept, handle.last_trace.kept, strict=True):
            assert torch.equal(a, b)  # generate() re-runs prefill: the same kept set
    assert all(n < v for n, v in zip(trace.n_kept, trace.n_visual, strict=True))
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_logits = model(**inputs).logits[:, -1]
        ref_sequences, ref_step_logits = greedy_generate(model, inputs, steps)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(step_logits, ref_step_logits, atol=ATOL, rtol=0)
    return trace
