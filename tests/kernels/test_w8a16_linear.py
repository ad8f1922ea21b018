"""`w8a16_linear`: int8 weights with a scale per output, bf16 activations, AMX bf16 tiles.
Its numbers against float64, bitwise row invariance over every code path (one A tile with two
blocks at a time, row pairs, row chunks with k-blocked panels) and thread count, the refusals;
`w8a16_silu_linear` (a gate/up projection with SiLU(gate) * up in its epilogue) bitwise
`silu_mul` of the plain layer on every path."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import (
    KernelError,
    cpu_build,
    gate_up_order,
    pack_w8a16_gate_up,
    pack_w8a16_weight,
    quantize_channel_weight,
    silu_mul,
    w8a16_available,
    w8a16_linear,
    w8a16_silu_linear,
)

pytestmark = pytest.mark.skipif(not cpu_build.cpu_supported(), reason="needs the C++ kernels")
amx = pytest.mark.skipif(not w8a16_available(), reason="needs AMX-BF16 (the amx variant)")


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scales = quantize_channel_weight(torch.randn(n, k, generator=g) * 0.05)
    return q, scales, pack_w8a16_weight(q, scales)


def _reference(x, q, scales, bias):
    """(float64 of the documented product: bf16(x) . q^T * scale + bias, the bound on the fp32
    sums' distance from it: one rounding per input pair and two in the epilogue, each at most
    2^-24 of the running magnitude, bounded by the sum of |terms|)."""
    xb = x.bfloat16().double()
    terms = xb.abs() @ q.double().abs().T
    ref = (xb @ q.double().T) * scales.double()
    bound = (x.shape[1] / 2 + 3) * 2.0**-24 * terms * scales.double()
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + 2.0**-24 * (ref.abs() + bias.double().abs())
    return ref, bound * 1.01


@amx
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 64, 32),
        (3, 100, 70),
        (16, 130, 96),
        (17, 96, 576),
        (40, 960, 576),
        (300, 70, 1536),
    ],  # fmt: skip
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_documented_arithmetic(m, n, k, with_bias):
    q, scales, packed = _weight(n, k, seed=m)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g) * 3
    bias = torch.randn(n, generator=g) if with_bias else None
    got = w8a16_linear(x, packed, bias)
    assert got.shape == (m, n)
    ref, bound = _reference(x, q, scales, bias)
    assert bool(((got.double() - ref).abs() <= bound).all())
    # x is rounded to bf16: fp32 x against the same weights lies 10x further off (median)
    unrounded = (x.double() @ q.double().T) * scales.double()
    if bias is not None:
        unrounded = unrounded + bias.double()
    near, far = (got.double() - ref).abs(), (got.double() - unrounded).abs()
    assert float(near.median()) * 10 < float(far.median())


SPANS = [(0, 1), (5, 1), (0, 2), (3, 15), (0, 16), (7, 17), (0, 32), (9, 33), (0, 64), (1, 65),
         (0, 256), (100, 300), (0, 600)]  # fmt: skip


@amx
def test_rows_are_bitwise_the_same_in_any_batch_and_thread_count():
    """Row counts through every path: up to 16 (one A tile), 17-32 (row pairs), above (chunks
    of 256 rows; panels of all of K for two row pairs, k blocks of 8 tiles beyond, the sums
    stored and reloaded between them)."""
    _, _, packed = _weight(300, 576, seed=2)
    x = torch.randn(600, 576, generator=torch.Generator().manual_seed(3))
    full = w8a16_linear(x, packed, None)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start, rows in SPANS:
                part = w8a16_linear(x[start : start + rows], packed, None)
                assert torch.equal(part, full[start : start + rows]), (count, start, rows)
    finally:
        torch.set_num_threads(threads)


@amx
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_linear_is_silu_mul_of_the_linear_bitwise(with_bias):
    """Every row path (1, 16: one A tile, two blocks at a time, an odd block last; 17-32: row
    pairs; 33 and up: chunks with k-blocked panels) and both thread counts: SiLU(gate) * up
    from the epilogue has the bits of `w8a16_linear` on [gate; up] followed by `silu_mul`."""
    inter, k = 48, 576  # 3 blocks: small rows take two, then the odd one
    q, scales, plain = _weight(2 * inter, k, seed=4)
    fused = pack_w8a16_gate_up(q, scales)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, k, generator=g) * 3
    bias = torch.randn(2 * inter, generator=g) if with_bias else None
    fused_bias = None if bias is None else bias[gate_up_order(inter)].contiguous()
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 5, 16, 17, 32, 33, 64, 65, 300):
                want = silu_mul(w8a16_linear(x[:rows], plain, bias))
                got = w8a16_silu_linear(x[:rows], fused, fused_bias)
                assert got.shape == (rows, inter)
                assert torch.equal(got, want), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_gate_up_packing_and_its_refusals():
    """Block b of the packed gate/up weight: gate outputs 16b..16b+15, then the same up ones."""
    assert gate_up_order(32).tolist() == [
        *range(16),
        *range(32, 48),
        *range(16, 32),
        *range(48, 64),
    ]
    q, scales, _ = _weight(64, 64)
    fused = pack_w8a16_gate_up(q, scales)
    assert torch.equal(fused.packed[0, 0, 1, 0, 3], q[32 + 3, 0:2])  # block 0's up column 3
    with pytest.raises(KernelError, match="multiple of 16"):
        gate_up_order(24)
    with pytest.raises(KernelError, match="\\[2I, K\\]"):
        pack_w8a16_gate_up(q[:63], scales[:63])
    if w8a16_available():
        _, _, plain = _weight(48, 64)  # 48 columns: not blocks of 16 gates + 16 ups
        with pytest.raises(KernelError, match="not a gate/up weight"):
            w8a16_silu_linear(torch.randn(2, 64), plain, None)


def test_packing_and_bad_arguments_are_refused():
    q, scales, packed = _weight(64, 64)
    assert packed.packed.shape == (2, 2, 2, 16, 16, 2)
    assert torch.equal(packed.packed[1, 0, 1, 3, 5], q[32 + 16 + 5, 6:8])  # column 53, k 6-7
    with pytest.raises(KernelError, match="\\[-127, 127\\]"):
        pack_w8a16_weight(torch.full((64, 64), -128, dtype=torch.int8), scales)
    with pytest.raises(KernelError, match="do not fit"):
        pack_w8a16_weight(q, scales[:1])
    if w8a16_available():
        with pytest.raises(KernelError, match="CPU fp32 rows of 64 features"):
            w8a16_linear(torch.randn(2, 63), packed, None)
    else:
        with pytest.raises(KernelError, match="AMX-BF16"):
            w8a16_linear(torch.randn(2, 64), packed, None)


def test_only_the_amx_variant_runs_it():
    for variant in cpu_build.supported_variants():
        with cpu_build.use_variant(variant):
            assert w8a16_available() == (variant == "amx")
