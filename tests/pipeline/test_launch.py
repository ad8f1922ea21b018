"""Real supervisord: config rendering, detached start, autorestart after SIGKILL, clean stop."""

from __future__ import annotations

import os
import signal
import sys
import time

import redis

from kvrelay.pipeline.launch import Program, Supervisor, read_state, render_config
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
from kvrelay.pipeline.launch import Program, Supervisor
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
    from kvrelay.pipeline.cli import build_parser
    from kvrelay.pipeline.cli_up import build_programs, threads_per_worker

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
