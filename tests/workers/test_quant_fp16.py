"""`--quantization fp16`: fp16 weights (fbgemm), fp32 activations; row, batch and chunk
invariance, the greedy answer of fp32, its own fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.workers.model.quant import Fp16Linear, can_quantize
from tests.workers.conftest import (
    FP32_CAPITAL_ANSWER,
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
    quantized_engine_factory,
)

if not can_quantize(torch.zeros(1, 1), "fp16"):
    pytest.skip("this torch has no fbgemm (fp16 weights)", allow_module_level=True)

make_engine = quantized_engine_factory("fp16")


def test_fp16_linear_rounds_only_the_weights_and_rows_stand_alone():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 1536, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(70, 1536, generator=g) * 3
    lin = Fp16Linear(weight, bias)
    full = lin(x)
    torch.testing.assert_close(full, x @ weight.half().float().T + bias, rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert torch.equal(lin(x), full)
            for start, rows in ((0, 1), (3, 4), (5, 8), (1, 12), (2, 64), (69, 1)):
                assert torch.equal(lin(x[start : start + rows]), full[start : start + rows])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="fp16 weights need CPU float32 weights"):
        Fp16Linear(weight.double())


def test_greedy_answer_is_fp32s(make_engine):
    assert greedy_capital_answer(make_engine()).output_token_ids == FP32_CAPITAL_ANSWER


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_fingerprint_is_its_own(make_engine, model_dir):
    fp16 = model_fingerprint(model_dir, "float32", "fp16")
    assert make_engine().fingerprint == fp16
    assert fp16 not in (model_fingerprint(model_dir, "float32"),
                        model_fingerprint(model_dir, "float32", "int8"))  # fmt: skip
