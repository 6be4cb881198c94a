"""The Triton kernels compile for a Hopper GPU (sm_90), checked on a machine without one.

The interpreter (``test_kernels_triton.py``) runs the kernels' Python, not the compiler, so type
errors of the compiled path (loop-carried types, scalar handling, dot shapes) would only show on a
GPU. Triton can compile ahead of time for a target given by name, with its bundled ``ptxas``, and
no driver. Compilation must happen where ``TRITON_INTERPRET`` was never set (the flag is read when
triton is imported), so the test runs this file as a script in a fresh process.

The argument types and specialisations mirror what the JIT derives for a LLaVA-1.5-7B call
(contiguous bf16 q/k, unit last stride, 16-aligned pointers and sizes where they are).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The variants the dispatch launches for LLaVA (MHA) and Qwen (GQA 7) shapes:
# (kernel, constexprs, num_warps, dtype of q and k).
HEADS, TQ, SEQ, DIM = 32, 32, 11000, 128


def _variants() -> list[tuple[str, dict, int, str]]:
    half = dict(BLOCK_N=64, BLOCK_D=128, PRECISION="tf32", DOT_FP32=False)
    fp32 = dict(half, PRECISION="ieee")
    score = dict(SPLIT_PAD=64)  # kernels/_triton.py's fixed _MAX_SPLIT
    return [
        ("_lse_kernel", dict(GROUPS=1, BLOCK_T=32, **half), 4, "bf16"),
        ("_lse_kernel", dict(GROUPS=7, BLOCK_T=16, **fp32), 4, "fp32"),
        ("_score_kernel", dict(GROUPS=1, BLOCK_T=32, REDUCE_MAX=False, **score, **half), 4, "fp16"),
        ("_score_kernel", dict(GROUPS=7, BLOCK_T=16, REDUCE_MAX=True, **score, **half), 4, "bf16"),
        ("_score_kernel", dict(GROUPS=1, BLOCK_T=16, REDUCE_MAX=False, **score, **fp32), 4, "fp32"),
        ("_select_kernel", dict(HAS_DEBIAS=True, BLOCK=2048, N_TILES=1), 4, "bf16"),
        ("_select_kernel", dict(HAS_DEBIAS=False, BLOCK=2048, N_TILES=3), 4, "bf16"),
    ]


def _example_args() -> dict:
    """Argument values of a LLaVA-7B call (pointer entries are triton type strings)."""
    return dict(
        q_ptr="*{dtype}",
        k_ptr="*{dtype}",
        kmask_ptr="*u8",
        vis_ptr="*u8",
        qpos_ptr="*i64",
        w_ptr="*fp32",
        lse_ptr="*fp32",
        part_ptr="*fp32",
        debias_ptr="*fp32",
        scores_ptr="*fp32",
        kept_ptr="*i64",
        n_heads=HEADS,
        n_kv=HEADS,
        n_query=TQ,
        seq=SEQ,
        head_dim=DIM,
        n_split=16,
        keys_per_split=704,
        kv_per_part=8,
        n_hparts=4,
        n_tblocks=1,
        tblocks_per_part=1,
        n_parts=4,
        n_keep=2700,
        qk_scale=0.1275,
        head_scale=1 / HEADS,
        sqb=HEADS * TQ * DIM,
        sqh=TQ * DIM,
        sqt=DIM,
        sqd=1,
        skb=HEADS * SEQ * DIM,
        skh=SEQ * DIM,
        sks=DIM,
        skd=1,
    )


def _compile_all(arch: int) -> None:
    """Compile every variant as the JIT would specialise it; raise on the first failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vlm_focus.kernels import _triton as kt

    for name, consts, num_warps, dtype in _variants():
        values = {
            k: v.format(dtype=dtype) if isinstance(v, str) else v
            for k, v in _example_args().items()
        }
        fn = getattr(kt, name)
        signature, constexprs, attrs = {}, dict(consts), {}
        plain = set(fn.do_not_specialize)  # shape integers: neither 1 nor 16-divisible variants
        for i, arg in enumerate(fn.arg_names):
            if arg in consts:
                signature[arg] = "constexpr"
                continue
            value = values[arg]
            if arg in plain or i in plain:
                signature[arg] = "i32"
                continue
            if isinstance(value, str):  # pointer: the JIT marks 16-byte aligned ones
                signature[arg] = value
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[arg] = "fp32"
            elif value == 1:  # the JIT turns integer arguments equal to 1 into constants
                signature[arg] = "constexpr"
                constexprs[arg] = 1
            else:
                signature[arg] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps)
        )
        assert len(compiled.asm["cubin"]) > 0
        print(f"compiled {name} {dtype} {consts} for sm_{arch}")


def test_shape_integers_are_plain_arguments_and_a_model_needs_few_variants() -> None:
    """Every integer argument that is a size or a count (not a stride) is exempt from Triton's
    ``== 1`` / ``% 16`` specialisation, so the variants of one model are the distinct
    compile-time arguments: over B 1-32, S 600-12k and Tq 1-200 on an H200, at most ten."""
    import torch

    from vlm_focus.kernels import _triton as kt

    strides = {"sqb", "sqh", "sqt", "sqd", "skb", "skh", "sks", "skd"}
    for fn in (kt._lse_kernel, kt._score_kernel, kt._select_kernel):
        constexprs = {fn.arg_names[i] for i in fn.constexprs}
        sizes = {
            a
            for a in fn.arg_names
            if a not in constexprs
            and a not in strides
            and not a.endswith("_ptr")
            and a not in ("qk_scale", "head_scale")
        }
        assert sizes == set(fn.do_not_specialize), fn.__name__
    variants = set()
    for batch in (1, 2, 3, 4, 8, 16, 32):
        for seq in range(600, 12_001, 397):
            for tq in (1, 2, 5, 16, 17, 32, 33, 64, 100, 200):
                q, k = (batch, 32, tq, 128), (batch, 32, seq, 128)  # LLaVA-1.5-7B
                plan = kt.plan_for(q, k, "mean", n_sm=132)
                variants.add(kt.compiled_variant(q, k, torch.bfloat16, "mean", False, plan))
    assert len(variants) <= 10, sorted(variants)


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, "90"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("compiled ") == len(_variants()), done.stdout


if __name__ == "__main__":
    _compile_all(int(sys.argv[1]))
