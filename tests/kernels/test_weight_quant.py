"""The C++ weight quantization: `quantize_int8_weight` and `quantize_channel_weight` give the
torch code's bits (q and scales) on each ISA variant: odd shapes, magnitudes from subnormal to
1e30, zero rows and blocks, exact .5 ties, the clamp edge, inf and NaN weights."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import cpu_build, ops
from kvrelay.kernels.ops import quantize_channel_weight, quantize_int8_weight

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )

# (N, K): K < 32, one block, a block and one, not a multiple of 32, one row, a model's row
# width, N large (several threads' chunks of rows)
SHAPES = ((1, 1), (3, 5), (4, 31), (2, 32), (5, 33), (7, 100), (1, 896), (64, 4099), (3000, 40))
QMAX = (127, 63, 1)
# inf, -inf, the default NaN, a signaling NaN with a payload, a negative signaling NaN
NONFINITE_BITS = (0x7F800000, -0x00800000, 0x7FC00000, 0x7FA00001, -0x00400001)
NONFINITE = torch.tensor(NONFINITE_BITS, dtype=torch.int32).view(torch.float32)


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Random weights: each row its own magnitude (1e-45 .. 1e30), values spread over several
    orders within a row; every 5th row zero, and where K allows the second block of every
    row zero and the third 1e-13-sized (below the 1e-12 clamp)."""
    g = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** torch.randint(-20, 10, (n, 1), generator=g).float()
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, k, generator=g) * 2)
    w = w * row_scale
    if n > 2:
        w[1] = torch.randn(k, generator=g) * 1e-42  # subnormal
        w[2] = torch.randn(k, generator=g) * 1e30
    w[::5] = 0
    if k > 64:
        w[:, 32:64] = 0
    if k > 96:
        w[:, 64:96] = torch.randn(n, 32, generator=g) * 1e-13
    return w


