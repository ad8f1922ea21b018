"""supervisord plumbing for `kvrelay up`: write a config into a run directory, start, stop, query.

Every program gets `autorestart=true` and its own process group (stopasgroup/killasgroup) so a
SIGKILLed child comes back and a stop takes its children with it; logs land in `<run>/logs`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import xmlrpc.client
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

logger = logging.getLogger(__name__)

CONFIG_NAME = "supervisord.conf"
SOCKET_NAME = "supervisor.sock"
STATE_NAME = "stack.json"
PROMPT_SUPERVISORD = "kvrelay.cli.up.prompt_supervisord"


@dataclass(slots=True)
class Program:
    """One supervised process."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    priority: int = 500  # lower starts first and stops last
    startsecs: int = 1
    stopwaitsecs: int = 15
    # False: started by `Supervisor.start_all` once what it needs is up (a formed Valkey cluster)
    autostart: bool = True


def _quote_env(env: dict[str, str]) -> str:
    # supervisord's environment= takes KEY="value" pairs; '%' must be doubled for its interpolation
    parts = []
    for key, value in env.items():
        escaped = str(value).replace("%", "%%").replace('"', '\\"')
        parts.append(f'{key}="{escaped}"')
    return ",".join(parts)


def render_config(run_dir: Path, programs: list[Program], nodaemon: bool) -> str:
    """The supervisord config text for `programs` with state under `run_dir`."""
    logs = run_dir / "logs"
    lines = [
        "[unix_http_server]",
        f"file={run_dir / SOCKET_NAME}",
        "chmod=0700",
        "",
        "[supervisord]",
        f"nodaemon={'true' if nodaemon else 'false'}",
        f"logfile={logs / 'supervisord.log'}",
        f"pidfile={run_dir / 'supervisord.pid'}",
        f"directory={run_dir}",
        "childlogdir=" + str(logs),
        "logfile_maxbytes=10MB",
        "loglevel=info",
    ]
    if os.geteuid() == 0:
        lines.append("user=root")  # otherwise supervisord logs a CRIT line when run as root
    lines += [
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{run_dir / SOCKET_NAME}",
        "",
    ]
    for prog in programs:
        command = " ".join(shlex.quote(part) for part in prog.command).replace("%", "%%")
        lines += [
            f"[program:{prog.name}]",
            f"command={command}",
            f"priority={prog.priority}",
            f"autostart={'true' if prog.autostart else 'false'}",
            "autorestart=true",
            f"startsecs={prog.startsecs}",
            "startretries=1000",
            "stopsignal=TERM",
            f"stopwaitsecs={prog.stopwaitsecs}",
            "stopasgroup=true",
            "killasgroup=true",
            "redirect_stderr=true",
            f"stdout_logfile={logs / (prog.name + '.log')}",
            "stdout_logfile_maxbytes=20MB",
            "stdout_logfile_backups=2",
        ]
        if os.geteuid() == 0:
            lines.append("user=root")
        if prog.env:
            lines.append("environment=" + _quote_env(prog.env))
        lines.append("")
    return "\n".join(lines)


