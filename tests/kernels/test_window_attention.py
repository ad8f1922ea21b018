"""Sliding-window paged attention (`paged_attention(..., window=W)`: the row at position p sees
the keys p - W < k <= p) on every CPU path (C++ fp32 in each ISA variant, the torch path, bf16
on AMX tiles), with Gemma 3's attention shapes (head_dim 256, 4 query heads on one KV head) and
Qwen3's head_dim 128: the explicitly masked reference's values, bitwise batch / chunk / decode /
thread invariance, bitwise full attention where the window covers the context, and no read of
the pages wholly before a window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.kernels import KernelError, bf16_attention_available, cpu_build, paged_attention
from tests.kernels.helpers import Case, attend_batch, make_case, random_seq

# (heads, kv_heads, head_dim, page_size): GQA with small pages (600 keys: three 256-key chunks
# of 64 pages), Gemma 3 (MQA, head_dim 256), MQA at Qwen3's head_dim
SHAPES = [(6, 2, 16, 4), (4, 1, 256, 16), (4, 1, 128, 16)]
LENGTHS = {16: 600, 256: 300, 128: 300}
WINDOWS = [1, 3, 37, 300]  # one key, under a page, across pages, across a chunk edge
SCALE = 0.125
needs_amx = pytest.mark.skipif(not bf16_attention_available(), reason="no AMX-BF16 here")


def shape_id(s) -> str:
    return "h{}kv{}d{}p{}".format(*s)


def impls_for(isa: str) -> tuple[str, ...]:
    """The C++ path in every variant; the torch path (no ISA variants) once."""
    return ("cpp", "torch") if isa == "avx2" else ("cpp",)


def masked_reference(case: Case, query_lens, scale: float, window: int) -> torch.Tensor:
    """float64 attention on the dense K/V with an explicit mask: key k is seen by the row at
    position p iff k <= p and (window == 0 or k > p - window)."""
    outs, at = [], 0
    for k, v, n in zip(case.keys, case.values, query_lens, strict=True):
        q = case.query[at : at + n].double()
        at += n
        ctx, group = k.shape[0], q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, 1)
        vv = v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        qpos = torch.arange(ctx - n, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        seen = kpos <= qpos
        if window:
            seen &= kpos > qpos - window
        s = s.masked_fill(~seen, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


def reference_case(shape, seed=0, dtype=torch.float32) -> tuple[Case, list[int]]:
    heads, kv_heads, head_dim, page = shape
    ctx, n = [45, 290, 5, 33], [45, 12, 1, 1]  # a prefill, a chunk over a prefix, two decodes
    case = make_case(ctx, n, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     page_size=page, seed=seed, dtype=dtype)  # fmt: skip
    return case, n


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_window_values_match_the_masked_reference(isa, shape):
    case, n = reference_case(shape)
    for window in [*WINDOWS, 2, 4, 16, 10_000]:
        want = masked_reference(case, n, SCALE, window)
        for impl in impls_for(isa):
            got = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE, impl=impl,
                                  window=window)  # fmt: skip
            err = float((got.double() - want).abs().max())
            assert err <= 2e-5, (impl, window, err)


def test_window_one_is_the_own_value(isa):
    case, n = reference_case(SHAPES[0])
    got = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE, window=1)
    own = torch.cat([v[v.shape[0] - k :] for v, k in zip(case.values, n, strict=True)])
    assert torch.equal(got, own.repeat_interleave(3, 1))  # p = 1 exactly: 1 * v


def check_invariant(seq, length: int, window: int, attend) -> None:
    """Every row bitwise the same as in one prefill of the whole sequence: prefill chunks
    beside another sequence's decode, decode steps beside another's prefill, one thread."""
    full = attend([(seq, length, length)], seed=1)[0]
    other = random_seq(80, *seq.queries.shape[1:2], *seq.keys.shape[1:], seed=9)
    start = 0
    for size in (37, 100, 1, 19, length):
        end = min(length, start + size)
        got = attend([(other, 50, 1), (seq, end, end - start)], seed=end)[1]
        assert torch.equal(got, full[start:end]), (window, start, end)
        start = end
        if start == length:
            break
    marks = {0, 1, window - 1, window, window + 1, 255, 256, 257, 256 + window, length - 1}
    for pos in sorted(p for p in marks if 0 <= p < length):
        got = attend([(seq, pos + 1, 1), (other, 80, 80)], seed=pos)[0]
        assert torch.equal(got[0], full[pos]), (window, pos)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = attend([(seq, length, length)], seed=2)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full), window


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_window_rows_are_invariant(isa, shape, window):
    heads, kv_heads, head_dim, page = shape
    length = LENGTHS[head_dim]
    seq = random_seq(length, heads, kv_heads, head_dim, seed=4)

    def attend(specs, **kw):
        return attend_batch(specs, page_size=page, window=window, **kw)

    check_invariant(seq, length, window, attend)


def test_torch_path_windows_are_invariant():
    seq = random_seq(300, 6, 2, 16, seed=5)
    for window in (3, 37):

        def attend(specs, w=window, **kw):
            return attend_batch(specs, page_size=4, window=w, impl="torch", **kw)

        check_invariant(seq, 300, window, attend)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_a_window_over_the_whole_context_is_full_attention_bitwise(isa, shape):
    heads, kv_heads, head_dim, page = shape
    length = LENGTHS[head_dim]
    seq = random_seq(length, heads, kv_heads, head_dim, seed=6)
    for impl in impls_for(isa):
        specs = [(seq, length, length), (seq, 200, 1)]
        full = attend_batch(specs, page_size=page, impl=impl)
        for window in (length, 1 << 40):
            got = attend_batch(specs, page_size=page, impl=impl, window=window)
            assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True)), (impl, window)


def poisoned_pool(case: Case, page: int, n: int, window: int, layer: int = 1) -> torch.Tensor:
    """The case's pool with NaN in the pages wholly before the first query row's window (of its
    single sequence): reading any of them would poison the rows."""
    ctx = case.keys[0].shape[0]
    lo = max(0, ctx - n - window + 1)
    pool = case.kv_pool.clone()
    for p in range(lo // page):
        pool[case.tables[0][p], layer] = float("nan")
    return pool


@pytest.mark.parametrize("n", [1, 20])
def test_pages_before_the_window_are_not_read(isa, n):
    heads, kv_heads, head_dim, page = 4, 1, 256, 16
    case = make_case([300], [n], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     page_size=page, seed=7)  # fmt: skip
    for window in (5, 40, 100):
        want = paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE, window=window)
        pool = poisoned_pool(case, page, n, window)
        got = paged_attention(case.query, pool, 1, case.meta, SCALE, impl="cpp", window=window)
        assert torch.equal(got, want), window


def test_bad_windows_are_refused():
    case, _ = reference_case(SHAPES[0])
    for window in (-1, 2.5, "8", None):
        with pytest.raises(KernelError, match="window must be"):
            paged_attention(case.query, case.kv_pool, 1, case.meta, SCALE, window=window)


def test_head_dim_256_and_mqa_take_the_cpp_path():
    from kvrelay.kernels import cpu_paged

    if cpu_build.load() is None:
        pytest.skip("needs the C++ kernels")
    for heads, kv_heads, head_dim in ((4, 1, 256), (4, 1, 128), (16, 8, 128)):
        query = torch.empty(1, heads, head_dim)
        pool = torch.zeros(1, 1, 2, 16, kv_heads, head_dim)
        assert cpu_paged.supports(query, pool)


# ---- bf16 dot products on AMX tiles ----------------------------------------------------------

BF16_SHAPES = [(4, 1, 256, 16), (4, 1, 128, 32), (6, 2, 64, 16)]


@needs_amx
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=shape_id)
def test_bf16_windows_close_to_the_reference_and_invariant(shape):
    heads, kv_heads, head_dim, page = shape
    case, n = reference_case(shape, seed=8, dtype=torch.bfloat16)
    query = case.query.float()
    length = 300
    seq = random_seq(length, heads, kv_heads, head_dim, seed=10)
    for window in (5, 20, 40, 10_000):
        got = paged_attention(query, case.kv_pool, 1, case.meta, SCALE, precision="bf16",
                              window=window)  # fmt: skip
        case_f = Case(case.kv_pool, [k.float() for k in case.keys],
                      [v.float() for v in case.values], case.tables, query, case.meta)  # fmt: skip
        want = masked_reference(case_f, n, SCALE, window)
        assert float((got.double() - want).abs().max()) < 3e-2, window

        def attend(specs, w=window, **kw):
            return attend_batch(specs, page_size=page, kv_dtype=torch.bfloat16,
                                precision="bf16", window=w, **kw)  # fmt: skip

        check_invariant(seq, length, window, attend)
    full = attend_batch([(seq, length, length)], page_size=page, kv_dtype=torch.bfloat16,
                        precision="bf16")  # fmt: skip
    wide = attend_batch([(seq, length, length)], page_size=page, kv_dtype=torch.bfloat16,
                        precision="bf16", window=length)  # fmt: skip
    assert torch.equal(full[0], wide[0])


@needs_amx
@pytest.mark.parametrize("page", [16, 32])  # 16: a window may start mid P.V half
@pytest.mark.parametrize("n", [1, 20])
def test_bf16_pages_before_the_window_are_not_read(n, page):
    heads, kv_heads, head_dim = 4, 1, 256
    case = make_case([300], [n], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     page_size=page, seed=11, dtype=torch.bfloat16)  # fmt: skip
    query = case.query.float()
    for window in (5, 40, 100, 120):
        want = paged_attention(query, case.kv_pool, 1, case.meta, SCALE, precision="bf16",
                               window=window)  # fmt: skip
        pool = poisoned_pool(case, page, n, window)
        got = paged_attention(query, pool, 1, case.meta, SCALE, precision="bf16", window=window)
        assert torch.equal(got, want), window


AVX2_ONLY = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "KVRELAY_KERNELS_ISA": "avx2",
}


@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2", reason="the forced run")
def test_window_invariance_holds_with_every_library_held_to_avx2():
    """The windowed invariance checks (torch path, C++ avx2 variant, the Gemma 3 decoder) again
    with torch's own kernels held to AVX2, as an AVX2-only host runs them (the `isa` fixture
    already runs our kernels' avx2 variant here; this also holds MKL/oneDNN to AVX2)."""
    root = Path(__file__).resolve().parents[2]
    select = "torch_path_windows or (avx2 and (invariant or loops_bits or whole_context))"
    files = [str(root / "tests" / "kernels" / f)
             for f in ("test_window_attention.py", "test_gemma3_kernels.py")]  # fmt: skip
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, *files]
    done = subprocess.run(args, env={**os.environ, **AVX2_ONLY}, cwd=root, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
