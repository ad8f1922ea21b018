"""The C++ CPU kernels: against the torch reference, bitwise invariance, exact KV writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvrelay.kernels import (
    KernelError,
    cpu_build,
    paged_attention,
    rope_write_kv,
    torch_ref,
    write_kv,
)
from tests.kernels.helpers import (
    attend_batch,
    build_meta,
    dense_reference,
    make_case,
    make_pool,
    random_seq,
)

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )

LENGTH = 600  # crosses the 256-key chunks twice and many 16-key pages


@pytest.fixture(scope="module")
def seq():
    return random_seq(LENGTH, seed=5)


# The invariance tests run on fp32 and bf16 pools (fp32 queries): a 16-bit pool is widened on
# load and nothing else changes, so its rows are as invariant as fp32's.
@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def kv_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def full(seq, kv_dtype):
    """All positions in one prefill chunk: what every other schedule must reproduce bitwise."""
    return attend_batch([(seq, LENGTH, LENGTH)], impl="cpp", kv_dtype=kv_dtype)[0]


def cpp(specs, kv_dtype, **kw):
    return attend_batch(specs, impl="cpp", kv_dtype=kv_dtype, **kw)


CASES = {
    "decode_ragged": ([1, 4, 5, 9, 16, 23], [1] * 6, {}),
    "prefill_over_prefix": ([13, 9, 20], [5, 9, 3], {}),
    "mixed_page16": ([300, 2, 47, 520], [1, 2, 40, 1], {"page_size": 16, "head_dim": 64}),
    "mha_hd8": ([70, 33], [40, 1], {"heads": 4, "kv_heads": 4, "head_dim": 8, "page_size": 16}),
    "gqa3_hd32": ([90, 41], [7, 1], {"heads": 9, "kv_heads": 3, "head_dim": 32}),
    "mqa_hd128": ([61], [61], {"heads": 4, "kv_heads": 1, "head_dim": 128, "page_size": 8}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_reference(isa, name: str) -> None:
    ctx, qlen, shape = CASES[name]
    case = make_case(ctx, qlen, **shape)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.25, impl="cpp")
    ref = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.25, impl="torch")
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dense = dense_reference(case, qlen, 0.25)
    torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_16bit_pool_equals_fp32_kernel_on_widened_pool(name: str, kv: torch.dtype) -> None:
    """Loads widen exactly and nothing else depends on the pool dtype: bitwise fp32's rows."""
    ctx, qlen, shape = CASES[name]
    case = make_case(ctx, qlen, **shape)
    pool = case.kv_pool.to(kv)
    out = paged_attention(case.query, pool, 1, case.meta, 0.25, impl="cpp")
    assert out.dtype == torch.float32
    assert torch.equal(
        out, paged_attention(case.query, pool.float(), 1, case.meta, 0.25, impl="cpp")
    )
    # auto dispatches on the query's dtype: fp32 queries run the C++ kernel on a 16-bit pool
    assert torch.equal(out, paged_attention(case.query, pool, 1, case.meta, 0.25))
    # and the torch path on the same pool agrees to fp32 rounding
    ref = paged_attention(case.query, pool, 1, case.meta, 0.25, impl="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_equal_prefill_rows(isa, seq, full, kv_dtype) -> None:
    edges = [0, 1, 7, 8, 15, 16, 17, 255, 256, 257, 511, 512, 513, LENGTH - 1]
    for pos in edges + list(range(30, LENGTH, 61)):
        (row,) = cpp([(seq, pos + 1, 1)], kv_dtype, seed=pos)
        assert torch.equal(row[0], full[pos]), pos


@pytest.mark.parametrize("chunk", [16, 37])
def test_chunked_prefill_equals_one_shot(isa, seq, full, kv_dtype, chunk: int) -> None:
    rows = []
    for start in range(0, LENGTH, chunk):
        end = min(LENGTH, start + chunk)
        rows += cpp([(seq, end, end - start)], kv_dtype, seed=start)
    assert torch.equal(torch.cat(rows), full)


def test_rows_independent_of_other_sequences(isa, seq, full, kv_dtype) -> None:
    others = [random_seq(n, seed=20 + n) for n in (5, 17, 700, 64)]
    specs = [
        (others[0], 5, 1),
        (seq, 290, 100),
        (others[1], 17, 17),
        (seq, 257, 1),
        (others[2], 700, 3),
        (seq, LENGTH, 6),
        (others[3], 64, 0),  # no query rows this step
    ]
    out = cpp(specs, kv_dtype, seed=11)
    assert torch.equal(out[1], full[190:290])
    assert torch.equal(out[3], full[256:257])
    assert torch.equal(out[5], full[LENGTH - 6 :])
    assert out[6].shape[0] == 0
    for i, spec in enumerate(specs[:6]):
        assert torch.equal(out[i], cpp([spec], kv_dtype, seed=3)[0]), i


def _shared_prefix_batch(seq, contexts: list[int], kv_dtype, page_size: int = 16) -> torch.Tensor:
    """Decode rows of sequences that all use one block table (a shared prefix): one row each."""
    num_pages = -(-LENGTH // page_size)
    pool = torch.randn(num_pages + 1, 1, 2, page_size, 3, 64).to(kv_dtype)
    table = list(range(num_pages, 0, -1))  # shuffled order, block 0 unused
    full_meta = build_meta([table], [LENGTH], [LENGTH], page_size)
    write_kv(pool, 0, seq.keys, seq.values, full_meta.slot_mapping, impl="torch")
    meta = build_meta([table] * len(contexts), contexts, [1] * len(contexts), page_size)
    query = torch.stack([seq.queries[c - 1] for c in contexts])
    return paged_attention(query, pool, 0, meta, 0.125, impl="cpp")


def test_shared_prefix_rows_equal_unshared_rows(isa, seq, full, kv_dtype) -> None:
    contexts = [520, 513, 600, 300, 520, 1, 257, 256]
    out = _shared_prefix_batch(seq, contexts, kv_dtype)
    for i, c in enumerate(contexts):
        assert torch.equal(out[i], full[c - 1]), c


def test_thread_count_does_not_change_rows(isa, seq, full, kv_dtype) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpp([(seq, LENGTH, LENGTH)], kv_dtype)[0]
        dec = cpp([(seq, 513, 1), (seq, 77, 1)], kv_dtype)
        shared = _shared_prefix_batch(seq, [600, 300], kv_dtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)
    assert torch.equal(dec[0][0], full[512]) and torch.equal(dec[1][0], full[76])
    assert torch.equal(shared[0], full[599]) and torch.equal(shared[1], full[299])


def test_empty_query_and_unsupported_head_dim_fall_back() -> None:
    case = make_case([9], [0], head_dim=16)
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.5, impl="cpp")
    assert out.shape == (0, 6, 16)
    case = make_case([20, 9], [3, 1], head_dim=12)  # not a multiple of 8: the torch path
    out = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.5, impl="cpp")
    ref = paged_attention(case.query, case.kv_pool, 1, case.meta, 0.5, impl="torch")
    assert torch.equal(out, ref)


