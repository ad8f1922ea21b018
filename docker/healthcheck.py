#!/usr/bin/env python3
"""HEALTHCHECK of kvrelay containers: exit 0 when the container's process does its job.

kvrelay-healthcheck http [URL]    the ingress answers GET /health with 200 (default :8000)
kvrelay-healthcheck store [DIR]   the store node answers a stats request on its socket
kvrelay-healthcheck worker        a worker on this host (container) sent a heartbeat lately
kvrelay-healthcheck valkey        Valkey answers PING (KVRELAY_REDIS_URL)
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request

FRESH_S = 15.0  # a heartbeat older than this is a stuck worker (it beats every second)


def check_http(url: str = "http://127.0.0.1:8000/health") -> str:
    with urllib.request.urlopen(url, timeout=3) as resp:  # non-2xx raises HTTPError
        return f"{url}: {resp.status}"


def check_store(run_dir: str = "/run/kvrelay") -> str:
    from kvrelay.kvstore.client import StoreClient

    client = StoreClient(os.environ.get("KVRELAY_STORE_RUN_DIR", run_dir), timeout_s=3.0)
    try:
        stats = client.stats()
    finally:
        client.close()
    return f"store node answers ({len(stats)} stats)"


def _redis():
    import redis

    url = os.environ.get("KVRELAY_REDIS_URL", "redis://127.0.0.1:6379/0")
    return redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)


def check_worker() -> str:
    from kvrelay.core.keys import Keys

    keys = Keys(os.environ.get("KVRELAY_KEY_PREFIX", "kvrelay:"))
    host, now = socket.gethostname(), time.time()
    r = _redis()
    try:
        for key in r.scan_iter(match=keys.worker_pattern, count=500):
            beat = r.hmget(key, "host", "updated")
            if beat[0] is not None and beat[0].decode() == host and beat[1] is not None:
                age = now - float(beat[1])
                if age < FRESH_S:
                    return f"{key.decode()}: heartbeat {age:.1f} s ago"
    finally:
        r.close()
    raise RuntimeError(f"no fresh worker heartbeat from host {host}")


def check_valkey() -> str:
    r = _redis()
    try:
        r.ping()
    finally:
        r.close()
    return "PONG"


def main(argv: list[str]) -> int:
    checks = {"http": check_http, "store": check_store, "worker": check_worker}
    checks["valkey"] = check_valkey
    if not argv or argv[0] not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(checks[argv[0]](*argv[1:]))
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", said in one line
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
