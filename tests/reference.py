"""Independent reference for pruning: the UNPRUNED model, with the pruned visual keys masked out
of attention at every layer >= the stage that pruned them. With the same kept set, a pruned run
must produce the same logits for every kept token, in prefill and in cached decode."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def masked_reference(model, layers, trace):
    """Within the block, ``model`` behaves like the pruned model described by ``trace``.

    ``trace.stages[i].layer`` and ``.kept[b]`` give, per stage, the original positions of the
    visual tokens row b still has; everything visual not kept is masked as a KEY from that layer
    on (a token may still see itself, so no attention row is empty).
    """
    visual = [set(v.tolist()) for v in trace.visual_positions]
    pruned_from = []  # per stage: [B] sets of pruned original positions
    for stage in trace.stages:
        pruned_from.append(
            (stage.layer, [visual[b] - set(k.tolist()) for b, k in enumerate(stage.kept)])
        )
    state = {}

    def on_model(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        ids = kwargs["input_ids"]
        mask2d = kwargs.get("attention_mask")
        if mask2d is None:  # generate() drops an all-ones mask
            mask2d = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long)
        state["mask2d"] = mask2d

    def on_layer(index):
        def hook(module, args, kwargs):
            pruned = None
            for layer, sets in pruned_from:
                if index >= layer:
                    pruned = sets
            if pruned is None:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            batch, n_new = hidden.shape[:2]
            mask2d = state["mask2d"]
            width = mask2d.shape[1]
            keys = torch.arange(width)
            queries = torch.arange(width - n_new, width)
            allowed = (keys[None, :] <= queries[:, None]).expand(batch, n_new, width).clone()
            allowed &= mask2d.bool()[:, None, :]
            for b in range(batch):
                if pruned[b]:
                    cols = torch.tensor(sorted(pruned[b]))
                    allowed[b][:, cols] = False
            allowed |= keys[None, None, :] == queries[None, :, None]  # keep the diagonal
            dtype = hidden.dtype
            mask = torch.zeros(batch, 1, n_new, width, dtype=dtype)
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


def greedy_generate(model, inputs, steps):
    """Greedy ``generate()`` returning the sequences and each step's logits ``[B, steps, V]``."""
    out = model.generate(
        **inputs,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences, torch.stack(out.logits, 1)


@contextlib.contextmanager
def fixation_reference(model, layers, first_layer, trace):
    """The unpruned model where, at decode step ``t``, every layer ``>= first_layer`` masks the
    visual keys that ``trace.fixations[t]`` did not attend to (for that step only)."""
    visual = [set(v.tolist()) for v in trace.visual_positions]
    state = {"step": -1}

    def on_model(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        ids = kwargs["input_ids"]
        mask2d = kwargs.get("attention_mask")
        if mask2d is None:
            mask2d = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long)
        state["mask2d"], state["decode"] = mask2d, past > 0
        state["step"] = state["step"] + 1 if past > 0 else -1

    def on_layer(index):
        def hook(module, args, kwargs):
            if index < first_layer or not state["decode"]:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            batch, n_new = hidden.shape[:2]
            mask2d = state["mask2d"]
            width = mask2d.shape[1]
            allowed = mask2d.bool()[:, None, :].expand(batch, n_new, width).clone()
            keys = torch.arange(width)
            allowed &= keys[None, None, :] <= torch.arange(width - n_new, width)[None, :, None]
            fixed = trace.fixations[state["step"]]
            for b in range(batch):
                dropped = sorted(visual[b] - set(fixed[b].tolist()))
                if dropped:
                    allowed[b][:, torch.tensor(dropped)] = False
            mask = torch.zeros(batch, 1, n_new, width, dtype=hidden.dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(hidden.dtype).min)
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
