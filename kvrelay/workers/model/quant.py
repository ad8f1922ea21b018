"""Smaller weights for CPU fp32 models: `--quantization int8`, `fp16`, `int8-weight-only`, `q8_0`,
`w8a16`.

w8a16 (`W8A16Linear`, AMX-BF16 hosts only): int8 weights with one scale per output, each row
of activations rounded to bf16, sums over all inputs on AMX bf16 tiles
(`kvrelay.kernels.w8a16_linear`, C++). No per-block scales: the tiles run the whole sum, so
linears are 1.3-1.8x q8_0's once a few rows form; perplexity between int8-weight-only's and
q8_0's. Rows are bitwise the same in any batch; AMX's summation is its own (no other
instruction set gives its bits), so other hosts refuse the scheme. A SwiGLU gate/up projection
(`W8A16GateUp`) also runs its activation in the same kernel (`kernels.w8a16_silu_linear`):
SiLU(gate) * up with silu_mul's bits, without writing and rereading the [T, 2I] gate/up rows.

q8_0 (`Q8Linear`): llama.cpp's Q8_0 x Q8_0 dot: the int8-weight-only weights, and each row of
activations quantized to int8 with one fp32 scale per 32 inputs as it enters the layer;
integer block sums (exact), one fp32 FMA per block (`kvrelay.kernels.q8_linear`, C++). On AMX
hosts the integer sums run on AMX tiles once 16 rows form, on VNNI, AVX-512 or AVX2 otherwise:
all exact, so the bits are the same on every host and in any batch.

int8-weight-only (`Int8WeightLinear`): int8 weights with one fp32 scale per 32 inputs of each
output (llama.cpp's Q8_0 blocks), fp32 activations and sums (`kvrelay.kernels.int8_linear`,
C++). A quarter of fp32's bytes per step (plus 1/8 for the scales), about half of fp16's, with
nothing rounded but the weights; every output is one fp32 accumulator over k in order, so a
row's result is bitwise the same in any batch.

fp16 (`Fp16Linear`): weights stored as IEEE half, converted to fp32 inside fbgemm's GEMM, fp32
activations and accumulation. Half the bytes of fp32 per step (batch 1 decode is bound by
reading the weights). fbgemm's AVX-512 kernels sum every row in the same order whatever the
row count; its AVX2 kernels run rows in blocks of 6 and give a trailing block of 1-2 rows a
kernel of its own whose sums round differently (a row alone -0.8467, in a batch -0.8468). So
`fp16_row_block()` measures once which holds on this host: 1 (any row count), 6 (rows padded
to whole blocks of 6, which every ISA fbgemm has computes alike: measured 1-139 rows, 1-4
threads), or neither (fp16 is refused here: `can_quantize` says False).

int8 (`Int8Linear`): int8 weights, per-token dynamic int8 activations.

y = (q(x) . Wq^T) * s_x * s_w, with per-output-channel symmetric weight scales (set once at
load) and a symmetric scale per token row computed from that row alone. The int8 GEMM is
oneDNN's `qlinear_pointwise` over a weight pre-packed by `qlinear_prepack`: it accumulates in
int32, exactly, so a row's output depends only on that row, whatever the batch, the thread
count or the CPU's instruction set. Exactness needs weights in [-63, 63]: without AVX-512
VNNI oneDNN multiplies with `vpmaddubsw`, whose int16 pair sums saturate for |w| > 63 against
the uint8 activations (measured: 8-bit weights give wrong sums under ONEDNN_MAX_CPU_ISA=AVX2,
7-bit weights exact on AVX2 and VNNI alike). Activations keep the full 8 bits (zero point 128).
`LlamaForCausalLM.quantize` says which layers use it. Measured here, the alternatives were
slower or not invariant: `torch._int_mm` reorders its weight on every call (~0.5-1.8 ms fixed
cost per layer on AVX2), `_weight_int8pack_mm` is 5-50x slower than fp32, fbgemm's
`linear_dynamic` quantises activations per tensor (rows then depend on their batch).
"""

from __future__ import annotations

import functools
import logging

import torch

from kvrelay import kernels
from kvrelay.core.enums import Quantization
from kvrelay.kernels.cpu_decoder import LinearKind, LinearSpec

logger = logging.getLogger(__name__)

WEIGHT_MAX = 63  # 7-bit weights: exact int32 sums on AVX2 (see the module docstring)
ACT_MAX = 127
ACT_ZERO_POINT = 128
WEIGHT_ONLY = Quantization.INT8_WEIGHT_ONLY


