"""Triton kernels vs the torch reference on CPU; run with TRITON_INTERPRET=1 (by the tests).

Prints one JSON object: case name -> {"ok": bool, "detail": str}.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from kvrelay.kernels import (  # noqa: E402
    add_rms_norm,
    gather_pages,
    linear,
    paged_attention,
    rms_norm,
    rope_write_kv,
    scatter_pages,
    write_kv,
)
from tests.kernels.helpers import attend_batch, make_case, make_pool, random_seq  # noqa: E402

_interpreter_dot = interpreter.InterpreterBuilder.create_dot


def _dot_bf16_as_fp32(self, a, b, d, *args):
    # The interpreter keeps bf16 as uint16 bit patterns and its dot multiplies those as integers;
    # bf16 products are exact in fp32, so upcasting first gives the GPU's fp32-accumulated dot.
    a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
    return _interpreter_dot(self, a, b, d, *args)


interpreter.InterpreterBuilder.create_dot = _dot_bf16_as_fp32
_patch_lang_tensor = interpreter._patch_lang_tensor


def _scalar_index(tensor, scope) -> None:
    # The interpreter holds a scalar as a 1-element array; Triton before 3.9 made a loop bound of
    # it with int(array), which NumPy >= 2.4 refuses for a 1-d array (the lent GPU machine's
    # Triton 3.6). 3.9 squeezes it first, as this does.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


interpreter._patch_lang_tensor = _scalar_index
# The interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest even): bf16 results
# are checked within two bf16 ulps of torch, not bitwise.
BF16_ULP = 2.0**-7
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LINEAR_SHAPES = ((96, 80), (128, 130))  # (K, N): a ragged K tile, ragged N tiles
ROW_COUNTS = (1, 3, 17, 64, 70)

ATTENTION = {
    "decode_gqa_ragged": (([1, 4, 5, 9, 23], [1, 1, 1, 1, 1]), {}),
    "prefill_over_prefix": (([13, 9, 20], [5, 9, 3]), {}),
    "mixed_long": (([70, 33, 2], [40, 1, 2]), {"page_size": 8}),
    "mha_group1": (([19, 6], [19, 2]), {"heads": 2, "kv_heads": 2}),
    "group3_dim_not_pow2": (([21, 10], [4, 1]), {"heads": 9, "kv_heads": 3, "head_dim": 24}),
}


# sliding windows (case, windows): under a page, tiles of 64 keys skipped before a window,
# Gemma 3's MQA at head_dim 256, a window over the whole context
WINDOWED = {
    "window_small_pages": (([150, 33, 2], [20, 1, 2]), {"page_size": 8}, (1, 3, 70)),
    "window_mqa_d256": (([90, 5], [3, 1]), {"heads": 4, "kv_heads": 1, "head_dim": 256}, (2, 70)),
    "window_over_context": (([40, 9], [40, 1]), {}, (40, 1000)),
}


def check_attention(ctx, qlen, kw, windows=(0,), scale=0.3) -> tuple[bool, str]:
    case = make_case(ctx, qlen, **kw)
    err = 0.0
    for w in windows:
        args = (case.query, case.kv_pool, 1, case.meta, scale)
        got = paged_attention(*args, impl="triton", window=w)
        ref = paged_attention(*args, impl="torch", window=w)
        err = max(err, (got - ref).abs().max().item())
    return err < 2e-6, f"max abs err {err:.3g}"


# the split-K launch against the one-pass launch (bitwise) and torch: contexts over several
# 256-key splits, query blocks of 1-20 rows, windows that skip whole splits, GQA and MQA
SPLIT_K = [
    (([600, 9, 300], [1, 1, 1]), {}, 0),
    (([700, 260], [5, 3]), {"page_size": 8}, 0),
    (([900, 520], [1, 20]), {"heads": 4, "kv_heads": 1, "head_dim": 24}, 300),
]


def check_split_k() -> tuple[bool, str]:
    from kvrelay.kernels.triton_attention import paged_attention as launch

    err, same = 0.0, True
    for (ctx, qlen), kw, window in SPLIT_K:
        case = make_case(ctx, qlen, **kw)
        args = (case.query, case.kv_pool, 1, case.meta, 0.3)
        one_pass = launch(*args, window=window, split_k=False)
        split = launch(*args, window=window, split_k=True)
        same = same and torch.equal(one_pass, split)
        ref = paged_attention(*args, impl="torch", window=window)
        err = max(err, (split - ref).abs().max().item())
    return bool(same) and err < 2e-6, f"launches equal: {same}; max abs err vs torch {err:.3g}"


def check_decode_and_chunks() -> tuple[bool, str]:
    # The interpreter's dot is numpy matmul, whose rows depend on their index in the tile, so
    # bitwise path invariance is checked on a GPU (tests/kernels/test_triton_gpu.py); here: close.
    seq = random_seq(40, heads=6, kv_heads=2, head_dim=16, seed=3)
    full = attend_batch([(seq, 40, 40)], page_size=4, impl="triton")[0]
    rows = [
        attend_batch([(seq, p + 1, 1)], page_size=4, seed=p, impl="triton")[0] for p in (0, 17, 39)
    ]
    chunks = torch.cat(attend_batch([(seq, 25, 25), (seq, 40, 15)], page_size=4, impl="triton"))
    err = max((r[0] - full[p]).abs().max().item() for r, p in zip(rows, (0, 17, 39), strict=True))
    err = max(err, (chunks - full).abs().max().item())
    return err < 1e-6, f"decode rows and chunked prefill vs one-shot prefill: max err {err:.3g}"


def check_write_kv() -> tuple[bool, str]:
    g = torch.Generator().manual_seed(0)
    pools = [make_pool(4, 2, 4, 3, 5) for _ in range(2)]
    key, value = torch.randn(6, 3, 5, generator=g), torch.randn(6, 3, 5, generator=g)
    slots = torch.tensor([15, -1, 0, 7, -3, 8])
    write_kv(pools[0], 1, key, value, slots, impl="triton")
    write_kv(pools[1], 1, key, value, slots, impl="torch")
    return torch.equal(pools[0], pools[1]), "pool equals the torch write"


def check_rope_write_kv() -> tuple[bool, str]:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 6, 2, 8
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g)
    pos, slots = torch.tensor([0, 3, 9, 2, 7]), torch.tensor([3, -1, 12, 0, 31])
    angles = torch.arange(16.0)[:, None] * torch.rand(dim // 2, generator=g)[None, :]
    cos, sin = angles.cos(), angles.sin()
    pools = [make_pool(4, 2, 8, kv_heads, dim) for _ in range(2)]
    q = [
        rope_write_kv(qkv, pos, cos, sin, pool, 1, slots, heads, impl=impl)
        for pool, impl in zip(pools, ("triton", "torch"), strict=True)
    ]
    ok = torch.equal(q[0], q[1]) and torch.equal(pools[0], pools[1])
    return ok, "q and the pool equal the torch path's"


def check_pages() -> tuple[bool, str]:
    pool = torch.randn(5, 2, 2, 4, 3, 5)
    ids = torch.tensor([4, 0, 4])
    pages = gather_pages(pool, ids, impl="triton")
    ok = torch.equal(pages, pool[ids])
    dst = torch.zeros_like(pool)
    scatter_pages(dst, torch.tensor([1, 3]), pool[[2, 0]], impl="triton")
    ok = ok and torch.equal(dst[1], pool[2]) and torch.equal(dst[3], pool[0])
    ok = ok and dst[[0, 2, 4]].abs().sum().item() == 0
    return ok, "gather equals indexing; scatter writes only the named blocks"


def _rows(n: int, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: float) -> float:
    """Max error beyond the allowed (atol + 2 ulps of the reference for bf16); <= 0 passes."""
    rel = 2 * BF16_ULP if dtype == torch.bfloat16 else 1e-5
    excess = (got.double() - ref.double()).abs() - (atol + rel * ref.double().abs())
    return excess.max().item()


def check_linear(dtype: torch.dtype) -> tuple[bool, str]:
    worst, invariant = float("-inf"), True
    for seed, (k, n) in enumerate(LINEAR_SHAPES):
        x, w = _rows(max(ROW_COUNTS), k, seed, dtype), _rows(n, k, seed + 10, dtype) / k**0.5
        for bias in (None, _rows(1, n, seed + 20, dtype)[0]):
            full = linear(x, w, bias, impl="triton")
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert full.dtype == dtype and full.shape == (x.shape[0], n)
            worst = max(worst, _close(full, ref, dtype, 1e-5))
            for m in ROW_COUNTS:
                invariant &= torch.equal(linear(x[:m], w, bias, impl="triton"), full[:m])
            # a row-strided x (a slice of wider rows) gives the same rows
            wide = torch.cat([x, x[:, :5]], 1)[:, :k]
            invariant &= torch.equal(linear(wide, w, bias, impl="triton"), full)
    detail = f"error beyond tolerance {worst:.3g}; rows of x[:m] equal rows of x: {invariant}"
    return worst <= 0 and invariant, detail


def check_rms_norm(dtype: torch.dtype) -> tuple[bool, str]:
    worst, invariant = float("-inf"), True
    for dim in (96, 130):
        x, w = _rows(max(ROW_COUNTS), dim, dim, dtype) * 3, _rows(1, dim, dim + 1, dtype)[0]
        full = rms_norm(x, w, 1e-5, impl="triton")
        ref = F.rms_norm(x.double(), (dim,), w.double(), 1e-5)
        worst = max(worst, _close(full, ref, dtype, 1e-6))
        delta = _rows(max(ROW_COUNTS), dim, dim + 2, dtype)
        residual = x.clone()
        summed = add_rms_norm(residual, delta, w, 1e-5, impl="triton")
        ref_sum = x.double() + delta.double()
        worst = max(worst, _close(residual, ref_sum, dtype, 0.0))
        worst = max(worst, _close(summed, rms_norm(residual, w, 1e-5, impl="torch"), dtype, 1e-5))
        invariant &= torch.equal(summed, rms_norm(residual, w, 1e-5, impl="triton"))
        for m in ROW_COUNTS:
            invariant &= torch.equal(rms_norm(x[:m], w, 1e-5, impl="triton"), full[:m])
            part = x[:m].clone()
            invariant &= torch.equal(
                add_rms_norm(part, delta[:m], w, 1e-5, impl="triton"), summed[:m]
            )
            invariant &= torch.equal(part, residual[:m])
    detail = f"error beyond tolerance {worst:.3g}; rows stand alone: {invariant}"
    return worst <= 0 and invariant, detail


def main() -> None:
    results = {}
    for name, ((ctx, qlen), kw) in ATTENTION.items():
        results[name] = check_attention(ctx, qlen, kw)
    for name, ((ctx, qlen), kw, windows) in WINDOWED.items():
        scale = kw.get("head_dim", 16) ** -0.5  # the model's
        results[name] = check_attention(ctx, qlen, kw, windows, scale)
    results["decode_and_chunks"] = check_decode_and_chunks()
    results["split_k"] = check_split_k()
    results["write_kv"] = check_write_kv()
    results["pages"] = check_pages()
    results["rope_write_kv"] = check_rope_write_kv()
    for name, dtype in DTYPES.items():
        results[f"linear_{name}"] = check_linear(dtype)
        results[f"rms_norm_{name}"] = check_rms_norm(dtype)
    json.dump({k: {"ok": ok, "detail": d} for k, (ok, d) in results.items()}, sys.stdout)


if __name__ == "__main__":
    main()
