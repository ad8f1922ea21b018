"""`--quantization q8_0`: llama.cpp's Q8_0 x Q8_0 arithmetic (int8 weights and activations, a
scale per 32 each); row, batch and chunk invariance, the same bits on every ISA variant, its
own fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import model_fingerprint
from kvrelay.kernels import quantize_int8_weight
from kvrelay.workers.model.quant import Q8Linear, can_quantize
from tests.workers.conftest import (
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
    quantized_engine_factory,
)

if not can_quantize(torch.zeros(1, 1), "q8_0"):
    pytest.skip("C++ CPU kernels unavailable (q8_0)", allow_module_level=True)

make_engine = quantized_engine_factory("q8_0")

# Measured: q8_0's greedy answer to the capital question, "L'Étoile, la Cité, la France" (12
# tokens): fp32's first token ("The") leads by less than the activations' rounding moves the
# logits (perplexity is within 0.5% of fp32: docs/benchmarks.md). The same on every ISA variant.
Q8_CAPITAL_ANSWER = [60, 23, 39614, 1141, 552, 28, 2618, 12693, 2756, 28, 2618, 4649]


def test_linear_is_the_q8_0_dot_and_row_invariant():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 1536, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(70, 1536, generator=g) * 3
    lin = Q8Linear(weight, bias)
    q, scales = quantize_int8_weight(weight)
    dequant = q.double() * scales.double().repeat_interleave(32, dim=1)
    blocks = x.double().view(70, 48, 32)
    xd = blocks.abs().amax(dim=2, keepdim=True) / 127
    xq = torch.round(blocks / xd).view(70, -1) * xd.repeat_interleave(32, dim=2).view(70, -1)
    ref = xq @ dequant.T + bias.double()
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-4)
    for start, rows in ((0, 1), (5, 2), (1, 12), (3, 16), (2, 40)):
        assert torch.equal(lin(x[start : start + rows]), lin(x)[start : start + rows])
    with pytest.raises(ValueError, match="q8_0 needs CPU float32 weights"):
        Q8Linear(weight.double())


def test_greedy_answer(make_engine):
    assert greedy_capital_answer(make_engine()).output_token_ids == Q8_CAPITAL_ANSWER


def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


def test_fingerprint_is_its_own(make_engine, model_dir):
    own = model_fingerprint(model_dir, "float32", "q8_0")
    assert make_engine().fingerprint == own
    others = {
        model_fingerprint(model_dir, "float32", m)
        for m in ("none", "int8", "fp16", "int8-weight-only")
    }
    assert own not in others


def test_every_isa_variant_gives_the_same_tokens_and_logprobs(make_engine):
    """The whole model (q8_linear on AMX tiles, VNNI, AVX-512 or AVX2, and the other kernels)
    in each ISA variant the CPU runs: the same greedy tokens and the same logprob bits, at
    batch 1 and in a batch of 20 (AMX tiles from 16 rows on)."""
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.kernels import cpu_build

    supported = cpu_build.supported_variants()
    if len(supported) < 2:
        pytest.skip(f"this CPU runs one kernel variant only ({', '.join(supported)})")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in range(3, 23)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    results = {}
    for variant in supported:
        with cpu_build.use_variant(variant):
            engine = make_engine()
            outs = engine.generate(prompts, params) + engine.generate(prompts[:1], params)
        results[variant] = [(o.output_token_ids, o.new_logprobs) for o in outs]
    assert all(r == results["avx2"] for r in results.values())
    assert results["avx2"][0] == results["avx2"][-1]  # alone == in the batch of 20