def ties(n: int, k: int, qmax: int, seed: int) -> torch.Tensor:
    """Rows whose every group of 32 (a block) holds qmax * s (so its scale is exactly s =
    c * 2^e, c a small odd integer) and values (m + 0.5) * s for |m + 0.5| < qmax: each
    w / scale lands exactly on a .5 (rounded to even), and qmax * s on the clamp edge."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 20, (n, 1), generator=g) * 2 + 1
    e = torch.randint(-30, 10, (n, 1), generator=g)
    s = c.double() * torch.pow(2.0, e.double())
    m = torch.randint(-qmax, qmax, (n, k), generator=g).double()
    w = (m + 0.5) * s
    w[:, ::32] = qmax * s * torch.where(torch.rand(n, 1, generator=g) < 0.5, 1.0, -1.0)
    return w.float()


def assert_same(got, want) -> None:
    (q, scales), (q_ref, scales_ref) = got, want
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert q.shape == q_ref.shape and scales.shape == scales_ref.shape
    assert torch.equal(q, q_ref), f"{int((q != q_ref).sum())} q differ"
    bits, bits_ref = scales.view(torch.int32), scales_ref.view(torch.int32)
    assert torch.equal(bits, bits_ref), f"{int((bits != bits_ref).sum())} scales differ"


@pytest.fixture
def cpp_only(monkeypatch):
    """Inside the test the torch code raises: the public functions must take the C++ path."""

    def torch_path(*args):
        raise AssertionError("the torch path ran")

    refs = (ops._quantize_int8_weight_torch, ops._quantize_channel_weight_torch)
    monkeypatch.setattr(ops, "_quantize_int8_weight_torch", torch_path)
    monkeypatch.setattr(ops, "_quantize_channel_weight_torch", torch_path)
    return refs


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda v: str(v))
def test_torch_bits(isa, cpp_only, n, k):
    int8_ref, channel_ref = cpp_only
    w = weights(n, k, seed=n * 10_000 + k)
    assert_same(quantize_int8_weight(w), int8_ref(w))
    for qmax in QMAX:
        assert_same(quantize_channel_weight(w, qmax), channel_ref(w, qmax))


@pytest.mark.parametrize(("n", "k"), ((3, 5), (5, 33), (6, 100), (40, 4099)), ids=str)
def test_exact_ties_and_the_clamp_edge(isa, cpp_only, n, k):
    int8_ref, channel_ref = cpp_only
    w = ties(n, k, 127, seed=k)
    q, _ = int8_ref(w)
    assert int(q.abs().max()) == 127 and bool((q % 2 == 0).sum() > q.numel() // 2)
    assert_same(quantize_int8_weight(w), int8_ref(w))
    for qmax in QMAX:
        w = ties(n, k, qmax, seed=k + qmax)
        assert_same(quantize_channel_weight(w, qmax), channel_ref(w, qmax))
        q, _ = channel_ref(w, qmax)
        assert int(q.abs().max()) == qmax


@pytest.mark.parametrize(("n", "k"), ((2, 7), (6, 100), (64, 4099)), ids=str)
def test_inf_and_nan_weights(isa, cpp_only, n, k):
    """torch's bits: a block (row) with inf gets the scale inf, one with NaN (a signaling or a
    negative one too) the default NaN; their q are all 0; the other blocks are untouched."""
    int8_ref, channel_ref = cpp_only
    g = torch.Generator().manual_seed(k)
    w = weights(n, k, seed=k)
    at = torch.rand(n, k, generator=g) < 0.003
    at[0, 0] = at[-1, -1] = True
    w[at] = NONFINITE[torch.randint(0, len(NONFINITE), (int(at.sum()),), generator=g)]
    q, scales = quantize_int8_weight(w)
    assert_same((q, scales), int8_ref(w))
    assert int(q[0, : min(k, 32)].abs().sum()) == 0 and not bool(scales[0, 0].isfinite())
    for qmax in QMAX:
        assert_same(quantize_channel_weight(w, qmax), channel_ref(w, qmax))


def test_other_dtypes_layouts_and_parameters(isa, cpp_only):
    """bf16, fp16 and float64 weights, a transposed one, an nn.Parameter: as the torch code
    (which quantizes `weight.detach().float()`)."""
    int8_ref, channel_ref = cpp_only
    w = weights(50, 130, seed=3)
    for v in (
        w.bfloat16(),
        w.clamp(-6e4, 6e4).half(),
        w.double() * 1.0000001,
        weights(130, 50, seed=4).t(),
        torch.nn.Parameter(w.clone()),
    ):
        assert_same(quantize_int8_weight(v), int8_ref(v))
        assert_same(quantize_channel_weight(v, 63), channel_ref(v, 63))


def test_empty_weights_take_the_torch_path():
    w = torch.zeros(3, 0)
    assert_same(quantize_int8_weight(w), ops._quantize_int8_weight_torch(w))
    w = torch.zeros(0, 40)
    assert_same(quantize_channel_weight(w), ops._quantize_channel_weight_torch(w))


def test_the_extension_refuses_bad_arguments():
    ext = cpu_build.load()
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        ext.quantize_int8_weight(torch.zeros(4, 64).t())
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        ext.quantize_channel_weight(torch.zeros(4, 64, dtype=torch.float64), 127)
    for qmax in (0, 128, 2**32 + 1):
        with pytest.raises(ValueError, match=rf"qmax must lie in \[1, 127\], got {qmax}$"):
            ext.quantize_channel_weight(torch.zeros(4, 64), qmax)


def test_any_thread_count_gives_the_same_bits():
    w = weights(3000, 40, seed=9)
    want = ops._quantize_int8_weight_torch(w), ops._quantize_channel_weight_torch(w)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert_same(quantize_int8_weight(w), want[0])
            assert_same(quantize_channel_weight(w), want[1])
    finally:
        torch.set_num_threads(threads)
