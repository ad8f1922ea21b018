"""`--quantization int8`: exact int8 GEMM, batch/chunk invariance of the int8 engine, fixed greedy
output, its own fingerprint, and clear errors for a bad value."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.modelref import model_fingerprint
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.config import load_worker_config
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.model.quant import ACT_ZERO_POINT, Int8Linear, quantize_rows, quantize_weight
from tests.workers.conftest import (
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
    quantized_engine_factory,
)

# Greedy answer of the int8 model to "What is the capital of France?" (chat template): "The
# capital of France is Paris." <eos>, as fp32's, but with "The" at logprob -1.41 (fp32: -1.88).
INT8_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]


make_engine = quantized_engine_factory("int8")


def test_int8_linear_is_exact_and_row_invariant():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1536, generator=g) * 0.05
    x = torch.randn(13, 1536, generator=g) * 3
    lin = Int8Linear(weight)
    wq, w_scale = quantize_weight(weight)
    assert int(wq.abs().max()) == 63  # 7-bit weights: exact sums without VNNI too
    xq, x_scale = quantize_rows(x)
    acc = (xq.long() - ACT_ZERO_POINT) @ wq.long().t()  # exact integer reference
    expected = acc.float() * w_scale * x_scale
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert torch.equal(lin(x), expected)
            for start, rows in ((0, 1), (3, 4), (5, 8), (1, 12)):
                assert torch.equal(lin(x[start : start + rows]), expected[start : start + rows])
    finally:
        torch.set_num_threads(threads)


def test_greedy_answer_is_fixed(make_engine):
    out = greedy_capital_answer(make_engine(), logprobs=1)
    assert out.output_token_ids == INT8_ANSWER
    # -1.41 with the C++ RMSNorm (its sum of squares rounds differently from torch's; int8
    # rounding of the activations magnifies it); it was -1.35 with torch's.
    assert round(out.new_logprobs[0][504], 2) == -1.41


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_decoded_tokens_prefill_to_the_same_logprobs(make_engine):
    prompt = list(range(1000, 1020))
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    decoded = make_engine().generate([prompt], params)[0]
    # the first 3 outputs were decoded one at a time; here they are prefilled with the prompt
    rest = make_engine().generate(
        [prompt + decoded.output_token_ids[:3]],
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, ignore_eos=True),
    )[0]
    assert rest.output_token_ids == decoded.output_token_ids[3:]
    assert rest.new_logprobs == decoded.new_logprobs[3:]


def test_fingerprint_differs_from_fp32(make_engine, model_dir, loaded_model):
    fp32 = model_fingerprint(model_dir, "float32")
    assert loaded_model.fingerprint == fp32  # unchanged for unquantized models
    int8 = model_fingerprint(model_dir, "float32", "int8")
    assert make_engine().fingerprint == int8 != fp32
    with pytest.raises(ValueError, match="config asks for 'none'"):
        Engine(EngineConfig(num_blocks=8), loaded=make_engine().loaded)


def test_worker_config_rejects_unknown_quantization():
    env = {"KVRELAY_WORKER_QUANTIZATION": "int4"}
    message = (
        "unsupported quantization 'int4'; use one of none, int8, fp16, int8-weight-only, q8_0, "
        "w8a16"
    )
    with pytest.raises(ConfigError, match=message):
        load_worker_config(environ=env)
    assert load_worker_config(environ={}, quantization="int8").engine.quantization == "int8"
