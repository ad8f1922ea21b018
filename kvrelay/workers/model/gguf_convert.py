"""GGUF -> Hugging Face directory (config.json, generation_config.json, tokenizer files, fp32
`model.safetensors`) in seconds: the files transformers' conversion writes, byte for byte.

transformers' GGUF path (`from_pretrained(gguf_file=...)`, `save_pretrained`) spends most of its
time parsing the file's metadata with `gguf.GGUFReader`, one memmap slice per vocabulary string
(Gemma 3's 262k tokens: 14 s a parse on a busy 2-core host), three times: for the tokenizer's
config, the model's config and the tensors. Here the header is parsed once, string arrays walked
and kept as their length; the config dict is computed as its `load_gguf_checkpoint` computes it
and handed to transformers, which still builds the config object and the tokenizer; tensors are
dequantized by gguf's own numpy block functions (those `gguf.quants.dequantize` calls, so the bits
are the same) in row chunks on threads (numpy releases the GIL) while the tokenizer is built; the
names and fixes are transformers' (its name table, Llama's q/k un-permutation, Gemma's 1 + w
norms), and the safetensors file is written as safetensors writes it.

`convert_gguf(path, out)` writes the directory; `UnsupportedGGUFError` says the file is not one
this module converts (the loader converts it with transformers instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.workers.errors import ModelLoadError

GGUF_FILE = "model.gguf"  # in the directory `link_gguf` writes: a link to the file
# GGUF `general.architecture` values converted here: the decoder families kvrelay serves that
# transformers' GGUF loader knows (llama.cpp files Mistral's dense models under "llama";
# transformers has no GGUF config mapping for smollm3, so neither way converts those).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

# ggml type ids stored as plain values, not blocks
_F32, _F16, _BF16 = 0, 1, 30
# metadata scalar value types -> struct format (8 is a string, 9 an array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# elements of one dequantization task: big enough that numpy runs long without the GIL,
# small enough that two threads share a big tensor evenly
_CHUNK_ELEMENTS = 1 << 21


class UnsupportedGGUFError(ModelLoadError, ValueError):
    """The file's architecture or one of its tensor types is not converted by this module."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, torch-order shape, ggml type and bytes."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    """A GGUF file's metadata (string arrays as their length) and tensor table."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def _block_size(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) of one block of `ggml_type`; UnsupportedGGUFError when gguf lacks it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise UnsupportedGGUFError(f"unknown ggml tensor type {ggml_type}") from None


