"""Every weight scheme's invariance checks again with each library held to AVX2 (oneDNN, ATen,
fbgemm and our kernels), as an AVX2-only host runs them, whatever CPU this is: the checks pass
on AVX-512 and AMX hosts by themselves, and an AVX2 host's kernels sum differently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AVX2_ONLY = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "KVRELAY_KERNELS_ISA": "avx2",
}
FILES = ["test_model_invariance.py", "test_quant.py", "test_quant_fp16.py",
         "test_quant_int8_weight.py", "test_quant_q8.py"]  # fmt: skip
# the invariance checks and the pinned answers; the ISA-variant comparisons need no rerun
SELECT = "alone or batch or chunked or threads or rounds_only or row_block or answer"


@pytest.mark.skipif(os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS") == "AVX2", reason="forced run")
def test_invariance_holds_with_every_library_held_to_avx2():
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECT,
            *(str(ROOT / "tests" / "workers" / f) for f in FILES)]  # fmt: skip
    done = subprocess.run(args, env={**os.environ, **AVX2_ONLY}, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
