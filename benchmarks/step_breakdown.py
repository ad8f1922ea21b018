"""Where one decode step of the in-process engine goes, at several batch sizes and contexts.

Each component is timed by a wrapper installed in this process only (linear layers, paged
attention, KV write, RMSNorm, RoPE, embedding, sampler, detokenizer, scheduler, input
preparation); "elementwise + forward glue" is the forward's time outside the timed calls and
"other Python" is the step's time outside every timed part. Instrumented and plain steps
alternate so the wrappers' own cost shows as the difference of the two step times.

The prompts' prefill is skipped (the forward is replaced by zero logits until every sequence
has its first token), so the KV pool holds zeros for the context: decode costs the same
whatever the values are, and a 64 x 2048 prefill would take minutes.

    python benchmarks/step_breakdown.py                        # full grid (~10-20 min)
    python benchmarks/step_breakdown.py --batches 1,8 --contexts 64 --steps 3   # smoke
    python benchmarks/step_breakdown.py --write-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import DOCS, WEIGHTS, machine_line, write_section  # noqa: E402
from kvrelay.core.modelref import QUANTIZATIONS  # noqa: E402

LINEARS = ("qkv", "o", "gate_up", "down")
COLUMNS = ("qkv", "o", "gate_up", "down", "lm_head", "attention", "write_kv", "rms_norm",
           "rope", "embedding", "elementwise", "scheduler", "prepare", "sampler",
           "detokenizer", "other")  # fmt: skip
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M fp32 (30 layers x 2 x 3 heads x 64 x 4 bytes)


class Clock:
    """Accumulated seconds per component while `on`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


class Patches:
    """Installs and removes the timing wrappers on one engine."""

    def __init__(self, engine, clock: Clock):
        import torch.nn.functional as F

        from kvrelay.workers.model import llama as model_mod

        self.undo: list[tuple[object, str, object, bool]] = []
        self.engine, self.clock, self.F, self.model_mod = engine, clock, F, model_mod

    def _set(self, obj, attr: str, name: str) -> None:
        own = attr in getattr(obj, "__dict__", {})
        old = getattr(obj, attr)
        self.undo.append((obj, attr, old, own))
        setattr(obj, attr, self.clock.wrap(name, old))

    def install(self) -> None:
        e, model = self.engine, self.engine.runner.model
        for layer in model.layers:
            for name in LINEARS:
                self._set(layer, name, name)
        self._set(model, "lm_head", "lm_head")
        # The model writes K/V through the fused RoPE + KV write op: its time counts as write_kv.
        # RMSNorm runs fused with the residual add before it (add_rms_norm): both count here.
        for attr, name in (("paged_attention", "attention"), ("rope_write_kv", "write_kv"),
                           ("rms_norm", "rms_norm"), ("add_rms_norm", "rms_norm")):  # fmt: skip
            self._set(self.model_mod, attr, name)
        self._set(self.F, "embedding", "embedding")
        self._set(e.runner, "model", "forward")
        self._set(e.runner, "prepare", "prepare")
        self._set(e.scheduler, "schedule", "scheduler")
        self._set(e, "sampler", "sampler")
        self._set(e.outputs, "append", "detokenizer")

    def remove(self) -> None:
        for obj, attr, old, own in reversed(self.undo):
            if own or isinstance(obj, type(self.F)):
                setattr(obj, attr, old)
            else:  # the attribute came from the class: drop the instance override
                delattr(obj, attr)
        self.undo.clear()


def make_engine(args: argparse.Namespace, kv_bytes: int, max_seqs: int):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    extra = {}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if args.quantization != "none":
        if "quantization" not in fields:
            raise SystemExit("this engine has no `quantization` option: use --quantization none")
        extra["quantization"] = args.quantization
    return Engine(EngineConfig(
        model=args.model, num_threads=args.threads, kv_cache_bytes=kv_bytes,
        max_num_seqs=max_seqs, max_num_batched_tokens=8192, save_to_store=False, **extra,
    ))  # fmt: skip


