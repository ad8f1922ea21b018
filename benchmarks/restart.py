"""How long a SIGKILLed worker takes to serve again: from the kill to the next token of the
stream it was decoding, as the client sees it (issue 48: "a killed decode worker serves again
within 2 s on an idle host, within 4 s while two others restart beside it").

Per round it also prints the phases of the killed worker's return, in seconds after the kill,
from the run dir's logs (supervisord's and the worker's, millisecond timestamps): `exited`
(supervisord reaped it), `spawned` (the new process started), `imported` (its first log line:
the kernels load after the imports), `engine` (engine ready: model loaded), `ready` (worker
ready: groups, predecessor's entries claimable), `token` (the stream's first token after the
kill).

Starts `kvrelay up --detach` (the host's defaults; `--decode N` decode workers, prefill in
them), streams one greedy request of `--tokens` tokens (ignore_eos), and when its 10th token
has arrived SIGKILLs the worker that owns it, plus `--beside K` other workers at once. Per
round it prints the gap in the stream (the longest wait for a token after the kill) and the
killed worker's start-up as it reports it (`startup_s`: process start to engine ready), as
JSON lines; then the median gap over `--rounds`.

    python benchmarks/restart.py --rounds 5
    python benchmarks/restart.py --decode 3 --beside 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import free_port, kvrelay_cli  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _owner(redis_url: str, prefix: str, request_id: str) -> str:
    import redis

    from kvrelay.core.keys import Keys

    r = redis.Redis.from_url(redis_url)
    owner = r.hget(Keys(prefix).request(request_id), "owner")
    return owner.decode() if owner else ""


def _worker_field(redis_url: str, prefix: str, worker: str, name: str) -> str | None:
    import redis

    from kvrelay.core.keys import Keys

    value = redis.Redis.from_url(redis_url).hget(Keys(prefix).worker(worker), name)
    return value.decode() if value else None


def _startup(redis_url: str, prefix: str, worker: str) -> float | None:
    value = _worker_field(redis_url, prefix, worker, "startup_s")
    return float(value) if value else None


def _serving_pid(redis_url: str, prefix: str, worker: str) -> int | None:
    """The pid serving worker name `worker` (with --standby, either of its two programs)."""
    value = _worker_field(redis_url, prefix, worker, "pid")
    return int(value) if value else None


# (phase, log, text): the first line after the kill in the log (supervisord's, or the killed
# worker's own) holding the text (`{name}`: the worker's name)
PHASES = (
    ("exited", "supervisord", "exited: {name} "),
    ("spawned", "supervisord", "spawned: '{name}'"),
    ("imported", "worker", " INFO "),
    ("engine", "worker", "engine ready"),
    ("ready", "worker", "worker {name} ready"),
)


def _log_time(line: str) -> float | None:
    """The epoch time of a log line stamped `2026-12-04 03:11:20,123 ...` (local time)."""
    from datetime import datetime

    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def phases(run_dir: Path, name: str, killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill (epoch `killed_at`) to each of `PHASES` in the logs."""
    logs = {"supervisord": run_dir / "logs" / "supervisord.log",
            "worker": run_dir / "logs" / f"{name}.log"}  # fmt: skip
    found: dict[str, float | None] = {}
    for phase, log, text in PHASES:
        found[phase] = None
        try:
            lines = logs[log].read_text(errors="replace").splitlines()
        except OSError:
            continue
        needle = text.format(name=name)
        for line in lines:
            at = _log_time(line)
            # the log's stamps are whole milliseconds: a line of the kill's millisecond counts
            if at is not None and at >= killed_at - 0.001 and needle in line:
                found[phase] = round(at - killed_at, 3)
                break
    return found


def one_round(
    state: dict, url: str, sup, tokens: int, beside: int, round_no: int, standby: bool
) -> dict:
    """Stream a request, kill its owner (and `beside` others) at its 10th token; the gap."""
    body = {"model": MODEL, "prompt": f"Round {round_no}: count from one to a thousand.",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    request_id = f"restart-{round_no}-{time.time_ns()}"
    arrivals: list[float] = []
    killed: dict[str, int] = {}
    kill_at = 0.0
    with (
        httpx.Client(timeout=300) as client,
        client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
        ) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 10:
                owner = _owner(state["redis_url"], state["key_prefix"], request_id)
                # the worker names' serving processes (with --standby: either program)
                names = sorted({name.removesuffix("-standby") for name in sup.status()
                                if name.startswith(("decode-", "prefill-"))})  # fmt: skip
                victims = [owner] + [name for name in names if name != owner][:beside]
                pids = {name: _serving_pid(state["redis_url"], state["key_prefix"], name)
                        for name in victims}  # fmt: skip
                kill_at, killed_wall = time.monotonic(), time.time()
                for name, pid in pids.items():
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                        killed[name] = pid
    # the stall: the longest wait for a token after the kill (events already on their way when
    # it struck arrive first)
    after = [kill_at] + [t for t in arrivals if t > kill_at]
    waits = [b - a for a, b in zip(after, after[1:], strict=False)]
    stall = max(waits, default=None)
    # the token that ended the stall (the new process's first), seconds after the kill
    first = after[waits.index(stall) + 1] - kill_at if stall is not None else None
    owner = next(iter(killed))
    # wait until every killed name is served again and, with --standby, each killed program is
    # back (as the standby); the serving process's startup_s is in its heartbeat
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        serving = {n: _serving_pid(state["redis_url"], state["key_prefix"], n) for n in killed}
        running = {pid for st, pid in sup.status().values() if st == "RUNNING"}
        if (
            all(pid and pid != killed[n] for n, pid in serving.items())
            and not (set(killed.values()) & running)
            and len(running) == len(sup.status())
        ):
            break
        time.sleep(0.2)
    time.sleep(2 if not standby else 8)  # its first heartbeat; a standby loaded again
    return {
        "round": round_no,
        "killed": sorted(killed),
        "events": len(arrivals),
        "gap_s": None if stall is None else round(stall, 2),
        "owner_startup_s": _startup(state["redis_url"], state["key_prefix"], owner),
        "phases_s": {
            **phases(Path(state["run_dir"]), owner, killed_wall),
            "token": None if first is None else round(first, 3),
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode", type=int, default=1, help="decode workers (kvrelay up --decode)")
    p.add_argument("--beside", type=int, default=0, help="other workers killed at once")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--standby", action="store_true", help="kvrelay up --standby")
    p.add_argument("--tokens", type=int, default=200, help="tokens of each streamed request")
    args = p.parse_args(argv)
    from kvrelay.cli.up.launch import Supervisor

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        port = free_port()
        done = kvrelay_cli("up", "--detach", "--run-dir", str(run_dir), "--port", str(port),
                        "--prefill", "0", "--decode", str(args.decode),
                        *(["--standby"] if args.standby else []))  # fmt: skip
        state = json.loads(done.stdout.strip().splitlines()[-1])
        try:
            sup = Supervisor(run_dir)
            url = f"http://127.0.0.1:{port}"
            gaps = []
            for i in range(args.rounds):
                result = one_round(state, url, sup, args.tokens, args.beside, i, args.standby)
                print(json.dumps(result), flush=True)
                if result["gap_s"] is not None:
                    gaps.append(result["gap_s"])
            print(json.dumps({"median_gap_s": statistics.median(gaps) if gaps else None,
                              "rounds": len(gaps), "decode": args.decode,
                              "beside": args.beside, "standby": args.standby}))  # fmt: skip
        finally:
            kvrelay_cli("down", "--run-dir", str(run_dir))


if __name__ == "__main__":
    main()
