"""Triton kernels on a real GPU: agreement with the torch path and bitwise path invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import (
    add_rms_norm,
    gather_pages,
    linear,
    paged_attention,
    rms_norm,
    scatter_pages,
    write_kv,
)
from tests.kernels.helpers import attend_batch, make_case, meta_on, random_seq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx,qlen",
    [
        ([585 + i for i in range(32)], [1] * 32),  # decode batch 32
        ([700, 512, 40], [188, 512, 1]),  # prefill over a prefix + fresh prefill + decode
        ([2048], [2048]),
    ],
)
def test_attention_matches_torch(dtype, ctx, qlen) -> None:
    case = make_case(ctx, qlen, heads=9, kv_heads=3, head_dim=64, page_size=16, dtype=dtype)
    meta = meta_on(case.meta, "cuda")
    got = paged_attention(case.query.cuda(), case.kv_pool.cuda(), 1, meta, 0.125)
    ref = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.125, impl="torch")
    assert got.is_cuda and got.dtype == dtype
    err = (got.float().cpu() - ref.float()).abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rows_are_path_invariant(dtype) -> None:
    seq = random_seq(300, seed=1)
    seq.keys, seq.values, seq.queries = (x.to(dtype) for x in (seq.keys, seq.values, seq.queries))
    full = attend_batch([(seq, 300, 300)], device="cuda")[0]
    for pos in (0, 15, 16, 17, 100, 299):
        row = attend_batch([(seq, pos + 1, 1)], seed=pos, device="cuda")[0][0]
        assert torch.equal(row, full[pos]), pos
    chunks = [(0, 37), (37, 200), (200, 300)]
    rows = [attend_batch([(seq, e, e - s)], seed=s, device="cuda")[0] for s, e in chunks]
    assert torch.equal(torch.cat(rows), full)
    other = random_seq(900, seed=5)
    other.keys, other.values, other.queries = (
        x.to(dtype) for x in (other.keys, other.values, other.queries)
    )
    mixed = attend_batch([(other, 900, 1), (seq, 250, 50), (other, 500, 3)], device="cuda")
    assert torch.equal(mixed[1], full[200:250])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx,qlen,window",
    [
        ([32768], [1], 0),  # one long context: 128 splits
        ([8192, 8000, 300, 5], [1, 1, 1, 1], 0),  # ragged decode batch
        ([4100, 1000], [4, 16], 0),  # verifying drafted tokens
        ([5000, 700], [1, 9], 1000),  # a window that skips whole splits
    ],
)
def test_split_k_launch_gives_the_one_pass_rows(dtype, ctx, qlen, window) -> None:
    """Flash-decoding (split-K) and the one-pass launch compute the same rows, bitwise."""
    from kvrelay.kernels.triton_attention import paged_attention as launch

    case = make_case(ctx, qlen, heads=9, kv_heads=3, head_dim=64, page_size=16, dtype=dtype)
    args = (case.query.cuda(), case.kv_pool.cuda(), 1, meta_on(case.meta, "cuda"), 0.125)
    split = launch(*args, window=window, split_k=True)
    assert torch.equal(split, launch(*args, window=window, split_k=False))
    ref = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.125, impl="torch",
                          window=window)  # fmt: skip
    assert (split.float().cpu() - ref.float()).abs().max().item() < TOL[dtype]


def test_long_context_decode_rows_equal_prefill_rows() -> None:
    """A decode row at 3,000 tokens (split-K at batch 1) equals its row of the prefill (one
    pass), and a batch of 200 sequences (one pass on a GPU of up to 150 multiprocessors) gives
    each row what it gets alone."""
    seq = random_seq(3000, seed=2)
    seq.keys, seq.values, seq.queries = (x.bfloat16() for x in (seq.keys, seq.values, seq.queries))
    full = attend_batch([(seq, 3000, 3000)], device="cuda")[0]
    for pos in (255, 256, 1000, 2999):
        row = attend_batch([(seq, pos + 1, 1)], seed=pos, device="cuda")[0][0]
        assert torch.equal(row, full[pos]), pos
    many = attend_batch([(seq, 1000 + i, 1) for i in range(200)], device="cuda")
    assert all(torch.equal(many[i][0], full[999 + i]) for i in (0, 1, 199))


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float16])
def test_fp32_queries_over_16bit_pool(kv) -> None:
    """--kv-cache-dtype bf16/fp16 with an fp32 model: 16-bit pages, fp32 queries and output."""
    case = make_case([700, 512, 40], [188, 512, 1], heads=9, kv_heads=3, head_dim=64, page_size=16)
    pool = case.kv_pool.to(kv)
    got = paged_attention(case.query.cuda(), pool.cuda(), 1, meta_on(case.meta, "cuda"), 0.125)
    ref = paged_attention(case.query, pool, 1, case.meta, 0.125, impl="torch")
    assert got.dtype == torch.float32
    err = (got.cpu() - ref).abs().max().item()  # the kernel's dots round q to the pool dtype
    assert err < TOL[torch.bfloat16], err
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(40, 3, 64, generator=g), torch.randn(40, 3, 64, generator=g)
    slots = torch.randperm(128, generator=g)[:40]
    gpu_pool, cpu_pool = (
        torch.zeros(8, 3, 2, 16, 3, 64, dtype=kv).cuda(),
        torch.zeros(8, 3, 2, 16, 3, 64, dtype=kv),
    )
    write_kv(gpu_pool, 2, key.cuda(), value.cuda(), slots.cuda())
    write_kv(cpu_pool, 2, key, value, slots, impl="torch")
    assert torch.equal(gpu_pool.cpu().view(torch.int16), cpu_pool.view(torch.int16))


def test_write_kv_and_pages_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    pool = torch.zeros(8, 3, 2, 16, 3, 64)
    key, value = torch.randn(40, 3, 64, generator=g), torch.randn(40, 3, 64, generator=g)
    slots = torch.randperm(128, generator=g)[:40]
    slots[5] = -1
    gpu_pool = pool.cuda()
    write_kv(gpu_pool, 2, key.cuda(), value.cuda(), slots.cuda())
    write_kv(pool, 2, key, value, slots, impl="torch")
    assert torch.equal(gpu_pool.cpu(), pool)
    ids = torch.tensor([7, 0, 3])
    assert torch.equal(gather_pages(gpu_pool, ids.cuda()).cpu(), pool[ids])
    dst = torch.zeros_like(gpu_pool)
    scatter_pages(dst, torch.tensor([1, 2]).cuda(), gpu_pool[[7, 3]])
    assert torch.equal(dst[1], gpu_pool[7]) and torch.equal(dst[2], gpu_pool[3])
    assert dst[[0, 3, 4, 5, 6, 7]].abs().sum().item() == 0


ROW_COUNTS = (1, 2, 7, 32, 33, 256, 1000)


def _gpu_rows(n: int, dim: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n", [(576, 1536), (576, 960), (1536, 576), (576, 49152)])
def test_linear_rows_are_batch_invariant(dtype, k, n) -> None:
    x = _gpu_rows(max(ROW_COUNTS), k, 0, dtype)
    w, b = _gpu_rows(n, k, 1, dtype) / k**0.5, _gpu_rows(1, n, 2, dtype)[0]
    full = linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)
    for m in ROW_COUNTS:
        assert torch.equal(linear(x[:m], w, b), full[:m]), m
        assert torch.equal(linear(x[m - 1 : m + 5], w, b), full[m - 1 : m + 5]), m


@pytest.mark.parametrize("dim", [576, 960])
def test_rms_norm_rows_are_batch_invariant(dim) -> None:
    x, w = _gpu_rows(max(ROW_COUNTS), dim, 3) * 3, _gpu_rows(1, dim, 4)[0]
    delta = _gpu_rows(max(ROW_COUNTS), dim, 5)
    full = rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.float(), (dim,), w.float(), 1e-5)
    torch.testing.assert_close(full.float(), ref, rtol=2e-2, atol=2e-2)
    residual = x.clone()
    summed = add_rms_norm(residual, delta, w, 1e-5)
    assert torch.equal(residual, x + delta)
    assert torch.equal(summed, rms_norm(x + delta, w, 1e-5))
    for m in ROW_COUNTS:
        assert torch.equal(rms_norm(x[:m], w, 1e-5), full[:m]), m
        part = x[:m].clone()
        assert torch.equal(add_rms_norm(part, delta[:m], w, 1e-5), summed[:m]), m
