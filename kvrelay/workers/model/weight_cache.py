"""The quantized model, written once in the engine's own format and mapped by every later start.

Quantizing and packing a model's linears (`LlamaForCausalLM.quantize`) costs every worker start
0.4-1 s on 2 cores; the result depends only on the checkpoint, the settings and this code. So
the first start writes it to a file beside the converted model (`<model dir>-weights/
weights-<quantization>-<isa>-<key>.kvw` in the kvrelay cache's `models/`) and every later start
maps that file read-only and builds its model over the mapping: no quantization, no copy. The
pages live in the page cache, shared by every worker of the host (three decode workers hold one
copy of the weights), and survive restarts and reboots; /dev/shm would be lost at a reboot, is
small in containers (64 MB by default under Docker) and its pages could not be dropped under
memory pressure (the page cache's clean pages can: they are read again from disk).

File: `MAGIC`, a u64 header length, a JSON header (format, key, file size, the storages'
offsets and sizes, the pickle's offset, size and digest), then every tensor storage (64-byte
aligned), then the model object pickled with its tensors as references into the storages.
The key hashes everything that changes the bytes: the model fingerprint (config and weight
digest, dtype, quantization), the kernel ISA variant and build, torch's version and the source
of the Python modules that build or describe the model. A file whose magic, format, key, size
or pickle digest differs is never used: the model is built as without a cache, and the file
rewritten. Writers hold an flock on `<file>.lock` from the check to the rename of a complete
temp file, so concurrent first starts build once: the others wait, then map.

Only weights the C++ kernels own (int8-weight-only, q8_0, w8a16: plain tensors) are cached;
oneDNN's and fbgemm's packed weights (fp32, int8, fp16) are opaque handles, built every start.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import logging
import mmap
import os
import pickle
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrelay.core.enums import Quantization
from kvrelay.workers.errors import EngineError

if TYPE_CHECKING:
    from kvrelay.workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAGIC = b"KVRWCACH"
FORMAT = 1  # bump when the file layout changes (the key covers the code that fills it)
ALIGN = 64
SUFFIX = ".kvw"
CACHEABLE = (Quantization.W8A16, Quantization.Q8_0, Quantization.INT8_WEIGHT_ONLY)
_PACKAGE = Path(__file__).resolve().parents[2]  # kvrelay/
# the modules whose code builds the cached objects, or defines their classes
_CODE = ("workers/model", "kernels", "core/kv_layout.py", "core/enums.py")


class WeightCacheError(EngineError):
    """A weight cache file is unusable (stale, truncated, corrupt) or the model cannot go in one."""


def cacheable(quantization: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of these settings goes through the cache (C++-kernel weights on CPU)."""
    return quantization in CACHEABLE and device.type == "cpu" and dtype == torch.float32


