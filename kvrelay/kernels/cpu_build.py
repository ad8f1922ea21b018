"""Build (once, cached by source hash and torch version) and load the C++ CPU kernels.

`python -m kvrelay.kernels.cpu_build` builds at install time. At run time `load()` imports the
cached library directly (milliseconds); when it is missing it builds on first use (about a
minute), and when building fails it logs one warning and returns None: callers then use the
torch path. `KVRELAY_KERNELS_CPU=torch` forces the torch path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("plan.cpp", "attention.cpp", "cache_ops.cpp", "rowwise.cpp", "wint8.cpp", "bindings.cpp")
HEADERS = ("ops.h", "parallel.h", "vec.h")
# -ffp-contract=off: the compiler must not fuse a*b+c on its own; the kernels place their FMAs
# explicitly, so the arithmetic of a row is exactly what the source says.
# -fopenmp: at::parallel_for (ATen/Parallel-inl.h) only splits work across torch's threads when
# the including file is compiled with OpenMP; without it every kernel ran on one thread. The
# library links libgomp.so.1, which resolves to the one torch already loaded (same soname).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)
ENV_FORCE = "KVRELAY_KERNELS_CPU"

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def cache_dir() -> Path:
    """Where builds live: `$KVRELAY_CACHE_DIR/kernels` (default `~/.cache/kvrelay/kernels`)."""
    root = os.environ.get("KVRELAY_CACHE_DIR") or str(Path.home() / ".cache" / "kvrelay")
    return Path(root) / "kernels"


def build_key() -> str:
    """Hash of the sources, flags, torch and Python versions: a new key means a new build."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    meta = (torch.__version__, sys.version, platform.machine(), " ".join(CFLAGS))
    h.update("\0".join(meta).encode())
    return h.hexdigest()[:16]


def _paths() -> tuple[str, Path, Path]:
    name = f"kvrelay_cpu_{build_key()}"
    build_dir = cache_dir() / name
    return name, build_dir, build_dir / f"{name}.so"


def cpu_supported() -> bool:
    """True on x86-64 CPUs with AVX2 (the kernels' instruction set)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False) -> ModuleType:
    """Compile the extension into the cache (no-op when already built); raises on failure."""
    from torch.utils import cpp_extension

    name, build_dir, so_path = _paths()
    done = build_dir / "built"  # written last: a half-linked library is never imported
    if done.exists() and so_path.exists():
        return _import(name, so_path)
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("building the C++ CPU kernels into %s", build_dir)
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(SOURCE_DIR / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=verbose,
    )
    done.write_text(f"{time.perf_counter() - t0:.1f} s\n")
    logger.info("built the C++ CPU kernels in %.1f s", time.perf_counter() - t0)
    return module


def load() -> ModuleType | None:
    """The extension module, or None (forced off, unsupported CPU, or the build failed)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
        return _state["module"]


def _load() -> ModuleType | None:
    if os.environ.get(ENV_FORCE, "").lower() == "torch":
        return None
    if not cpu_supported():
        logger.info("CPU without AVX2: using the torch attention path")
        return None
    try:
        name, build_dir, so_path = _paths()
        if (build_dir / "built").exists() and so_path.exists():
            return _import(name, so_path)
        return build()
    except Exception as exc:  # noqa: BLE001 - any build/import failure means: use torch
        logger.warning("C++ CPU kernels unavailable, using the torch path: %s", exc)
        return None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    if not cpu_supported():
        print("CPU without AVX2: the C++ kernels are not built (the torch path is used)")
        return
    build(verbose="-v" in sys.argv)
    _, _, so_path = _paths()
    print(f"C++ CPU kernels ready: {so_path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
