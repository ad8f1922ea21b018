"""bf16 attention on AMX tiles (`precision="bf16"`): close to fp32 attention, and bitwise the same
row in any batch, chunking, decode or prefill, shared prefix or not, and thread count; refused
where it cannot run, with the reason."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import (
    KernelError,
    bf16_attention_available,
    cpu_build,
    paged_attention,
    write_kv,
)
from tests.kernels.helpers import SeqData, attend_batch, build_meta, random_seq

LENGTH = 300  # two 256-key chunks (the second partial), pages of 16 and 32
needs_amx = pytest.mark.skipif(
    not bf16_attention_available(), reason="no AMX-BF16 here: the refusal tests run instead"
)
# (heads, kv_heads, head_dim, page_size): the model's shape, MHA with 32-key pages, GQA 4 at 128
SHAPES = [(9, 3, 64, 16), (8, 8, 32, 32), (8, 2, 128, 16)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "h{}kv{}d{}p{}".format(*s))
def shape(request):
    return request.param


@pytest.fixture(scope="module")
def seq(shape):
    heads, kv_heads, head_dim, _ = shape
    return random_seq(LENGTH, heads, kv_heads, head_dim, seed=3)


def attend(shape, specs, **kw):
    kw.setdefault("seed", 0)
    return attend_batch(specs, page_size=shape[3], kv_dtype=torch.bfloat16, precision="bf16", **kw)


@pytest.fixture(scope="module")
def full(shape, seq):
    """Every position in one prefill: the rows every other path must give bitwise."""
    return attend(shape, [(seq, LENGTH, LENGTH)])[0]


@needs_amx
def test_close_to_fp32_attention_on_the_same_pages(shape, seq, full) -> None:
    (exact,) = attend_batch([(seq, LENGTH, LENGTH)], page_size=shape[3], kv_dtype=torch.bfloat16)
    # q and p rounded to bf16 (8 bits of mantissa): errors of a few 1e-3 on unit-scale outputs
    err = (full - exact).abs()
    assert float(err.max()) < 3e-2 and float(err.mean()) < 3e-3
    assert not torch.equal(full, exact)  # it is another computation, not fp32 relabelled


@needs_amx
def test_decode_steps_equal_prefill_rows(shape, seq, full) -> None:
    for pos in [*range(0, 20), 31, 32, 63, 64, 65, 127, 128, 255, 256, 257, LENGTH - 1]:
        (row,) = attend(shape, [(seq, pos + 1, 1)], seed=pos)
        assert torch.equal(row[0], full[pos]), pos


@needs_amx
@pytest.mark.parametrize("chunks", [[7] * 43, [22] * 14, [129] * 3, [1, 2, 3, 21, 50, 1, 222]])
def test_chunked_prefill_equals_one_shot(shape, seq, full, chunks) -> None:
    rows, start = [], 0
    for chunk in chunks:
        end = min(LENGTH, start + chunk)
        rows += attend(shape, [(seq, end, end - start)], seed=start)
        start = end
    assert start == LENGTH
    assert torch.equal(torch.cat(rows), full)


@needs_amx
def test_rows_independent_of_other_sequences(shape, seq, full) -> None:
    heads, kv_heads, head_dim, _ = shape
    others = [random_seq(n, heads, kv_heads, head_dim, seed=10 + n) for n in (5, 17, 400, 64)]
    specs = [
        (others[0], 5, 1),
        (seq, 250, 90),  # a prefill over a cached prefix next to decodes and other prefills
        (others[1], 17, 17),
        (others[2], 400, 1),
        (seq, 160, 1),
        (others[3], 64, 30),
        (seq, LENGTH, 6),
    ]
    out = attend(shape, specs, seed=99)
    assert torch.equal(out[1], full[160:250])
    assert torch.equal(out[4], full[159:160])
    assert torch.equal(out[6], full[LENGTH - 6 :])
    for i, spec in enumerate(specs):
        assert torch.equal(out[i], attend(shape, [spec], seed=7)[0]), i


@needs_amx
def test_thread_count_does_not_change_rows(shape, seq, full) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(shape, [(seq, LENGTH, LENGTH)])[0]
        dec = attend(shape, [(seq, 200, 1), (seq, 77, 1)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)
    assert torch.equal(dec[0][0], full[199]) and torch.equal(dec[1][0], full[76])


@needs_amx
def test_shared_prefix_rows_equal_rows_alone(shape) -> None:
    """Sequences whose first pages are the same blocks share one pass over them (one item)."""
    heads, kv_heads, head_dim, page_size = shape
    base = random_seq(LENGTH, heads, kv_heads, head_dim, seed=5)
    shared = LENGTH // page_size * page_size  # whole shared pages
    tails = [random_seq(LENGTH, heads, kv_heads, head_dim, seed=20 + i) for i in range(3)]
    seqs = [
        SeqData(
            torch.cat([base.keys[:shared], t.keys[shared:]]),
            torch.cat([base.values[:shared], t.values[shared:]]),
            t.queries,
        )
        for t in tails
    ]
    pages = -(-LENGTH // page_size)
    common = list(range(1, shared // page_size + 1))
    nxt = len(common) + 1
    tables = []
    for _ in seqs:
        own = list(range(nxt, nxt + pages - len(common)))
        nxt += len(own)
        tables.append(common + own)
    pool = torch.randn(nxt, 1, 2, page_size, kv_heads, head_dim).to(torch.bfloat16)
    for s, t in zip(seqs, tables, strict=True):
        meta = build_meta([t], [LENGTH], [LENGTH], page_size)
        write_kv(pool, 0, s.keys, s.values, meta.slot_mapping)
    meta = build_meta(tables, [LENGTH] * 3, [1] * 3, page_size)
    query = torch.cat([s.queries[LENGTH - 1 :] for s in seqs])
    together = paged_attention(query, pool, 0, meta, 0.125, precision="bf16")
    for i, s in enumerate(seqs):
        (alone,) = attend(shape, [(s, LENGTH, 1)], seed=i)
        assert torch.equal(together[i], alone[0]), i


@needs_amx
@pytest.mark.parametrize(
    ("pool_dtype", "page_size", "head_dim", "says"),
    [
        (torch.float32, 16, 64, "bfloat16 KV pool"),
        (torch.bfloat16, 8, 64, "multiple of 16"),
        (torch.bfloat16, 16, 16, "head_dim 32, 64, 128 or 256"),
        (torch.bfloat16, 16, 96, "head_dim 32, 64, 128 or 256"),
    ],
)
def test_shapes_it_cannot_run_are_refused(pool_dtype, page_size, head_dim, says) -> None:
    seq = random_seq(40, 4, 2, head_dim, seed=1)
    with pytest.raises(KernelError, match=says):
        attend_batch([(seq, 40, 40)], page_size=page_size, kv_dtype=pool_dtype, precision="bf16")


@pytest.mark.skipif(bf16_attention_available(), reason="AMX-BF16 here: the tests above run")
def test_refused_without_amx_bf16() -> None:
    seq = random_seq(40, 9, 3, 64, seed=1)
    with pytest.raises(KernelError, match="amx build"):
        attend_batch([(seq, 40, 40)], kv_dtype=torch.bfloat16, precision="bf16")


def test_unknown_precision_is_refused() -> None:
    seq = random_seq(8, 9, 3, 64, seed=1)
    with pytest.raises(KernelError, match="precision must be one of"):
        attend_batch([(seq, 8, 8)], kv_dtype=torch.bfloat16, precision="fp8")


@needs_amx
def test_the_avx2_build_refuses_it() -> None:
    """Only the amx build has the tile code: the others say so rather than compute other bits."""
    avx2 = cpu_build.load_variant("avx2")
    assert avx2 is not None and not avx2.bf16_attention_available()