@functools.cache
def code_digest() -> str:
    """blake2b of the Python source that builds the model's objects (see `_CODE`)."""
    h = hashlib.blake2b(digest_size=16)
    for entry in _CODE:
        path = _PACKAGE / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(file.relative_to(_PACKAGE)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()


def cache_key(fingerprint: str, quantization: str) -> str:
    """The key of the cached model: fingerprint (config, weights, dtype, quantization), the
    kernel build that packs and runs it, torch's version and the code (`code_digest`)."""
    from kvrelay.kernels.cpu_build import build_key, loaded_isa

    isa = loaded_isa() or "none"
    parts = [
        f"format={FORMAT}",
        f"fingerprint={fingerprint}",
        f"quantization={quantization}",
        f"isa={isa}",
        f"kernels={build_key(isa) if isa != 'none' else ''}",
        f"torch={torch.__version__}",
        f"code={code_digest()}",
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def cache_path(directory: Path, quantization: str, key: str) -> Path:
    """The cache file of `key` in `directory` (one per key: two checkouts do not fight)."""
    from kvrelay.kernels.cpu_build import loaded_isa

    return Path(directory) / f"weights-{quantization}-{loaded_isa() or 'none'}-{key[:16]}{SUFFIX}"


def load_or_build(
    path: Path, key: str, build: Callable[[], LlamaForCausalLM]
) -> tuple[LlamaForCausalLM, str]:
    """The model mapped from `path` when it holds `key`, else `build()` written there (under
    an flock); returns (model, how): "mapped", "built" (and written), or "built, not cached"."""
    model = _try_map(path, key)
    if model is not None:  # the common case: no lock needed, a file in place is complete
        return model, "mapped"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.with_name(path.name + ".lock").open("a")
    except OSError as exc:  # a read-only cache: every start builds
        logger.warning("weight cache off (%s): building the model", exc)
        return build(), "built, not cached"
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another start may be writing it: wait for it
        model = _try_map(path, key, quiet=True)
        if model is not None:
            return model, "mapped"
        model = build()
        try:
            write(path, key, model)
        except (OSError, WeightCacheError) as exc:
            logger.warning("cannot write the weight cache %s: %s", path, exc)
            return model, "built, not cached"
        _remove_stale(path)
        return model, "built"


def _try_map(path: Path, key: str, quiet: bool = False) -> LlamaForCausalLM | None:
    try:
        return read(path, key)
    except FileNotFoundError:
        return None
    except (OSError, WeightCacheError) as exc:
        if not quiet:
            logger.warning("weight cache %s unusable (%s): rebuilding it", path, exc)
        return None


def _remove_stale(path: Path) -> None:
    """Other keys' files of the same quantization and ISA (an older checkpoint or code)."""
    prefix = path.name[: -len(SUFFIX) - 16]
    for other in path.parent.glob(f"{prefix}*{SUFFIX}"):
        if other != path:
            with contextlib.suppress(OSError):  # a mapping of it stays valid
                other.unlink()
                other.with_name(other.name + ".lock").unlink(missing_ok=True)


class _Pickler(pickle.Pickler):
    """Pickles a model with its tensors as (storage index, dtype, shape, stride, offset)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=5)
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[tuple[int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        from kvrelay.kernels.cpu_decoder import CpuDecoder

        if isinstance(obj, CpuDecoder):  # a C++ object over the tensors: rebuilt after a load
            return ("cpu_decoder",)
        if not isinstance(obj, torch.Tensor):
            return None
        if (
            type(obj) is not torch.Tensor
            or obj.layout != torch.strided
            or obj.device.type != "cpu"
            or obj.is_quantized
            or obj.is_mkldnn
        ):
            raise WeightCacheError(f"cannot cache a {type(obj).__name__} {obj.layout} tensor")
        storage = obj.untyped_storage()
        ident = (storage.data_ptr(), storage.nbytes())
        index = self._index.get(ident) if storage.nbytes() else None
        if index is None:
            index = self._index[ident] = len(self.storages)
            self.storages.append(storage)
        dtype = str(obj.dtype).removeprefix("torch.")
        return ("tensor", index, dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write(path: Path, key: str, model: LlamaForCausalLM) -> None:
    """Write `model` (quantized, packed) to `path` atomically: a temp file renamed into place."""
    start = time.monotonic()
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(model)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an object pickle refuses
        raise WeightCacheError(f"cannot pickle the model: {exc}") from None
    blob = buf.getvalue()
    sizes = [s.nbytes() for s in pickler.storages]
    digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
    # the header's length depends on the offsets: lay out with room for the largest numbers
    room = len(key) + len(digest) + 200 + 40 * len(sizes)
    offset = _aligned(len(MAGIC) + 8 + room)
    layout: list[list[int]] = []
    for n in sizes:
        layout.append([offset, n])
        offset = _aligned(offset + n)
    size = offset + len(blob)
    header = {"format": FORMAT, "key": key, "size": size, "storages": layout,
              "pickle": [offset, len(blob)], "pickle_digest": digest}  # fmt: skip
    text = json.dumps(header).encode()
    if len(text) > room:
        raise WeightCacheError(f"header of {len(text)} bytes outgrew its {room}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC + len(text).to_bytes(8, "little") + text)
            for storage, (at, n) in zip(pickler.storages, layout, strict=True):
                f.seek(at)
                if n:
                    f.write(_storage_bytes(storage))
            f.seek(offset)
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())  # complete on disk before its name says it is
        tmp.chmod(0o644)  # the cache is shared between users of the host, like the model
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info(
        "wrote the weight cache %s (%.0f MB) in %.2f s",
        path,
        size / 1e6,
        time.monotonic() - start,
    )


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    with torch.inference_mode():
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        return memoryview(flat.numpy().data).cast("B")


def read_header(data: mmap.mmap | bytes, size: int, key: str) -> dict:
    """The header of a cache file of `size` bytes; WeightCacheError unless it is this
    format's, for `key`, and the file is as long as it says."""
    if size < len(MAGIC) + 8 or data[: len(MAGIC)] != MAGIC:
        raise WeightCacheError("not a weight cache file")
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    if length > size:
        raise WeightCacheError("truncated header")
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + length]))
    except ValueError as exc:
        raise WeightCacheError(f"bad header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise WeightCacheError(f"format {header.get('format')!r}, not {FORMAT}")
    if header.get("key") != key:
        raise WeightCacheError("stale: written for another model, setting or code")
    if header.get("size") != size:
        raise WeightCacheError(f"{size} bytes, its header says {header.get('size')}")
    return header


def read(path: Path, key: str) -> LlamaForCausalLM:
    """The model of cache file `path` over a read-only shared mapping of it (zero-copy)."""
    from kvrelay.workers.model.llama import LlamaForCausalLM

    start = time.monotonic()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise WeightCacheError("empty file")
        # MAP_POPULATE: the page tables are filled now (the pages are in the page cache after
        # the first start), not by faults inside the first forward step
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        data = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    header = read_header(data, size, key)
    at, length = header["pickle"]
    blob = data[at : at + length]
    if hashlib.blake2b(blob, digest_size=16).hexdigest() != header.get("pickle_digest"):
        raise WeightCacheError("corrupt: its object table does not match its digest")
    with warnings.catch_warnings():  # read-only on purpose: nothing writes weights
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        base = torch.frombuffer(data, dtype=torch.uint8)
    storages = []
    for offset, n in header["storages"]:
        if offset + n > size:
            raise WeightCacheError("a storage runs past the end of the file")
        storages.append(base[offset : offset + n])
    try:
        model = _Unpickler(io.BytesIO(blob), storages).load()
    except (pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise WeightCacheError(f"cannot rebuild the model: {exc!r}") from None
    if not isinstance(model, LlamaForCausalLM):
        raise WeightCacheError(f"holds a {type(model).__name__}, not a model")
    model.attach_cpu_decoders()
    logger.info(
        "mapped the weight cache %s (%.0f MB) in %.3f s", path, size / 1e6, time.monotonic() - start
    )
    return model


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, storages: list[torch.Tensor]):
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid: Any) -> Any:
        if pid == ("cpu_decoder",):
            return None
        kind, index, dtype, shape, stride, offset = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        raw = self.storages[index]
        kind_of = getattr(torch, dtype)
        typed = raw.view(kind_of) if raw.numel() else torch.empty(0, dtype=kind_of)
        return typed.as_strided(shape, stride, typed.storage_offset() + offset)
