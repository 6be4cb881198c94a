"""The torch twin of score-and-select against full attention, its input checks and the dispatch.

``make_inputs`` and ``assert_same_selection`` are shared with the Triton tests
(``test_kernels_triton.py`` on the CPU interpreter, ``test_kernels_gpu.py`` on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlm_focus.kernels as kernels
from vlm_focus.kernels import score_and_select

ROOT = Path(__file__).resolve().parents[1]


def make_inputs(
    *,
    batch: int = 2,
    n_kv: int = 2,
    groups: int = 1,
    n_query: int = 1,
    seq: int = 63,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    causal_query: bool = False,
    debias: bool = False,
) -> dict:
    """Random q/k with left padding and a different visual span per row.

    Row ``b`` is left-padded by ``3 * b`` keys (row 0 unpadded) and its visual span starts and ends
    at different offsets. With ``causal_query`` the first query row of batch row 0 sits inside the
    visual span, so it sees only part of the image. Returns the kwargs of ``score_and_select``
    (without ``backend``), with ``n_keep`` a third of the smallest visual count.
    """
    gen = torch.Generator().manual_seed(seed)
    n_heads = n_kv * groups
    # Larger logits than unit normals give peaked, realistic attention (well-separated scores).
    q = torch.randn(batch, n_heads, n_query, head_dim, generator=gen) * 1.5
    k = torch.randn(batch, n_kv, seq, head_dim, generator=gen)
    key_mask = torch.ones(batch, seq, dtype=torch.bool)
    visual = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        pad = 3 * b
        key_mask[b, :pad] = False
        start = pad + 1 + 2 * b
        end = seq - n_query - 1 - b
        visual[b, start:end] = True
    query_pos = torch.arange(seq - n_query, seq).repeat(batch, 1)
    if causal_query:
        query_pos[0, 0] = int(visual[0].nonzero()[len(visual[0].nonzero()) // 2])
    weights = torch.rand(batch, n_query, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    n_visual = int((visual & key_mask).sum(-1).min())
    args = dict(
        q=q.to(device=device, dtype=dtype),
        k=k.to(device=device, dtype=dtype),
        visual=visual.to(device),
        n_keep=max(1, n_visual // 3),
        scaling=head_dim**-0.5,
        key_mask=key_mask.to(device),
        query_pos=query_pos.to(device),
        query_weights=weights.to(device),
        debias=(torch.rand(batch, seq, generator=gen) + 0.5).to(device) if debias else None,
    )
    return args


def assert_same_selection(
    kept: torch.Tensor, kept_ref: torch.Tensor, scores_ref: torch.Tensor, atol: float
) -> None:
    """Kept sets are equal, except where the reference scores tie within ``atol`` at the cut."""
    assert kept.shape == kept_ref.shape
    assert torch.equal(kept, kept.sort(dim=-1).values), "kept must be in ascending order"
    for b in range(kept.shape[0]):
        mine, ref = set(kept[b].tolist()), set(kept_ref[b].tolist())
        if mine == ref:
            continue
        cut = scores_ref[b, kept_ref[b]].min()
        for s in mine ^ ref:
            assert abs(float(scores_ref[b, s] - cut)) <= atol, (
                f"row {b}: position {s} differs and is not a tie at the cut "
                f"({float(scores_ref[b, s])} vs {float(cut)})"
            )


def _full_attention_reference(
    q_full: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    key_mask: torch.Tensor,
    visual: torch.Tensor,
    weights: torch.Tensor,
    reduce: str,
    scaling: float,
) -> torch.Tensor:
    """softmax(Q K^T) over the WHOLE sequence (every position a query), then pick the query rows."""
    groups = q_full.shape[1] // k.shape[1]
    keys = k.repeat_interleave(groups, dim=1).double()  # [B, H, S, D]
    logits = q_full.double() @ keys.transpose(-1, -2) * scaling  # [B, H, S, S]
    seq = k.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()  # [S (query), S (key)]
    allowed = causal[None] & key_mask[:, None, :]  # [B, S, S]
    attn = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    attn = attn.nan_to_num(0.0)  # a padded query row sees no key
    picked = torch.stack([attn[b, :, rows[b]] for b in range(attn.shape[0])])  # [B, H, Tq, S]
    per_row = picked.mean(1) if reduce == "mean" else picked.amax(1)  # [B, Tq, S]
    scores = (weights.double()[:, :, None] * per_row).sum(1)  # [B, S]
    return scores.masked_fill(~visual, 0.0)


def _top_positions(scores: torch.Tensor, visual: torch.Tensor, n_keep: int) -> list[list[int]]:
    """Top ``n_keep`` visual positions per row, ties to the lower position, ascending."""
    out = []
    for b in range(scores.shape[0]):
        cand = [s for s in range(scores.shape[1]) if visual[b, s]]
        cand.sort(key=lambda s: (-float(scores[b, s]), s))
        out.append(sorted(cand[:n_keep]))
    return out


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("n_kv,groups", [(2, 1), (2, 4), (1, 7)])
@pytest.mark.parametrize("rows_kind", ["last", "inside"])
def test_twin_matches_full_attention(reduce: str, n_kv: int, groups: int, rows_kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    batch, seq, dim, n_query = 2, 40, 16, 3
    n_heads = n_kv * groups
    q_full = torch.randn(batch, n_heads, seq, dim, generator=gen) * 2
    k = torch.randn(batch, n_kv, seq, dim, generator=gen)
    key_mask = torch.ones(batch, seq, dtype=torch.bool)
    key_mask[1, :6] = False
    visual = torch.zeros(batch, seq, dtype=torch.bool)
    visual[0, 2:30] = True
    visual[1, 8:33] = True
    if rows_kind == "last":
        rows = torch.arange(seq - n_query, seq).repeat(batch, 1)
    else:  # query rows inside the image: each sees only the keys before it
        rows = torch.tensor([[10, 20, 39], [15, 25, 31]])
    weights = torch.rand(batch, n_query, generator=gen)
    q = torch.stack([q_full[b, :, rows[b]] for b in range(batch)])  # [B, H, Tq, D]
    scores, kept = score_and_select(
        q,
        k,
        visual,
        9,
        scaling=dim**-0.5,
        key_mask=key_mask,
        query_pos=rows,
        query_weights=weights,
        reduce=reduce,
        backend="torch",
    )
    ref = _full_attention_reference(q_full, k, rows, key_mask, visual, weights, reduce, dim**-0.5)
    assert scores.dtype == torch.float32 and scores.shape == (batch, seq)
    torch.testing.assert_close(scores.double(), ref, atol=1e-6, rtol=1e-5)
    assert kept.dtype == torch.int64
    assert kept.tolist() == _top_positions(ref, visual, 9)


def test_fastv_last_row_head_mean() -> None:
    """Tq = 1 at the last position, mean over heads: FastV's score, the last row of attention."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 8, generator=gen)
    k = torch.randn(1, 4, 12, 8, generator=gen)
    visual = torch.zeros(1, 12, dtype=torch.bool)
    visual[0, 1:9] = True
    scores, kept = score_and_select(q, k, visual, 3, scaling=8**-0.5, backend="torch")
    attn = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, dim=-1)[0, :, 0]  # [H, S]
    expected = attn.mean(0) * visual[0]
    torch.testing.assert_close(scores[0], expected)
    assert kept[0].tolist() == sorted(expected.topk(3).indices.tolist())


