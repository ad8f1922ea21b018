"""Tiny random Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 / Gemma 3 checkpoints: our
forward vs transformers, and loading."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.loader import load_model
from tests.workers.conftest import SeqChunk, run_batch

PAGE = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
)

ARCHS = {
    "qwen2-bias": (
        "Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)
    ),
    # QK-norm, head_dim apart from hidden / heads, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    # fused qkv_proj / gate_up_proj tensors (full rotary, no scaling: Phi-3-mini-4k's shape)
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)),
    # NoPE every 2nd layer (the released model: every 4th), tied embeddings
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=2, no_rope_layers=None, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=2),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=32)),
    # a window of 16 on every layer: the 70 tokens reach far past it
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    # local (window 8, base 10,000) and global (base 1e6) layers, MQA, QK-norm, (1 + w) norms,
    # sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar, a logit soft cap
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=32, num_key_value_heads=1, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0),
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-bias-mha": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    ),
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _kernels_from_the_default_cache():
    """Load the C++ kernels before the tests point KVRELAY_CACHE_DIR at a temporary directory
    (the build is cached there: a fresh directory would compile them again, ~1 min)."""
    from kvrelay.kernels import cpu_build

    cpu_build.load()


def _tiny_checkpoint(arch: str, path, model_dir):
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(len(arch))
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and norms so that every weight matters
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return hf


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_model_matches_transformers(arch, tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_checkpoint(arch, tmp_path / arch, model_dir)
    loaded = load_model(tmp_path / arch, dtype="float32", device="cpu", progress=False)
    assert loaded.dir.parent == tmp_path / "cache" / "models"
    assert (loaded.dir / "model.safetensors").is_symlink()  # safetensors are linked, not copied
    torch.manual_seed(0)
    tokens = torch.randint(0, COMMON["vocab_size"], (70,)).tolist()  # > original rope length
    pool = loaded.model.allocate_kv_pool(8, PAGE)
    # Chunked: prefill 50 tokens, then a chunk of 17 and 3 decode steps.
    got = run_batch(loaded.model, pool, [SeqChunk([3, 1, 6, 0, 2], 0, tokens[:50])], PAGE)
    got |= run_batch(loaded.model, pool, [SeqChunk([3, 1, 6, 0, 2], 50, tokens[50:67])], PAGE)
    for p in range(67, 70):
        got |= run_batch(
            loaded.model, pool, [SeqChunk([3, 1, 6, 0, 2], p, tokens[p : p + 1])], PAGE
        )
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    ours = torch.stack([got[(0, p)] for p in range(70)])
    assert (ours - ref).abs().max().item() < 1e-4


def test_config_reads_architecture_features(tmp_path, model_dir):
    import json

    for arch in ARCHS:
        _tiny_checkpoint(arch, tmp_path / arch, model_dir)
    cfg = {
        a: ModelConfig.from_hf(json.loads((tmp_path / a / "config.json").read_text()))
        for a in ARCHS
    }
    assert (cfg["qwen2-bias"].qkv_bias, cfg["qwen2-bias"].o_bias) == (True, False)
    assert cfg["qwen2-bias"].tie_word_embeddings and cfg["qwen2-bias"].rope_theta == 1e6
    assert cfg["mistral"].head_dim == 32 and cfg["mistral"].q_size == 128
    assert cfg["smollm3"].rope_layers == (True, False) and cfg["llama3-rope"].rope_layers == ()
    assert (cfg["qwen3"].model_type, cfg["qwen3"].head_dim, cfg["qwen3"].qkv_bias) == (
        "qwen3", 32, False,
    )  # fmt: skip
    assert cfg["llama-bias-mha"].qkv_bias and cfg["llama-bias-mha"].o_bias
    assert cfg["llama-bias-mha"].mlp_bias and cfg["llama-bias-mha"].num_kv_heads == 4
    llama3 = cfg["llama3-rope"]
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_theta == 500000.0
    inv = llama3.inv_freq()
    plain = [1.0 / 500000.0 ** (i / 16) for i in range(0, 16, 2)]
    assert inv[0] == plain[0]  # high frequencies unchanged
    assert inv[-1] == pytest.approx(plain[-1] / 8.0)  # low frequencies divided by factor


@pytest.mark.parametrize("quantization", ["none", "int8-weight-only"])
@pytest.mark.parametrize(
    "arch", ["qwen3", "smollm3", "gemma3", "phi3", "mistral-window", "qwen2-bias"]
)
def test_family_rows_alone_equal_rows_in_a_batch(arch, quantization, tmp_path, monkeypatch,
                                                 model_dir):  # fmt: skip
    """QK-norm runs per head row, NoPE layers write K/V as projected, windows and Gemma's
    norms and GeGLU are row-local: a sequence's logits are
    the same alone and beside another, in fp32 (the Python loop) and with C++ linears (the C++
    decoder, whose logits are the Python loop's to the bit)."""
    from kvrelay.kernels import int8_linear_available
    from kvrelay.workers.model.loader import model_class

    if quantization != "none" and not int8_linear_available():
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_checkpoint(arch, tmp_path / arch, model_dir)
    loaded = load_model(tmp_path / arch, dtype="float32", device="cpu", progress=False,
                        quantization=quantization)  # fmt: skip
    model = loaded.model
    assert type(model) is model_class(model.config.model_type)
    assert (model.cpu_decoder is None) == (quantization == "none")
    ran: list[bool] = []
    if model.cpu_decoder is not None:  # count the steps the C++ decoder took
        run = model.cpu_decoder.run
        monkeypatch.setattr(model.cpu_decoder, "run", lambda *a: ran.append(run(*a)) or ran[-1])
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (21, 9))
    alone = run_batch(model, model.allocate_kv_pool(8, PAGE), [SeqChunk([0, 1], 0, a)], PAGE)
    pool = model.allocate_kv_pool(8, PAGE)
    both = run_batch(model, pool, [SeqChunk([2, 3], 0, b), SeqChunk([0, 1], 0, a)], PAGE)
    for p in range(21):
        assert torch.equal(alone[(0, p)], both[(1, p)]), p
    if model.cpu_decoder is not None:  # the same step through the Python loop
        assert ran == [True, True]
        model.cpu_decoder = None
        loop = run_batch(model, model.allocate_kv_pool(8, PAGE), [SeqChunk([0, 1], 0, a)], PAGE)
        assert all(torch.equal(alone[(0, p)], loop[(0, p)]) for p in range(21))


