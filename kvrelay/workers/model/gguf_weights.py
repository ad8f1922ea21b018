"""A GGUF file's tensors read straight into a model's weights, by their Hugging Face names.

A GGUF model is served from its own file: the converted directory holds the config and
tokenizer files and a link to the GGUF (`GGUF_FILE`), never a fp32 copy of its weights. At
load each tensor's blocks are dequantized into the model's fp32 tensor in place (the C++
kernel `kernels.dequantize_gguf`, gguf's numpy functions on threads for a type it does not
cover: the same bits either way), with llama.cpp's conversion undone as transformers undoes
it (Llama's q/k rows permuted for its rotary layout, Gemma's RMSNorm weights stored as w + 1).
A Q8_0 tensor can also be handed over as its int8 values and scales (`q8_blocks`): the
int8-weight formats take those without a detour through fp32.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvrelay.workers.errors import UnsupportedModelError
from kvrelay.workers.model.gguf_convert import (
    TensorInfo,
    _block_kind,
    _dequantize_rows,
    read_gguf,
)

_Q8_0 = 8
_Q8_BLOCK = 32  # values per Q8_0 block (then an fp16 scale: 34 bytes)
_CHUNK_ELEMENTS = 1 << 21  # numpy fallback: values per task on the thread pool
# Hugging Face names outside the layers -> GGUF names (llama.cpp's, every family)
_TOP = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
# GGUF architectures whose RMSNorm weights llama.cpp stores as w + 1
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a Hugging Face tensor is in the file, and the fix its rows need."""

    name: str  # the file's
    info: TensorInfo
    rows: np.ndarray | None  # the file's row for each of ours (llama's q/k), None: the same