def test_known_selection_from_aligned_keys() -> None:
    """Keys aligned with the query get almost all attention, so they are exactly what is kept."""
    seq, dim = 30, 8
    q = torch.zeros(2, 2, 1, dim)
    q[..., 0] = 4.0
    k = torch.zeros(2, 1, seq, dim)
    targets = [[5, 11, 17, 23], [4, 9, 10, 20]]
    for b, pos in enumerate(targets):
        k[b, 0, pos, 0] = torch.tensor([3.0, 2.5, 2.0, 1.5])
    visual = torch.zeros(2, seq, dtype=torch.bool)
    visual[:, 2:26] = True
    scores, kept = score_and_select(q, k, visual, 4, scaling=1.0, backend="torch")
    assert kept.tolist() == targets
    # the most aligned key of each row scores highest
    assert scores.argmax(-1).tolist() == [5, 4]


def test_mean_scores_are_the_visual_attention_mass() -> None:
    """Attention rows sum to 1: with all keys visual, the mean scores of a row sum to sum_t w_t."""
    args = make_inputs(n_query=4, seq=50, groups=2, seed=1)
    args["visual"] = args["key_mask"].clone()
    scores, _ = score_and_select(**args, reduce="mean", backend="torch")
    torch.testing.assert_close(scores.sum(-1), args["query_weights"].sum(-1))
    assert bool((scores[~args["key_mask"]] == 0).all())


def test_ties_go_to_lower_positions() -> None:
    """Uniform attention (q = 0) ties every visual key: the first n_keep visual positions win."""
    q = torch.zeros(2, 2, 3, 16)
    k = torch.randn(2, 2, 20, 16)
    visual = torch.zeros(2, 20, dtype=torch.bool)
    visual[0, 3:15] = True
    visual[1, [2, 4, 6, 8, 10, 12, 14]] = True
    _, kept = score_and_select(q, k, visual, 5, scaling=0.25, backend="torch")
    assert kept.tolist() == [[3, 4, 5, 6, 7], [2, 4, 6, 8, 10]]