def test_bad_metadata_raises_kernel_error() -> None:
    pool = make_pool(2, 1, 4, 2, 8)
    with pytest.raises(KernelError, match=r"block id 5 outside the pool of 2"):
        paged_attention(torch.zeros(3, 2, 8), pool, 0, build_meta([[5]], [3], [3], 4), 1.0)
    with pytest.raises(KernelError, match="4 query rows but context length 3"):
        paged_attention(torch.zeros(4, 2, 8), pool, 0, build_meta([[0]], [3], [4], 4), 1.0)


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KV_IDS = ["fp32", "bf16", "fp16"]
_INT_OF = {4: torch.int32, 2: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN payloads included): torch.equal on them is bitwise equality."""
    return t.view(_INT_OF[t.element_size()])


# Values where rounding to 16 bits is delicate: ties, overflow, subnormals, inf and NaN.
SPECIAL = [
    float("nan"),
    float("inf"),
    -float("inf"),
    1e30,  # over fp16's range: inf
    65519.0,  # fp16 max rounds down, 65520 up to inf
    65520.0,
    1.0 + 2**-8,  # bf16 tie, rounds to even (1.0)
    1.0 + 3 * 2**-8,  # bf16 tie, rounds to even (up)
    1.0 + 2**-11,  # fp16 tie
    -(2**-126) * 0.75,  # fp32 subnormal (bf16 keeps it)
    6e-8,  # fp16 subnormal
    1e-41,
    -0.0,
    3.0e38,
    -3.4e38,
    2**-149,
]


def _special_rows(g: torch.Generator, n: int, width: int) -> torch.Tensor:
    x = torch.randn(n, width, generator=g) * 100
    flat = x.view(-1)
    flat[: len(SPECIAL)] = torch.tensor(SPECIAL)
    flat[-len(SPECIAL) :] = -torch.tensor(SPECIAL)
    return x


@pytest.mark.parametrize("kv", KV_DTYPES, ids=KV_IDS)
def test_write_kv_bitwise_equal_to_torch(kv: torch.dtype) -> None:
    """C++ narrows exactly like torch's `.to(dtype)` (ties to even, overflow, NaN)."""
    g = torch.Generator().manual_seed(0)
    pools = [torch.randn(6, 3, 2, 4, 2, 8, generator=g).to(kv) for _ in range(2)]
    pools[1].copy_(pools[0])
    qkv = _special_rows(g, 5, 64).view(5, 8, 8)  # a fused row: k = heads 2-3, v = heads 4-5
    key, value = qkv[:, 2:4], qkv[:, 4:6]  # non-contiguous views, as the model passes them
    slots = torch.tensor([9, -1, 0, 23, 4])
    write_kv(pools[0], 2, key, value, slots, impl="cpp")
    write_kv(pools[1], 2, key, value, slots, impl="torch")
    assert torch.equal(_bits(pools[0]), _bits(pools[1]))
    assert torch.equal(_bits(pools[0][5, 2, 1, 3]), _bits(value[3].to(kv)))
    assert torch.equal(_bits(pools[0][0, 2, 0, 0]), _bits(key[2].to(kv)))
    assert int(pools[0].isnan().sum()) == int(key[[0, 2, 3, 4]].isnan().sum()) + int(
        value[[0, 2, 3, 4]].isnan().sum()
    )


