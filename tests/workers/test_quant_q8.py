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
    outputs_in_each_variant,
    quantized_engine_factory,
)

if not can_quantize(torch.zeros(1, 1), "q8_0"):
    pytest.skip("C++ CPU kernels unavailable (q8_0)", allow_module_level=True)

make_engine = quantized_engine_factory("q8_0")

# Measured: q8_0's greedy answer to the capital question, "L'Étoile, la Cité, la France" (12
# tokens): fp32's first token ("The") leads by less than the activations' rounding moves the
# logits (perplexity is within 0.5% of fp32: docs/benchmarks.md). The same on every ISA variant.
Q8_CAPITAL_ANSWER = [60, 23, 39614, 1141, 552, 28, 2618, 12693, 2756, 28, 2618, 4649]


def q8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """(float64 x_dequant @ w_dequant^T + bias, the bound on q8_linear's distance from it).

    The activations are quantized as the kernel does (fp32: d = amax / 127 per block of 32,
    round_half_even(x / d)), so the integers are the kernel's and only its fp32 arithmetic
    differs: per block one rounding of wd * xd and one FMA into the output, then the bias, each
    off by at most u = 2^-24 of what it rounds, so |y - ref| <= (blocks + 2) u (sum_b |t_b| +
    |bias|) with t_b = isum_b wd_b xd_b (to first order; 1% added for the rest)."""
    rows, k = x.shape
    blocks = -(-k // 32)
    xp = torch.zeros(rows, blocks * 32)
    xp[:, :k] = x
    xb = xp.view(rows, blocks, 32)
    xd = xb.abs().amax(dim=2, keepdim=True) / 127
    xq = torch.round(xb / torch.where(xd == 0, 1.0, xd)).clamp_(-127, 127)
    q, wd = quantize_int8_weight(weight)
    qp = torch.zeros(q.shape[0], blocks * 32, dtype=torch.float64)
    qp[:, :k] = q.double()
    isum = torch.einsum("mbk,nbk->mnb", xq.double(), qp.view(-1, blocks, 32))  # exact integers
    terms = isum * xd.double().view(rows, 1, blocks) * wd.double()[None]
    ref = terms.sum(dim=2) + bias.double()
    bound = (blocks + 2) * 2.0**-24 * (terms.abs().sum(dim=2) + bias.double().abs()) * 1.01
    return ref, bound


@pytest.mark.parametrize("out_features, in_features", [(96, 1536), (70, 100)])
def test_linear_is_the_q8_0_dot_and_row_invariant(out_features, in_features):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(70, in_features, generator=g) * 3
    x[4, :40] = 0  # an all-zero block: scale 0, q 0
    lin = Q8Linear(weight, bias)
    y = lin(x)
    ref, bound = q8_reference(x, weight, bias)
    assert bool(((y.double() - ref).abs() <= bound).all())
    # The activations are rounded: fp32 x against the same int8 weights (int8-weight-only's
    # product) is out of the bound nearly everywhere (measured: 99.8% and 100% of the outputs).
    q, wd = quantize_int8_weight(weight)
    w_dequant = q.double() * wd.double().repeat_interleave(32, dim=1)[:, :in_features]
    unrounded = (y.double() - (x.double() @ w_dequant.T + bias.double())).abs()
    assert float((unrounded > bound).double().mean()) > 0.9
    for start, rows in ((0, 1), (5, 2), (1, 12), (3, 16), (2, 40), (0, 70)):
        assert torch.equal(lin(x[start : start + rows]), y[start : start + rows])
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
    batch = outputs_in_each_variant(make_engine, range(3, 23), max_tokens=4)
    alone = outputs_in_each_variant(make_engine, (3,), max_tokens=4)  # batch's first prompt
    assert all(r == batch["avx2"] for r in batch.values())
    assert all(r == alone["avx2"] for r in alone.values())
    assert alone["avx2"][0] == batch["avx2"][0]  # alone == in the batch of 20
