"""Triton fused score-and-select: attention mass on visual keys without materialising attention.

Formula (the contract of :func:`vlm_focus.kernels.naive.score_and_select_naive`)::

    scores[b, s] = debias[b, s] * sum_t w[b, t] * R_h(softmax_s'(q[b,h,t] . k[b,h,s'] * c))[s]

where the softmax runs over the allowed keys ``s'`` (valid and ``s' <= query_pos[b, t]``), ``R_h``
is the mean or max over query heads (GQA heads read their shared kv head) and scores are 0 on
non-visual keys; then the top ``n_keep`` visual keys are kept.

Three launches, none of which writes a ``[Tq, S]`` or ``[S, S]`` tensor:

1. ``_lse_kernel``, grid ``(B * H, Tq blocks, S splits)``. Each program holds a block of query rows
   of one head in registers and streams its range of key tiles, keeping an online max and sum of
   ``exp2`` (log2 domain, fp32) per row. It writes one partial log-sum-exp per row and split,
   ``[B, H, Tq, n_split]``. Splitting S gives a batch-1 call enough programs to fill the GPU.
   The query heads of a GQA group have adjacent program ids, so their shared key tiles are mostly
   re-read from L2 rather than HBM. Key tiles after the block's last query position are skipped.
2. ``_score_kernel``, grid ``(S blocks, head parts x query parts, B)``. Each program owns one tile
   of keys and loops over its blocks of query rows. Per block it merges the partial
   log-sum-exps of its rows (a few floats per row), then for each kv head loads the key tile once
   and, for every query head of the group, forms ``p = exp2(s - lse)`` in registers and folds it
   into a ``[Tq block, keys]`` accumulator: a sum for ``mean``, an elementwise max for ``max``;
   the query weights reduce it to ``[keys]`` and ``1 / H`` is applied at the end. Because a
   program holds every head of its keys, ``max`` needs no atomics. Query blocks (any reduce) and,
   for the linear ``mean``, kv heads may be split over programs to add parallelism when S is
   short. Each program writes one partial score row ``[keys]``, so the buffer is
   ``[B, n_parts, S]`` with ``n_parts`` sized to the GPU (at most 4 query parts), not to S or Tq.
   Key tiles that hold no visual key, or lie after every query row, skip the head loop. Keys are
   read twice (pass 1 and 2); queries are tiny and come from L2.
3. ``_select_kernel``, grid ``(B,)``. It sums the partial scores, applies ``debias`` and the visual
   mask, writes ``scores``, then finds the ``n_keep``-th largest score by a 32-step bitwise
   bisection on order-preserving integer keys (a radix select with 1-bit digits: every step is one
   compare-and-count over the row, held in registers for S <= 16384) and writes the kept positions
   in ascending order with a prefix sum. Ties at the threshold go to the lowest positions, as in
   the twin. Wider digits (``tl.histogram``, 8 rounds of 16 bins) compile to shared-memory atomics
   per key; attention scores share their top digits, so those atomics would hit one address and
   serialise. The 1-bit counts are plain warp reductions and cost the same for any score values.

Why selection is a second kernel and not fused into pass 2: top-k needs every score of a row, and
the score tiles of one row are produced by many programs. Fusing would need a grid-wide barrier
(a "last program done" atomic counter with acquire/release fences) inside pass 2. That saves one
launch of a few microseconds, while a fence bug there would corrupt selections silently. The
separate kernel reads only ``B * n_parts * S`` floats (from L2) and replaces what would otherwise
be five or more torch launches (sum of partials, debias, masking, ``topk``, ``sort``).

Precision: ``tl.dot`` takes bf16/fp16 tiles and accumulates in fp32 (products of two halves are
exact in fp32); fp32 inputs use IEEE fp32 dots, not TF32, so the kernel matches the twin to ~1e-7.
Everything after the dot (log-sum-exp, probabilities, accumulators, scores) is fp32. Under the CPU
interpreter the tiles are converted to fp32 before the dot, because triton 3.9's interpreter
returns wrong results for bf16 dots; the values are the same.

Launch shapes come from ``_plan`` (about four programs per SM for a batch-1 call; tiles of 64
keys and up to 32 query rows). ``benchmarks/kernel.py --sweep`` times alternatives on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_SELECT_MAX_SINGLE = 16384  # row length up to which the selection keeps the whole row in registers
_MAX_TPARTS = 4  # query-block ranges of pass 2: bounds the partial scores at [B, 4 * heads, S]


# Shape integers vary from call to call (batch, sequence, query rows, split counts). Triton
# would compile a variant for each value that is 1 or a multiple of 16; these stay plain
# arguments, so one compiled variant serves every shape of a model (strides stay specialised:
# their alignment is what vectorises the loads).
_LSE_SHAPES = ("n_heads", "n_query", "seq", "head_dim", "n_split", "keys_per_split")
_SCORE_SHAPES = (
    "n_heads",
    "n_kv",
    "n_query",
    "seq",
    "head_dim",
    "n_split",
    "kv_per_part",
    "n_hparts",
    "n_tblocks",
    "tblocks_per_part",
    "n_parts",
)
_SELECT_SHAPES = ("seq", "n_parts", "n_keep")
_MAX_SPLIT = 64  # key ranges of pass 1; pass 2 always reads a fixed _MAX_SPLIT-wide row


@triton.jit
def _dot_tile(ptr, row_ok, d_ok, DOT_FP32: tl.constexpr):
    """A ``[rows, BLOCK_D]`` operand of ``tl.dot`` at the pointers ``ptr`` (0 outside
    ``row_ok x d_ok``); in fp32 under the interpreter (see the module docstring)."""
    tile = tl.load(ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit(do_not_specialize=_LSE_SHAPES)
def _lse_kernel(
    q_ptr,
    k_ptr,
    kmask_ptr,
    qpos_ptr,
    lse_ptr,
    n_heads,
    n_query,
    seq,
    head_dim,
    n_split,
    keys_per_split,
    qk_scale,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    sks,
    skd,
    GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Partial log2-sum-exp of one head's query block over one range of keys."""
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    kv = h // GROUPS

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < n_query
    d_ok = offs_d < head_dim
    q_base = q_ptr + b.to(tl.int64) * sqb + h * sqh
    q = _dot_tile(q_base + offs_t[:, None] * sqt + offs_d[None, :] * sqd, t_ok, d_ok, DOT_FP32)
    qpos = tl.load(qpos_ptr + b * n_query + offs_t, mask=t_ok, other=-1)  # [BLOCK_T]
    k_base = k_ptr + b.to(tl.int64) * skb + kv * skh

    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_T], tl.float32)
    start = pid_s * keys_per_split
    end = tl.minimum(seq, start + keys_per_split)
    # Keys after the last query position of the block are masked for every row: skip them.
    end = tl.minimum(end, tl.max(qpos, axis=0).to(tl.int32) + 1)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k = _dot_tile(
            k_base + offs_n[:, None] * sks + offs_d[None, :] * skd, n_ok, d_ok, DOT_FP32
        )  # [BLOCK_N, BLOCK_D]
        valid = tl.load(kmask_ptr + b * seq + offs_n, mask=n_ok, other=0) != 0
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_T, BLOCK_N]
        allowed = valid[None, :] & (offs_n[None, :] <= qpos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no allowed key keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_sum = l_sum * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new
    # -inf when the row has no allowed key in this range (log2 only of positive sums)
    lse = tl.where(l_sum > 0.0, m + tl.log2(tl.where(l_sum > 0.0, l_sum, 1.0)), float("-inf"))
    row = (b * n_heads + h) * n_query + offs_t
    tl.store(lse_ptr + row * n_split + pid_s, lse, mask=t_ok)


@triton.jit(do_not_specialize=_SCORE_SHAPES)
def _score_kernel(
    q_ptr,
    k_ptr,
    kmask_ptr,
    vis_ptr,
    qpos_ptr,
    w_ptr,
    lse_ptr,
    part_ptr,
    n_heads,
    n_kv,
    n_query,
    seq,
    head_dim,
    n_split,
    kv_per_part,
    n_hparts,
    n_tblocks,
    tblocks_per_part,
    n_parts,
    qk_scale,
    head_scale,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    sks,
    skd,
    GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    REDUCE_MAX: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Partial score ``sum_t w_t R_h p[h, t, s]`` of one key tile over one part of heads/queries."""
    pid_n = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = tl.program_id(2)
    hp = pid_p % n_hparts
    tp = pid_p // n_hparts

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_sp = tl.arange(0, SPLIT_PAD)
    n_ok = offs_n < seq
    d_ok = offs_d < head_dim
    vis = tl.load(vis_ptr + b * seq + offs_n, mask=n_ok, other=0) != 0  # [BLOCK_N]
    valid = tl.load(kmask_ptr + b * seq + offs_n, mask=n_ok, other=0) != 0
    # Tiles without a visual key score 0 by definition: skip all their work.
    has_visual = tl.max((vis & valid).to(tl.int32), axis=0) > 0
    kv_lo = hp * kv_per_part
    kv_end = tl.minimum(n_kv, kv_lo + kv_per_part)
    q_base = q_ptr + b.to(tl.int64) * sqb
    k_base = k_ptr + b.to(tl.int64) * skb
    k_rows = offs_n[:, None] * sks + offs_d[None, :] * skd

    score = tl.zeros([BLOCK_N], tl.float32)
    # This part's query blocks, one after another: the partial row stays [BLOCK_N] whatever Tq.
    tb_lo = tp * tblocks_per_part
    tb_hi = tl.minimum(n_tblocks, tb_lo + tblocks_per_part)
    for tb in range(tb_lo, tb_hi):
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < n_query
        qpos = tl.load(qpos_ptr + b * n_query + offs_t, mask=t_ok, other=-1)  # [BLOCK_T]
        w = tl.load(w_ptr + b * n_query + offs_t, mask=t_ok, other=0.0).to(tl.float32)
        allowed = valid[None, :] & (offs_n[None, :] <= qpos[:, None])  # [BLOCK_T, BLOCK_N]
        q_rows = offs_t[:, None] * sqt + offs_d[None, :] * sqd
        # Tiles past the last query position of the block get no attention from it.
        seen = pid_n * BLOCK_N <= tl.max(qpos, axis=0)
        kv_hi = tl.where(has_visual & seen, kv_end, kv_lo)
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)  # sum or max over heads of p
        for kv in range(kv_lo, kv_hi):
            # keys of this tile and kv head, loaded once for every query head of the group
            k = _dot_tile(k_base + kv * skh + k_rows, n_ok, d_ok, DOT_FP32)  # [BLOCK_N, BLOCK_D]
            # GROUPS is a constant, so for MHA (GROUPS = 1) this loop folds away and the kv loop,
            # now innermost, gets software-pipelined key loads.
            for g in range(GROUPS):
                h = kv * GROUPS + g
                q = _dot_tile(q_base + h * sqh + q_rows, t_ok, d_ok, DOT_FP32)  # [BLOCK_T, BLOCK_D]
                # Merge the pass-1 partial log-sum-exps of these rows.
                row = (b * n_heads + h) * n_query + offs_t
                parts = tl.load(
                    lse_ptr + row[:, None] * n_split + offs_sp[None, :],
                    mask=t_ok[:, None] & (offs_sp[None, :] < n_split),
                    other=float("-inf"),
                )  # [BLOCK_T, SPLIT_PAD]
                top = tl.max(parts, axis=1)
                top = tl.where(top == float("-inf"), 0.0, top)
                total = tl.sum(tl.exp2(parts - top[:, None]), axis=1)
                # A row whose splits are all -inf has no allowed key at all: its lse is a
                # placeholder (0) and every p of the row is masked to 0 below.
                lse = tl.where(total > 0.0, top + tl.log2(tl.where(total > 0.0, total, 1.0)), top)
                s = (
                    tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                )  # [BLOCK_T, BLOCK_N]
                p = tl.where(allowed, tl.exp2(s - lse[:, None]), 0.0)
                if REDUCE_MAX:
                    acc = tl.maximum(acc, p)
                else:
                    acc += p
        score += tl.sum(acc * w[:, None], axis=0)
    score = tl.where(vis, score * head_scale, 0.0)
    tl.store(part_ptr + (b * n_parts + pid_p).to(tl.int64) * seq + offs_n, score, mask=n_ok)


@triton.jit
def _order_key(x):
    """int32 keys whose signed order is the float order of ``x`` (+0 and -0 share one key)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _final_tile(
    part_ptr, vis_ptr, debias_ptr, scores_ptr, b, offs, seq, n_parts, HAS_DEBIAS: tl.constexpr
):
    """Sum the partial scores of one tile, apply debias and the visual mask, store, return keys."""
    ok = offs < seq
    acc = tl.zeros(offs.shape, tl.float32)
    for p in range(n_parts):
        acc += tl.load(part_ptr + (b * n_parts + p).to(tl.int64) * seq + offs, mask=ok, other=0.0)
    if HAS_DEBIAS:
        acc = acc * tl.load(debias_ptr + b * seq + offs, mask=ok, other=0.0).to(tl.float32)
    vis = tl.load(vis_ptr + b * seq + offs, mask=ok, other=0) != 0
    acc = tl.where(vis, acc, 0.0)
    tl.store(scores_ptr + b * seq + offs, acc, mask=ok)
    return tl.where(vis, _order_key(acc), -2147483648)


@triton.jit(do_not_specialize=_SELECT_SHAPES)
def _select_kernel(
    part_ptr,
    vis_ptr,
    debias_ptr,
    scores_ptr,
    kept_ptr,
    seq,
    n_parts,
    n_keep,
    HAS_DEBIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    N_TILES: tl.constexpr,
):
    """Final scores of one row, then its ``n_keep`` largest visual positions in ascending order."""
    b = tl.program_id(0)
    sign = -2147483648  # non-visual keys sit at the int32 minimum, below every real score
    one = tl.full([], 1, tl.int32)  # int32, so that one << 31 is the sign bit
    if N_TILES == 1:
        offs = tl.arange(0, BLOCK)
        key = _final_tile(
            part_ptr, vis_ptr, debias_ptr, scores_ptr, b, offs, seq, n_parts, HAS_DEBIAS
        )
        # Radix select with 1-bit digits on the sign-flipped (unsigned-ordered) keys: keep the
        # largest prefix such that at least n_keep keys are >= it.
        prefix = tl.zeros([], tl.int32)
        for bit in range(31, -1, -1):
            cand = prefix | (one << bit)
            count = tl.sum((key >= (cand ^ sign)).to(tl.int32), axis=0)
            prefix = tl.where(count >= n_keep, cand, prefix)
        thr = prefix ^ sign
        above = key > thr
        tie = key == thr
        need = n_keep - tl.sum(above.to(tl.int32), axis=0)
        tie_i = tie.to(tl.int32)
        take = above | (tie & (tl.cumsum(tie_i, axis=0) - tie_i < need))
        take_i = take.to(tl.int32)
        pos = tl.cumsum(take_i, axis=0) - take_i
        tl.store(kept_ptr + b * n_keep + pos, offs.to(tl.int64), mask=take)
    else:
        for tile in range(N_TILES):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            _final_tile(
                part_ptr, vis_ptr, debias_ptr, scores_ptr, b, offs, seq, n_parts, HAS_DEBIAS
            )
        tl.debug_barrier()  # scores written above are re-read by other threads below
        prefix = tl.zeros([], tl.int32)
        for bit in range(31, -1, -1):
            cand = prefix | (one << bit)
            count = tl.zeros([], tl.int32)
            for tile in range(N_TILES):
                offs = tile * BLOCK + tl.arange(0, BLOCK)
                key = _stored_key(scores_ptr, vis_ptr, b, offs, seq)
                count += tl.sum((key >= (cand ^ sign)).to(tl.int32), axis=0)
            prefix = tl.where(count >= n_keep, cand, prefix)
        thr = prefix ^ sign
        n_above = tl.zeros([], tl.int32)
        for tile in range(N_TILES):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            key = _stored_key(scores_ptr, vis_ptr, b, offs, seq)
            n_above += tl.sum((key > thr).to(tl.int32), axis=0)
        need = n_keep - n_above
        n_out = tl.zeros([], tl.int32)
        n_tie = tl.zeros([], tl.int32)
        for tile in range(N_TILES):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            key = _stored_key(scores_ptr, vis_ptr, b, offs, seq)
            tie_i = (key == thr).to(tl.int32)
            take = (key > thr) | ((tie_i != 0) & (n_tie + tl.cumsum(tie_i, axis=0) - tie_i < need))
            take_i = take.to(tl.int32)
            pos = n_out + tl.cumsum(take_i, axis=0) - take_i
            tl.store(kept_ptr + b * n_keep + pos, offs.to(tl.int64), mask=take)
            n_out += tl.sum(take_i, axis=0)
            n_tie += tl.sum(tie_i, axis=0)


@triton.jit
def _stored_key(scores_ptr, vis_ptr, b, offs, seq):
    ok = offs < seq
    vis = tl.load(vis_ptr + b * seq + offs, mask=ok, other=0) != 0
    score = tl.load(scores_ptr + b * seq + offs, mask=ok, other=0.0)
    return tl.where(vis, _order_key(score), -2147483648)


@dataclass(frozen=True)
class _Plan:
    """Launch shape. ``_plan`` picks one from the problem size and the GPU; tests force others."""

    block_n: int = 64  # keys per tile (both passes)
    block_t: int = 16  # query rows per tile: a power of two >= 16 (tl.dot minimum)
    n_split: int = 1  # key ranges in pass 1
    n_hparts: int = 1  # kv-head ranges in pass 2 (mean only)
    n_tparts: int = 1  # query-block ranges in pass 2 (at most _MAX_TPARTS)
    select_block: int = 0  # selection tile; 0 = whole row in one tile
    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _plan(q: torch.Tensor, k: torch.Tensor, reduce: str) -> _Plan:
    """Heuristic launch shape: enough programs (~4 per SM) for a batch-1 call at every S."""
    # The interpreter runs programs one after another: few, large programs are fastest there.
    n_sm = _sm_count(q.device.index if q.device.index is not None else 0) if q.is_cuda else 1
    return plan_for(q.shape, k.shape, reduce, n_sm)


def plan_for(q_shape, k_shape, reduce: str, n_sm: int) -> _Plan:
    """:func:`_plan` from the shapes ``[B, H, Tq, D]`` / ``[B, Hkv, S, D]`` and the SM count."""
    batch, n_heads, n_query, _ = q_shape
    n_kv, seq = k_shape[1], k_shape[2]
    block_n = 64
    block_t = min(32, max(16, _next_pow2(n_query)))  # 32 rows keep pass 2 in registers
    n_tblocks = triton.cdiv(n_query, block_t)
    n_blocks = triton.cdiv(seq, block_n)
    target = 4 * n_sm
    n_split = max(1, min(n_blocks, _MAX_SPLIT, triton.cdiv(target, batch * n_heads * n_tblocks)))
    # Pass 2: split query blocks first (any reduce), then kv heads (mean only).
    n_tparts = max(1, min(n_tblocks, _MAX_TPARTS, triton.cdiv(target, batch * n_blocks)))
    n_hparts = 1
    if reduce == "mean":
        n_hparts = max(1, min(n_kv, triton.cdiv(target, batch * n_blocks * n_tparts)))
    return _Plan(
        block_n=block_n, block_t=block_t, n_split=n_split, n_hparts=n_hparts, n_tparts=n_tparts
    )


def compiled_variant(
    q_shape, k_shape, dtype: torch.dtype, reduce: str, has_debias: bool, plan: _Plan, cuda=True
) -> tuple:
    """The compile-time arguments of the three kernels for one call: Triton compiles one
    variant per distinct value (the shape integers are not specialised)."""
    n_heads, head_dim = q_shape[1], q_shape[3]
    seq = k_shape[2]
    sel_block = plan.select_block or min(_SELECT_MAX_SINGLE, max(16, _next_pow2(seq)))
    return (
        n_heads // k_shape[1],  # GROUPS
        plan.block_t,
        plan.block_n,
        max(16, _next_pow2(head_dim)),  # BLOCK_D
        "ieee" if dtype == torch.float32 else "tf32",  # tf32 applies to fp32 inputs only
        # The CPU interpreter (triton 3.9) returns garbage from tl.dot on bf16 tiles, so there
        # the tiles go to fp32 first. Exact: a product of two bf16/fp16 numbers fits in fp32.
        not cuda,  # DOT_FP32
        reduce == "max",
        has_debias,
        sel_block,
        triton.cdiv(seq, sel_block),  # N_TILES
    )


def _launch(
    q: torch.Tensor, k: torch.Tensor, visual: torch.Tensor, n_keep: int, *, plan: _Plan, **args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the three kernels with an explicit launch shape; ``args`` are the twin's keyword
    arguments (``scaling``, ``key_mask``, ``query_pos``, ``query_weights``, ``reduce``,
    ``debias``: :func:`vlm_focus.kernels.naive.score_and_select_naive`)."""
    reduce, debias = args["reduce"], args["debias"]
    batch, n_heads, n_query, head_dim = q.shape
    n_kv, seq = k.shape[1], k.shape[2]
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        # mixed or other dtypes: one of the types tl.dot takes, never below the inputs' precision
        common = torch.promote_types(q.dtype, k.dtype)
        if common not in (torch.float16, torch.bfloat16):
            common = torch.float32
        q, k = q.to(common), k.to(common)
    device = q.device
    has_debias = debias is not None
    (groups, block_t, block_n, block_d, precision, dot_fp32, reduce_max, _, sel_block, n_tiles) = (
        compiled_variant(q.shape, k.shape, q.dtype, reduce, has_debias, plan, q.is_cuda)
    )
    n_tblocks = triton.cdiv(n_query, block_t)
    n_blocks = triton.cdiv(seq, block_n)
    # Whole tiles per split, then drop splits that would be empty.
    keys_per_split = triton.cdiv(n_blocks, max(1, min(plan.n_split, _MAX_SPLIT))) * block_n
    n_split = triton.cdiv(seq, keys_per_split)
    kv_per_part = triton.cdiv(n_kv, max(1, plan.n_hparts)) if reduce == "mean" else n_kv
    n_hparts = triton.cdiv(n_kv, kv_per_part)
    tblocks_per_part = triton.cdiv(n_tblocks, max(1, min(plan.n_tparts, _MAX_TPARTS)))
    n_tparts = triton.cdiv(n_tblocks, tblocks_per_part)
    n_parts = n_hparts * n_tparts

    kmask = args["key_mask"].to(device).contiguous().view(torch.uint8)  # [B, S]
    vis = visual.to(device).contiguous().view(torch.uint8)  # [B, S]
    qpos = args["query_pos"].to(device=device, dtype=torch.int64).contiguous()  # [B, Tq]
    weights = args["query_weights"].to(device=device, dtype=torch.float32).contiguous()  # [B, Tq]
    qk_scale = float(args["scaling"]) * _LOG2E  # work in log2 so the kernels use exp2
    lse = torch.empty(batch, n_heads, n_query, n_split, device=device, dtype=torch.float32)
    parts = torch.empty(batch, n_parts, seq, device=device, dtype=torch.float32)
    scores = torch.empty(batch, seq, device=device, dtype=torch.float32)
    kept = torch.empty(batch, n_keep, device=device, dtype=torch.int64)

    # Launch on the tensors' GPU, which need not be the current one (models split over GPUs).
    with torch.cuda.device(device) if q.is_cuda else contextlib.nullcontext():
        _lse_kernel[(batch * n_heads, n_tblocks, n_split)](
            q,
            k,
            kmask,
            qpos,
            lse,
            n_heads,
            n_query,
            seq,
            head_dim,
            n_split,
            keys_per_split,
            qk_scale,
            *q.stride(),
            *k.stride(),
            GROUPS=groups,
            BLOCK_T=block_t,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            PRECISION=precision,
            DOT_FP32=dot_fp32,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
        _score_kernel[(n_blocks, n_parts, batch)](
            q,
            k,
            kmask,
            vis,
            qpos,
            weights,
            lse,
            parts,
            n_heads,
            n_kv,
            n_query,
            seq,
            head_dim,
            n_split,
            kv_per_part,
            n_hparts,
            n_tblocks,
            tblocks_per_part,
            n_parts,
            qk_scale,
            1.0 / n_heads if reduce == "mean" else 1.0,
            *q.stride(),
            *k.stride(),
            GROUPS=groups,
            BLOCK_T=block_t,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            SPLIT_PAD=_MAX_SPLIT,
            REDUCE_MAX=reduce_max,
            PRECISION=precision,
            DOT_FP32=dot_fp32,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
        debias_arg = debias.to(device=device).contiguous() if has_debias else scores
        _select_kernel[(batch,)](
            parts,
            vis,
            debias_arg,
            scores,
            kept,
            seq,
            n_parts,
            n_keep,
            HAS_DEBIAS=has_debias,
            BLOCK=sel_block,
            N_TILES=n_tiles,
            num_warps=4 if sel_block <= 2048 else (8 if sel_block <= 8192 else 16),
        )
    return scores, kept


def score_and_select_triton(
    q: torch.Tensor, k: torch.Tensor, visual: torch.Tensor, n_keep: int, **args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton score-and-select, launched with the shape :func:`_plan` picks: the keyword
    arguments and results of the torch twin
    (:func:`vlm_focus.kernels.naive.score_and_select_naive`), already checked and defaulted by
    :func:`vlm_focus.kernels.score_and_select` (``visual`` is already AND-ed with ``key_mask``)."""
    return _launch(q, k, visual, n_keep, **args, plan=_plan(q, k, args["reduce"]))