def test_sliding_windows_are_applied_where_implemented_else_cap_the_context():
    """Mistral's window and Gemma 3's local layers are applied by the decoder (the context is
    the model's whole length); Qwen2/3's windows are not, so a model using one is served within
    it (where its attention is exactly full attention); an unused window changes nothing."""
    from kvrelay.core.modelref import context_length

    mistral = {**COMMON, "model_type": "mistral", "sliding_window": 64}
    assert ModelConfig.from_hf(mistral).max_position_embeddings == 256 == context_length(mistral)
    assert ModelConfig.from_hf(mistral).layer_windows == (64, 64)
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).layer_windows == ()
    qwen = {**COMMON, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 256
    assert ModelConfig.from_hf(qwen).layer_windows == ()
    assert context_length({**qwen, "use_sliding_window": True}) == 32
    gemma = {**COMMON, "model_type": "gemma3_text", "num_hidden_layers": 7,
             "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    cfg = ModelConfig.from_hf(gemma)  # no layer_types: every 6th layer global, as transformers
    assert cfg.layer_windows == (512, 512, 512, 512, 512, 0, 512)
    assert [cfg.rope_set(i) for i in range(7)] == [1, 1, 1, 1, 1, 0, 1]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.activation) == (1e6, 1e4, "gelu_tanh")
    assert cfg.max_position_embeddings == 256 == context_length(gemma)


PHI3 = dict(
    original_max_position_embeddings=64,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.5],
                  "long_factor": [4.0, 4.0, 8.0, 8.0]},
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip


