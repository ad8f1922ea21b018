"""`--quantization fp16`: fp16 weights (fbgemm), fp32 activations; row, batch and chunk
invariance, the greedy answer of fp32, its own fingerprint; on this host's ISA (and with fbgemm
forced to its AVX2 kernels, whose 6-row blocks are padded, in test_avx2_forced.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.workers.model.quant import Fp16Linear, can_quantize, fp16_row_block
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


FORCED = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")


def test_row_block_is_fbgemms_kernel_block():
    # AVX2's kernels (forced below, or an AVX2-only host) need whole blocks of 6 rows
    assert fp16_row_block() == (6 if FORCED == "AVX2" else Fp16Linear(torch.zeros(1, 1)).row_block)
    assert fp16_row_block() in (1, 6)


def test_greedy_answer_is_fp32s(make_engine):
    assert greedy_capital_answer(make_engine()).output_token_ids == FP32_CAPITAL_ANSWER


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_fingerprint_is_its_own(make_engine, model_dir):
    fp16 = model_fingerprint(model_dir, "float32", "fp16")
    assert make_engine().fingerprint == fp16
    assert fp16 not in (model_fingerprint(model_dir, "float32"),
                        model_fingerprint(model_dir, "float32", "int8"))  # fmt: skip
