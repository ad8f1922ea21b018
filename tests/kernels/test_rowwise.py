"""The C++ row-wise ops (RMSNorm, residual add + RMSNorm, SiLU * up, int8 row quantization)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import add_rms_norm, cpu_build, quantize_rows, rms_norm, silu_mul

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )

EPS = 1e-5


def rows(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("dim", [576, 1000, 5])  # full 8-lane vectors, a tail, only a tail
def test_rms_norm_matches_torch_and_each_row_stands_alone(isa, dim):
    x, w = rows(300, dim, 1), rows(1, dim, 2)[0]
    out = rms_norm(x, w, EPS)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, EPS), rtol=1e-6, atol=1e-5)
    for start, n in ((0, 1), (7, 3), (100, 200)):  # 200 rows split across threads
        assert torch.equal(rms_norm(x[start : start + n], w, EPS), out[start : start + n])


def test_add_rms_norm_adds_in_place_exactly_then_normalizes(isa):
    x, d, w = rows(40, 576, 3), rows(40, 576, 4), rows(1, 576, 5)[0]
    residual = x.clone()
    out = add_rms_norm(residual, d, w, EPS)
    assert torch.equal(residual, x + d)
    assert torch.equal(out, rms_norm(x + d, w, EPS))
    with pytest.raises(Exception, match="must match"):
        add_rms_norm(x.clone(), d[:3], w, EPS)


def test_silu_mul_matches_torch_and_each_row_stands_alone(isa):
    gu = rows(64, 2 * 1536, 6)
    out = silu_mul(gu)
    assert out.shape == (64, 1536)
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(silu_mul(gu[5:6]), out[5:6])


def test_quantize_rows_is_bitwise_the_torch_formula(isa):
    x = rows(33, 576, 7)
    x[3] = 0.0  # an all-zero row: scale 1e-30 / 127, every value at the zero point
    x[4, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0, -127.0, 63.5])  # ties round even
    q, scale = quantize_rows(x, 127, 128)
    ref_scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q, torch.round(x / ref_scale).add_(128).to(torch.uint8))
    assert q.dtype == torch.uint8 and q[3].eq(128).all()
