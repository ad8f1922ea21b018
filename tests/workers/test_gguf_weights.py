"""A GGUF served from its own file: the prepared directory links it, every load dequantizes
its blocks straight into the model, with the bits of the fp32 conversion."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import read_config, resolve_model
from kvrelay.kernels import cpu_build
from kvrelay.workers.errors import UnsupportedModelError
from kvrelay.workers.model import gguf_convert, loader
from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.gguf_convert import GGUF_FILE, convert_gguf, read_gguf
from kvrelay.workers.model.gguf_weights import GGUFWeights
from kvrelay.workers.model.weights import checkpoint_tensors, load_weights
from tests.workers.gguf_files import tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty model cache (the C++ kernels already loaded: a fresh cache would build them)."""
    cpu_build.load()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model(directory):
    config = ModelConfig.from_hf(read_config(directory))
    with torch.inference_mode():
        model = loader.model_class(config.model_type)(config, torch.float32, torch.device("cpu"))
        load_weights(model, directory, pack=False)
    return model


def _assert_same_weights(a, b) -> int:
    count = 0
    for ours, theirs in zip(checkpoint_tensors(a), checkpoint_tensors(b), strict=True):
        assert sorted(ours) == sorted(theirs)
        for name, tensor in ours.items():
            other = theirs[name].contiguous()
            assert torch.equal(tensor.contiguous().view(torch.int32), other.view(torch.int32)), name
            count += 1
    return count


@pytest.mark.parametrize("kquants", [False, True], ids=["q8-q4", "k-quants"])
@pytest.mark.parametrize("arch", gguf_convert.ARCHITECTURES)
def test_each_architecture_loads_the_bits_of_its_fp32_conversion(tmp_path, cache, arch, kquants):
    """Per family (Llama's q/k rows, Gemma's 1 + w norms, Phi-3's fused tensors, Qwen2's
    biases), per block type: the linked file loads as the safetensors conversion does."""
    source = tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, kquants=kquants)
    kinds = {t.ggml_type for t in read_gguf(source).tensors}  # F32, Q4_0, Q8_0 (Q5_0, K-quants)
    assert kinds == ({0, 6, 8, 12, 13, 14} if kquants else {0, 2, 8})
    directory = loader.prepare_model(source, progress=False)
    files = sorted(p.name for p in directory.iterdir())
    assert GGUF_FILE in files and not any(f.endswith(".safetensors") for f in files)
    assert (directory / GGUF_FILE).resolve() == source.resolve()
    converted = tmp_path / "fp32"
    converted.mkdir()
    convert_gguf(source, converted)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        if (converted / name).exists():
            assert (directory / name).read_bytes() == (converted / name).read_bytes(), name
    assert _assert_same_weights(_model(directory), _model(converted)) > 10


def test_the_numpy_fallback_gives_the_kernels_bits(tmp_path, monkeypatch):
    source = tiny_gguf(tmp_path / "tiny.gguf", "llama", kquants=True)
    weights = GGUFWeights(source, num_layers=2, num_heads=4, num_kv_heads=2)
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
             "model.layers.0.self_attn.o_proj.weight"]  # fmt: skip
    fast = {n: torch.empty(weights.shape(n)) for n in names}
    for name, target in fast.items():
        weights.read_into(name, target)
    monkeypatch.setattr("kvrelay.kernels.dequantize_gguf", lambda *args: False)
    for name, target in fast.items():
        slow = torch.empty_like(target)
        weights.read_into(name, slow)
        assert torch.equal(slow.view(torch.int32), target.view(torch.int32)), name