def fill_context(engine, batch: int, context: int, max_tokens: int) -> None:
    """Queue `batch` requests of `context` distinct tokens and 'prefill' them without compute."""
    import torch

    from kvrelay.core.sampling import SamplingParams
    from kvrelay.workers.engine.model_runner import StepLogits

    engine.pool.reset_prefix_cache()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(context * 1000 + batch)
    for i in range(batch):
        ids = torch.randint(100, engine.vocab_size - 100, (context,), generator=g).tolist()
        engine.add_request(f"bd-{time.monotonic_ns()}-{i}", ids, sp)
    real_run = engine.runner.run
    vocab = engine.vocab_size
    engine.runner.run = lambda sched: StepLogits(
        torch.zeros(sum(1 for s in sched if s.samples), vocab)
    )
    try:
        firsts: set[str] = set()
        while len(firsts) < batch:
            firsts.update(o.request_id for o in engine.step())
    finally:
        engine.runner.run = real_run


def timed_steps(engine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t)
    return out


def measure(engine, batch: int, context: int, args: argparse.Namespace) -> dict:
    """Median plain and instrumented step times and the per-component ms per step."""
    clock = Clock()
    patches = Patches(engine, clock)
    per_round = args.steps
    fill_context(engine, batch, context, 2 + 2 * per_round * args.rounds + 4)
    timed_steps(engine, 2)  # warm-up: first decode steps allocate
    plain: list[float] = []
    instr: list[float] = []
    for _ in range(args.rounds):
        plain += timed_steps(engine, per_round)
        patches.install()
        try:
            instr += timed_steps(engine, per_round)
        finally:
            patches.remove()
    n = len(instr)
    while engine.has_unfinished_requests():  # the few tokens left: cheaper than aborting
        engine.step()
    ms = {k: v * 1000 / n for k, v in clock.totals.items()}
    step_ms = sum(instr) * 1000 / n
    inside = sum(ms.get(k, 0.0) for k in (*LINEARS, "lm_head", "attention", "write_kv",
                                         "rms_norm", "rope", "embedding"))  # fmt: skip
    parts = {k: ms.get(k, 0.0) for k in COLUMNS if k not in ("elementwise", "other")}
    parts["elementwise"] = ms.get("forward", 0.0) - inside
    parts["other"] = (
        step_ms
        - ms.get("forward", 0.0)
        - sum(ms.get(k, 0.0) for k in ("scheduler", "prepare", "sampler", "detokenizer"))
    )
    missing = [k for k in ("attention", "write_kv", "qkv", "sampler") if not clock.calls.get(k)]
    return {
        "batch": batch, "context": context, "steps": n,
        "step_ms_plain": round(statistics.median(plain) * 1000, 2),
        "step_ms_instrumented": round(statistics.median(instr) * 1000, 2),
        "tok_s_plain": round(batch / statistics.median(plain), 1),
        "ms": {k: round(v, 3) for k, v in parts.items()},
        "share": {k: round(v / step_ms, 4) for k, v in parts.items()},
        "not_called": missing,
    }  # fmt: skip


