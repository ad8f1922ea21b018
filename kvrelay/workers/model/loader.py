"""Prepare (convert once, cache) and load models.

Every model is prepared once into an HF-format directory under the kvrelay cache: a GGUF file
of an architecture `gguf_convert` maps gets its config and tokenizer files and a link to the
file, whose tensors every load dequantizes straight into the model (`gguf_weights`: no fp32
copy is written); safetensors checkpoints are linked in as they are; anything else (a `.bin`
checkpoint, a GGUF that only transformers converts) is converted by `transformers` into fp32
`model.safetensors`. Preparing writes a temp directory and renames it into place under an
exclusive file lock, so concurrent processes wait for one conversion and nobody ever sees a
half-written directory. `prepare_hf_checkpoint` writes the fp32 safetensors of a GGUF for
tools that need them (transformers, vLLM).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.core.enums import Quantization
from kvrelay.core.modelref import (
    GGUF_SAMPLING_KEYS,
    GGUF_SAMPLING_META,
    META_FILE,
    META_FORMAT,
    ModelNotFoundError,
    ModelRef,
    converted_dir,
    is_prepared,
    is_prepared_dir,
    model_fingerprint,
    normalize_attention_precision,
    normalize_dtype,
    normalize_kv_cache_dtype,
    normalize_quantization,
    read_config,
    read_meta,
    resolve_model,
    weights_digest,
    write_meta,
)
from kvrelay.core.tokenizer import Tokenizer
from kvrelay.workers.errors import EngineError, ModelLoadError, UnsupportedModelError
from kvrelay.workers.model.config import ModelConfig
from kvrelay.workers.model.gguf_header import check_gguf_architecture

if TYPE_CHECKING:
    import torch

    from kvrelay.workers.model.config import ModelConfig
    from kvrelay.workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Files copied (linked) next to the weights of a safetensors checkpoint.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"kvrelay: {msg}", file=sys.stderr, flush=True)
    logger.info("%s", msg)


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_model(name: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Resolve `name` and make sure its converted directory exists; returns that directory."""
    ref = resolve_model(name)
    target = converted_dir(ref)
    if is_prepared(ref):
        _record_gguf_sampling(ref, target)
        return target
    check_architecture(ref)  # refused in milliseconds, not after a conversion

    def convert(tmp: Path) -> None:
        if ref.kind == "safetensors":
            _link_checkpoint(ref, tmp)
        else:
            _say(progress, conversion_note(ref))
            _convert(ref, tmp, progress)
            _check_weights(tmp)

    _prepare(ref, target, convert, progress)
    return target


def prepare_hf_checkpoint(name: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """A Hugging Face directory with fp32 `model.safetensors` of the model `name`, for
    transformers and vLLM: a GGUF's tensors dequantized into it once (cached beside the
    directory kvrelay serves from); any other model's prepared directory."""
    ref = resolve_model(name)
    if ref.kind != "gguf":
        return prepare_model(name, progress)
    target = converted_dir(ref).with_name(converted_dir(ref).name + "-safetensors")
    if is_prepared_dir(target):
        return target
    check_architecture(ref)

    def convert(tmp: Path) -> None:
        _say(progress, f"writing the fp32 safetensors of {ref.source}, once")
        if _fast_gguf(ref):
            from kvrelay.workers.model.gguf_convert import convert_gguf

            convert_gguf(ref.source, tmp, say=lambda msg: _say(progress, msg))
        else:
            _convert_with_transformers(ref, tmp, progress)

    _prepare(ref, target, convert, progress)
    return target


def _prepare(ref: ModelRef, target: Path, convert, progress: bool) -> None:
    """Run `convert(tmp)` into a temp directory, add kvrelay.json, and rename it to `target`,
    under a file lock (a second process waits, then finds it done)."""
    with _file_lock(target.with_name(target.name + ".lock")):
        if is_prepared_dir(target):
            _record_gguf_sampling(ref, target)  # another process converted it meanwhile
            return
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        start = time.monotonic()
        try:
            convert(tmp)
            _say(progress, "hashing weights for the model fingerprint")
            meta = {
                "format": META_FORMAT,
                "name": ref.name,
                "kind": ref.kind,
                "source": str(ref.source),
                "weights_digest": weights_digest(tmp),
            }
            if ref.kind == "gguf":
                meta[GGUF_SAMPLING_META] = gguf_sampling(ref.source)
            write_meta(tmp, meta)
            for path in tmp.iterdir():  # the cache is shared between users of the host
                if not path.is_symlink():
                    path.chmod(0o644)
            shutil.rmtree(target, ignore_errors=True)  # stale: another format, no kvrelay.json
            os.rename(tmp, target)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, EngineError | ModelNotFoundError):
                raise
            raise ModelLoadError(
                f"could not prepare model {ref.name!r} from {ref.source}: {exc}"
            ) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(progress, f"model ready in {target} ({time.monotonic() - start:.1f} s)")
    assert (target / META_FILE).is_file()


