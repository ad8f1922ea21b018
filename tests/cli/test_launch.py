"""Real supervisord: config rendering, detached start, autorestart after SIGKILL, clean stop."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest
import redis

from kvrelay.cli.up.launch import Program, Supervisor, read_state, render_config
from tests.conftest import free_port, valkey_binary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a zombie is not alive for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_render_config_quotes_and_escapes(tmp_path):
    prog = Program("decode-0", [sys.executable, "-c", "print('50%')"], env={"A": 'x"y%'})
    text = render_config(tmp_path, [prog], nodaemon=True)
    assert "[program:decode-0]" in text
    assert "command=" + sys.executable + " -c 'print('\"'\"'50%%'\"'\"')'" in text
    assert 'environment=A="x\\"y%%"' in text
    assert "autorestart=true" in text and "nodaemon=true" in text
    assert ("user=root" in text) == (os.geteuid() == 0)


def test_detached_stack_restarts_killed_programs_and_stops(tmp_path):
    port = free_port()
    programs = [
        Program(
            "valkey",
            [
                valkey_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(tmp_path),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            priority=10,
        ),
        Program(
            "sleeper",
            [sys.executable, "-c", "import time, os; time.sleep(600)"],
            env={"KVRELAY_X": "1"},
        ),
    ]
    sup = Supervisor(tmp_path / "run")
    sup.write(programs, nodaemon=False, state={"redis_url": f"redis://127.0.0.1:{port}/0"})
    assert read_state(tmp_path / "run")["redis_url"].endswith(f":{port}/0")
    sup.start(detach=True)
    try:
        pids = sup.wait_running(["valkey", "sleeper"], timeout=30)
        client = redis.Redis(port=port)
        client.xadd("s", {"m": b"1"})
        os.kill(pids["valkey"], signal.SIGKILL)
        os.kill(pids["sleeper"], signal.SIGKILL)
        time.sleep(0.3)
        new = sup.wait_running(["valkey", "sleeper"], timeout=30)
        assert new["valkey"] != pids["valkey"] and new["sleeper"] != pids["sleeper"]
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.xlen("s") == 1  # appendonly: the stream survived SIGKILL
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with open(f"/proc/{new['sleeper']}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert b"KVRELAY_X=1" in env
    finally:
        assert sup.stop(timeout=30)
    assert sup.pid() is None
    assert not _alive(new["valkey"]) and not _alive(new["sleeper"])


FOREGROUND = """
import sys
from kvrelay.cli.up.launch import Program, Supervisor
sup = Supervisor(sys.argv[1])
sup.write([Program("a", [sys.executable, "-c", "import time; time.sleep(600)"]),
           Program("b", [sys.executable, "-c", "import time; time.sleep(600)"])], nodaemon=True)
