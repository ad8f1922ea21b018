"""Torch kernel ops against a dense float64 causal attention and against plain indexing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import (
    KernelError,
    add_rms_norm,
    gather_pages,
    linear,
    paged_attention,
    rms_norm,
    scatter_pages,
    write_kv,
)
from tests.kernels.helpers import build_meta, dense_reference, make_case, make_pool

SCALE = 0.25

CASES = {
    "decode_ragged": ([1, 4, 5, 9, 16, 23], [1, 1, 1, 1, 1, 1]),
    "prefill_fresh": ([7, 12, 1], [7, 12, 1]),
    "prefill_over_prefix": ([13, 9, 20], [5, 9, 3]),
    "mixed": ([30, 2, 17, 8], [1, 2, 6, 1]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_matches_dense(name: str) -> None:
    ctx, qlen = CASES[name]
    case = make_case(ctx, qlen)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE)
    ref = dense_reference(case, qlen, SCALE)
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_attention_mha_and_long_context() -> None:
    ctx, qlen = [70, 33], [40, 1]
    case = make_case(ctx, qlen, heads=4, kv_heads=4, head_dim=8, page_size=16, seed=3)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.3)
    torch.testing.assert_close(out.double(), dense_reference(case, qlen, 0.3), rtol=1e-5, atol=1e-5)


def test_bfloat16_pool_and_query() -> None:
    ctx, qlen = [30, 7], [10, 1]
    case = make_case(ctx, qlen, dtype=torch.bfloat16)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE)
    assert out.dtype == torch.bfloat16
    # The reference sees the same bf16 inputs; only the output rounding to bf16 differs.
    ref = dense_reference(case, qlen, SCALE)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_write_kv_places_tokens_and_skips_negative_slots() -> None:
    pool = make_pool(3, 2, 4, 1, 2)
    key = torch.arange(1, 7, dtype=torch.float32).reshape(3, 1, 2)
    value = -key
    write_kv(pool, 1, key, value, torch.tensor([9, -1, 2]))
    assert pool[2, 1, 0, 1].tolist() == [[1.0, 2.0]]
    assert pool[2, 1, 1, 1].tolist() == [[-1.0, -2.0]]
    assert pool[0, 1, 0, 2].tolist() == [[5.0, 6.0]]
    assert pool[0, 1, 1, 2].tolist() == [[-5.0, -6.0]]
    assert int((pool != 0).sum()) == 8  # the skipped token (3, 4) is nowhere
    assert pool[:, 0].abs().sum() == 0


def test_gather_scatter_round_trip() -> None:
    pool = torch.randn(5, 2, 2, 4, 1, 3)
    ids = torch.tensor([3, 0, 3])
    pages = gather_pages(pool, ids)
    assert pages.is_contiguous() and pages.shape == (3, 2, 2, 4, 1, 3)
    assert torch.equal(pages[0], pool[3]) and torch.equal(pages[1], pool[0])
    pages[0] += 1  # a copy: the pool does not change
    assert torch.equal(pages[2], pool[3])
    other = torch.zeros_like(pool)
    scatter_pages(other, torch.tensor([4, 1]), gather_pages(pool, torch.tensor([0, 2])))
    assert torch.equal(other[4], pool[0]) and torch.equal(other[1], pool[2])
    assert other[[0, 2, 3]].abs().sum() == 0


def test_bad_input_raises_clear_errors() -> None:
    pool = make_pool(2, 1, 4, 2, 8)
    meta = build_meta([[0]], [3], [3], 4)
    with pytest.raises(KernelError, match="layer 1 out of range"):
        write_kv(pool, 1, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), meta.slot_mapping)
    with pytest.raises(KernelError, match="key/value must be"):
        write_kv(pool, 0, torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), meta.slot_mapping)
    with pytest.raises(KernelError, match="multiple of kv heads"):
        paged_attention(torch.zeros(3, 3, 8), pool, 0, meta, 1.0)
    with pytest.raises(KernelError, match="impl must be"):
        paged_attention(torch.zeros(3, 2, 8), pool, 0, meta, 1.0, impl="cuda")
    with pytest.raises(KernelError, match="pages must be"):
        scatter_pages(pool, torch.tensor([0]), torch.zeros(1, 1, 2, 4, 2, 4))
    with pytest.raises(KernelError, match="slot 8 outside the pool's 8 slots"):
        write_kv(pool, 0, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.tensor([8]))
    with pytest.raises(KernelError, match=r"block ids? \[?5\]? outside the pool of 2"):
        paged_attention(torch.zeros(3, 2, 8), pool, 0, build_meta([[5]], [3], [3], 4), 1.0)
    too_long = build_meta([[0]], [3], [3], 4)
    too_long.context_lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(KernelError, match="exceeds its block table"):
        paged_attention(torch.zeros(3, 2, 8), pool, 0, too_long, 1.0)
    with pytest.raises(KernelError, match="4 query rows but context length 3"):
        paged_attention(torch.zeros(4, 2, 8), pool, 0, build_meta([[0]], [3], [4], 4), 1.0)
    wide = make_pool(2, 1, 4, 2, 8, torch.float64)
    message = "kv_pool dtype must be float32, bfloat16 or float16, got torch.float64"
    with pytest.raises(KernelError, match=message):
        paged_attention(torch.zeros(3, 2, 8), wide, 0, meta, 1.0)
    with pytest.raises(KernelError, match=message):
        write_kv(wide, 0, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), meta.slot_mapping)


def test_linear_and_rms_norm_off_cuda_are_the_torch_ops() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w, impl="torch"), F.linear(x, w))
    norm = torch.randn(8, generator=g)
    assert torch.equal(rms_norm(x, norm, 1e-5, impl="torch"), F.rms_norm(x, (8,), norm, 1e-5))
    residual = x.clone()
    out = add_rms_norm(residual, x, norm, 1e-5, impl="torch")
    assert torch.equal(residual, 2 * x) and torch.equal(out, F.rms_norm(2 * x, (8,), norm, 1e-5))
    with pytest.raises(KernelError, match="need x"):
        linear(x, w[:, :7])
    with pytest.raises(KernelError, match="no C\\+\\+ path"):
        linear(x, w, impl="cpp")
    with pytest.raises(KernelError, match="impl must be"):
        rms_norm(x, norm, 1e-5, impl="cuda")


def test_sequence_without_query_rows_is_skipped() -> None:
    ctx, qlen = [9, 6, 11], [2, 0, 3]
    case = make_case(ctx, qlen)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE)
    ref = dense_reference(case, qlen, SCALE)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_use_does_not_import_triton() -> None:
    code = (
        "import sys, torch\n"
        "from kvrelay.kernels import gather_pages\n"
        "from kvrelay.kernels import add_rms_norm, linear, rms_norm\n"
        "gather_pages(torch.zeros(2, 1, 2, 4, 1, 8), torch.tensor([1]))\n"
        "x = torch.ones(3, 8)\n"
        "linear(x, torch.ones(4, 8), None); rms_norm(x, x[0], 1e-5)\n"
        "add_rms_norm(x, x, x[0], 1e-5)\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
