#!/usr/bin/env bash
# The project's test command: lint, format check, then the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# One-way layers (core <- components <- {workers, bench} <- cli): import-linter's contracts in
# pyproject.toml, run through the interpreter (its console script may not be on PATH).
"$PY" -c "import sys; from importlinter.cli import lint_imports_command as m; sys.exit(m())"
# Types: the whole package checks clean (pyproject.toml [tool.mypy]).
"$PY" -m mypy kvrelay
# No import cycles between modules, TYPE_CHECKING imports included: grimp + Tarjan's SCC.
"$PY" scripts/check_cycles.py
# Convert the bundled GGUF model once (cached under $KVRELAY_CACHE_DIR) before the timed tests.
"$PY" -c "from kvrelay.workers.model.loader import prepare_model; prepare_model('smollm2-135m-instruct')"
exec "$PY" -m pytest -q -p no:cacheprovider --durations=25 "$@"
