"""Shared model fixtures (loaded once per session) and a helper to build forward batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvrelay.kernels import AttentionMetadata


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model directory (converts the GGUF on first use, ~5 s)."""
    from kvrelay.workers.model.loader import prepare_model

    return prepare_model(progress=False)


@pytest.fixture(scope="session")
def loaded_model(model_dir):
    """Our SmolLM2-135M-Instruct, fp32 on CPU (LoadedModel)."""
    from kvrelay.workers.model.loader import load_model

    return load_model(progress=False, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """transformers' LlamaForCausalLM on the GGUF's fp32 safetensors (the reference)."""
    from transformers import AutoModelForCausalLM

    from kvrelay.workers.model.loader import prepare_hf_checkpoint

    directory = prepare_hf_checkpoint(progress=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


@dataclass(slots=True)
class SeqChunk:
    """`token_ids` of one sequence at positions start.., stored in `block_ids` pages."""

    block_ids: list[int]
    start: int
    token_ids: list[int]
    all_logits: bool = True  # logits for every row, else only the last


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    rows: list[tuple[int, int]] = field(default_factory=list)  # (seq index, position) per logit


def make_batch(chunks: list[SeqChunk], page_size: int) -> Batch:
    """Flatten sequence chunks into one forward step (tokens, slots, block tables, logits rows)."""
    ids, pos, slots, logits_idx, rows, qsl, ctx = [], [], [], [], [], [0], []
    width = max(len(c.block_ids) for c in chunks)
    tables = torch.full((len(chunks), width), -1, dtype=torch.int32)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
        for j, tok in enumerate(c.token_ids):
            p = c.start + j
            if c.all_logits or j == len(c.token_ids) - 1:
                logits_idx.append(len(ids))
                rows.append((i, p))
            ids.append(tok)
            pos.append(p)
            slots.append(c.block_ids[p // page_size] * page_size + p % page_size)
        qsl.append(len(ids))
        ctx.append(c.start + len(c.token_ids))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(len(c.token_ids) for c in chunks),
        max_context_len=max(ctx),
    )
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        meta=meta,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long),
        rows=rows,
    )


def run_batch(model, kv_pool: torch.Tensor, chunks: list[SeqChunk], page_size: int,
              device: str = "cpu"):  # fmt: skip
    """One forward on `device` (the model's and the pool's); returns {(seq index, position):
    logits row}."""
    from tests.kernels.helpers import meta_on

    b = make_batch(chunks, page_size)
    meta = b.meta if device == "cpu" else meta_on(b.meta, device)
    ids, positions, indices = (t.to(device) for t in (b.input_ids, b.positions, b.logits_indices))
    logits = model(ids, positions, kv_pool, meta, indices)
    return {row: logits[k] for k, row in enumerate(b.rows)}


def quantized_engine_factory(quantization: str):
    """A module-scoped `make_engine` fixture: make(**kw) builds an Engine (64 blocks and fp32
    KV pages unless given: the tests compare the weight schemes with fp32 and pin values
    measured on fp32 pages) over the model loaded once with `quantization`."""

    @pytest.fixture(scope="module")
    def make_engine(model_dir):
        from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
        from kvrelay.workers.model.loader import load_model

        loaded = load_model(progress=False, dtype="float32", device="cpu",
                            quantization=quantization)  # fmt: skip

        def make(**kw):
            kw.setdefault("num_blocks", 64)
            kw.setdefault("kv_cache_dtype", "fp32")
            return Engine(EngineConfig(quantization=quantization, **kw), loaded=loaded)

        return make

    return make_engine


# fp32's greedy answer to "What is the capital of France?": "The capital of France is Paris."
FP32_CAPITAL_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def greedy_capital_answer(engine, **params):
    """The engine's greedy output (12 tokens at most) for "What is the capital of France?"."""
    from kvrelay.core.sampling import SamplingParams

    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    return engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, **params))[0]


def check_alone_equals_in_batch_of_8_and_chunked(make_engine) -> None:
    """Greedy tokens and logprobs of a prompt alone (prefilled in chunks of <= 16) equal its
    row in a batch of 8."""
    from kvrelay.core.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 60, (8,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    batch = make_engine().generate(prompts, params)
    engine = make_engine(max_num_batched_tokens=16)
    for i in (0, 5):
        alone = engine.generate([prompts[i]], params)[0]
        assert alone.output_token_ids == batch[i].output_token_ids
        assert alone.new_logprobs == batch[i].new_logprobs


def outputs_in_each_variant(make_engine, prompt_lengths, max_tokens: int) -> dict:
    """{ISA variant: [(greedy token ids, logprobs)] of random prompts of `prompt_lengths`
    (seeded: the same prompts on every call)} for each C++ kernel variant the CPU runs (a
    fresh engine per variant); skips the test where the CPU runs only one."""
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.kernels import cpu_build

    supported = cpu_build.supported_variants()
    if len(supported) < 2:
        pytest.skip(f"this CPU runs one kernel variant only ({', '.join(supported)})")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in prompt_lengths]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)
    results = {}
    for variant in supported:
        with cpu_build.use_variant(variant):
            outs = make_engine().generate(prompts, params)
        results[variant] = [(o.output_token_ids, o.new_logprobs) for o in outs]
    return results
