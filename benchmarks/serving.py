"""Serving benchmark: the pipeline (`kvrelay up`, HTTP + Redis + workers) vs the in-process engine.

Closed loop at each concurrency (1, 8, 32 by default): every simulated user sends its next
request when the previous one finishes. Both sides get the same prompts, greedy sampling with
`ignore_eos` (fixed output length) and the same compute threads per engine. Reports TTFT and
inter-token latency (median, p90) and output tokens/s, and the pipeline/in-process ratios.

    python benchmarks/serving.py [--concurrency 1,8,32] [--max-tokens 32] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrelay.bench.datasets import Dataset, Session  # noqa: E402
from kvrelay.bench.request import RequestOptions, RequestRecord, Target  # noqa: E402
from kvrelay.bench.runner import Load  # noqa: E402
from kvrelay.bench.runner import run_load as bench_load  # noqa: E402
from kvrelay.bench.stats import Slo  # noqa: E402
from kvrelay.bench.stats import summarize as bench_summarize  # noqa: E402

MODEL = "smollm2-135m-instruct"
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- serving:start -->", "<!-- serving:end -->"


def prompts_for(n: int, salt: str) -> list[str]:
    topics = ["the sea", "mountains", "a city at night", "a robot", "a garden", "the moon",
              "a library", "winter"]  # fmt: skip
    return [f"[{salt}-{i}] Write a short poem about {topics[i % len(topics)]}." for i in range(n)]


def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
             ) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """`prompts` streamed to /v1/completions with `concurrency` in flight (kvrelay bench's loop)."""
    sessions = [Session(prompt=p) for p in prompts]
    target = Target("pipeline", url.rstrip("/"), model)
    opts = RequestOptions("completions", max_tokens, ignore_eos=True)
    load = Load(concurrency=concurrency, num_requests=len(prompts))
    dataset = Dataset("serving", lambda i: sessions[i])
    res = asyncio.run(bench_load(target, dataset, load, opts, 0, lambda _rec: None))
    return res.records, res.duration_s


def summarize(run: tuple[list[RequestRecord], float], concurrency: int) -> dict:
    """Median/p90 TTFT and ITL (per-request TPOT) in ms, output tokens/s, errors."""
    records, wall = run
    s = bench_summarize(records, wall, Slo(), server="", url="", mode="concurrency",
                        point=concurrency, rounds=1)  # fmt: skip
    return {
        "concurrency": concurrency, "requests": s.num_requests, "errors": s.num_errors,
        "ttft_ms_p50": s.ttft_ms.p50, "ttft_ms_p90": s.ttft_ms.p90,
        "itl_ms_p50": s.tpot_ms.p50, "itl_ms_p90": s.tpot_ms.p90,
        "output_tok_s": round(s.output_throughput, 2),
        "first_error": s.errors[0] if s.errors else None,
    }  # fmt: skip


def inprocess(engine, prompts: list[str], max_tokens: int, concurrency: int
              ) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """The same closed loop against an in-process Engine."""
    from kvrelay.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = [
        (f"ip-{time.monotonic_ns()}-{i}", engine.tokenizer.encode(p)) for i, p in enumerate(prompts)
    ]
    active: dict[str, tuple[RequestRecord, float, list[float]]] = {}
    results: list[RequestRecord] = []
    start = time.monotonic()

    def admit() -> None:
        while pending and len(active) < concurrency:
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, params)
            session = int(rid.rsplit("-", 1)[1])
            active[rid] = (RequestRecord("in-process", concurrency, 0, session, 0),
                           time.monotonic(), [])  # fmt: skip

    admit()
    while active:
        outs = engine.step()
        now = time.monotonic()
        for out in outs:
            res, t0, last = active[out.request_id]
            if res.output_tokens == 0:
                res.ttft_s = now - t0
            else:
                res.itl_s.append(now - last[0])
            last[:] = [now]
            res.output_tokens += len(out.new_token_ids)
            if out.finished:
                res.e2e_s = now - t0
                results.append(res)
                del active[out.request_id]
        admit()
    return results, time.monotonic() - start


