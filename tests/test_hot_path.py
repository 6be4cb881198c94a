"""The GPU hot path, checked on CPU: no host reads per decode step, a prefill whose host reads
do not grow with the batch, bounded scoring memory, selections that are stable under ties,
and pruning that follows the devices of a dispatched model."""

from __future__ import annotations

import host_reads
import numpy as np
import pytest
import torch
from host_reads import OnDevice, on_device, per_forward, reads
from pruner_inputs import make_ctx
from reference import greedy_generate, masked_reference
from tiny_models import make_inputs, make_model

import vlm_focus as vf
from vlm_focus.core.selection import keep_mask
from vlm_focus.pruners._common import per_query_scores
from vlm_focus.pruners._math import maxmin_orders


def _options(pruner: str, batch: int) -> dict:
    if pruner != "guided":
        return {}
    guide = make_model("llava", seed=3)
    return dict(guide=guide, guide_inputs=on_device(make_inputs("llava", guide, batch, seed=5)))


def _reads_during_generate(kind: str, pruner: str, batch: int, layer: int) -> list[int]:
    model = make_model(kind)
    inputs = on_device(make_inputs(kind, model, batch=batch))
    options = _options(pruner, batch)
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=layer, **options):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    return marks


CASES = [("llava", p) for p in vf.pruners()] + [
    ("qwen2_5_vl", p) for p in ("fastv", "text", "debiased", "pyramid", "diverse", "pool")
]


@pytest.mark.parametrize("kind,pruner", CASES)
def test_host_reads_none_per_decode_step_and_flat_in_the_batch(kind, pruner):
    layer = 0 if pruner in ("guided", "pyramid") else 2
    prefill = {}
    for batch in (1, 4, 8):
        marks = _reads_during_generate(kind, pruner, batch, layer)
        where = dict(reads)
        # marks: before each forward (after the engine's model hook), then at the end
        assert marks[1:] == [marks[1]] * (len(marks) - 1), f"decode reads: {marks} {where}"
        prefill[batch] = marks[1]
    assert prefill[1] == prefill[4] == prefill[8], f"prefill reads by batch: {prefill}"


def test_the_read_counter_sees_a_per_row_loop(monkeypatch):
    """The instrument itself: a per-row ``nonzero().cpu()`` loop is counted per row."""
    from vlm_focus.model_adapters import llava

    model = make_model("llava")
    counts = {}
    monkeypatch.setattr(host_reads, "WATCHED", [*host_reads.WATCHED, __file__])
    for batch in (1, 4):
        inputs = on_device(make_inputs("llava", model, batch=batch))
        reads.clear()
        visual = llava.LLAVA.visual_mask(model, inputs["input_ids"])
        for b in range(batch):  # what the layouts used to do
            torch.nonzero(visual[b]).cpu()
        counts[batch] = sum(reads.values())
    assert counts == {1: 2, 4: 8}


# --- memory of the text pruner's per-row scores --------------------------------------------
def _peak_allocation(fn) -> int:
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_text_scores_peak_memory_grows_with_the_probability_slab_not_the_keys():
    batch, heads, kv_heads, tq, seq, dim = 2, 4, 2, 32, 600, 64
    hidden = torch.zeros(batch, seq, 10)
    ctx = make_ctx(hidden, [[]] * batch)
    ctx.visual[:, 100:500] = True
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, tq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    rows = torch.arange(seq - tq, seq).expand(batch, tq)
    peak = _peak_allocation(lambda: per_query_scores(ctx, q, k, rows, ctx.visual))
    slab = batch * heads * tq * seq * 4  # [B, H, Tq, S] fp32
    copied_keys = batch * tq * kv_heads * seq * dim * 4  # K repeated once per query row
    assert peak <= 2 * slab < copied_keys / 8, (peak, slab, copied_keys)
    # and the scores are each row's own attention, as the model computes it
    scores = per_query_scores(ctx, q, k, rows, ctx.visual)
    logits = q @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * ctx.attention.scaling
    causal = torch.arange(seq)[None, :] <= rows[0][:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    probs = probs.amax(1) if ctx.config.reduce == "max" else probs.mean(1)  # over heads
    torch.testing.assert_close(
        scores, probs.masked_fill(~ctx.visual[:, None], 0), atol=1e-6, rtol=0
    )


# --- diverse on the device, and equal to the matrix greedy it replaces ----------------------
def _matrix_greedy(features: torch.Tensor, count: int) -> list[int]:
    """The earlier host implementation: one [n, n] cosine-distance matrix and a numpy loop."""
    unit = torch.nn.functional.normalize(features.double(), dim=-1)
    centre = torch.nn.functional.normalize(unit.mean(0), dim=0)
    distance = (1.0 - unit @ unit.T).numpy()
    order = [int((1.0 - unit @ centre).argmax())]
    nearest = distance[order[0]].copy()
    nearest[order[0]] = -1.0
    for _ in range(count - 1):
        pick = int(nearest.argmax())
        order.append(pick)
        np.minimum(nearest, distance[pick], out=nearest)
        nearest[order] = -1.0
    return order


@pytest.mark.parametrize("seed", range(4))
def test_diverse_order_equals_the_matrix_greedy_and_never_reads_the_device(seed):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(3, 90, 24, generator=gen, dtype=torch.float64)
    candidates = torch.rand(3, 90, generator=gen) < 0.7
    reads.clear()
    order = maxmin_orders(features.as_subclass(OnDevice), candidates.as_subclass(OnDevice), 20)
    assert sum(reads.values()) == 0, dict(reads)
    for b in range(3):
        local = torch.nonzero(candidates[b]).flatten()
        expected = local[_matrix_greedy(features[b, local], 20)]
        assert order[b].tolist() == expected.tolist()


# --- ties: stable, and the lower position wins ------------------------------------------------
def test_keep_mask_breaks_ties_towards_the_lower_position():
    scores = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0], [2.0] * 8])
    visual = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = keep_mask(scores, visual, drop=3)
    # a stable descending sort of the visual scores, positions ascending among equals
    for b in range(2):
        ranked = sorted(torch.nonzero(visual[b]).flatten().tolist(), key=lambda s: -scores[b, s])
        expected = set(ranked[: len(ranked) - 3])
        assert set(torch.nonzero(keep[b] & visual[b]).flatten().tolist()) == expected
        assert keep[b][~visual[b]].all()
    assert torch.nonzero(keep[0] & visual[0]).flatten().tolist() == [1, 2, 3]


@pytest.mark.parametrize("pruner", [p for p in vf.pruners() if p != "guided"])
def test_every_pruner_selects_the_same_tokens_run_after_run(pruner):
    model = make_model("llava_next")
    inputs = make_inputs("llava_next", model, batch=2)
    kept = []
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.3, layer=1) as handle:
        for _ in range(5):
            model(**inputs)
            kept.append([k.tolist() for k in handle.last_trace.kept])
    assert all(k == kept[0] for k in kept)


# --- a dispatched model ---------------------------------------------------------------------
def test_pruning_a_model_dispatched_by_accelerate_equals_the_reference():
    """accelerate's hooks move each layer's inputs inside ``forward``, after the engine's
    pre-hooks; on one CPU the devices agree, so this checks that the two sets of hooks compose
    (the cross-device moves themselves run in the GPU tests)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    layers = model.model.language_model.layers
    for layer in layers:  # what dispatch_model installs on every module of a device map
        add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
        sequences, logits = greedy_generate(model, inputs, 4)
        trace = handle.last_trace
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, 4)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=0)
    for layer in layers:
        remove_hook_from_module(layer)
