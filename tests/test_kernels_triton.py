"""Triton score-and-select against its torch twin, on the CPU interpreter when there is no GPU.

Triton picks interpreter or compiler when a function is decorated with ``@triton.jit``, reading
``TRITON_INTERPRET`` then, and ``import triton`` already decorates triton's own ``tl.*`` helpers.
So the variable must be set before the first ``import triton`` of the process, and that import
happens early and indirectly: ``import vlm_focus`` pulls in transformers, which imports
``torch._dynamo``, which imports triton. Hence:

- If triton is not loaded yet (this file run on its own), this module sets
  ``TRITON_INTERPRET=1`` (CPU only) before importing anything else and runs its cases in-process.
- If a compiled triton is already loaded (the whole suite: other test files imported
  ``vlm_focus`` first), the in-process cases are not collected and one test runs this file in a
  fresh Python process with ``TRITON_INTERPRET=1`` and asserts that all its cases pass.

The interpreter is ~2000x slower than torch, so the shape axes (S in {63, 200, 577}, D in
{64, 80, 128}, GQA groups 1/4/7, Tq in {1, 5}, fp32/bf16, mean/max) are covered pairwise by nine
cases rather than by their full product.
"""

from __future__ import annotations

import os
import sys

import torch

ON_CPU = not torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET")
# In-process on CPU only if triton is not loaded yet (we can still switch it to the interpreter)
# or was loaded with the interpreter on; an explicit other TRITON_INTERPRET also goes out.
IN_PROCESS = not ON_CPU or INTERPRET == "1" or (INTERPRET is None and "triton" not in sys.modules)
if ON_CPU and IN_PROCESS:  # else leave the environment of the other test files alone
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
from test_kernels import assert_same_selection, make_inputs  # noqa: E402

import vlm_focus.kernels as kernels  # noqa: E402
from vlm_focus.kernels import _triton as kt  # noqa: E402
from vlm_focus.kernels.naive import score_and_select_naive  # noqa: E402

DEVICE = "cpu" if ON_CPU else "cuda"


def in_process(test):
    """Collect ``test`` only when this process can run the kernels (interpreter or GPU)."""
    test.__test__ = IN_PROCESS
    return test


