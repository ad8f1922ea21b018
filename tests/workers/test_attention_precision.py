"""--attention-precision: what auto resolves to and why a request for bf16 is refused, the
fingerprint; on AMX-BF16 hosts the engine with bf16 attention keeps row, batch and chunk
invariance and gives fp32 attention's greedy answer."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.modelref import model_fingerprint, normalize_attention_precision
from kvrelay.kernels import bf16_attention_available
from kvrelay.workers.model.loader import resolve_attention_precision
from tests.workers.conftest import (
    FP32_CAPITAL_ANSWER,
    check_alone_equals_in_batch_of_8_and_chunked,
    greedy_capital_answer,
)

AMX = bf16_attention_available()
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU")
# (kv dtype, model dtype, device, page size, head_dim, kernels can): every condition bf16 needs
FITS = ("bfloat16", "float32", "cpu", 16, 64, True)


def resolve(precision: str, **changes):
    names = ("kv_dtype", "model_dtype", "device_type", "page_size", "head_dim", "available")
    args = dict(zip(names, FITS, strict=True))
    args.update(changes)
    return resolve_attention_precision(precision, **args)


def test_auto_is_bf16_only_where_every_condition_holds():
    assert resolve("auto") == "bf16"
    assert resolve("auto", head_dim=None) == "bf16"  # unknown head_dim: the worker checks it
    for change in (
        {"available": False},
        {"kv_dtype": "float32"},
        {"kv_dtype": "float16"},
        {"model_dtype": "bfloat16"},
        {"device_type": "cuda"},
        {"page_size": 8},
        {"head_dim": 80},
    ):
        assert resolve("auto", **change) == "fp32", change
    assert resolve("fp32") == "fp32"
    assert resolve("fp32", device_type="cuda", available=False) == "fp32"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"available": False}, "AMX-BF16"),
        ({"kv_dtype": "float32"}, "bf16 KV pages"),
        ({"device_type": "cuda"}, "an fp32 model on CPU"),
        ({"page_size": 24}, "multiple of 16"),
        ({"head_dim": 96}, "head_dim 32, 64, 128 or 256"),
    ],
)
def test_bf16_where_it_cannot_run_says_why(change, says):
    with pytest.raises(ValueError, match=f"--attention-precision bf16 needs .*{says}"):
        resolve("bf16", **change)


def test_names():
    assert normalize_attention_precision(" BF16 ") == "bf16"
    with pytest.raises(ValueError, match="use one of auto, fp32, bf16"):
        normalize_attention_precision("fp8")


def test_fingerprint_says_bf16_attention(model_dir):
    plain = model_fingerprint(model_dir, "float32", "none", "bfloat16")
    assert model_fingerprint(model_dir, "float32", "none", "bfloat16", "fp32") == plain
    bf16 = model_fingerprint(model_dir, "float32", "none", "bfloat16", "bf16")
    assert bf16 != plain
    assert model_fingerprint(model_dir, "float32", "q8_0", "bfloat16", "bf16") not in (bf16, plain)
    with pytest.raises(ValueError, match="resolved to fp32 or bf16"):
        model_fingerprint(model_dir, "float32", "none", "bfloat16", "auto")


@pytest.fixture(scope="module")
def loaded(model_dir):
    from kvrelay.workers.model.loader import load_model

    return load_model(progress=False, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def make_engine(loaded):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    def make(**kw):
        kw.setdefault("num_blocks", 64)
        kw.setdefault("kv_cache_dtype", "bf16")
        kw.setdefault("attention_precision", "bf16")
        return Engine(EngineConfig(**kw), loaded=loaded)

    return make


@pytest.mark.skipif(AMX, reason="AMX-BF16 here: the engine runs it")
def test_engine_refuses_bf16_without_amx(make_engine):
    with pytest.raises(ConfigError, match="needs AMX-BF16"):
        make_engine()
    assert make_engine(attention_precision="auto").attention_precision == "fp32"


@needs_amx
def test_engine_runs_bf16_with_its_fingerprint(make_engine, model_dir):
    engine = make_engine()
    assert engine.attention_precision == "bf16"
    assert engine.fingerprint == model_fingerprint(model_dir, "float32", "none", "bfloat16", "bf16")
    assert make_engine(attention_precision="auto").attention_precision == "bf16"
    assert make_engine(attention_precision="auto", kv_cache_dtype="fp32").attention_precision == (
        "fp32"
    )
    with pytest.raises(ConfigError, match="bf16 KV pages"):
        make_engine(kv_cache_dtype="fp32")
    # the engine alone keeps fp32 attention unless asked: the same bits on every host
    assert make_engine(attention_precision="fp32").attention_precision == "fp32"


@needs_amx
def test_alone_equals_in_batch_of_8_and_chunked(make_engine):
    check_alone_equals_in_batch_of_8_and_chunked(make_engine)


@needs_amx
def test_greedy_answer_is_fp32_attentions(make_engine):
    # q and p rounded to bf16 move the logits less than this prompt's margins (perplexity
    # within 0.1% of fp32 attention: docs/benchmarks.md)
    assert greedy_capital_answer(make_engine()).output_token_ids == FP32_CAPITAL_ANSWER


@needs_amx
def test_logprobs_close_to_fp32_attention(make_engine):
    from kvrelay.core.sampling import SamplingParams

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 300)]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True)
    bf16 = make_engine().generate(prompts, params)
    fp32 = make_engine(attention_precision="fp32").generate(prompts, params)
    for a, b in zip(bf16, fp32, strict=True):
        assert a.output_token_ids == b.output_token_ids
        shared = a.new_logprobs[0].keys() & b.new_logprobs[0].keys()
        diffs = [abs(a.new_logprobs[0][t] - b.new_logprobs[0][t]) for t in shared]
        assert len(shared) >= 4 and max(diffs) > 0  # another computation, not fp32 relabelled
        # measured 0.061 at most on these random-token prompts (flat distributions, 30 layers)
        assert max(diffs) < 0.1
