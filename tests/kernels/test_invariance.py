"""Bitwise batch- and path-invariance of the torch paged attention (model-like shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import SeqData, attend_batch, random_seq

LENGTH = 300


@pytest.fixture(scope="module")
def seq():
    return random_seq(LENGTH, seed=1)


# Every invariance test runs on an fp32 pool and on a bf16 pool (fp32 queries): a 16-bit pool
# is widened on read, so its rows are as invariant as fp32's.
@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def kv_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def full(seq, kv_dtype):
    """All positions in one prefill: the rows every other path must reproduce bitwise."""
    return attend_batch([(seq, LENGTH, LENGTH)], kv_dtype=kv_dtype)[0]


def attend(specs, kv_dtype, **kw):
    return attend_batch(specs, kv_dtype=kv_dtype, **kw)


def test_bf16_pool_equals_fp32_pool_of_its_values(seq) -> None:
    """The torch path on a bf16 pool computes what it computes on the widened fp32 pool."""
    keys, values = (t.to(torch.bfloat16).float() for t in (seq.keys, seq.values))
    wide = SeqData(keys, values, seq.queries)
    for spec in [(seq, LENGTH, LENGTH), (seq, 200, 1), (seq, 130, 7)]:
        (got,) = attend_batch([spec], kv_dtype=torch.bfloat16, impl="torch")
        (want,) = attend_batch([(wide, *spec[1:])], impl="torch")
        assert torch.equal(got, want), spec[1:]


def test_prefill_matches_naive_reference(seq, full, kv_dtype) -> None:
    if kv_dtype != torch.float32:
        pytest.skip("the dense reference reads the fp32 K/V")
    from tests.kernels.helpers import Case, dense_reference

    case = Case(None, [seq.keys], [seq.values], [], seq.queries, None)
    ref = dense_reference(case, [LENGTH], 0.125)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_steps_equal_prefill_rows(seq, full, kv_dtype) -> None:
    # Every position of the first two tiles (partial pages, tile edges), then a sample.
    for pos in list(range(0, 20)) + [126, 127, 128, 129] + list(range(40, LENGTH, 23)):
        (row,) = attend([(seq, pos + 1, 1)], kv_dtype, seed=pos)
        assert torch.equal(row[0], full[pos]), pos


SCHEDULES = {
    "by7": [7] * 43,
    "by22": [22] * 14,  # 22 rows x group 3 > 64: the per-unit path
    "by129": [129] * 3,
    "irregular": [1, 2, 3, 21, 22, 50, 1, 128, 72],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_chunked_prefill_equals_one_shot(seq, full, kv_dtype, name: str) -> None:
    rows, start = [], 0
    for chunk in SCHEDULES[name]:
        end = min(LENGTH, start + chunk)
        rows += attend([(seq, end, end - start)], kv_dtype, seed=start)
        start = end
    assert start == LENGTH
    assert torch.equal(torch.cat(rows), full)


def test_rows_independent_of_other_sequences(seq, full, kv_dtype) -> None:
    others = [random_seq(n, seed=10 + n) for n in (5, 17, 400, 64, 1000)]
    specs = [
        (others[0], 5, 1),
        (seq, 250, 90),  # prefill over a cached prefix, next to decodes and other prefills
        (others[1], 17, 17),
        (others[2], 400, 1),
        (seq, 160, 1),
        (others[3], 64, 30),
        (seq, LENGTH, 6),
        (others[4], 1000, 300),
    ]
    out = attend(specs, kv_dtype, seed=99)
    assert torch.equal(out[1], full[160:250])
    assert torch.equal(out[4], full[159:160])
    assert torch.equal(out[6], full[LENGTH - 6 :])
    alone = [attend([spec], kv_dtype, seed=7)[0] for spec in specs]
    for i, (a, b) in enumerate(zip(out, alone, strict=True)):
        assert torch.equal(a, b), i


def test_thread_count_does_not_change_rows(seq, full, kv_dtype) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend([(seq, LENGTH, LENGTH)], kv_dtype)[0]
        dec = attend([(seq, 200, 1), (seq, 77, 1)], kv_dtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)
    assert torch.equal(dec[0][0], full[199]) and torch.equal(dec[1][0], full[76])