def _cpu_s(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_io(engine, batch: int, tokens: int) -> dict:
    """A real DecodeWorker (this process, embedded Valkey): CPU of its threads per engine step."""
    import shutil
    import tempfile
    import threading

    import redis
    import torch

    from benchmarks.common import start_valkey
    from kvrelay.core.keys import MESSAGE_FIELD, Keys
    from kvrelay.core.messages import DecodeTask
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.config import EngineConfig

    keys, data_dir = Keys("bd:"), tempfile.mkdtemp(prefix="bd-valkey-")
    valkey, url = start_valkey(data_dir, "--appendonly", "no")
    r = redis.Redis.from_url(url)
    engine.pool.reset_prefix_cache()
    config = WorkerConfig(redis_url=url, key_prefix="bd:", name="decode-bd", metrics_port=-1,
                          engine=EngineConfig(max_num_seqs=batch))  # fmt: skip
    worker = DecodeWorker(config, engine)
    compute = threading.Thread(target=worker.run, name="compute", daemon=True)
    compute.start()
    try:
        while not worker.emitter.thread.is_alive():
            time.sleep(0.01)
        time.sleep(0.3)
        named = {t.name.partition("-")[0]: t.native_id for t in threading.enumerate()
                 if t.name in ("compute", "reader-0", "emitter", "heartbeat")}  # fmt: skip

        def snapshot() -> dict[str, float]:
            cpu = {"valkey": _cpu_s(f"/proc/{valkey.pid}/stat")}
            tids = {int(t) for t in os.listdir("/proc/self/task")}
            for name, tid in named.items():
                cpu[name] = _cpu_s(f"/proc/self/task/{tid}/stat")
            others = tids - set(named.values()) - {threading.main_thread().native_id}
            cpu["torch threads"] = sum(_cpu_s(f"/proc/self/task/{t}/stat") for t in others
                                       if os.path.exists(f"/proc/self/task/{t}/stat"))  # fmt: skip
            return cpu

        g = torch.Generator().manual_seed(7)
        rids = [f"io-{time.monotonic_ns()}-{i}" for i in range(batch)]
        before, steps0, t0 = snapshot(), engine.stats.num_steps, time.perf_counter()
        sampling = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        for rid in rids:
            ids = torch.randint(100, engine.vocab_size - 100, (64,), generator=g).tolist()
            task = DecodeTask(request_id=rid, prompt_token_ids=ids, sampling=sampling)
            r.xadd(keys.decode_stream, {MESSAGE_FIELD: task.encode()})
        pending, deadline = set(rids), time.monotonic() + 900
        while pending:  # a slow poll: this thread's own CPU is not counted
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker IO probe: {len(pending)} requests unfinished")
            time.sleep(0.25)
            streams = next(iter(worker.lanes.values())).streams
            for rid in list(pending):
                if streams.emitted_tokens(rid)[2]:  # out:{id} and the tail: a final chunk
                    pending.discard(rid)
        wall, after = time.perf_counter() - t0, snapshot()
        steps = engine.stats.num_steps - steps0
    finally:
        worker.stop()
        compute.join(30)
        valkey.terminate()
        valkey.wait(10)
        shutil.rmtree(data_dir, ignore_errors=True)
    ms = {k: round((after[k] - before[k]) * 1000 / max(1, steps), 3) for k in after}
    io = sum(ms[k] for k in ("reader", "emitter", "heartbeat") if k in ms)
    return {
        "batch": batch,
        "tokens": tokens,
        "steps": steps,
        "wall_s": round(wall, 2),
        "cpu_ms_per_step": ms,
        "io_threads_ms_per_step": round(io, 3),
        "io_share_of_compute": round(io / ms["compute"], 4) if ms.get("compute") else None,
    }


def io_table(io: list[dict]) -> str:
    cols = ["compute", "reader", "emitter", "heartbeat", "torch threads", "valkey"]
    lines = ["| batch | steps | " + " | ".join(f"{c} ms/step" for c in cols)
             + " | IO threads / compute |", "|" + "---:|" * (len(cols) + 3)]  # fmt: skip
    for r in io:
        cells = [r["batch"], r["steps"]] + [r["cpu_ms_per_step"].get(c) for c in cols]
        cells.append(f"{100 * (r['io_share_of_compute'] or 0):.1f}%")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ["batch", "context", "step ms (plain)", "step ms (timed)"] + [f"{c} %" for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [r["batch"], r["context"], r["step_ms_plain"], r["step_ms_instrumented"]]
        cells += [f"{100 * r['share'][c]:.1f}" for c in COLUMNS]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def grouped(rows: list[dict]) -> str:
    """The issue's categories: linear, attention, norms/RoPE/elementwise, sampler, ..."""
    groups = {
        "linear (qkv+o+gate_up+down+lm_head)": ("qkv", "o", "gate_up", "down", "lm_head"),
        "attention + write_kv": ("attention", "write_kv"),
        "norms/RoPE/elementwise/embedding": ("rms_norm", "rope", "elementwise", "embedding"),
        "sampler": ("sampler",), "detokenizer": ("detokenizer",),
        "Python (scheduler, prepare, other)": ("scheduler", "prepare", "other"),
    }  # fmt: skip
    head = ["batch", "context", "tok/s"] + list(groups)
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [r["batch"], r["context"], r["tok_s_plain"]]
        cells += [f"{100 * sum(r['share'][k] for k in ks):.1f}%" for ks in groups.values()]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="64,512,2048")
    p.add_argument("--steps", type=int, default=5, help="steps per round and mode")
    p.add_argument("--rounds", type=int, default=2, help="alternations plain/instrumented")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-kv-gib", type=float, default=7.0, help="skip larger KV pools")
    p.add_argument(
        "--kernels",
        choices=("torch", "auto"),
        default="auto",
        help="torch: KVRELAY_KERNELS_CPU=torch (the torch attention path)",
    )
    p.add_argument("--quantization", default="none",
                   choices=QUANTIZATIONS)  # fmt: skip
    p.add_argument(
        "--worker-io",
        default="8",
        help="batches for the DecodeWorker IO-thread probe (empty: skip)",
    )
    p.add_argument("--worker-io-tokens", type=int, default=64)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--docs", type=Path, default=DOCS, help="markdown file to update")
    args = p.parse_args(argv)
    if args.kernels == "torch":
        os.environ["KVRELAY_KERNELS_CPU"] = "torch"
    else:
        os.environ.pop("KVRELAY_KERNELS_CPU", None)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    headroom = 8 + 2 * args.steps * args.rounds + 16  # decode tokens + a page of slack
    need = {(b, c): b * (c + headroom) * KV_BYTES_PER_TOKEN for b in batches for c in contexts}
    limit = int(args.max_kv_gib * (1 << 30))
    fits = [v for v in need.values() if v <= limit]
    if not fits:
        raise SystemExit(f"every combination needs more than --max-kv-gib {args.max_kv_gib}")
    machine = machine_line()
    io_batches = [int(b) for b in args.worker_io.split(",") if b]
    engine = make_engine(args, max(fits) + (64 << 20), max(batches + io_batches))
    rows, skipped = [], []
    for b in batches:
        for c in contexts:
            if need[(b, c)] > limit:
                skipped.append(f"batch {b} x context {c} ({need[(b, c)] / 2**30:.1f} GiB of KV)")
                print(f"skip {skipped[-1]}", file=sys.stderr)
                continue
            row = measure(engine, b, c, args)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    io = [worker_io(engine, b, args.worker_io_tokens) for b in io_batches]
    for row in io:
        print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"benchmark": "step_breakdown", "machine": machine, "threads": args.threads,
              "kernels": args.kernels, "quantization": args.quantization, "rows": rows,
              "skipped": skipped, "worker_io": io}  # fmt: skip
    print(json.dumps(result))
    text = grouped(rows) + "\n\n" + table(rows) + "\n\n" + io_table(io)
    print(text)
    if args.write_docs:
        cmd = "python benchmarks/step_breakdown.py " + " ".join(argv or sys.argv[1:])
        write_section("breakdown", "\n".join([
            f"## Decode step breakdown (in-process engine, CPU, {WEIGHTS[args.quantization]})", "",
            f"Command: `{cmd.strip()}`  ", f"Machine: {machine}  ",
            f"{args.threads} torch threads, kernels {args.kernels}, quantization "
            f"{args.quantization}; median of {args.steps * args.rounds} steps per mode, plain and "
            "timed steps alternating. Prefill skipped (zero KV for the context: same cost).", "",
            "Step ms: medians. Shares: of the mean timed step; each call's Python dispatch counts "
            "in its own component. `elementwise` = forward time outside the timed calls "
            "(residual adds, SiLU x up, slicing, RoPE table lookup); `other` = step time outside "
            "every timed part (engine bookkeeping, KV commit, logits copy).", "",
            grouped(rows), "", table(rows), "",
            "Worker IO threads: a real `DecodeWorker` in the benchmark process with an embedded "
            "Valkey, 64-token prompts, greedy; CPU time per engine step of each thread (from "
            "/proc, 10 ms ticks) and of the Valkey server.", "", io_table(io), "",
            "Skipped: " + ("; ".join(skipped) if skipped else "none") + ".",
        ]), doc=args.docs)  # fmt: skip
    bad = [r for r in rows if r["not_called"]]
    if bad:
        print(f"warning: components never called: {bad[0]['not_called']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