def test_debias_multiplies_before_selection() -> None:
    args = make_inputs(seed=4)
    plain, _ = score_and_select(**{**args, "debias": None}, backend="torch")
    debias = torch.ones_like(plain)
    # zero the best key of row 0: it must drop out of the selection
    best = int(plain[0].argmax())
    debias[0, best] = 0.0
    debias[1] *= 2.0
    scores, kept = score_and_select(**{**args, "debias": debias}, backend="torch")
    torch.testing.assert_close(scores, plain * debias)
    assert best not in kept[0].tolist()


def test_query_without_allowed_keys_contributes_nothing() -> None:
    """A query row placed on left padding sees no key: it adds 0 instead of NaN."""
    args = make_inputs(n_query=2, seed=5)
    args["query_pos"] = args["query_pos"].clone()
    args["query_pos"][1, 0] = 1  # row 1 is padded on [0, 3)
    scores, _ = score_and_select(**args, backend="torch")
    alone = {**args, "query_weights": args["query_weights"].clone()}
    alone["query_weights"][1, 0] = 0.0
    expected, _ = score_and_select(**alone, backend="torch")
    assert bool(torch.isfinite(scores).all())
    torch.testing.assert_close(scores, expected)


def test_n_keep_equal_to_visual_count_keeps_every_visual_key() -> None:
    args = make_inputs(batch=1, seed=6)
    visual = args["visual"] & args["key_mask"]
    n_visual = int(visual.sum())
    _, kept = score_and_select(**{**args, "n_keep": n_visual}, backend="torch")
    assert kept[0].tolist() == visual[0].nonzero().flatten().tolist()


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q=torch.zeros(2, 2, 16)), ValueError, "q must be"),
        (dict(q=torch.zeros(2, 2, 0, 64)), ValueError, "Tq = 0"),
        (dict(k=torch.zeros(2, 3, 63, 64)), ValueError, "multiple of kv heads"),
        (dict(k=torch.zeros(2, 2, 63, 32)), ValueError, "head_dim"),
        (dict(visual=torch.ones(2, 63)), TypeError, "visual must be a bool"),
        (dict(key_mask=torch.ones(2, 62, dtype=torch.bool)), ValueError, "key_mask has shape"),
        (dict(n_keep=0), ValueError, "n_keep=0"),
        (dict(n_keep=10_000), ValueError, "n_keep=10000"),
        (dict(n_keep=True), ValueError, "n_keep=True"),
        (dict(reduce="sum"), ValueError, "reduce='sum'"),
        (dict(query_pos=torch.zeros(2, 3, dtype=torch.long)), ValueError, "query_pos"),
        (dict(query_weights=torch.ones(1, 1)), ValueError, "query_weights"),
        (dict(debias=torch.ones(2, 5)), ValueError, "debias"),
        (dict(backend="cuda"), ValueError, "backend='cuda'"),
    ],
)
def test_bad_input_names_the_argument(change: dict, error: type, match: str) -> None:
    args = make_inputs()
    with pytest.raises(error, match=match):
        score_and_select(**{**args, **change})


def test_dispatch_picks_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLM_FOCUS_BACKEND", raising=False)
    cpu = torch.zeros(1)
    assert kernels._pick_backend(None, cpu) == "torch"
    assert kernels._pick_backend("torch", cpu) == "torch"
    monkeypatch.setenv("VLM_FOCUS_BACKEND", "torch")
    assert kernels._pick_backend(None, cpu) == "torch"
    monkeypatch.setenv("VLM_FOCUS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="'tpu'"):
        kernels._pick_backend(None, cpu)


def test_forcing_triton_without_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    monkeypatch.setenv("VLM_FOCUS_BACKEND", "triton")
    with pytest.raises(ValueError, match="backend='torch'"):
        score_and_select(**make_inputs())


def test_package_works_without_triton() -> None:
    """With triton unimportable the op still runs on the twin and reports triton unavailable."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, vlm_focus.kernels as kn\n"
        "assert not kn.triton_available()\n"
        "q = torch.randn(1, 2, 1, 8); k = torch.randn(1, 2, 6, 8)\n"
        "s, kept = kn.score_and_select(q, k, torch.ones(1, 6, dtype=torch.bool), 2, scaling=0.3)\n"
        "assert kept.shape == (1, 2) and abs(float(s.sum()) - 1.0) < 1e-5\n"
        "assert 'vlm_focus.kernels._triton' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLM_FOCUS_BACKEND", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