def _check_weights(directory: Path) -> None:
    """UnsupportedModelError now, not at every load, when the GGUF `directory` links lacks a
    tensor its config needs or holds one of another shape (the header alone is read)."""
    import torch

    from kvrelay.workers.model.gguf_convert import GGUF_FILE
    from kvrelay.workers.model.gguf_weights import GGUFWeights
    from kvrelay.workers.model.weights import checkpoint_tensors

    if not (directory / GGUF_FILE).exists():
        return
    config = ModelConfig.from_hf(read_config(directory))
    weights = GGUFWeights(directory / GGUF_FILE, config.num_layers, config.num_heads,
                          config.num_kv_heads)  # fmt: skip
    model = model_class(config.model_type)(config, torch.float32, torch.device("meta"))
    for tensors in checkpoint_tensors(model):
        for name, tensor in tensors.items():
            if weights.shape(name) != tuple(tensor.shape):
                raise UnsupportedModelError(
                    f"{weights.path.resolve()}: tensor {name} has shape {weights.shape(name)}, "
                    f"its config needs {tuple(tensor.shape)}"
                )


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    """The decoder class of a family: its own where its layers differ from Llama's."""
    from kvrelay.workers.model.gemma3 import Gemma3ForCausalLM
    from kvrelay.workers.model.llama import LlamaForCausalLM
    from kvrelay.workers.model.phi3 import Phi3ForCausalLM
    from kvrelay.workers.model.qwen3 import Qwen3ForCausalLM
    from kvrelay.workers.model.smollm3 import SmolLM3ForCausalLM

    families: dict[str, type[LlamaForCausalLM]] = {
        "gemma3_text": Gemma3ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "smollm3": SmolLM3ForCausalLM,
    }
    return families.get(model_type, LlamaForCausalLM)


def check_architecture(ref: ModelRef) -> None:
    """UnsupportedModelError now for a model kvrelay cannot serve, from the GGUF header or
    config.json alone."""
    if ref.kind == "gguf":
        check_gguf_architecture(ref.source)
        return
    config = (ref.source if ref.source.is_dir() else ref.source.parent) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # the conversion says what is wrong with it
    ModelConfig.from_hf(cfg)


def gguf_sampling(path: Path) -> dict[str, float | int]:
    """The sampling defaults a GGUF file carries (`GGUF_SAMPLING_KEYS`, llama.cpp's
    `general.sampling.*` metadata), key -> value; {} when it has none."""
    from kvrelay.workers.model.gguf_convert import read_gguf

    # the metadata alone (gguf.GGUFReader indexes every vocabulary string: 14 s for Gemma 3's
    # 262k on a busy 2-core host)
    metadata = read_gguf(path, tensors=False).metadata
    found: dict[str, float | int] = {}
    for key in GGUF_SAMPLING_KEYS:
        value = metadata.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[key] = value
    return found


def _record_gguf_sampling(ref: ModelRef, directory: Path) -> None:
    """Read the GGUF's sampling defaults into kvrelay.json of a directory converted before
    kvrelay recorded them (once: an empty dict marks a file that carries none)."""
    if ref.kind != "gguf":
        return
    meta = read_meta(directory)
    if GGUF_SAMPLING_META in meta:
        return
    try:
        meta[GGUF_SAMPLING_META] = gguf_sampling(ref.source)
        write_meta(directory, meta)
    except (OSError, ValueError) as exc:  # a read-only cache: the table's defaults still apply
        logger.warning("cannot record the GGUF sampling defaults in %s: %s", directory, exc)


# Seconds per MB of source a conversion takes on 2 cores: an estimate to print, never a promise.
# transformers' (for a .bin checkpoint or a GGUF architecture gguf_convert does not map;
# measured 2026-12-03, Xeon, 2 cores, quiet: SmolLM2-135M's 98 MB GGUF in 21.4 s; issue 46: 54 s
# for it on a busy 2-core host, 336 s for a 0.5B GGUF).
CONVERT_S_PER_MB = (0.2, 0.6)