def read_gguf(path: str | os.PathLike, tensors: bool = True) -> GGUFFile:
    """Parse the header and (`tensors`) the tensor table of a GGUF v2/v3 file (no tensor data
    is read)."""
    path = Path(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(blob)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (2 or 3 expected)")
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    def value(at: int, kind: int) -> tuple[Any, int]:
        if kind in _SCALAR:
            fmt = _SCALAR[kind]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALAR:
                fmt = _SCALAR[item]
                width = struct.calcsize(fmt)
                if count > 4096:  # scores, token types: not needed here, skipped
                    return count, at + width * count
                return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, at)), at + width * count
            if item == _STRING:  # a vocabulary or merge table: walked, kept as its length
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, at)
                    at += 8 + n
                return count, at
            raise ValueError(f"{path}: GGUF array of value type {item}")
        raise ValueError(f"{path}: unknown GGUF value type {kind}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = value(pos + 4, kind)
    if not tensors:
        return GGUFFile(path, metadata)
    entries = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    infos = []
    for name, shape, ggml_type, offset in entries:
        elements = int(np.prod(shape, dtype=np.int64))
        block_elements, block_bytes = _block_size(ggml_type)
        nbytes = elements // block_elements * block_bytes
        infos.append(TensorInfo(name, shape, ggml_type, data_start + offset, nbytes))
    return GGUFFile(path, metadata, infos)


def config_dict(gguf: GGUFFile) -> dict[str, Any]:
    """The config dict transformers' `load_gguf_checkpoint(..., return_tensors=False)["config"]`
    builds for this file (its key mapping, applied the same way to the same values)."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = gguf.architecture
    if architecture not in ARCHITECTURES:
        raise UnsupportedGGUFError(f"GGUF architecture {architecture!r} is not converted here")
    # transformers: `"mistral" in read_field(reader, "general.name")`, a list: the whole name
    updated = "mistral" if gguf.metadata.get("general.name") == "mistral" else architecture
    names = {t.name for t in gguf.tensors}
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(
        updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
    )
    for key, default in defaults.items():
        config.setdefault(key, default)
    renames: dict[str, dict[str, Any]] = GGUF_TO_TRANSFORMERS_MAPPING["config"]  # type: ignore[assignment]
    for key, raw in gguf.metadata.items():
        key = key.replace(architecture, updated)
        prefix, _, config_key = key.partition(".")
        value = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        target = renames.get(prefix, {}).get(config_key, -1)
        if target is not None and target != -1:
            config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # the GGUF holds the text backbone only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = gguf.metadata["tokenizer.ggml.tokens"]  # its length, as read
    return config


@contextlib.contextmanager
def _known_config(path: Path, config: dict[str, Any]) -> Iterator[None]:
    """transformers' `load_gguf_checkpoint(path, return_tensors=False)` answers with `config`
    while inside: AutoConfig and AutoTokenizer call it for the config of a GGUF whose
    architecture their fast reader does not cover, and it parses the whole file with
    `gguf.GGUFReader` each time (the bulk of transformers' conversion time)."""
    from transformers import modeling_gguf_pytorch_utils as legacy

    original = legacy.load_gguf_checkpoint

    def load_gguf_checkpoint(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if not return_tensors and Path(gguf_checkpoint_path).resolve() == path.resolve():
            return {"config": dict(config)}
        return original(gguf_checkpoint_path, return_tensors, *args, **kwargs)

    legacy.load_gguf_checkpoint = load_gguf_checkpoint
    try:
        yield
    finally:
        legacy.load_gguf_checkpoint = original


def _name_map(model, gguf_arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF state-dict name, as transformers' `get_gguf_hf_weights_map`
    derives it from the model's state dict and gguf's tensor name table (one table here; it
    builds the same one again for every submodule)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == gguf_arch)
    table = get_tensor_name_map(arch, num_layers)

    def walk(module, qual_name: str) -> dict[str, str]:
        found: dict[str, str] = {}
        for hf_name in module.state_dict(keep_vars=True):
            name, suffix = hf_name, ""
            if hf_name.endswith((".weight", ".bias")):
                name, suffix = hf_name.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = table.get_name(name)
            if gguf_name is not None:
                found[gguf_name + suffix] = qual_name + hf_name
        for child_name, child in module.named_children():
            sub = walk(child, f"{qual_name}{child_name}.")
            found.update({k: v for k, v in sub.items() if k not in found})
        return found

    return walk(model, "")


def _meta_model(config):
    """The causal-LM module transformers would build for `config`, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _saved_names(model) -> list[str]:
    """The state-dict names save_pretrained writes: each tensor once (a tied one under its
    first name)."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        names.append(name)
    return names


def _dequantize_rows(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """fp32 values of `rows` (uint8 blocks, or the raw values of an F32/F16/BF16 tensor),
    computed as `gguf.quants.dequantize` computes them, bit for bit."""
    if ggml_type == _F32:
        return rows.view(np.float32)
    if ggml_type == _F16:
        return rows.view(np.float16).astype(np.float32)
    if ggml_type == _BF16:
        return (rows.view(np.int16).astype(np.int32) << 16).view(np.float32)
    return _block_kind(ggml_type).dequantize_rows(rows)


def _block_kind(ggml_type: int) -> Any:
    """gguf's class for a block type (None for F32/F16/BF16); UnsupportedGGUFError where gguf
    has no dequantization for it."""
    from gguf import GGMLQuantizationType, quants

    if ggml_type in (_F32, _F16, _BF16):
        return None
    try:
        kind = quants._type_traits.get(GGMLQuantizationType(ggml_type))
    except ValueError:
        kind = None
    if kind is None:
        raise UnsupportedGGUFError(f"no dequantization for ggml type {ggml_type}")
    kind.init_grid()  # the IQ types' lookup grids, built once (not thread-safe to race on)
    return kind


class _Dequantizer:
    """Dequantizes a GGUF file's tensors into fp32 arrays on a thread pool, row chunks as tasks,
    while the caller's thread does other work (numpy releases the GIL in its loops)."""

    def __init__(self, gguf: GGUFFile, infos: list[TensorInfo], threads: int):
        # copy-on-write: torch.from_numpy wants a writable array (nothing writes to it)
        blob = np.memmap(gguf.path, dtype=np.uint8, mode="c")
        self.arrays = {t.name: np.empty(t.shape, dtype=np.float32) for t in infos}
        self.elements = sum(a.size for a in self.arrays.values())
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gguf-dequant")
        self.futures: list[Future[int]] = []
        for t in infos:
            rows = int(np.prod(t.shape[:-1], dtype=np.int64))
            raw = blob[t.start : t.start + t.nbytes].reshape(rows, t.nbytes // rows)
            dst = self.arrays[t.name].reshape(rows, t.shape[-1])
            step = max(1, _CHUNK_ELEMENTS // max(t.shape[-1], 1))
            for r in range(0, rows, step):
                self.futures.append(
                    self.pool.submit(
                        _dequantize_into, raw[r : r + step], t.ggml_type, dst[r : r + step]
                    )
                )

    def wait(self, done: Callable[[int], None]) -> dict[str, np.ndarray]:
        """The arrays, once every chunk is in; `done(elements)` after each chunk."""
        try:
            for future in as_completed(self.futures):
                done(future.result())
        finally:
            self.cancel()
        return self.arrays

    def cancel(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _dequantize_into(raw: np.ndarray, ggml_type: int, dst: np.ndarray) -> int:
    """`raw` rows dequantized into `dst`: the C++ kernel where it covers the type, gguf's
    numpy functions otherwise (the same bits)."""
    import torch

    from kvrelay.kernels import dequantize_gguf

    rows = dst.reshape(raw.shape[0], -1)
    done = rows.size and dequantize_gguf(torch.from_numpy(raw), ggml_type, torch.from_numpy(rows))
    if not done:
        dst[...] = _dequantize_rows(raw, ggml_type).reshape(dst.shape)
    return dst.size


def _process(arrays: dict[str, np.ndarray], gguf_arch: str, config: dict[str, Any]) -> None:
    """Undo llama.cpp's converter as transformers' tensor processors do, in place: Llama's q/k
    rows permuted for its rotary layout; Gemma's RMSNorm weights stored as w + 1."""
    if gguf_arch == "llama":
        heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
        if heads is None or kv_heads is None:
            return
        for name, w in arrays.items():
            if ".attn_q." in name or ".attn_k." in name:
                n = heads if ".attn_q." in name else kv_heads
                dim = w.shape[0] // n // 2
                arrays[name] = np.ascontiguousarray(
                    w.reshape(n, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
                )
    elif gguf_arch in ("gemma2", "gemma3"):
        for name, w in arrays.items():
            if "norm.weight" in name:
                arrays[name] = w - 1


def _threads() -> int:
    try:
        return max(1, min(len(os.sched_getaffinity(0)), 8))
    except AttributeError:  # not Linux
        return max(1, min(os.cpu_count() or 1, 8))


class _Progress:
    """One line per stage (what a log file wants); on a terminal, also a percentage redrawn in
    place while the dequantization finishes."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say = say
        self.tty = say is not None and sys.stderr.isatty()
        self.total = self.count = 0
        self.shown = -1

    def stage(self, msg: str) -> None:
        if self.say is not None:
            self.say(msg)

    def advance(self, n: int) -> None:
        self.count += n
        if not self.tty or not self.total:
            return
        pct = 100 * self.count // self.total
        if pct != self.shown:
            self.shown = pct
            end = "\n" if self.count >= self.total else ""
            print(f"\rkvrelay:   dequantized {pct:3d}%", end=end, file=sys.stderr, flush=True)


def convert_gguf(
    path: str | os.PathLike,
    out: str | os.PathLike,
    say: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> dict[str, float]:
    """Write the HF-format directory of the GGUF file `path` into the existing directory `out`:
    the files transformers' conversion writes, with bit-identical tensors. `say` gets one line
    per stage. Returns seconds: header, config_tokenizer, dequantize (waited for it after
    that), write, total. UnsupportedGGUFError (nothing written) for a file this module does
    not convert."""
    path, out = Path(path).resolve(), Path(out)
    progress = _Progress(say)
    times: dict[str, float] = {}
    start = time.monotonic()
    gguf, config = _checked(path)
    times["header"] = time.monotonic() - start

    threads = threads or _threads()
    dequantizer = _Dequantizer(gguf, gguf.tensors, threads)
    # the stage lines start as the transformers path's did: `kvrelay up` reads its phases off them
    progress.stage(
        f"loading and dequantizing {len(gguf.tensors)} tensors "
        f"({dequantizer.elements / 1e6:.0f} M weights) to fp32 on {threads} threads, "
        "building the config and tokenizer meanwhile"
    )
    try:
        t0 = time.monotonic()
        hf_config, tokenizer = _config_and_tokenizer(path, gguf, config)
        model, names = _model_and_names(hf_config)
        times["config_tokenizer"] = time.monotonic() - t0
        progress.total = dequantizer.elements
        arrays = dequantizer.wait(progress.advance)
    finally:
        dequantizer.cancel()
    times["dequantize"] = time.monotonic() - start - sum(times.values())

    t0 = time.monotonic()
    _process(arrays, gguf.architecture, config)
    by_name = {names[k]: v for k, v in arrays.items() if k in names}
    saved = _saved_names(model)
    missing = sorted(set(saved) - set(by_name))
    if missing:
        raise ValueError(f"{path} lacks tensors the model needs: {', '.join(missing[:5])}")
    tensors = {k: by_name[k] for k in saved}  # each once: save_pretrained drops tied copies
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [
        f"{k} {a.shape} (the model: {shapes[k]})"
        for k, a in tensors.items()
        if a.shape != shapes[k]
    ]
    if wrong:  # transformers refuses these too (ignore_mismatched_sizes=False)
        raise ValueError(
            f"{path}: tensors of the wrong shape for its config: {', '.join(wrong[:3])}"
        )
    progress.stage(f"writing safetensors ({sum(t.nbytes for t in tensors.values()) / 1e6:.0f} MB)")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-write") as writer:
        written = writer.submit(write_safetensors, out / "model.safetensors", tensors)
        _save_config(hf_config, type(model).__name__, out)  # meanwhile: file writes drop the GIL
        tokenizer.save_pretrained(out)
        written.result()
    del tensors, by_name, arrays
    times["write"] = time.monotonic() - t0
    times["total"] = time.monotonic() - start
    return times


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """fp32 arrays as a safetensors file, byte for byte what `safetensors.torch.save_file(...,
    metadata={"format": "pt"})` writes (compact JSON header, names sorted, padded with spaces to
    8 bytes, data in header order), without its copy of every tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        array = tensors[name]
        if array.dtype != np.float32:
            raise TypeError(f"{name}: {array.dtype}, float32 expected")
        shape = list(array.shape)
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            np.ascontiguousarray(tensors[name]).tofile(f)


def _config_and_tokenizer(path: Path, gguf: GGUFFile, config: dict[str, Any]):
    """(config object, tokenizer), as transformers builds them from the file."""
    from transformers import AutoConfig, AutoTokenizer

    with _known_config(path, config):
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf_config, tokenizer


def _model_and_names(hf_config):
    """(meta-device model, GGUF -> HF tensor names) of `hf_config`, as transformers maps them."""
    model = _meta_model(hf_config)
    # transformers looks the table up under its model_type (Gemma 3's text model aside); "mistral"
    # has none in gguf (transformers' loader fails there), llama.cpp writes it as "llama"
    gguf_arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(
        hf_config.model_type, hf_config.model_type
    )
    return model, _name_map(model, gguf_arch, hf_config.num_hidden_layers)


def _causal_lm_class(hf_config) -> str:
    """The name of transformers' causal-LM class for `hf_config` (config.json's architecture)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type])


def _checked(path: Path) -> tuple[GGUFFile, dict[str, Any]]:
    """The file's header and transformers' config dict; UnsupportedGGUFError, before anything
    is written, for an architecture or a tensor type this module does not convert."""
    gguf = read_gguf(path)
    config = config_dict(gguf)
    for info in gguf.tensors:
        _block_kind(info.ggml_type)
    return gguf, config


def link_gguf(
    path: str | os.PathLike, out: str | os.PathLike, say: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Write the directory kvrelay serves a GGUF file from into the existing directory `out`:
    config.json, generation_config.json and the tokenizer files, as `convert_gguf` writes them,
    and `GGUF_FILE`, a link to the file, whose tensors every load reads from there
    (`gguf_weights`). Returns seconds: header, config_tokenizer, total. UnsupportedGGUFError
    (nothing written) for a file this module does not convert."""
    path, out = Path(path).resolve(), Path(out)
    times: dict[str, float] = {}
    start = time.monotonic()
    gguf, config = _checked(path)
    times["header"] = time.monotonic() - start
    if say is not None:  # `kvrelay up` reads its phases off this line
        say(
            f"reading the tokenizer and config of {path.name} ({len(gguf.tensors)} tensors, read "
            "from the file at every load: no weights are written)"
        )
    t0 = time.monotonic()
    hf_config, tokenizer = _config_and_tokenizer(path, gguf, config)
    _save_config(hf_config, _causal_lm_class(hf_config), out)
    tokenizer.save_pretrained(out)
    os.symlink(path, out / GGUF_FILE)
    times["config_tokenizer"] = time.monotonic() - t0
    times["total"] = time.monotonic() - start
    return times


def _save_config(hf_config, architecture: str, out: Path) -> None:
    """config.json and generation_config.json as `save_pretrained` writes them for the model."""
    import torch
    from transformers import GenerationConfig

    hf_config.architectures = [architecture]
    hf_config.dtype = torch.float32
    hf_config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(hf_config)
    if generation.to_diff_dict():
        generation.save_pretrained(out)


def describe(times: dict[str, float]) -> str:
    """One line of stage times, for a log."""
    return ", ".join(f"{k} {v:.1f} s" for k, v in times.items())


if __name__ == "__main__":  # python -m kvrelay.workers.model.gguf_convert FILE.gguf OUT_DIR
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    print(json.dumps(convert_gguf(sys.argv[1], target, say=print), indent=1))