def test_interpreter_cases_in_fresh_process() -> None:
    """This file's cases, run where TRITON_INTERPRET=1 precedes the first ``import triton``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("VLM_FOCUS_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))]
    done = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True
    )
    summary = done.stdout.strip().splitlines()[-1:] or [""]
    assert done.returncode == 0 and " passed" in summary[0], (
        done.stdout[-8000:] + done.stderr[-4000:]
    )
    assert "skipped" not in summary[0] and "deselected" not in summary[0], summary[0]


test_interpreter_cases_in_fresh_process.__test__ = not IN_PROCESS

# (dtype, atol, rtol) for scores; scores are probabilities in [0, 1] accumulated in fp32.
TOLERANCES = {
    torch.float32: (2e-6, 1e-4),
    torch.bfloat16: (2e-6, 1e-4),  # q and k are rounded to bf16 first: the twin reads the same
}

S_VALUES, D_VALUES, GROUP_VALUES, TQ_VALUES = (63, 200, 577), (64, 80, 128), (1, 4, 7), (1, 5)
DTYPES, REDUCES = (torch.float32, torch.bfloat16), ("mean", "max")
# A covering array of strength 2: every pair of values of any two axes appears in some case.
CASES = [
    (63, 64, 1, 1, torch.float32, "mean"),
    (63, 80, 4, 1, torch.float32, "mean"),
    (63, 128, 7, 5, torch.bfloat16, "max"),
    (200, 64, 4, 5, torch.bfloat16, "max"),
    (200, 80, 7, 1, torch.float32, "mean"),
    (200, 128, 1, 1, torch.float32, "max"),
    (577, 64, 7, 1, torch.bfloat16, "mean"),
    (577, 80, 1, 5, torch.bfloat16, "max"),
    (577, 128, 4, 5, torch.float32, "mean"),
]


def _run_both(args: dict, reduce: str, plan: kt._Plan | None = None):
    args = {**args, "reduce": reduce}
    ref = score_and_select_naive(**args)
    if plan is None:
        out = kt.score_and_select_triton(**args)
    else:
        out = kt._launch(**args, plan=plan)
    return out, ref


def _check(out, ref, dtype: torch.dtype) -> None:
    (scores, kept), (scores_ref, kept_ref) = out, ref
    atol, rtol = TOLERANCES[dtype]
    assert scores.dtype == torch.float32 and kept.dtype == torch.int64
    torch.testing.assert_close(scores, scores_ref, atol=atol, rtol=rtol)
    assert_same_selection(kept, kept_ref, scores_ref, atol=2 * atol)


@in_process
def test_cases_cover_every_pair_of_axis_values() -> None:
    axes = (S_VALUES, D_VALUES, GROUP_VALUES, TQ_VALUES, DTYPES, REDUCES)
    for i, j in itertools.combinations(range(len(axes)), 2):
        seen = {(case[i], case[j]) for case in CASES}
        assert seen == set(itertools.product(axes[i], axes[j])), (i, j)


@in_process
@pytest.mark.parametrize("seq,head_dim,groups,n_query,dtype,reduce", CASES)
def test_kernel_matches_twin(
    seq: int, head_dim: int, groups: int, n_query: int, dtype: torch.dtype, reduce: str
) -> None:
    args = make_inputs(
        batch=2,
        n_kv=2 if groups < 7 else 1,
        groups=groups,
        n_query=n_query,
        seq=seq,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        seed=seq + head_dim + groups,
        causal_query=n_query > 1,
        debias=groups != 1,
    )
    _check(*_run_both(args, reduce), dtype)


@in_process
@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize(
    "plan",
    [
        # several key ranges in pass 1, one kv head per pass-2 program, each program loops over
        # both query blocks, tiled selection
        kt._Plan(n_split=3, n_hparts=2, select_block=64),
        # more splits than tiles, the two query blocks in two programs, one selection tile
        kt._Plan(block_n=32, block_t=16, n_split=9, n_hparts=8, n_tparts=2),
    ],
    ids=["split", "many-parts"],
)
def test_launch_shapes_agree(plan: kt._Plan, reduce: str) -> None:
    """Every way of cutting the work (S splits, head parts, Tq blocks, select tiles) is exact."""
    args = make_inputs(
        n_kv=2,
        groups=2,
        n_query=20,
        seq=150,
        head_dim=32,
        device=DEVICE,
        seed=11,
        causal_query=True,
        debias=True,
    )
    _check(*_run_both(args, reduce, plan), torch.float32)


@in_process
@pytest.mark.parametrize(
    "q_dtype,k_dtype", [(torch.float16, torch.float16), (torch.float32, torch.bfloat16)]
)
def test_non_contiguous_and_mixed_dtypes(q_dtype: torch.dtype, k_dtype: torch.dtype) -> None:
    """q and k as the transposed views attention layers produce ([B, S, H, D] -> [B, H, S, D])."""
    args = make_inputs(n_kv=2, groups=2, n_query=3, seq=90, head_dim=48, device=DEVICE, seed=2)
    args["q"] = args["q"].to(q_dtype).transpose(1, 2).contiguous().transpose(1, 2)
    args["k"] = args["k"].to(k_dtype).transpose(1, 2).contiguous().transpose(1, 2)
    assert not args["q"].is_contiguous() and not args["k"].is_contiguous()
    _check(*_run_both(args, "mean"), torch.float32)


@in_process
def test_query_rows_without_allowed_keys() -> None:
    """A query row on left padding sees no key: its lse is -inf and it must add 0, not NaN."""
    args = make_inputs(n_query=3, seq=70, device=DEVICE, seed=9)
    args["query_pos"] = args["query_pos"].clone()
    args["query_pos"][1, 0] = 1  # row 1 is padded on [0, 3)
    for reduce in ("mean", "max"):
        out, ref = _run_both(args, reduce)
        assert bool(torch.isfinite(out[0]).all())
        _check(out, ref, torch.float32)


@in_process
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_queries_inside_the_image(reduce: str) -> None:
    """All query rows of a batch row sit early: key tiles and S splits after them are skipped."""
    args = make_inputs(n_query=3, seq=160, head_dim=32, device=DEVICE, seed=12, debias=True)
    args["query_pos"] = torch.tensor([[40, 41, 70], [100, 130, 159]], device=DEVICE)
    _check(*_run_both(args, reduce, kt._Plan(block_n=32, n_split=5, n_hparts=2)), torch.float32)


@in_process
@pytest.mark.parametrize(
    "kind,pruner", [("llava", "fastv"), ("qwen2_vl", "debiased"), ("qwen3_vl", "fastv")]
)
def test_pruning_in_a_model_is_the_same_on_both_backends(
    kind: str, pruner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wrap() on a tiny model (batch 2, left padding; Qwen2-VL has GQA, Qwen3-VL q/k norms
    and DeepStack): the pruners' calls of ``score_and_select`` keep the same tokens with the
    kernel as with the twin."""
    from tiny_models import make_case, make_model

    import vlm_focus as vf

    calls = []
    original = kt.score_and_select_triton

    def spy(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(kt, "score_and_select_triton", spy)
    model = make_model(kind).to(DEVICE)
    inputs = {k: v.to(DEVICE) for k, v in make_case(kind, "image", model.cpu(), 2).items()}
    model.to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("VLM_FOCUS_BACKEND", backend)
        with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=1) as handle:
            logits = model(**inputs).logits[:, -1]
            results[backend] = (logits, handle.last_trace)
    (logits, trace), (ref_logits, ref_trace) = results["triton"], results["torch"]
    assert calls, "the pruner never reached the Triton kernel"
    assert len(trace.kept) == 2
    for kept, ref_kept in zip(trace.kept, ref_trace.kept, strict=True):
        assert torch.equal(kept.cpu(), ref_kept.cpu())
    for scores, ref_scores in zip(trace.scores, ref_trace.scores, strict=True):
        torch.testing.assert_close(scores, ref_scores, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


@in_process
def test_public_op_dispatches_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = kt.score_and_select_triton

    def spy(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(kt, "score_and_select_triton", spy)
    monkeypatch.setenv("VLM_FOCUS_BACKEND", "triton")
    args = make_inputs(seq=63, device=DEVICE, seed=3)
    args.pop("key_mask")  # the public op defaults it
    scores, kept = kernels.score_and_select(**args)
    ref_scores, ref_kept = kernels.score_and_select(**args, backend="torch")
    assert calls == [1]
    torch.testing.assert_close(scores, ref_scores, atol=2e-6, rtol=1e-4)
    assert_same_selection(kept, ref_kept, ref_scores, atol=4e-6)


def _select_reference(scores: torch.Tensor, visual: torch.Tensor, n_keep: int) -> torch.Tensor:
    ranked = scores.masked_fill(~visual, float("-inf"))
    order = ranked.sort(dim=-1, descending=True, stable=True).indices
    return order[:, :n_keep].sort(dim=-1).values


@in_process
@pytest.mark.parametrize("block", [0, 16], ids=["one-tile", "tiled"])
def test_select_kernel_on_constructed_scores(block: int) -> None:
    """Ties, zeros of both signs, negative scores (negative debias) and masked keys."""
    seq = 45
    part = torch.zeros(3, 2, seq)
    part[0, 0] = torch.linspace(-1, 1, seq)
    part[0, 1, 10] = 5.0  # partials are summed before selection
    part[1, 0, ::3] = 0.25  # 15 ties at 0.25; the rest are 0 (some negative zero)
    part[1, 1, 1::3] = -0.0
    part[2, 0] = -torch.arange(seq, dtype=torch.float32)  # all negative, best at the front
    visual = torch.ones(3, seq, dtype=torch.bool)
    visual[0, 40:] = False  # the largest raw scores are not visual
    visual[1, :6] = False
    visual[2, 0] = False
    debias = torch.ones(3, seq)
    debias[2, 5] = -1.0  # turns -5 into +5: position 5 must win row 2
    n_keep = 7
    part, visual, debias = part.to(DEVICE), visual.to(DEVICE), debias.to(DEVICE)
    scores = torch.empty(3, seq, device=DEVICE)
    kept = torch.empty(3, n_keep, dtype=torch.int64, device=DEVICE)
    sel_block = block or kt._next_pow2(seq)
    kt._select_kernel[(3,)](
        part,
        visual.view(torch.uint8),
        debias,
        scores,
        kept,
        seq,
        2,
        n_keep,
        HAS_DEBIAS=True,
        BLOCK=sel_block,
        N_TILES=triton.cdiv(seq, sel_block),
    )
    expected = (part.sum(1) * debias).masked_fill(~visual, 0.0)
    torch.testing.assert_close(scores, expected, atol=0, rtol=0)
    assert torch.equal(kept, _select_reference(expected, visual, n_keep))
    assert kept[1].tolist() == [6, 9, 12, 15, 18, 21, 24]  # ties: lowest positions
    assert kept[2].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert 10 in kept[0].tolist() and max(kept[0].tolist()) < 40
