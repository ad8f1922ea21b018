"""Triton kernels vs the torch reference on CPU; run with TRITON_INTERPRET=1 (by the tests).

Prints one JSON object: case name -> {"ok": bool, "detail": str}.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

from kvrelay.kernels import (  # noqa: E402
    gather_pages,
    paged_attention,
    rope_write_kv,
    scatter_pages,
    write_kv,
)
from tests.kernels.helpers import attend_batch, make_case, make_pool, random_seq  # noqa: E402

ATTENTION = {
    "decode_gqa_ragged": (([1, 4, 5, 9, 23], [1, 1, 1, 1, 1]), {}),
    "prefill_over_prefix": (([13, 9, 20], [5, 9, 3]), {}),
    "mixed_long": (([70, 33, 2], [40, 1, 2]), {"page_size": 8}),
    "mha_group1": (([19, 6], [19, 2]), {"heads": 2, "kv_heads": 2}),
    "group3_dim_not_pow2": (([21, 10], [4, 1]), {"heads": 9, "kv_heads": 3, "head_dim": 24}),
}


def check_attention(ctx, qlen, kw) -> tuple[bool, str]:
    case = make_case(ctx, qlen, **kw)
    got = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.3, impl="triton")
    ref = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.3, impl="torch")
    err = (got - ref).abs().max().item()
    return err < 2e-6, f"max abs err {err:.3g}"


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


def main() -> None:
    results = {}
    for name, ((ctx, qlen), kw) in ATTENTION.items():
        results[name] = check_attention(ctx, qlen, kw)
    results["decode_and_chunks"] = check_decode_and_chunks()
    results["write_kv"] = check_write_kv()
    results["pages"] = check_pages()
    results["rope_write_kv"] = check_rope_write_kv()
    json.dump({k: {"ok": ok, "detail": d} for k, (ok, d) in results.items()}, sys.stdout)


if __name__ == "__main__":
    main()
