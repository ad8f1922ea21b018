"""Build (once, cached by source hash, ISA variant and torch version) and load the C++ CPU kernels.

The same sources compile once per ISA variant (`VARIANTS`: flags on top of `CFLAGS`, each under
its own module name and cache directory); the sources pick their code paths with
`#if defined(__AVX512F__)`. `python -m kvrelay.kernels.cpu_build` builds at install time: the
avx2 variant and the host's best one. At run time `load()` imports the best variant the CPU
supports (`KVRELAY_KERNELS_ISA=auto|avx2|avx512|amx` overrides it; a variant the CPU lacks is
refused with a warning) from the cache (milliseconds); when it is missing it builds on first
use (about a minute), and when building fails it logs one warning and falls back to the avx2
variant, then to None: callers then use the torch path. `KVRELAY_KERNELS_CPU=torch` forces the
torch path. Every variant gives the same bits (docs/internals.md, Kernels).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import platform
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kvrelay.core.config import cache_root, env_name, from_env
from kvrelay.kernels.errors import KernelError

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = (
    "plan.cpp",
    "attention.cpp",
    "cache_ops.cpp",
    "rowwise.cpp",
    "wint8.cpp",
    "q8.cpp",
    "w8a16.cpp",
    "sampling.cpp",
    "gguf_dequant.cpp",
    "weight_quant.cpp",
    "bindings.cpp",
)
HEADERS = ("ops.h", "parallel.h", "vec.h", "kv_types.h", "amx.h")
# -ffp-contract=off: the compiler must not fuse a*b+c on its own; the kernels place their FMAs
# explicitly, so the arithmetic of a row is exactly what the source says.
# -mf16c: fp16 KV pages widen and narrow with vcvtph2ps / vcvtps2ph (every AVX2 CPU has F16C).
# -fopenmp: at::parallel_for (ATen/Parallel-inl.h) only splits work across torch's threads when
# the including file is compiled with OpenMP; without it every kernel ran on one thread. The
# library links libgomp.so.1, which resolves to the one torch already loaded (same soname).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# ISA variants, from the most basic up: flags added to CFLAGS, and the /proc/cpuinfo flags the
# CPU needs to run the result.
VARIANTS: dict[str, tuple[str, ...]] = {
    "avx2": (),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    # AMX hosts (Sapphire Rapids on): AVX-512 plus VNNI and BF16, the AMX int8 tiles of
    # `q8_linear`, the bf16 tiles of bf16 attention and
    # `w8a16_linear`.
    "amx": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        "-mavx512bf16",
        "-mamx-tile",
        "-mamx-int8",
        "-mamx-bf16",
    ),
}
VARIANT_CPU_FLAGS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "amx": frozenset(
        {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
        | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    ),
}
BASE_VARIANT = "avx2"
SECTION = "KERNELS"


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """Process-wide kernel choices (`KVRELAY_KERNELS_*`, read through kvrelay.core.config)."""

    cpu: str = "auto"  # torch: never load the C++ kernels (the torch path)
    isa: str = "auto"  # auto | avx2 | avx512 | amx: the variant `load()` imports

    @property
    def torch_only(self) -> bool:
        return self.cpu.strip().lower() == "torch"


ENV_FORCE = env_name(SECTION, "cpu")  # KVRELAY_KERNELS_CPU
ENV_ISA = env_name(SECTION, "isa")  # KVRELAY_KERNELS_ISA


def kernel_settings(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernel settings of this process (or of the environment `environ`)."""
    return from_env(KernelSettings, SECTION, environ=environ)


_lock = threading.Lock()
_state: dict[str, ModuleType | str | None] = {}  # "module", "isa" (what load() chose)
_variants: dict[str, ModuleType] = {}  # every variant imported in this process


def cache_dir() -> Path:
    """Where builds live: `$KVRELAY_CACHE_DIR/kernels` (default `~/.cache/kvrelay/kernels`)."""
    return cache_root() / "kernels"


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise KernelError(f"unknown kernel ISA variant {variant!r} (one of {tuple(VARIANTS)})")


def variant_cflags(variant: str = BASE_VARIANT) -> tuple[str, ...]:
    """The compiler flags of one ISA variant."""
    _check_variant(variant)
    return (*CFLAGS, *VARIANTS[variant])


def build_key(variant: str = BASE_VARIANT) -> str:
    """Hash of the sources, flags, torch and Python versions: a new key means a new build."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    meta = (torch.__version__, sys.version, platform.machine(), " ".join(variant_cflags(variant)))
    h.update("\0".join(meta).encode())
    return h.hexdigest()[:16]


def _paths(variant: str = BASE_VARIANT) -> tuple[str, Path, Path]:
    name = f"kvrelay_cpu_{variant}_{build_key(variant)}"
    build_dir = cache_dir() / name
    return name, build_dir, build_dir / f"{name}.so"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; elsewhere what torch's capability implies)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return VARIANT_CPU_FLAGS["avx512"]
    return VARIANT_CPU_FLAGS["avx2"] if capability == "AVX2" else frozenset()


def supported_variants(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The variants a CPU with `flags` (default: this one) runs, from the most basic up."""
    have = cpu_flags() if flags is None else frozenset(flags)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    return tuple(v for v in VARIANTS if VARIANT_CPU_FLAGS[v] <= have)


def cpu_supported() -> bool:
    """True on x86-64 CPUs with AVX2 and FMA (the base variant's instruction set)."""
    return BASE_VARIANT in supported_variants()


