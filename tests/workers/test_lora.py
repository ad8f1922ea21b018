"""LoRA adapters (PEFT format) in the engine: greedy tokens vs transformers + PEFT, mixed
batches bitwise equal to single-adapter runs, pages never shared between adapters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.page_keys import lora_fingerprint, page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.errors import InvalidRequestError, LoraError
from kvrelay.workers.model.lora import parse_modules, read_config

NEW_TOKENS = 24
TIE_TOL = 1e-3
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "a1": (8, 16, ALL, False),
    "a2": (4, 8, ["q_proj", "v_proj"], True),
    "a3": (16, 32, ["gate_proj", "up_proj", "down_proj"], False),
    "a4": (2, 4, ["k_proj", "o_proj"], False),
}
QUESTIONS = ["What is the capital of France?", "Tell me a joke.", "Count to ten."]


@pytest.fixture(scope="module")
def peft_model(hf_model, tmp_path_factory):
    """A copy of the reference model with the four random adapters; saved under `root`."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    model = None
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            use_rslora=rslora,
            init_lora_weights=False,
        )
        if model is None:
            model = get_peft_model(copy.deepcopy(hf_model), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if f".{name}." in key and "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    assert model is not None
    model.save_pretrained(root)  # each adapter in root/<name>
    model.root = root
    return model.eval()


def _modules(root: Path) -> tuple[str, ...]:
    return tuple(f"{name}={root / name}" for name in ADAPTERS)


@pytest.fixture(scope="module")
def engine(loaded_model, peft_model):
    """fp32 pages (transformers' numbers), every adapter loaded at start."""
    return Engine(
        EngineConfig(num_blocks=400, kv_cache_dtype="fp32", lora_modules=_modules(peft_model.root)),
        loaded=loaded_model,
    )


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _run(engine: Engine, requests: list[tuple[str, list[int], str]], sampling: SamplingParams):
    """Run (id, prompt, adapter) requests together: id -> (tokens, logprobs, cached tokens)."""
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, sampling, lora=lora)
    out: dict[str, tuple[list[int], list, int]] = {r[0]: ([], [], 0) for r in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens, lps, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, lps + (o.new_logprobs or []),
                                 o.num_cached_tokens)  # fmt: skip
    return out


def test_greedy_tokens_match_transformers_peft(engine, peft_model):
    prompts = _prompts(engine.tokenizer)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    eos = engine.tokenizer.eos_token_id
    exact, ties = 0, []
    for name in ("a1", "a2", "a3"):
        ours = _run(engine, [(f"{name}-{i}", p, name) for i, p in enumerate(prompts)], greedy)
        peft_model.set_adapter(name)
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                ref = peft_model.generate(
                    input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                    pad_token_id=eos, output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
            ref_tokens = ref.sequences[0, len(prompt) :].tolist()
            got = ours[f"{name}-{i}"][0]
            if got == ref_tokens:
                exact += 1
                continue
            k = next(k for k in range(min(len(got), len(ref_tokens))) if got[k] != ref_tokens[k])
            top2 = torch.topk(ref.logits[k][0], 2).values
            assert float(top2[0] - top2[1]) < TIE_TOL, f"{name} prompt {i} differs at {k}"
            ties.append((name, i, k))
    assert exact >= 8, ties  # of 9; a near-tie in transformers' own logits may go either way
    # the adapters change the answers (the comparison is not of the base model)
    base = _run(engine, [(f"base-{i}", p, "") for i, p in enumerate(prompts)], greedy)
    with_a1 = _run(engine, [(f"a1b-{i}", p, "a1") for i, p in enumerate(prompts)], greedy)
    assert [base[f"base-{i}"][0] != with_a1[f"a1b-{i}"][0] for i in range(3)].count(True) >= 2


def test_mixed_batch_is_bitwise_each_single_run(loaded_model, peft_model):
    # bf16 pages and the C++ kernels (the workers' default); no prefix cache: each run computes
    engine = Engine(
        EngineConfig(num_blocks=600, enable_prefix_caching=False,
                     lora_modules=_modules(peft_model.root)),
        loaded=loaded_model,
    )  # fmt: skip
    prompts = _prompts(engine.tokenizer)
    prompts += [p[: len(p) - 3] for p in prompts]  # 6 prompts of several lengths
    sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=2)
    plan = ["a1", "a2", "a3", "a4", "", "a1", "a2", "", "a3", "a4"]
    requests = [(f"m{k}", prompts[k % len(prompts)], lora) for k, lora in enumerate(plan)]
    mixed = _run(engine, requests, sampling)
    for rid, prompt, lora in requests:
        alone = _run(engine, [(rid, prompt, lora)], sampling)[rid]
        assert mixed[rid][0] == alone[0], (rid, lora)
        assert mixed[rid][1] == alone[1], (rid, lora)  # logprobs: the same floats
    # another worker that loaded them in the other order: other slots, the same bits
    reverse = Engine(
        EngineConfig(num_blocks=600, enable_prefix_caching=False,
                     lora_modules=_modules(peft_model.root)[::-1]),
        loaded=loaded_model,
    )  # fmt: skip
    assert [reverse.loras.stack.slot_of(reverse.loras.get(n)) for n in ADAPTERS] == [3, 2, 1, 0]
    assert _run(reverse, requests, sampling) == mixed
    # the adapters change the tokens of the same prompt and seed
    same_prompt = {lora: mixed[f"m{k}"][0] for k, lora in enumerate(plan) if k % 6 == 0}
    assert len({tuple(v) for v in same_prompt.values()}) == len(same_prompt)