@pytest.mark.parametrize("kv", KV_DTYPES, ids=KV_IDS)
def test_rope_write_kv_bitwise_equal_to_torch(kv: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, n = 9, 3, 64, 37
    angles = torch.arange(64, dtype=torch.float64)[:, None] * (1e4 ** -torch.arange(0, 1, 2 / dim))
    cos, sin = angles.cos().float(), angles.sin().float()
    qkv = torch.randn(40, (heads + 2 * kv_heads) * dim, generator=g)[:n]
    positions = torch.randint(0, 64, (n,), generator=g)
    slots = torch.randperm(8 * 16, generator=g)[:n]
    slots[5] = -1
    qkv[:, -len(SPECIAL) :] = torch.tensor(SPECIAL)  # v of the last head: written as is
    pools = [torch.randn(8, 2, 2, 16, kv_heads, dim, generator=g).to(kv) for _ in range(2)]
    pools[1].copy_(pools[0])
    q = rope_write_kv(qkv, positions, cos, sin, pools[0], 1, slots, heads, impl="cpp")
    ref = torch_ref.rope_write_kv(qkv, positions, cos, sin, pools[1], 1, slots, heads)
    assert torch.equal(q, ref) and torch.equal(_bits(pools[0]), _bits(pools[1]))
    with pytest.raises(KernelError, match="positions must be in"):
        rope_write_kv(qkv, positions + 64, cos, sin, pools[0], 1, slots, heads, impl="cpp")


def test_env_var_forces_the_torch_path() -> None:
    code = (
        "import torch\n"
        "from kvrelay.kernels import KernelError, ops\n"
        "print(ops._backend('auto', torch.zeros(1)).__name__)\n"
        "try:\n"
        "    ops._backend('cpp', torch.zeros(1))\n"
        "except KernelError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "KVRELAY_KERNELS_CPU": "torch"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "kvrelay.kernels.torch_paged",
        "impl='cpp' needs CPU tensors and the built C++ CPU kernels",
    ]


def test_failed_build_warns_once_and_uses_torch(tmp_path) -> None:
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "from kvrelay.kernels import ops\n"
        "for _ in range(3):\n"
        "    print(ops._backend('auto', torch.zeros(1)).__name__)\n"
    )
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should be: mkdir fails
    env = {**os.environ, "KVRELAY_CACHE_DIR": str(blocker), "KVRELAY_KERNELS_CPU": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["kvrelay.kernels.torch_paged"] * 3
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "C++ CPU kernels unavailable" in warnings[0]
