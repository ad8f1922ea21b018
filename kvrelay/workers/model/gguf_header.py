"""A GGUF file's metadata header, read up to the key asked for: the architecture in a few
reads, before any conversion (the `gguf` package's reader maps and indexes every tensor first).

Layout (GGUF v2/v3, little endian): magic `GGUF`, u32 version, u64 tensor count, u64 key/value
count, then each pair: u64-length key, u32 value type, value (strings u64-length, arrays u32
element type + u64 count + elements)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from kvrelay.workers.errors import ModelLoadError, UnsupportedModelError
from kvrelay.workers.model.config import SUPPORTED_MODEL_TYPES

# value type -> struct format of a scalar (8 string, 9 array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# llama.cpp's architecture names -> the Hugging Face model_type transformers converts them to
# (llama.cpp files Mistral's dense models under "llama")
GGUF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
                    "phi3": "phi3", "smollm3": "smollm3", "qwen2moe": "qwen2_moe"}  # fmt: skip


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise ValueError("the file ends inside its header")
    return struct.unpack(fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise ValueError(f"a header string of {n} bytes")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:  # skipped, not read: a vocabulary's scores are 100k+ floats
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
            return None
        for _ in range(count):
            _value(f, item)
        return None
    raise ValueError(f"unknown value type {kind}")


def header_value(path: Path, key: str) -> Any:
    """The value of `key` in the GGUF header of `path` (None if absent; arrays are not kept)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic")
            version = _read(f, "<I")
            if version < 2:
                raise ValueError(f"GGUF version {version} (2 or 3 expected)")
            _read(f, "<Q")
            for _ in range(_read(f, "<Q")):
                name, kind = _string(f), _read(f, "<I")
                value = _value(f, kind)
                if name == key:
                    return value
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {exc}") from exc
    return None


def check_gguf_architecture(path: Path) -> str:
    """The model_type a GGUF file converts to; UnsupportedModelError, naming it and the
    supported list, when kvrelay cannot serve it (milliseconds: nothing is converted)."""
    arch = header_value(path, "general.architecture")
    if not isinstance(arch, str):
        raise UnsupportedModelError(f"{path.name}: the GGUF header names no general.architecture")
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} (model_type {model_type!r}) is not "
            f"supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return model_type