def test_pages_are_never_shared_between_adapters(engine, peft_model):
    # several full pages, run by no other test with this engine
    prompt = engine.tokenizer.encode("Pages of a prompt seen first here. " * 8)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    full = (len(prompt) - 1) // 16 * 16
    assert _run(engine, [("p-a1", prompt, "a1")], one)["p-a1"][2] == 0
    assert _run(engine, [("p-a1b", prompt, "a1")], one)["p-a1b"][2] == full  # its own pages
    assert _run(engine, [("p-base", prompt, "")], one)["p-base"][2] == 0
    assert _run(engine, [("p-a2", prompt, "a2")], one)["p-a2"][2] == 0
    assert _run(engine, [("p-base2", prompt, "")], one)["p-base2"][2] == full
    # the keys: per adapter identity, none the base model's
    keys = {
        lora: page_keys(prompt, 16, lora_fingerprint(engine.fingerprint, lora))
        for lora in ("", engine.loras.get("a1").salt, engine.loras.get("a2").salt)
    }
    firsts = {k[0] for k in keys.values()}
    assert len(firsts) == 3 and keys[""] == page_keys(prompt, 16, engine.fingerprint)
    # a name reloaded with other weights: other pages (its digest is part of the key)
    adapters = engine.loras
    a1 = adapters.get("a1")
    adapters.load("a1", peft_model.root / "a4")
    assert adapters.get("a1").digest != a1.digest
    assert _run(engine, [("p-a1c", prompt, "a1")], one)["p-a1c"][2] == 0
    adapters.load("a1", peft_model.root / "a1")
    assert adapters.get("a1").digest == a1.digest


def test_unload_while_running_keeps_its_slot(engine, peft_model):
    prompt = _prompts(engine.tokenizer)[1]
    sampling = SamplingParams(max_tokens=10, temperature=0.0)
    alone = _run(engine, [("u-ref", prompt, "a3")], sampling)["u-ref"][0]
    loras = engine.loras
    engine.add_request("u-run", prompt, sampling, lora="a3")
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    a3 = loras.get("a3")
    loras.unload("a3")  # the request keeps its adapter and its slot
    assert a3 in loras.stack.slots and "a3" not in loras
    with pytest.raises(LoraError, match="a running request still uses"):
        loras.load("a5", peft_model.root / "a1")
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == alone
    loras.load("a3", peft_model.root / "a3")  # its slot is free again
    assert a3 not in loras.stack.slots and loras.names() == ["a1", "a2", "a3", "a4"]


def test_refusals(engine, peft_model, tmp_path):
    prompt = _prompts(engine.tokenizer)[0]
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded") as info:
        engine.add_request("x", prompt, SamplingParams(max_tokens=1), lora="nope")
    assert info.value.param == "model"
    loras = engine.loras
    assert loras.names() == ["a1", "a2", "a3", "a4"]
    with pytest.raises(LoraError, match="max_loras"):
        loras.load("a5", peft_model.root / "a1")
    loras.unload("a4")
    with pytest.raises(LoraError, match="not a directory"):
        loras.load("a5", tmp_path / "missing")
    with pytest.raises(LoraError, match="no adapter_config.json"):
        loras.load("a5", tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((peft_model.root / "a1" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    with pytest.raises(LoraError, match="rank 32, over max_lora_rank 16"):
        loras.load("a5", bad)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    with pytest.raises(LoraError, match="target_modules"):
        read_config(bad)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        loras.load("a5", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraError, match="cannot read"):
        loras.load("a5", bad)
    with pytest.raises(LoraError, match="is not loaded"):
        loras.unload("a5")
    loras.load("a4", peft_model.root / "a4")
    assert loras.names() == ["a1", "a2", "a3", "a4"]
    assert parse_modules(["x=/a,y=/b", "z=/c"]) == {"x": "/a", "y": "/b", "z": "/c"}
    with pytest.raises(LoraError, match="name=path"):
        parse_modules(["x"])
    with pytest.raises(ConfigError, match="max_loras"):
        Engine(
            EngineConfig(num_blocks=8, max_loras=1, lora_modules=_modules(peft_model.root)),
            loaded=engine.loaded,
        )


def test_quantized_model_mixed_batch(peft_model):
    # int8-weight-only: base-only steps run the C++ decoder, steps with adapter rows the
    # Python loop (the same bits): a base request's tokens never depend on its neighbours
    engine = Engine(
        EngineConfig(num_blocks=300, quantization="int8-weight-only", enable_prefix_caching=False,
                     lora_modules=_modules(peft_model.root)[:2]),
    )  # fmt: skip
    assert engine.loaded.model.cpu_decoder is not None
    prompts = _prompts(engine.tokenizer)
    sampling = SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs=1)
    requests = [("q0", prompts[0], "a1"), ("q1", prompts[1], ""), ("q2", prompts[2], "a2"),
                ("q3", prompts[0], "")]  # fmt: skip
    mixed = _run(engine, requests, sampling)
    for request in requests:
        assert _run(engine, [request], sampling)[request[0]] == mixed[request[0]], request
    assert mixed["q0"][0] != mixed["q3"][0]
