"""Which workers `kvrelay up` runs when no `--prefill`/`--decode` is given (see docs/operations.md).

A prefill worker only pays when it has hardware of its own to use while decode keeps running:
on one CPU host prefill and decode share the same cores and memory bandwidth, so a dedicated
prefill worker idles whenever prompts are short or cached while decode (the bottleneck) gets
half the cores; measured on 2 cores, one decode worker with both cores that prefills locally
served 1.4-1.7x the 1+1 split. With GPUs, a worker per GPU and a prefill GPU keeps long prompts
from stalling the decode batches.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

from kvrelay.core.enums import Quantization

# One CPU engine scales poorly past this many threads on small models (GEMMs of a few hundred
# rows, a Python step loop); beyond it another decode worker (its own batch) uses cores better.
CPU_CORES_PER_WORKER = 16
GPUS_PER_PREFILL = 4  # with 2+ GPUs: one prefill GPU per this many GPUs, the rest decode
INGRESS = "ingress"  # the ingress program; with `--ingresses N` also ingress-1 ... ingress-<N-1>
MAX_INGRESSES = 64


STANDBY_SUFFIX = "-standby"  # a worker's standby program (`up --standby`): decode-0-standby


def worker_of(program: str) -> str:
    """The worker name a worker program serves (a standby program serves its first's)."""
    return program.removesuffix(STANDBY_SUFFIX)


def ingress_names(count: int) -> list[str]:
    """The supervisord programs of `count` ingresses sharing one address: `ingress` (the one of
    a one-ingress stack), then `ingress-1`, `ingress-2`, ..."""
    return [INGRESS, *(f"{INGRESS}-{i}" for i in range(1, count))]


def is_ingress(program: str) -> bool:
    """Whether a stack's program is one of its ingresses (ingress_names)."""
    number = program.removeprefix(f"{INGRESS}-")
    return program == INGRESS or (number != program and number.isdigit())


def ingress_programs(state: dict) -> list[str]:
    """The ingress programs of a stack (its stack.json state), in order."""
    return [name for name in state["programs"] if is_ingress(name)]


@dataclass(slots=True)
class Topology:
    """Worker counts (per model) and compute threads for one `kvrelay up`."""

    prefill: int
    decode: int
    threads: int  # compute threads per worker
    cores: int
    gpus: int
    auto: bool  # chosen for the host (no --prefill/--decode), else given
    reason: str
    models: int = 1  # each model runs `prefill` + `decode` workers of its own

    @property
    def layout(self) -> str:
        return "disaggregated" if self.prefill else "colocated"

    def describe(self) -> str:
        """One line for `kvrelay up` and `kvrelay status`."""
        parts = []
        if self.prefill:
            parts.append(f"{self.prefill} prefill")
        parts.append(f"{self.decode} decode worker{'s' if self.decode + self.prefill > 1 else ''}")
        unit = "GPU each" if self.gpus else f"thread{'s' if self.threads > 1 else ''} each"
        text = " + ".join(parts)
        if self.models > 1:
            text = f"{self.models} models x ({text})"
        text += f", 1 {unit}" if self.gpus else f", {self.threads} {unit}"
        if not self.prefill:
            text += ", decode prefills locally"
        how = "auto" if self.auto else "given"
        return f"{text} ({how}: {self.reason})"

    def to_dict(self) -> dict:
        return dict(asdict(self), layout=self.layout, summary=self.describe())


def threads_per_worker(cores: int, num_workers: int) -> int:
    """Cores each worker's compute pool gets so the workers together fill, not oversubscribe."""
    return max(1, cores // max(1, num_workers))


def auto_counts(cores: int, gpus: int) -> tuple[int, int, str]:
    """(prefill, decode, why) for a host with `cores` CPU cores and `gpus` GPUs."""
    if gpus >= 2:
        prefill = max(1, gpus // GPUS_PER_PREFILL)
        return prefill, gpus - prefill, f"{gpus} GPUs: one worker per GPU, prefill on its own GPU"
    if gpus == 1:
        return 0, 1, "1 GPU: a second worker would time-share it"
    decode = max(1, cores // CPU_CORES_PER_WORKER)
    why = f"{cores} CPU cores, no GPU: a prefill worker would take cores decode needs"
    return 0, decode, why


def choose(
    cores: int,
    gpus: int,
    prefill: int | None,
    decode: int | None,
    wants_prefill: bool = False,
    models: int = 1,
) -> Topology:
    """The topology for these counts per model (None = pick for the host); `wants_prefill`:
    the routing mode was asked for explicitly and needs a prefill worker. With several
    `models`, each model's counts are picked for its even share of the cores (and GPUs), and
    the cores are divided evenly between all the workers of all models."""
    models = max(1, models)
    share_cores, share_gpus = max(1, cores // models), gpus // models if gpus else 0
    if gpus and not share_gpus:
        share_gpus = 1  # fewer GPUs than models: they share, round robin
    auto_p, auto_d, why = auto_counts(share_cores, share_gpus)
    if models > 1:
        why = f"per model, {models} models: {why}"
    given = prefill is not None or decode is not None
    if prefill is None:
        prefill = max(auto_p, 1) if wants_prefill else auto_p
        if wants_prefill and not auto_p:
            why = "the routing mode asked for needs a prefill worker"
    if decode is None:
        decode = auto_d
    if given:
        why = f"--prefill {prefill} --decode {decode}"
    threads = threads_per_worker(cores, models * (prefill + decode))
    return Topology(prefill, decode, threads, cores, gpus, not given, why, models)


def default_weights(
    gpus: int,
    machine: str | None = None,
    int8_kernel: bool | None = None,
    kernel_isa: str | None = None,
    bf16_tiles: bool | None = None,
) -> tuple[str, str]:
    """(quantization, why) for `kvrelay up --quantization auto` on a host with `gpus` GPUs.

    On x86-64 CPUs int8 weights with a scale per 32 inputs (fp32 activations and sums, our C++
    kernel) read about half the bytes of fp16 per decode step, with perplexity within 0.3% of
    fp32 and below the bundled Q4_1 GGUF's (docs/benchmarks.md); where the amx kernel variant
    runs, w8a16 (int8 weights with a scale per output, bf16 activations, AMX bf16 tiles that sum
    over all of K: 1.5-1.8x q8_0's linears from 8 rows on, perplexity below q8_0's); fp16
    weights (fbgemm) where the kernel is not built; elsewhere, and on GPUs (bf16 models), the
    model's own weights. `int8_kernel`, `kernel_isa` and `bf16_tiles` (the OS grants the AMX
    tiles) None: ask the kernel build (loads it, or builds it once); an amx host whose tiles are
    not granted runs q8_0 (VNNI)."""
    if gpus:
        return Quantization.NONE, "GPU workers keep the model's weights"
    arch = (machine or platform.machine()).lower()
    if arch not in ("x86_64", "amd64"):
        return Quantization.NONE, f"no fp16 GEMM on {arch}: fp32 weights"
    if int8_kernel is None:
        from kvrelay.kernels.ops import int8_linear_available

        int8_kernel = int8_linear_available()
    if int8_kernel and kernel_isa is None:
        from kvrelay.kernels import loaded_isa

        kernel_isa = loaded_isa()
    if int8_kernel and kernel_isa == "amx":
        if bf16_tiles is None:
            from kvrelay.kernels import w8a16_available

            bf16_tiles = w8a16_available()
        if not bf16_tiles:
            why = "AMX host without the OS's tiles: int8 weights and activations"
            return Quantization.Q8_0, why
        return (
            Quantization.W8A16,
            "AMX host: int8 weights (a scale per output), bf16 activations, AMX bf16 tiles",
        )
    if int8_kernel:
        return (
            Quantization.INT8_WEIGHT_ONLY,
            "CPU host: int8 weights (a scale per 32), fp32 activations",
        )
    return Quantization.FP16, "CPU host, C++ kernels not built: fp16 weights, fp32 activations"