def _source_bytes(ref: ModelRef) -> int:
    """Bytes of the checkpoint a conversion reads (the GGUF file, or a directory's weights)."""
    if ref.source.is_file():
        return ref.source.stat().st_size
    return sum(p.stat().st_size for p in ref.source.glob("*.bin") if p.is_file())


def _fast_gguf(ref: ModelRef) -> bool:
    """Whether kvrelay's own converter (gguf_convert) takes this model."""
    from kvrelay.workers.model.gguf_convert import ARCHITECTURES
    from kvrelay.workers.model.gguf_header import header_value

    return ref.kind == "gguf" and header_value(ref.source, "general.architecture") in ARCHITECTURES


def conversion_note(ref: ModelRef) -> str:
    """The line announcing a conversion: what it writes, and how long it takes."""
    mb = _source_bytes(ref) / 1e6
    if _fast_gguf(ref):
        return (
            f"preparing {ref.source} ({mb:.0f} MB), once: its config and tokenizer files "
            "(seconds; its weights are read from the file at every load)"
        )
    low, high = (max(1, round(mb * rate)) for rate in CONVERT_S_PER_MB)
    return (
        f"converting {ref.source} ({mb:.0f} MB) to safetensors, once: about {low}-{high} s "
        "on 2 cores at this size, longer on a busy host"
    )


@contextlib.contextmanager
def progress_bars(show: bool):
    """transformers' (and huggingface_hub's) progress bars, and the GGUF loader's own tqdm bar,
    only when `show` and stderr is a terminal: in a log file every frame of a bar is a
    carriage-return line (hundreds per conversion). Restored on exit; yields whether on."""
    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    on = show and sys.stderr.isatty()
    was_on = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf, "tqdm", None)  # tqdm.auto's, which disable_progress_bar misses
    if not on:
        hf_logging.disable_progress_bar()
        if gguf_tqdm is not None:
            gguf.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield on
    finally:
        if not on:
            if gguf_tqdm is not None:
                gguf.tqdm = gguf_tqdm
            if was_on:
                hf_logging.enable_progress_bar()


def _link_checkpoint(ref: ModelRef, out: Path) -> None:
    src_dir = ref.source if ref.source.is_dir() else ref.source.parent
    weights = sorted(src_dir.glob("*.safetensors")) if ref.source.is_dir() else [ref.source]
    index = src_dir / "model.safetensors.index.json"
    for path in [src_dir / n for n in _SIDE_FILES] + weights + [index]:
        if path.is_file():
            os.symlink(path.resolve(), out / path.name)


def _convert(ref: ModelRef, out: Path, progress: bool) -> None:
    """A GGUF whose architecture kvrelay's converter maps: its config and tokenizer files and a
    link to the file (`gguf_convert.link_gguf`, seconds); anything else converted to fp32
    safetensors by transformers."""
    if ref.kind == "gguf" and _fast_gguf(ref):
        from kvrelay.workers.model.gguf_convert import UnsupportedGGUFError, describe, link_gguf

        try:
            times = link_gguf(ref.source, out, say=lambda msg: _say(progress, msg))
        except UnsupportedGGUFError as exc:  # e.g. a tensor type gguf cannot dequantize
            logger.info("converting %s with transformers: %s", ref.source, exc)
            for path in out.iterdir():
                path.unlink()
        else:
            logger.info("prepared %s: %s", ref.source, describe(times))
            return
    _convert_with_transformers(ref, out, progress)


