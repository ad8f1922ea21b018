"""Read HF safetensors weights into our fused (and, on CPU fp32, oneDNN-packed) layers.

Weights are read with `readinto` straight into their destination: faulting fresh pages in from
the kernel side is much faster here than a user-space copy out of a memory map. Packing then
replaces each dense linear weight by its oneDNN layout (see `LlamaForCausalLM.pack_weights`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from kvrelay.core.modelref import ModelNotFoundError
from kvrelay.workers.errors import UnsupportedModelError
from kvrelay.workers.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvrelay.workers.model.gguf_weights import GGUFWeights

logger = logging.getLogger(__name__)

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start offset, {name: {dtype, shape, data_offsets}}) of a safetensors file."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return 8 + header_len, header


def _read_into(f, target: torch.Tensor, info: dict, base: int, name: str) -> None:
    if info["dtype"] not in _ST_DTYPES:
        raise UnsupportedModelError(f"weight {name} has unsupported dtype {info['dtype']}")
    if tuple(target.shape) != tuple(info["shape"]):
        raise UnsupportedModelError(
            f"weight {name} has shape {tuple(info['shape'])}, expected {tuple(target.shape)}"
        )
    dtype = _ST_DTYPES[info["dtype"]]
    start, end = info["data_offsets"]
    f.seek(base + start)
    direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
    buffer = target if direct else torch.empty(info["shape"], dtype=dtype)
    if buffer.numel() and f.readinto(buffer.view(-1).view(torch.uint8).numpy()) != end - start:
        raise UnsupportedModelError(f"weight {name} is truncated")
    if not direct:
        target.copy_(buffer)  # dtype conversion and/or host-to-device copy


def checkpoint_tensors(model: LlamaForCausalLM) -> list[dict[str, torch.Tensor]]:
    """The model's tensors (or slices of its fused ones) by their checkpoint names: those
    outside the layers, then each layer's."""
    top = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not model.config.tie_word_embeddings:
        top["lm_head.weight"] = model.lm_head.dense_weight()  # not packed yet: the tensor
    layers = [
        layer.checkpoint_weights(f"model.layers.{i}.") for i, layer in enumerate(model.layers)
    ]
    return [top, *layers]


def load_weights(
    model: LlamaForCausalLM, directory: Path, pack: bool | None = None
) -> GGUFWeights | None:
    """Fill `model` from the safetensors of `directory`, or from the GGUF file it links
    (`gguf_convert.GGUF_FILE`); pack linears (default: when possible). Returns the GGUF's
    reader (None for safetensors), whose Q8_0 blocks quantization can take."""
    from kvrelay.workers.model.gguf_convert import GGUF_FILE

    pack = model.can_pack() if pack is None else pack
    dests = checkpoint_tensors(model)
    gguf = None
    if (Path(directory) / GGUF_FILE).exists():
        gguf = _load_gguf(Path(directory) / GGUF_FILE, model, dests)
    else:
        _load_safetensors(Path(directory), dests[0], dests[1:])
    model.after_load()
    if pack:
        model.pack_weights()
    return gguf


def _load_gguf(path: Path, model: LlamaForCausalLM, dests: list[dict]) -> GGUFWeights:
    from kvrelay.workers.model.gguf_weights import GGUFWeights

    c = model.config
    weights = GGUFWeights(path, c.num_layers, c.num_heads, c.num_kv_heads)
    for dest in dests:
        for name, target in dest.items():
            weights.read_into(name, target)
    return weights


def _load_safetensors(directory: Path, top: dict, layers: list[dict]) -> None:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory} has no .safetensors weights")
    groups: dict[int, list] = {}  # layer index (-1 = not in a layer) -> (path, base, name, info)
    for path in files:
        base, header = read_safetensors_header(path)
        for name, info in header.items():
            match = _LAYER.match(name)
            groups.setdefault(int(match.group(1)) if match else -1, []).append(
                (path, base, name, info)
            )
    handles: dict[Path, BinaryIO] = {}
    try:
        _fill(groups.pop(-1, []), top, handles)
        for i, dest in enumerate(layers):
            _fill(groups.pop(i, []), dest, handles)
    finally:
        for f in handles.values():
            f.close()
    if groups:
        logger.debug("ignoring weights of layers %s", sorted(groups))


def _fill(entries: list, dest: dict, handles: dict) -> None:
    for path, base, name, info in sorted(entries, key=lambda e: (e[0], e[3]["data_offsets"][0])):
        target = dest.pop(name, None)
        if target is None:
            logger.debug("ignoring weight %s", name)
            continue
        if path not in handles:
            handles[path] = path.open("rb", buffering=0)
        _read_into(handles[path], target, info, base, name)
    if dest:
        raise UnsupportedModelError(f"the checkpoint lacks weights: {sorted(dest)[:5]}")
