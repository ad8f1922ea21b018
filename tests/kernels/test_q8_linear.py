"""`q8_linear`: llama.cpp's Q8_0 x Q8_0 arithmetic, the same bits on every path and variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrelay.kernels import (
    KernelError,
    cpu_build,
    pack_q8_weight,
    q8_linear,
    q8_path,
    quantize_int8_weight,
)

pytestmark = pytest.mark.skipif(not cpu_build.cpu_supported(), reason="needs the C++ kernels")


def _reference(x: torch.Tensor, q: torch.Tensor, wd: torch.Tensor, bias) -> np.ndarray:
    """The documented arithmetic in numpy: fp32 quantization, exact int64 block sums, and each
    block's fp32 FMA (a * b exact in float64, one rounding of the sum to fp32)."""
    m, k = x.shape
    n = q.shape[0]
    blocks = -(-k // 32)
    xp = np.zeros((m, blocks * 32), np.float32)
    xp[:, :k] = x.numpy()
    qp = np.zeros((n, blocks * 32), np.int64)
    qp[:, :k] = q.numpy()
    xb = xp.reshape(m, blocks, 32)
    xd = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    div = np.where(xd != 0, xd, np.float32(1)).astype(np.float32)
    xq = np.rint((xb / div[:, :, None]).astype(np.float32)).astype(np.int64)
    assert np.abs(xq).max() <= 127
    y = np.zeros((m, n), np.float32)
    wdn = wd.numpy().astype(np.float32)
    for b in range(blocks):
        isum = xq[:, b, :] @ qp[:, b * 32 : (b + 1) * 32].T
        s = (wdn[None, :, b] * xd[:, b, None]).astype(np.float32)
        y = (isum.astype(np.float32).astype(np.float64) * s + y).astype(np.float32)
    if bias is not None:
        y = (y + bias.numpy()).astype(np.float32)
    return y


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scales = quantize_int8_weight(w)
    return q, scales, pack_q8_weight(q, scales)


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (3, 100, 70), (17, 130, 96), (40, 960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_documented_arithmetic(isa, m, n, k, with_bias):
    q, scales, packed = _weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[0, :5] = 0.0  # a zero block part and, below, a whole zero block
    if k >= 64:
        x[-1, 32:64] = 0.0
    bias = torch.randn(n) if with_bias else None
    got = q8_linear(x, packed, bias).numpy()
    want = _reference(x, q, scales, bias)
    # The float64 FMA stand-in can differ from a true FMA by one double rounding, rarely.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (got == want).mean() > 0.99


def test_rows_are_bitwise_the_same_in_any_batch_and_thread_count(isa):
    _, _, packed = _weight(300, 576, seed=2)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(3))
    full = q8_linear(x, packed, None)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 8, 15, 16, 17, 33, 70):
                part = q8_linear(x[:rows], packed, None)
                assert torch.equal(part, full[:rows]), (count, rows)
            assert torch.equal(q8_linear(x[5:6], packed, None), full[5:6])
            assert torch.equal(q8_linear(x[20:52], packed, None), full[20:52])
    finally:
        torch.set_num_threads(threads)


def test_every_variant_gives_the_same_bits():
    _, _, packed = _weight(200, 1536, seed=4)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(5)) * 3
    results = {}
    for variant in cpu_build.supported_variants():
        with cpu_build.use_variant(variant):
            results[variant] = [q8_linear(x[:rows], packed, None) for rows in (1, 2, 7, 16, 40)]
            results[variant + " paths"] = [q8_path(rows) for rows in (1, 16)]
    base = results["avx2"]
    for variant in cpu_build.supported_variants():
        for a, b in zip(results[variant], base, strict=True):
            assert torch.equal(a, b), variant
    assert results["avx2 paths"] == ["avx2", "avx2"]
    if "amx" in results:
        assert results["amx paths"] == ["vnni", "amx"]


def test_extreme_activations_stay_in_range(isa):
    q, scales, packed = _weight(64, 64, seed=6)
    x = torch.zeros(2, 64)
    x[0, 0] = 3.0e38  # the block's scale is near the fp32 maximum
    x[0, 1] = -3.0e38
    x[1, 33] = 1e-40  # a subnormal alone in its block
    got = q8_linear(x, packed, None)
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), _reference(x, q, scales, None), rtol=1e-6)


def test_bad_arguments_are_refused():
    q, scales, packed = _weight(64, 64)
    with pytest.raises(KernelError, match="CPU fp32 rows of 64 features"):
        q8_linear(torch.randn(2, 63), packed, None)
    with pytest.raises(KernelError, match="\\[-127, 127\\]"):
        pack_q8_weight(torch.full((64, 64), -128, dtype=torch.int8), scales)
    with pytest.raises(KernelError, match="do not fit"):
        pack_q8_weight(q, scales[:, :1])
