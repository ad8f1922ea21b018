"""The C++ int8-weight linear layer: fp32 sums of int8 weights, rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import (
    KernelError,
    cpu_build,
    int8_linear,
    pack_int8_weight,
    quantize_int8_weight,
)

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )


def layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 q [n, k], scales [n, ceil(k / 32)], bias [n])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, -(-k // 32), generator=g) * 0.01 + 1e-3
    return q, scales, torch.randn(n, generator=g)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    per_k = scales.double().repeat_interleave(32, dim=1)[:, : q.shape[1]]
    return q.double() * per_k


def test_quantize_keeps_each_block_of_32_within_half_a_step():
    w = torch.randn(5, 70, generator=torch.Generator().manual_seed(3))
    w[2, 40] = 50.0  # an outlier widens only its own block's step
    q, scales = quantize_int8_weight(w)
    assert q.shape == (5, 70) and scales.shape == (5, 3)
    assert int(q.abs().max()) == 127
    err = (dequantize(q, scales) - w.double()).abs()
    assert bool((err <= scales.double().repeat_interleave(32, 1)[:, :70] / 2 + 1e-9).all())
    assert float(err[2, :32].max()) < 0.02 and float(err[2, 64:].max()) < 0.02


def test_packing_puts_64_columns_of_one_k_side_by_side():
    q = torch.arange(130 * 3, dtype=torch.int32).remainder(251).sub(125).to(torch.int8).view(130, 3)
    scales = torch.arange(130, dtype=torch.float32).view(130, 1)
    w = pack_int8_weight(q, scales)
    assert w.packed.shape == (3, 3, 64)  # 130 columns -> 3 groups, the last padded with zeros
    assert w.scales.shape == (3, 1, 64) and float(w.scales[1, 0, 5]) == 69.0
    assert torch.equal(w.packed[1, 2, 5], q[64 + 5, 2])
    assert torch.equal(w.packed[2, :, 2:], torch.zeros(3, 62, dtype=torch.int8))
    with pytest.raises(KernelError, match="2-D int8 weight"):
        pack_int8_weight(q.float(), scales)
    with pytest.raises(KernelError, match="do not fit"):
        pack_int8_weight(q, scales[:, :0])


# (start, rows): 1 row, 2 rows and 3+ rows take different tile shapes (the avx512 variant: 1-2
# rows, up to 95 rows and more rows take three other tilings), all with the same bits.
SLICES = ((0, 1), (3, 1), (5, 2), (1, 3), (2, 7), (9, 13), (0, 64), (30, 100))


# N: whole groups, a partial last group, less than one sub-block; K: blocks of 32, a partial
# last block, less than one block.
@pytest.mark.parametrize(("n", "k"), [(192, 576), (100, 37), (7, 20)])
def test_matches_float64_and_each_row_stands_alone(isa, n, k):
    q, scales, bias = layer(n, k, n + k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(1)) * 3
    w = pack_int8_weight(q, scales)
    full = int8_linear(x, w, bias)
    ref = x.double() @ dequantize(q, scales).T + bias.double()
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(int8_linear(x, w, None) + bias, full, rtol=0, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert torch.equal(int8_linear(x, w, bias), full)
            for start, rows in SLICES:
                part = int8_linear(x[start : start + rows], w, bias)
                assert torch.equal(part, full[start : start + rows])
    finally:
        torch.set_num_threads(threads)


def test_refuses_what_it_cannot_compute():
    q, scales, bias = layer(64, 32, 0)
    w = pack_int8_weight(q, scales)
    with pytest.raises(KernelError, match="rows of 32 features"):
        int8_linear(torch.randn(2, 31), w, bias)
    with pytest.raises(KernelError, match="CPU fp32 rows"):
        int8_linear(torch.randn(2, 32, dtype=torch.float64), w, bias)


def test_no_rows_give_no_rows():
    q, scales, bias = layer(100, 37, 5)
    out = int8_linear(torch.empty(0, 37), pack_int8_weight(q, scales), bias)
    assert out.shape == (0, 100)