def choose_variant(requested: str, supported: Iterable[str]) -> str | None:
    """The variant to load for `KVRELAY_KERNELS_ISA=requested` (auto: the best supported);
    an unknown or unsupported request logs a warning and falls back to auto. None: none runs."""
    supported = tuple(supported)
    best = supported[-1] if supported else None
    requested = (requested or "auto").strip().lower()
    if requested == "auto":
        return best
    if requested not in VARIANTS:
        logger.warning(
            "%s=%s is not one of auto, %s: using %s",
            ENV_ISA,
            requested,
            ", ".join(VARIANTS),
            best,
        )
        return best
    if requested not in supported:
        missing = sorted(VARIANT_CPU_FLAGS[requested] - _flags_of(supported))
        logger.warning(
            "%s=%s refused: this CPU lacks %s; using %s",
            ENV_ISA,
            requested,
            ", ".join(missing) or "it",
            best,
        )
        return best
    return requested


def _flags_of(supported: tuple[str, ...]) -> frozenset[str]:
    return frozenset().union(*(VARIANT_CPU_FLAGS[v] for v in supported))


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False, variant: str = BASE_VARIANT) -> ModuleType:
    """Compile one variant into the cache (no-op when already built); raises on failure."""
    from torch.utils import cpp_extension

    name, build_dir, so_path = _paths(variant)
    done = build_dir / "built"  # written last: a half-linked library is never imported
    if done.exists() and so_path.exists():
        return _import(name, so_path)
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("building the C++ CPU kernels (%s) into %s", variant, build_dir)
    t0 = time.perf_counter()
    # torch's own build lock (`lock`, created with O_EXCL) outlives a builder killed mid-build,
    # and every later build of the variant would wait on it forever; an flock dies with its
    # holder, so builders take one first and its holder clears a lock file left behind.
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if done.exists() and so_path.exists():  # built by another process while we waited
            return _import(name, so_path)
        (build_dir / "lock").unlink(missing_ok=True)
        module = cpp_extension.load(
            name=name,
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=list(variant_cflags(variant)),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=verbose,
        )
        done.write_text(f"{time.perf_counter() - t0:.1f} s\n")
    logger.info("built the C++ CPU kernels (%s) in %.1f s", variant, time.perf_counter() - t0)
    return module


def load_variant(variant: str) -> ModuleType:
    """One ISA variant's module (built if missing), whatever `load()` chose: each variant has
    its own module name, so several load side by side. Raises KernelError when the CPU lacks
    the variant's instructions; build errors propagate."""
    _check_variant(variant)
    if variant not in supported_variants():
        missing = sorted(VARIANT_CPU_FLAGS[variant] - cpu_flags())
        raise KernelError(f"this CPU cannot run the {variant} kernels (lacks {', '.join(missing)})")
    with _lock:
        return _load_unlocked(variant)


def use_variant(variant: str) -> AbstractContextManager[ModuleType]:
    """Within the block `load()` (so every public op) uses `variant`: tests run each variant
    the CPU supports through the same ops. Not thread-safe; for tests and benchmarks."""
    return use_module(load_variant(variant), variant)


@contextmanager
def use_module(module: ModuleType, isa: str) -> Iterator[ModuleType]:
    """Within the block `load()` returns `module`, a build of variant `isa` (one of
    `load_variant`'s, or another checkout's loaded beside this one's: benchmarks compare two
    builds in one process). Not thread-safe; for tests and benchmarks."""
    load()  # settle the process's own choice first, so it is what comes back afterwards
    saved = dict(_state)
    _state.update(module=module, isa=isa)
    try:
        yield module
    finally:
        _state.clear()
        _state.update(saved)


def load() -> ModuleType | None:
    """The extension module, or None (forced off, unsupported CPU, or the build failed)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" not in _state:
            _state["isa"], _state["module"] = _load()
    return _state["module"]  # type: ignore[return-value]


def loaded_isa() -> str | None:
    """The ISA variant `load()` uses ("avx2", "avx512", "amx"), None on the torch path."""
    load()
    return _state.get("isa")  # type: ignore[return-value]


def _load() -> tuple[str | None, ModuleType | None]:
    settings = kernel_settings()
    if settings.torch_only:
        return None, None
    supported = supported_variants()
    chosen = choose_variant(settings.isa, supported)
    if chosen is None:
        logger.info("CPU without AVX2: using the torch attention path")
        return None, None
    errors = []
    for variant in dict.fromkeys((chosen, BASE_VARIANT)):  # the choice, then the base variant
        try:
            module = _load_unlocked(variant)
        except Exception as exc:  # noqa: BLE001 - any build/import failure: try the next one
            errors.append(f"{variant}: {exc}")
            continue
        if errors:
            logger.warning("C++ CPU kernels: %s; using the %s variant", errors[0], variant)
        logger.info("C++ CPU kernels: %s variant (CPU supports %s)", variant, ", ".join(supported))
        return variant, module
    logger.warning("C++ CPU kernels unavailable, using the torch path: %s", "; ".join(errors))
    return None, None


def _load_unlocked(variant: str) -> ModuleType:
    if variant not in _variants:
        name, build_dir, so_path = _paths(variant)
        if (build_dir / "built").exists() and so_path.exists():
            _variants[variant] = _import(name, so_path)
        else:
            _variants[variant] = build(variant=variant)
    return _variants[variant]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    supported = supported_variants()
    if not supported:
        print("CPU without AVX2: the C++ kernels are not built (the torch path is used)")
        return
    for variant in dict.fromkeys((BASE_VARIANT, supported[-1])):  # CI's and this host's best
        build(verbose="-v" in sys.argv, variant=variant)
        _, _, so_path = _paths(variant)
        print(f"C++ CPU kernels ready ({variant}): {so_path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
