"""`--quantization int8-weight-only`: int8 weights with a scale per 32 inputs, fp32 activations and
sums (C++); row, batch and chunk invariance, the greedy answer of fp32, its own fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.kernels import quantize_int8_weight
from kvrelay.workers.model.quant import Int8WeightLinear, can_quantize
from tests.workers.conftest import (
    FP32_CAPITAL_ANSWER,
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
    outputs_in_each_variant,
    quantized_engine_factory,
)

if not can_quantize(torch.zeros(1, 1), "int8-weight-only"):
    pytest.skip("C++ CPU kernels unavailable (int8-weight-only)", allow_module_level=True)

make_engine = quantized_engine_factory("int8-weight-only")


def test_linear_rounds_only_the_weights_to_8_bits_per_channel():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 1536, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(70, 1536, generator=g) * 3
    lin = Int8WeightLinear(weight, bias)
    q, scales = quantize_int8_weight(weight)
    assert int(q.abs().max()) == 127  # the full 8 bits: the sums are fp32, nothing saturates
    per_k = scales.double().repeat_interleave(32, dim=1)
    dequant = q.double() * per_k
    assert bool(((dequant - weight.double()).abs() <= per_k / 2 + 1e-9).all())
    ref = x.double() @ dequant.T + bias.double()
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-4)
    for start, rows in ((0, 1), (5, 2), (1, 12)):
        assert torch.equal(lin(x[start : start + rows]), lin(x)[start : start + rows])
    with pytest.raises(ValueError, match="int8-weight-only needs CPU float32 weights"):
        Int8WeightLinear(weight.double())


def test_greedy_answer_is_fp32s(make_engine):
    assert greedy_capital_answer(make_engine()).output_token_ids == FP32_CAPITAL_ANSWER


def test_default_stack_bf16_pages_keep_the_answer(make_engine, model_dir):
    """What `kvrelay up` runs on this CPU (int8-weight-only, kv_cache_dtype auto: bf16 pages
    with the C++ kernels) still gives fp32's greedy answer, under its own fingerprint."""
    engine = make_engine(kv_cache_dtype="auto")
    assert engine.kv_dtype == torch.bfloat16
    assert greedy_capital_answer(engine).output_token_ids == FP32_CAPITAL_ANSWER
    own = model_fingerprint(model_dir, "float32", "int8-weight-only", "bfloat16")
    assert engine.fingerprint == own


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_fingerprint_is_its_own(make_engine, model_dir):
    own = model_fingerprint(model_dir, "float32", "int8-weight-only")
    assert make_engine().fingerprint == own
    others = {model_fingerprint(model_dir, "float32", m) for m in ("none", "int8", "fp16")}
    assert own not in others


def test_every_isa_variant_gives_the_same_tokens_and_logprobs(make_engine):
    """The whole model (int8_linear, silu_mul, rms_norm, attention) in each ISA variant the
    CPU runs: the same greedy tokens and the same logprob bits."""
    results = outputs_in_each_variant(make_engine, (7, 40, 3), max_tokens=6)
    assert all(r == results["avx2"] for r in results.values())
