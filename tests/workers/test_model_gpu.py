"""The model on CUDA (random weights, SmolLM-135M shapes): a token's logits are bitwise the
same alone, beside 31 decode rows, and when a prefill recomputes its position."""

from __future__ import annotations

import pytest
import torch

from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.llama import LlamaForCausalLM
from tests.workers.conftest import SeqChunk, run_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE = 16
CONFIG = ModelConfig(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_layers=3,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CONFIG, dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [model.embed] + [lin.weight for lin in model.all_linears()[:-1]]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g, device="cuda") * 0.05)
    return model


def _run(model, pool, chunks):
    return run_batch(model, pool, chunks, PAGE, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_do_not_depend_on_the_batch(dtype) -> None:
    model = _model(dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, CONFIG.vocab_size, (40,), generator=g).tolist() for _ in range(32)]
    pool = model.allocate_kv_pool(32 * 3, PAGE)
    blocks = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(32)]
    prefill = _run(model, pool, [SeqChunk(blocks[0], 0, seqs[0])])  # all 40 positions at once
    for i in range(1, 32):
        _run(model, pool, [SeqChunk(blocks[i], 0, seqs[i][:39], all_logits=False)])
    alone = _run(model, pool, [SeqChunk(blocks[0], 39, seqs[0][39:])])
    batch = _run(model, pool, [SeqChunk(blocks[i], 39, seqs[i][39:]) for i in range(32)])
    assert torch.equal(alone[(0, 39)], prefill[(0, 39)])
    assert torch.equal(batch[(0, 39)], prefill[(0, 39)])
    for i in range(1, 32):
        single = _run(model, pool, [SeqChunk(blocks[i], 39, seqs[i][39:])])
        assert torch.equal(batch[(i, 39)], single[(0, 39)]), i