sup.start(detach=False)
sys.exit(sup.wait())
"""


def test_foreground_stack_stops_everything_on_sigterm(tmp_path):
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", FOREGROUND, str(tmp_path)])
    sup = Supervisor(tmp_path)
    deadline = time.monotonic() + 30
    while not sup.config_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = sup.wait_running(["a", "b"], timeout=30)
    proc.send_signal(signal.SIGTERM)  # what Ctrl-C or `kill` does to `kvrelay up`
    assert proc.wait(timeout=30) == 0
    assert sup.pid() is None
    assert not any(_alive(p) for p in pids.values())


def test_up_programs_divide_cores_and_share_settings(tmp_path):
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs
    from kvrelay.cli.up.topology import threads_per_worker

    assert [threads_per_worker(c, 3) for c in (1, 2, 6, 16)] == [1, 1, 2, 5]
    args = build_parser().parse_args(
        [
            "up",
            "--prefill",
            "2",
            "--decode",
            "3",
            "--threads",
            "10",
            "--port",
            "9001",
            "--env",
            "KVRELAY_WORKER_LEASE_MS=500",
        ]
    )
    programs, state = build_programs(args, tmp_path)
    names = [p.name for p in programs]
    assert names == [
        "valkey",
        "store",
        "ingress",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
    ]
    by = {p.name: p for p in programs}
    assert by["decode-2"].command[-4:] == ["--name", "decode-2", "--threads", "2"]
    assert by["decode-2"].env["OMP_NUM_THREADS"] == "2"
    assert by["ingress"].command[-4:] == ["--host", "127.0.0.1", "--port", "9001"]
    assert by["prefill-0"].env["KVRELAY_WORKER_LEASE_MS"] == "500"
    port = by["valkey"].command[by["valkey"].command.index("--port") + 1]
    assert state["redis_url"] == f"redis://127.0.0.1:{port}/0"
    assert by["store"].env["KVRELAY_STORE_RUN_DIR"] == str(tmp_path / "store")
    assert by["prefill-0"].env["KVRELAY_REDIS_URL"] == state["redis_url"]
    assert (
        by["valkey"].priority
        < by["store"].priority
        < by["ingress"].priority
        < by["decode-0"].priority
    )
    external = build_parser().parse_args(["up", "--redis-url", "redis://db:6379/2"])
    programs, state = build_programs(external, tmp_path)
    assert "valkey" not in [p.name for p in programs] and state["redis_url"] == "redis://db:6379/2"


def test_weights_are_chosen_for_the_host_unless_given(tmp_path, monkeypatch):
    from kvrelay.cli import up
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs
    from kvrelay.cli.up.topology import default_weights

    assert default_weights(0, "x86_64", int8_kernel=True, kernel_isa="avx512") == (
        "int8-weight-only",
        "CPU host: int8 weights (a scale per 32), fp32 activations",
    )
    assert default_weights(0, "x86_64", int8_kernel=True, kernel_isa="amx", bf16_tiles=True) == (
        "w8a16",
        "AMX host: int8 weights (a scale per output), bf16 activations, AMX bf16 tiles",
    )
    assert default_weights(0, "x86_64", int8_kernel=True, kernel_isa="amx", bf16_tiles=False) == (
        "q8_0",
        "AMX host without the OS's tiles: int8 weights and activations",
    )
    assert default_weights(0, "x86_64", int8_kernel=False) == (
        "fp16",
        "CPU host, C++ kernels not built: fp16 weights, fp32 activations",
    )
    assert default_weights(2, "x86_64") == ("none", "GPU workers keep the model's weights")
    assert default_weights(0, "aarch64") == ("none", "no fp16 GEMM on aarch64: fp32 weights")
    # a CPU host and a GPU host, whatever this one is
    for gpus in (0, 1):
        monkeypatch.setattr(up.command, "_num_gpus", lambda gpus=gpus: gpus)
        for flag, want in (([], default_weights(gpus)[0]), (["--quantization", "none"], "none")):
            args = build_parser().parse_args(["up", "--threads", "2", *flag])
            programs, state = build_programs(args, tmp_path / f"{gpus}-{len(flag)}")
            assert state["quantization"] == want
            for program in programs:
                if program.name in ("store", "decode-0"):
                    assert program.env.get("KVRELAY_STORE_QUANTIZATION") == (
                        None if want == "none" else want
                    )


def test_topology_is_chosen_for_the_host_unless_given():
    from kvrelay.cli.up.topology import choose

    def counts(cores, gpus, prefill=None, decode=None, wants=False):
        t = choose(cores, gpus, prefill, decode, wants)
        return t.prefill, t.decode, t.threads, t.auto

    # CPU: never a dedicated prefill worker; one decode worker per 16 cores, all cores used
    assert [counts(c, 0) for c in (1, 2, 8, 16, 40)] == [
        (0, 1, 1, True), (0, 1, 2, True), (0, 1, 8, True), (0, 1, 16, True), (0, 2, 20, True)
    ]  # fmt: skip
    # GPUs: one worker per GPU, one in four prefills (at least one once there are two)
    assert [counts(16, g)[:2] for g in (1, 2, 4, 8)] == [(0, 1), (1, 1), (1, 3), (2, 6)]
    assert counts(2, 0, prefill=1) == (1, 1, 1, False)  # given counts win, cores divided
    assert counts(2, 0, decode=3) == (0, 3, 1, False)
    assert counts(2, 0, wants=True) == (1, 1, 1, True)  # --mode auto|disaggregated asked for
    t = choose(2, 0, None, None)
    assert t.describe() == (
        "1 decode worker, 2 threads each, decode prefills locally "
        "(auto: 2 CPU cores, no GPU: a prefill worker would take cores decode needs)"
    )
    assert choose(4, 0, 1, 1).describe() == (
        "1 prefill + 1 decode workers, 2 threads each (given: --prefill 1 --decode 1)"
    )
    assert t.to_dict()["layout"] == "colocated" and choose(4, 2, None, None).layout == (
        "disaggregated"
    )


def _main(capsys, *argv: str) -> tuple[int, str]:
    """Run the real `kvrelay` entry in-process; (exit code, last stderr line)."""
    from kvrelay.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


HINT = " (see `kvrelay up --help`)"  # argparse usage errors name the help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "0"], "kvrelay up: error: argument --port: port must be 1-65535, got 0" + HINT),
        (
            ["--port", "70000"],
            "kvrelay up: error: argument --port: port must be 1-65535, got 70000" + HINT,
        ),
        (["--port", "x"], "kvrelay up: error: argument --port: not a port: 'x'" + HINT),
        (
            ["--redis-port", "65536"],
            "kvrelay up: error: argument --redis-port: port must be 0-65535, got 65536" + HINT,
        ),
        (
            ["--env", "NOEQUALS"],
            "kvrelay up: error: argument --env: wants KEY=VALUE, got 'NOEQUALS'" + HINT,
        ),
        (["--env", "=1"], "kvrelay up: error: argument --env: wants KEY=VALUE, got '=1'" + HINT),
        (
            ["--prefill", "-1"],
            "kvrelay up: error: argument --prefill: count must be at least 0, got -1" + HINT,
        ),
        (["--decode", "0"], "kvrelay up: error: need --decode >= 1 (and --prefill >= 0)"),
        (
            ["--prefill", "0", "--mode", "auto"],
            "kvrelay up: error: --prefill 0 needs mode colocated (no prefill worker), got auto",
        ),
        (
            ["--mode", "auto", "--env", "KVRELAY_INGRESS_MODE=colocated"],
            "kvrelay up: error: --mode auto disagrees with --env KVRELAY_INGRESS_MODE=colocated",
        ),
        (
            ["--env", "KVRELAY_INGRESS_MODE=fast"],
            "kvrelay up: error: KVRELAY_INGRESS_MODE must be one of auto, disaggregated, "
            "colocated, got 'fast'",
        ),
        (
            ["--port", "7001", "--redis-port", "7001"],
            "kvrelay up: error: --port and --redis-port are both 7001",
        ),
        (
            ["--speculation", "draft"],
            "kvrelay up: error: workers: speculation 'draft' needs a draft model (--draft-model)",
        ),
        (
            ["--env", "KVRELAY_WORKER_NUM_SPECULATIVE_TOKENS=0"],
            "kvrelay up: error: workers: num_speculative_tokens must be at least 1, got 0",
        ),
        (
            ["--num-speculative-tokens", "0"],
            "kvrelay up: error: argument --num-speculative-tokens: size must be at least 1, "
            "got 0" + HINT,
        ),
    ],
)
def test_up_usage_errors_exit_2_before_launching(tmp_path, capsys, argv, message):
    code, line = _main(capsys, "up", "--detach", "--run-dir", str(tmp_path / "run"), *argv)
    assert (code, line) == (2, message)
    assert not (tmp_path / "run").exists()


def test_up_refuses_ports_in_use_and_unreachable_redis(tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for argv in (
            ["--port", str(busy)],
            ["--port", str(free_port()), "--redis-port", str(busy)],
        ):
            code, line = _main(capsys, "up", "--detach", "--run-dir", run, *argv)
            assert (code, line) == (2, f"kvrelay up: error: port {busy} on 127.0.0.1 is in use")
        code, line = _main(capsys, "up", "--run-dir", run, "--host", "0.0.0.0", "--port", str(busy))
        assert (code, line) == (2, f"kvrelay up: error: port {busy} on 0.0.0.0 is in use")
    closed = free_port()
    url = f"redis://app:s3cret@127.0.0.1:{closed}/0"
    pinged, ping = [], redis.Redis.ping

    def counted_ping(client, **kwargs):
        pinged.append(client.connection_pool.connection_kwargs["port"])
        return ping(client, **kwargs)

    monkeypatch.setattr(redis.Redis, "ping", counted_ping)
    code, line = _main(capsys, "up", "--detach", "--run-dir", run, "--port", str(free_port()),
                       "--redis-url", url)  # fmt: skip
    assert pinged == [closed]  # one PING, refused: `up` does not wait for that Redis to come up
    assert (code, line) == (
        1,
        f"kvrelay up: error: Redis at redis://app:***@127.0.0.1:{closed}/0 is not reachable: "
        f"Error 111 connecting to 127.0.0.1:{closed}. Connection refused.",
    )
    assert not (tmp_path / "run").exists()
    code, line = _main(capsys, "down", "--run-dir", str(tmp_path / "none"))
    none = tmp_path / "none"
    assert (code, line) == (
        2,
        f"kvrelay down: error: no kvrelay stack in {none} ({none / 'stack.json'} is missing)",
    )


def test_up_mode_reaches_the_ingress_only(tmp_path):
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs

    cases = [
        ([], "colocated"),  # a CPU host: one decode worker that prefills locally
        (["--prefill", "1"], "auto"),
        (["--mode", "auto"], "auto"),  # the mode asked for needs a prefill worker: one comes
        (["--mode", "disaggregated"], "disaggregated"),
        (["--prefill", "0"], "colocated"),
        (["--env", "KVRELAY_INGRESS_MODE=disaggregated"], "disaggregated"),
    ]
    for argv, mode in cases:
        args = build_parser().parse_args(["up", "--threads", "2", *argv])
        programs, state = build_programs(args, tmp_path)
        assert state["topology"]["prefill"] == (mode != "colocated")
        by = {p.name: p for p in programs}
        assert (by["ingress"].env["KVRELAY_INGRESS_MODE"], state["mode"]) == (mode, mode)
        assert "KVRELAY_INGRESS_MODE" not in by["decode-0"].env or argv[:1] == ["--env"]
        assert by["ingress"].command[1:4] == ["-m", "kvrelay.cli.main", "serve"]


def test_readiness_wants_this_stacks_programs_running_and_listening(tmp_path):
    import subprocess

    from kvrelay.cli.up.launch import listens
    from kvrelay.cli.up.ready import not_ready_reason

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with socket.socket() as served:  # another process (this one) holds the ingress port
            served.bind(("127.0.0.1", 0))
            served.listen()
            port = served.getsockname()[1]
            assert listens(os.getpid(), port) is True
            assert listens(os.getpid(), free_port()) is False
            assert listens(other.pid, port) is False
            state = {"programs": ["ingress", "decode-0"], "port": port, "host": "127.0.0.1",
                     "prefill": 0, "decode": 1}  # fmt: skip
            running = {"ingress": ("RUNNING", other.pid), "decode-0": ("RUNNING", 7)}
            assert not_ready_reason(state, {}, {}) == "supervisord does not answer"
            backoff = dict(running, ingress=("BACKOFF", None))
            assert not_ready_reason(state, backoff, {}) == "ingress is BACKOFF"
            moved = dict(running, ingress=("RUNNING", 1))
            assert not_ready_reason(state, running, moved) == "ingress restarted"
            assert not_ready_reason(state, running, running) == (
                f"ingress (pid {other.pid}) is not listening on port {port}"
            )
    finally:
        other.kill()
        other.wait()


def test_status_topology_counts_live_workers_and_names_the_choice():
    from kvrelay.cli.admin import topology_of
    from kvrelay.cli.up.topology import choose

    workers = [{"role": "decode"}, {"role": "decode"}, {"role": "prefill"}]
    assert topology_of(workers, {}) == {
        "prefill": 1,
        "decode": 2,
        "layout": "disaggregated",
        "chosen": None,
        "summary": "1 prefill + 2 decode live (disaggregated)",
    }
    state = {"topology": choose(2, 0, None, None).to_dict()}
    got = topology_of([{"role": "decode"}], state)
    assert got["summary"] == (
        "0 prefill + 1 decode live (colocated: decode workers prefill locally); kvrelay up: "
        "1 decode worker, 2 threads each, decode prefills locally (auto: 2 CPU cores, no GPU: "
        "a prefill worker would take cores decode needs)"
    )


def test_kv_cache_dtype_reaches_the_workers_and_the_store(tmp_path, monkeypatch):
    """`up --kv-cache-dtype bf16`: workers get the setting, and the store expects their pages:
    bf16 page bytes and the fingerprint of fp32 compute with bf16 pages (a CPU host)."""
    import argparse

    from kvrelay.cli import up
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.store import add_store_arguments, build_config
    from kvrelay.cli.up.command import build_programs
    from kvrelay.core.modelref import converted_dir, model_fingerprint, resolve_model

    monkeypatch.setattr(up.command, "_num_gpus", lambda: 0)
    args = build_parser().parse_args(["up", "--threads", "2", "--kv-cache-dtype", "bf16"])
    programs, state = build_programs(args, tmp_path)
    assert state["kv_cache_dtype"] == "bf16"
    env = {p.name: p.env for p in programs}
    assert env["decode-0"]["KVRELAY_WORKER_KV_CACHE_DTYPE"] == "bf16"
    store_env = env["store"]
    assert (store_env["KVRELAY_STORE_DTYPE"], store_env["KVRELAY_STORE_MODEL_DTYPE"]) == (
        "bfloat16",
        "float32",
    )
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    p = argparse.ArgumentParser()
    add_store_arguments(p)
    cfg = build_config(p.parse_args([]))
    directory = converted_dir(resolve_model(args.model))
    quant, attention = state["quantization"], state["attention_precision"]
    assert env["decode-0"]["KVRELAY_WORKER_ATTENTION_PRECISION"] == attention
    assert store_env["KVRELAY_STORE_ATTENTION_PRECISION"] == attention
    assert cfg.fingerprint == model_fingerprint(directory, "float32", quant, "bfloat16", attention)
    assert cfg.fingerprint != model_fingerprint(directory, "float32", quant)
    monkeypatch.setenv("KVRELAY_STORE_DTYPE", "fp32")
    monkeypatch.delenv("KVRELAY_STORE_MODEL_DTYPE")
    monkeypatch.setenv("KVRELAY_STORE_ATTENTION_PRECISION", "fp32")  # bf16 needs bf16 pages
    assert build_config(p.parse_args([])).page_bytes == 2 * cfg.page_bytes


def test_attention_precision_is_resolved_once_for_the_workers_and_the_store(tmp_path, monkeypatch):
    """`up --attention-precision`: auto is bf16 where AMX-BF16 runs with bf16 pages, fp32
    elsewhere; given, the workers and the store get it; bf16 where it cannot run is refused
    before anything starts, with the reason."""
    from kvrelay.cli import up
    from kvrelay.cli.errors import CommandError
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs
    from kvrelay.kernels import bf16_attention_available

    monkeypatch.setattr(up.command, "_num_gpus", lambda: 0)

    def programs_for(*flags):
        args = build_parser().parse_args(["up", "--threads", "2", *flags])
        programs, state = build_programs(args, tmp_path)
        env = {p.name: p.env for p in programs}
        got = env["decode-0"]["KVRELAY_WORKER_ATTENTION_PRECISION"]
        assert env["store"]["KVRELAY_STORE_ATTENTION_PRECISION"] == got
        assert state["attention_precision"] == got
        return got

    amx = bf16_attention_available()
    assert programs_for() == ("bf16" if amx else "fp32")
    assert programs_for("--attention-precision", "fp32") == "fp32"
    assert programs_for("--kv-cache-dtype", "fp32") == "fp32"  # auto: bf16 needs bf16 pages
    with pytest.raises(CommandError, match="--attention-precision bf16 needs bf16 KV pages"):
        programs_for("--attention-precision", "bf16", "--kv-cache-dtype", "fp32")
    if amx:
        assert programs_for("--attention-precision", "bf16") == "bf16"
    else:
        with pytest.raises(CommandError, match="needs AMX-BF16"):
            programs_for("--attention-precision", "bf16")


def test_kv_cache_dtype_auto_is_resolved_once_for_workers_and_store(tmp_path, monkeypatch):
    """`up` resolves --kv-cache-dtype auto by the workers' rule (bf16 pages for fp32 compute
    on CPU with the C++ kernels, fp32 on the torch path), hands every worker the result and
    the store the matching page dtype, and records it in stack.json; a standalone store's
    default (auto) expects the same pages. On a GPU host: the model's bf16 for both."""
    import argparse

    from kvrelay.cli import up
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.store import add_store_arguments, build_config
    from kvrelay.cli.up.command import build_programs
    from kvrelay.core.modelref import converted_dir, model_fingerprint, resolve_model
    from kvrelay.kernels import cpu_build

    for name in ("KVRELAY_STORE_DTYPE", "KVRELAY_STORE_MODEL_DTYPE", "KVRELAY_KERNELS_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(up.command, "_num_gpus", lambda: 1)
    args = build_parser().parse_args(["up", "--threads", "2", "--prefill", "1"])
    programs, state = build_programs(args, tmp_path / "gpu")
    env = {p.name: p.env for p in programs}
    assert (state["kv_cache_dtype"], state["quantization"]) == ("bf16", "none")
    assert (env["store"]["KVRELAY_STORE_DTYPE"], env["store"]["KVRELAY_STORE_MODEL_DTYPE"]) == (
        "bfloat16",
        "bfloat16",
    )
    monkeypatch.setattr(up.command, "_num_gpus", lambda: 0)
    kernels = cpu_build.load() is not None
    for extra, short, long in (
        ([], "bf16" if kernels else "fp32", "bfloat16" if kernels else "float32"),
        (["--env", "KVRELAY_KERNELS_CPU=torch"], "fp32", "float32"),
        (["--env", "KVRELAY_WORKER_KV_CACHE_DTYPE=fp16"], "fp16", "float16"),
    ):
        args = build_parser().parse_args(["up", "--threads", "2", "--prefill", "1", *extra])
        programs, state = build_programs(args, tmp_path / short)
        assert state["kv_cache_dtype"] == short, extra
        env = {p.name: p.env for p in programs}
        assert {env[w]["KVRELAY_WORKER_KV_CACHE_DTYPE"] for w in ("prefill-0", "decode-0")} == {
            short
        }
        assert (env["store"]["KVRELAY_STORE_DTYPE"], env["store"]["KVRELAY_STORE_MODEL_DTYPE"]) == (
            long,
            "float32",
        )
    directory = converted_dir(resolve_model(args.model))
    p = argparse.ArgumentParser()
    add_store_arguments(p)
    cfg = build_config(p.parse_args(["--model", args.model]))  # dtype auto
    expected = "bfloat16" if kernels else "float32"
    from kvrelay.kernels import bf16_attention_available

    attention = "bf16" if kernels and bf16_attention_available() else "fp32"  # auto as well
    assert cfg.fingerprint == model_fingerprint(directory, "float32", "none", expected, attention)
    bf16 = build_config(p.parse_args(["--model", args.model, "--dtype", "bf16", "--model-dtype",
                                      "float32"]))  # fmt: skip
    assert cfg.page_bytes == bf16.page_bytes * (1 if kernels else 2)


def test_speculation_reaches_the_workers(tmp_path):
    """`up --speculation/--num-speculative-tokens/--draft-model`: every worker gets the
    variables (only decode steps speculate; prefill workers ignore them); the stack state
    names the resolved mode; without the flags the workers' own settings hold."""
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs

    names = ("KVRELAY_WORKER_SPECULATION", "KVRELAY_WORKER_NUM_SPECULATIVE_TOKENS",
             "KVRELAY_WORKER_DRAFT_MODEL")  # fmt: skip
    cases = [
        ([], (None, None, None), "ngram"),  # auto without a draft model
        (["--speculation", "off"], ("off", None, None), "off"),
        (["--speculation", "ngram", "--num-speculative-tokens", "3"], ("ngram", "3", None),
         "ngram"),
        (["--draft-model", "smollm2-135m-instruct"], (None, None, "smollm2-135m-instruct"),
         "draft"),
        # --env is applied after the flags, as for every other setting
        (["--speculation", "ngram", "--env", "KVRELAY_WORKER_SPECULATION=off"],
         ("off", None, None), "off"),
    ]  # fmt: skip
    for n, (argv, want, mode) in enumerate(cases):
        args = build_parser().parse_args(["up", "--threads", "2", "--prefill", "1", *argv])
        programs, state = build_programs(args, tmp_path / str(n))
        by = {p.name: p.env for p in programs}
        for worker in ("prefill-0", "decode-0"):
            assert tuple(by[worker].get(v) for v in names) == want, argv
        assert state["speculation"] == mode, argv


def test_up_refuses_an_unknown_draft_model_before_launching(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["up", "--detach", "--run-dir", str(run), "--port", str(free_port())]
    code, line = _main(capsys, *argv, "--draft-model", "no-such-model")
    assert code == 2
    assert line.startswith("kvrelay up: error: draft model: unknown model 'no-such-model': ")
    assert not run.exists()


def test_w8a16_is_the_amx_default_and_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """`up` picks w8a16 where the AMX bf16 tiles run (and tells the store); asked for where they
    do not, it is refused before anything starts, with the reason."""
    import kvrelay.kernels
    from kvrelay.cli import up
    from kvrelay.cli.errors import CommandError
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs
    from kvrelay.kernels import loaded_isa, w8a16_available

    monkeypatch.setattr(up.command, "_num_gpus", lambda: 0)

    def weights(*flags):
        args = build_parser().parse_args(["up", "--threads", "2", *flags])
        programs, state = build_programs(args, tmp_path)
        env = {p.name: p.env for p in programs}
        assert env["store"]["KVRELAY_STORE_QUANTIZATION"] == state["quantization"]
        return env["decode-0"]["KVRELAY_WORKER_QUANTIZATION"]

    if w8a16_available():
        assert weights() == "w8a16"
        assert weights("--quantization", "w8a16") == "w8a16"
    elif loaded_isa() is not None:
        assert weights() in ("q8_0", "int8-weight-only")
    monkeypatch.setattr(kvrelay.kernels, "w8a16_available", lambda: False)
    with pytest.raises(CommandError, match="w8a16 needs AMX-BF16 tiles"):
        weights("--quantization", "w8a16")
