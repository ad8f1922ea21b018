"""The C++ GGUF dequantization: gguf-py's numpy bits for every covered type, on each ISA variant."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvrelay.core.modelref import resolve_model
from kvrelay.kernels import GGUF_DEQUANT_TYPES, KernelError, cpu_build, dequantize_gguf
from kvrelay.workers.model.gguf_convert import read_gguf

if cpu_build.load() is None:  # said out loud: these tests need the built extension
    pytest.skip(
        "C++ CPU kernels unavailable (KVRELAY_KERNELS_CPU=torch or build failed)",
        allow_module_level=True,
    )

# Byte offsets of each block type's fp16 scale fields (d, and m / dmin where it has one).
SCALE_FIELDS = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
PLAIN = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)  # every bit pattern, NaNs too
TYPES = (*PLAIN, *SCALE_FIELDS)
# fp16 scales beside the random ones: zeros of both signs, the smallest subnormal, a
# subnormal, the largest finite value of each sign.
SPECIAL = np.array([0.0, -0.0, 6e-8, 3e-6, 65504.0, -65504.0], dtype=np.float16)
NONFINITE = np.array([np.inf, -np.inf, np.nan], dtype=np.float16).view(np.uint16)
# (rows, blocks per row): one row of one block, several blocks, rows of 4096 values, and
# 40 such rows (several threads' chunks).
SHAPES = ((1, 1), (1, 3), (5, 1), (5, 3), (3, None), (40, None))


def blocks(qtype: GGMLQuantizationType, rows: int, n: int, seed: int, nonfinite=False):
    """Random rows of `n` blocks; scale fields modest fp16 values (1 in 4 a special one)."""
    size, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, n * nbytes), dtype=np.uint8)
    each = raw.reshape(rows * n, nbytes)
    for at in SCALE_FIELDS.get(qtype, ()):
        scale = (rng.standard_normal(rows * n) * 0.05).astype(np.float16)
        special = rng.random(rows * n) < 0.25
        scale[special] = rng.choice(SPECIAL, int(special.sum()))
        bits = scale.view(np.uint16)
        if nonfinite:
            bits[::3] = rng.choice(NONFINITE, bits[::3].size)
            bits[1::7] = 0x7C01  # a signaling NaN
        each[:, at : at + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw, n * size


def numpy_values(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf * 0 and the like, in the non-finite cases
        return gguf_quants.dequantize(raw, qtype).reshape(raw.shape[0], cols)


def cpp_values(raw: np.ndarray, qtype: int, cols: int, odd: bool = False) -> np.ndarray:
    """`dequantize_gguf`'s values (`odd`: from a copy of raw at an odd byte address)."""
    src = torch.from_numpy(raw)
    if odd:
        src = torch.empty(src.numel() + 1, dtype=torch.uint8)[1:].view(src.shape).copy_(src)
        assert src.data_ptr() % 2 == 1
    out = torch.full((raw.shape[0], cols), 1.5)
    assert dequantize_gguf(src, int(qtype), out) is True
    return out.numpy()


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    differ = np.flatnonzero(got.view(np.int32) != want.view(np.int32))
    assert differ.size == 0, f"{differ.size} values differ, first at {differ[0]}"