# What each method needs beyond CPU float32 weights (its error message where it cannot run).
NEEDS = {
    Quantization.INT8: "a torch with oneDNN's int8 linear (qlinear_prepack)",
    Quantization.FP16: "a torch built with fbgemm whose fp16 rows are batch invariant here",
    WEIGHT_ONLY: "the C++ CPU kernels (x86-64 with AVX2)",
    Quantization.Q8_0: "the C++ CPU kernels (x86-64 with AVX2)",
    Quantization.W8A16: "the amx kernel variant (a CPU with AMX-BF16 and AVX512-BF16)",
}


def can_quantize(weight: torch.Tensor, method: str = Quantization.INT8) -> bool:
    """True where `method`'s path runs: CPU fp32 with oneDNN's int8 / fbgemm's fp16 linear."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if method == Quantization.FP16:
        return fp16_row_block() is not None
    if method in (WEIGHT_ONLY, Quantization.Q8_0):
        return kernels.int8_linear_available()
    if method == Quantization.W8A16:
        return kernels.w8a16_available()
    return hasattr(torch.ops.onednn, "qlinear_prepack")


def quantize_weight(
    weight: torch.Tensor, qmax: int = WEIGHT_MAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], fp32 scale [out]): symmetric, one scale per output channel
    (7-bit by default: see WEIGHT_MAX)."""
    return kernels.quantize_channel_weight(weight, qmax)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 x with zero point 128, fp32 scale [rows, 1]): symmetric per row (token)."""
    return kernels.quantize_rows(x, ACT_MAX, ACT_ZERO_POINT)


class Int8Linear:
    """Drop-in for `model.Linear` (same call): y = x W^T + b through oneDNN's int8 GEMM."""

    __slots__ = ("packed", "scale", "bias", "out_features", "in_features", "_zero_points")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_max: int = WEIGHT_MAX
    ):
        if not can_quantize(weight):
            raise ValueError(
                f"int8 quantization needs CPU float32 weights (got {weight.dtype} on "
                f"{weight.device.type}) and a torch with oneDNN's quantized linear"
            )
        q, self.scale = quantize_weight(weight, weight_max)
        self.out_features, self.in_features = (int(n) for n in q.shape)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.bias = None if bias is None else bias.detach().float().clone()
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_rows(x)
        # x scale 1.0: the per-row scale is applied after, elementwise, to the fp32 result.
        y = torch.ops.onednn.qlinear_pointwise(
            xq,
            1.0,
            ACT_ZERO_POINT,
            self.packed,
            self.scale,
            self._zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
        y.mul_(x_scale)
        return y if self.bias is None else y.add_(self.bias)


# Row counts fbgemm's fp16 GEMM is tried with (alone and at offsets) against a 48-row batch.
_FP16_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 14, 20, 31, 32, 44)


