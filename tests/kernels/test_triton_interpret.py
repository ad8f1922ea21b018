"""Triton kernels checked against the torch reference on CPU with TRITON_INTERPRET=1.

The interpreter must be switched on before triton is imported, so the checks run in a child
process (tests/kernels/triton_cases.py) and each test reads its case's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    "decode_gqa_ragged",
    "prefill_over_prefix",
    "mixed_long",
    "mha_group1",
    "group3_dim_not_pow2",
    "window_small_pages",
    "window_mqa_d256",
    "window_over_context",
    "decode_and_chunks",
    "split_k",
    "write_kv",
    "pages",
    "rope_write_kv",
    "linear_fp32",
    "linear_bf16",
    "rms_norm_fp32",
    "rms_norm_bf16",
]


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_cases"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_torch(results: dict, case: str) -> None:
    assert set(results) == set(CASES)
    assert results[case]["ok"], results[case]["detail"]
