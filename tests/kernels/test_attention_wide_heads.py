"""fp32 paged attention at head_dim 128 and 256 (Gemma 3: 4 query heads on 1 KV head, head_dim
256): the AVX-512 builds run rows_page16 there (two rows per zmm in q.k, 16 dims per zmm in
P.V, tiles of up to 4 rows), whose every row must be bitwise the AVX2 code's (unchanged since
before it), on fp32, bf16 and fp16 pools, in prefill chunks (odd pages: partial 8-key groups),
decode batches over several 256-key chunks, windows, and 1 or 2 threads. Tiles of 4, 3, 2 and 1
rows are all met: GQA groups 1, 2, 3, 4, 5 (4 + 1), 7 (4 + 3) and 8 (4 + 4)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import cpu_build

WIDE = tuple(v for v in cpu_build.VARIANTS if v != "avx2")

# (context lengths, query rows, page size, window)
BATCHES = [
    ([77], [77], 5, 0),  # a whole prompt in odd pages
    ([530], [45], 16, 0),  # a prefill chunk over three 256-key chunks
    ([40, 700, 300], [1, 1, 1], 8, 0),  # decode
    ([500, 33], [71, 1], 32, 0),  # a prefill chunk beside a decode row
    ([530], [45], 16, 100),  # windows: a page met from inside, chunks skipped
    ([40, 700, 300], [1, 1, 1], 8, 200),
]


@pytest.fixture(params=WIDE)
def wide(request):
    if request.param not in cpu_build.supported_variants():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    return cpu_build.load_variant("avx2"), cpu_build.load_variant(request.param)


def make_case(group, kv_heads, head_dim, ctx, qlen, page, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // page) for c in ctx]
    blocks = torch.randperm(sum(pages) + 1, generator=g)
    rows, at = [], 0
    for p in pages:
        rows.append(blocks[at : at + p].tolist() + [0] * (max(pages) - p))
        at += p
    pool = torch.randn(sum(pages) + 1, 2, 2, page, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(qlen), group * kv_heads, head_dim, generator=g) * 2
    qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.tensor(rows, dtype=torch.int32)
    return q, pool, tables, torch.tensor(ctx, dtype=torch.int32), qsl, page


def attend(mod, case, window: int, threads: int) -> torch.Tensor:
    q, pool, tables, ctx, qsl, page = case
    chunk_pages = max(1, 256 // page)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        blocks = pool.shape[0]
        plan = mod.build_plan(tables, ctx, qsl, q.shape[0], page, chunk_pages, blocks, window)
        scale = q.shape[2] ** -0.5
        return mod.paged_attention(q, pool, 1, tables, *plan, chunk_pages, scale, False, window)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("group,kv_heads", [(4, 1), (1, 2), (2, 2), (3, 1), (5, 1), (7, 1), (8, 1)])
def test_wide_heads_same_bits_as_avx2(wide, head_dim, dtype, group, kv_heads):
    avx2, other = wide
    for i, (ctx, qlen, page, window) in enumerate(BATCHES):
        case = make_case(group, kv_heads, head_dim, ctx, qlen, page, dtype, seed=group * 10 + i)
        want = attend(avx2, case, window, 1)
        assert bool(torch.isfinite(want).all())
        for threads in (1, 2):
            got = attend(other, case, window, threads)
            assert torch.equal(got, want), (ctx, qlen, page, window, threads)


def test_wide_heads_rows_are_invariant(wide):
    """Gemma 3's shape on the wide build: a prompt's rows, its rows decoded one at a time and
    in two prefill chunks are bitwise the same."""
    _, mod = wide
    head_dim, n = 256, 300
    case = make_case(4, 1, head_dim, [n], [n], 16, torch.bfloat16, seed=3)
    q, pool, tables, _, _, page = case
    full = attend(mod, case, 0, 1)
    for pos in (0, 7, 255, 256, 299):
        one = (q[pos : pos + 1], pool, tables, torch.tensor([pos + 1], dtype=torch.int32),
               torch.tensor([0, 1], dtype=torch.int32), page)  # fmt: skip
        assert torch.equal(attend(mod, one, 0, 2)[0], full[pos]), pos
    cut = 133
    tail = (q[cut:], pool, tables, torch.tensor([n], dtype=torch.int32),
            torch.tensor([0, n - cut], dtype=torch.int32), page)  # fmt: skip
    assert torch.equal(attend(mod, tail, 0, 2), full[cut:])
