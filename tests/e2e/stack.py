"""A whole kvrelay stack started with `kvrelay up --detach` in a fresh run directory (e2e tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvrelay.cli.up.launch import Supervisor
from kvrelay.core.keys import Keys
from kvrelay.core.redis_client import sync_redis
from tests.conftest import free_port
from tests.queue_state import emitted_chunks

MODEL = "smollm2-135m-instruct"


def kvrelay_up(run_dir: Path, port: int, *extra: str, timeout: float = 180
               ) -> subprocess.CompletedProcess:  # fmt: skip
    """`kvrelay up --detach --run-dir RUN_DIR --port PORT EXTRA...` as a finished process."""
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "up", "--detach",
           "--run-dir", str(run_dir), "--port", str(port), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class Stack:
    """`kvrelay up --detach` ... `kvrelay down`, with handles on Redis and supervisord."""

    def __init__(
        self,
        run_dir: Path,
        prefill: int = 1,
        decode: int = 1,
        env: dict | None = None,
        shards: int | None = None,
        model: str | None = None,
        models: list[str] | None = None,
        extra: list[str] | None = None,
    ):
        self.run_dir = run_dir
        self.model = model  # None: `up`'s default (MODEL)
        # several: `up --model A --model B ...` (`model` is then ignored); the first keeps the
        # single-model stack's program names, the others' are in `self.state["models"]`
        self.models = models or ([model] if model else [])
        # > 1: a local Valkey Cluster, one pipeline shard per node; None: KVRELAY_E2E_SHARDS
        # (default 1), so the whole e2e suite runs on a cluster with KVRELAY_E2E_SHARDS=3
        self.shards = shards or int(os.environ.get("KVRELAY_E2E_SHARDS") or 1)
        self.port = free_port()
        self.prefill, self.decode = prefill, decode
        self.env = {
            "KVRELAY_WORKER_LEASE_MS": "2000",
            "KVRELAY_WORKER_HEARTBEAT_S": "0.5",
            **json.loads(os.environ.get("KVRELAY_E2E_ENV", "{}")),
            **(env or {}),
        }
        self.state: dict = {}
        self.extra = extra or []  # more `up` flags

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self, timeout: float = 240) -> None:
        extra = [
            "--prefill",
            str(self.prefill),
            "--decode",
            str(self.decode),
            "--kv-cache-bytes",
            str(96 << 20),
            "--arena-bytes",
            str(256 << 20),
            "--timeout",
            str(timeout),
        ]
        if self.shards > 1:
            extra += ["--shards", str(self.shards)]
        for model in self.models:
            extra += ["--model", model]
        for key, value in self.env.items():
            extra += ["--env", f"{key}={value}"]
        extra += self.extra
        done = kvrelay_up(self.run_dir, self.port, *extra, timeout=timeout + 60)
        if done.returncode != 0:
            raise RuntimeError(
                f"kvrelay up failed ({done.returncode}): {done.stderr[-3000:]}" + self.logs()
            )
        self.state = json.loads(done.stdout.strip().splitlines()[-1])
        self.keys = Keys(self.state["key_prefix"], shards=self.shards)
        url = self.state["redis_url"]
        # the one factory: a cluster's client, or a Sentinel URL's primary (--valkey-replicas)
        self.redis = sync_redis(url, cluster=self.shards > 1)
        self.sup = Supervisor(self.run_dir)

    @property
    def valkeys(self) -> tuple[str, ...]:
        """The supervisord programs of the stack's Valkey: one node, or each cluster primary
        `up` started (`valkey-<i>`; replica nodes are in `cluster_nodes`)."""
        if self.shards == 1:
            return ("valkey",)
        return tuple(f"valkey-{i}" for i in range(self.shards))

    @property
    def cluster_nodes(self) -> dict[str, int]:
        """Program name -> port of every cluster node, replicas included ({} without one)."""
        nodes = (self.state.get("cluster") or {}).get("nodes", [])
        return {n["name"]: int(n["port"]) for n in nodes}

    def valkey_of(self, request_id: str = "") -> str:
        """The supervisord program of the Valkey holding a request's shard: the cluster node
        serving the shard's slot now (a replica promoted at a failover serves it after), asked
        of the nodes that answer; the one Valkey of a plain stack."""
        if not request_id or self.shards == 1:
            return self.valkeys[self.keys.of(request_id).shard] if request_id else self.valkeys[-1]
        from kvrelay.cli.up.valkey_cluster import tag_slot

        return self.serving(tag_slot(self.keys.of(request_id)))

    def serving(self, slot: int) -> str:
        """The program of the cluster node serving `slot` now, as the nodes that answer say."""
        import redis

        from kvrelay.cli.up.valkey_cluster import serving_port

        by_port = {port: name for name, port in self.cluster_nodes.items()}
        for port in by_port:
            client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
            try:
                serving = serving_port(client, slot)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if serving in by_port:
                return by_port[serving]
        raise RuntimeError(f"no cluster node serves slot {slot}")

    def down(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "kvrelay.cli.main", "down", "--run-dir", str(self.run_dir)],
            capture_output=True,
            timeout=120,
        )

    def logs(self, tail: int = 30) -> str:
        out = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"\n== {path.name}\n" + "\n".join(lines))
        return "".join(out)

    def pids(self) -> dict[str, int | None]:
        return {name: pid for name, (_state, pid) in self.sup.status().items()}

    def kill(self, program: str) -> int:
        """SIGKILL one program; returns the pid it had."""
        pid = self.pids()[program]
        assert pid, f"{program} is not running"
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, program: str, old_pid: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, pid = self.sup.status().get(program, ("", None))
            if state == "RUNNING" and pid and pid != old_pid:
                return pid
            time.sleep(0.2)
        raise TimeoutError(f"{program} did not come back: {self.sup.status()}{self.logs()}")

    def out_tokens(self, request_id: str) -> list[int]:
        """Token ids emitted (out:{id} and the progress tail), checking the chunk indices leave
        no gap and no overlap."""
        tokens: list[int] = []
        for chunk in emitted_chunks(self.redis, self.keys, request_id):
            assert chunk.index == len(tokens), f"chunk at {chunk.index}, expected {len(tokens)}"
            tokens.extend(chunk.token_ids)
        return tokens


def generate_reference(
    tmp_path: Path,
    requests: list[dict],
    max_tokens: int,
    quantization: str = "none",
    attention: str = "fp32",
    model: str = MODEL,
    extra: tuple[str, ...] = (),
) -> dict[str, dict]:
    """`kvrelay generate --json` (the in-process engine, with the stack's weights and attention
    precision, plain decoding) for JSONL requests (greedy unless a line says otherwise);
    results by id."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in requests))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrelay.cli.main",
            "generate",
            "--json",
            "--batch-file",
            str(batch),
            "--temperature",
            "0",
            "--max-tokens",
            str(max_tokens),
            "--num-threads",
            "1",
            "--quantization",
            quantization,
            "--attention-precision",
            attention,
            "--speculation",  # the reference is plain decoding: speculation must not show
            "off",
            "--model",
            model,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["id"]: r for r in results}