@pytest.mark.parametrize("quantization", ["none", "int8-weight-only"])
def test_phi3_partial_rotary_and_longrope_match_transformers(
    quantization, tmp_path, monkeypatch, model_dir
):
    """Phi-4-mini's shape: RoPE on half of each head's dims (permuted into our pairing at
    load), LongRoPE's short factors and attention factor, fused qkv/gate_up tensors; served
    within the pretraining length (64 here), where transformers uses the short factors too."""
    import transformers

    from kvrelay.kernels import int8_linear_available
    from kvrelay.workers.model.phi3 import Phi3ForCausalLM, head_order

    if quantization != "none" and not int8_linear_available():
        pytest.skip("the C++ CPU kernels are not built")
    assert head_order(8, 4) == [0, 1, 4, 5, 2, 3, 6, 7]
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.Phi3Config(**{**COMMON, **PHI3, "partial_rotary_factor": 0.5})
    torch.manual_seed(11)
    hf = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path / "phi3")
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, tmp_path / "phi3" / name)
    loaded = load_model(tmp_path / "phi3", dtype="float32", device="cpu", progress=False,
                        quantization=quantization)  # fmt: skip
    model = loaded.model
    assert type(model) is Phi3ForCausalLM and model.config.max_position_embeddings == 64
    assert model.config.rotary_dim == 8 and model.config.rope_scaling["attention_factor"] == (
        pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    )
    tokens = torch.randint(0, COMMON["vocab_size"], (60,)).tolist()
    pool = model.allocate_kv_pool(8, PAGE)
    got = run_batch(model, pool, [SeqChunk([0, 1, 2, 3], 0, tokens[:40])], PAGE)
    for p in range(40, 60):
        got |= run_batch(model, pool, [SeqChunk([0, 1, 2, 3], p, tokens[p : p + 1])], PAGE)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    ours = torch.stack([got[(0, p)] for p in range(60)])
    if quantization == "none":
        assert (ours - ref).abs().max().item() < 1e-4
    else:  # int8 weights: close to fp32's logits, and the same greedy tokens
        assert (ours - ref).abs().max().item() < 0.05
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_greedy_equals_transformers_and_resumes_exactly(arch, tmp_path, monkeypatch,
                                                               model_dir):  # fmt: skip
    """Through the engine (paged pool, chunked prefill of 16 tokens, prefix cache): 64 greedy
    tokens equal transformers' `generate`; a sampled request given its first 30 tokens on a
    fresh engine (as a decode worker resumes one) continues with exactly the rest; a prompt
    sharing a cached prefix gets the tokens it gets alone (Mistral's and Gemma 3's windows
    reach back past the cached pages)."""
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_checkpoint(arch, tmp_path / arch, model_dir)
    loaded = load_model(tmp_path / arch, dtype="float32", device="cpu", progress=False)

    def engine() -> Engine:
        config = EngineConfig(num_blocks=64, max_num_batched_tokens=16, speculation="off",
                              kv_cache_dtype="fp32")  # fmt: skip
        return Engine(config, loaded=loaded)

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, COMMON["vocab_size"], (40,), generator=g).tolist()
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ours = engine().generate([prompt], [greedy])[0].new_token_ids
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          min_new_tokens=64)[0, 40:].tolist()  # fmt: skip
    assert ours == ref
    sp = SamplingParams(max_tokens=48, temperature=1.0, seed=1234, ignore_eos=True)
    first = engine()
    full = first.generate([prompt], [sp], ["s"])[0].new_token_ids
    fresh = engine()
    fresh.add_request("s2", prompt, sp, output_token_ids=full[:30])
    rest: list[int] = []
    while fresh.has_unfinished_requests():
        for out in fresh.step():
            rest.extend(out.new_token_ids)
    assert full[:30] + rest == full
    # a longer prompt over `first`'s cached pages: as it is alone on a fresh engine
    longer = prompt + full[:20]
    cached = first.generate([longer], [greedy])[0]
    assert cached.num_cached_tokens >= 48
    assert cached.new_token_ids == engine().generate([longer], [greedy])[0].new_token_ids
