"""`CpuDecoder`: a model whose linears are all C++ ones runs its layers in one C++ call, with
the logits of the Python loop bit for bit (prefill chunks, decode steps, a batch of three),
for every scheme that has one; what it does not take goes back to the loop."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.core.sampling import SamplingParams
from kvrelay.kernels import KernelError, cpu_build
from kvrelay.kernels.cpu_decoder import CpuDecoder, LayerSpec, LinearKind, LinearSpec
from kvrelay.workers.model.quant import can_quantize

pytestmark = pytest.mark.skipif(not cpu_build.cpu_supported(), reason="needs the C++ kernels")

SCHEMES = [  # quantization, attention precision (None: fp32 pages and attention)
    ("int8-weight-only", None),
    ("q8_0", None),
    pytest.param("w8a16", None, marks=pytest.mark.skipif(
        not can_quantize(torch.zeros(1, 1), "w8a16"), reason="needs AMX-BF16")),
    pytest.param("w8a16", "bf16", marks=pytest.mark.skipif(
        not can_quantize(torch.zeros(1, 1), "w8a16"), reason="needs AMX-BF16")),
]  # fmt: skip


def _engine(quantization: str, precision: str | None):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.model.loader import load_model

    loaded = load_model(progress=False, dtype="float32", device="cpu", quantization=quantization)
    pages = "bf16" if precision == "bf16" else "fp32"
    extra = {"attention_precision": precision or "fp32", "kv_cache_dtype": pages}
    config = EngineConfig(
        quantization=quantization, num_blocks=64, max_num_batched_tokens=128,
        speculation="off", **extra,
    )  # fmt: skip
    return Engine(config, loaded=loaded)


def _logits_of_a_batch(engine) -> tuple[list, list[torch.Tensor]]:
    """Three prompts (one prefilled over three chunks beside the others' decode steps), six
    tokens each: the greedy tokens and every step's logits."""
    model, seen = engine.loaded.model, []
    compute = model.compute_logits

    def record(hidden, indices):
        logits = compute(hidden, indices)
        seen.append(logits.clone())
        return logits

    model.compute_logits = record
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 300, 40)]
        engine.pool.reset_prefix_cache()
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        out = engine.generate(prompts, params)
    finally:
        model.compute_logits = compute
    return [o.output_token_ids for o in out], seen


@pytest.mark.parametrize("quantization,precision", SCHEMES)
def test_one_call_gives_the_loops_logits_bitwise(model_dir, quantization, precision):
    engine = _engine(quantization, precision)
    model = engine.loaded.model
    decoder = model.cpu_decoder
    assert decoder is not None and decoder.num_layers == len(model.layers)
    tokens, logits = _logits_of_a_batch(engine)
    model.cpu_decoder = None  # the Python loop
    try:
        loop_tokens, loop_logits = _logits_of_a_batch(engine)
    finally:
        model.cpu_decoder = decoder
    assert tokens == loop_tokens
    assert len(logits) == len(loop_logits) > 6  # prefill chunks and decode steps
    for step, (got, want) in enumerate(zip(logits, loop_logits, strict=True)):
        assert torch.equal(got, want), step


def test_models_with_other_linears_loop_in_python(loaded_model):
    """fp32 (oneDNN's GEMM for its linears) keeps the loop."""
    assert loaded_model.model.cpu_decoder is None


def test_what_it_does_not_take_goes_to_the_loop_and_bad_positions_are_refused(model_dir):
    engine = _engine("int8-weight-only", None)
    model, decoder = engine.loaded.model, engine.loaded.model.cpu_decoder
    c = model.config
    pool = engine.runner.kv_pool
    from kvrelay.kernels import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1]),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.tensor([2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        max_query_len=2,
        max_context_len=2,
    )
    hidden, x = torch.zeros(2, c.hidden_size), torch.zeros(2, c.hidden_size)
    cos, sin = model.rope_table(16)
    positions = torch.tensor([0, 1])
    args = (positions, cos, sin, pool, meta.slot_mapping, meta, model.scale)
    assert not decoder.run(hidden.double(), x.double(), *args)  # not fp32: the loop's business
    assert not decoder.run(hidden[:1], x[:1], *args)  # rows that do not match the slots
    meta.precision = "bf16"
    assert not decoder.run(hidden, x, *args)  # bf16 attention needs a bf16 pool
    meta.precision = "fp32"
    with pytest.raises(KernelError, match="positions must be in"):
        decoder.run(hidden, x, torch.tensor([0, 10**6]), *args[1:])
    assert torch.equal(hidden, torch.zeros_like(hidden))  # refused before any layer ran
    ext = cpu_build.load()
    fused = LinearSpec(
        LinearKind.W8A16_GATE_UP_SILU, torch.zeros(1), torch.zeros(1), None, None, 32
    )
    plain = LinearSpec(LinearKind.INT8, torch.zeros(1), torch.zeros(1), None, None, 32)
    layer = (torch.ones(4), torch.ones(4), fused.as_tuple(), plain.as_tuple(), plain.as_tuple(),
             plain.as_tuple(), None, None, True)  # fmt: skip
    with pytest.raises(ValueError, match="only a gate/up projection"):
        ext.CpuDecoder([layer], 1e-5, 1)
    half_norms = LayerSpec(torch.ones(4), torch.ones(4), plain, plain, plain, plain,
                           q_norm=torch.ones(2))  # fmt: skip
    with pytest.raises(KernelError, match="a layer's q and k head norms come together"):
        CpuDecoder([half_norms], 1e-5, 1)
