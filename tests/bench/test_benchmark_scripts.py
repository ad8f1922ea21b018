"""benchmarks/peers.py's per-host peer settings and sizing (no server started), and
benchmarks/engine.py's smoke runs, decode-step rows, --json and --compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peers
from benchmarks.common import PeerConfig, cpu_flags, isa_line, peer_config

ROOT = Path(__file__).resolve().parents[2]
AMX_CPUINFO = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
ZEN_CPUINFO = "processor\t: 0\nmodel name\t: EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def test_cpu_flags_and_isa_line():
    assert cpu_flags(AMX_CPUINFO) == {"fpu", "avx2", "avx512f", "amx_bf16", "amx_tile"}
    assert isa_line(cpu_flags(ZEN_CPUINFO)) == (
        "avx2 yes, avx512f yes, avx512_bf16 yes, amx_bf16 no"
    )
    assert cpu_flags("no flags here") == set()


def test_peer_config_follows_amx_unless_overridden():
    amx, zen = cpu_flags(AMX_CPUINFO), cpu_flags(ZEN_CPUINFO)
    assert peer_config(amx) == PeerConfig("bfloat16", ["--no-repack"], "AMX host")
    assert peer_config(zen) == PeerConfig("float32", [], "no AMX")
    assert peer_config(amx, "float32") == PeerConfig(
        "float32", ["--no-repack"], "AMX host; vLLM --dtype float32 as asked"
    )
    assert peer_config(zen, "bfloat16").vllm_dtype == "bfloat16"


def print_config(monkeypatch, capsys, cpuinfo: str, *argv: str) -> dict:
    monkeypatch.setattr(peers, "cpu_flags", lambda: cpu_flags(cpuinfo))
    assert peers.main(["--print-config", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_peers_are_sized_for_32_long_context_streams(monkeypatch, capsys):
    workloads = "--workloads=short,shared-prefix,long-context"
    out = print_config(monkeypatch, capsys, ZEN_CPUINFO, workloads)
    assert (out["rule"], out["slots"], out["tokens_per_slot"]) == ("no AMX", 64, 4192)
    assert out["kv_tokens"] == 32 * (4064 + 128)
    assert out["levels"][-2:] == [["long-context", 8], ["long-context", 32]]
    # kvrelay's KV dtype auto (this host's: bf16 with the C++ kernels, 23,040 bytes a token;
    # fp32 on the torch path, 46,080), 1.2x room; llama: 64 slots of 4,192 tokens
    from kvrelay.kernels import cpu_build

    pool = 3708813312 if cpu_build.load() is not None else 7417626624
    assert out["servers"] == {
        "kvrelay": f"--threads 2 --quantization auto --kv-cache-bytes {pool}",
        "llama": "-t 2 -tb 2 --parallel 64 -c 268288",
        "vllm": "OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=7 --dtype float32 --max-model-len 4192",
    }
    extra = "--kvrelay-extra=--kv-cache-dtype bf16"
    out = print_config(monkeypatch, capsys, AMX_CPUINFO, workloads, extra)
    assert out["servers"] == {
        "kvrelay": "--threads 2 --quantization auto --kv-cache-bytes 3708813312 "
        "--kv-cache-dtype bf16",
        "llama": "-t 2 -tb 2 --parallel 64 -c 268288 --no-repack",
        "vllm": "OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=4 --dtype bfloat16 --max-model-len 4192",
    }


def test_short_only_keeps_the_default_pools(monkeypatch, capsys):
    out = print_config(monkeypatch, capsys, ZEN_CPUINFO, "--workloads=short", "--vllm-kv-gib=6")
    assert (out["slots"], out["tokens_per_slot"], out["kv_tokens"]) == (64, 256, 64 * 256)
    assert out["servers"] == {
        "kvrelay": "--threads 2 --quantization auto",
        "llama": "-t 2 -tb 2 --parallel 64 -c 16384",
        "vllm": "OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=6 --dtype float32 --max-model-len 4096",
    }


def test_long_context_requests_come_from_the_bench_dataset():
    from kvrelay.bench.datasets import builtin

    convs = peers.requests_for("long-context", 8, "salt", "", seed=1008)
    assert len(convs) == 16
    assert convs[3] == builtin("long-context", 1008).session(3).messages
    assert len({c[0]["content"] for c in convs}) == 16
    assert len(peers.requests_for("long-context", 32, "s", "", 1032, per_stream=1)) == 32
    assert len(peers.requests_for("short", 1, "s", "", per_stream=1)) == 4


def engine(*argv: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine.py"), *argv]
    # this tree's kvrelay, whatever the environment has installed
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[0])


@pytest.mark.slow
def test_engine_quick_and_decode_step_rows_compare(tmp_path):
    plain = engine("--quick", "--json", str(tmp_path / "a.json"))
    assert [r["tokens"] for r in plain["prefill"]] == [64]
    assert [r["batch"] for r in plain["decode"]] == [1, 4]
    steps = engine("--quick", "--decode-context", "64", "--json", str(tmp_path / "b.json"))
    assert [(r["batch"], r["context"], r["steps"]) for r in steps["decode"]] == [
        (1, 64, 5),
        (4, 64, 5),
    ]
    assert all(r["ms_per_step"] > 0 and r["kvrelay_tok_s"] > 0 for r in steps["decode"])
    assert json.loads((tmp_path / "b.json").read_text()) == steps
    out = engine("--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    old, new = plain["prefill"][0]["kvrelay_tok_s"], steps["prefill"][0]["kvrelay_tok_s"]
    # decode rows differ in context, so only the prefill row pairs up
    assert out["rows"] == [
        {
            "row": "prefill 64 tokens",
            "old_tok_s": old,
            "new_tok_s": new,
            "speedup": round(new / old, 2),
        }
    ]
