"""Bitwise batch- and path-invariance of the torch paged attention (model-like shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import attend_batch, random_seq

LENGTH = 300


@pytest.fixture(scope="module")
def seq():
    return random_seq(LENGTH, seed=1)


@pytest.fixture(scope="module")
def full(seq):
    """All positions in one prefill: the rows every other path must reproduce bitwise."""
    return attend_batch([(seq, LENGTH, LENGTH)])[0]


def test_prefill_matches_naive_reference(seq, full) -> None:
    from tests.kernels.helpers import Case, dense_reference

    case = Case(None, [seq.keys], [seq.values], [], seq.queries, None)
    ref = dense_reference(case, [LENGTH], 0.125)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_steps_equal_prefill_rows(seq, full) -> None:
    # Every position of the first two tiles (partial pages, tile edges), then a sample.
    for pos in list(range(0, 20)) + [126, 127, 128, 129] + list(range(40, LENGTH, 23)):
        (row,) = attend_batch([(seq, pos + 1, 1)], seed=pos)
        assert torch.equal(row[0], full[pos]), pos


SCHEDULES = {
    "by7": [7] * 43,
    "by22": [22] * 14,  # 22 rows x group 3 > 64: the per-unit path
    "by129": [129] * 3,
    "irregular": [1, 2, 3, 21, 22, 50, 1, 128, 72],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_chunked_prefill_equals_one_shot(seq, full, name: str) -> None:
    rows, start = [], 0
    for chunk in SCHEDULES[name]:
        end = min(LENGTH, start + chunk)
        rows += attend_batch([(seq, end, end - start)], seed=start)
        start = end
    assert start == LENGTH
    assert torch.equal(torch.cat(rows), full)


def test_rows_independent_of_other_sequences(seq, full) -> None:
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
    out = attend_batch(specs, seed=99)
    assert torch.equal(out[1], full[160:250])
    assert torch.equal(out[4], full[159:160])
    assert torch.equal(out[6], full[LENGTH - 6 :])
    alone = [attend_batch([spec], seed=7)[0] for spec in specs]
    for i, (a, b) in enumerate(zip(out, alone, strict=True)):
        assert torch.equal(a, b), i


def test_thread_count_does_not_change_rows(seq, full) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend_batch([(seq, LENGTH, LENGTH)])[0]
        dec = attend_batch([(seq, 200, 1), (seq, 77, 1)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)
    assert torch.equal(dec[0][0], full[199]) and torch.equal(dec[1][0], full[76])
