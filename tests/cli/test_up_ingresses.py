"""Several ingresses behind one address: `kvrelay serve --reuse-port` sockets sharing a port, and
`kvrelay up --ingresses N` (programs, flags, readiness per ingress, usage errors)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvrelay.cli.errors import CommandError
from kvrelay.cli.serve import bind_shared
from kvrelay.cli.up.launch import check_port_free, listens
from kvrelay.cli.up.topology import ingress_names, ingress_programs, is_ingress
from tests.conftest import free_port


def _accepted_by(servers: list[socket.socket], connections: int) -> list[int]:
    """Open `connections` client connections to the servers' port; which server (its index in
    `servers`) accepted each."""
    port = servers[0].getsockname()[1]
    for s in servers:
        s.setblocking(False)
    taken: list[int] = []
    clients = []
    try:
        for _ in range(connections):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            while len(taken) < len(clients):  # the handshake is done: one queue holds it
                for i, s in enumerate(servers):
                    try:
                        conn, _addr = s.accept()
                    except BlockingIOError:
                        continue
                    conn.close()
                    taken.append(i)
    finally:
        for c in clients:
            c.close()
    return taken


def test_reuse_port_sockets_share_the_port_and_a_survivor_takes_every_connection():
    first = bind_shared("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = bind_shared("127.0.0.1", port)
    try:
        # bound, not listening: no connection is queued where no app accepts it yet
        assert listens(os.getpid(), port) is False
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        first.listen()  # the second one's app is still starting: it takes no connection
        assert _accepted_by([first], 16) == [0] * 16
        second.listen()
        assert listens(os.getpid(), port) is True
        # the kernel spreads connections (a hash of each one's addresses) over both
        assert set(_accepted_by([first, second], 32)) == {0, 1}
        # a listener that does not share the port is refused while they hold it
        with pytest.raises(CommandError, match=f"^port {port} on 127.0.0.1 is in use$"):
            check_port_free("127.0.0.1", port)
        first.close()  # killed: every new connection reaches the one left
        assert _accepted_by([second], 16) == [0] * 16
    finally:
        first.close()
        second.close()


def test_reuse_port_refuses_a_port_held_by_a_plain_listener():
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        port = plain.getsockname()[1]
        with pytest.raises(CommandError) as info:
            bind_shared("127.0.0.1", port)
        assert str(info.value) == (
            f"port {port} on 127.0.0.1 is in use by a listener that does not share it "
            "(SO_REUSEPORT)"
        )
        # the real command says it in one line, exit 2, before starting anything
        done = subprocess.run(
            [sys.executable, "-m", "kvrelay.cli.main", "serve", "--reuse-port", "--port",
             str(port), "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        f"kvrelay serve: error: {info.value}",
    )
    with pytest.raises(CommandError, match="^port must be 0-65535"):
        bind_shared("127.0.0.1", 70000)


def test_ingress_program_names():
    assert ingress_names(1) == ["ingress"]
    assert ingress_names(3) == ["ingress", "ingress-1", "ingress-2"]
    assert [is_ingress(n) for n in ("ingress", "ingress-12", "ingress-", "ingress-x",
                                    "decode-0", "store")] == [True, True, False, False,
                                                              False, False]  # fmt: skip
    state = {"programs": ["valkey", "store", "ingress", "ingress-1", "decode-0"]}
    assert ingress_programs(state) == ["ingress", "ingress-1"]


def test_up_runs_n_ingresses_on_one_shared_address(tmp_path):
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs

    base = ["up", "--threads", "2", "--port", "9001"]
    programs, state = build_programs(build_parser().parse_args(base), tmp_path)
    by = {p.name: p for p in programs}
    assert [n for n in by if is_ingress(n)] == ["ingress"] and "ingresses" not in state
    assert "--reuse-port" not in by["ingress"].command  # one ingress: today's stack

    programs, state = build_programs(build_parser().parse_args([*base, "--ingresses", "3"]),
                                     tmp_path)  # fmt: skip
    names = [p.name for p in programs]
    assert names == ["valkey", "store", "ingress", "ingress-1", "ingress-2", "decode-0"]
    assert (state["ingresses"], ingress_programs(state)) == (3, names[2:5])
    commands = [p.command for p in programs[2:5]]
    assert all(c == commands[0] for c in commands)  # the same address and settings
    serve = commands[0][commands[0].index("serve") :]
    assert serve == ["serve", "--host", "127.0.0.1", "--port", "9001", "--reuse-port"]
    assert {p.env["KVRELAY_INGRESS_MODE"] for p in programs[2:5]} == {"colocated"}
    assert {p.priority for p in programs[2:5]} == {30}


def _main(capsys, *argv: str) -> tuple[int, str]:
    from kvrelay.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "number of ingresses must be 1-64, got 0"),
        ("65", "number of ingresses must be 1-64, got 65"),
        ("two", "not a number of ingresses: 'two'"),
    ],
)
def test_up_refuses_a_bad_ingress_count(tmp_path, capsys, value, message):
    run = tmp_path / "run"
    code, line = _main(capsys, "up", "--detach", "--run-dir", str(run), "--ingresses", value)
    assert (code, line) == (
        2,
        f"kvrelay up: error: argument --ingresses: {message} (see `kvrelay up --help`)",
    )
    assert not run.exists()


def test_readiness_checks_every_ingress_listens():
    from kvrelay.cli.up.ready import not_ready_reason

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    served = bind_shared("127.0.0.1", 0)
    try:
        served.listen()
        port = served.getsockname()[1]
        state = {"programs": ["ingress", "ingress-1", "decode-0"], "port": port,
                 "host": "127.0.0.1", "prefill": 0, "decode": 1}  # fmt: skip
        # this process listens as `ingress`; `ingress-1` (another pid) does not yet
        status = {"ingress": ("RUNNING", os.getpid()), "ingress-1": ("RUNNING", other.pid),
                  "decode-0": ("RUNNING", 7)}  # fmt: skip
        assert not_ready_reason(state, status, status) == (
            f"ingress-1 (pid {other.pid}) is not listening on port {port}"
        )
        starting = dict(status, **{"ingress-1": ("STARTING", None)})
        assert not_ready_reason(state, starting, starting) == "ingress-1 is STARTING"
    finally:
        served.close()
        other.kill()
        other.wait()


def test_ingresses_with_shards_and_several_models(tmp_path):
    from kvrelay.cli.main import build_parser
    from kvrelay.cli.up.command import build_programs
    from kvrelay.core.modelref import DEFAULT_MODEL
    from tests.cli.test_up_models import model_dir

    argv = ["up", "--threads", "2", "--ingresses", "2", "--shards", "2",
            "--redis-port", str(free_port())]  # fmt: skip
    programs, state = build_programs(build_parser().parse_args(argv), tmp_path / "a")
    names = [p.name for p in programs]
    assert names == ["valkey-0", "valkey-1", "store", "ingress", "ingress-1", "decode-0"]
    # started once the cluster is formed, as the one ingress is
    assert [p.autostart for p in programs] == [True, True, False, False, False, False]
    tiny = model_dir(tmp_path, "Tiny_Llama")
    argv = ["up", "--threads", "4", "--redis-port", "7100", "--ingresses", "2",
            "--model", DEFAULT_MODEL, "--model", str(tiny)]  # fmt: skip
    programs, state = build_programs(build_parser().parse_args(argv), tmp_path / "b")
    by = {p.name: p for p in programs}
    assert ingress_programs(state) == ["ingress", "ingress-1"]
    # every ingress serves every model
    assert by["ingress"].env == by["ingress-1"].env
    assert by["ingress-1"].env["KVRELAY_INGRESS_MODELS"] == f"{DEFAULT_MODEL},{tiny}"


def test_up_refuses_a_port_in_use_for_its_ingresses(tmp_path, capsys):
    run = tmp_path / "run"
    # held with SO_REUSEPORT (an ingress of another stack): still not this stack's to share
    for holder in (socket.socket(), bind_shared("127.0.0.1", 0)):
        with holder:
            if holder.getsockname()[1] == 0:
                holder.bind(("127.0.0.1", 0))
            holder.listen()
            busy = holder.getsockname()[1]
            argv = ["--ingresses", "2", "--port", str(busy)]
            code, line = _main(capsys, "up", "--detach", "--run-dir", str(run), *argv)
            assert (code, line) == (2, f"kvrelay up: error: port {busy} on 127.0.0.1 is in use")
    assert not run.exists()