class GGUFWeights:
    """The tensors of one GGUF file under the names of a Hugging Face checkpoint of
    `num_layers` layers with `num_heads` query and `num_kv_heads` key/value heads."""

    def __init__(self, path: str | os.PathLike, num_layers: int, num_heads: int, num_kv_heads: int):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path = Path(path)
        self.file = read_gguf(self.path)
        self.architecture = self.file.architecture
        arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == self.architecture), None)
        if arch is None:
            raise UnsupportedModelError(
                f"{self.path.name}: GGUF architecture {self.architecture!r}"
            )
        self._table = get_tensor_name_map(arch, num_layers)
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self._by_name = {t.name: t for t in self.file.tensors}
        # copy-on-write: torch.from_numpy wants a writable array (nothing writes to it)
        self._blob = np.memmap(self.path, dtype=np.uint8, mode="c")

    def gguf_name(self, hf_name: str) -> str | None:
        """The file's name for the Hugging Face tensor `hf_name` (None: no such tensor)."""
        stem, _, suffix = hf_name.rpartition(".")
        name = _TOP.get(stem) or self._table.get_name(stem)
        return None if name is None else f"{name}.{suffix}"

    def _source(self, hf_name: str) -> _Source:
        name = self.gguf_name(hf_name)
        info = self._by_name.get(name) if name is not None else None
        if name is None or info is None:
            raise UnsupportedModelError(f"{self.path.name} lacks the tensor {hf_name}")
        rows = None
        kind = name.split(".")[-2]
        if self.architecture == "llama" and kind in self._heads:
            # llama.cpp's converter interleaves each head's rotary halves: row h*2d + j*d + i
            # of the checkpoint is row h*2d + 2i + j of the file
            n = self._heads[kind]
            dim = info.shape[0] // n // 2
            rows = np.arange(info.shape[0]).reshape(n, dim, 2).transpose(0, 2, 1).reshape(-1)
        return _Source(name, info, rows)

    def _raw(self, source: _Source) -> np.ndarray:
        """The tensor's blocks as [rows, bytes per row] (rows in the checkpoint's order)."""
        info = source.info
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = self._blob[info.start : info.start + info.nbytes].reshape(rows, info.nbytes // rows)
        return raw if source.rows is None or len(info.shape) == 1 else raw[source.rows]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self._source(hf_name).info.shape

    def read_into(self, hf_name: str, target: torch.Tensor) -> None:
        """Dequantize the tensor `hf_name` into `target` (its shape; any dtype and device)."""
        from kvrelay.kernels import dequantize_gguf

        source = self._source(hf_name)
        info = source.info
        if tuple(target.shape) != info.shape:
            raise UnsupportedModelError(
                f"weight {hf_name} has shape {info.shape}, expected {tuple(target.shape)}"
            )
        direct = (
            target.device.type == "cpu" and target.dtype == torch.float32 and target.is_contiguous()
        )
        dst = target if direct else torch.empty(info.shape, dtype=torch.float32)
        raw = self._raw(source)
        rows = dst.view(raw.shape[0], -1) if dst.numel() else dst
        if dst.numel() and not dequantize_gguf(torch.from_numpy(raw), info.ggml_type, rows):
            _dequantize_numpy(raw, info.ggml_type, rows.numpy())
        if source.rows is not None and len(info.shape) == 1:  # a bias: its values in order
            dst.copy_(dst[torch.from_numpy(source.rows)])
        if "norm.weight" in source.name and self.architecture in _NORM_PLUS_ONE:
            dst -= 1  # numpy's `w - 1` in fp32, as transformers' Gemma processor does
        if not direct:
            target.copy_(dst)

    def q8_blocks(self, hf_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(int8 q [N, K], fp32 scales [N, K / 32]) of a Q8_0 tensor: its blocks as they are, in
        the layout of `kernels.quantize_int8_weight` (one scale per 32 inputs of each output);
        None for another type."""
        source = self._source(hf_name)
        info = source.info
        if info.ggml_type != _Q8_0 or len(info.shape) != 2:
            return None
        raw = self._raw(source)
        n, k = info.shape
        blocks = raw.reshape(n, k // _Q8_BLOCK, 2 + _Q8_BLOCK)
        scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0]
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k)
        return torch.from_numpy(q), torch.from_numpy(scales.astype(np.float32))


def _dequantize_numpy(raw: np.ndarray, ggml_type: int, out: np.ndarray) -> None:
    """gguf's numpy dequantization of `raw` rows into `out`, in row chunks on threads."""
    _block_kind(ggml_type)  # UnsupportedGGUFError for a type gguf cannot dequantize
    step = max(1, _CHUNK_ELEMENTS // max(out.shape[-1], 1))
    if raw.shape[0] <= step:
        out[...] = _dequantize_rows(raw, ggml_type).reshape(out.shape)
        return

    def chunk(start: int) -> None:
        end = start + step
        out[start:end] = _dequantize_rows(raw[start:end], ggml_type).reshape(out[start:end].shape)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(chunk, range(0, raw.shape[0], step)))


Blocks = tuple[torch.Tensor, torch.Tensor]


def q8_weights(weights: GGUFWeights, tensors: list[dict[str, torch.Tensor]]):
    """`blocks(weight)` for `LlamaForCausalLM.quantize`: the file's Q8_0 values and scales of a
    dense weight whose every checkpoint part (q/k/v of a fused QKV, gate/up) is Q8_0, else
    None. `tensors`: `weights.checkpoint_tensors(model)`, the parts as views into the model's
    weights (a part is found by the storage it views)."""
    parts: dict[int, list[tuple[int, str]]] = {}
    for dest in tensors:
        for name, tensor in dest.items():
            if tensor.dim() == 2:
                ptr = tensor.untyped_storage().data_ptr()
                parts.setdefault(ptr, []).append((int(tensor.storage_offset()), name))

    def blocks(weight: torch.Tensor) -> Blocks | None:
        names = sorted(parts.get(weight.untyped_storage().data_ptr(), []))
        found = [weights.q8_blocks(name) for _, name in names]
        if not found or any(b is None for b in found):
            return None
        q = torch.cat([b[0] for b in found if b is not None])
        scales = torch.cat([b[1] for b in found if b is not None])
        if tuple(q.shape) != tuple(weight.shape) or int(q.min()) < -127:
            return None  # not the whole weight, or a -128 the int8 kernels do not take
        return q, scales

    return blocks