def test_the_covered_types():
    assert {GGMLQuantizationType(t) for t in GGUF_DEQUANT_TYPES} == set(TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_numpy_bits(isa, qtype):
    size = GGML_QUANT_SIZES[qtype][0]
    for i, (rows, n) in enumerate(SHAPES):
        raw, cols = blocks(qtype, rows, n or 4096 // size, seed=1000 * qtype + i)
        assert_same_bits(cpp_values(raw, qtype, cols), numpy_values(raw, qtype, cols))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_at_an_odd_address(isa, qtype):
    """Raw bytes need no alignment (a tensor's bytes anywhere in a mapped file)."""
    raw, cols = blocks(qtype, 3, 4096 // GGML_QUANT_SIZES[qtype][0] + 1, seed=qtype + 7)
    assert_same_bits(cpp_values(raw, qtype, cols, odd=True), numpy_values(raw, qtype, cols))


@pytest.mark.parametrize("qtype", tuple(SCALE_FIELDS), ids=lambda t: t.name)
def test_numpy_bits_with_nonfinite_scales(isa, qtype):
    """inf and NaN scales (signaling ones too) give numpy's NaNs, payloads and signs."""
    raw, cols = blocks(qtype, 7, 4096 // GGML_QUANT_SIZES[qtype][0], seed=qtype, nonfinite=True)
    assert_same_bits(cpp_values(raw, qtype, cols), numpy_values(raw, qtype, cols))


def test_every_fp16_value(isa):
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(16, -1)
    qtype = GGMLQuantizationType.F16
    assert_same_bits(cpp_values(raw, qtype, 4096), numpy_values(raw, qtype, 4096))


@pytest.fixture(scope="module")
def smollm2():
    gguf = read_gguf(resolve_model(None).source)
    blob = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    return gguf, blob


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("token_embd.weight", slice(0, 3000)),  # Q8_0
        ("token_embd.weight", slice(-500, None)),
        ("blk.0.ffn_down.weight", slice(None)),  # Q4_1
        ("blk.0.attn_k.weight", slice(None)),
        ("blk.29.ffn_up.weight", slice(0, 700)),
    ],
)
def test_smollm2_tensors(isa, smollm2, name, rows):
    gguf, blob = smollm2
    (t,) = (t for t in gguf.tensors if t.name == name)
    qtype = GGMLQuantizationType(t.ggml_type)
    assert qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1)
    raw = np.array(blob[t.start : t.start + t.nbytes].reshape(t.shape[0], -1)[rows])  # a copy
    cols = t.shape[-1]
    assert_same_bits(cpp_values(raw, qtype, cols), numpy_values(raw, qtype, cols))


def test_wrong_arguments_raise():
    q4 = int(GGMLQuantizationType.Q4_0)
    raw, out = torch.zeros(4, 36, dtype=torch.uint8), torch.zeros(4, 64)
    assert dequantize_gguf(raw, q4, out) is True
    bad = [
        (raw.view(torch.int8), out),  # raw not uint8
        (raw, out.double()),  # out not fp32
        (raw.view(-1), out),  # raw not 2-D
        (raw, out.view(-1)),  # out not 2-D
        (raw[:3], out),  # rows differ
        (raw[:, :18], out),  # too few bytes for 64 values
        (raw, torch.zeros(4, 72)),  # too many values for the bytes
        (torch.zeros(4, 18, dtype=torch.uint8), torch.zeros(4, 31)),  # not whole blocks
        (torch.zeros(4, 72, dtype=torch.uint8)[:, :36], out),  # raw not contiguous
        (raw, torch.zeros(64, 4).t()),  # out not contiguous
    ]
    for r, o in bad:
        with pytest.raises(KernelError):
            dequantize_gguf(r, q4, o)


@pytest.mark.parametrize("qtype", [0, 9, 16, 23, 39, 1000])  # F32, Q8_1, IQ2_XXS, IQ4_XS, ...
def test_an_uncovered_type_returns_false_and_writes_nothing(qtype):
    out = torch.full((2, 32), 7.0)
    assert dequantize_gguf(torch.zeros(2, 34, dtype=torch.uint8), qtype, out) is False
    assert torch.equal(out, torch.full((2, 32), 7.0))


def test_without_the_cpp_kernels_it_returns_false():
    code = (
        "import torch\n"
        "from kvrelay.kernels import dequantize_gguf\n"
        "out = torch.full((2, 32), 7.0)\n"
        "print(dequantize_gguf(torch.zeros(2, 34, dtype=torch.uint8), 8, out), out.sum().item())\n"
    )
    env = {**os.environ, "KVRELAY_KERNELS_CPU": "torch"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "448.0"]
