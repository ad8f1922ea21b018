"""The model families on CUDA (tiny random checkpoints built from transformers' own classes, as
in test_model_archs.py): fp32 logits match transformers; bf16 logits of a sequence are bitwise
the same alone, beside another and decoded token by token; the engine on the GPU (paged pool,
chunked prefill, decode steps replayed as CUDA graphs) gives transformers' greedy tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvrelay.workers.model.loader import load_model
from tests.workers.conftest import SeqChunk, run_batch
from tests.workers.test_model_archs import ARCHS, COMMON, _tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE = 16


@pytest.fixture(scope="module")
def tokenizer_dir(request) -> Path:
    """Where the checkpoints take their tokenizer files: the default model's directory, or
    KVRELAY_TEST_TOKENIZER_DIR on a GPU machine the bundled model does not travel to."""
    carried = os.environ.get("KVRELAY_TEST_TOKENIZER_DIR")
    return Path(carried) if carried else request.getfixturevalue("model_dir")


def _load(arch, tmp_path, monkeypatch, tokenizer_dir, dtype):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir)
    loaded = load_model(tmp_path / arch, dtype=dtype, device="cuda", progress=False)
    return hf, loaded


def _run(model, pool, chunks):
    return run_batch(model, pool, chunks, PAGE, device="cuda")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_fp32_logits_on_cuda_match_transformers(arch, tmp_path, monkeypatch,
                                                       tokenizer_dir):  # fmt: skip
    hf, loaded = _load(arch, tmp_path, monkeypatch, tokenizer_dir, "float32")
    assert loaded.model.embed.is_cuda
    torch.manual_seed(0)
    tokens = torch.randint(0, COMMON["vocab_size"], (70,)).tolist()
    pool = loaded.model.allocate_kv_pool(8, PAGE)
    blocks = [3, 1, 6, 0, 2]
    got = _run(loaded.model, pool, [SeqChunk(blocks, 0, tokens[:50])])
    got |= _run(loaded.model, pool, [SeqChunk(blocks, 50, tokens[50:67])])
    for p in range(67, 70):
        got |= _run(loaded.model, pool, [SeqChunk(blocks, p, tokens[p : p + 1])])
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    ours = torch.stack([got[(0, p)].float().cpu() for p in range(70)])
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_bf16_rows_do_not_depend_on_the_batch(arch, tmp_path, monkeypatch,
                                                     tokenizer_dir):  # fmt: skip
    _, loaded = _load(arch, tmp_path, monkeypatch, tokenizer_dir, "bfloat16")
    model = loaded.model
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (40, 9))
    alone = _run(model, model.allocate_kv_pool(8, PAGE), [SeqChunk([0, 1, 2], 0, a)])
    pool = model.allocate_kv_pool(8, PAGE)
    both = _run(model, pool, [SeqChunk([4, 5], 0, b), SeqChunk([0, 1, 2], 0, a)])
    for p in range(40):
        assert torch.equal(alone[(0, p)], both[(1, p)]), p
    # decoded token by token after a prefill of 30, beside the other sequence's decode rows
    pool = model.allocate_kv_pool(8, PAGE)
    _run(model, pool, [SeqChunk([4, 5], 0, b), SeqChunk([0, 1, 2], 0, a[:30])])
    for p in range(30, 40):
        step = _run(model, pool, [SeqChunk([0, 1, 2], p, a[p : p + 1]),
                                  SeqChunk([4, 5], 9, b[:1])])  # fmt: skip
        assert torch.equal(step[(0, p)], alone[(0, p)]), p


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_engine_on_cuda_gives_transformers_greedy_tokens(arch, tmp_path, monkeypatch,
                                                                tokenizer_dir):  # fmt: skip
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    hf, loaded = _load(arch, tmp_path, monkeypatch, tokenizer_dir, "float32")
    config = EngineConfig(device="cuda", num_blocks=64, max_num_batched_tokens=16,
                          speculation="off", kv_cache_dtype="fp32")  # fmt: skip
    engine = Engine(config, loaded=loaded)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (40, 7)]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ours = [o.new_token_ids for o in engine.generate(prompts, [greedy, greedy])]
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                              min_new_tokens=48)[0, len(prompt) :].tolist()  # fmt: skip
        assert got == ref
