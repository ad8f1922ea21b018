"""What Gemma 3 takes from the kernels beside windowed attention (test_window_attention.py):
GeGLU's `gelu_tanh_mul` (close to torch's, the same bits in any batch, thread count and ISA
variant) and `CpuDecoder`'s Gemma 3 fields (windows per layer, two RoPE table pairs, norms of
the o and down projections' outputs, GeGLU), the Python loop's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import (
    KernelError,
    add_rms_norm,
    bf16_attention_available,
    cpu_build,
    gelu_tanh_mul,
    int8_linear,
    pack_int8_weight,
    paged_attention,
    quantize_int8_weight,
    rms_norm,
    rope_write_kv,
)
from kvrelay.kernels.cpu_decoder import CpuDecoder, LayerSpec, LinearKind, LinearSpec
from tests.kernels.helpers import build_meta

needs_cpp = pytest.mark.skipif(not cpu_build.cpu_supported(), reason="needs the C++ kernels")


def geglu_rows(rows: int, inter: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * inter, generator=g) * 3
    x[0, :inter] = torch.linspace(-12, 12, inter)  # both tails and the middle of the curve
    return x


@needs_cpp
@pytest.mark.parametrize("inter", [1, 7, 8, 17, 33, 2048])  # tails of 16 and 8 lanes; Gemma's
def test_gelu_tanh_mul_is_close_to_torch(isa, inter):
    x = geglu_rows(9, inter)
    got = gelu_tanh_mul(x)
    gate, up = x[:, :inter], x[:, inter:]
    want = F.gelu(gate, approximate="tanh") * up
    # measured: |got - torch| <= 2.3e-7 |gate * up| (2 ulp), and got's own error against the
    # float64 formula is no larger than torch's
    bound = 1e-6 * (gate * up).abs() + 1e-30
    assert bool(((got - want).abs() <= bound).all())
    gd, ud = gate.double(), up.double()
    exact = 0.5 * gd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd**3))) * ud
    assert float((got.double() - exact).abs().max()) <= 1e-5


@needs_cpp
def test_gelu_tanh_mul_rows_are_invariant(isa):
    x = geglu_rows(40, 2048 + 5)
    full = gelu_tanh_mul(x)
    for r in (0, 1, 17, 39):
        assert torch.equal(gelu_tanh_mul(x[r : r + 1].clone()), full[r : r + 1])
    assert torch.equal(gelu_tanh_mul(x[3:21].clone()), full[3:21])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(gelu_tanh_mul(x), full)
    finally:
        torch.set_num_threads(threads)


@needs_cpp
def test_gelu_tanh_mul_same_bits_in_every_variant():
    x = geglu_rows(5, 2048 + 13, seed=1)
    outs = {v: cpu_build.load_variant(v).gelu_tanh_mul(x) for v in cpu_build.supported_variants()}
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_gelu_tanh_mul_torch_path_and_shapes():
    x = geglu_rows(3, 10).to(torch.bfloat16)  # not CPU fp32: torch's
    half = 10
    want = F.gelu(x[:, :half], approximate="tanh") * x[:, half:]
    assert torch.equal(gelu_tanh_mul(x), want)
    with pytest.raises(KernelError, match="gate_up must be"):
        gelu_tanh_mul(torch.zeros(2, 5))


# ---- CpuDecoder with Gemma 3's layers --------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 1, 256, 48
EPS = 1e-6
SCALE = 256**-0.5
# Gemma 3's pattern in small: sliding layers (window 6, local RoPE table 0) and a global one
# (full attention, table 1); the second sliding layer rotates nothing (NoPE) and uses SiLU
LAYERS = [
    dict(window=6, rope_table=0),
    dict(window=6, rope_table=0, rope=False, activation="silu"),
    dict(window=0, rope_table=1),
]


def _linear(g: torch.Generator, n: int, k: int) -> tuple[LinearSpec, object]:
    w = torch.randn(n, k, generator=g) / k**0.5
    packed = pack_int8_weight(*quantize_int8_weight(w))
    spec = LinearSpec(LinearKind.INT8, packed.packed, packed.scales, None, None, n)
    return spec, packed


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, generator=g)


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    specs, weights = [], []
    for extra in LAYERS:
        qkv, qkv_w = _linear(g, (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        o, o_w = _linear(g, HIDDEN, HEADS * HEAD_DIM)
        gu, gu_w = _linear(g, 2 * INTER, HIDDEN)
        down, down_w = _linear(g, HIDDEN, INTER)
        fields = {"activation": "gelu_tanh", **extra}
        spec = LayerSpec(
            _norm(g, HIDDEN), _norm(g, HIDDEN), qkv, o, gu, down,
            q_norm=_norm(g, HEAD_DIM), k_norm=_norm(g, HEAD_DIM),
            attn_out_norm=_norm(g, HIDDEN), mlp_out_norm=_norm(g, HIDDEN), **fields,
        )  # fmt: skip
        specs.append(spec)
        weights.append((qkv_w, o_w, gu_w, down_w))
    return specs, weights


def _rope(base: float, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(rows).float()[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


def _loop(specs, weights, hidden, x, positions, cos, sin, pool, meta):
    """The Python loop of the brief: one kernel call at a time."""
    tokens = hidden.shape[0]
    for i, (s, (qkv_w, o_w, gu_w, down_w)) in enumerate(zip(specs, weights, strict=True)):
        qkv = int8_linear(x, qkv_w, None)
        qw, kw = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        q_rows = rms_norm(qkv[:, :qw].reshape(-1, HEAD_DIM), s.q_norm, EPS)
        k_rows = rms_norm(qkv[:, qw : qw + kw].reshape(-1, HEAD_DIM), s.k_norm, EPS)
        qkv[:, :qw] = q_rows.view(tokens, qw)
        qkv[:, qw : qw + kw] = k_rows.view(tokens, kw)
        if s.rope:
            q = rope_write_kv(qkv, positions, cos[s.rope_table], sin[s.rope_table], pool, i,
                              meta.slot_mapping, HEADS)  # fmt: skip
        else:
            from kvrelay.kernels import write_kv

            k = qkv[:, qw : qw + kw].reshape(tokens, KV_HEADS, HEAD_DIM)
            v = qkv[:, qw + kw :].reshape(tokens, KV_HEADS, HEAD_DIM)
            write_kv(pool, i, k, v, meta.slot_mapping)
            q = qkv[:, :qw].reshape(tokens, HEADS, HEAD_DIM).contiguous()
        attn = paged_attention(q, pool, i, meta, SCALE, window=s.window)
        o_out = int8_linear(attn.reshape(tokens, -1), o_w, None)
        if s.attn_out_norm is not None:
            o_out = rms_norm(o_out, s.attn_out_norm, EPS)
        x = add_rms_norm(hidden, o_out, s.post_norm, EPS)
        gate_up = int8_linear(x, gu_w, None)
        if s.activation == "gelu_tanh":
            act = gelu_tanh_mul(gate_up)
        else:
            from kvrelay.kernels import silu_mul

            act = silu_mul(gate_up)
        down = int8_linear(act, down_w, None)
        if s.mlp_out_norm is not None:
            down = rms_norm(down, s.mlp_out_norm, EPS)
        if i + 1 < len(specs):
            x = add_rms_norm(hidden, down, specs[i + 1].input_norm, EPS)
        else:
            hidden.add_(down)


PRECISIONS = [
    ("fp32", torch.float32),
    pytest.param("bf16", torch.bfloat16, marks=pytest.mark.skipif(
        not bf16_attention_available(), reason="needs AMX-BF16")),
]  # fmt: skip


@needs_cpp
@pytest.mark.parametrize("precision,kv_dtype", PRECISIONS)
def test_gemma3_layers_in_one_call_give_the_loops_bits(isa, precision, kv_dtype):
    if precision == "bf16" and not bf16_attention_available():
        pytest.skip(f"bf16 attention is the amx variant's, not {isa}'s")
    specs, weights = _model()
    decoder = CpuDecoder(specs, EPS, HEADS)
    tables = [_rope(10_000.0), _rope(1_000_000.0)]
    cos, sin = [c for c, _ in tables], [s for _, s in tables]
    page = 16
    seq_tables = [list(range(0, 20)), list(range(20, 40))]
    pools = [torch.zeros(40, len(specs), 2, page, KV_HEADS, HEAD_DIM, dtype=kv_dtype)
             for _ in range(2)]  # fmt: skip
    # (context lengths, query rows) per step: prefill chunks of sequence 0 beside sequence 1's
    # prefill and decode steps; sequence 0 crosses a 256-key chunk
    steps = [([200, 7], [200, 7]), ([270, 8], [70, 1]), ([271, 9], [1, 1]), ([272, 10], [1, 1])]
    g = torch.Generator().manual_seed(1)
    for ctx, n in steps:
        meta = build_meta(seq_tables, ctx, n, page)
        meta.precision = precision
        positions = torch.cat([torch.arange(c - k, c) for c, k in zip(ctx, n, strict=True)])
        hidden = torch.randn(sum(n), HIDDEN, generator=g)
        x = rms_norm(hidden, specs[0].input_norm, EPS)
        want_hidden = hidden.clone()
        _loop(specs, weights, want_hidden, x.clone(), positions, cos, sin, pools[1], meta)
        meta_c = build_meta(seq_tables, ctx, n, page)
        meta_c.precision = precision
        assert decoder.run(hidden, x, positions, cos, sin, pools[0], meta_c.slot_mapping, meta_c,
                           SCALE)  # fmt: skip
        assert torch.equal(hidden, want_hidden), (ctx, n)
        assert torch.equal(pools[0], pools[1]), (ctx, n)


@needs_cpp
def test_gemma3_fields_are_checked_and_missing_tables_go_to_the_loop():
    specs, _ = _model()
    fused = LinearSpec(LinearKind.W8A16_GATE_UP_SILU, torch.zeros(1), torch.zeros(1), None,
                       None, 2 * INTER)  # fmt: skip
    s = specs[0]
    bad = [
        (LayerSpec(s.input_norm, s.post_norm, s.qkv, s.o, fused, s.down,
                   activation="gelu_tanh"), "plain \\(unfused\\) gate/up"),
        (LayerSpec(s.input_norm, s.post_norm, s.qkv, s.o, s.gate_up, s.down,
                   activation="relu"), "activation must be one of"),
        (LayerSpec(s.input_norm, s.post_norm, s.qkv, s.o, s.gate_up, s.down, window=-1),
         "window and rope_table"),
    ]  # fmt: skip
    for spec, match in bad:
        with pytest.raises(KernelError, match=match):
            CpuDecoder([spec], EPS, HEADS)
    decoder = CpuDecoder(specs, EPS, HEADS)
    meta = build_meta([[0]], [2], [2], 16)
    pool = torch.zeros(1, len(specs), 2, 16, KV_HEADS, HEAD_DIM)
    hidden, x = torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN)
    cos, sin = _rope(10_000.0)
    args = (torch.tensor([0, 1]), cos, sin, pool, meta.slot_mapping, meta, SCALE)
    assert not decoder.run(hidden, x, *args)  # a layer takes table 1: one pair is not enough
    assert torch.equal(hidden, torch.zeros_like(hidden))
