"""`kv_cache_dtype`: 16-bit KV pages under the fp32 model (real SmolLM2, exact comparisons)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.modelref import model_fingerprint
from kvrelay.core.sampling import SamplingParams
from kvrelay.kernels import cpu_build
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from tests.workers.test_engine import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    def make(kv_cache_dtype: str, **kw) -> Engine:
        kw.setdefault("num_blocks", 96)
        return Engine(EngineConfig(kv_cache_dtype=kv_cache_dtype, **kw), loaded=loaded_model)

    return make


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_16bit_pool_is_batch_invariant(make_engine, kv):
    """A 16-bit pool keeps greedy outputs (tokens and logprobs) bitwise the same alone and in a
    batch of other prompts, whatever the chunking."""
    prompts = random_prompts(5, seed=7, lo=5, hi=60)
    engine = make_engine(kv)
    assert engine.runner.kv_pool.dtype == getattr(torch, {"bf16": "bfloat16"}.get(kv, "float16"))
    assert engine.runner.kv_pool.element_size() == 2
    batch = engine.generate(prompts, [GREEDY] * 5, [f"b{i}" for i in range(5)])
    chunked = make_engine(kv, max_num_batched_tokens=16)
    for i in (0, 3):
        for eng in (engine, chunked):
            alone = eng.generate([prompts[i]], [GREEDY], [f"a{i}"])[0]
            assert alone.new_token_ids == batch[i].new_token_ids, (i, kv)
            assert alone.new_logprobs == batch[i].new_logprobs, (i, kv)
    # 16-bit K/V is close to fp32's: the greedy first tokens agree on these prompts
    fp32 = make_engine("fp32").generate(prompts, [GREEDY] * 5, [f"f{i}" for i in range(5)])
    assert [o.new_token_ids[0] for o in fp32] == [o.new_token_ids[0] for o in batch]


def test_fingerprint_is_per_kv_dtype(make_engine, loaded_model):
    auto, fp32 = make_engine("auto", num_blocks=2), make_engine("float32", num_blocks=2)
    bf16, fp16 = make_engine("bf16", num_blocks=2), make_engine("fp16", num_blocks=2)
    # pages in the model dtype keep today's fingerprint; other dtypes are other pages
    assert fp32.fingerprint == loaded_model.fingerprint
    # CPU fp32 model with the C++ kernels: auto is bf16 (the torch path keeps fp32)
    expected = torch.bfloat16 if cpu_build.load() is not None else torch.float32
    assert (auto.runner.kv_pool.dtype, auto.kv_dtype) == (expected, expected)
    assert auto.fingerprint == (bf16 if expected == torch.bfloat16 else fp32).fingerprint
    assert len({fp32.fingerprint, bf16.fingerprint, fp16.fingerprint}) == 3
    assert bf16.fingerprint == model_fingerprint(loaded_model.dir, "float32", "none", "bfloat16")
    assert model_fingerprint(loaded_model.dir, "float32", "none", "fp32") == fp32.fingerprint


def test_auto_resolution_rule(monkeypatch):
    """auto: bf16 for fp32 compute on CPU with the C++ kernels, fp32 on the torch path, the
    model dtype elsewhere; explicit values pass through (normalized)."""
    from kvrelay.workers.model.loader import resolve_kv_dtype, resolve_kv_dtype_name

    assert resolve_kv_dtype_name("auto", "float32", "cpu", kernels=True) == "bfloat16"
    assert resolve_kv_dtype_name("auto", "fp32", "cpu", kernels=False) == "float32"
    assert resolve_kv_dtype_name("auto", "bfloat16", "cpu", kernels=True) == "bfloat16"
    assert resolve_kv_dtype_name("auto", "float32", "cuda", kernels=True) == "float32"
    assert resolve_kv_dtype_name("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_kv_dtype_name("fp16", "float32", "cpu", kernels=True) == "float16"
    assert resolve_kv_dtype_name("fp32", "float32", "cpu", kernels=True) == "float32"
    assert resolve_kv_dtype("auto", torch.float32, "cuda") == torch.float32
    # kernels=None asks cpu_build.load(): None (forced off, no AVX2, failed build) means fp32
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    assert resolve_kv_dtype("auto", torch.float32, "cpu") == torch.float32
    monkeypatch.setattr(cpu_build, "load", lambda: object())
    assert resolve_kv_dtype("auto", torch.float32, torch.device("cpu")) == torch.bfloat16


def test_kv_cache_bytes_hold_twice_the_16bit_pages(make_engine, loaded_model):
    c = loaded_model.config
    fp32_block = c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 4
    budget = 10 * fp32_block + 1
    fp32 = make_engine("fp32", num_blocks=None, kv_cache_bytes=budget)
    bf16 = make_engine("bf16", num_blocks=None, kv_cache_bytes=budget)
    assert (fp32.num_blocks, bf16.num_blocks) == (10, 20)
    assert bf16.runner.kv_pool.nbytes == fp32.runner.kv_pool.nbytes


def test_bad_kv_cache_dtype_is_a_config_error(loaded_model):
    with pytest.raises(ConfigError, match="unsupported kv cache dtype 'int8'; use one of auto"):
        Engine(EngineConfig(kv_cache_dtype="int8", num_blocks=2), loaded=loaded_model)


def test_worker_setting_from_env_and_validated():
    from kvrelay.workers.config import load_worker_config

    env = {"KVRELAY_WORKER_KV_CACHE_DTYPE": "bf16"}
    assert load_worker_config(environ=env).engine.kv_cache_dtype == "bf16"
    flagged = load_worker_config(environ={}, kv_cache_dtype="float16")
    assert flagged.engine.kv_cache_dtype == "float16"
    with pytest.raises(ConfigError, match="unsupported kv cache dtype 'fp8'"):
        load_worker_config(environ={"KVRELAY_WORKER_KV_CACHE_DTYPE": "fp8"})