@functools.cache
def fp16_row_block() -> int | None:
    """Rows fbgemm's fp16 GEMM must get in whole multiples of for every row to be computed
    alike in any batch on this host: 1, 6 (its AVX2 kernels), or None (neither: refused)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    g = torch.Generator().manual_seed(0)
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 1536, generator=g), None)
    x = torch.randn(48, 1536, generator=g) * 3
    for block in (1, 6):
        full = _fp16_rows(x, packed, block)
        if all(
            torch.equal(_fp16_rows(x[start : start + n], packed, block), full[start : start + n])
            for n in _FP16_PROBE_ROWS
            for start in (0, 1, 48 - n)
        ):
            return block
    logger.warning("fbgemm's fp16 rows change with their batch on this host: fp16 refused")
    return None


def _fp16_rows(x: torch.Tensor, packed: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[0]
    pad = -n % block
    if pad:  # zero rows to a whole block: the real rows take the full-block kernel
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    y = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return y[:n] if pad else y


class Fp16Linear:
    """Drop-in for `model.Linear` (same call): y = x W^T + b with W stored as fp16 (fbgemm)."""

    __slots__ = ("packed", "bias", "out_features", "in_features", "row_block")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if not can_quantize(weight, Quantization.FP16):
            raise ValueError(
                f"fp16 weights need CPU float32 weights (got {weight.dtype} on "
                f"{weight.device.type}) and {NEEDS[Quantization.FP16]}"
            )
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        w = weight.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.row_block = fp16_row_block() or 1  # rows padded to it (the model pads to it too)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _fp16_rows(x, self.packed, self.row_block)
        return y if self.bias is None else y.add_(self.bias)


class Int8WeightLinear:
    """Drop-in for `model.Linear` (same call): y = x W^T + b, W int8 with a scale per 32 inputs."""

    __slots__ = ("weight", "bias", "out_features", "in_features")
    # Each row is computed alone whatever the row count, so the model need not pad batches.
    any_row_count = True
    method: str = WEIGHT_ONLY

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`blocks`: the weight's int8 values and scales as they are (a GGUF's Q8_0 blocks),
        taken instead of quantizing `weight` again (int8-weight-only and q8_0)."""
        if not can_quantize(weight, self.method):
            raise ValueError(
                f"{self.method} needs CPU float32 weights (got {weight.dtype} on "
                f"{weight.device.type}) and {NEEDS[Quantization(self.method)]}"
            )
        self.weight = self.pack(*(blocks or self.quantize(weight)))
        self.out_features, self.in_features = self.weight.out_features, self.weight.in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.quantize_int8_weight(weight)

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor):
        return kernels.pack_int8_weight(q, scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_linear(x, self.weight, self.bias)

    def cpp_spec(self) -> LinearSpec:
        """This layer for `kernels.CpuDecoder` (the same kernel as a call)."""
        return self._spec(LinearKind.INT8)

    def _spec(self, kind: LinearKind, comp: torch.Tensor | None = None) -> LinearSpec:
        w = self.weight
        return LinearSpec(kind, w.packed, w.scales, comp, self.bias, self.out_features)


class Q8Linear(Int8WeightLinear):
    """Drop-in for `model.Linear` (same call): y = x W^T + b in Q8_0 x Q8_0 arithmetic (the
    same int8 weights, packed for `q8_linear`)."""

    __slots__ = ()
    method = Quantization.Q8_0

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor):
        return kernels.pack_q8_weight(q, scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.q8_linear(x, self.weight, self.bias)

    def cpp_spec(self) -> LinearSpec:
        return self._spec(LinearKind.Q8, self.weight.comp)


class W8A16Linear(Int8WeightLinear):
    """Drop-in for `model.Linear` (same call): y = x W^T + b with W int8, one scale per output,
    and x rounded to bf16, summed on AMX bf16 tiles (`kvrelay.kernels.w8a16_linear`)."""

    __slots__ = ()
    method = Quantization.W8A16

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.quantize_channel_weight(weight)

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor):
        return kernels.pack_w8a16_weight(q, scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a16_linear(x, self.weight, self.bias)

    def cpp_spec(self) -> LinearSpec:
        return self._spec(LinearKind.W8A16)


class W8A16GateUp(W8A16Linear):
    """A SwiGLU MLP's gate/up projection ([gate; up], [2I, K]) in w8a16 with its activation:
    `silu_mul(x)` gives SiLU(gate) * up [T, I] in one kernel, bitwise what `silu_mul` of the
    plain layer's output gives. The weight is packed in `kernels.gate_up_order` (16 gates, then
    their ups, per 32-column block); calling the layer still gives [T, 2I] in [gate; up] order."""

    __slots__ = ("inverse",)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether a [2I, K] gate/up weight has the 16-output groups the fused kernel needs."""
        return weight.dim() == 2 and weight.shape[0] % 32 == 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if not self.fits(weight):
            raise ValueError(f"a gate/up weight needs 2I rows, I a multiple of 16: {weight.shape}")
        super().__init__(weight, bias)
        order = kernels.gate_up_order(self.out_features // 2)
        self.inverse = torch.argsort(order)
        if self.bias is not None:  # in the packed order, as the kernel reads it
            self.bias = self.bias[order].contiguous()

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor):
        return kernels.pack_w8a16_gate_up(q, scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a16_linear(x, self.weight, self.bias)[:, self.inverse]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a16_silu_linear(x, self.weight, self.bias)

    def cpp_spec(self) -> LinearSpec:
        return self._spec(LinearKind.W8A16_GATE_UP_SILU)


def quantized_linear(
    method: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gate_up: bool = False,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """`method`'s linear layer for a dense fp32 weight; `gate_up`: a SwiGLU [gate; up]
    projection, which w8a16 fuses with its activation where the shape allows; `blocks`: the
    weight's int8 values with a scale per 32 inputs as the checkpoint holds them (Q8_0), which
    int8-weight-only and q8_0 take as they are."""
    if method == Quantization.W8A16:
        if gate_up and W8A16GateUp.fits(weight):
            return W8A16GateUp(weight, bias)
        return W8A16Linear(weight, bias)
    if method == Quantization.Q8_0:
        return Q8Linear(weight, bias, blocks)
    if method == Quantization.FP16:
        return Fp16Linear(weight, bias)
    if method == WEIGHT_ONLY:
        return Int8WeightLinear(weight, bias, blocks)
    return Int8Linear(weight, bias)
