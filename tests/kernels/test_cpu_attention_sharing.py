"""C++ CPU attention over shared prefix pages and GQA row tiles: rows equal rows computed alone."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvrelay.kernels import cpu_build, paged_attention, write_kv
from tests.kernels.helpers import SeqData, attend_batch, build_meta

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )

PREFIX = 300  # crosses the first 256-key chunk: shared pages in two chunks


def _family(n, heads, kv_heads, head_dim, seed) -> list[SeqData]:
    """n sequences with one common 300-token prefix and their own continuations."""
    g = torch.Generator().manual_seed(seed)

    def rand(length, h):
        return torch.randn(length, h, head_dim, generator=g)

    base_k, base_v = rand(PREFIX, kv_heads), rand(PREFIX, kv_heads)
    out = []
    for _ in range(n):
        tail = 130
        out.append(
            SeqData(
                torch.cat([base_k, rand(tail, kv_heads)]),
                torch.cat([base_v, rand(tail, kv_heads)]),
                rand(PREFIX + tail, heads),
            )
        )
    return out


def _shared_batch(specs, page_size, shared_pages, private=()):
    """One step over specs (SeqData, context, query rows) whose first pages are the same blocks
    (except the specs at the indices in `private`, which get blocks of their own)."""
    kv_heads, head_dim = specs[0][0].keys.shape[1:]
    pages = [-(-c // page_size) for _, c, _ in specs]
    num_blocks = shared_pages + sum(pages) + 1
    free = list(range(num_blocks - 1, 0, -1))  # block 0 unused, ids descending
    common = [free.pop() for _ in range(shared_pages)]
    tables = [
        [free.pop() for _ in range(p)]
        if i in private
        else common + [free.pop() for _ in range(p - shared_pages)]
        for i, p in enumerate(pages)
    ]
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(num_blocks, 1, 2, page_size, kv_heads, head_dim, generator=g)
    for (s, c, _), t in zip(specs, tables, strict=True):
        # Each sequence writes its whole context; the shared pages get the same data each time.
        full = build_meta([t], [c], [c], page_size)
        write_kv(pool, 0, s.keys[:c], s.values[:c], full.slot_mapping)
    meta = build_meta(tables, [c for _, c, _ in specs], [n for _, _, n in specs], page_size)
    query = torch.cat([s.queries[c - n : c] for s, c, n in specs])
    out = paged_attention(query, pool, 0, meta, 0.125, impl="cpp")
    return list(out.split([n for _, _, n in specs]))


def _dense(s: SeqData, ctx: int, n: int) -> torch.Tensor:
    """float64 causal attention for the last n positions of a context."""
    q = s.queries[ctx - n : ctx].double()
    group = q.shape[1] // s.keys.shape[1]
    k = s.keys[:ctx].double().repeat_interleave(group, 1)
    v = s.values[:ctx].double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.125
    pos = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


SHAPES = {  # heads, kv_heads, head_dim, page_size: row tiles 3, 2+2, 3+2, 1, 3+3+1
    "gqa3_hd64_page16": (9, 3, 64, 16),
    "gqa4_hd32_page5": (8, 2, 32, 5),
    "gqa5_hd16_page16": (5, 1, 16, 16),
    "mha_hd128_page8": (3, 3, 128, 8),
    "gqa7_hd8_page3": (14, 2, 8, 3),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shared_prefix_rows_equal_rows_alone(isa, name: str) -> None:
    heads, kv_heads, head_dim, page = SHAPES[name]
    fam = _family(5, heads, kv_heads, head_dim, seed=len(name))
    other = _family(1, heads, kv_heads, head_dim, seed=99)[0]  # same lengths, its own blocks
    specs = [
        (fam[0], 431 - 1, 1),
        (fam[1], PREFIX + 1, 1),
        (fam[2], 420, 24),  # prefill rows over the shared prefix
        (other, 420, 1),
        (fam[3], 429, 1),
        (fam[4], 420, 1),
    ]
    out = _shared_batch(specs, page, shared_pages=PREFIX // page, private={3})
    for i, spec in enumerate(specs):
        alone = attend_batch([spec], page_size=page, seed=7 + i, impl="cpp")[0]
        assert torch.equal(out[i], alone), (name, i)
        torch.testing.assert_close(out[i].double(), _dense(*spec), rtol=1e-5, atol=1e-5)


def test_thread_count_does_not_change_shared_rows(isa) -> None:
    fam = _family(4, 9, 3, 64, seed=3)
    specs = [(fam[0], 430, 1), (fam[1], 417, 1), (fam[2], 420, 9), (fam[3], 301, 1)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _shared_batch(specs, 16, shared_pages=PREFIX // 16)
    finally:
        torch.set_num_threads(before)
    two = _shared_batch(specs, 16, shared_pages=PREFIX // 16)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def _exact_seq(length: int, heads: int, kv_heads: int, head_dim: int) -> SeqData:
    """Inputs of exactly representable values (integer arithmetic / 64): the same everywhere."""

    def ramp(n, h, mul, mod):
        i = torch.arange(n * h * head_dim, dtype=torch.int64)
        return (((i * mul) % mod) - mod // 2).to(torch.float32).div(64).view(n, h, head_dim)

    return SeqData(
        ramp(length, kv_heads, 37, 101), ramp(length, kv_heads, 53, 97), ramp(length, heads, 29, 89)
    )


# sha256 of the output bytes, computed by the kernel before issue #9 (8f4298d): the row tiles
# and prefetching must leave every bit as it was.
PINNED = "ac824b600c4d5e682f5daaa7dafefc499a9d38237ab0958b17f0c66af62df092"


def test_output_bits_pinned_to_the_original_kernel(isa) -> None:
    seq = _exact_seq(300, 9, 3, 64)
    specs = [(seq, 300, 1), (seq, 257, 1), (seq, 300, 20), (seq, 37, 37)]
    out = torch.cat(_shared_batch(specs, 16, shared_pages=2))
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest() == PINNED