class Supervisor:
    """A supervisord instance owning one run directory."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir).resolve()
        self.config_path = self.run_dir / CONFIG_NAME
        self.proc: subprocess.Popen | None = None

    def write(self, programs: list[Program], nodaemon: bool, state: dict | None = None) -> Path:
        """Write the config (and the stack state other commands read) into the run directory."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render_config(self.run_dir, programs, nodaemon))
        if state is not None:
            (self.run_dir / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
        return self.config_path

    def pid(self) -> int | None:
        """The pid of a live supervisord for this run directory, if any."""
        try:
            pid = int((self.run_dir / "supervisord.pid").read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def start(self, detach: bool) -> None:
        """Start supervisord: in the background (daemon) or as a child this process waits on."""
        if self.pid() is not None:
            raise RuntimeError(f"a stack is already running in {self.run_dir} (pid {self.pid()})")
        # our entry point: supervisord restarting a dead program at once (prompt_supervisord)
        cmd = [sys.executable, "-m", PROMPT_SUPERVISORD, "-c", str(self.config_path)]
        if detach:
            subprocess.run(cmd, check=True, cwd=self.run_dir)
        else:
            self.proc = subprocess.Popen(cmd, cwd=self.run_dir, start_new_session=True)

    def wait(self) -> int:
        """Wait for a foreground supervisord; Ctrl-C and SIGTERM stop the whole stack cleanly."""
        assert self.proc is not None

        def forward(signum, _frame):
            if self.proc and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    return self.proc.wait()
                except KeyboardInterrupt:
                    forward(signal.SIGINT, None)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def stop(self, timeout: float = 60.0) -> bool:
        """SIGTERM supervisord (it stops every program) and wait; True when it has exited."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        pid = self.pid()
        if pid is None:
            return True
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return True
            time.sleep(0.1)
        return False

    def ctl(self, *args: str) -> str:
        """Run supervisorctl against this stack and return its output."""
        cmd = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.config_path), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return done.stdout

    def rpc(self) -> xmlrpc.client.ServerProxy:
        """An XML-RPC proxy of this supervisord (over the config's unix socket)."""
        from supervisor.xmlrpc import SupervisorTransport

        # XML-RPC over the config's unix socket: no supervisorctl process per query
        transport = SupervisorTransport(serverurl=f"unix://{self.run_dir / SOCKET_NAME}")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    def status(self) -> dict[str, tuple[str, int | None]]:
        """Program name -> (state, pid) as supervisord reports it ({} while it is not up)."""
        try:
            with self.rpc() as proxy:
                # supervisord's API: a struct (name, statename, pid, ...) per program
                infos = cast("list[dict[str, Any]]", proxy.supervisor.getAllProcessInfo())
        except (OSError, xmlrpc.client.Error):
            return {}
        return {i["name"]: (i["statename"], i["pid"] or None) for i in infos}

    def start_all(self) -> None:
        """Start every program not running yet (those written with autostart=False)."""
        with self.rpc() as proxy:
            proxy.supervisor.startAllProcesses(False)

    def wait_running(self, names: list[str], timeout: float = 60.0) -> dict[str, int]:
        """Wait until every named program is RUNNING; return their pids."""
        deadline = time.monotonic() + timeout
        status: dict[str, tuple[str, int | None]] = {}
        while time.monotonic() < deadline:
            status = self.status()
            if all(status.get(n, ("", None))[0] == "RUNNING" for n in names):
                return {n: cast(int, status[n][1]) for n in names}  # RUNNING: it has a pid
            time.sleep(0.1)
        raise TimeoutError(f"programs not running after {timeout}s: {status}")


def read_state(run_dir: str | Path) -> dict:
    """The stack state `kvrelay up` wrote (redis url, ports, programs)."""
    path = Path(run_dir) / STATE_NAME
    if not path.exists():
        raise FileNotFoundError(f"no kvrelay stack in {run_dir} ({path} is missing)")
    return json.loads(path.read_text())


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a TCP socket listening on `port` (None: no /proc to tell)."""
    inodes: set[str] = set()
    tables = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            f = row.split()  # sl local_address rem_address st ... inode
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not tables:
        return None
    if not inodes:
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


def listen_address(host: str, port: int) -> tuple[Any, ...]:
    """(family, type, proto, canonname, sockaddr) a TCP listener on `host:port` binds;
    CommandError (exit 2) for a host that does not resolve."""
    import socket

    from kvrelay.cli.errors import CommandError

    try:
        return socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise CommandError(f"cannot listen on {host}: {exc}") from None


def check_port_free(host: str, port: int) -> None:
    """Raise CommandError (exit 2) unless a TCP listener could bind `host:port` now."""
    import errno
    import socket

    from kvrelay.cli.errors import CommandError

    family, kind, proto, _name, addr = listen_address(host, port)
    with socket.socket(family, kind, proto) as sock:
        # SO_REUSEADDR as uvicorn and valkey set it: a port in TIME_WAIT is free, a listener not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CommandError(f"port {port} on {host} is in use") from None
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