def test_q8_blocks_are_the_files_values_and_scales(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    weights = GGUFWeights(source, num_layers=2, num_heads=4, num_kv_heads=2)
    name = "model.layers.0.self_attn.q_proj.weight"  # Q8_0
    q, scales = weights.q8_blocks(name)
    assert (q.dtype, tuple(q.shape), scales.dtype, tuple(scales.shape)) == (
        torch.int8, (64, 64), torch.float32, (64, 2)
    )  # fmt: skip
    dense = torch.empty(64, 64)
    weights.read_into(name, dense)
    product = (q.view(64, 2, 32).float() * scales[:, :, None]).view(64, 64)
    assert torch.equal(product.view(torch.int32), dense.view(torch.int32))
    assert weights.q8_blocks("model.layers.0.mlp.gate_proj.weight") is None  # Q4_0


def test_llama_q_and_k_rows_are_unpermuted_in_the_blocks(tmp_path):
    """llama's q/k rows come back in the checkpoint's order before dequantizing: the int8 blocks
    (the Q8_0 shortcut) and the fp32 values agree."""
    source = tiny_gguf(tmp_path / "tiny.gguf", "llama")
    weights = GGUFWeights(source, num_layers=2, num_heads=4, num_kv_heads=2)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        q, scales = weights.q8_blocks(name)
        dense = torch.empty(weights.shape(name))
        weights.read_into(name, dense)
        product = (q.view(q.shape[0], -1, 32).float() * scales[:, :, None]).view(q.shape)
        assert torch.equal(product, dense), name


def test_a_tensor_of_the_wrong_shape_is_refused_when_prepared(tmp_path, cache):
    source = tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", head_dim=16)  # the config says 128
    with pytest.raises(UnsupportedModelError) as refused:
        loader.prepare_model(source, progress=False)
    assert (
        f"{source}: tensor model.layers.0.self_attn.q_proj.weight has shape (64, 64), its "
        "config needs (512, 64)"
    ) in str(refused.value)
    assert not list((cache / "models").glob("qwen3*/kvrelay.json"))


def test_a_missing_tensor_is_named(tmp_path):
    source = tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    weights = GGUFWeights(source, num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"tiny.gguf lacks the tensor lm_head.weight"):
        weights.shape("lm_head.weight")  # tied: the file has no output.weight
    assert weights.gguf_name("model.layers.1.mlp.down_proj.weight") == "blk.1.ffn_down.weight"


def test_smollm2_loads_as_before(model_dir, loaded_model):
    """The bundled model: its directory links the GGUF; its fp32 weights are the conversion's."""
    assert (model_dir / GGUF_FILE).resolve() == resolve_model(None).source.resolve()
    assert not list(model_dir.glob("*.safetensors"))
    hf = loader.prepare_hf_checkpoint(progress=False)
    from safetensors.torch import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    model = loaded_model.model
    assert torch.equal(model.embed, tensors["model.embed_tokens.weight"])
    down = model.layers[3].down.dense_weight()
    assert torch.equal(down, tensors["model.layers.3.mlp.down_proj.weight"])


def test_q8_0_tensors_keep_their_int8_values_in_the_int8_formats(tmp_path, cache, monkeypatch):
    """int8-weight-only and q8_0 take a Q8_0 weight's blocks as they are; a weight with a part
    of another type (Q4_0 gate beside a Q8_0 up) is quantized from its fp32 values."""
    from kvrelay import kernels
    from kvrelay.workers.model import quant

    if not kernels.int8_linear_available():
        pytest.skip("the C++ int8 kernels are not built here")
    source = tiny_gguf(tmp_path / "tiny.gguf", "qwen2")  # q/k/v, o, up, embed Q8_0; gate, down Q4_0
    quantized: list[tuple[int, ...]] = []
    original = quant.Int8WeightLinear.quantize

    def counting(weight):
        quantized.append(tuple(weight.shape))
        return original(weight)

    monkeypatch.setattr(quant.Int8WeightLinear, "quantize", staticmethod(counting))
    for method in ("int8-weight-only", "q8_0"):
        quantized.clear()
        loaded = loader.load_model(source, progress=False, quantization=method, device="cpu")
        assert sorted(quantized) == [(64, 128)] * 2 + [(256, 64)] * 2  # down, gate/up per layer
        weights = GGUFWeights(source, num_layers=2, num_heads=4, num_kv_heads=2)
        q, scales = weights.q8_blocks("model.layers.1.self_attn.o_proj.weight")
        pack = kernels.pack_int8_weight if method == "int8-weight-only" else kernels.pack_q8_weight
        assert torch.equal(loaded.model.layers[1].o.weight.packed, pack(q, scales).packed)
        assert torch.equal(loaded.model.layers[1].o.weight.scales, pack(q, scales).scales)