def up(run_dir: Path, port: int, prefill: int, decode: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kvrelay.cli.main",
        "up",
        "--detach",
        "--run-dir",
        str(run_dir),
        "--port",
        str(port),
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"kvrelay up failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def down(run_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "down", "--run-dir", str(run_dir)],
        capture_output=True,
        timeout=120,
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| concurrency | mode | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | ITL p90 (ms) "
        "| output tok/s | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['ttft_ms_p50']} | "
            f"{r['ttft_ms_p90']} | {r['itl_ms_p50']} | {r['itl_ms_p90']} | "
            f"{r['output_tok_s']} | {r['errors']} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    for c in sorted({r["concurrency"] for r in rows}):
        p, e = by.get((c, "pipeline")), by.get((c, "in-process"))
        if not p or not e or not p["itl_ms_p50"] or not e["itl_ms_p50"]:
            continue
        out.append(
            {
                "concurrency": c,
                "itl_ratio": round(p["itl_ms_p50"] / e["itl_ms_p50"], 3),
                "ttft_overhead_ms": round(p["ttft_ms_p50"] - e["ttft_ms_p50"], 2),
                "throughput_ratio": round(p["output_tok_s"] / e["output_tok_s"], 3),
            }
        )
    return out


def write_docs(text: str) -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = f"{START}\n{text}\n{END}"
    if START in old:
        new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _m: block, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=None, help="per level (default 2x c, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs per level")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--port", type=int, default=18321)
    ap.add_argument("--url", default=None, help="use a running stack (give --threads too)")
    ap.add_argument("--threads", type=int, default=None, help="in-process engine threads")
    ap.add_argument("--write-docs", action="store_true", help=f"update {DOC.relative_to(ROOT)}")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    load = os.getloadavg()[0]

    run_dir = Path(tempfile.mkdtemp(prefix="kvrelay-bench-"))
    state = None if args.url else up(run_dir, args.port, args.prefill, args.decode)
    url = args.url or f"http://127.0.0.1:{args.port}"
    threads = args.threads or (state or {}).get("threads_per_worker") or 1
    rows: list[dict] = []
    try:
        run_load(url, MODEL, prompts_for(4, "warm"), args.max_tokens, 2)
        from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

        engine = Engine(EngineConfig(model=MODEL, num_threads=threads, kv_cache_bytes=512 << 20))
        inprocess(engine, prompts_for(4, "warm"), args.max_tokens, 2)
        for c in levels:
            n = args.requests or max(4, 2 * c)
            runs: dict[str, tuple[list[RequestRecord], float]] = {
                "pipeline": ([], 0.0), "in-process": ([], 0.0)}  # fmt: skip
            for rep in range(args.repeats):  # alternate the modes so load drift hits both
                prompts = prompts_for(n, f"c{c}r{rep}")
                for mode in runs:
                    if mode == "pipeline":
                        res, wall = run_load(url, MODEL, prompts, args.max_tokens, c)
                    else:
                        res, wall = inprocess(engine, prompts, args.max_tokens, c)
                    runs[mode] = (runs[mode][0] + res, runs[mode][1] + wall)
            for mode, run in runs.items():
                row = {"mode": mode, **summarize(run, c)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if state is not None:
            down(run_dir)
    rat = ratios(rows)
    print(json.dumps({"ratios": rat}))
    text = table(rows)
    print(text)
    if args.write_docs:
        meta = (
            f"## Serving: pipeline vs in-process engine\n\n`python benchmarks/serving.py` "
            f"({time.strftime('%Y-%m-%d')}): {args.prefill} prefill + {args.decode} decode "
            f"worker(s), {threads} compute thread(s) per engine, greedy, {args.max_tokens} "
            f"output tokens (ignore_eos), closed loop, {args.repeats} alternating run(s) per "
            "level. ITL = (latency - TTFT) / (tokens - 1). "
            f"Load average at start {load:.1f} on {os.cpu_count()} cores."
            "\n\n"
        )
        rtab = "\n".join(
            [
                "",
                "| concurrency | ITL ratio (pipeline / in-process) | TTFT "
                "overhead p50 (ms) | throughput ratio |",
                "|---:|---:|---:|---:|",
            ]
            + [
                f"| {r['concurrency']} | {r['itl_ratio']} | {r['ttft_overhead_ms']}"
                f" | {r['throughput_ratio']} |"
                for r in rat
            ]
        )
        write_docs(meta + text + "\n" + rtab)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
