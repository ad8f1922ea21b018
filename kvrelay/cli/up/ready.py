"""Whether a `kvrelay up` stack may start (free ports, reachable Redis) and when it is ready."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from kvrelay.cli.errors import EXIT_UNAVAILABLE, CommandError, redact_url
from kvrelay.cli.up.launch import Supervisor, listens
from kvrelay.cli.up.sentinel_status import not_ready_reason as sentinel_not_ready
from kvrelay.cli.up.topology import ingress_programs, worker_of
from kvrelay.cli.up.valkey import cluster_mode, valkey_ports
from kvrelay.core.enums import Stage, WorkerField
from kvrelay.core.errors import KvrelayError
from kvrelay.core.worker_record import WorkerRecord


def check_redis(url: str) -> None:
    """PING the Redis at `url` (2 s); CommandError (exit 1) when it does not answer."""
    import redis

    from kvrelay.core.redis_client import sync_redis

    shown = redact_url(url)
    try:  # cluster=False: PING one node (a Sentinel URL: the primary its Sentinels name)
        client = sync_redis(url, cluster=False, socket_timeout=2, socket_connect_timeout=2)
    except ValueError as exc:
        raise CommandError(f"bad --redis-url {shown}: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise CommandError(f"Redis at {shown} is not reachable: {exc}", EXIT_UNAVAILABLE) from None
    finally:
        client.close()


def _health(host: str, port: int) -> dict | None:
    """The /health body when it answers 200, else None."""
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def _worker_names(state: dict) -> list[str]:
    return [n for n in state["programs"] if n.startswith(("prefill-", "decode-"))]


def _heartbeat_pids(state: dict, names: list[str]) -> list[set[int]]:
    """Per worker program, the pids that announce its worker name: its heartbeat's and, with
    `up --standby`, the waiting standby's (either program may serve the name)."""
    import redis

    from kvrelay.core.keys import Keys
    from kvrelay.core.redis_client import sync_redis

    keys = Keys(state["key_prefix"])
    try:
        client = sync_redis(
            state["redis_url"], cluster_mode(state), socket_timeout=2, socket_connect_timeout=2
        )
        try:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hget(keys.worker(worker_of(name)), WorkerField.PID)
                pipe.get(keys.standby(worker_of(name)))
            replies = pipe.execute()
        finally:
            client.close()
    except redis.RedisError:
        return [set() for _ in names]
    out = []
    for beat, standby in zip(replies[::2], replies[1::2], strict=True):
        pids = {WorkerRecord.partial(WorkerField.PID, beat).pid}
        pids.add(WorkerRecord.partial(WorkerField.PID, standby).pid)
        out.append({p for p in pids if p is not None})
    return out


def not_ready_reason(state: dict, status: dict, previous: dict) -> str | None:
    """Why this stack is not ready yet (None when it is): every program RUNNING with the pid
    of the previous poll, listening where it should (each of several ingresses on the shared
    port: one listens only once its app has started), /health 200 counting this stack's
    workers, and each worker's heartbeat coming from the pid supervisord runs under its name."""
    if not status:
        return "supervisord does not answer"
    for name in state["programs"]:
        program_state, pid = status.get(name, ("MISSING", None))
        if program_state != "RUNNING":
            return f"{name} is {program_state}"
        if previous.get(name, (None, pid))[1] != pid:
            return f"{name} restarted"
    # every ingress listens on the one port (SO_REUSEPORT with several): each pid is checked
    ports = {**dict.fromkeys(ingress_programs(state), state["port"]), **valkey_ports(state)}
    for name, port in ports.items():
        if listens(status[name][1], port) is False:  # None: no /proc to tell, trust RUNNING
            return f"{name} (pid {status[name][1]}) is not listening on port {port}"
    replicated = sentinel_not_ready(state)  # None without --valkey-replicas
    if replicated is not None:
        return replicated
    body = _health(state["host"], state["port"])
    if body is None:
        return f"/health on port {state['port']} does not answer 200"
    workers = body.get("workers", {})
    for role in Stage:
        if workers.get(role, 0) < state[role]:
            return f"/health counts {workers.get(role, 0)} {role} workers, want {state[role]}"
    names = _worker_names(state)
    for name, pids in zip(names, _heartbeat_pids(state, names), strict=True):
        if status[name][1] not in pids:
            return f"no heartbeat from {name} (pid {status[name][1]})"
    return None


def ingress_status(state: dict) -> list[dict]:
    """Each ingress program of a stack running several (`kvrelay up --ingresses N`; [] for
    one): its supervisord state, pid, and whether it listens on the shared port (`kvrelay
    status`)."""
    if int(state.get("ingresses") or 1) < 2:
        return []
    status = Supervisor(state["run_dir"]).status()
    out = []
    for name in ingress_programs(state):
        program_state, pid = status.get(name, ("STOPPED", None))
        # listens None: no /proc to tell; a running pid is trusted, as readiness does
        listening = pid is not None and listens(pid, state["port"]) is not False
        out.append({"program": name, "state": program_state, "pid": pid, "listening": listening})
    return out


class CrashLoopError(KvrelayError, RuntimeError):
    """A program keeps dying before the stack became ready."""


def wait_ready(
    state: dict, timeout: float, sup: Supervisor, alive=lambda: True, progress=None
) -> str | None:
    """Poll until the stack is ready (None) or time runs out (the last reason it was not).

    A program seen with three pids, entering BACKOFF twice, or FATAL raises CrashLoopError with
    the tail of its log instead of waiting out the timeout. `progress` (an UpProgress) is told
    every status it polls and when the stack is ready."""
    deadline = time.monotonic() + timeout
    try:
        return _poll(state, deadline, sup, alive, progress)
    finally:
        if progress is not None:
            progress.close()


def _poll(state: dict, deadline: float, sup: Supervisor, alive, progress) -> str | None:
    pids: dict[str, set[int]] = {}
    backoffs: dict[str, int] = {}
    previous: dict[str, tuple[str, int | None]] = {}
    reason: str | None = "not started"
    while time.monotonic() < deadline and alive():
        status = sup.status()
        for name, (program_state, pid) in status.items():
            if pid:
                pids.setdefault(name, set()).add(pid)
            # BACKOFF: the program exited before `startsecs`; a quick crash shows no pid.
            if program_state == "BACKOFF" and previous.get(name, ("",))[0] != "BACKOFF":
                backoffs[name] = backoffs.get(name, 0) + 1
            if (
                len(pids.get(name, ())) >= 3
                or backoffs.get(name, 0) >= 2
                or (program_state == "FATAL")
            ):
                log = _log_tail(sup.run_dir / "logs" / f"{name}.log")
                raise CrashLoopError(f"{name} keeps exiting; the end of its log:\n{log}")
        reason = not_ready_reason(state, status, previous)
        if progress is not None:
            if reason is None:
                progress.ready()
            else:
                progress.update(status)
        if reason is None:
            return None
        previous = status
        time.sleep(0.5)
    return reason


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
