"""The engine on a CUDA GPU (bf16): greedy tokens and logprobs are bitwise the same alone, in a
batch, prefilled in chunks, and with decode steps replayed as CUDA graphs or run eagerly."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def make_engine(model_dir):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.model.loader import load_model

    loaded = load_model(progress=False, device="cuda")
    assert loaded.dtype == torch.bfloat16

    def make(**kw):
        kw.setdefault("kv_cache_bytes", 256 << 20)
        kw.setdefault("speculation", "off")
        return Engine(EngineConfig(device="cuda", **kw), loaded=loaded)

    return make


def _prompts(engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    chat = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Write a haiku about rain.", "Hi")
    ]
    rand = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
            for n in torch.randint(5, 300, (9,), generator=g)]  # fmt: skip
    return chat + rand


def test_greedy_same_alone_batched_chunked_graphs_and_eager(make_engine):
    from kvrelay.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    graphs = make_engine(max_num_seqs=16)
    prompts = _prompts(graphs)
    batch = graphs.generate(prompts, params)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.disabled is None
    assert 16 in graphs.runner.graphs.graphs  # 12 sequences replay the 16-row graph
    eager = make_engine(max_num_seqs=16, cuda_graphs=False).generate(prompts, params)
    chunked = make_engine(max_num_seqs=4, max_num_batched_tokens=32)
    for i, out in enumerate(batch):
        assert len(out.output_token_ids) == 24
        assert eager[i].output_token_ids == out.output_token_ids, i
        assert eager[i].new_logprobs == out.new_logprobs, i
        if i in (0, 4, 11):
            alone = graphs.generate([prompts[i]], params)[0]  # the 1-row graph
            assert alone.output_token_ids == out.output_token_ids, i
            assert alone.new_logprobs == out.new_logprobs, i
            small = chunked.generate([prompts[i]], params)[0]  # prefill in 32-token chunks
            assert small.output_token_ids == out.output_token_ids, i
            assert small.new_logprobs == out.new_logprobs, i
    assert 1 in graphs.runner.graphs.graphs
    # the answer is sensible, not only self-consistent
    text = graphs.tokenizer.decode(batch[0].output_token_ids)
    assert "Paris" in text, text
