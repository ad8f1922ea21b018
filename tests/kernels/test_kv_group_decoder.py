"""`CpuDecoder` over KV groups (`kvrelay.core.kv_layout`): each layer writes its K/V into its
pool slot with its group's slot mapping and attends with its group's block tables and window,
the Python loop's bits (per-layer kernels with the group's metadata), in every ISA variant, for
each C++ linear; a local group's released pages (its table entries behind the window) point at
a block of NaN that neither path reads."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.kv_layout import KVLayout
from kvrelay.kernels import (
    KernelError,
    add_rms_norm,
    bf16_attention_available,
    cpu_build,
    gelu_tanh_mul,
    paged_attention,
    rms_norm,
    rope_write_kv,
    silu_mul,
    w8a16_available,
    write_kv,
)
from kvrelay.kernels.cpu_decoder import CpuDecoder, LayerSpec
from kvrelay.workers.model.quant import W8A16GateUp, quantized_linear
from tests.kernels.helpers import build_meta

pytestmark = pytest.mark.skipif(not cpu_build.cpu_supported(), reason="needs the C++ kernels")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 32, 32
EPS = 1e-6
SCALE = HEAD_DIM**-0.5
PAGE = 16
WINDOW = 8
NAN_BLOCK = 0  # where a local group's released pages point
NUM_BLOCKS = 160
# per-layer fields, in turn: q/k head norms, NoPE, GeGLU with the output norms
KINDS = [
    dict(heads_norm=True),
    dict(rope=False),
    dict(activation="gelu_tanh", out_norms=True),
    dict(heads_norm=True, activation="gelu_tanh", out_norms=True),
]
LAYOUTS = {
    # layers 0 and 2 full (group 0, slots 0 and 1), 1 and 3 local (group 1, slots 0 and 1)
    "two-groups": (0, WINDOW, 0, WINDOW),
    # group 0: layers 0 and 3; group 1: 1 and 2; group 2: 4 and 5 (both local)
    "three-groups": (0, WINDOW, WINDOW, 0, WINDOW, WINDOW),
}
# (context lengths, query rows) per step: both prefilled, then sequence 0's prefill chunks
# (one crossing a 256-key chunk) beside sequence 1's prefill and decode steps
STEPS = [
    ([40, 7], [40, 7]),
    ([100, 30], [60, 23]),
    ([270, 31], [170, 1]),
    ([271, 32], [1, 1]),
    ([272, 33], [1, 1]),
    ([273, 49], [1, 16]),
]


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, generator=g)


def _model(windows: tuple[int, ...], method: str, seed: int = 0):
    """The layers' specs and their linear layers (the loop calls those)."""
    layout = KVLayout.from_windows(len(windows), windows)
    g = torch.Generator().manual_seed(seed)
    specs, linears = [], []
    for i, window in enumerate(windows):
        kind = KINDS[i % len(KINDS)]
        act = kind.get("activation", "silu")

        def lin(n: int, k: int, gate_up: bool = False):
            w = torch.randn(n, k, generator=g) / k**0.5
            return quantized_linear(method, w, None, gate_up=gate_up)

        qkv = lin((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        o = lin(HIDDEN, HEADS * HEAD_DIM)
        gate_up = lin(2 * INTER, HIDDEN, gate_up=act == "silu")
        down = lin(HIDDEN, INTER)
        heads_norm, out_norms = kind.get("heads_norm", False), kind.get("out_norms", False)
        spec = LayerSpec(
            _norm(g, HIDDEN), _norm(g, HIDDEN), qkv.cpp_spec(), o.cpp_spec(),
            gate_up.cpp_spec(), down.cpp_spec(),
            q_norm=_norm(g, HEAD_DIM) if heads_norm else None,
            k_norm=_norm(g, HEAD_DIM) if heads_norm else None,
            rope=kind.get("rope", True), window=window, rope_table=0 if window else 1,
            attn_out_norm=_norm(g, HIDDEN) if out_norms else None,
            mlp_out_norm=_norm(g, HIDDEN) if out_norms else None,
            activation=act, kv_group=layout.layer_group[i], kv_slot=layout.layer_slot[i],
        )  # fmt: skip
        specs.append(spec)
        linears.append((qkv, o, gate_up, down))
    return layout, specs, linears


def _rope(base: float, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(rows).float()[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


def _loop(specs, linears, hidden, x, positions, cos, sin, pool, metas):
    """The Python loop: one kernel call at a time, each layer with its group's metadata and
    slots and its own pool slot."""
    tokens = hidden.shape[0]
    qw, kw = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i, (s, (qkv_l, o_l, gu_l, down_l)) in enumerate(zip(specs, linears, strict=True)):
        meta = metas[s.kv_group]
        qkv = qkv_l(x)
        if s.q_norm is not None:
            q_rows = rms_norm(qkv[:, :qw].reshape(-1, HEAD_DIM), s.q_norm, EPS)
            k_rows = rms_norm(qkv[:, qw : qw + kw].reshape(-1, HEAD_DIM), s.k_norm, EPS)
            qkv[:, :qw] = q_rows.view(tokens, qw)
            qkv[:, qw : qw + kw] = k_rows.view(tokens, kw)
        if s.rope:
            t = s.rope_table
            q = rope_write_kv(qkv, positions, cos[t], sin[t], pool, s.kv_slot, meta.slot_mapping,
                              HEADS)  # fmt: skip
        else:
            k = qkv[:, qw : qw + kw].reshape(tokens, KV_HEADS, HEAD_DIM)
            v = qkv[:, qw + kw :].reshape(tokens, KV_HEADS, HEAD_DIM)
            write_kv(pool, s.kv_slot, k, v, meta.slot_mapping)
            q = qkv[:, :qw].reshape(tokens, HEADS, HEAD_DIM).contiguous()
        attn = paged_attention(q, pool, s.kv_slot, meta, SCALE, window=s.window)
        o_out = o_l(attn.reshape(tokens, -1))
        if s.attn_out_norm is not None:
            o_out = rms_norm(o_out, s.attn_out_norm, EPS)
        x = add_rms_norm(hidden, o_out, s.post_norm, EPS)
        if s.activation == "gelu_tanh":
            act = gelu_tanh_mul(gu_l(x))
        elif isinstance(gu_l, W8A16GateUp):
            act = gu_l.silu_mul(x)
        else:
            act = silu_mul(gu_l(x))
        down = down_l(act)
        if s.mlp_out_norm is not None:
            down = rms_norm(down, s.mlp_out_norm, EPS)
        if i + 1 < len(specs):
            x = add_rms_norm(hidden, down, specs[i + 1].input_norm, EPS)
        else:
            hidden.add_(down)


def _group_tables(layout: KVLayout, num_seqs: int, max_pages: int, seed: int = 0):
    """Each group's own block ids per sequence (no block shared, none the NaN block)."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    need = layout.num_groups * num_seqs * max_pages
    assert need <= len(ids)
    it = iter(ids)
    return [[[next(it) for _ in range(max_pages)] for _ in range(num_seqs)]
            for _ in range(layout.num_groups)]  # fmt: skip


def _step_metas(layout, tables, ctx, n, precision):
    """Each group's metadata for one step: a local group's pages wholly behind the window of
    the step's first query released (pointing at the NaN block), as the engine leaves them."""
    metas = []
    for group, group_tables in zip(layout.groups, tables, strict=True):
        step_tables = []
        for seq_table, c, k in zip(group_tables, ctx, n, strict=True):
            pages = -(-c // PAGE)
            first = group.first_block(c - k, PAGE)
            step_tables.append([NAN_BLOCK] * first + seq_table[first:pages])
        meta = build_meta(step_tables, ctx, n, PAGE)
        meta.precision = precision
        metas.append(meta)
    return metas


def _methods() -> list[str]:
    methods = ["int8-weight-only", "q8_0"]
    if w8a16_available():
        methods.append("w8a16")
    return methods


PRECISIONS = [
    ("fp32", torch.float32),
    ("fp32", torch.bfloat16),
    pytest.param("bf16", torch.bfloat16, marks=pytest.mark.skipif(
        not bf16_attention_available(), reason="needs AMX-BF16")),
]  # fmt: skip


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("precision,kv_dtype", PRECISIONS)
def test_kv_groups_in_one_call_give_the_loops_bits(isa, layout_name, precision, kv_dtype):
    if precision == "bf16" and not bf16_attention_available():
        pytest.skip(f"bf16 attention is the amx variant's, not {isa}'s")
    windows = LAYOUTS[layout_name]
    cos, sin = map(list, zip(_rope(10_000.0), _rope(1_000_000.0), strict=True))
    for method in _methods():
        layout, specs, linears = _model(windows, method)
        decoder = CpuDecoder(specs, EPS, HEADS)
        assert decoder.num_kv_groups == layout.num_groups > 1
        max_pages = -(-max(c for ctx, _ in STEPS for c in ctx) // PAGE)
        tables = _group_tables(layout, 2, max_pages)
        shape = (NUM_BLOCKS, layout.group_size, 2, PAGE, KV_HEADS, HEAD_DIM)
        pools = [torch.zeros(shape, dtype=kv_dtype) for _ in range(2)]
        for pool in pools:
            pool[NAN_BLOCK] = float("nan")
        g = torch.Generator().manual_seed(1)
        for ctx, n in STEPS:
            positions = torch.cat([torch.arange(c - k, c) for c, k in zip(ctx, n, strict=True)])
            hidden = torch.randn(sum(n), HIDDEN, generator=g)
            x = rms_norm(hidden, specs[0].input_norm, EPS)
            want = hidden.clone()
            metas = _step_metas(layout, tables, ctx, n, precision)
            _loop(specs, linears, want, x.clone(), positions, cos, sin, pools[1], metas)
            metas_c = _step_metas(layout, tables, ctx, n, precision)  # fresh plan caches
            slots = [m.slot_mapping for m in metas_c]
            assert decoder.run(hidden, x, positions, cos, sin, pools[0], slots, metas_c, SCALE)
            where = (method, ctx, n)
            assert bool(want.isfinite().all()), where  # no NaN page read by the loop either
            assert torch.equal(hidden, want), where
            assert torch.equal(pools[0][1:], pools[1][1:]), where
            assert bool(pools[0][NAN_BLOCK].isnan().all()), where  # never written


def test_one_meta_for_every_group_is_a_sequence_of_it(isa):
    """A single slot mapping and metadata serve every group (what one group did before)."""
    windows = LAYOUTS["two-groups"]
    layout, specs, _ = _model(windows, "int8-weight-only")
    decoder = CpuDecoder(specs, EPS, HEADS)
    cos, sin = map(list, zip(_rope(10_000.0), _rope(1_000_000.0), strict=True))
    tables = [list(range(1, 9)), list(range(9, 17))]
    shape = (20, layout.group_size, 2, PAGE, KV_HEADS, HEAD_DIM)
    pools = [torch.zeros(shape) for _ in range(2)]
    hidden = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(2))
    outs = []
    for pool, as_list in zip(pools, (False, True), strict=True):
        meta = build_meta(tables, [40, 30], [30, 20], PAGE)
        positions = torch.cat([torch.arange(10, 40), torch.arange(10, 30)])
        h = hidden.clone()
        x = rms_norm(h, specs[0].input_norm, EPS)
        slots = [meta.slot_mapping] * 2 if as_list else meta.slot_mapping
        metas = [meta] * 2 if as_list else meta
        assert decoder.run(h, x, positions, cos, sin, pool, slots, metas, SCALE)
        outs.append(h)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0], pools[1])


def test_kv_group_fields_are_checked_and_misfits_go_to_the_loop():
    windows = LAYOUTS["two-groups"]
    layout, specs, _ = _model(windows, "int8-weight-only")
    s0, s1 = specs[0], specs[1]

    def with_(s: LayerSpec, **fields) -> LayerSpec:
        from dataclasses import replace

        return replace(s, **fields)

    bad = [
        ([with_(s0, kv_group=-1)], "kv_group must be >= 0"),
        ([with_(s0, kv_slot=-2)], "kv_slot >= -1"),
        ([s0, with_(s1, kv_group=0, kv_slot=0)], "share one KV group's pool slot"),
        (
            [s0, with_(s1, kv_group=0, kv_slot=1), with_(specs[3], kv_slot=0)],
            "KV group 0 must share one window",
        ),
        ([s0, with_(s1, kv_group=2)], "KV groups must be 0 .. n-1"),
    ]
    for layer_specs, match in bad:
        with pytest.raises(KernelError, match=match):
            CpuDecoder(layer_specs, EPS, HEADS)
    # kv_slot -1: the layer's own index; a single group may mix windows (as before groups)
    single = CpuDecoder([with_(s, kv_group=0, kv_slot=-1) for s in specs], EPS, HEADS)
    assert single.num_kv_groups == 1

    decoder = CpuDecoder(specs, EPS, HEADS)
    cos, sin = map(list, zip(_rope(10_000.0), _rope(1_000_000.0), strict=True))
    metas = [build_meta([[1]], [2], [2], PAGE), build_meta([[2]], [2], [2], PAGE)]
    slots = [m.slot_mapping for m in metas]
    pool = torch.zeros(4, layout.group_size, 2, PAGE, KV_HEADS, HEAD_DIM)
    hidden, x = torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN)
    positions = torch.tensor([0, 1])

    def run(**kw) -> bool:
        args = dict(positions=positions, cos=cos, sin=sin, kv_pool=pool, slot_mapping=slots,
                    meta=metas, scale=SCALE)  # fmt: skip
        args.update(kw)
        return decoder.run(hidden, x, **args)

    assert not run(meta=metas[:1])  # one metadata short
    assert not run(slot_mapping=slots + slots[:1])  # one slot mapping too many
    assert not run(slot_mapping=[slots[0], slots[1][:1]])  # a group's slots not one per token
    assert not run(slot_mapping=[slots[0], slots[1].int()])  # not int64
    assert not run(kv_pool=pool[:, :1].contiguous())  # slot 1 outside the pool
    bad_meta = build_meta([[2]], [2], [2], PAGE)
    bad_meta.block_tables = bad_meta.block_tables[:0]
    assert not run(meta=[metas[0], bad_meta])  # a group's tables not one row per sequence
    mixed = build_meta([[2]], [2], [2], PAGE)
    mixed.precision = "bf16"
    assert not run(meta=[metas[0], mixed])  # one precision per step
    assert torch.equal(hidden, torch.zeros_like(hidden))  # refused before any layer ran
    with pytest.raises(KernelError, match="outside the pool"):
        run(slot_mapping=[slots[0], torch.tensor([0, 4 * PAGE])])
    assert torch.equal(hidden, torch.zeros_like(hidden))
    assert run()
