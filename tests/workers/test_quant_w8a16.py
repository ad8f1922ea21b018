"""`--quantization w8a16`: int8 weights with a scale per output, bf16 activations, AMX bf16
tiles; the whole model's rows are the same alone, in a batch and chunked, its own fingerprint.
AMX-BF16 hosts only (elsewhere it is refused: tests/cli)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.kernels import silu_mul
from kvrelay.workers.model.llama import swiglu
from kvrelay.workers.model.quant import W8A16GateUp, W8A16Linear, can_quantize, quantized_linear
from tests.workers.conftest import (
    FP32_CAPITAL_ANSWER,
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
    quantized_engine_factory,
)

if not can_quantize(torch.zeros(1, 1), "w8a16"):
    pytest.skip("needs AMX-BF16 (the amx kernel variant)", allow_module_level=True)

make_engine = quantized_engine_factory("w8a16")


def test_greedy_answer_is_fp32s(make_engine):
    """Measured: "The capital of France is Paris.", token for token fp32's answer (q8_0's
    rounding of the activations per 32 moves its first token)."""
    assert greedy_capital_answer(make_engine()).output_token_ids == FP32_CAPITAL_ANSWER


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_fingerprint_is_its_own(make_engine, model_dir):
    own = model_fingerprint(model_dir, "float32", "w8a16")
    assert make_engine().fingerprint == own
    others = {
        model_fingerprint(model_dir, "float32", m)
        for m in ("none", "int8", "fp16", "int8-weight-only", "q8_0")
    }
    assert own not in others


def test_gate_up_runs_its_activation_in_the_linear_with_the_same_bits(make_engine):
    """The model's gate/up layers are fused (SmolLM2: I = 1536); the fused layer gives the
    plain layer's [gate; up] when called and silu_mul's bits of it from `swiglu`, with a bias
    too; a gate/up without 16-output groups stays a plain layer."""
    layers = make_engine().loaded.model.layers
    assert all(isinstance(layer.gate_up, W8A16GateUp) for layer in layers)
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(40, 64, generator=g)
    for b in (None, bias):
        plain, fused = W8A16Linear(weight, b), quantized_linear("w8a16", weight, b, gate_up=True)
        assert isinstance(fused, W8A16GateUp)
        assert torch.equal(fused(x), plain(x))
        assert torch.equal(swiglu(fused, x), silu_mul(plain(x)))
        assert torch.equal(swiglu(plain, x), silu_mul(plain(x)))
    odd = quantized_linear("w8a16", torch.randn(48, 64, generator=g), None, gate_up=True)
    assert type(odd) is W8A16Linear


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="w8a16 needs CPU float32 weights"):
        W8A16Linear(torch.zeros(4, 4, dtype=torch.float64))