def _convert_with_transformers(ref: ModelRef, out: Path, progress: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if ref.kind == "gguf":
        src, kwargs = str(ref.source.parent), {"gguf_file": ref.source.name}
    else:
        src, kwargs = str(ref.source), {}
    with progress_bars(progress):  # the stage lines below are the progress in a log
        _say(progress, "loading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
        _say(progress, "loading and dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs)
        # save_pretrained refuses a GGUF-quantized model; the weights are already dense fp32.
        # (type: ignore: torch's stubs type a Module's unknown attributes Tensor | Module)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False  # type: ignore[assignment]  # torch stubs, as above
        _say(progress, "writing safetensors")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: our module, its config, tokenizer and identity."""

    name: str
    dir: Path
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    quantization: str = Quantization.NONE
    # how the weights came: "built" (read and quantized), "mapped" (from the weight cache),
    # "built, not cached" (the cache file could not be written)
    weights: str = "built"


def resolve_device_dtype(
    dtype: str = "auto", device: str = "auto"
) -> tuple[torch.dtype, torch.device]:
    """(torch.dtype, torch.device) for flags: auto = bf16 on CUDA, fp32 on CPU."""
    import torch

    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    if str(dtype) == "auto":
        return (torch.bfloat16 if torch_device.type == "cuda" else torch.float32), torch_device
    return getattr(torch, normalize_dtype(str(dtype))), torch_device


def resolve_kv_dtype_name(
    kv_cache_dtype: str, model_dtype: str, device_type: str, kernels: bool | None = None
) -> str:
    """The KV pool's dtype name ("float32", "bfloat16", "float16") for `--kv-cache-dtype`; the
    one place that decides what `auto` means (the workers, `kvrelay up` and the store agree
    through it). `kernels`: whether the C++ CPU kernels run (None: load them to find out).

    auto = bfloat16 when the model computes in fp32 on CPU and the C++ kernels run: half the
    bytes per token, faster decode steps (attention is memory-bound; 8.0-8.3 ms vs 8.7-9.0 ms a
    step at batch 1, 1.7x faster attention at 8k context), and bf16 keeps fp32's exponent range
    so nothing overflows (fp16 measured no faster). fp32 where the torch path runs
    (KVRELAY_KERNELS_CPU=torch, no AVX2); the model's dtype otherwise (bf16 on CUDA)."""
    name = normalize_kv_cache_dtype(kv_cache_dtype)
    if name != "auto":
        return name
    model_dtype = normalize_dtype(model_dtype)
    if device_type != "cpu" or model_dtype != "float32":
        return model_dtype
    if kernels is None:
        from kvrelay.kernels.cpu_build import load

        kernels = load() is not None
    return "bfloat16" if kernels else "float32"


def resolve_attention_precision(
    precision: str,
    kv_dtype: str,
    model_dtype: str,
    device_type: str,
    page_size: int = 16,
    head_dim: int | None = None,
    available: bool | None = None,
) -> str:
    """The attention precision, "fp32" or "bf16", for `--attention-precision`; the one place
    that decides what `auto` means (the workers, `kvrelay up` and the store agree through it).
    `available`: whether the kernels can run bf16 attention here (None: load them to find
    out); `head_dim` None: unknown (taken as supported).

    bf16 (q and p rounded to bf16, dot products on AMX-BF16 tiles) needs an fp32 model on CPU,
    bfloat16 pages (tiles read them in place), pages a multiple of 16 tokens, head_dim 32, 64 or
    128, and the amx kernel build with its tiles granted. auto = bf16 where all of that holds:
    prefill attention 4x faster at 2-4k tokens (docs/benchmarks.md), perplexity unchanged to
    three digits; fp32 elsewhere. Asked for where it cannot run, it is a ValueError."""
    name = normalize_attention_precision(precision)
    if name == "fp32":
        return name
    why = ""
    if device_type != "cpu" or normalize_dtype(model_dtype) != "float32":
        why = "an fp32 model on CPU"
    elif normalize_dtype(kv_dtype) != "bfloat16":
        why = "bf16 KV pages (--kv-cache-dtype bf16)"
    elif page_size % 16:
        why = "a page size that is a multiple of 16"
    else:
        if available is None:
            from kvrelay.kernels import bf16_attention_available

            available = bf16_attention_available()
        if not available:
            why = "AMX-BF16 (the amx build of the C++ kernels, tiles granted by the OS)"
        elif head_dim is not None:
            from kvrelay.kernels.cpu_paged import BF16_HEAD_DIMS

            if head_dim not in BF16_HEAD_DIMS:
                why = (
                    "head_dim "
                    + ", ".join(map(str, BF16_HEAD_DIMS[:-1]))
                    + f" or {BF16_HEAD_DIMS[-1]}"
                )
    if not why:
        return "bf16"
    if name == "bf16":
        raise ValueError(f"--attention-precision bf16 needs {why}")
    return "fp32"


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype, device="cpu"):
    """The KV pool's torch dtype for `--kv-cache-dtype` (resolve_kv_dtype_name decides auto)."""
    import torch

    name = resolve_kv_dtype_name(kv_cache_dtype, str(model_dtype), torch.device(device).type)
    return getattr(torch, name)


def _checkpoint_blocks(model, gguf, quantization: str):
    """The Q8_0 blocks of the GGUF the model was loaded from (`gguf`, a GGUFWeights; None for
    safetensors) for the int8 formats with a scale per 32 inputs (its int8 values kept as they
    are), None otherwise (`LlamaForCausalLM.quantize`'s `blocks`)."""
    from kvrelay.workers.model.gguf_weights import q8_weights
    from kvrelay.workers.model.weights import checkpoint_tensors

    if gguf is None or quantization not in (Quantization.INT8_WEIGHT_ONLY, Quantization.Q8_0):
        return None
    return q8_weights(gguf, checkpoint_tensors(model))


def load_model(
    name: str | os.PathLike | None = None,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    quantization: str = Quantization.NONE,
    weight_cache: bool | Path = True,
) -> LoadedModel:
    """Prepare (convert once) and load a model with its tokenizer and fingerprint;
    `quantization` "int8" replaces its linears by int8 ones (`kvrelay.workers.model.quant`).
    `weight_cache`: map the quantized weights from the file the first load of these settings
    wrote (`weight_cache`; a Path: that directory instead of `weight_cache_dir`), False: build
    them."""
    import torch

    from kvrelay.workers.model.config import ModelConfig
    from kvrelay.workers.model.weights import load_weights

    try:
        quantization = normalize_quantization(quantization)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    start = time.monotonic()
    directory = prepare_model(name, progress=progress)
    torch_dtype, torch_device = resolve_device_dtype(dtype, device)
    if quantization != Quantization.NONE and (torch_device.type, torch_dtype) != (
        "cpu",
        torch.float32,
    ):
        raise ModelLoadError(
            f"--quantization {quantization} runs on CPU with float32 only "
            f"(got {torch_device.type}, {str(torch_dtype).removeprefix('torch.')})"
        )
    if quantization != Quantization.NONE:
        from kvrelay.workers.model.quant import NEEDS, can_quantize

        if not can_quantize(torch.zeros(1, 1), quantization):
            raise ModelLoadError(f"--quantization {quantization} needs {NEEDS[quantization]}")
    config = ModelConfig.from_hf(read_config(directory))
    dtype_name = str(torch_dtype).removeprefix("torch.")
    fingerprint = model_fingerprint(directory, dtype_name, quantization)

    def build() -> LlamaForCausalLM:
        model = model_class(config.model_type)(config, torch_dtype, torch_device)
        if quantization == Quantization.NONE:
            load_weights(model, directory)
        else:  # quantize from the dense fp32 weights, then pack what stays fp32
            gguf = load_weights(model, directory, pack=False)
            model.quantize(quantization, blocks=_checkpoint_blocks(model, gguf, quantization))
            model.pack_weights()
        return model

    with torch.inference_mode():
        model, how = _build_or_map(
            build, directory, fingerprint, quantization, torch_device, torch_dtype, weight_cache
        )
    model.eval()
    try:
        tokenizer = Tokenizer.from_dir(directory)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {directory}: {exc}") from exc
    loaded = LoadedModel(
        name=resolve_model(name).name,
        dir=directory,
        model=model,
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        dtype=torch_dtype,
        device=torch_device,
        quantization=quantization,
        weights=how,
    )
    logger.info(
        "loaded %s (%s, %s, quantization %s, weights %s) from %s in %.2f s",
        loaded.name,
        dtype_name,
        torch_device,
        quantization,
        how,
        directory,
        time.monotonic() - start,
    )
    return loaded


def weight_cache_dir(directory: Path) -> Path:
    """Where the weight cache files of the model prepared in `directory` live: beside it, like
    its `-safetensors` copy (the prepared directory itself holds what preparing wrote)."""
    return directory.with_name(directory.name + "-weights")


def _build_or_map(
    build: Callable[[], LlamaForCausalLM],
    directory: Path,
    fingerprint: str,
    quantization: str,
    device: torch.device,
    dtype: torch.dtype,
    weight_cache: bool | Path,
) -> tuple[LlamaForCausalLM, str]:
    """(model, how): mapped from the weight cache (`weight_cache`, written by the first start
    of these settings), else built; `weight_cache` False: built, a Path: the cache's directory
    instead of the model's (`weight_cache_dir`)."""
    from kvrelay.workers.model import weight_cache as cache

    if weight_cache is False or not cache.cacheable(quantization, device, dtype):
        return build(), "built"
    where = weight_cache_dir(directory) if weight_cache is True else Path(weight_cache)
    key = cache.cache_key(fingerprint, quantization)
    return cache.load_or_build(cache.cache_path(where, quantization, key), key, build)
