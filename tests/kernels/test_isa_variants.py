"""ISA variants of the C++ kernels: selection, side-by-side loading, and the same bits."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from kvrelay.kernels import KernelError, cpu_build, pack_int8_weight

AVX2 = ("avx2", "fma")
AVX512 = (*AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
AMX = (*AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def test_supported_variants_follow_the_cpu_flags():
    assert cpu_build.supported_variants(()) == ()
    assert cpu_build.supported_variants(("avx2",)) == ()  # FMA too
    assert cpu_build.supported_variants((*AVX2, "avx512f")) == ("avx2",)
    assert cpu_build.supported_variants((*AVX512, "amx_tile")) == ("avx2", "avx512")
    assert cpu_build.supported_variants(AMX) == ("avx2", "avx512", "amx")
    assert cpu_build.supported_variants(AMX[:-1]) == ("avx2", "avx512")  # no amx_int8


def test_choose_variant_takes_the_best_or_the_override(caplog):
    both = ("avx2", "avx512")
    assert cpu_build.choose_variant("auto", both) == "avx512"
    assert cpu_build.choose_variant("", both) == "avx512"
    assert cpu_build.choose_variant("AVX2", both) == "avx2"
    assert cpu_build.choose_variant("avx512", both) == "avx512"
    assert cpu_build.choose_variant("auto", ()) is None
    assert not caplog.records


def test_choose_variant_refuses_what_the_cpu_lacks(caplog):
    with caplog.at_level(logging.WARNING, logger="kvrelay.kernels.cpu_build"):
        assert cpu_build.choose_variant("avx512", ("avx2",)) == "avx2"
        assert cpu_build.choose_variant("sse", ("avx2", "avx512")) == "avx512"
    first, second = (r.getMessage() for r in caplog.records)
    assert first == (
        "KVRELAY_KERNELS_ISA=avx512 refused: this CPU lacks avx512bw, avx512dq, avx512f, "
        "avx512vl; using avx2"
    )
    assert second == "KVRELAY_KERNELS_ISA=sse is not one of auto, avx2, avx512, amx: using avx512"


def test_load_variant_refuses_a_variant_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(AVX2))
    with pytest.raises(KernelError, match="cannot run the avx512 kernels \\(lacks avx512bw"):
        cpu_build.load_variant("avx512")
    with pytest.raises(KernelError, match="unknown kernel ISA variant 'avx1024'"):
        cpu_build.load_variant("avx1024")


def test_each_variant_has_its_own_build_key_and_flags():
    assert cpu_build.variant_cflags("avx2") == cpu_build.CFLAGS
    assert cpu_build.variant_cflags("avx512")[-4:] == (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
    )
    assert "-ffp-contract=off" in cpu_build.variant_cflags("avx512")
    keys = {v: cpu_build.build_key(v) for v in cpu_build.VARIANTS}
    assert len(set(keys.values())) == len(keys)
    name, build_dir, so_path = cpu_build._paths("avx512")
    assert name == f"kvrelay_cpu_avx512_{keys['avx512']}"
    assert build_dir == cpu_build.cache_dir() / name and so_path.name == f"{name}.so"


def _isa_in_subprocess(**env: str) -> list[str]:
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from kvrelay.kernels import cpu_build\n"
        "print(cpu_build.loaded_isa())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVRELAY_KERNELS_CPU": "", "KVRELAY_KERNELS_ISA": "", **env},
    )
    assert out.returncode == 0, out.stderr
    return [out.stdout.strip(), out.stderr]


def test_env_picks_the_variant_and_load_reports_it():
    supported = cpu_build.supported_variants()
    if not supported:
        pytest.skip("CPU without AVX2 and FMA: no variant runs")
    isa, log = _isa_in_subprocess()
    assert isa == supported[-1]
    assert f"C++ CPU kernels: {isa} variant" in log
    assert _isa_in_subprocess(KVRELAY_KERNELS_ISA="avx2")[0] == "avx2"
    assert _isa_in_subprocess(KVRELAY_KERNELS_CPU="torch")[0] == "None"


WIDE = tuple(v for v in cpu_build.VARIANTS if v != "avx2")  # each compared with avx2


@pytest.fixture(scope="module", params=WIDE)
def variants(request):
    """avx2's module and, as "wide", one wider variant's (each that this CPU runs in turn)."""
    if request.param not in cpu_build.supported_variants():
        needs = ", ".join(sorted(cpu_build.VARIANT_CPU_FLAGS[request.param]))
        pytest.skip(f"needs a CPU with {needs} to compare the {request.param} variant with avx2")
    return {"avx2": cpu_build.load_variant("avx2"), "wide": cpu_build.load_variant(request.param)}


def test_variants_load_side_by_side(variants):
    assert variants["avx2"].__name__ != variants["wide"].__name__
    # each module runs its own code (no symbol of one resolves to the other)
    assert variants["avx2"].simd_width() == 8
    assert variants["wide"].simd_width() == 16


# The model's linears (qkv, o, gate_up, down, LM head) and awkward ones: n not a multiple of 64
# or 16, k not a multiple of 32, fewer columns than a sub-block.
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
AWKWARD_SHAPES = [(100, 37), (7, 20), (1000, 61), (65, 33), (17, 1), (130, 96)]


def _int8_layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, -(-k // 32), generator=g) * 0.01 + 1e-3
    return pack_int8_weight(q, scales), torch.randn(n, generator=g)


@pytest.mark.parametrize(("n", "k"), LINEAR_SHAPES + AWKWARD_SHAPES)
def test_int8_linear_same_bits_in_each_variant(variants, n, k):
    w, bias = _int8_layer(n, k, n * 7 + k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 3
    row_counts = range(1, 41) if n * k <= 600_000 else (1, 2, 3, 8, 24, 25, 40)
    for m in row_counts:
        for b in (bias, None):
            a2 = variants["avx2"].int8_linear(x[:m], w.packed, w.scales, b, n)
            a5 = variants["wide"].int8_linear(x[:m], w.packed, w.scales, b, n)
            assert torch.equal(a2, a5), (m, b is None)


def test_int8_linear_same_bits_past_96_rows(variants):
    w, bias = _int8_layer(200, 70, 3)
    x = torch.randn(300, 70, generator=torch.Generator().manual_seed(4))
    for m in (95, 96, 97, 131, 300):
        a2 = variants["avx2"].int8_linear(x[:m], w.packed, w.scales, bias, 200)
        assert torch.equal(a2, variants["wide"].int8_linear(x[:m], w.packed, w.scales, bias, 200))


def _rows_with_edges(n: int, dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * 4
    edge = torch.tensor([0.0, -0.0, 88.5, -88.5, -100.0, 1e-30, float("inf"), -float("inf")])
    x[0, : min(dim, 8)] = edge[: min(dim, 8)]
    if dim > 20:
        x[1, 20] = float("nan")
    return x


@pytest.mark.parametrize("dim", [1536, 1000, 24, 17, 5])  # 16-lane vectors, 8-lane, tails
def test_rowwise_ops_same_bits_in_each_variant(variants, dim):
    a2, a5 = variants["avx2"], variants["wide"]
    gu = _rows_with_edges(40, 2 * dim, dim)
    torch.testing.assert_close(a2.silu_mul(gu), a5.silu_mul(gu), rtol=0, atol=0, equal_nan=True)
    x, w = _rows_with_edges(40, dim, dim + 1)[2:], torch.randn(dim)
    assert torch.equal(a2.rms_norm(x, w, 1e-5), a5.rms_norm(x, w, 1e-5))
    d = torch.randn_like(x)
    r2, r5 = x.clone(), x.clone()
    assert torch.equal(a2.add_rms_norm(r2, d, w, 1e-5), a5.add_rms_norm(r5, d, w, 1e-5))
    assert torch.equal(r2, r5)
    q2, s2 = a2.quantize_rows(x, 127.0, 128)
    q5, s5 = a5.quantize_rows(x, 127.0, 128)
    assert torch.equal(q2, q5) and torch.equal(s2, s5)


def _attention_case(group: int, kv_heads: int, ctx: list[int], qlen: list[int], page: int, dtype):
    """Pool, block tables, plan inputs and queries of one batch (shuffled block ids)."""
    g = torch.Generator().manual_seed(group * 1000 + sum(ctx) + sum(qlen) + page)
    head_dim = 64
    pages = [-(-c // page) for c in ctx]
    blocks = torch.randperm(sum(pages) + 2, generator=g)
    rows, at = [], 0
    for p in pages:
        rows.append(blocks[at : at + p].tolist() + [0] * (max(pages) - p))
        at += p
    pool = torch.randn(sum(pages) + 2, 2, 2, page, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(qlen), group * kv_heads, head_dim, generator=g) * 2
    qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32)
    return (
        q,
        pool,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        qsl,
        page,
    )


def _attend(mod, case, threads: int) -> torch.Tensor:
    q, pool, tables, ctx, qsl, page = case
    chunk_pages = max(1, 256 // page)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        plan = mod.build_plan(tables, ctx, qsl, q.shape[0], page, chunk_pages, pool.shape[0])
        return mod.paged_attention(q, pool, 1, tables, *plan, chunk_pages, 0.125, False)
    finally:
        torch.set_num_threads(before)


# (context lengths, query rows) per batch: prefill chunks long enough for many row blocks and
# odd token counts, decode at batch 1 over several chunks (items cut by KV heads at 2 threads),
# decode batches, a prefill chunk next to decode rows.
ATTENTION_BATCHES = [
    ([300], [300]),
    ([77], [77]),
    ([530], [45]),
    ([700], [1]),
    ([260], [1]),
    ([40, 700, 300], [1, 1, 1]),
    ([500, 33], [71, 1]),
]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_same_bits_in_each_variant(variants, group, dtype):
    for (ctx, qlen), page in zip(ATTENTION_BATCHES, (16, 5, 16, 16, 16, 8, 32), strict=True):
        for kv_heads in (1, 3):
            case = _attention_case(group, kv_heads, ctx, qlen, page, dtype)
            one = _attend(variants["avx2"], case, 1)
            for v in ("avx2", "wide"):
                for threads in (1, 2):
                    out = _attend(variants[v], case, threads)
                    assert torch.equal(out, one), (ctx, qlen, kv_heads, v, threads)


@pytest.mark.parametrize("variant", tuple(cpu_build.VARIANTS))
def test_attention_items_cut_by_heads_keep_the_bits(variant):
    """Decode at batch 1 with 2-3 chunks: at 2 threads (more than 1 thread per item) each item
    is cut by KV heads; the rows equal one thread's and the prefill's rows of those positions."""
    if variant not in cpu_build.supported_variants():
        pytest.skip(f"this CPU cannot run the {variant} kernels")
    mod = cpu_build.load_variant(variant)
    for kv_heads in (2, 3, 5):
        full = _attention_case(3, kv_heads, [700], [700], 16, torch.float32)
        rows = _attend(mod, full, 1)
        q, pool, tables, _, _, page = full
        for pos in (255, 256, 511, 699):
            one = (q[pos : pos + 1], pool, tables, torch.tensor([pos + 1], dtype=torch.int32),
                   torch.tensor([0, 1], dtype=torch.int32), page)  # fmt: skip
            for threads in (1, 2, 3):
                assert torch.equal(_attend(mod, one, threads)[0], rows[pos]), (pos, threads)


@pytest.mark.parametrize("vocab", [49152, 3001])
def test_sampled_tokens_same_in_each_variant(variants, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 4
    temperature = torch.rand(64, generator=g) + 0.3
    top_p = torch.where(torch.arange(64) % 3 == 0, 1.0, torch.rand(64, generator=g))
    min_p = torch.where(torch.arange(64) % 4 == 0, 0.05, 0.0)
    settings = torch.stack((temperature, top_p, min_p, torch.rand(64, generator=g)), dim=1)
    top_k = torch.where(torch.arange(64) % 5 == 0, 20, 0)
    a2 = variants["avx2"].sample_rows(logits, settings, top_k)
    assert torch.equal(a2, variants["wide"].sample_rows(logits, settings, top_k))
    assert len(set(a2.tolist())) > 40  # real draws, not one token
