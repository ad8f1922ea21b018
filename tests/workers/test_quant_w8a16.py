"""`--quantization w8a16`: int8 weights with a scale per output, bf16 activations, AMX bf16
tiles; the whole model's rows are the same alone, in a batch and chunked, its own fingerprint.
AMX-BF16 hosts only (elsewhere it is refused: tests/cli)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.workers.model.quant import W8A16Linear, can_quantize
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


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="w8a16 needs CPU float32 weights"):
        W8A16Linear(torch.zeros(4, 4, dtype=torch.float64))
