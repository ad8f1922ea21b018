"""The engine settings on `kvrelay worker` and `kvrelay generate`: `--kv-cache-dtype` and
`--quantization` (and its variable) are checked as usage errors, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvrelay.cli import generate, worker


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "--log-level", "WARNING", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_kv_cache_dtype_flag():
    p = argparse.ArgumentParser()
    worker.add_arguments(p)
    assert p.parse_args(["decode", "--kv-cache-dtype", "bf16"]).kv_cache_dtype == "bf16"
    assert p.parse_args(["decode"]).kv_cache_dtype is None
    with pytest.raises(SystemExit):
        p.parse_args(["decode", "--kv-cache-dtype", "int4"])
    g = argparse.ArgumentParser()
    generate.add_arguments(g)
    assert g.parse_args(["hi", "--kv-cache-dtype", "fp16"]).kv_cache_dtype == "fp16"


@pytest.mark.parametrize("command", [["generate", "hi"], ["worker", "decode"]])
def test_cli_rejects_unknown_quantization_flag(command):
    r = _cli(*command, "--quantization", "int4")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --quantization: invalid choice: 'int4'" in r.stderr


def test_generate_rejects_unknown_quantization_env():
    r = _cli("generate", "hi", env={"KVRELAY_WORKER_QUANTIZATION": "int4"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "kvrelay generate: error: unsupported quantization 'int4'; use one of none, int8, "
        "fp16, int8-weight-only, q8_0, w8a16"
    ]


def test_worker_rejects_unknown_quantization_env():
    r = _cli("worker", "decode", env={"KVRELAY_WORKER_QUANTIZATION": "int4"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "kvrelay worker: error: unsupported quantization 'int4'; use one of none, int8, fp16, "
        "int8-weight-only, q8_0, w8a16"
    ]


def test_generate_refuses_w8a16_where_its_tiles_do_not_run():
    """Without AMX-BF16 (here the avx2 kernel variant forced, or no C++ kernels at all) the
    scheme is a usage error naming what it needs, before any weight is converted."""
    r = _cli("generate", "hi", "--quantization", "w8a16", env={"KVRELAY_KERNELS_ISA": "avx2"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "kvrelay generate: error: --quantization w8a16 needs the amx kernel variant (a CPU with "
        "AMX-BF16 and AVX512-BF16)"
    )
